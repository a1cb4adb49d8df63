"""Validated inputs of the serving ops: packed variable-length attention and KV-cache attention.

Kept apart from ``_inputs.py`` (same conventions, same helpers). Sequence boundaries
(``cu_seqlens``), cache lengths and block tables are read on the host once, here: every later
index computation trusts them, so these checks are what keeps the kernels inside their tensors.
On a GPU that read is one host sync per call (FlashAttention itself reads ``max_seqlen`` from
the caller instead; we check the values because a wrong boundary is an out-of-bounds access).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np

from fastpe import _arrays
from fastpe._arrays import Placement
from fastpe._inputs import (
    CAUSAL_ALIGNMENTS,
    _check_alibi,
    _check_sinks,
    _features,
    _Inputs,
    check_window,
)
from fastpe._options import Rope, check_rope_tables
from fastpe._validate import (
    check_bool,
    check_choice,
    check_float,
    check_float_array,
    check_int,
    check_int_array,
    check_range,
    check_same_placement,
)


def _host_ints(name: str, x, *, ndim: int) -> np.ndarray:
    x = check_int_array(name, x, ndim=ndim)
    return _arrays.to_int64(x)


def check_cu_seqlens(name: str, cu, total: int) -> np.ndarray:
    """``cu`` int32/int64 [B + 1]: starts at 0, non-decreasing, ends at ``total`` (the packed
    length). Returned as host int64."""
    cu_array = check_int_array(name, cu, ndim=1)
    if _arrays.dtype_name(cu_array) not in ("int32", "int64"):
        raise TypeError(f"{name} must be int32 or int64; got {_arrays.dtype_name(cu_array)}")
    values = _arrays.to_int64(cu_array)
    if values.shape[0] < 1:
        raise ValueError(f"{name} must have B + 1 >= 1 entries; got an empty array")
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0; got {name}[0] = {int(values[0])}")
    steps = np.diff(values)
    if (steps < 0).any():
        at = int(np.argmax(steps < 0)) + 1
        raise ValueError(
            f"{name} must be non-decreasing; got {name}[{at}] = {int(values[at])} < "
            f"{name}[{at - 1}] = {int(values[at - 1])}"
        )
    if values[-1] != total:
        raise ValueError(
            f"{name} must end at the packed length {total}; got {name}[-1] = {int(values[-1])}"
        )
    return values


def _check_max_seqlen(name: str, value, lengths: np.ndarray) -> int:
    longest = int(lengths.max(initial=0))
    if value is None:
        return longest
    value = check_int(name, value, minimum=0)
    if value < longest:
        raise ValueError(
            f"{name} = {value} is smaller than the longest sequence ({longest}); pass at least "
            f"{longest} or None"
        )
    return value


class PackedRope(NamedTuple):
    """Fused RoPE of a packed batch: tables and one host position per packed token."""

    cos: Any  # [P, R/2]
    sin: Any
    interleaved: bool
    q_positions: np.ndarray  # int64 [Tq]
    k_positions: np.ndarray  # int64 [Tk]

    @classmethod
    def build(cls, value, *, head_dim, q_default, k_default):
        Rope.check_keys(value)
        cos, sin = check_rope_tables("rope['", value["cos"], value["sin"], head_dim)
        rows = cos.shape[0]
        positions = []
        for key, default in (("q_positions", q_default), ("k_positions", k_default)):
            given = value.get(key)
            name = f"rope[{key!r}]"
            if given is None:
                pos = default
            else:
                if isinstance(given, (int, np.integer)):
                    raise TypeError(
                        f"{name} must be None (positions restart at each sequence) or an int "
                        f"array [{default.shape[0]}] of one position per packed token; got {given}"
                    )
                array = check_int_array(name, given, ndim=(1, 2))
                pos = _arrays.to_int64(array).reshape(-1)
                if array.ndim == 2 and array.shape[0] != 1 or pos.shape != default.shape:
                    raise ValueError(
                        f"{name} must have shape [{default.shape[0]}] (one per packed token); "
                        f"got {tuple(array.shape)}"
                    )
            check_range(name, pos, 0, rows, what=f"(rope cos/sin have {rows} rows)")
            positions.append(pos)
        return cls(
            cos, sin, check_bool("rope['interleaved']", value.get("interleaved", False)), *positions
        )


def _default_positions(cu: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """Per packed token: its index within its sequence plus that sequence's shift, clamped at 0."""
    lengths = np.diff(cu)
    index = np.arange(cu[-1]) - np.repeat(cu[:-1], lengths)
    return np.maximum(index + np.repeat(shift, lengths), 0)


def _check_dtype_and_dims(named: dict) -> str:
    dtypes = {name: _arrays.dtype_name(x) for name, x in named.items()}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{n}: {d}" for n, d in dtypes.items())
        raise TypeError(f"{', '.join(named)} must share one dtype; got {listing}")
    return next(iter(dtypes.values()))


def _check_heads(q_name, hq, k_name, hkv):
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"{q_name} heads ({hq}) must be a multiple of {k_name} heads ({hkv}) for "
            "grouped-query attention"
        )


@dataclass(frozen=True, eq=False)
class AttentionVarlenInputs(_Inputs):
    op: ClassVar[str] = "attention_varlen"
    q: Any  # [Tq, Hq, D]
    k: Any  # [Tk, Hkv, D]
    v: Any  # [Tk, Hkv, Dv]
    cu_q: np.ndarray  # host int64 [B + 1]
    cu_k: np.ndarray
    max_seqlen_q: int
    max_seqlen_k: int
    scale: float
    causal: bool
    bottom_right: bool
    rope: PackedRope | None
    alibi_slopes: Any  # [B, Hq] or None
    window: tuple[int, int] | None
    softcap: float | None
    sinks: Any
    return_lse: bool
    dtype: str
    placement: Placement

    @property
    def batch(self) -> int:
        return self.cu_q.shape[0] - 1

    @property
    def q_lengths(self) -> np.ndarray:
        return np.diff(self.cu_q)

    @property
    def k_lengths(self) -> np.ndarray:
        return np.diff(self.cu_k)

    @property
    def features(self) -> frozenset[str]:
        return _features(
            causal=self.causal,
            gqa=self.q.shape[1] != self.k.shape[1],
            rope=self.rope is not None,
            alibi=self.alibi_slopes is not None,
            window=self.window is not None,
            softcap=self.softcap is not None,
            sinks=self.sinks is not None,
            lse=self.return_lse,
            value_dim_differs=self.q.shape[2] != self.v.shape[2],
        )

    @classmethod
    def build(
        cls, q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, causal,
        causal_alignment, scale, rope, alibi_slopes, window, softcap, sinks, return_lse,
    ):  # fmt: skip
        q = check_float_array("q", q, ndim=3)
        k = check_float_array("k", k, ndim=3)
        v = check_float_array("v", v, ndim=3)
        dtype = _check_dtype_and_dims({"q": q, "k": k, "v": v})
        total_q, hq, d = q.shape
        total_k, hkv = k.shape[0], k.shape[1]
        if k.shape[2] != d:
            raise ValueError(f"k's head dim {k.shape[2]} must equal q's head dim {d}")
        if tuple(v.shape[:2]) != (total_k, hkv):
            raise ValueError(
                f"v must be [total_k, Hkv, Dv] matching k's {tuple(k.shape[:2])}; "
                f"got {tuple(v.shape)}"
            )
        _check_heads("q", hq, "k/v", hkv)
        if d == 0:
            raise ValueError(f"head_dim must be >= 1; got q of shape {tuple(q.shape)}")
        cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q)
        cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k)
        if cu_q.shape != cu_k.shape:
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must both have B + 1 entries; got "
                f"{cu_q.shape[0]} and {cu_k.shape[0]}"
            )
        batch = cu_q.shape[0] - 1
        q_len, k_len = np.diff(cu_q), np.diff(cu_k)
        bottom_right = (
            check_choice("causal_alignment", causal_alignment, CAUSAL_ALIGNMENTS) == "bottom_right"
        )
        packed_rope = None
        if rope is not None:
            shift = k_len - q_len if bottom_right else np.zeros(batch, np.int64)
            packed_rope = PackedRope.build(
                rope, head_dim=d, q_default=_default_positions(cu_q, shift),
                k_default=_default_positions(cu_k, np.zeros(batch, np.int64)),
            )  # fmt: skip
        alibi_slopes = None if alibi_slopes is None else _check_alibi(alibi_slopes, batch, hq)
        sinks = None if sinks is None else _check_sinks(sinks, hq)
        placement = check_same_placement(
            {
                "q": q,
                "k": k,
                "v": v,
                "cu_seqlens_q": _arrays.as_array(cu_seqlens_q),
                "cu_seqlens_k": _arrays.as_array(cu_seqlens_k),
                "rope['cos']": None if packed_rope is None else packed_rope.cos,
                "rope['sin']": None if packed_rope is None else packed_rope.sin,
                "alibi_slopes": alibi_slopes,
                "sinks": sinks,
            }
        )
        return cls(
            q=q,
            k=k,
            v=v,
            cu_q=cu_q,
            cu_k=cu_k,
            max_seqlen_q=_check_max_seqlen("max_seqlen_q", max_seqlen_q, q_len),
            max_seqlen_k=_check_max_seqlen("max_seqlen_k", max_seqlen_k, k_len),
            scale=1.0 / math.sqrt(d) if scale is None else check_float("scale", scale),
            causal=check_bool("causal", causal),
            bottom_right=bottom_right,
            rope=packed_rope,
            alibi_slopes=alibi_slopes,
            window=check_window(window),
            softcap=None if softcap is None else check_float("softcap", softcap, positive=True),
            sinks=sinks,
            return_lse=check_bool("return_lse", return_lse),
            dtype=dtype,
            placement=placement,
        )
