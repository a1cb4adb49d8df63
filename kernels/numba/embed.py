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
from numba.extending import overload, register_jitable


# bfloat16 travels as its uint16 bit pattern and float16 as its int16 bit pattern (Numba has
# neither half type; the signedness is only a tag that picks the conversion at compile time):
# widened exactly and rounded to nearest-even on the way back, bit for bit as torch rounds.
# Kept in this file on purpose: Numba's disk cache only notices changes to the file that holds
# the kernel.
def _widen(value):
    """An element as a number to compute with: half bits -> float32, floats unchanged."""


def _narrow(array, value):
    """``value`` as an element of ``array``: float -> half bits for uint16/int16 arrays."""


@register_jitable
def _fp16_to_float32(value):
    """float16 bits (int16) -> float32, exactly. A plain jitted function rather than an inline
    overload body: Numba's inliner mishandles its branches (NumbaIRAssumptionWarning)."""
    h = np.uint32(np.uint16(value))
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exp = (h >> np.uint32(10)) & np.uint32(0x1F)
    mant = h & np.uint32(0x3FF)
    if exp == np.uint32(0):  # zero or subnormal: mant · 2^-24, exact in float32
        result = np.float32(mant) * np.float32(5.9604644775390625e-08)
        if sign:
            result = -result
    else:
        if exp == np.uint32(0x1F):  # inf, NaN (payload kept)
            bits = sign | np.uint32(0x7F800000) | (mant << np.uint32(13))
        else:  # normal: rebias the exponent 15 -> 127
            bits = sign | ((exp + np.uint32(112)) << np.uint32(23)) | (mant << np.uint32(13))
        result = np.uint32(bits).view(np.float32)
    return result


@overload(_widen, inline="always")
def _widen_impl(value):
    if value == types.uint16:
        return lambda value: np.uint32(np.uint32(value) << np.uint32(16)).view(np.float32)
    if value == types.int16:
        return lambda value: _fp16_to_float32(value)
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
    if array.dtype == types.int16:

        def to_fp16(array, value):
            bits = np.float32(value).view(np.uint32)
            sign = (bits >> np.uint32(16)) & np.uint32(0x8000)
            mag = bits & np.uint32(0x7FFFFFFF)
            if mag > np.uint32(0x7F800000):  # NaN stays a quiet NaN
                half = sign | np.uint32(0x7E00) | ((mag >> np.uint32(13)) & np.uint32(0x3FF))
            elif mag >= np.uint32(0x477FF000):  # >= 65520 rounds past 65504: inf
                half = sign | np.uint32(0x7C00)
            elif mag >= np.uint32(0x38800000):  # a normal half: rebias 127 -> 15, round 13 bits
                mag = mag - np.uint32(0x38000000)
                keep = (mag >> np.uint32(13)) & np.uint32(1)  # ties go to the even half
                half = sign | ((mag + np.uint32(0xFFF) + keep) >> np.uint32(13))
            else:  # a subnormal half (or zero): count units of 2^-24, round to nearest even
                exp = mag >> np.uint32(23)
                shift = np.uint32(126) - exp  # >= 14 here
                if shift > np.uint32(25) or exp == np.uint32(0):
                    half = sign  # below half the smallest subnormal (2^-25 itself ties to 0)
                else:
                    full = (mag & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
                    units = full >> shift
                    rest = full & ((np.uint32(1) << shift) - np.uint32(1))
                    middle = np.uint32(1) << (shift - np.uint32(1))
                    if rest > middle or (rest == middle and (units & np.uint32(1)) != 0):
                        units += np.uint32(1)  # may carry into the smallest normal: still right
                    half = sign | units
            return np.int16(np.uint16(half))

        return to_fp16
    return lambda array, value: value


PE_NONE, PE_SINUSOIDAL, PE_TABLE = 0, 1, 2


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


# Below this many output elements a call runs on the calling thread (a decode step embeds one
# token per sequence): a parallel region would only add its start, or a wait for a busy core.
SERIAL_ELEMENTS = 1 << 16

_embed_kernel = njit(parallel=True, cache=True)(_embed_numba)


def embed_numba(
    ids, weight, positions, *, scale, pe, pe_table=None, omega=None, interleaved=True,
    token_type_ids=None, token_type_weight=None,
):  # fmt: skip
    """ids, positions int64 [B, S]; weight [V, D] float32, float64, or the bits of bfloat16
    (uint16) or float16 (int16) (then pe_table / token_type_weight alike; computed in float32).
    Returns [B, S, D] in weight's dtype."""
    batch, seq = ids.shape
    dim = weight.shape[1]
    compute = np.float32 if weight.dtype in (np.uint16, np.int16) else weight.dtype
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
    kernel = _embed_kernel.serial if out.size <= SERIAL_ELEMENTS else _embed_kernel
    kernel(
        flat_ids, np.ascontiguousarray(weight), np.dtype(compute).type(scale), flat_pos, kind, table, *basis,
        has_types, type_ids, type_weight, out,
    )  # fmt: skip
    return out.reshape(batch, seq, dim)


# ---------------------------------------------------------------------------------------------
# Backward: the gradient of a row gather, out[r] = scale · Σ_{t : index[t] = r} grad[t].
# Tokens are sorted by row (stably) and each (row, column block) is summed by one iteration in
# token order: no two iterations write the same element (no atomics), and every sum is taken in
# the same order whatever the thread count, so the result is deterministic.


def _accumulate(out, src, first):
    """``out = src`` (``first``) or ``out += src``, src widened from half bits."""


@overload(_accumulate)
def _accumulate_impl(out, src, first):
    if src.dtype in (types.uint16, types.int16):

        def widening(out, src, first):
            if first:
                for c in range(out.size):
                    out[c] = _widen(src[c])
            else:
                for c in range(out.size):
                    out[c] += _widen(src[c])

        return widening

    # whole-slice operations: Numba vectorises these inside a prange body, where an indexed
    # scalar loop over a 2-D array ran ~4x slower
    def plain(out, src, first):
        if first:
            out[:] = src
        else:
            out += src

    return plain


def _scatter_rows_numba(order, starts, rows, grad, scale, acc, block):
    dim = grad.shape[1]
    blocks = (dim + block - 1) // block
    for item in prange(rows.size * blocks):
        g, first = item // blocks, (item % blocks) * block
        last = min(dim, first + block)
        out = acc[rows[g], first:last]
        for j in range(starts[g], starts[g + 1]):
            _accumulate(out, grad[order[j], first:last], j == starts[g])
        out *= scale


def _narrow_rows_numba(rows, acc, out):
    for g in prange(rows.size):
        r = rows[g]
        for c in range(acc.shape[1]):
            out[r, c] = _narrow(out, acc[r, c])


_scatter_rows_kernel = njit(parallel=True, cache=True)(_scatter_rows_numba)
_narrow_rows_kernel = njit(parallel=True, cache=True)(_narrow_rows_numba)


def scatter_rows_numba(index, grad, num_rows, scale=1.0):
    """The gradient of ``table[index]`` for a table of ``num_rows`` rows: index int [...],
    grad [..., D] float32, float64 or half bits (uint16 / int16, summed in float32 and rounded
    once). Returns [num_rows, D] in grad's dtype; rows no index names are zero."""
    import numba

    dim = grad.shape[-1]
    flat = np.ascontiguousarray(index, dtype=np.int64).reshape(-1)
    grad = grad.reshape(flat.size, dim)
    half = grad.dtype in (np.uint16, np.int16)
    compute = np.float32 if half else grad.dtype
    # zero pages from calloc: rows no token names are never written by this call
    acc = np.zeros((num_rows, dim), dtype=compute)
    order = np.argsort(flat, kind="stable")
    ordered = flat[order]
    first = np.ones(flat.size, dtype=bool)  # where a run of equal rows starts
    first[1:] = ordered[1:] != ordered[:-1]
    starts = np.flatnonzero(first)
    rows = ordered[starts]
    starts = np.append(starts, flat.size).astype(np.int64)
    # whole rows per iteration, unless there are too few rows to keep every thread busy (the
    # two token types of BERT): then column blocks of at least 64
    pieces = -(-4 * numba.get_num_threads() // max(rows.size, 1))
    block = max(64, -(-dim // pieces)) if pieces > 1 else max(dim, 1)
    small = grad.size <= SERIAL_ELEMENTS
    kernel = _scatter_rows_kernel.serial if small else _scatter_rows_kernel
    kernel(order.astype(np.int64), starts, rows, grad, np.dtype(compute).type(scale), acc, block)
    if not half:
        return acc
    out = np.zeros((num_rows, dim), dtype=grad.dtype)  # all-zero bits: +0.0 in both half types
    (_narrow_rows_kernel.serial if small else _narrow_rows_kernel)(rows, acc, out)
    return out
