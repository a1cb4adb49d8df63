"""Rotary position embedding applied to x on the CPU (Numba), one pass.

Logical shapes: x, out [B, H, S, D] (a "bshd" tensor arrives as a transposed view);
cos, sin [P, R/2]; positions [B, S] rows of cos/sin.
(a, b) -> (a·cos - b·sin, b·cos + a·sin) on pairs (i, i + R/2) or (2i, 2i + 1); D - R tail copied.
``inverse`` rotates by -θ instead (sin negated, an exact operation): the gradient w.r.t. x.
"""

from __future__ import annotations

import numpy as np
from fastpe.kernels.numba._half import _narrow, _widen
from fastpe.kernels.numba._runtime import njit
from numba import prange


def _apply_rope_numba(x, cos, sin, positions, out, interleaved, copy_tail, inverse):
    batch, heads, seq, dim = x.shape
    half = cos.shape[1]
    for row in prange(batch * seq):
        b, s = row // seq, row % seq
        p = positions[b, s]
        for h in range(heads):
            if interleaved:
                for i in range(half):
                    c, sn = _widen(cos[p, i]), _widen(sin[p, i])
                    if inverse:  # loop-invariant: LLVM unswitches it
                        sn = -sn
                    a, o = _widen(x[b, h, s, 2 * i]), _widen(x[b, h, s, 2 * i + 1])
                    out[b, h, s, 2 * i] = _narrow(out, a * c - o * sn)
                    out[b, h, s, 2 * i + 1] = _narrow(out, o * c + a * sn)
            else:
                for i in range(half):
                    c, sn = _widen(cos[p, i]), _widen(sin[p, i])
                    if inverse:
                        sn = -sn
                    a, o = _widen(x[b, h, s, i]), _widen(x[b, h, s, half + i])
                    out[b, h, s, i] = _narrow(out, a * c - o * sn)
                    out[b, h, s, half + i] = _narrow(out, o * c + a * sn)
            if copy_tail:
                for i in range(2 * half, dim):
                    out[b, h, s, i] = _narrow(out, _widen(x[b, h, s, i]))  # exact


# Below this many rotated elements a call runs on the calling thread: splitting a decode step
# (one token, a few thousand elements, ~2 µs of work) gains nothing, and a parallel region has to
# wait for a worker when torch's pool or another process holds the cores.
SERIAL_ELEMENTS = 1 << 16

_apply_rope_kernel = njit(parallel=True, cache=True)(_apply_rope_numba)

HALF_BITS = (np.uint16, np.int16)  # bfloat16, float16 bits

_apply_rope_serial = _apply_rope_kernel.serial


@njit(cache=True)
def _apply_rope_pair(x1, out1, tail1, x2, out2, tail2, cos, sin, positions, interleaved, inverse):
    """Two arrays that share tables and positions (q and k of a decode step) in one launch: a
    one-token call costs about as much to launch as to compute."""
    _apply_rope_serial(x1, cos, sin, positions, out1, interleaved, tail1, inverse)
    _apply_rope_serial(x2, cos, sin, positions, out2, interleaved, tail2, inverse)


def _tables(cos, sin, x):
    """cos/sin as the kernels read them: contiguous, in x's compute dtype or as half bits."""
    compute = np.float32 if x.dtype in HALF_BITS else x.dtype
    return tuple(
        np.ascontiguousarray(t) if t.dtype in HALF_BITS else np.ascontiguousarray(t, dtype=compute)
        for t in (cos, sin)
    )


def apply_rope_numba(x, cos, sin, positions, *, interleaved, layout, out=None, inverse=False):
    """Rotate x ("bhsd" [B,H,S,D] or "bshd" [B,S,H,D], any strides): float32, float64, or the
    bits of bfloat16 (uint16) or float16 (int16), computed in float32.

    ``positions`` int64 [B, S]; cos/sin are read in the compute dtype, or as half bits (widened
    per element: only the rows used are read). ``out=x`` rotates in place; an ``out`` of
    another dtype (float32 for half x) receives the unrounded rotation. Returns the output in
    x's layout. ``inverse=True`` rotates by -θ: the gradient w.r.t. x of a rotation, computed
    from the gradient of its output.
    """
    cos, sin = _tables(cos, sin, x)
    inplace = out is x
    if out is None:
        out = np.empty(x.shape, dtype=x.dtype)  # C order in the caller's layout
    as_bhsd = (lambda a: a) if layout == "bhsd" else (lambda a: a.swapaxes(1, 2))
    kernel = _apply_rope_kernel.serial if x.size <= SERIAL_ELEMENTS else _apply_rope_kernel
    kernel(
        as_bhsd(x),
        cos,
        sin,
        np.ascontiguousarray(positions, dtype=np.int64),
        as_bhsd(out),
        interleaved,
        not inplace and 2 * cos.shape[1] < x.shape[3],
        inverse,
    )
    return out


def apply_rope_pair_numba(x1, x2, cos, sin, positions, *, interleaved, layout, inverse=False):
    """``apply_rope_numba`` on two arrays with the same tables and positions (new outputs, not in
    place): one serial launch when both are small, else one call each."""
    if x1.size + x2.size > SERIAL_ELEMENTS:
        return tuple(
            apply_rope_numba(
                x, cos, sin, positions, interleaved=interleaved, layout=layout, inverse=inverse
            )
            for x in (x1, x2)
        )
    cos, sin = _tables(cos, sin, x1)
    as_bhsd = (lambda a: a) if layout == "bhsd" else (lambda a: a.swapaxes(1, 2))
    out1, out2 = np.empty(x1.shape, dtype=x1.dtype), np.empty(x2.shape, dtype=x2.dtype)
    rotary = 2 * cos.shape[1]
    _apply_rope_pair(
        as_bhsd(x1),
        as_bhsd(out1),
        rotary < x1.shape[3],
        as_bhsd(x2),
        as_bhsd(out2),
        rotary < x2.shape[3],
        cos,
        sin,
        np.ascontiguousarray(positions, dtype=np.int64),
        interleaved,
        inverse,
    )
    return out1, out2
