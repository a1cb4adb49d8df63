"""Typed records for the structured options of the ops: ``Positions``, ``Rope``,
``RelativeBias``, and ``AttentionOptions``, the options every attention op shares.

They are named tuples on purpose: a kernel launcher unpacks them like the plain tuples it is
documented to take (``fastpe.kernels`` never imports ``fastpe``), and the torch custom-op layer
flattens them into schema arguments and rebuilds them (``fastpe.torch_ops``).
Each ``build`` validates a user's value once and names the argument in every error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from fastpe import _arrays
from fastpe._validate import (
    MAX_POSITION,
    check_bool,
    check_choice,
    check_finite,
    check_float,
    check_float_array,
    check_int,
    check_int_array,
    check_position,
    check_range,
    is_int_scalar,
)


class Positions(NamedTuple):
    """Row indices into a table for every (batch, seq) slot: ``offset + s``, or ``array``.

    The pair ``(array or None, offset)`` is also the form kernels and the torch op schema take.
    """

    array: Any = None  # None, or an integer array [S] or [B, S] in the caller's framework
    offset: int = 0

    @classmethod
    def build(cls, name: str, value, batch: int, seq: int, limit: int | None, what: str, like):
        """None -> 0 + s; int -> offset + s; int array [S], [B, S] or [1, S]; all in
        [0, limit). A Python list becomes an array in the framework and device of ``like``."""
        if isinstance(value, (list, tuple)):
            value = _arrays.array_like(value, like)
        if value is None or is_int_scalar(value):
            offset = 0 if value is None else check_int(name, value, minimum=0)
            check_position(name, offset, count=seq)
            if limit is not None and offset + seq > limit:
                raise IndexError(
                    f"{name}: positions {offset} … {offset + seq - 1} are needed but {what} has "
                    f"only {limit} rows; pass a longer table or smaller {name}"
                )
            return cls(offset=offset)
        array = check_int_array(name, value, ndim=(1, 2))
        # [1, S] is what transformers passes as position_ids for a whole batch
        expected = [(seq,), (batch, seq), (1, seq)]
        if tuple(array.shape) not in expected:
            raise ValueError(
                f"{name} must be an int offset or an int array of shape [S]={expected[0]}, "
                f"[B, S]={expected[1]} or [1, S]={expected[2]}; got shape {tuple(array.shape)}"
            )
        if limit is not None:
            check_range(name, array, 0, limit, what=f"({what} has {limit} rows)")
        elif _arrays.on_gpu(array):  # on the device, without a host sync
            check_range(name, array, 0, MAX_POSITION)
        elif (_arrays.min_max(array) or (0, 0))[0] < 0:  # a negative row: IndexError, as tables
            check_range(name, array, 0, MAX_POSITION)
        if limit is None or limit > MAX_POSITION:  # else implied by the row check
            check_position(name, array)  # the supported range: ValueError
        if array.ndim == 2 and tuple(array.shape) != (batch, seq):
            array = _arrays.broadcast_to(array, (batch, seq))
        return cls(array=array)

    @staticmethod
    def flatten(name: str, value, device) -> tuple:
        """The public value as the torch op schema's (tensor or None, offset or None), the same
        values the eager path accepts (a list becomes a tensor on ``device``)."""
        if isinstance(value, np.generic) or isinstance(value, np.ndarray) and value.ndim == 0:
            value = value.item()  # the schema takes a Python int, not np.int64
        if value is None or isinstance(value, int):
            if value is not None:  # the eager check, before int64 must hold it
                check_position(name, value)
            return None, value
        if isinstance(value, (list, tuple)):  # as eagerly: a list takes the tensors' device
            import torch

            value = torch.as_tensor(value, device=device)
        if not _arrays.is_tensor(value):
            raise TypeError(
                f"all arrays must be NumPy arrays or all torch tensors on one device; got {name}: "
                f"{type(value).__name__} with torch tensors"
            )
        return value, None

    @staticmethod
    def unflatten(tensor, offset):
        """The schema's (tensor or None, offset or None) -> the public value."""
        return offset if tensor is None else tensor

    def as_int64(self, batch: int, seq: int) -> np.ndarray:
        """[B, S] int64 NumPy array of the positions (for the oracle and the CPU kernels)."""
        if self.array is None:
            return np.broadcast_to(np.arange(self.offset, self.offset + seq), (batch, seq))
        values = _arrays.to_int64(self.array)
        # build() already broadcast [1, S] to [B, S]; np.broadcast_to costs a decode step µs
        return values if values.shape == (batch, seq) else np.broadcast_to(values, (batch, seq))

    def on_device(self, device) -> Positions:
        """The same positions with the array as an int64 tensor on ``device`` (GPU kernels)."""
        if self.array is None:
            return self
        import torch

        array = self.array
        if not _arrays.is_tensor(array):
            array = torch.from_numpy(np.asarray(array))
        return Positions(array.to(device=device, dtype=torch.int64), self.offset)


def check_rope_tables(prefix: str, cos, sin, head_dim: int):
    """cos/sin [P, R/2] with 2 <= R <= head_dim; ``prefix`` names them in errors."""
    cos = check_float_array(f"{prefix}cos", cos, ndim=2)
    sin = check_float_array(f"{prefix}sin", sin, ndim=2)
    if tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(
            f"{prefix}cos and {prefix}sin must have the same shape [P, R/2]; "
            f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    rotary_dim = 2 * cos.shape[1]
    if rotary_dim == 0 or rotary_dim > head_dim:
        raise ValueError(
            f"{prefix}cos/sin have R/2 = {cos.shape[1]} columns, so rotary dim R = {rotary_dim}; "
            f"it must be in [2, head_dim = {head_dim}] (tables hold half the rotary dim, not "
            "duplicated halves)"
        )
    return cos, sin


class Rope(NamedTuple):
    """RoPE fused into attention: tables, pairing, and the positions of queries and keys (an
    offset or an array in the caller's framework for ``attention``; host int64 arrays, one
    position per packed token or [B, S], for the serving ops)."""

    cos: Any  # [P, R/2]
    sin: Any
    interleaved: bool
    q_positions: Positions
    k_positions: Positions

    KEYS = frozenset({"cos", "sin", "interleaved", "q_positions", "k_positions"})

    @classmethod
    def check_keys(cls, value) -> None:
        """The structure of the public dict (its values are checked by ``build``)."""
        if not isinstance(value, Mapping):
            raise TypeError(f"rope must be None or a dict(cos=, sin=, ...); got {type(value)}")
        if set(value) - cls.KEYS or "cos" not in value or "sin" not in value:
            raise ValueError(
                "rope must be a dict with keys cos, sin and optionally interleaved, "
                f"q_positions, k_positions; got keys {sorted(value)}"
            )

    @classmethod
    def _tables(cls, value, head_dim: int):
        cls.check_keys(value)
        cos, sin = check_rope_tables("rope['", value["cos"], value["sin"], head_dim)
        return cos, sin, check_bool("rope['interleaved']", value.get("interleaved", False))

    @classmethod
    def build(cls, value, *, head_dim: int, batch: int, sq: int, sk: int, q_positions):
        """From the public ``rope=dict(cos=, sin=, interleaved=False, q_positions=None,
        k_positions=None)``; ``q_positions`` is the default for queries (an offset or array)."""
        cos, sin, interleaved = cls._tables(value, head_dim)
        rows = cos.shape[0]
        q_positions = value.get("q_positions", q_positions)
        return cls(
            cos,
            sin,
            interleaved,
            *(
                Positions.build(f"rope[{key!r}]", given, batch, seq, rows, "rope cos/sin", cos)
                for key, given, seq in (
                    ("q_positions", q_positions, sq),
                    ("k_positions", value.get("k_positions"), sk),
                )
            ),
        )

    @classmethod
    def build_packed(cls, value, *, head_dim: int, q_default, k_default):
        """A packed batch's: one host int64 position per packed token (``*_default``: where
        the caller gives none, as from ``attention_varlen``'s sequence starts)."""
        cos, sin, interleaved = cls._tables(value, head_dim)
        rows = cos.shape[0]
        positions = []
        for key, default in (("q_positions", q_default), ("k_positions", k_default)):
            given = value.get(key)
            name = f"rope[{key!r}]"
            if given is None:
                pos = default
            else:
                if is_int_scalar(given):
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
            positions.append(Positions(pos))
        return cls(cos, sin, interleaved, *positions)

    # the torch op schema's arguments for the public ``rope=`` dict (fastpe.torch_ops)
    SCHEMA = (
        "Tensor? rope_cos, Tensor? rope_sin, bool rope_interleaved, "
        "Tensor? rope_q_positions, int? rope_q_positions_offset, "
        "Tensor? rope_k_positions, int? rope_k_positions_offset"
    )

    @classmethod
    def flatten(cls, value, device) -> tuple:
        """The public ``rope=`` dict (or None) as ``SCHEMA``'s values."""
        if value is None:
            return None, None, False, None, None, None, None
        cls.check_keys(value)
        return (
            value["cos"],
            value["sin"],
            check_bool("rope['interleaved']", value.get("interleaved", False)),
            *Positions.flatten("rope['q_positions']", value.get("q_positions"), device),
            *Positions.flatten("rope['k_positions']", value.get("k_positions"), device),
        )

    @classmethod
    def unflatten(cls, values) -> dict | None:
        """``SCHEMA``'s values -> the public ``rope=`` dict (or None)."""
        cos, sin, interleaved, q_tensor, q_offset, k_tensor, k_offset = values
        if cos is None and sin is None:
            return None
        rope = {"cos": cos, "sin": sin, "interleaved": interleaved}
        for key, tensor, offset in (
            ("q_positions", q_tensor, q_offset),
            ("k_positions", k_tensor, k_offset),
        ):
            if tensor is not None or offset is not None:  # absent: the op's default positions
                rope[key] = Positions.unflatten(tensor, offset)
        return rope

    def arrays(self) -> dict:
        """The arrays it holds, by the name users know them by (for placement checks)."""
        return {
            "rope['cos']": self.cos,
            "rope['sin']": self.sin,
            "rope['q_positions']": self.q_positions.array,
            "rope['k_positions']": self.k_positions.array,
        }


class RelativeBias(NamedTuple):
    """T5's learned relative-position bias: ``table[bucket(j - query position), h]``.

    The defaults are T5's (and the only place they are written down).
    """

    table: Any  # [num_buckets, Hq]
    num_buckets: int = 32
    max_distance: int = 128
    bidirectional: bool = True

    @classmethod
    def check_keys(cls, value) -> None:
        """The structure of the public dict (its values are checked by ``build``)."""
        if not isinstance(value, Mapping):
            raise TypeError(f"relative_bias must be None or a dict(table=, ...); got {type(value)}")
        if set(value) - set(cls._fields) or "table" not in value:
            raise ValueError(
                "relative_bias must be a dict with key table and optionally num_buckets, "
                f"max_distance, bidirectional; got keys {sorted(value)}"
            )

    @classmethod
    def build(cls, value, *, heads: int) -> RelativeBias:
        """From the public ``relative_bias=dict(table=, num_buckets=, max_distance=,
        bidirectional=)``."""
        cls.check_keys(value)
        defaults = cls._field_defaults
        buckets = check_int(
            "relative_bias['num_buckets']",
            value.get("num_buckets", defaults["num_buckets"]),
            minimum=2,
        )
        bidirectional = check_bool(
            "relative_bias['bidirectional']", value.get("bidirectional", defaults["bidirectional"])
        )
        max_exact = buckets // (4 if bidirectional else 2)
        if max_exact < 1:
            raise ValueError(
                f"relative_bias['num_buckets'] = {buckets} is too small: needs >= 4 when "
                "bidirectional, >= 2 otherwise"
            )
        max_distance = check_int(
            "relative_bias['max_distance']", value.get("max_distance", defaults["max_distance"])
        )
        if max_distance <= max_exact:  # the logarithmic buckets span max_exact … max_distance
            raise ValueError(
                f"relative_bias['max_distance'] must be >= {max_exact + 1} (num_buckets = "
                f"{buckets} uses {max_exact} exact distances); got {max_distance}"
            )
        table = check_float_array("relative_bias['table']", value["table"], ndim=2)
        if tuple(table.shape) != (buckets, heads):
            raise ValueError(
                f"relative_bias['table'] must have shape [num_buckets, Hq] = "
                f"[{buckets}, {heads}]; got {tuple(table.shape)}"
            )
        check_finite("relative_bias['table']", table)
        return cls(table, buckets, max_distance, bidirectional)


# A window side at least this wide reaches every key of any sequence that can exist: it is
# unbounded, and the op schema of fastpe.torch_ops (int64) can carry every window after this.
UNBOUNDED_WINDOW = 2**62


def check_window(window, *, span: int | None = None, name: str = "window"):
    """None or (left, right) of integers >= -1 (-1 = unbounded); None when both are unbounded.

    A side that reaches every key is unbounded as well, so kernels never compute with huge
    values (``query position ± window`` overflowed int64 and masked every key): a side >=
    ``span``, the op's largest distance between a query and a key plus one, or >=
    ``UNBOUNDED_WINDOW`` when the shapes are not known yet (fastpe.torch_ops checks the window
    before it enters the op schema). ``name`` is the argument's public name."""
    if window is None:
        return None
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        raise TypeError(
            f"{name} must be None or a pair (left, right) of integers >= -1; got {window!r}"
        )
    limit = UNBOUNDED_WINDOW if span is None else min(span, UNBOUNDED_WINDOW)
    left, right = (
        -1 if side >= limit else side
        for side in (
            check_int(f"{name}[{index}]", value, minimum=-1) for index, value in enumerate(window)
        )
    )
    return None if (left, right) == (-1, -1) else (left, right)


def check_softcap(softcap):
    """None, or a positive finite float (scores become ``c·tanh(score / c)``)."""
    return None if softcap is None else check_float("softcap", softcap, positive=True)


def check_sinks(sinks, heads: int, name: str = "sinks"):
    """[Hq] float, finite; errors name ``name`` (fastpe.flash_attn's ``s_aux``)."""
    sinks = check_float_array(name, sinks)
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"{name} must have shape [Hq] = [{heads}]; got {tuple(sinks.shape)}")
    check_finite(name, sinks)
    return sinks


def check_alibi(alibi_slopes, batch: int, heads: int):
    """[Hq] or [B, Hq], finite; returned broadcast to [B, Hq] (a view)."""
    alibi_slopes = check_float_array("alibi_slopes", alibi_slopes)
    if tuple(alibi_slopes.shape) not in [(heads,), (batch, heads)]:
        raise ValueError(
            f"alibi_slopes must have shape [Hq] = [{heads}] or [B, Hq] = [{batch}, {heads}]; "
            f"got {tuple(alibi_slopes.shape)}"
        )
    check_finite("alibi_slopes", alibi_slopes)
    return _arrays.broadcast_to(alibi_slopes, (batch, heads))


CAUSAL_ALIGNMENTS = ("bottom_right", "top_left")


class AttentionOptions(NamedTuple):
    """The options of every attention op (dense, packed, KV cache) and of their backward,
    validated once. The records hold it whole, the backends hand it to the launchers through
    ``launched`` and the torch ops carry it as ``SCHEMA``, so a new option is: a field
    here, its check in ``build``, its schema argument (``SCHEMA``, ``flatten``, ``unflatten``),
    its entry in ``FEATURES`` (and ``ARRAYS`` for an array), and its use in the launchers,
    kernels and the oracle — plus the public keyword (docs/extending.md)."""

    scale: float
    causal: bool = False
    bottom_right: bool = True  # query i sits at key position i + Sk - Sq (else at i)
    window: tuple[int, int] | None = None  # (left, right), -1 = unbounded; None when both are
    softcap: float | None = None
    sinks: Any = None  # float [Hq]
    alibi_slopes: Any = None  # float broadcast to [B, Hq]
    rope: Rope | None = None
    return_lse: bool = False

    # field -> the feature a capability table names when the option is in use
    FEATURES = {
        "causal": "causal",
        "window": "window",
        "softcap": "softcap",
        "sinks": "sinks",
        "alibi_slopes": "alibi",
        "rope": "rope",
        "return_lse": "lse",
    }
    # the fields that hold arrays in the caller's framework (placement, launcher conversions)
    ARRAYS = ("sinks", "alibi_slopes")
    # not launcher arguments: each backend applies fused RoPE itself (rotating q and k first, or
    # handing the Triton forward its tables), and the kernels always compute the lse
    _NOT_LAUNCHED = ("rope", "return_lse")

    # The torch custom ops' schema arguments for the public options (fastpe.torch_ops): the
    # record itself is built inside each op, where the shapes and values are known. return_lse
    # is not among them: the ops always return the lse (the backward needs it).
    SCHEMA = (
        "bool causal, str causal_alignment, float? scale, int window_left, int window_right, "
        f"float? softcap, Tensor? sinks, Tensor? alibi_slopes, {Rope.SCHEMA}"
    )
    SCHEMA_NAMES = tuple(argument.split()[-1] for argument in SCHEMA.split(", "))

    @classmethod
    def flatten(
        cls,
        device,
        *,
        causal=False,
        causal_alignment="bottom_right",
        scale=None,
        window=None,
        softcap=None,
        sinks=None,
        alibi_slopes=None,
        rope=None,
    ) -> tuple:
        """The public keyword options as ``SCHEMA``'s values. Checked here: what the schema's
        types would otherwise refuse with torch's errors, which name the schema's argument and
        not the caller's; the rest is validated once, by ``build`` inside the op."""
        left, right = check_window(window) or (-1, -1)
        return (
            check_bool("causal", causal),
            check_choice("causal_alignment", causal_alignment, CAUSAL_ALIGNMENTS),
            None if scale is None else float(scale),
            left,
            right,
            check_softcap(softcap),
            sinks,
            alibi_slopes,
            *Rope.flatten(rope, device),
        )

    @classmethod
    def unflatten(cls, values) -> dict:
        """``SCHEMA``'s values -> the public keyword options ``build`` takes."""
        causal, causal_alignment, scale, left, right, softcap, sinks, alibi_slopes, *rope = values
        return dict(
            causal=causal,
            causal_alignment=causal_alignment,
            scale=scale,
            window=(left, right),
            softcap=softcap,
            sinks=sinks,
            alibi_slopes=alibi_slopes,
            rope=Rope.unflatten(rope),
        )

    @classmethod
    def build(
        cls,
        *,
        scale,
        causal,
        causal_alignment,
        alibi_slopes,
        rope,
        return_lse,
        window=None,
        softcap=None,
        sinks=None,
        head_dim: int,
        heads: int,
        batch: int,
        span: int,
        build_rope: Callable[[Any, AttentionOptions], Rope],
    ) -> AttentionOptions:
        """From the public keyword options of an attention op on q of ``heads`` heads of
        ``head_dim``. ``span``: one more than the largest distance between a query and a key of
        one sequence (a wider window side reaches every key). ``build_rope(value, options)``:
        the op's ``Rope`` from its public fused-RoPE value, given the other options (default
        positions follow the alignment, the window)."""
        options = cls(
            scale=1.0 / math.sqrt(head_dim) if scale is None else check_float("scale", scale),
            causal=check_bool("causal", causal),
            bottom_right=(
                check_choice("causal_alignment", causal_alignment, CAUSAL_ALIGNMENTS)
                == "bottom_right"
            ),
            window=check_window(window, span=span),
            softcap=check_softcap(softcap),
            sinks=None if sinks is None else check_sinks(sinks, heads),
            alibi_slopes=None if alibi_slopes is None else check_alibi(alibi_slopes, batch, heads),
            return_lse=check_bool("return_lse", return_lse),
        )
        return options if rope is None else options._replace(rope=build_rope(rope, options))

    def features(self) -> frozenset[str]:
        return frozenset(
            feature
            for field, feature in self.FEATURES.items()
            if getattr(self, field) is not None and getattr(self, field) is not False
        )

    def arrays(self) -> dict:
        """The option arrays by their public names, for the placement check (fused RoPE's
        arrays are named by each op: ``attention_kvcache`` calls its tables ``rotary_cos``)."""
        return {name: getattr(self, name) for name in self.ARRAYS}

    def launched(self, convert: Callable) -> AttentionOptions:
        """The record a kernel launcher takes as ``options``: the same values, each option
        array passed through the backend's ``convert``. Launchers read the fields they apply
        (``scale``, ``causal``, ``bottom_right``, ``window``, ``softcap``, ``sinks``,
        ``alibi_slopes``); fused RoPE and ``return_lse`` are the backends' concern."""
        converted = {
            name: convert(getattr(self, name))
            for name in self.ARRAYS
            if getattr(self, name) is not None
        }
        return self._replace(**converted) if converted else self  # no copy of a plain call's

    def keywords(self) -> dict:
        """The launched fields as keyword arguments (the NumPy oracle's ``reference.attention``
        takes the options so)."""
        return {
            name: getattr(self, name) for name in self._fields if name not in self._NOT_LAUNCHED
        }
