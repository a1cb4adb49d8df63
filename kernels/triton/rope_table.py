"""RoPE cos/sin tables on CUDA (Triton).

Logical shapes: cos, sin [P, R/2]; cos[p, i] = attention_factor · cos((offset + p) · inv_freq[i]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fastpe.kernels.triton._common import low_precision_via_fp32, next_pow2, sincos_of_product


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
    pid_p = tl.program_id(0).to(tl.int64)
    pid_f = tl.program_id(1).to(tl.int64)
    rows = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    freqs = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    inv_freq = tl.load(inv_freq_ptr + freqs, mask=freqs < half, other=0.0)
    sin, cos = sincos_of_product(
        (rows + offset)[:, None], inv_freq[None, :], cos_ptr.dtype.element_ty == tl.float64
    )
    keep = (rows[:, None] < num_positions) & (freqs[None, :] < half)
    at = rows[:, None] * stride_pos + freqs[None, :]
    tl.store(cos_ptr + at, (factor * cos).to(cos_ptr.dtype.element_ty), mask=keep)
    tl.store(sin_ptr + at, (factor * sin).to(sin_ptr.dtype.element_ty), mask=keep)


def rope_table_triton(inv_freq, attention_factor, num_positions, offset, dtype, device):
    half = inv_freq.shape[0]
    store = torch.float32 if low_precision_via_fp32(dtype) else dtype
    cos = torch.empty((num_positions, half), dtype=store, device=device)
    sin = torch.empty_like(cos)
    block_p, block_f = 32, min(128, next_pow2(half))
    if num_positions:
        _rope_table_kernel[(triton.cdiv(num_positions, block_p), triton.cdiv(half, block_f))](
            cos,
            sin,
            torch.as_tensor(inv_freq, dtype=torch.float64, device=device),
            num_positions,
            offset,
            half,
            cos.stride(0),
            float(attention_factor),
            BLOCK_P=block_p,
            BLOCK_F=block_f,
        )
    return cos.to(dtype), sin.to(dtype)
