"""Typed records for the structured options of the ops: ``Positions``, ``Rope`` and
``RelativeBias``.

They are named tuples on purpose: a kernel launcher unpacks them like the plain tuples it is
documented to take (``fastpe.kernels`` never imports ``fastpe``), and the torch custom-op layer
flattens them into schema arguments and rebuilds them (``fastpe.torch_ops``).
Each ``build`` validates a user's value once and names the argument in every error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from fastpe import _arrays
from fastpe._validate import (
    MAX_POSITION,
    check_bool,
    check_finite,
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
        elif (_arrays.min_max(array) or (0, 0))[0] < 0:  # a negative row: IndexError, as tables
            check_range(name, array, 0, MAX_POSITION)
        if limit is None or limit > MAX_POSITION:  # else implied by the row check
            check_position(name, array)  # the supported range: ValueError
        if array.ndim == 2:
            array = _arrays.broadcast_to(array, (batch, seq))
        return cls(array=array)

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
    """RoPE fused into attention: tables, pairing, and the positions of queries and keys."""

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
    def build(cls, value, *, head_dim: int, batch: int, sq: int, sk: int, q_positions):
        """From the public ``rope=dict(cos=, sin=, interleaved=False, q_positions=None,
        k_positions=None)``; ``q_positions`` is the default for queries (an offset or array)."""
        cls.check_keys(value)
        cos, sin = check_rope_tables("rope['", value["cos"], value["sin"], head_dim)
        rows = cos.shape[0]
        q_positions = value.get("q_positions", q_positions)
        return cls(
            cos=cos,
            sin=sin,
            interleaved=check_bool("rope['interleaved']", value.get("interleaved", False)),
            q_positions=Positions.build(
                "rope['q_positions']", q_positions, batch, sq, rows, "rope cos/sin", cos
            ),
            k_positions=Positions.build(
                "rope['k_positions']",
                value.get("k_positions"),
                batch,
                sk,
                rows,
                "rope cos/sin",
                cos,
            ),
        )

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
