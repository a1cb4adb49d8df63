"""RoPE cos/sin tables on the CPU (Numba).

Logical shapes: cos, sin [P, R/2]; cos[p, i] = attention_factor · cos((offset + p) · inv_freq[i]).
Accurate angle addition from the concat-layout ([sin | cos]) bases of ``_angles``.
"""

from __future__ import annotations

import numpy as np
from fastpe.kernels.numba._angles import column_basis
from fastpe.kernels.numba._runtime import njit
from numba import prange


@njit(parallel=True, cache=True)
def _rope_table_numba(cos, sin, block, hi_a, hi_b, lo_x, lo_y, factor):
    rows, half = cos.shape
    for p in prange(rows):
        t, l = p // block, p % block
        for i in range(half):
            sin[p, i] = factor * (hi_a[t, i] * lo_x[l, i] + hi_b[t, i] * lo_y[l, i])
        for i in range(half):
            j = half + i
            cos[p, i] = factor * (hi_a[t, j] * lo_x[l, j] + hi_b[t, j] * lo_y[l, j])


def rope_table_numba(inv_freq, attention_factor, num_positions, offset, dtype):
    cos = np.empty((num_positions, inv_freq.shape[0]), dtype=dtype)
    sin = np.empty_like(cos)
    basis = column_basis(offset, num_positions, inv_freq, interleaved=False, dtype=dtype)
    _rope_table_numba(cos, sin, *basis, np.dtype(dtype).type(attention_factor))
    return cos, sin
