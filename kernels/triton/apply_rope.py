"""Rotary position embedding applied to x on CUDA (Triton), one pass.

Logical shapes: x, out [B, H, S, D] (any strides; "bshd" tensors arrive as permuted strides);
cos, sin [P, R/2]; positions [B, S] (stride 0 over B for a shared [S]) or offset + s.
(a, b) -> (a·cos - b·sin, b·cos + a·sin) on pairs (i, i + R/2) or (2i, 2i + 1); tail copied.
INVERSE rotates by -θ (sin negated, exact): the gradient w.r.t. x from the output's gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fastpe.kernels.triton._common import low_precision_via_fp32, next_pow2


@triton.jit
def _rotate_heads(
    x,
    out,
    table,
    b,
    s,
    p,
    h,
    heads,
    INTERLEAVED: tl.constexpr,
    COPY_TAIL: tl.constexpr,
    INVERSE: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    """Rotate heads ``h`` [BLOCK_H] of one (batch b, position s) row of one tensor at row p.
    ``x``, ``out``: (ptr, strides b, h, s, d); ``table``: (cos ptr, sin ptr, row stride, half,
    dim)."""
    x_ptr, xs = x
    out_ptr, os = out
    cos_ptr, sin_ptr, stride_cos_p, half, dim = table
    f = tl.arange(0, BLOCK_F)
    c = tl.load(cos_ptr + p * stride_cos_p + f, mask=f < half, other=1.0).to(tl.float32)
    sn = tl.load(sin_ptr + p * stride_cos_p + f, mask=f < half, other=0.0).to(tl.float32)
    if INVERSE:
        sn = -sn
    if INTERLEAVED:
        col_a, col_b = 2 * f, 2 * f + 1
    else:
        col_a, col_b = f, f + half
    keep = (h[:, None] < heads) & (f[None, :] < half)
    x_row = x_ptr + b * xs[0] + s * xs[2] + h[:, None] * xs[1]
    o_row = out_ptr + b * os[0] + s * os[2] + h[:, None] * os[1]
    a = tl.load(x_row + col_a[None, :] * xs[3], mask=keep, other=0.0).to(tl.float32)
    o = tl.load(x_row + col_b[None, :] * xs[3], mask=keep, other=0.0).to(tl.float32)
    kind = out_ptr.dtype.element_ty
    tl.store(o_row + col_a[None, :] * os[3], (a * c[None, :] - o * sn[None, :]).to(kind), mask=keep)
    tl.store(o_row + col_b[None, :] * os[3], (o * c[None, :] + a * sn[None, :]).to(kind), mask=keep)
    if COPY_TAIL:  # partial rotary: elements R … D-1 pass through
        for t0 in range(2 * half, dim, BLOCK_TAIL):
            t = t0 + tl.arange(0, BLOCK_TAIL)
            tail_keep = (h[:, None] < heads) & (t[None, :] < dim)
            tail = tl.load(x_row + t[None, :] * xs[3], mask=tail_keep, other=0.0)
            tl.store(o_row + t[None, :] * os[3], tail.to(kind), mask=tail_keep)


@triton.jit
def _apply_rope_kernel(
    x1_ptr,
    out1_ptr,
    x2_ptr,
    out2_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    heads1,
    heads2,
    seq,
    half,
    dim,
    pos_offset,
    strides,
    HAS_POSITIONS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    COPY_TAIL: tl.constexpr,
    INVERSE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    """Axis 0: one (batch, position) row; axis 1: head blocks of tensor 1, then of tensor 2 (q
    and k in one launch; tensor 2 has zero heads when only one tensor is rotated). strides:
    ((x1 b, h, s, d), (out1 …), (x2 …), (out2 …), cos row, (positions b, s)); pointers, then
    sizes, then strides, as ptxas allocates registers best for this kernel."""
    x1s, o1s, x2s, o2s, stride_cos_p, pos_strides = strides
    row = tl.program_id(0).to(tl.int64)
    b = row // seq
    s = row % seq
    if HAS_POSITIONS:
        p = tl.load(pos_ptr + b * pos_strides[0] + s * pos_strides[1])
    else:
        p = pos_offset + s
    table = (cos_ptr, sin_ptr, stride_cos_p, half, dim)
    block = tl.program_id(1).to(tl.int64)
    blocks1 = tl.cdiv(heads1, BLOCK_H)
    if block < blocks1:
        h = block * BLOCK_H + tl.arange(0, BLOCK_H)
        _rotate_heads(
            (x1_ptr, x1s),
            (out1_ptr, o1s),
            table,
            b,
            s,
            p,
            h,
            heads1,
            INTERLEAVED,
            COPY_TAIL,
            INVERSE,
            BLOCK_F,
            BLOCK_TAIL,
        )
    else:
        h = (block - blocks1) * BLOCK_H + tl.arange(0, BLOCK_H)
        _rotate_heads(
            (x2_ptr, x2s),
            (out2_ptr, o2s),
            table,
            b,
            s,
            p,
            h,
            heads2,
            INTERLEAVED,
            COPY_TAIL,
            INVERSE,
            BLOCK_F,
            BLOCK_TAIL,
        )


def _bhsd_strides(t, layout):
    s = t.stride()
    return s if layout == "bhsd" else (s[0], s[2], s[1], s[3])


def _heads_seq(x, layout):
    return (x.shape[1], x.shape[2]) if layout == "bhsd" else (x.shape[2], x.shape[1])


def launch_args(xs, outs, cos, sin, positions, pos_offset, *, interleaved, layout, inverse):
    """(kernel, grid, args, constexprs) of one launch rotating ``xs`` (one or two tensors) into
    ``outs`` (one per entry of ``xs``; the inputs themselves when in place): the one place its
    arguments are assembled (``fastpe triton-report`` calls it on meta tensors). The rest as in
    ``apply_rope_triton``."""
    x1, out1 = xs[0], outs[0]
    x2, out2 = (xs[1], outs[1]) if len(xs) == 2 else (x1, out1)
    batch, dim, half = x1.shape[0], x1.shape[3], cos.shape[1]
    heads1, seq = _heads_seq(x1, layout)
    heads2 = _heads_seq(x2, layout)[0] if len(xs) == 2 else 0
    pos = (
        positions
        if positions is not None
        else torch.zeros((1, 1), dtype=torch.int64, device=x1.device)
    )
    block_h = min(16, next_pow2(max(heads1, heads2), 1))
    grid = (batch * seq, triton.cdiv(heads1, block_h) + triton.cdiv(heads2, block_h))
    args = (
        x1,
        out1,
        x2,
        out2,
        cos,
        sin,
        pos,
        heads1,
        heads2,
        seq,
        half,
        dim,
        pos_offset,
        (
            _bhsd_strides(x1, layout),
            _bhsd_strides(out1, layout),
            _bhsd_strides(x2, layout),
            _bhsd_strides(out2, layout),
            cos.stride(0),
            (0, pos.stride(0)) if pos.dim() == 1 else (pos.stride(0), pos.stride(1)),
        ),
    )
    constexprs = dict(
        HAS_POSITIONS=positions is not None,
        INTERLEAVED=interleaved,
        COPY_TAIL=out1 is not x1 and 2 * half < dim,
        INVERSE=inverse,
        BLOCK_H=block_h,
        BLOCK_F=next_pow2(half, 1),
        BLOCK_TAIL=next_pow2(min(dim - 2 * half, 64), 1),
    )
    return _apply_rope_kernel, grid, args, constexprs


def apply_rope_triton(
    xs, cos, sin, positions, pos_offset, *, interleaved, layout, inplace, inverse=False
):
    """Rotate one or two tensors ("bhsd" or "bshd", same batch and sequence) in one launch.

    ``positions``: int64 tensor [S] or [B, S], or None for ``pos_offset + s``. Returns a tuple
    of rotated tensors (the inputs themselves when ``inplace``); ``inverse`` rotates by -θ."""
    if len(xs) > 2:  # the kernel has two slots: rotate larger groups two at a time
        options = {
            "interleaved": interleaved,
            "layout": layout,
            "inplace": inplace,
            "inverse": inverse,
        }
        return apply_rope_triton(
            xs[:2], cos, sin, positions, pos_offset, **options
        ) + apply_rope_triton(xs[2:], cos, sin, positions, pos_offset, **options)
    via_fp32 = low_precision_via_fp32(xs[0].dtype)
    outs = []
    for x in xs:
        if inplace and not via_fp32:
            outs.append(x)
        else:
            outs.append(
                torch.empty(x.shape, dtype=torch.float32 if via_fp32 else x.dtype, device=x.device)
            )
    kernel, grid, args, constexprs = launch_args(
        xs,
        outs,
        cos,
        sin,
        positions,
        pos_offset,
        interleaved=interleaved,
        layout=layout,
        inverse=inverse,
    )
    if grid[0] and grid[1]:
        kernel[grid](*args, **constexprs)
    results = []
    for x, out in zip(xs, outs, strict=True):
        if via_fp32:
            rounded = out.to(x.dtype)
            results.append(x.copy_(rounded) if inplace else rounded)
        else:
            results.append(out)
    return tuple(results)
