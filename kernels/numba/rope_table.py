"""RoPE cos/sin tables on the CPU (Numba).

Logical shapes: cos, sin [P, R/2]; cos[p, i] = attention_factor · cos((offset + p) · inv_freq[i]).
"""

from __future__ import annotations

import numpy as np
from fastpe.kernels.numba._angles import angle_basis
from numba import njit, prange


@njit(parallel=True, cache=True)
def _rope_table_numba(cos, sin, block, cos_lo, sin_lo, cos_hi, sin_hi, factor):
    rows, half = cos.shape
    for p in prange(rows):
        t, l = p // block, p % block
        for i in range(half):
            sin[p, i] = factor * (sin_hi[t, i] * cos_lo[l, i] + cos_hi[t, i] * sin_lo[l, i])
            cos[p, i] = factor * (cos_hi[t, i] * cos_lo[l, i] - sin_hi[t, i] * sin_lo[l, i])


def rope_table_numba(inv_freq, attention_factor, num_positions, offset, dtype):
    cos = np.empty((num_positions, inv_freq.shape[0]), dtype=dtype)
    sin = np.empty_like(cos)
    block, cos_lo, sin_lo, cos_hi, sin_hi = angle_basis(offset, num_positions, inv_freq)
    _rope_table_numba(cos, sin, block, cos_lo, sin_lo, cos_hi, sin_hi, attention_factor)
    return cos, sin
