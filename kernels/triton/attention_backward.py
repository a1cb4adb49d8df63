"""Attention's backward pass (Triton), FlashAttention-2 style.

Logical shapes: q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] (q and k already
rotated by RoPE), grad_out [B, Hq, Sq, Dv], lse and delta [B, Hq, Sq] (fp32)
          -> dq [B, Hq, Sq, D], dk [B, Hkv, Sk, D], dv [B, Hkv, Sk, Dv] (fp32).

Two launches of one kernel recompute the scores tile by tile, P = exp(s - lse) from the
forward's lse (no [Sq, Sk] matrix is held; docs/math.md#attention-backward): in the first, one
program per (key block, batch, kv head) accumulates dK and dV over the query blocks of every
query head of its group (GQA sums there, without atomics); in the second (DQ), one program per
(query block, batch, query head) accumulates dQ over its keys. No element is written by two programs: the result does not depend on
scheduling. Everything is computed in fp32 with IEEE dots (the launcher widens half inputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fastpe.kernels.triton._attention_common import (
    alibi_slope,
    modify_scores,
    score_args,
    score_param_args,
)
from fastpe.kernels.triton._common import LOG2E, interpreted, next_pow2


@triton.jit
def _tile_grads(
    row_tiles, kv_tiles, rows, cols, row_ok, col_ok, qpos, b, h, slope, mods, MODS: tl.constexpr
):
    """(P, dZ, dS, T5 buckets) of one [rows, cols] tile from ``_row_tiles`` and ``_kv_tiles``:
    s = q·kᵀ (q pre-scaled), soft-cap, window (the causal rule is its right edge 0), masks,
    ALiBi, T5 bias; P = exp(s - lse); dZ = P∘(dO·vᵀ - delta); dS = dZ∘(1 - tanh²). The buckets
    are 0 without a T5 bias. ``mods`` and ``MODS``: the score modifiers' arguments and
    constexprs (see the kernel)."""
    q, do, lse, delta = row_tiles
    k, v = kv_tiles
    score_params, relative_bias, mask = mods
    HAS_SOFTCAP: tl.constexpr = MODS[0]
    s, valid, t, bucket = modify_scores(
        tl.dot(q, tl.trans(k), input_precision="ieee"),
        rows,
        cols,
        row_ok[:, None] & col_ok[None, :],
        qpos,
        b,
        h,
        False,
        slope,
        tl.zeros_like(qpos),  # the full ALiBi distances: lse is the forward's, offset included
        score_params,
        relative_bias,
        mask,
        False,  # the causal rule is the window's right edge
        True,
        *MODS,
    )
    seen = lse > float("-inf")  # rows that saw no key have P = 0
    ref = tl.where(seen, lse, 0.0)
    p = tl.where(valid & seen[:, None], tl.exp2((s - ref[:, None]) * LOG2E), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision="ieee")
    dz = p * (dp - delta[:, None])
    ds = dz
    if HAS_SOFTCAP:
        ds = dz * (1.0 - t * t)
    return p, dz, ds, bucket


@triton.jit
def _row_tiles(inputs, sizes, b, h, rows, scale, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """(q·scale, dO, lse, delta) of one block of rows of one (batch, query head)."""
    q_ptr, _, _, do_ptr, lse_ptr, delta_ptr = inputs
    Hq, _, Sq, _, D, Dv = sizes
    row_ok = rows < Sq
    dcols = tl.arange(0, BLOCK_D)
    vcols = tl.arange(0, BLOCK_DV)
    base = (b * Hq + h) * Sq
    q = (
        tl.load(
            q_ptr + (base + rows[:, None]) * D + dcols[None, :],
            mask=row_ok[:, None] & (dcols[None, :] < D),
            other=0.0,
        )
        * scale
    )
    do = tl.load(
        do_ptr + (base + rows[:, None]) * Dv + vcols[None, :],
        mask=row_ok[:, None] & (vcols[None, :] < Dv),
        other=0.0,
    )
    lse = tl.load(lse_ptr + base + rows, mask=row_ok, other=float("-inf"))
    delta = tl.load(delta_ptr + base + rows, mask=row_ok, other=0.0)
    return q, do, lse, delta


@triton.jit
def _kv_tiles(inputs, sizes, b, hk, cols, col_ok, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """(k, v) of one block of keys of one (batch, kv head)."""
    _, k_ptr, v_ptr, _, _, _ = inputs
    _, Hkv, _, Sk, D, Dv = sizes
    dcols = tl.arange(0, BLOCK_D)
    vcols = tl.arange(0, BLOCK_DV)
    kv_row = (b * Hkv + hk) * Sk + cols
    k = tl.load(
        k_ptr + kv_row[:, None] * D + dcols[None, :],
        mask=col_ok[:, None] & (dcols[None, :] < D),
        other=0.0,
    )
    v = tl.load(
        v_ptr + kv_row[:, None] * Dv + vcols[None, :],
        mask=col_ok[:, None] & (vcols[None, :] < Dv),
        other=0.0,
    )
    return k, v


@triton.jit
def _key_end(
    key_len_ptr, b, Sq, Sk, query_shift, HAS_KEY_LEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr
):
    """(the keys of batch b, the key position of its query 0)."""
    end_keys = Sk
    shift = query_shift
    if HAS_KEY_LEN:
        end_keys = tl.load(key_len_ptr + b)
        if BOTTOM_RIGHT:
            shift = end_keys - Sq
    return end_keys, shift


@triton.jit
def _dkdv_program(
    program,
    MODS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """dK and dV of key block program_id(0) of (batch b, kv head hk), summed over the query
    blocks of every query head of its group (``program``: see the kernel)."""
    inputs, grads, sizes, b, hk, end_keys, shift, alibi, mods, scale = program
    Hq, Hkv, Sq, Sk, D, Dv = sizes
    dk_ptr, dv_ptr = grads
    HAS_ALIBI: tl.constexpr = MODS[1]
    pid_n = tl.program_id(0).to(tl.int64)
    group = Hq // Hkv
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < end_keys
    kv_tiles = _kv_tiles(inputs, sizes, b, hk, cols, col_ok, BLOCK_D, BLOCK_DV)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
    # the queries that can see a key of this block: j - win_right <= i + shift <= j + win_left
    (win_left, win_right), _ = mods[0]
    lo = tl.maximum(pid_n * BLOCK_N - win_right - shift, 0)
    lo = (lo // BLOCK_M) * BLOCK_M
    hi = tl.minimum(pid_n * BLOCK_N + BLOCK_N + win_left - shift, Sq)
    for g in range(group):
        h = hk * group + g
        slope = alibi_slope(alibi, b, h, HAS_ALIBI)
        for start in range(lo, hi, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_tiles = _row_tiles(inputs, sizes, b, h, rows, scale, BLOCK_D, BLOCK_DV)
            row_ok, qpos = rows < Sq, rows + shift
            p, dz, ds, bucket = _tile_grads(
                row_tiles, kv_tiles, rows, cols, row_ok, col_ok, qpos, b, h, slope, mods, MODS
            )
            q, do, lse, delta = row_tiles
            dv += tl.dot(tl.trans(p), do, input_precision="ieee")
            dk += tl.dot(tl.trans(ds), q, input_precision="ieee")
    dcols = tl.arange(0, BLOCK_D)
    vcols = tl.arange(0, BLOCK_DV)
    kv_row = (b * Hkv + hk) * Sk + cols
    tl.store(
        dk_ptr + kv_row[:, None] * D + dcols[None, :],
        dk,
        mask=(cols[:, None] < Sk) & (dcols[None, :] < D),
    )
    tl.store(
        dv_ptr + kv_row[:, None] * Dv + vcols[None, :],
        dv,
        mask=(cols[:, None] < Sk) & (vcols[None, :] < Dv),
    )


@triton.jit
def _dq_program(
    program,
    MODS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """dQ of query block program_id(0) of (batch b, query head h), and its share of the T5
    table's gradient (``program``: see the kernel)."""
    inputs, grads, sizes, b, h, end_keys, shift, alibi, mods, scale = program
    Hq, Hkv, Sq, _, D, _ = sizes
    dq_ptr, dtable_ptr = grads
    HAS_ALIBI: tl.constexpr = MODS[1]
    HAS_RELATIVE_BIAS: tl.constexpr = MODS[2]
    BUCKETS: tl.constexpr = MODS[3]
    pid_m = tl.program_id(0).to(tl.int64)
    hk = h // (Hq // Hkv)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Sq
    row_tiles = _row_tiles(inputs, sizes, b, h, rows, scale, BLOCK_D, BLOCK_DV)
    slope = alibi_slope(alibi, b, h, HAS_ALIBI)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    buckets = tl.arange(0, BLOCK_B)
    dtable = tl.zeros((BLOCK_B,), tl.float32)
    # the keys this block's queries can see: i + shift - win_left <= j <= i + shift + win_right
    (win_left, win_right), _ = mods[0]
    lo = tl.maximum(pid_m * BLOCK_M + shift - win_left, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.minimum(pid_m * BLOCK_M + BLOCK_M + shift + win_right, end_keys)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < end_keys
        kv_tiles = _kv_tiles(inputs, sizes, b, hk, cols, col_ok, BLOCK_D, BLOCK_DV)
        p, dz, ds, bucket = _tile_grads(
            row_tiles, kv_tiles, rows, cols, row_ok, col_ok, rows + shift, b, h, slope, mods, MODS
        )
        dq += tl.dot(ds, kv_tiles[0], input_precision="ieee")
        if HAS_RELATIVE_BIAS:  # dtable[n, h] += Σ dZ over this tile's (i, j) of bucket n
            for n in tl.static_range(BUCKETS):
                total = tl.sum(tl.sum(tl.where(bucket == n, dz, 0.0), 1), 0)
                dtable = tl.where(buckets == n, dtable + total, dtable)
    dcols = tl.arange(0, BLOCK_D)
    tl.store(
        dq_ptr + ((b * Hq + h) * Sq + rows[:, None]) * D + dcols[None, :],
        dq * scale,
        mask=row_ok[:, None] & (dcols[None, :] < D),
    )
    if HAS_RELATIVE_BIAS:  # this program's share, summed over programs in a fixed order
        tl.store(
            dtable_ptr + ((b * Hq + h) * tl.num_programs(0) + pid_m) * BLOCK_B + buckets, dtable
        )


@triton.jit
def _attention_backward_kernel(
    inputs,
    grads,
    mask,
    key_len_ptr,
    alibi,
    relative_bias,
    sizes,
    query_shift,
    window,
    scales,
    HAS_SOFTCAP: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
    HAS_KEY_LEN: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_RELATIVE_BIAS: tl.constexpr,
    RELATIVE_BIAS_BUCKETS: tl.constexpr,
    RELATIVE_BIAS_BIDIRECTIONAL: tl.constexpr,
    DQ: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One program of the dK/dV pass (axis 1: batch x kv head) or, when DQ, of the dQ pass
    (axis 1: batch x query head). inputs: (q, k, v, dO, lse, delta), contiguous; grads: (dK, dV)
    like k and v, or (dQ, dtable) when DQ: dtable [B, Hq, query blocks, BLOCK_B] gets each
    program's share of the T5 table's gradient; sizes: (Hq, Hkv, Sq, Sk, D, Dv); mask, alibi,
    relative_bias and the score_params (window, scales) as in _attention_common.

    Its arguments come in the order the two kernels it replaces took them (pointers, then
    sizes): the tuples only group them, so ptxas sees the same parameter list."""
    Hq, Hkv, Sq, Sk, _, _ = sizes
    pid_bh = tl.program_id(1).to(tl.int64)
    # the score modifiers' arguments, and their constexprs in modify_scores' order
    mods = ((window, scales), relative_bias, mask)
    MODS: tl.constexpr = (
        HAS_SOFTCAP,
        HAS_ALIBI,
        HAS_RELATIVE_BIAS,
        RELATIVE_BIAS_BUCKETS,
        RELATIVE_BIAS_BIDIRECTIONAL,
        HAS_MASK,
        MASK_IS_BOOL,
    )
    if DQ:  # b, query head
        b, head = pid_bh // Hq, pid_bh % Hq
    else:  # b, kv head
        b, head = pid_bh // Hkv, pid_bh % Hkv
    end_keys, shift = _key_end(key_len_ptr, b, Sq, Sk, query_shift, HAS_KEY_LEN, BOTTOM_RIGHT)
    program = (inputs, grads, sizes, b, head, end_keys, shift, alibi, mods, scales[0])
    if DQ:
        _dq_program(program, MODS, BLOCK_B, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV)
    else:
        _dkdv_program(program, MODS, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV)


# (BLOCK_M, BLOCK_N, num_warps) of the dK/dV and the dQ pass by head dim (64: D <= 64, 128,
# 256), one pipeline stage: the largest tiles whose fp32 accumulators stay in registers on sm_90
# with every feature on (`fastpe triton-report`: no spill but 4 stores in dQ at 256) and whose
# shared memory fits sm_80 and sm_120. Under the interpreter: 16 x 16.
_TILES = {
    64: ((64, 32, 8), (64, 32, 8)),
    128: ((32, 32, 8), (32, 16, 4)),
    256: ((16, 16, 4), (16, 16, 4)),
}


def tiles(d: int, dv: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(dK/dV tiles, dQ tiles) the launcher uses at head dims d, dv (also read by the AOT
    report)."""
    if interpreted():
        return (16, 16, 4), (16, 16, 4)
    widest = max(d, dv)
    return _TILES[64 if widest <= 64 else 128 if widest <= 128 else 256]


def _launch_args(
    dq, q, k, v, do, lse, delta, grads, *, options, mask=None, key_lengths=None, relative_bias=None
):
    batch, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    device = q.device
    (window, scales), param_flags = score_param_args(options, sq + sk + 1, causal_edge=True)
    (mask_arg, alibi_arg, bias_arg), score_flags = score_args(
        device,
        options,
        mask=mask,
        relative_bias=(relative_bias[0].float(), *relative_bias[1:])
        if relative_bias is not None
        else None,
    )
    args = (
        (q, k, v, do, lse, delta),
        grads,
        mask_arg,
        key_lengths
        if key_lengths is not None
        else torch.zeros(1, dtype=torch.int64, device=device),
        alibi_arg,
        bias_arg,
        (hq, hkv, sq, sk, d, dv),
        sk - sq if options.bottom_right else 0,
        window,
        scales,
    )
    dkdv_tiles, dq_tiles = tiles(d, dv)
    block_m, block_n, warps = dq_tiles if dq else dkdv_tiles
    constexprs = dict(
        **param_flags,
        HAS_KEY_LEN=key_lengths is not None,
        BOTTOM_RIGHT=options.bottom_right,
        **score_flags,
        DQ=dq,
        BLOCK_B=next_pow2(score_flags["RELATIVE_BIAS_BUCKETS"]),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=next_pow2(d),
        BLOCK_DV=next_pow2(dv),
        num_warps=warps,
        num_stages=1,
    )
    if dq:
        grid = (triton.cdiv(sq, block_m), batch * hq)
    else:
        grid = (triton.cdiv(sk, block_n), batch * hkv)
    return _attention_backward_kernel, grid, args, constexprs


def dkdv_launch_args(q, k, v, do, lse, delta, dk, dv, **arguments):
    """(kernel, grid, args, constexprs) of the dK/dV pass: the one place its arguments are
    assembled, for ``attention_backward_triton`` and ``fastpe triton-report`` (on meta
    tensors). q, k, v, do fp32 contiguous, lse and delta fp32 [B, Hq, Sq] contiguous, dk and dv
    like k and v; ``arguments`` the keywords of ``attention_backward_triton`` (``options``,
    ``mask``, ``key_lengths``, ``relative_bias``)."""
    return _launch_args(False, q, k, v, do, lse, delta, (dk, dv), **arguments)


def dq_launch_args(q, k, v, do, lse, delta, dq, dtable_part, **arguments):
    """As ``dkdv_launch_args`` for the dQ pass; dtable_part fp32 [B, Hq, query blocks,
    BLOCK_B] with a T5 bias (each program's share of the table's gradient), else [1]."""
    return _launch_args(True, q, k, v, do, lse, delta, (dq, dtable_part), **arguments)


def attention_backward_triton(
    q,
    k,
    v,
    out,
    lse,
    grad_out,
    grad_lse=None,
    *,
    options,
    mask=None,
    key_lengths=None,
    relative_bias=None,
):
    """Gradients of ``attention_triton``'s call (q and k already rotated) from its out, lse and
    the gradients of its results, on torch tensors (CUDA, or CPU under TRITON_INTERPRET=1).
    ``options`` the attention options (see ``_attention_common``; ALiBi slopes [B, Hq]);
    ``mask`` None or bool/float broadcast to [B, Hq, Sq, Sk]; ``relative_bias`` None or (table
    [num_buckets, Hq], num_buckets, max_distance, bidirectional). Returns (dq, dk, dv) fp32, dsinks fp32 [Hq] or None and
    the table's gradient fp32 [num_buckets, Hq] or None."""
    batch, hq, sq, d = q.shape
    sk, dv = k.shape[2], v.shape[3]
    device = q.device
    q, k, v, do = (x.float().contiguous() for x in (q, k, v, grad_out))
    lse = lse.float().contiguous()
    # D_i = Σ dO∘O - dlse: what every dZ of row i subtracts (docs/math.md#attention-backward)
    delta = (do * out.float()).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.float()
    delta = delta.contiguous()
    dsinks = None
    if options.sinks is not None:
        dsinks = -(torch.exp(options.sinks.float()[None, :, None] - lse) * delta).sum((0, 2))
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv_ = torch.zeros_like(v)
    num_buckets = relative_bias[1] if relative_bias is not None else 2
    n_mblocks = triton.cdiv(sq, tiles(d, dv)[1][0])
    dtable_part = torch.zeros(
        (batch, hq, n_mblocks, next_pow2(num_buckets)) if relative_bias is not None else (1,),
        dtype=torch.float32,
        device=device,
    )
    arguments = dict(
        options=options, mask=mask, key_lengths=key_lengths, relative_bias=relative_bias
    )
    if batch * hq * sq and sk:
        for kernel, grid, args, constexprs in (
            dkdv_launch_args(q, k, v, do, lse, delta, dk, dv_, **arguments),
            dq_launch_args(q, k, v, do, lse, delta, dq, dtable_part, **arguments),
        ):
            kernel[grid](*args, **constexprs)
    dtable = None
    if relative_bias is not None:
        dtable = dtable_part.sum((0, 2))[:, :num_buckets].T.contiguous()
    return dq, dk, dv_, dsinks, dtable
