"""One frozen record of validated, normalised inputs per op (after xformers' fmha ``Inputs``).

Each public op builds its record once; the dispatcher reads it to choose a backend and the
backend reads it to launch a kernel. Nothing downstream re-validates user input. Arrays keep
their framework, device and dtype; scalars are normalised to plain Python values.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from fastpe import _arrays
from fastpe._arrays import Placement
from fastpe._options import AttentionOptions, Positions, RelativeBias, Rope, check_rope_tables
from fastpe._validate import (
    MAX_DIM,
    MAX_POSITION,
    _skip_device_values,
    check_bool,
    check_choice,
    check_device_data,
    check_float,
    check_float_array,
    check_int,
    check_int_array,
    check_position,
    check_range,
    check_same_placement,
)

LAYOUTS = ("interleaved", "concat")
FREQS = ("paper", "tensor2tensor")
ROPE_LAYOUTS = ("bhsd", "bshd")
PE_KINDS = ("sinusoidal", "table", None)


def _check_sinusoidal_dim(name: str, dim: int, freq: str) -> None:
    if dim % 2:
        raise ValueError(
            f"{name} must be even for a sinusoidal encoding (sin/cos pairs); got {dim}"
        )
    if freq == "tensor2tensor" and dim < 4:
        raise ValueError(f"{name} must be >= 4 with freq='tensor2tensor' (ω divides by dim/2 - 1)")


def _check_offset(offset, num_positions: int) -> int:
    """A table's first position: an int with the whole table inside the supported range."""
    offset = check_int("offset", offset, minimum=0)
    check_position("offset", offset)
    # the last position, offset + num_positions - 1, must be supported too: named by the count
    check_int("num_positions", num_positions, maximum=MAX_POSITION - offset)
    return offset


def _table_record(cls, device, dtype, **fields):
    """A table op's record: its checked fields, then the placement ``device`` names and the
    dtype normalised for it."""
    placement = _arrays.resolve_device(device)
    return cls(**fields, dtype=_arrays.normalize_dtype(dtype, placement), placement=placement)


def _features(**flags: bool) -> frozenset[str]:
    return frozenset(name for name, on in flags.items() if on)


class _Inputs:
    """What the dispatcher reads from every record: ``op``, ``placement``, ``dtype``, and the
    optional features a capability table may lack (none, unless an op says otherwise)."""

    op: ClassVar[str]

    @property
    def features(self) -> frozenset[str]:
        return frozenset()


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class SinusoidalTableInputs(_Inputs):
    op: ClassVar[str] = "sinusoidal_table"
    num_positions: int
    dim: int
    base: float
    layout: str
    freq: str
    offset: int
    dtype: str
    placement: Placement

    @classmethod
    def build(cls, num_positions, dim, *, base, layout, freq, offset, dtype, device):
        num_positions = check_int("num_positions", num_positions, minimum=0)
        dim = check_int("dim", dim, minimum=2, maximum=MAX_DIM)
        layout = check_choice("layout", layout, LAYOUTS)
        freq = check_choice("freq", freq, FREQS)
        _check_sinusoidal_dim("dim", dim, freq)
        return _table_record(
            cls,
            device,
            dtype,
            num_positions=num_positions,
            dim=dim,
            base=check_float("base", base, positive=True),
            layout=layout,
            freq=freq,
            offset=_check_offset(offset, num_positions),
        )


@dataclass(frozen=True, eq=False)
class RopeTableInputs(_Inputs):
    op: ClassVar[str] = "rope_table"
    num_positions: int
    inv_freq: np.ndarray  # float64 [R/2]
    attention_factor: float
    offset: int
    dtype: str
    placement: Placement

    @classmethod
    def build(cls, num_positions, rotary_dim, *, base, scaling, offset, dtype, device):
        from fastpe.rope_scaling import rope_inv_freq

        num_positions = check_int("num_positions", num_positions, minimum=0)
        offset = _check_offset(offset, num_positions)
        # dynamic NTK and longrope pick their parameters from the longest position in the table
        inv_freq, attention_factor = rope_inv_freq(
            rotary_dim, base=base, scaling=scaling, seq_len=offset + num_positions
        )
        return _table_record(
            cls,
            device,
            dtype,
            num_positions=num_positions,
            inv_freq=inv_freq,
            attention_factor=attention_factor,
            offset=offset,
        )


@dataclass(frozen=True, eq=False)
class ApplyRopeInputs(_Inputs):
    op: ClassVar[str] = "apply_rope"
    x: Any
    cos: Any
    sin: Any
    positions: Positions
    interleaved: bool
    layout: str  # "bhsd" | "bshd"
    inplace: bool
    dtype: str
    placement: Placement
    # rotate by -θ: the gradient w.r.t. x, from the output's gradient as x (set by torch_ops)
    inverse: bool = False

    @property
    def batch(self) -> int:
        return self.x.shape[0]

    @property
    def heads(self) -> int:
        return self.x.shape[1 if self.layout == "bhsd" else 2]

    @property
    def seq(self) -> int:
        return self.x.shape[2 if self.layout == "bhsd" else 1]

    @property
    def head_dim(self) -> int:
        return self.x.shape[3]

    @property
    def rotary_dim(self) -> int:
        return 2 * self.cos.shape[1]

    @property
    def features(self) -> frozenset[str]:
        return _features(inplace=self.inplace, position_array=self.positions.array is not None)

    @classmethod
    def build(cls, x, cos, sin, *, positions, interleaved, layout, inplace):
        x = check_float_array("x", x, ndim=4)
        layout = check_choice("layout", layout, ROPE_LAYOUTS)
        cos, sin = check_rope_tables("", cos, sin, x.shape[3])
        inplace = check_bool("inplace", inplace)
        if inplace:
            _check_writable(x)
        batch = x.shape[0]
        seq = x.shape[2 if layout == "bhsd" else 1]
        pos = Positions.build("positions", positions, batch, seq, cos.shape[0], "cos/sin", x)
        placement = check_same_placement({"x": x, "cos": cos, "sin": sin, "positions": pos.array})
        return cls(
            x=x,
            cos=cos,
            sin=sin,
            positions=pos,
            interleaved=check_bool("interleaved", interleaved),
            layout=layout,
            inplace=inplace,
            dtype=_arrays.dtype_name(x),
            placement=placement,
        )

    def with_x(self, x) -> ApplyRopeInputs:
        """The record of another array of the same call (``apply_rope((q, k), ...)``, whose
        batch and sequence the caller checked): only what depends on x is checked again — its
        dtype, rank, head dim, writability and placement; tables, positions and options are
        this record's."""
        x = check_float_array("x", x, ndim=4)
        if self.rotary_dim > x.shape[3]:  # the only table check that depends on x
            check_rope_tables("", self.cos, self.sin, x.shape[3])
        if self.inplace:
            _check_writable(x)
        placement = _arrays.placement_of(x)
        if placement != self.placement:
            check_same_placement({"x[0]": self.x, "x": x})
        # a copy with three fields changed: dataclasses.replace re-runs __init__ on every field,
        # a visible part of a one-token call
        record = object.__new__(type(self))
        record.__dict__.update(self.__dict__, x=x, dtype=_arrays.dtype_name(x), placement=placement)
        return record


def _check_writable(x) -> None:
    """``inplace=True``: x can be written, and writing one element changes no other."""
    if not _arrays.is_tensor(x) and not x.flags.writeable:
        raise ValueError("inplace=True needs a writeable x; got a read-only NumPy array")
    if _arrays.may_overlap(x):
        raise ValueError(
            f"inplace=True needs an x whose elements occupy distinct memory; got shape "
            f"{tuple(x.shape)} with strides {_arrays.strides(x)} (an expanded or as_strided "
            "view, whose shared rows would be rotated more than once); pass x.contiguous() "
            "or inplace=False"
        )


@dataclass(frozen=True, eq=False)
class EmbedInputs(_Inputs):
    op: ClassVar[str] = "embed"
    ids: Any  # int [B, S]
    weight: Any  # [V, D]
    positions: Positions
    pe: str | None
    pe_table: Any  # [P, D] or None
    scale: float
    base: float
    layout: str
    freq: str
    token_type_ids: Any  # int [B, S] or None
    token_type_weight: Any  # [T, D] or None
    dtype: str
    placement: Placement

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    @property
    def seq(self) -> int:
        return self.ids.shape[1]

    @property
    def dim(self) -> int:
        return self.weight.shape[1]

    @property
    def features(self) -> frozenset[str]:
        return _features(
            pe_sinusoidal=self.pe == "sinusoidal",
            pe_table=self.pe == "table",
            token_types=self.token_type_ids is not None,
            position_array=self.positions.array is not None,
        )

    @classmethod
    def build(
        cls,
        ids,
        weight,
        *,
        positions,
        pe,
        pe_table,
        scale,
        base,
        layout,
        freq,
        token_type_ids,
        token_type_weight,
    ):
        ids = check_int_array("ids", ids, ndim=2)
        weight = check_float_array("weight", weight, ndim=2)
        vocab, dim = weight.shape
        batch, seq = ids.shape
        pe = check_choice("pe", pe, PE_KINDS)
        layout = check_choice("layout", layout, LAYOUTS)
        freq = check_choice("freq", freq, FREQS)
        limit = None
        if pe == "table":
            if pe_table is None:
                raise ValueError("pe='table' needs pe_table=[num_positions, D]")
            pe_table = check_float_array("pe_table", pe_table, ndim=2)
            if pe_table.shape[1] != dim:
                raise ValueError(
                    f"pe_table must have D = {dim} columns like weight; got shape "
                    f"{tuple(pe_table.shape)}"
                )
            limit = pe_table.shape[0]
        elif pe_table is not None:
            raise ValueError(f"pe_table is only read with pe='table'; got pe={pe!r}")
        if pe == "sinusoidal":
            _check_sinusoidal_dim("weight's embedding dim", dim, freq)
        if (token_type_ids is None) != (token_type_weight is None):
            raise ValueError("token_type_ids and token_type_weight must be given together")
        if token_type_ids is not None:
            token_type_ids = check_int_array("token_type_ids", token_type_ids, ndim=2)
            if tuple(token_type_ids.shape) != (batch, seq):
                raise ValueError(
                    f"token_type_ids must have the shape of ids {(batch, seq)}; "
                    f"got {tuple(token_type_ids.shape)}"
                )
            token_type_weight = check_float_array("token_type_weight", token_type_weight, ndim=2)
            if token_type_weight.shape[1] != dim:
                raise ValueError(
                    f"token_type_weight must have D = {dim} columns like weight; "
                    f"got shape {tuple(token_type_weight.shape)}"
                )
            check_range("token_type_ids", token_type_ids, 0, token_type_weight.shape[0])
        check_range("ids", ids, 0, vocab, what=f"(weight has {vocab} rows)")
        pos = Positions.build("positions", positions, batch, seq, limit, "pe_table", weight)
        placement = check_same_placement(
            {
                "ids": ids,
                "weight": weight,
                "pe_table": pe_table,
                "positions": pos.array,
                "token_type_ids": token_type_ids,
                "token_type_weight": token_type_weight,
            }
        )
        return cls(
            ids=ids,
            weight=weight,
            positions=pos,
            pe=pe,
            pe_table=pe_table,
            scale=check_float("scale", scale),
            base=check_float("base", base, positive=True),
            layout=layout,
            freq=freq,
            token_type_ids=token_type_ids,
            token_type_weight=token_type_weight,
            dtype=_arrays.dtype_name(weight),
            placement=placement,
        )


@dataclass(frozen=True, eq=False)
class EmbedBackwardInputs(_Inputs):
    """The gradients of one ``embed`` call (docs/math.md#gradients): the forward call's record,
    the gradient of its output, and which of weight / pe_table / token_type_weight to return."""

    op: ClassVar[str] = "embed_backward"
    forward: EmbedInputs
    grad: Any  # [B, S, D] in the output's (weight's) dtype
    need_weight: bool
    need_pe_table: bool
    need_token_type_weight: bool
    dtype: str
    placement: Placement

    @classmethod
    def build(cls, forward: EmbedInputs, grad, *, weight, pe_table, token_type_weight):
        grad = check_float_array("grad", grad, ndim=3)
        expected = (forward.batch, forward.seq, forward.dim)
        if tuple(grad.shape) != expected:
            raise ValueError(
                f"grad must have the output's shape {expected}; got {tuple(grad.shape)}"
            )
        if _arrays.dtype_name(grad) != forward.dtype:
            raise TypeError(
                f"grad must have the output's dtype {forward.dtype}; got {_arrays.dtype_name(grad)}"
            )
        placement = check_same_placement({"weight": forward.weight, "grad": grad})
        return cls(
            forward=forward,
            grad=grad,
            need_weight=bool(weight),
            need_pe_table=bool(pe_table) and forward.pe == "table",
            need_token_type_weight=bool(token_type_weight) and forward.token_type_ids is not None,
            dtype=forward.dtype,
            placement=placement,
        )


@dataclass(frozen=True, eq=False)
class AttentionInputs(_Inputs):
    op: ClassVar[str] = "attention"
    q: Any  # [B, Hq, Sq, D]
    k: Any  # [B, Hkv, Sk, D]
    v: Any  # [B, Hkv, Sk, Dv]
    mask: Any  # None, or bool (True = attend) / float (added) broadcast to [B, Hq, Sq, Sk]
    key_lengths: Any  # int [B] or None
    relative_bias: RelativeBias | None
    options: AttentionOptions
    dtype: str
    placement: Placement

    @property
    def shape(self) -> tuple[int, int, int, int, int, int, int]:
        """(B, Hq, Hkv, Sq, Sk, D, Dv)."""
        b, hq, sq, d = self.q.shape
        return b, hq, self.k.shape[1], sq, self.k.shape[2], d, self.v.shape[3]

    @property
    def mask_is_bool(self) -> bool:
        return self.mask is not None and _arrays.dtype_name(self.mask) == "bool"

    @property
    def features(self) -> frozenset[str]:
        b, hq, hkv, sq, sk, d, dv = self.shape
        return self.options.features() | _features(
            bool_mask=self.mask_is_bool,
            additive_mask=self.mask is not None and not self.mask_is_bool,
            key_lengths=self.key_lengths is not None,
            gqa=hq != hkv,
            relative_bias=self.relative_bias is not None,
            value_dim_differs=d != dv,
        )

    @classmethod
    def build(cls, q, k, v, *, mask, key_lengths, relative_bias, **options):
        """``options``: the public keywords of ``AttentionOptions.build``."""
        q, k, v = _check_qkv(q, k, v)
        b, hq, sq, d = q.shape
        sk = k.shape[2]
        key_lengths = None if key_lengths is None else _check_key_lengths(key_lengths, b, sk)

        def build_rope(value, options):
            default = _default_query_positions(options.bottom_right, key_lengths, sq, sk)
            return Rope.build(value, head_dim=d, batch=b, sq=sq, sk=sk, q_positions=default)

        options = AttentionOptions.build(
            **options,
            head_dim=d,
            heads=hq,
            batch=b,
            # query positions lie in [-Sq, Sk) (bottom-right with key_lengths), keys in [0, Sk)
            span=sq + sk,
            build_rope=build_rope,
        )
        relative_bias = (
            None if relative_bias is None else RelativeBias.build(relative_bias, heads=hq)
        )
        mask = None if mask is None else _check_mask(mask, (b, hq, sq, sk))
        placement = check_same_placement(
            {
                "q": q,
                "k": k,
                "v": v,
                "mask": mask,
                "key_lengths": key_lengths,
                **(options.rope.arrays() if options.rope else {}),
                **options.arrays(),
                "relative_bias['table']": None if relative_bias is None else relative_bias.table,
            }
        )
        return cls(
            q=q,
            k=k,
            v=v,
            mask=mask,
            key_lengths=key_lengths,
            relative_bias=relative_bias,
            options=options,
            dtype=_arrays.dtype_name(q),
            placement=placement,
        )


def _default_query_positions(bottom_right: bool, key_lengths, sq: int, sk: int):
    """Fused RoPE's query positions when the caller gives none: the positions the alignment
    puts the queries at (docs/math.md#fused-rope). bottom_right: the last Sq of each sequence's
    keys, ``L_b - Sq + i`` with ``L_b = key_lengths[b]`` (or Sk); clamped at 0, for queries in
    front of a sequence shorter than Sq (they see no key under the causal rule)."""
    if not bottom_right:
        return 0
    if key_lengths is None:
        return max(sk - sq, 0)
    if _arrays.on_gpu(key_lengths):  # computed where the lengths live: no host round trip
        torch = sys.modules["torch"]
        steps = torch.arange(sq, device=key_lengths.device)
        return (key_lengths.to(torch.int64)[:, None] - sq + steps[None, :]).clamp_(min=0)
    lengths = _arrays.to_int64(key_lengths)
    positions = np.maximum(lengths[:, None] - sq + np.arange(sq)[None, :], 0)
    return _arrays.array_like(positions, key_lengths)


def _check_qkv(q, k, v):
    """q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] of one float dtype, Hkv | Hq."""
    q = check_float_array("q", q, ndim=4)
    k = check_float_array("k", k, ndim=4)
    v = check_float_array("v", v, ndim=4)
    dtypes = {_arrays.dtype_name(t) for t in (q, k, v)}
    if len(dtypes) > 1:
        raise TypeError(f"q, k and v must share one dtype; got {sorted(dtypes)}")
    b, hq, sq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(
            f"q, k, v must share batch size B; got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}"
        )
    hkv = k.shape[1]
    if k.shape[3] != d:
        raise ValueError(f"k's head dim {k.shape[3]} must equal q's head dim {d}")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(
            f"v must be [B, Hkv, Sk, Dv] matching k's {tuple(k.shape[:3])}; got {tuple(v.shape)}"
        )
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"q heads ({hq}) must be a multiple of k/v heads ({hkv}) for grouped-query attention"
        )
    if d == 0:
        raise ValueError("head_dim must be >= 1; got q of shape " + str(tuple(q.shape)))
    return q, k, v


def _check_mask(mask, full: tuple[int, int, int, int]):
    """bool or float, broadcastable to [B, Hq, Sq, Sk]; returned broadcast to it (a view)."""
    mask = _arrays.as_array(mask)
    mask_dtype = _arrays.dtype_name(mask)
    if mask_dtype != "bool" and not _arrays.is_float_dtype(mask_dtype):
        raise TypeError(
            f"mask must be bool (True = may attend) or float (added to scores); got {mask_dtype}"
        )
    try:
        ok = mask.ndim <= 4 and np.broadcast_shapes(tuple(mask.shape), full) == full
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to [B, Hq, Sq, Sk] = {list(full)}"
        )
    if mask_dtype != "bool" and (check_device_data() or not _arrays.on_gpu(mask)):
        # one reduction, no copy: the max of a mask is NaN if it holds a NaN, +inf if a +inf.
        # (On a GPU reading it back would be a host sync per call: there, as in torch SDPA, a
        # NaN in the mask gives NaN rows unless FASTPE_CHECK_DEVICE_DATA=1 —
        # docs/dtypes-and-errors.md.)
        top = _arrays.max_value(mask)
        if top is not None and (math.isnan(top) or top == math.inf):
            raise ValueError("mask (additive) must not contain NaN or +inf; use -inf to block")
    return _arrays.broadcast_to(mask, full)


def _check_key_lengths(key_lengths, batch: int, sk: int):
    key_lengths = check_int_array("key_lengths", key_lengths, ndim=1)
    if tuple(key_lengths.shape) != (batch,):
        raise ValueError(
            f"key_lengths must have shape [B] = [{batch}]; got {tuple(key_lengths.shape)}"
        )
    check_range("key_lengths", key_lengths, 0, sk + 1, what=f"(Sk = {sk})")
    return key_lengths


@dataclass(frozen=True, eq=False)
class MergeAttentionInputs(_Inputs):
    op: ClassVar[str] = "merge_attention"
    out_a: Any  # [B, H, S, D]
    lse_a: Any  # [B, H, S] float
    out_b: Any
    lse_b: Any
    dtype: str
    placement: Placement

    @classmethod
    def build(cls, out_a, lse_a, out_b, lse_b):
        out_a = check_float_array("out_a", out_a, ndim=4)
        out_b = check_float_array("out_b", out_b, ndim=4)
        if tuple(out_a.shape) != tuple(out_b.shape):
            raise ValueError(
                f"out_a and out_b must have the same shape; got {tuple(out_a.shape)} and "
                f"{tuple(out_b.shape)}"
            )
        if _arrays.dtype_name(out_a) != _arrays.dtype_name(out_b):
            raise TypeError(
                f"out_a and out_b must share a dtype; got {_arrays.dtype_name(out_a)} and "
                f"{_arrays.dtype_name(out_b)}"
            )
        for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
            lse = check_float_array(name, lse, ndim=3)
            if tuple(lse.shape) != tuple(out_a.shape[:3]):
                raise ValueError(
                    f"{name} must have shape [B, H, S] = {list(out_a.shape[:3])}; "
                    f"got {tuple(lse.shape)}"
                )
            if _skip_device_values(lse):
                # as the finite checks of ALiBi slopes: a NaN gives NaN rows, no stray access
                continue
            top = _arrays.max_value(lse)  # a reduction, no host copy: NaN or +inf if any
            if top is not None and (math.isnan(top) or top == math.inf):
                raise ValueError(f"{name} must not contain NaN or +inf (-inf marks an empty row)")
        lse_a, lse_b = _arrays.as_array(lse_a), _arrays.as_array(lse_b)
        placement = check_same_placement(
            {"out_a": out_a, "lse_a": lse_a, "out_b": out_b, "lse_b": lse_b}
        )
        return cls(out_a, lse_a, out_b, lse_b, _arrays.dtype_name(out_a), placement)


@dataclass(frozen=True, eq=False)
class MergeAttentionBackwardInputs(_Inputs):
    """The gradients of one ``merge_attention`` call (docs/math.md#merge-gradients): its
    validated forward record and the gradients of its (out, lse)."""

    op: ClassVar[str] = "merge_attention_backward"
    forward: MergeAttentionInputs
    grad_out: Any  # [B, H, S, Dv] in the output's dtype
    grad_lse: Any  # [B, H, S] float
    dtype: str
    placement: Placement

    @classmethod
    def build(cls, forward: MergeAttentionInputs, grad_out, grad_lse):
        grad_out = check_float_array("grad_out", grad_out, ndim=4)
        grad_lse = check_float_array("grad_lse", grad_lse, ndim=3)
        for name, grad, shape in (
            ("grad_out", grad_out, forward.out_a.shape),
            ("grad_lse", grad_lse, forward.out_a.shape[:3]),
        ):
            if tuple(grad.shape) != tuple(shape):
                raise ValueError(
                    f"{name} must have the output's shape {tuple(shape)}; got {tuple(grad.shape)}"
                )
        placement = check_same_placement(
            {"out_a": forward.out_a, "grad_out": grad_out, "grad_lse": grad_lse}
        )
        return cls(forward, grad_out, grad_lse, forward.dtype, placement)


@dataclass(frozen=True, eq=False)
class _AttentionGradients(_Inputs):
    """The gradients of one attention call: its validated forward record, the forward's
    results (out, and lse in float32) and the gradients of those results (grad_lse None: zero).
    The backward needs the forward's features, less the lse output it reads rather than makes."""

    forward: Any
    grad_out: Any
    grad_lse: Any
    out: Any
    lse: Any
    dtype: str
    placement: Placement

    @property
    def features(self) -> frozenset[str]:
        return self.forward.features - {"lse"}


@dataclass(frozen=True, eq=False)
class AttentionBackwardInputs(_AttentionGradients):
    """The gradients of one attention call (docs/math.md#attention-backward): grad_out, out
    [B, Hq, Sq, Dv]; grad_lse, lse [B, Hq, Sq]."""

    op: ClassVar[str] = "attention_backward"

    @classmethod
    def build(cls, forward: AttentionInputs, *, grad_out, grad_lse, out, lse):
        b, hq, hkv, sq, sk, d, dv = forward.shape
        shapes = {
            "grad_out": (b, hq, sq, dv),
            "out": (b, hq, sq, dv),
            "lse": (b, hq, sq),
            "grad_lse": (b, hq, sq),
        }
        arrays = {"grad_out": grad_out, "out": out, "lse": lse, "grad_lse": grad_lse}
        for name, x in arrays.items():
            if x is None and name == "grad_lse":
                continue
            x = arrays[name] = check_float_array(name, x, ndim=len(shapes[name]))
            if tuple(x.shape) != shapes[name]:
                raise ValueError(
                    f"{name} must have shape {list(shapes[name])} (from q, k, v); "
                    f"got {tuple(x.shape)}"
                )
        placement = check_same_placement({"q": forward.q, **arrays})
        return cls(forward=forward, **arrays, dtype=forward.dtype, placement=placement)
