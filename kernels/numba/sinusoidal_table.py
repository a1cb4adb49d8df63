"""Sinusoidal positional-encoding table on the CPU (Numba).

Logical shape: out [P, D] for positions offset … offset + P - 1, D/2 frequencies ω.
interleaved: out[p, 2i] = sin(pω_i), out[p, 2i+1] = cos(pω_i); concat: out[p, i], out[p, D/2 + i].
Both layouts are one loop: the angle-addition bases come in output-column order (``_angles``).
"""

from __future__ import annotations

import numpy as np
from fastpe.kernels.numba._angles import column_basis
from fastpe.kernels.numba._runtime import njit
from numba import prange


@njit(parallel=True, cache=True)
def _sinusoidal_table_numba(out, block, hi_a, hi_b, lo_x, lo_y):
    rows, dim = out.shape
    for p in prange(rows):
        t, l = p // block, p % block
        for j in range(dim):
            out[p, j] = hi_a[t, j] * lo_x[l, j] + hi_b[t, j] * lo_y[l, j]


def sinusoidal_table_numba(omega, num_positions, offset, interleaved, dtype):
    """[num_positions, 2·len(omega)] table in ``dtype`` (float32/float64) for the frequencies ω."""
    out = np.empty((num_positions, 2 * omega.shape[0]), dtype=dtype)
    _sinusoidal_table_numba(out, *column_basis(offset, num_positions, omega, interleaved, dtype))
    return out
