"""Basis tables for accurate sin/cos of p·ω at many positions (plain NumPy, not jitted).

The usual float32 recipe rounds p·ω to float32 before sin/cos: at p ~ 2^20 the argument is off
by ~0.06 rad. Here every position p in [p0, p0 + count) is split as p = p0 + t·L + l
(0 <= l < L) and

    sin(pω) = sin(H_t)·cos(l·ω) + cos(H_t)·sin(l·ω),   H_t = (p0 + t·L)·ω
    cos(pω) = cos(H_t)·cos(l·ω) - sin(H_t)·sin(l·ω)

with both bases evaluated in float64 (arguments exact to ~1e-16 relative). A kernel then needs
4 multiplies and 2 adds per pair — plain arithmetic that vectorises — instead of two libm calls.
L ~ sqrt(count) keeps both bases small (a few MB at 2^20 positions).
"""

from __future__ import annotations

import math

import numpy as np


def angle_basis(p0: int, count: int, omega: np.ndarray):
    """Return (L, cos_lo, sin_lo [L, F], cos_hi, sin_hi [T, F]) for positions p0 … p0+count-1."""
    count = max(count, 1)
    block = max(16, math.isqrt(count - 1) + 1)
    n_hi = -(-count // block)
    lo = np.arange(block, dtype=np.float64)[:, None] * omega
    hi = (p0 + block * np.arange(n_hi, dtype=np.float64))[:, None] * omega
    return block, np.cos(lo), np.sin(lo), np.cos(hi), np.sin(hi)
