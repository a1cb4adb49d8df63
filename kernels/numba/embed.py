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

import numba
import numpy as np
from fastpe.kernels.numba._angles import gather_basis
from fastpe.kernels.numba._half import _narrow, _widen
from fastpe.kernels.numba._runtime import njit, read_only
from numba import prange, types
from numba.extending import overload

PE_NONE, PE_SINUSOIDAL, PE_TABLE = 0, 1, 2


def _row_sum(out, t, scratch):
    """Where token t's row is summed: out's row itself, or for half out the float32 scratch."""


@overload(_row_sum, inline="always")
def _row_sum_impl(out, t, scratch):
    if out.dtype in (types.uint16, types.int16):
        return lambda out, t, scratch: scratch
    return lambda out, t, scratch: out[t]


def _store_row(out, t, total):
    """Round a half row from its float32 sum (nothing to do for float out: summed in place)."""


@overload(_store_row, inline="always")
def _store_row_impl(out, t, total):
    if out.dtype in (types.uint16, types.int16):

        def store(out, t, total):
            row = out[t]
            for c in range(row.size):
                row[c] = _narrow(out, total[c])

        return store
    return lambda out, t, total: None


def _embed_numba(
    ids,
    weight,
    scale,
    positions,
    pe_kind,
    pe_table,
    block,
    p0,
    hi_row,
    hi_a,
    hi_b,
    lo_x,
    lo_y,
    has_types,
    type_ids,
    type_weight,
    out,
    scratch,
):
    """``scratch`` [chunks, D] in the compute dtype: one row sum per chunk of tokens. Each term
    is added to the row in its own loop over D, in the order of the formula (the same float
    operations as one loop), so that every loop vectorises."""
    tokens, dim = out.shape
    chunks = scratch.shape[0]
    for chunk in prange(chunks):
        for t in range(chunk * tokens // chunks, (chunk + 1) * tokens // chunks):
            total = _row_sum(out, t, scratch[chunk])
            w = weight[ids[t]]
            for c in range(dim):
                total[c] = scale * _widen(w[c])
            if has_types:
                tw = type_weight[type_ids[t]]
                for c in range(dim):
                    total[c] += _widen(tw[c])
            p = positions[t]
            if pe_kind == PE_SINUSOIDAL:
                a, b = hi_a[hi_row[t]], hi_b[hi_row[t]]
                lo = (p - p0) % block
                x, y = lo_x[lo], lo_y[lo]
                for c in range(dim):
                    total[c] += a[c] * x[c] + b[c] * y[c]
            elif pe_kind == PE_TABLE:
                pe = pe_table[p]
                for c in range(dim):
                    total[c] += _widen(pe[c])
            _store_row(out, t, total)


# Below this many output elements a call runs on the calling thread (a decode step embeds one
# token per sequence): a parallel region would only add its start, or a wait for a busy core.
SERIAL_ELEMENTS = 1 << 16

_embed_kernel = njit(parallel=True, cache=True)(_embed_numba)


def embed_numba(
    ids,
    weight,
    positions,
    *,
    scale,
    pe,
    pe_table=None,
    omega=None,
    interleaved=True,
    token_type_ids=None,
    token_type_weight=None,
):
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
    serial = out.size <= SERIAL_ELEMENTS
    kernel = _embed_kernel.serial if serial else _embed_kernel
    chunks = 1 if serial else max(1, min(out.shape[0], 8 * numba.get_num_threads()))
    kernel(
        read_only(flat_ids),
        read_only(np.ascontiguousarray(weight)),
        np.dtype(compute).type(scale),
        read_only(flat_pos),
        kind,
        read_only(table),
        *(read_only(a) if isinstance(a, np.ndarray) else a for a in basis),
        has_types,
        read_only(type_ids),
        read_only(type_weight),
        out,
        np.empty((chunks, dim), dtype=compute),
    )
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
