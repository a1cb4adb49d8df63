"""Sinusoidal positional-encoding table on the CPU (Numba).

Logical shape: out [P, D] for positions offset … offset + P - 1, D/2 frequencies ω.
interleaved: out[p, 2i] = sin(pω_i), out[p, 2i+1] = cos(pω_i); concat: out[p, i], out[p, D/2 + i].
"""

from __future__ import annotations

import numpy as np
from fastpe.kernels.numba._angles import angle_basis
from numba import njit, prange


@njit(parallel=True, cache=True)
def _sinusoidal_table_numba(out, block, cos_lo, sin_lo, cos_hi, sin_hi, interleaved):
    rows = out.shape[0]
    half = cos_lo.shape[1]
    for p in prange(rows):
        t, l = p // block, p % block
        for i in range(half):
            s = sin_hi[t, i] * cos_lo[l, i] + cos_hi[t, i] * sin_lo[l, i]
            c = cos_hi[t, i] * cos_lo[l, i] - sin_hi[t, i] * sin_lo[l, i]
            if interleaved:
                out[p, 2 * i] = s
                out[p, 2 * i + 1] = c
            else:
                out[p, i] = s
                out[p, half + i] = c


def sinusoidal_table_numba(omega, num_positions, offset, interleaved, dtype):
    """[num_positions, 2·len(omega)] table in ``dtype`` (float32/float64) for the frequencies ω."""
    out = np.empty((num_positions, 2 * omega.shape[0]), dtype=dtype)
    block, cos_lo, sin_lo, cos_hi, sin_hi = angle_basis(offset, num_positions, omega)
    _sinusoidal_table_numba(out, block, cos_lo, sin_lo, cos_hi, sin_hi, interleaved)
    return out
