"""RoPE cos/sin tables on CUDA (Triton).

Logical shapes: cos, sin [P, R/2]; cos[p, i] = attention_factor · cos((offset + p) · inv_freq[i]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fastpe.kernels.triton._common import low_precision_via_fp32, next_pow2, position_sincos


@triton.jit
def _rope_table_kernel(
    cos_ptr,
    sin_ptr,
    inv_freq_ptr,
    num_positions,
    offset,
    half,
    stride_pos,
    factor,
    BLOCK_P: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    rows, freqs, keep, sin, cos = position_sincos(
        cos_ptr, inv_freq_ptr, num_positions, offset, half, BLOCK_P, BLOCK_F
    )
    at = rows[:, None] * stride_pos + freqs[None, :]
    tl.store(cos_ptr + at, (factor * cos).to(cos_ptr.dtype.element_ty), mask=keep)
    tl.store(sin_ptr + at, (factor * sin).to(sin_ptr.dtype.element_ty), mask=keep)


def launch_args(cos, sin, inv_freq, offset, attention_factor):
    """(kernel, grid, args, constexprs) of the table kernel for cos, sin [P, R/2] and inv_freq
    fp64 [R/2]: the one place its arguments are assembled (``fastpe triton-report`` calls it
    on meta tensors)."""
    num_positions, half = cos.shape
    block_p, block_f = 32, min(128, next_pow2(half))
    grid = (triton.cdiv(num_positions, block_p), triton.cdiv(half, block_f))
    args = (cos, sin, inv_freq, num_positions, offset, half, cos.stride(0), float(attention_factor))
    return _rope_table_kernel, grid, args, {"BLOCK_P": block_p, "BLOCK_F": block_f}


def rope_table_triton(inv_freq, attention_factor, num_positions, offset, dtype, device):
    half = inv_freq.shape[0]
    store = torch.float32 if low_precision_via_fp32(dtype) else dtype
    cos = torch.empty((num_positions, half), dtype=store, device=device)
    sin = torch.empty_like(cos)
    if num_positions:
        inv_freq = torch.as_tensor(inv_freq, dtype=torch.float64, device=device)
        kernel, grid, args, constexprs = launch_args(cos, sin, inv_freq, offset, attention_factor)
        kernel[grid](*args, **constexprs)
    return cos.to(dtype), sin.to(dtype)
