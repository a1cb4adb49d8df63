"""Rotary position embedding applied to x on the CPU (Numba), one pass.

Logical shapes: x, out [B, H, S, D] (a "bshd" tensor arrives as a transposed view);
cos, sin [P, R/2]; positions [B, S] rows of cos/sin.
(a, b) -> (a·cos - b·sin, b·cos + a·sin) on pairs (i, i + R/2) or (2i, 2i + 1); D - R tail copied.
"""

from __future__ import annotations

import numpy as np
from fastpe.kernels.numba._runtime import njit
from numba import prange, types
from numba.extending import overload


# bfloat16 travels as its uint16 bit pattern (Numba has no bfloat16): widened exactly with << 16
# and rounded to nearest-even on the way back. Kept in this file on purpose: Numba's disk cache
# only notices changes to the file that holds the kernel.
def _widen(value):
    """An element as a number to compute with: bf16 bits -> float32, floats unchanged."""


def _narrow(array, value):
    """``value`` as an element of ``array``: float -> bf16 bits for uint16 arrays."""


@overload(_widen, inline="always")
def _widen_impl(value):
    if value == types.uint16:
        return lambda value: np.uint32(np.uint32(value) << np.uint32(16)).view(np.float32)
    return lambda value: value


@overload(_narrow, inline="always")
def _narrow_impl(array, value):
    if array.dtype == types.uint16:

        def to_bf16(array, value):
            bits = np.float32(value).view(np.uint32)
            if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN stays a quiet NaN
                return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
            keep = (bits >> np.uint32(16)) & np.uint32(1)  # ties go to the even bf16
            return np.uint16((bits + np.uint32(0x7FFF) + keep) >> np.uint32(16))

        return to_bf16
    return lambda array, value: value


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
                    a, o = _widen(x[b, h, s, 2 * i]), _widen(x[b, h, s, 2 * i + 1])
                    out[b, h, s, 2 * i] = _narrow(out, a * c - o * sn)
                    out[b, h, s, 2 * i + 1] = _narrow(out, o * c + a * sn)
            else:
                for i in range(half):
                    c, sn = cos[p, i], sin[p, i]
                    a, o = _widen(x[b, h, s, i]), _widen(x[b, h, s, half + i])
                    out[b, h, s, i] = _narrow(out, a * c - o * sn)
                    out[b, h, s, half + i] = _narrow(out, o * c + a * sn)
            if copy_tail:
                for i in range(2 * half, dim):
                    out[b, h, s, i] = x[b, h, s, i]


def apply_rope_numba(x, cos, sin, positions, *, interleaved, layout, out=None):
    """Rotate x ("bhsd" [B,H,S,D] or "bshd" [B,S,H,D], any strides): float32, float64, or uint16
    holding bfloat16 bits (computed in float32).

    ``positions`` int64 [B, S]; cos/sin are read in the compute dtype. ``out=x`` rotates in
    place. Returns the output in x's layout.
    """
    compute = np.float32 if x.dtype == np.uint16 else x.dtype
    cos = np.ascontiguousarray(cos, dtype=compute)
    sin = np.ascontiguousarray(sin, dtype=compute)
    inplace = out is x
    if out is None:
        out = np.empty(x.shape, dtype=x.dtype)  # C order in the caller's layout
    as_bhsd = (lambda a: a) if layout == "bhsd" else (lambda a: a.swapaxes(1, 2))
    _apply_rope_numba(
        as_bhsd(x), cos, sin, np.ascontiguousarray(positions, dtype=np.int64), as_bhsd(out),
        interleaved, not inplace and 2 * cos.shape[1] < x.shape[3],
    )  # fmt: skip
    return out
