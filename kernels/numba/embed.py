"""Fused token embedding + positional encoding (+ token type) on the CPU (Numba), one pass.

Logical shapes: ids, positions, token types [B·S]; weight [V, D]; pe_table [P, D];
token_type_weight [T, D] -> out [B·S, D].
out[t] = scale · weight[ids[t]] + PE(positions[t]) [+ token_type_weight[tt[t]]], summed in float64
and rounded once. The sinusoidal PE is computed on the fly (no table is read) by angle addition
from two small float64 bases (see ``_angles``); ids and positions were range-checked upstream.
"""

from __future__ import annotations

import numpy as np
from fastpe.kernels.numba._angles import angle_basis
from numba import njit, prange

PE_NONE, PE_SINUSOIDAL, PE_TABLE = 0, 1, 2


@njit(parallel=True, cache=True)
def _embed_numba(
    ids, weight, scale, positions, pe_kind, pe_table, block, p0, cos_lo, sin_lo, cos_hi, sin_hi,
    interleaved, has_types, type_ids, type_weight, out,
):  # fmt: skip
    tokens, dim = out.shape
    half = dim // 2
    for t in prange(tokens):
        row = ids[t]
        tt = type_ids[t] if has_types else 0
        if pe_kind == PE_SINUSOIDAL:
            rel = positions[t] - p0
            hi, lo = rel // block, rel % block
            for i in range(half):
                cs, cc = (2 * i, 2 * i + 1) if interleaved else (i, half + i)
                value_s = scale * np.float64(weight[row, cs])
                value_c = scale * np.float64(weight[row, cc])
                if has_types:
                    value_s += type_weight[tt, cs]
                    value_c += type_weight[tt, cc]
                value_s += sin_hi[hi, i] * cos_lo[lo, i] + cos_hi[hi, i] * sin_lo[lo, i]
                value_c += cos_hi[hi, i] * cos_lo[lo, i] - sin_hi[hi, i] * sin_lo[lo, i]
                out[t, cs] = value_s
                out[t, cc] = value_c
        else:
            p = positions[t]
            for c in range(dim):
                value = scale * np.float64(weight[row, c])
                if has_types:
                    value += type_weight[tt, c]
                if pe_kind == PE_TABLE:
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
    empty2 = np.zeros((1, 1), dtype=np.float64)
    basis, p0 = (1, empty2, empty2, empty2, empty2), 0
    kind = PE_NONE
    if pe == "sinusoidal":
        kind = PE_SINUSOIDAL
        if flat_pos.size:
            p0 = int(flat_pos.min())
            basis = angle_basis(p0, int(flat_pos.max()) - p0 + 1, omega)
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
        flat_ids, np.ascontiguousarray(weight), float(scale), flat_pos, kind, table, basis[0], p0,
        basis[1], basis[2], basis[3], basis[4], interleaved, has_types, type_ids, type_weight, out,
    )  # fmt: skip
    return out.reshape(batch, seq, dim)
