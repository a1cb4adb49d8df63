"""Fused token embedding + positional encoding (+ token type) on the CPU (Numba), one pass.

Logical shapes: ids, positions, token types [B·S]; weight [V, D]; pe_table [P, D];
token_type_weight [T, D] -> out [B·S, D].
out[t] = scale · weight[ids[t]] + PE(positions[t]) [+ token_type_weight[tt[t]]], in weight's dtype
(float32 sums stay within a few ulp; the PE term within 2.5e-7 of the exact value at any
position). The sinusoidal PE is computed on the fly (no table is read) by angle addition from
small bases in column order (see ``_angles.gather_basis``): one hi row per block of positions
actually present, so the cost follows the token count, not the span of the positions; ids and
positions were range-checked upstream.
"""

from __future__ import annotations

import numpy as np
from fastpe.kernels.numba._angles import gather_basis
from fastpe.kernels.numba._runtime import njit
from numba import prange, types
from numba.extending import overload


# bfloat16 travels as its uint16 bit pattern (Numba has no bfloat16): widened exactly with << 16
# and rounded to nearest-even on the way back. Kept in this file on purpose: Numba's disk cache
# only notices changes to the file that holds the kernel.
def _widen(value):
    """An element as a number to compute with: bf16 bits -> float32, floats unchanged."""


def _narrow(array, value):
    """``value`` as an element of ``array``: float -> bf16 bits for uint16 arrays."""


@overload(_widen, inline="always")
def _widen_impl(value):
    if value == types.uint16:
        return lambda value: np.uint32(np.uint32(value) << np.uint32(16)).view(np.float32)
    return lambda value: value


@overload(_narrow, inline="always")
def _narrow_impl(array, value):
    if array.dtype == types.uint16:

        def to_bf16(array, value):
            bits = np.float32(value).view(np.uint32)
            if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN stays a quiet NaN
                return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
            keep = (bits >> np.uint32(16)) & np.uint32(1)  # ties go to the even bf16
            return np.uint16((bits + np.uint32(0x7FFF) + keep) >> np.uint32(16))

        return to_bf16
    return lambda array, value: value


PE_NONE, PE_SINUSOIDAL, PE_TABLE = 0, 1, 2


@njit(parallel=True, cache=True)
def _embed_numba(
    ids, weight, scale, positions, pe_kind, pe_table, block, p0, hi_row, hi_a, hi_b, lo_x, lo_y,
    has_types, type_ids, type_weight, out,
):  # fmt: skip
    tokens, dim = out.shape
    for t in prange(tokens):
        row = ids[t]
        tt = type_ids[t] if has_types else 0
        p = positions[t]
        hi, lo = hi_row[t], (p - p0) % block
        for c in range(dim):
            value = scale * _widen(weight[row, c])
            if has_types:
                value += _widen(type_weight[tt, c])
            if pe_kind == PE_SINUSOIDAL:
                value += hi_a[hi, c] * lo_x[lo, c] + hi_b[hi, c] * lo_y[lo, c]
            elif pe_kind == PE_TABLE:
                value += _widen(pe_table[p, c])
            out[t, c] = _narrow(out, value)


def embed_numba(
    ids, weight, positions, *, scale, pe, pe_table=None, omega=None, interleaved=True,
    token_type_ids=None, token_type_weight=None,
):  # fmt: skip
    """ids, positions int64 [B, S]; weight [V, D] float32, float64 or uint16 holding bfloat16
    bits (then pe_table / token_type_weight alike; computed in float32). Returns [B, S, D] in
    weight's dtype."""
    batch, seq = ids.shape
    dim = weight.shape[1]
    compute = np.float32 if weight.dtype == np.uint16 else weight.dtype
    flat_ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    flat_pos = np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)
    out = np.empty((batch * seq, dim), dtype=weight.dtype)
    unused = np.zeros((1, 1), dtype=compute)
    basis = (1, 0, np.zeros(flat_pos.size, dtype=np.int64), unused, unused, unused, unused)
    kind = PE_NONE
    if pe == "sinusoidal":
        kind = PE_SINUSOIDAL
        if flat_pos.size:
            basis = gather_basis(flat_pos, omega, interleaved, compute)
    table = np.zeros((1, 1), dtype=weight.dtype)
    if pe == "table":
        kind, table = PE_TABLE, np.ascontiguousarray(pe_table)
    has_types = token_type_ids is not None
    type_ids = (
        np.ascontiguousarray(token_type_ids, dtype=np.int64).reshape(-1)
        if has_types
        else np.zeros(1, dtype=np.int64)
    )
    type_weight = (
        np.ascontiguousarray(token_type_weight) if has_types else np.zeros((1, 1), weight.dtype)
    )
    _embed_numba(
        flat_ids, np.ascontiguousarray(weight), np.dtype(compute).type(scale), flat_pos, kind, table, *basis,
        has_types, type_ids, type_weight, out,
    )  # fmt: skip
    return out.reshape(batch, seq, dim)
