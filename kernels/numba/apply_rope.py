"""Rotary position embedding applied to x on the CPU (Numba), one pass.

Logical shapes: x, out [B, H, S, D] (a "bshd" tensor arrives as a transposed view);
cos, sin [P, R/2]; positions [B, S] rows of cos/sin.
(a, b) -> (a·cos - b·sin, b·cos + a·sin) on pairs (i, i + R/2) or (2i, 2i + 1); D - R tail copied.
``inverse`` rotates by -θ instead (sin negated, an exact operation): the gradient w.r.t. x.

Memory-bound, so written for LLVM's vectoriser: each (b, s) widens its cos/sin row once into a
small scratch row (negated for ``inverse``), then the row of every head is rotated by a loop
over D. The loop vectorises only over rows the compiler knows to be contiguous, so rows (whose
elements the wrapper makes adjacent) are retyped as such, whatever the strides between rows
(a "bshd" tensor seen as "bhsd", a slice of a fused projection). In place, x is passed alone
(``out=None``) and each row is read and written through one array: with two arrays LLVM checks
at run time whether they overlap, and they do, which sends every row to its scalar loop.
"""

from __future__ import annotations

import numba
import numpy as np
from fastpe.kernels.numba._half import _narrow, _widen
from fastpe.kernels.numba._runtime import njit, read_only
from numba import prange, types
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic


@intrinsic
def _contiguous_row(typingctx, row):
    """A 1-D array whose step is one element, typed as contiguous (the same array; only what
    the compiler knows changes). The caller guarantees the step."""
    if not (isinstance(row, types.Array) and row.ndim == 1):
        return None
    contiguous = row.copy(layout="C")

    def codegen(context, builder, signature, args):
        return impl_ret_borrowed(context, builder, contiguous, args[0])

    return contiguous(row), codegen


@njit(inline="always")
def _rotate_row(x, out, cos, sin, interleaved, copy_tail):
    """One head's row: x -> out (possibly the same array); cos, sin the float rows [R/2]."""
    half = cos.size
    if interleaved:
        for i in range(half):
            a, o = _widen(x[2 * i]), _widen(x[2 * i + 1])
            out[2 * i] = _narrow(out, a * cos[i] - o * sin[i])
            out[2 * i + 1] = _narrow(out, o * cos[i] + a * sin[i])
    else:
        for i in range(half):
            a, o = _widen(x[i]), _widen(x[half + i])
            out[i] = _narrow(out, a * cos[i] - o * sin[i])
            out[half + i] = _narrow(out, o * cos[i] + a * sin[i])
    if copy_tail:
        for i in range(2 * half, x.size):
            out[i] = _narrow(out, _widen(x[i]))  # exact


@njit(cache=True)
def _rotate_rows(x, cos, sin, positions, out, interleaved, copy_tail, sign, c, sn, first, stop):
    """(b, s) rows first … stop - 1 of every head: ``_apply_rope_numba``'s work for one chunk,
    with c, sn its chunk's cos/sin row scratch."""
    heads, seq = x.shape[1], x.shape[2]
    half = cos.shape[1]
    for row in range(first, stop):
        b, s = row // seq, row % seq
        p = positions[b, s]
        for i in range(half):
            c[i] = _widen(cos[p, i])
            sn[i] = sign * _widen(sin[p, i])
        for h in range(heads):
            xr = _contiguous_row(x[b, h, s])
            if out is None:
                _rotate_row(xr, xr, c, sn, interleaved, copy_tail)
            else:
                _rotate_row(xr, _contiguous_row(out[b, h, s]), c, sn, interleaved, copy_tail)


def _apply_rope_numba(x, cos, sin, positions, out, interleaved, copy_tail, inverse, scratch):
    """x and out (None: in place) with adjacent elements within each row; ``scratch``
    [chunks, 2, R/2] in the compute dtype, one cos/sin row pair per chunk of (b, s) rows. The
    loop's body is one call: Numba types a parallel loop's body twice."""
    rows, chunks = x.shape[0] * x.shape[2], scratch.shape[0]
    sign = -1.0 if inverse else 1.0  # negation is exact
    for chunk in prange(chunks):
        first, stop = chunk * rows // chunks, (chunk + 1) * rows // chunks
        _rotate_rows(
            x, cos, sin, positions, out, interleaved, copy_tail, sign,
            scratch[chunk, 0], scratch[chunk, 1], np.int64(first), np.int64(stop),
        )  # fmt: skip


# Below this many rotated elements a call runs on the calling thread: splitting a decode step
# (one token, a few thousand elements, ~2 µs of work) gains nothing, and a parallel region has to
# wait for a worker when torch's pool or another process holds the cores.
SERIAL_ELEMENTS = 1 << 16

_apply_rope_kernel = njit(parallel=True, cache=True)(_apply_rope_numba)

HALF_BITS = (np.uint16, np.int16)  # bfloat16, float16 bits

_apply_rope_serial = _apply_rope_kernel.serial


@njit(cache=True)
def _apply_rope_pair(
    x1, out1, tail1, x2, out2, tail2, cos, sin, positions, interleaved, inverse, scratch
):
    """Two arrays that share tables and positions (q and k of a decode step) in one launch: a
    one-token call costs about as much to launch as to compute."""
    _apply_rope_serial(x1, cos, sin, positions, out1, interleaved, tail1, inverse, scratch)
    _apply_rope_serial(x2, cos, sin, positions, out2, interleaved, tail2, inverse, scratch)


def _tables(cos, sin, x):
    """cos/sin as the kernels read them: contiguous, in x's compute dtype or as half bits."""
    compute = np.float32 if x.dtype in HALF_BITS else x.dtype
    return tuple(
        np.ascontiguousarray(t) if t.dtype in HALF_BITS else np.ascontiguousarray(t, dtype=compute)
        for t in (cos, sin)
    )


def _adjacent(a):
    """Whether the elements of each row (the last axis) are adjacent in memory. An empty array
    counts as adjacent: NumPy flags it contiguous whatever its strides, so a copy would keep
    them."""
    return a.size == 0 or a.shape[-1] <= 1 or a.strides[-1] == a.itemsize


def _scratch(x, half, rows, serial):
    """The kernel's cos/sin rows: one pair per chunk of (b, s) rows, several chunks per thread
    when parallel."""
    chunks = 1 if serial else max(1, min(rows, 8 * numba.get_num_threads()))
    return np.empty((chunks, 2, half), np.float64 if x.dtype == np.float64 else np.float32)


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
    if not (_adjacent(x) and (out is None or _adjacent(out))):
        # a row with gaps (a rare view, e.g. x[..., ::2]): rotate a contiguous copy
        rotated = apply_rope_numba(
            np.ascontiguousarray(x),
            cos,
            sin,
            positions,
            interleaved=interleaved,
            layout=layout,
            out=None if out is None or out is x else np.empty(out.shape, out.dtype),
            inverse=inverse,
        )
        if out is None:
            return rotated
        out[...] = rotated
        return out
    inplace = out is x
    if out is None:
        out = np.empty(x.shape, dtype=x.dtype)  # C order in the caller's layout
    as_bhsd = (lambda a: a) if layout == "bhsd" else (lambda a: a.swapaxes(1, 2))
    serial = x.size <= SERIAL_ELEMENTS
    kernel = _apply_rope_kernel.serial if serial else _apply_rope_kernel
    kernel(
        as_bhsd(x),
        read_only(cos),
        read_only(sin),
        read_only(np.ascontiguousarray(positions, dtype=np.int64)),
        None if inplace else as_bhsd(out),
        interleaved,
        not inplace and 2 * cos.shape[1] < x.shape[3],
        inverse,
        _scratch(x, cos.shape[1], x.shape[0] * x.shape[2 if layout == "bhsd" else 1], serial),
    )
    return out


def apply_rope_pair_numba(
    x1, x2, cos, sin, positions, *, interleaved, layout, inverse=False, inplace=False
):
    """``apply_rope_numba`` on two arrays with the same tables and positions (new outputs, or
    ``inplace``): one serial launch when both are small and their rows contiguous, else one call
    each."""
    if x1.size + x2.size > SERIAL_ELEMENTS or not (_adjacent(x1) and _adjacent(x2)):
        return tuple(
            apply_rope_numba(
                x,
                cos,
                sin,
                positions,
                interleaved=interleaved,
                layout=layout,
                out=x if inplace else None,
                inverse=inverse,
            )
            for x in (x1, x2)
        )
    cos, sin = _tables(cos, sin, x1)
    as_bhsd = (lambda a: a) if layout == "bhsd" else (lambda a: a.swapaxes(1, 2))
    if inplace:
        out1, out2 = x1, x2
    else:
        out1, out2 = np.empty(x1.shape, dtype=x1.dtype), np.empty(x2.shape, dtype=x2.dtype)
    rotary = 2 * cos.shape[1]
    _apply_rope_pair(
        as_bhsd(x1),
        None if inplace else as_bhsd(out1),
        not inplace and rotary < x1.shape[3],
        as_bhsd(x2),
        None if inplace else as_bhsd(out2),
        not inplace and rotary < x2.shape[3],
        read_only(cos),
        read_only(sin),
        read_only(np.ascontiguousarray(positions, dtype=np.int64)),
        interleaved,
        inverse,
        _scratch(x1, cos.shape[1], 0, serial=True),
    )
    return out1, out2
