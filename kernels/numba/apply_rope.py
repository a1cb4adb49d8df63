"""Rotary position embedding applied to x on the CPU (Numba), one pass.

Logical shapes: x, out [B, H, S, D] (a "bshd" tensor arrives as a transposed view);
cos, sin [P, R/2]; positions [B, S] rows of cos/sin.
(a, b) -> (a·cos - b·sin, b·cos + a·sin) on pairs (i, i + R/2) or (2i, 2i + 1); D - R tail copied.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True)
def _apply_rope_numba(x, cos, sin, positions, out, interleaved, copy_tail):
    batch, heads, seq, dim = x.shape
    half = cos.shape[1]
    for row in prange(batch * seq):
        b, s = row // seq, row % seq
        p = positions[b, s]
        for h in range(heads):
            if interleaved:
                for i in range(half):
                    c, sn = cos[p, i], sin[p, i]
                    a, o = x[b, h, s, 2 * i], x[b, h, s, 2 * i + 1]
                    out[b, h, s, 2 * i] = a * c - o * sn
                    out[b, h, s, 2 * i + 1] = o * c + a * sn
            else:
                for i in range(half):
                    c, sn = cos[p, i], sin[p, i]
                    a, o = x[b, h, s, i], x[b, h, s, half + i]
                    out[b, h, s, i] = a * c - o * sn
                    out[b, h, s, half + i] = o * c + a * sn
            if copy_tail:
                for i in range(2 * half, dim):
                    out[b, h, s, i] = x[b, h, s, i]


def apply_rope_numba(x, cos, sin, positions, *, interleaved, layout, out=None):
    """Rotate x ("bhsd" [B,H,S,D] or "bshd" [B,S,H,D], float32/float64, any strides).

    ``positions`` int64 [B, S]; cos/sin are read in x's dtype. ``out=x`` rotates in place.
    Returns the output in x's layout.
    """
    cos = np.ascontiguousarray(cos, dtype=x.dtype)
    sin = np.ascontiguousarray(sin, dtype=x.dtype)
    inplace = out is x
    if out is None:
        out = np.empty(x.shape, dtype=x.dtype)  # C order in the caller's layout
    as_bhsd = (lambda a: a) if layout == "bhsd" else (lambda a: a.swapaxes(1, 2))
    _apply_rope_numba(
        as_bhsd(x), cos, sin, np.ascontiguousarray(positions, dtype=np.int64), as_bhsd(out),
        interleaved, not inplace and 2 * cos.shape[1] < x.shape[3],
    )  # fmt: skip
    return out
