"""The gradients of merge_attention on the CPU (Numba): one pass over the rows.

Logical shapes: out_a, out_b, grad_out, d_out_a, d_out_b [B, H, S, Dv]; lse_a, lse_b, grad_lse,
d_lse_a, d_lse_b [B, H, S]. With lse = logaddexp(lse_a, lse_b) and w_p = exp(lse_p − lse):
d out_p = w_p · g and d lse_p = w_p · (⟨g, out_p − out⟩ + g_lse) (docs/math.md#merge-gradients).
The merged row is recomputed here (float64 sums) rather than saved. A part with w = 0 (lse −inf,
or underflow) gets exactly zero gradients, whatever its out holds.
"""

from __future__ import annotations

import math

import numpy as np
from fastpe.kernels.numba._runtime import njit
from numba import prange


@njit(parallel=True, cache=True)
def _merge_backward(
    out_a, lse_a, out_b, lse_b, grad_out, grad_lse, d_out_a, d_lse_a, d_out_b, d_lse_b
):
    batch, heads, seq, dv = out_a.shape
    for row in prange(batch * heads * seq):
        i = row % seq
        h = (row // seq) % heads
        b = row // (seq * heads)
        la = float(lse_a[b, h, i])
        lb = float(lse_b[b, h, i])
        top = max(la, lb)
        wa = 0.0
        wb = 0.0
        if top != -np.inf:
            lse = top + math.log(math.exp(la - top) + math.exp(lb - top))
            wa = math.exp(la - lse)
            wb = math.exp(lb - lse)
        dot_a = 0.0
        dot_b = 0.0
        for c in range(dv):
            g = float(grad_out[b, h, i, c])
            oa = float(out_a[b, h, i, c]) if wa > 0.0 else 0.0
            ob = float(out_b[b, h, i, c]) if wb > 0.0 else 0.0
            out = wa * oa + wb * ob
            dot_a += g * (oa - out)
            dot_b += g * (ob - out)
            d_out_a[b, h, i, c] = wa * g
            d_out_b[b, h, i, c] = wb * g
        gl = float(grad_lse[b, h, i])
        d_lse_a[b, h, i] = wa * (dot_a + gl) if wa > 0.0 else 0.0
        d_lse_b[b, h, i] = wb * (dot_b + gl) if wb > 0.0 else 0.0


def merge_attention_backward_numba(grad_out, grad_lse, out_a, lse_a, out_b, lse_b):
    """(d out_a, d lse_a, d out_b, d lse_b): d out_* in out_a's dtype, d lse_* in float64."""
    d_out_a = np.empty(out_a.shape, dtype=out_a.dtype)
    d_out_b = np.empty(out_a.shape, dtype=out_a.dtype)
    d_lse_a = np.empty(lse_a.shape, dtype=np.float64)
    d_lse_b = np.empty(lse_a.shape, dtype=np.float64)
    _merge_backward(
        out_a, lse_a, out_b, lse_b, grad_out, grad_lse, d_out_a, d_lse_a, d_out_b, d_lse_b
    )
    return d_out_a, d_lse_a, d_out_b, d_lse_b
