"""Sinusoidal positional-encoding table on CUDA (Triton).

Logical shape: out [P, D]; row p is position offset + p; ω [D/2] (fp64).
interleaved: out[p, 2i] = sin(pω_i), out[p, 2i+1] = cos(pω_i); concat: out[p, i], out[p, D/2+i].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fastpe.kernels.triton._common import low_precision_via_fp32, next_pow2, position_sincos


@triton.jit
def _sinusoidal_table_kernel(
    out_ptr,
    omega_ptr,
    num_positions,
    offset,
    half,
    stride_out_pos,
    INTERLEAVED: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    rows, freqs, keep, sin, cos = position_sincos(
        out_ptr, omega_ptr, num_positions, offset, half, BLOCK_P, BLOCK_F
    )
    if INTERLEAVED:
        col_sin, col_cos = 2 * freqs, 2 * freqs + 1
    else:
        col_sin, col_cos = freqs, freqs + half
    row_ptr = out_ptr + rows[:, None] * stride_out_pos
    tl.store(row_ptr + col_sin[None, :], sin.to(out_ptr.dtype.element_ty), mask=keep)
    tl.store(row_ptr + col_cos[None, :], cos.to(out_ptr.dtype.element_ty), mask=keep)


def launch_args(out, omega, offset, interleaved):
    """(kernel, grid, args, constexprs) of the table kernel for out [P, D] and omega fp64
    [D/2]: the one place its arguments are assembled (``fastpe triton-report`` calls it on meta
    tensors)."""
    num_positions, half = out.shape[0], omega.shape[0]
    block_p, block_f = 32, min(128, next_pow2(half))
    grid = (triton.cdiv(num_positions, block_p), triton.cdiv(half, block_f))
    args = (out, omega, num_positions, offset, half, out.stride(0))
    constexprs = {"INTERLEAVED": interleaved, "BLOCK_P": block_p, "BLOCK_F": block_f}
    return _sinusoidal_table_kernel, grid, args, constexprs


def sinusoidal_table_triton(omega, num_positions, offset, interleaved, dtype, device):
    """omega: float64 NumPy [D/2]. Returns [num_positions, D] in ``dtype`` on ``device``."""
    half = omega.shape[0]
    store = torch.float32 if low_precision_via_fp32(dtype) else dtype
    out = torch.empty((num_positions, 2 * half), dtype=store, device=device)
    if num_positions:
        omega_t = torch.as_tensor(omega, dtype=torch.float64, device=device)
        kernel, grid, args, constexprs = launch_args(out, omega_t, offset, interleaved)
        kernel[grid](*args, **constexprs)
    return out.to(dtype)
