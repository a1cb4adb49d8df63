"""Fused token embedding + positional encoding (+ token type) on CUDA (Triton), one pass.

Logical shapes: ids, token types [B·S]; positions [B, S] or offset + s; weight [V, D];
pe_table [P, D]; token_type_weight [T, D] -> out [B·S, D].
out[t] = scale · weight[ids[t]] + PE(pos[t]) [+ token_type_weight[tt[t]]], summed in fp32. The
sinusoidal PE is computed on the fly with the fp64 product (no table read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fastpe.kernels.triton._common import low_precision_via_fp32, next_pow2, sincos_of_product

PE_NONE, PE_SINUSOIDAL, PE_TABLE = 0, 1, 2


@triton.jit
def _embed_kernel(
    ids_ptr,
    weight_ptr,
    out_ptr,
    pos_ptr,
    omega_ptr,
    pe_ptr,
    type_ids_ptr,
    type_weight_ptr,
    tokens,
    seq,
    dim,
    half,
    pos_offset,
    scale,
    stride_w,
    stride_out,
    stride_pe,
    stride_tw,
    stride_pos_b,
    stride_pos_s,
    PE_KIND: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    HAS_TYPES: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    token_ok = t < tokens
    keep = token_ok[:, None] & (cols[None, :] < dim)
    ids = tl.load(ids_ptr + t, mask=token_ok, other=0)
    value = scale * tl.load(
        weight_ptr + ids[:, None] * stride_w + cols[None, :], mask=keep, other=0.0
    ).to(tl.float32)
    if HAS_TYPES:
        types = tl.load(type_ids_ptr + t, mask=token_ok, other=0)
        value += tl.load(
            type_weight_ptr + types[:, None] * stride_tw + cols[None, :], mask=keep, other=0.0
        ).to(tl.float32)
    if PE_KIND != 0:
        if HAS_POSITIONS:
            pos = tl.load(
                pos_ptr + (t // seq) * stride_pos_b + (t % seq) * stride_pos_s,
                mask=token_ok,
                other=0,
            )
        else:
            pos = pos_offset + t % seq
        if PE_KIND == 1:
            if INTERLEAVED:
                freq, is_cos = cols // 2, (cols % 2) == 1
            else:
                freq, is_cos = tl.where(cols < half, cols, cols - half), cols >= half
            omega = tl.load(omega_ptr + freq, mask=cols < dim, other=0.0)
            sin, cos = sincos_of_product(pos[:, None], omega[None, :])
            value += tl.where(is_cos[None, :], cos, sin)
        else:
            value += tl.load(
                pe_ptr + pos[:, None] * stride_pe + cols[None, :], mask=keep, other=0.0
            ).to(tl.float32)
    tl.store(
        out_ptr + t[:, None] * stride_out + cols[None, :],
        value.to(out_ptr.dtype.element_ty),
        mask=keep,
    )


def launch_args(
    ids,
    weight,
    out,
    positions,
    pos_offset,
    *,
    scale,
    pe,
    pe_table=None,
    omega=None,
    interleaved=True,
    token_type_ids=None,
    token_type_weight=None,
):
    """(kernel, grid, args, constexprs) of the embedding kernel writing out [B·S, D]: the one
    place its arguments are assembled (``fastpe triton-report`` calls it on meta tensors).
    ``omega`` fp64 tensor [D/2] for the sinusoidal PE; the rest as in ``embed_triton``."""
    batch, seq = ids.shape
    dim = weight.shape[1]
    device = weight.device
    dummy = torch.zeros(1, dtype=torch.float32, device=device)
    kind = {"sinusoidal": PE_SINUSOIDAL, "table": PE_TABLE}.get(pe, PE_NONE)
    pos = (
        positions
        if positions is not None
        else torch.zeros((1, 1), dtype=torch.int64, device=device)
    )
    pos_strides = (0, pos.stride(0)) if pos.dim() == 1 else (pos.stride(0), pos.stride(1))
    has_types = token_type_ids is not None
    types = token_type_ids.reshape(-1).to(torch.int64) if has_types else dummy.long()
    type_weight = token_type_weight if has_types else dummy[None]
    table = pe_table if kind == PE_TABLE else dummy[None]
    block_t, block_d = 16, min(256, next_pow2(dim))
    grid = (triton.cdiv(batch * seq, block_t), triton.cdiv(dim, block_d))
    args = (
        ids.reshape(-1).to(torch.int64),
        weight,
        out,
        pos,
        omega if kind == PE_SINUSOIDAL else dummy.double(),
        table,
        types,
        type_weight,
        batch * seq,
        seq,
        dim,
        dim // 2,
        pos_offset,
        float(scale),
        weight.stride(0),
        out.stride(0),
        table.stride(0),
        type_weight.stride(0),
        *pos_strides,
    )
    constexprs = dict(
        PE_KIND=kind,
        HAS_POSITIONS=positions is not None,
        HAS_TYPES=has_types,
        INTERLEAVED=interleaved,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
    )
    return _embed_kernel, grid, args, constexprs


def embed_triton(ids, weight, positions, pos_offset, *, omega=None, **features):
    """ids int [B, S]; positions int64 tensor [S] or [B, S] or None (pos_offset + s); ``omega``
    the sinusoidal PE's frequencies [D/2] (any array; None without it); ``features`` the other
    keywords of ``launch_args`` (scale, pe, pe_table, interleaved, token types)."""
    batch, seq = ids.shape
    dim = weight.shape[1]
    device = weight.device
    store = torch.float32 if low_precision_via_fp32(weight.dtype) else weight.dtype
    out = torch.empty((batch * seq, dim), dtype=store, device=device)
    if batch * seq:
        kernel, grid, args, constexprs = launch_args(
            ids,
            weight,
            out,
            positions,
            pos_offset,
            omega=torch.as_tensor(omega, dtype=torch.float64, device=device)
            if features["pe"] == "sinusoidal"
            else None,
            **features,
        )
        kernel[grid](*args, **constexprs)
    return out.reshape(batch, seq, dim).to(weight.dtype)


# ---------------------------------------------------------------------------------------------
# Backward: the gradient of a row gather, out[r] = scale · Σ_{t : index[t] = r} grad[t].
# Tokens are sorted by row (stably, by torch) and one program sums one (row, column block) in
# token order: no atomics, so the result is the same on every run (deterministic on GPU too).


@triton.jit
def _scatter_rows_kernel(
    order_ptr,
    starts_ptr,
    rows_ptr,
    grad_ptr,
    out_ptr,
    dim,
    scale,
    stride_grad,
    stride_out,
    BLOCK_D: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    keep = cols < dim
    first = tl.load(starts_ptr + g)
    last = tl.load(starts_ptr + g + 1)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(first, last):
        t = tl.load(order_ptr + j)
        acc += tl.load(grad_ptr + t * stride_grad + cols, mask=keep, other=0.0).to(tl.float32)
    r = tl.load(rows_ptr + g)
    tl.store(out_ptr + r * stride_out + cols, (scale * acc).to(out_ptr.dtype.element_ty), mask=keep)


def scatter_rows_launch_args(order, starts, rows, grad, out, scale):
    """(kernel, grid, args, constexprs) of the row-gather gradient kernel: tokens ``order``
    sorted by row, group g of ``rows`` summing order[starts[g]:starts[g + 1]] of grad [T, D]
    into out [num_rows, D]. The one place its arguments are assembled (``fastpe
    triton-report`` calls it on meta tensors)."""
    dim = grad.shape[1]
    block_d = min(256, next_pow2(dim))
    grid = (rows.shape[0], triton.cdiv(dim, block_d))
    args = (order, starts, rows, grad, out, dim, float(scale), grad.stride(0), out.stride(0))
    return _scatter_rows_kernel, grid, args, {"BLOCK_D": block_d}


def scatter_rows_triton(index, grad, num_rows, scale=1.0):
    """The gradient of ``table[index]`` for a table of ``num_rows`` rows: index int [...], grad
    [..., D] fp16/bf16/fp32 (summed in fp32, rounded once). Returns [num_rows, D] in grad's dtype;
    rows no index names are zero."""
    dim = grad.shape[-1]
    flat = index.reshape(-1).to(torch.int64)
    grad = grad.reshape(flat.numel(), dim)
    if grad.stride(-1) != 1:  # e.g. an expanded gradient (stride 0)
        grad = grad.contiguous()
    ordered, order = torch.sort(flat, stable=True)
    rows, counts = torch.unique_consecutive(ordered, return_counts=True)
    starts = torch.zeros(rows.numel() + 1, dtype=torch.int64, device=grad.device)
    torch.cumsum(counts, 0, out=starts[1:])
    store = torch.float32 if low_precision_via_fp32(grad.dtype) else grad.dtype
    out = torch.zeros((num_rows, dim), dtype=store, device=grad.device)
    if rows.numel():
        kernel, grid, args, constexprs = scatter_rows_launch_args(
            order, starts, rows, grad, out, scale
        )
        kernel[grid](*args, **constexprs)
    return out.to(grad.dtype)
