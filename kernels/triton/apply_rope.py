"""Rotary position embedding applied to x on CUDA (Triton), one pass.

Logical shapes: x, out [B, H, S, D] (any strides; "bshd" tensors arrive as permuted strides);
cos, sin [P, R/2]; positions [B, S] (stride 0 over B for a shared [S]) or offset + s.
(a, b) -> (a·cos - b·sin, b·cos + a·sin) on pairs (i, i + R/2) or (2i, 2i + 1); tail copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fastpe.kernels.triton._common import low_precision_via_fp32, next_pow2


@triton.jit
def _apply_rope_kernel(
    x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr,
    heads, seq, half, dim, pos_offset,
    stride_xb, stride_xh, stride_xs, stride_xd,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_cos_p, stride_pos_b, stride_pos_s,
    HAS_POSITIONS: tl.constexpr, INTERLEAVED: tl.constexpr, COPY_TAIL: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_TAIL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # one (batch, position) per program along axis 0
    b = row // seq
    s = row % seq
    if HAS_POSITIONS:
        p = tl.load(pos_ptr + b * stride_pos_b + s * stride_pos_s)
    else:
        p = pos_offset + s
    h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    f = tl.arange(0, BLOCK_F)
    c = tl.load(cos_ptr + p * stride_cos_p + f, mask=f < half, other=1.0).to(tl.float32)
    sn = tl.load(sin_ptr + p * stride_cos_p + f, mask=f < half, other=0.0).to(tl.float32)
    if INTERLEAVED:
        col_a, col_b = 2 * f, 2 * f + 1
    else:
        col_a, col_b = f, f + half
    keep = (h[:, None] < heads) & (f[None, :] < half)
    x_row = x_ptr + b * stride_xb + s * stride_xs + h[:, None] * stride_xh
    o_row = out_ptr + b * stride_ob + s * stride_os + h[:, None] * stride_oh
    a = tl.load(x_row + col_a[None, :] * stride_xd, mask=keep, other=0.0).to(tl.float32)
    o = tl.load(x_row + col_b[None, :] * stride_xd, mask=keep, other=0.0).to(tl.float32)
    kind = out_ptr.dtype.element_ty
    tl.store(
        o_row + col_a[None, :] * stride_od, (a * c[None, :] - o * sn[None, :]).to(kind), mask=keep
    )
    tl.store(
        o_row + col_b[None, :] * stride_od, (o * c[None, :] + a * sn[None, :]).to(kind), mask=keep
    )
    if COPY_TAIL:  # partial rotary: elements R … D-1 pass through
        for t0 in range(2 * half, dim, BLOCK_TAIL):
            t = t0 + tl.arange(0, BLOCK_TAIL)
            tail_keep = (h[:, None] < heads) & (t[None, :] < dim)
            tail = tl.load(x_row + t[None, :] * stride_xd, mask=tail_keep, other=0.0)
            tl.store(o_row + t[None, :] * stride_od, tail.to(kind), mask=tail_keep)


def _bhsd_strides(t, layout):
    s = t.stride()
    return s if layout == "bhsd" else (s[0], s[2], s[1], s[3])


def apply_rope_triton(x, cos, sin, positions, pos_offset, *, interleaved, layout, inplace):
    """x: torch tensor ("bhsd" or "bshd"); positions: int64 tensor [S] or [B, S], or None for
    ``pos_offset + s``. Returns the rotated tensor (x itself when ``inplace``)."""
    batch = x.shape[0]
    heads, seq = (x.shape[1], x.shape[2]) if layout == "bhsd" else (x.shape[2], x.shape[1])
    dim, half = x.shape[3], cos.shape[1]
    via_fp32 = low_precision_via_fp32(x.dtype)
    if inplace and not via_fp32:
        out = x
    else:
        out = torch.empty(x.shape, dtype=torch.float32 if via_fp32 else x.dtype, device=x.device)
    pos = (
        positions
        if positions is not None
        else torch.zeros((1, 1), dtype=torch.int64, device=x.device)
    )
    pos_strides = (0, pos.stride(0)) if pos.dim() == 1 else (pos.stride(0), pos.stride(1))
    block_h = min(16, next_pow2(heads, 1))
    grid = (batch * seq, triton.cdiv(heads, block_h))
    if batch * seq and heads:
        _apply_rope_kernel[grid](
            x, out, cos, sin, pos, heads, seq, half, dim, pos_offset,
            *_bhsd_strides(x, layout), *_bhsd_strides(out, layout), cos.stride(0), *pos_strides,
            HAS_POSITIONS=positions is not None, INTERLEAVED=interleaved,
            COPY_TAIL=out is not x and 2 * half < dim,
            BLOCK_H=block_h, BLOCK_F=next_pow2(half, 1), BLOCK_TAIL=next_pow2(min(dim - 2 * half, 64), 1),
        )  # fmt: skip
    if via_fp32:
        result = out.to(x.dtype)
        return x.copy_(result) if inplace else result
    return out
