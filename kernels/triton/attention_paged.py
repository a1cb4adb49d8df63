"""Flash-style attention over packed queries and keys read through a page table (Triton).

The Triton twin of ``fastpe.kernels.numba.attention_paged``, for packed variable-length
batches and KV caches (paged or contiguous) alike. Shapes:

- q [Tq, Hq, D]: sequence b's queries are rows q_start[b] … q_start[b] + q_len[b] - 1;
- k [R, Hkv, D], v [R, Hkv, Dv]: key j of sequence b (j < k_len[b]) is physical row
  ``page_start[b, j // page_size] + j % page_size``;
- out [Tq, Hq, Dv], lse [Hq, Tq] (float32, natural log).

Quantized caches (KV_QUANT 1: float8_e4m3fn read as its uint8 bits; 2: int8) are widened in
registers and dequantized per key: the scores of key row r times k_scale[b, r, hk], its weights
times v_scale[b, r, hk] before P·V (fp8 and int8 values are exact in q's half type, so the
tensor-core dots see them unrounded).

One program = (block of one sequence's queries, sequence and query head, key split), laid out
as ``program_ids`` of ``_attention_common`` says; programs whose block lies past their
sequence's queries return at once, so the grid is sized by the
longest sequence but no work is done for the others' padding. Keys past k_len[b] are never
read. The options arrive as one record (``options``, described in ``_attention_common``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fastpe.kernels.triton._attention_common import (
    alibi_near,
    alibi_slope,
    epilogue,
    forward_flags,
    forward_grid,
    key_range,
    modify_scores,
    program_ids,
    pv_product,
    qk_scores,
    score_param_args,
    softmax_step,
)
from fastpe.kernels.triton._common import LOG2E, low_precision_via_fp32, next_pow2
from fastpe.kernels.triton.attention import merged, split_keys


@triton.jit
def dequantized(x, KV_QUANT: tl.constexpr):
    """A loaded cache tile as float32 values (before their scale): fp8 e4m3 bits decoded by
    integer arithmetic (no fp8 support needed in the hardware), int8 converted."""
    if KV_QUANT == 1:
        bits = x.to(tl.int32)
        mag = bits & 0x7F
        # exponent field e (bias 7) and mantissa placed in float32's, rebiased by 120
        normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        value = tl.where(mag < 8, mag.to(tl.float32) * 0.001953125, normal)  # subnormal: m·2^-9
        value = tl.where(mag == 0x7F, float("nan"), value)
        return tl.where(bits >= 128, -value, value)
    return x.to(tl.float32)


@triton.jit
def _attention_paged_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    pages,
    alibi_ptr,
    sinks_ptr,
    scale_ptrs,
    Hq,
    group,
    D,
    Dv,
    page_size,
    keys_per_split,
    window,
    strides,
    scales,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    DOT_FP32: tl.constexpr,
    KV_QUANT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """pages: (q_start, q_len, k_len, page_start) pointers; window and scales: the score_params
    of _attention_common; strides: ((q t, h, d), (k row, h, d), (v …), (out split, t, h, d),
    (lse split, t, h), (page_start b, page), (alibi b, h), (k_scale b, r, h), (v_scale …));
    scale_ptrs: (k_scale, v_scale), read when KV_QUANT. Pointers, then sizes, then strides: see
    _attention_kernel."""
    score_params = (window, scales)
    q_start_ptr, q_len_ptr, k_len_ptr, page_ptr = pages
    pid_m, split, b, h, hk = program_ids(Hq, group)
    q_len = tl.load(q_len_ptr + b)
    if pid_m * BLOCK_M >= q_len:  # this block is past the sequence's queries
        return
    qs, ks, vs, os, ls, ps, alibi_strides, kss, vss = strides
    k_scale_ptr, v_scale_ptr = scale_ptrs
    q0 = tl.load(q_start_ptr + b)
    length = tl.load(k_len_ptr + b)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    dcols = tl.arange(0, BLOCK_D)
    vcols = tl.arange(0, BLOCK_DV)
    q_tile = tl.load(
        q_ptr + (q0 + rows)[:, None] * qs[0] + h * qs[1] + dcols[None, :] * qs[2],
        mask=row_ok[:, None] & (dcols[None, :] < D),
        other=0.0,
    ).to(tl.float32)
    q_tile = q_tile * scales[0]
    if not DOT_FP32:
        q_tile = q_tile.to(q_ptr.dtype.element_ty)

    shift = 0
    if BOTTOM_RIGHT:  # FlashAttention's rule: the queries are the last q_len of the keys
        shift = length - q_len
    lo, hi = key_range(
        pid_m, split, length, shift, keys_per_split, score_params, CAUSAL, HAS_WINDOW, BLOCK_M
    )
    qpos_keys = rows + shift

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    slope = alibi_slope((alibi_ptr, alibi_strides), b, h, HAS_ALIBI)
    near = alibi_near(qpos_keys, length, HAS_ALIBI)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        # keys < 2^31: an int32 division, inline (an int64 one calls a routine, in every tile)
        page = cols.to(tl.int32) // page_size
        prow = tl.load(page_ptr + b * ps[0] + page * ps[1], mask=col_ok, other=0)
        prow = prow + (cols - page * page_size)
        k_tile = tl.load(
            k_ptr + prow[:, None] * ks[0] + hk * ks[1] + dcols[None, :] * ks[2],
            mask=col_ok[:, None] & (dcols[None, :] < D),
            other=0.0,
        )
        if KV_QUANT:
            s = qk_scores(q_tile, dequantized(k_tile, KV_QUANT).to(q_tile.dtype), DOT_FP32)
            s = (
                s
                * tl.load(
                    k_scale_ptr + b * kss[0] + prow * kss[1] + hk * kss[2], mask=col_ok, other=1.0
                )[None, :]
            )
        else:
            s = qk_scores(q_tile, k_tile, DOT_FP32)
        s, valid, _, _ = modify_scores(
            s,
            rows,
            cols,
            row_ok[:, None] & col_ok[None, :],
            qpos_keys,
            b,
            h,
            # the causal rule on every tile: skipping the tiles below the diagonal, as the dense
            # kernel does, costs this one up to 21 registers (fastpe triton-report)
            True,
            slope,
            near,
            score_params,
            None,  # no T5 bias
            None,  # no mask
            CAUSAL,
            HAS_WINDOW,
            HAS_SOFTCAP,
            HAS_ALIBI,
            False,
            2,
            False,
            False,
            False,
        )
        p, alpha, m_i, l_i = softmax_step(s, valid, m_i, l_i, LOG2E)
        v_tile = tl.load(
            v_ptr + prow[:, None] * vs[0] + hk * vs[1] + vcols[None, :] * vs[2],
            mask=col_ok[:, None] & (vcols[None, :] < Dv),
            other=0.0,
        )
        if KV_QUANT:
            v_tile = dequantized(v_tile, KV_QUANT).to(q_tile.dtype)
            p = (
                p
                * tl.load(
                    v_scale_ptr + b * vss[0] + prow * vss[1] + hk * vss[2], mask=col_ok, other=1.0
                )[None, :]
            )
        pv = pv_product(p, v_tile, DOT_FP32)
        acc = acc * alpha[:, None] + pv
    o, row_lse = epilogue(acc, m_i, l_i, slope, near, sinks_ptr, h, split, HAS_ALIBI, HAS_SINKS)
    t = q0 + rows
    o_ptrs = out_ptr + split * os[0] + t[:, None] * os[1] + h * os[2] + vcols[None, :] * os[3]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (vcols[None, :] < Dv))
    tl.store(lse_ptr + split * ls[0] + t * ls[1] + h * ls[2], row_lse, mask=row_ok)


def tiles(max_q: int, d: int, fp32: bool, capability: int) -> dict:
    """BLOCK_M, BLOCK_N, num_warps and num_stages that compile without register spills on
    sm_80/sm_90 (checked by ``fastpe triton-report``): thin query tiles for decoding, smaller
    tiles for fp32 and wide heads. From 64 queries a sequence, heads up to 128 wide take the
    dense forward's tiles: on sm_90 and later 128 x 64 with 8 warps (two warpgroups of HGMMA)
    from 128 queries and 64 x 64 with one warpgroup below (8 warps on 64 rows issue 1.5x the
    tile's tensor-core FLOPs: two warpgroups on one warpgroup's rows); before sm_90 64 x 64 with 8 warps and 2 stages (128-row
    tiles, and a third stage once the scores carry ALiBi, a window, a cap and sinks, spill)."""
    if fp32:
        return _tiles(16, 16)
    if max_q <= 16:
        return _tiles(16, 64 if d <= 128 else 32)
    if d <= 64:
        return _tiles(64, 64)
    if d <= 128 and max_q >= 64:
        if capability < 90:
            return _tiles(64, 64, num_warps=8, num_stages=2)
        if max_q >= 128:
            return _tiles(128, 64, num_warps=8)
        return _tiles(64, 64)
    return _tiles(32, 32, num_stages=3 if d <= 128 or capability >= 90 else 2)


def _tiles(block_m, block_n, num_warps=4, num_stages=3):
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)


def _capability(device) -> int:
    """The compute capability of a CUDA device as 10·major + minor; 90 elsewhere (the
    interpreter, meta tensors)."""
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def launch_args(
    q,
    k,
    v,
    part_out,
    part_lse,
    *,
    q_start,
    q_len,
    k_len,
    page_start,
    page_size,
    max_q,
    max_k,
    keys_per_split,
    options,
    capability=None,
    k_scale=None,
    v_scale=None,
):
    """(kernel, grid, args, constexprs) of the paged kernel: the one place its arguments are
    assembled, for ``attention_paged_triton`` and for ``fastpe triton-report`` (on meta
    tensors). part_out [n_splits, Tq, Hq, Dv], part_lse [n_splits, Tq, Hq]; ``max_q``/``max_k``
    the longest sequence's query and key counts; ``capability`` (e.g. 80) defaults to q's GPU
    (the report passes its target); the rest as in ``attention_paged_triton``."""
    hq, d = q.shape[1], q.shape[2]
    hkv, dv = k.shape[1], v.shape[2]
    dot_fp32 = low_precision_via_fp32(q.dtype) or q.dtype == torch.float32
    if capability is None:
        capability = _capability(q.device)
    sizes = tiles(max_q, d, dot_fp32, capability)
    dummy = torch.zeros(1, dtype=torch.float32, device=q.device)
    alibi = options.alibi_slopes if options.alibi_slopes is not None else dummy[None]
    (window, scales), param_flags = score_param_args(options, max_q + max_k + 1)
    kv_quant = {torch.float8_e4m3fn: 1, torch.int8: 2}.get(k.dtype, 0)
    if kv_quant == 1:  # read as bits, decoded in the kernel (any GPU, and the interpreter)
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    if kv_quant:
        # the decoded tiles take registers: 64-key tiles spilled on sm_80/sm_90 for fp8 at D 128;
        # wide heads keep the 64-row, 8-warp tiles checked for these caches
        if sizes["BLOCK_M"] >= 64 and d > 64:
            sizes.update(BLOCK_M=64, num_warps=8)
        sizes["BLOCK_N"] = min(sizes["BLOCK_N"], 32)
    else:
        k_scale = v_scale = dummy[None, None]
    args = (
        q,
        k,
        v,
        part_out,
        part_lse,
        (q_start, q_len, k_len, page_start),
        alibi,
        options.sinks if options.sinks is not None else dummy,
        (k_scale, v_scale),
        hq,
        hq // hkv,
        d,
        dv,
        page_size,
        keys_per_split,
        window,
        (
            q.stride(),
            k.stride(),
            v.stride(),
            part_out.stride(),
            part_lse.stride(),
            page_start.stride(),
            alibi.stride(),
            k_scale.stride(),
            v_scale.stride(),
        ),
        scales,
    )
    constexprs = dict(
        **forward_flags(options),
        **param_flags,
        HAS_ALIBI=options.alibi_slopes is not None,
        DOT_FP32=dot_fp32,
        KV_QUANT=kv_quant,
        **sizes,
        BLOCK_D=next_pow2(d),
        BLOCK_DV=next_pow2(dv),
    )
    grid = forward_grid(
        triton.cdiv(max_q, sizes["BLOCK_M"]), q_len.shape[0] * hq, part_out.shape[0]
    )
    return _attention_paged_kernel, grid, args, constexprs


def attention_paged_triton(
    q,
    k,
    v,
    *,
    q_start,
    q_len,
    k_len,
    page_start,
    page_size,
    max_q,
    max_k,
    options,
    num_sms=None,
    k_scale=None,
    v_scale=None,
):
    """Launch on torch tensors (CUDA, or CPU under TRITON_INTERPRET=1). q_start, q_len, k_len
    int64 [B] and page_start int64 [B, pages] on q's device; ``max_q``/``max_k`` (Python ints)
    the longest sequence's query and key counts, from the host values the caller validated
    (``int(q_len.max())`` here would be a host sync per call); ``options`` the attention options
    (see ``_attention_common``; ALiBi slopes [B, Hq]). Quantized caches: k/v float8_e4m3fn or
    int8 with float32 ``k_scale``/``v_scale`` [B or 1, R, Hkv] views (key row r of sequence b,
    kv head h, is worth ``k[r, h] · k_scale[b, r, h]``; a B of 1, stride 0 over it, serves every
    sequence). Returns (out [Tq, Hq, Dv] in q's dtype, lse fp32 [Hq, Tq])."""
    total_q, hq, d = q.shape
    dv = v.shape[2]
    batch = q_len.shape[0]
    device = q.device
    dot_fp32 = low_precision_via_fp32(q.dtype) or q.dtype == torch.float32
    capability = _capability(device)
    block_m = tiles(max_q, d, dot_fp32, capability)["BLOCK_M"]
    n_splits, keys_per_split, out_dtype = split_keys(
        triton.cdiv(max(max_q, 1), block_m) * batch * hq, max_q, max(max_k, 1), num_sms, q.dtype
    )
    part_out = torch.zeros((n_splits, total_q, hq, dv), dtype=out_dtype, device=device)
    part_lse = torch.full(
        (n_splits, total_q, hq), float("-inf"), dtype=torch.float32, device=device
    )
    if total_q * hq and max_k:
        kernel, grid, args, constexprs = launch_args(
            q,
            k,
            v,
            part_out,
            part_lse,
            q_start=q_start,
            q_len=q_len,
            k_len=k_len,
            page_start=page_start,
            page_size=page_size,
            max_q=max_q,
            max_k=max_k,
            keys_per_split=keys_per_split,
            options=options,
            capability=capability,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        kernel[grid](*args, **constexprs)
    elif options.sinks is not None:  # no key anywhere: lse is the sink
        part_lse[0] = options.sinks[None, :]
    out, lse = merged(part_out, part_lse)
    return out.to(q.dtype), lse.transpose(0, 1).contiguous()
