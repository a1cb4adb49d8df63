"""Fused token embedding + positional encoding (+ token type) on the CPU (Numba), one pass.

Logical shapes: ids, positions, token types [B·S]; weight [V, D]; pe_table [P, D];
token_type_weight [T, D] -> out [B·S, D].
out[t] = scale · weight[ids[t]] + PE(positions[t]) [+ token_type_weight[tt[t]]], in weight's dtype
(float32 sums stay within a few ulp; the PE term within 2.5e-7 of the float64 truth). The sinusoidal PE is computed on the fly (no table is read) by angle addition
from two small float64 bases in column order (see ``_angles``); ids and positions were
range-checked upstream.
"""

from __future__ import annotations

import numpy as np
from fastpe.kernels.numba._angles import column_basis
from numba import njit, prange

PE_NONE, PE_SINUSOIDAL, PE_TABLE = 0, 1, 2


@njit(parallel=True, cache=True)
def _embed_numba(
    ids, weight, scale, positions, pe_kind, pe_table, block, p0, hi_a, hi_b, lo_x, lo_y,
    has_types, type_ids, type_weight, out,
):  # fmt: skip
    tokens, dim = out.shape
    for t in prange(tokens):
        row = ids[t]
        tt = type_ids[t] if has_types else 0
        p = positions[t]
        hi, lo = (p - p0) // block, (p - p0) % block
        for c in range(dim):
            value = scale * weight[row, c]
            if has_types:
                value += type_weight[tt, c]
            if pe_kind == PE_SINUSOIDAL:
                value += hi_a[hi, c] * lo_x[lo, c] + hi_b[hi, c] * lo_y[lo, c]
            elif pe_kind == PE_TABLE:
                value += pe_table[p, c]
            out[t, c] = value


def embed_numba(
    ids, weight, positions, *, scale, pe, pe_table=None, omega=None, interleaved=True,
    token_type_ids=None, token_type_weight=None,
):  # fmt: skip
    """ids, positions int64 [B, S]; weight [V, D] float32/float64. Returns [B, S, D] in weight's dtype."""
    batch, seq = ids.shape
    dim = weight.shape[1]
    flat_ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    flat_pos = np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)
    out = np.empty((batch * seq, dim), dtype=weight.dtype)
    unused = np.zeros((1, 1), dtype=weight.dtype)
    basis, p0 = (1, unused, unused, unused, unused), 0
    kind = PE_NONE
    if pe == "sinusoidal":
        kind = PE_SINUSOIDAL
        if flat_pos.size:
            p0 = int(flat_pos.min())
            basis = column_basis(p0, int(flat_pos.max()) - p0 + 1, omega, interleaved, weight.dtype)
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
        flat_ids, np.ascontiguousarray(weight), weight.dtype.type(scale), flat_pos, kind, table, basis[0], p0,
        basis[1], basis[2], basis[3], basis[4], has_types, type_ids, type_weight, out,
    )  # fmt: skip
    return out.reshape(batch, seq, dim)
