"""Attention's backward pass (Triton), FlashAttention-2 style.

Logical shapes: q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] (q and k already
rotated by RoPE), grad_out [B, Hq, Sq, Dv], lse and delta [B, Hq, Sq] (fp32)
          -> dq [B, Hq, Sq, D], dk [B, Hkv, Sk, D], dv [B, Hkv, Sk, Dv] (fp32).

A first small launch computes delta_i = Σ dO∘O - dlse per query row (fp32). Then two launches
of one kernel recompute the scores tile by tile, P = exp(s - lse) from the forward's lse (no
[Sq, Sk] matrix is held; docs/math.md#attention-backward): in the first, one program per (key
block, batch, kv head) accumulates dK and dV over the query blocks of every query head of its
group (GQA sums there, without atomics); in the second (DQ), one program per (query block,
batch, query head) accumulates dQ over its keys. No element is written by two programs: the
result does not depend on scheduling.

The five products per tile are FlashAttention-2's: S = Q·Kᵀ and dP = dO·Vᵀ (both passes),
dV += Pᵀ·dO and dK += dSᵀ·Q (first pass), dQ += dS·K (second pass). q, k, v and dO are read in
their own dtype; fp16/bf16 feed the tensor cores in that dtype with fp32 accumulation (P and dS
rounded to it before their products, as FlashAttention does; q·scale rounded once, as in the
forward), fp32 gets IEEE fp32 dots (no TF32). Everything else (softmax, score modifiers,
dS, the accumulators) is fp32. Under the interpreter bf16 dots are wrong (Triton 3.9), so bf16
tiles are widened to fp32 as they are loaded there.
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
from fastpe.kernels.triton._common import LOG2E, interpreted, low_precision_via_fp32, next_pow2
from fastpe.kernels.triton.attention import _per_element_bias


@triton.jit
def _dot(a, b):
    """a·b accumulated in fp32: IEEE fp32 products for fp32 tiles (Triton's fp32 default is
    TF32), the tensor cores in the tiles' dtype for fp16/bf16."""
    if a.dtype == tl.float32:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _operand(x, ref_ptr, DOT_FP32: tl.constexpr):
    """A loaded tile as the dots take it: fp32 when DOT_FP32, else the dtype of ``ref_ptr``'s
    elements (v's: the inputs' dtype)."""
    if DOT_FP32:
        y = x.to(tl.float32)
    else:
        y = x.to(ref_ptr.dtype.element_ty)
    return y


@triton.jit
def _tile_grads(
    qk, dp, row_tiles, rows, cols, row_ok, col_ok, qpos, b, h, slope, mods, MODS: tl.constexpr
):
    """(P, dZ, dS, T5 buckets) of one [rows, cols] tile from its products ``qk`` = q·kᵀ (q
    pre-scaled) and ``dp`` = dO·vᵀ and ``_row_tiles``: soft-cap, window (the causal rule is its
    right edge 0), masks, ALiBi, T5 bias; P = exp(s - lse); dZ = P∘(dp - delta); dS =
    dZ∘(1 - tanh²), all fp32. The buckets are 0 without a T5 bias. ``mods`` and ``MODS``: the
    score modifiers' arguments and constexprs (see the kernel)."""
    _, _, lse, delta = row_tiles
    score_params, relative_bias, mask = mods
    HAS_SOFTCAP: tl.constexpr = MODS[0]
    s, valid, t, bucket = modify_scores(
        qk,
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
    dz = p * (dp - delta[:, None])
    ds = dz
    if HAS_SOFTCAP:
        ds = dz * (1.0 - t * t)
    return p, dz, ds, bucket


@triton.jit
def _row_tiles(
    inputs,
    sizes,
    b,
    h,
    rows,
    scale,
    DOT_FP32: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """(q·scale, dO, lse, delta) of one block of rows of one (batch, query head), q and dO as
    the dots take them."""
    q_ptr, _, v_ptr, do_ptr, lse_ptr, delta_ptr = inputs
    Hq, _, Sq, _, D, Dv = sizes
    row_ok = rows < Sq
    dcols = tl.arange(0, BLOCK_D)
    vcols = tl.arange(0, BLOCK_DV)
    base = (b * Hq + h) * Sq
    q = tl.load(
        q_ptr + (base + rows[:, None]) * D + dcols[None, :],
        mask=row_ok[:, None] & (dcols[None, :] < D),
        other=0.0,
    )
    q = _operand(q.to(tl.float32) * scale, v_ptr, DOT_FP32)
    do = tl.load(
        do_ptr + (base + rows[:, None]) * Dv + vcols[None, :],
        mask=row_ok[:, None] & (vcols[None, :] < Dv),
        other=0.0,
    )
    lse = tl.load(lse_ptr + base + rows, mask=row_ok, other=float("-inf"))
    delta = tl.load(delta_ptr + base + rows, mask=row_ok, other=0.0)
    return q, _operand(do, v_ptr, DOT_FP32), lse, delta


@triton.jit
def _kv_tiles(
    inputs,
    sizes,
    b,
    hk,
    cols,
    col_ok,
    DOT_FP32: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """(k, v) of one block of keys of one (batch, kv head), as the dots take them."""
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
    return _operand(k, v_ptr, DOT_FP32), _operand(v, v_ptr, DOT_FP32)


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
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """dK and dV of key block ``pid_n`` of (batch b, kv head hk), summed over the query blocks
    of every query head of its group (``program``: see the kernel)."""
    inputs, grads, sizes, pid_n, b, hk, end_keys, shift, alibi, mods, scale = program
    Hq, Hkv, Sq, Sk, D, Dv = sizes
    dk_ptr, dv_ptr = grads
    HAS_ALIBI: tl.constexpr = MODS[1]
    group = Hq // Hkv
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < end_keys
    k, v = _kv_tiles(inputs, sizes, b, hk, cols, col_ok, DOT_FP32, BLOCK_D, BLOCK_DV)
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
            row_tiles = _row_tiles(inputs, sizes, b, h, rows, scale, DOT_FP32, BLOCK_D, BLOCK_DV)
            row_ok, qpos = rows < Sq, rows + shift
            q, do = row_tiles[0], row_tiles[1]
            if DOT_FP32:
                qk = _dot(q, tl.trans(k))
                dp = _dot(do, tl.trans(v))
            else:
                # the products transposed, [keys, rows]: k and v are the dots' first operands,
                # which the tensor cores' layout splits across warps (as second operands every
                # warp would hold all of them), and Pᵀ and dSᵀ come out as dV's and dK's
                qk = tl.trans(_dot(k, tl.trans(q)))
                dp = tl.trans(_dot(v, tl.trans(do)))
            p, dz, ds, bucket = _tile_grads(
                qk, dp, row_tiles, rows, cols, row_ok, col_ok, qpos, b, h, slope, mods, MODS
            )
            dv += _dot(tl.trans(p).to(do.dtype), do)
            dk += _dot(tl.trans(ds).to(q.dtype), q)
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
    n_blocks,
    MODS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """dQ of query block ``pid_m`` (of ``n_blocks``) of (batch b, query head h), and its share
    of the T5 table's gradient (``program``: see the kernel)."""
    inputs, grads, sizes, pid_m, b, h, end_keys, shift, alibi, mods, scale = program
    Hq, Hkv, Sq, _, D, _ = sizes
    dq_ptr, dtable_ptr = grads
    HAS_ALIBI: tl.constexpr = MODS[1]
    HAS_RELATIVE_BIAS: tl.constexpr = MODS[2]
    BUCKETS: tl.constexpr = MODS[3]
    hk = h // (Hq // Hkv)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Sq
    row_tiles = _row_tiles(inputs, sizes, b, h, rows, scale, DOT_FP32, BLOCK_D, BLOCK_DV)
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
        k, v = _kv_tiles(inputs, sizes, b, hk, cols, col_ok, DOT_FP32, BLOCK_D, BLOCK_DV)
        q, do = row_tiles[0], row_tiles[1]
        qk = _dot(q, tl.trans(k))
        dp = _dot(do, tl.trans(v))
        p, dz, ds, bucket = _tile_grads(
            qk, dp, row_tiles, rows, cols, row_ok, col_ok, rows + shift, b, h, slope, mods, MODS
        )
        dq += _dot(ds.to(k.dtype), k)
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
        tl.store(dtable_ptr + ((b * Hq + h) * n_blocks + pid_m) * BLOCK_B + buckets, dtable)


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
    DOT_FP32: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One program of the dK/dV pass (a key block of one batch x kv head) or, when DQ, of the
    dQ pass (a query block of one batch x query head): axis 0 numbers the (block, batch x
    head) pairs, the block fastest, so the grid's one axis holds up to 2^31 - 1 programs.
    inputs: (q, k, v, dO, lse, delta), contiguous, q/k/v/dO in one dtype; grads: (dK, dV) like
    k and v in fp32, or (dQ, dtable) when DQ: dtable [B, Hq, query blocks, BLOCK_B] gets each
    program's share of the T5 table's gradient; sizes: (Hq, Hkv, Sq, Sk, D, Dv); mask, alibi,
    relative_bias and the score_params (window, scales) as in _attention_common. DOT_FP32:
    IEEE fp32 dots on tiles widened to fp32 (fp32 inputs, and bf16 under the interpreter).

    Its arguments come in the order the two kernels it replaces took them (pointers, then
    sizes): the tuples only group them, so ptxas sees the same parameter list."""
    Hq, Hkv, Sq, Sk, _, _ = sizes
    pid = tl.program_id(0).to(tl.int64)
    # (a size of 1 arrives as a constexpr: no tl.cdiv(...).to() on it)
    if DQ:
        n_blocks = (Sq + BLOCK_M - 1) // BLOCK_M
    else:
        n_blocks = (Sk + BLOCK_N - 1) // BLOCK_N
    block = pid % n_blocks
    pid_bh = pid // n_blocks
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
    program = (inputs, grads, sizes, block, b, head, end_keys, shift, alibi, mods, scales[0])
    if DQ:
        _dq_program(program, n_blocks, MODS, DOT_FP32, BLOCK_B, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV)
    else:
        _dkdv_program(program, MODS, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV)


@triton.jit
def _delta_kernel(
    do_ptr,
    out_ptr,
    dlse_ptr,
    delta_ptr,
    n_rows,
    Dv,
    HAS_DLSE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """delta = Σ dO∘O - dlse of BLOCK_R rows (of the contiguous [n_rows, Dv] dO and O, in
    their own dtype), in fp32."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    vcols = tl.arange(0, BLOCK_DV)
    ok = row_ok[:, None] & (vcols[None, :] < Dv)
    offsets = rows[:, None] * Dv + vcols[None, :]
    do = tl.load(do_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    out = tl.load(out_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    delta = tl.sum(do * out, 1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(delta_ptr + rows, delta, mask=row_ok)


# (BLOCK_M, BLOCK_N, num_warps) of the dK/dV and the dQ pass by dots (IEEE fp32, or the tensor
# cores in fp16/bf16) and head dim (64: D <= 64, 128, 256), one pipeline stage, picked from
# `fastpe triton-report` compiles for sm_80 and sm_90 (causal, and every feature on): the
# tensor-core tiles do not spill there; on some fp32-dot compiles ptxas stops at 128 registers
# and spills a few words (up to 40 bytes of stack), which no tile tried avoided everywhere.
# Shared memory fits sm_80 and sm_120. On the tensor cores Triton gives every warp whole rows
# of a product ([warps, 1]), so the dK/dV pass needs BLOCK_N >= 16 x warps and the dQ pass
# BLOCK_M >= 16 x warps. Under the interpreter: 16 x 16.
_TILES = {
    (True, 64): ((32, 64, 8), (32, 16, 4)),
    (True, 128): ((32, 32, 8), (16, 32, 4)),
    (True, 256): ((16, 16, 4), (32, 16, 8)),
    (False, 64): ((16, 64, 4), (64, 16, 4)),
    (False, 128): ((16, 64, 4), (64, 32, 4)),
}
# with a per-element bias, where it differs: the fp32-dot dQ pass at head dim 128 spills at
# 16 x 32 (4 warps) with every feature on, not at 16 x 16 (2 warps)
_BIASED_TILES = {(True, 128): ((32, 32, 8), (16, 16, 2))}


def dot_fp32(dtype: torch.dtype, d: int, dv: int, biased: bool) -> bool:
    """Whether the kernel widens tiles of ``dtype`` to fp32 for IEEE dots rather than feeding
    them to the tensor cores: fp32; bf16 under the interpreter; heads wider than 128, and wider
    than 64 with a per-element bias (ALiBi, T5, an additive mask), whose tensor-core tiles
    spill (dK and dV's accumulators alone take D/2 registers each per thread there)."""
    widest = max(d, dv)
    return (
        dtype == torch.float32
        or low_precision_via_fp32(dtype)
        or widest > 128
        or (widest > 64 and biased)
    )


def tiles(
    d: int, dv: int, dtype: torch.dtype = torch.float32, biased: bool = False
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(dK/dV tiles, dQ tiles) the launcher uses at head dims d, dv for inputs of ``dtype``,
    ``biased``: with a per-element bias (also read by the AOT report)."""
    if interpreted():
        return (16, 16, 4), (16, 16, 4)
    widest = max(d, dv)
    dclass = 64 if widest <= 64 else 128 if widest <= 128 else 256
    key = (dot_fp32(dtype, d, dv, biased), dclass)
    return _BIASED_TILES.get(key, _TILES[key]) if biased else _TILES[key]


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
    biased = _per_element_bias(score_flags)
    dkdv_tiles, dq_tiles = tiles(d, dv, v.dtype, biased)
    block_m, block_n, warps = dq_tiles if dq else dkdv_tiles
    constexprs = dict(
        **param_flags,
        HAS_KEY_LEN=key_lengths is not None,
        BOTTOM_RIGHT=options.bottom_right,
        **score_flags,
        DQ=dq,
        DOT_FP32=dot_fp32(v.dtype, d, dv, biased),
        BLOCK_B=next_pow2(score_flags["RELATIVE_BIAS_BUCKETS"]),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=next_pow2(d),
        BLOCK_DV=next_pow2(dv),
        num_warps=warps,
        num_stages=1,
    )
    # one axis, (blocks) x (batch x heads): axis 1 would stop at 65535 batch x heads
    if dq:
        grid = (triton.cdiv(sq, block_m) * batch * hq,)
    else:
        grid = (triton.cdiv(sk, block_n) * batch * hkv,)
    return _attention_backward_kernel, grid, args, constexprs


def dkdv_launch_args(q, k, v, do, lse, delta, dk, dv, **arguments):
    """(kernel, grid, args, constexprs) of the dK/dV pass: the one place its arguments are
    assembled, for ``attention_backward_triton`` and ``fastpe triton-report`` (on meta
    tensors). q, k, v, do contiguous in one dtype (fp16, bf16 or fp32), lse and delta fp32
    [B, Hq, Sq] contiguous, dk and dv fp32 like k and v; ``arguments`` the keywords of
    ``attention_backward_triton`` (``options``, ``mask``, ``key_lengths``,
    ``relative_bias``)."""
    return _launch_args(False, q, k, v, do, lse, delta, (dk, dv), **arguments)


def dq_launch_args(q, k, v, do, lse, delta, dq, dtable_part, **arguments):
    """As ``dkdv_launch_args`` for the dQ pass; dq fp32 like q; dtable_part fp32 [B, Hq, query
    blocks, BLOCK_B] with a T5 bias (each program's share of the table's gradient), else
    [1]."""
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
    q, k, v and grad_out share one dtype (fp16, bf16 or fp32) and are read in it.
    ``options`` the attention options (see ``_attention_common``; ALiBi slopes [B, Hq]);
    ``mask`` None or bool/float broadcast to [B, Hq, Sq, Sk]; ``relative_bias`` None or (table
    [num_buckets, Hq], num_buckets, max_distance, bidirectional). Returns (dq, dk, dv) fp32,
    dsinks fp32 [Hq] or None and the table's gradient fp32 [num_buckets, Hq] or None."""
    batch, hq, sq, d = q.shape
    sk, dv = k.shape[2], v.shape[3]
    device = q.device
    # no dtype change: a copy only where a tensor is not contiguous already
    q, k, v, do, out = (x.contiguous() for x in (q, k, v, grad_out, out))
    lse = lse.float().contiguous()
    # D_i = Σ dO∘O - dlse: what every dZ of row i subtracts (docs/math.md#attention-backward)
    delta = torch.empty((batch, hq, sq), dtype=torch.float32, device=device)
    n_rows = batch * hq * sq
    if n_rows:
        block_dv = next_pow2(dv)
        block_r = 16 if interpreted() else max(16, 4096 // block_dv)
        _delta_kernel[(triton.cdiv(n_rows, block_r),)](
            do,
            out,
            grad_lse.contiguous() if grad_lse is not None else lse,
            delta,
            n_rows,
            dv,
            HAS_DLSE=grad_lse is not None,
            BLOCK_R=block_r,
            BLOCK_DV=block_dv,
        )
    dsinks = None
    if options.sinks is not None:
        dsinks = -(torch.exp(options.sinks.float()[None, :, None] - lse) * delta).sum((0, 2))
    grad = dict(dtype=torch.float32, device=device)
    dq = torch.zeros(q.shape, **grad)
    dk = torch.zeros(k.shape, **grad)
    dv_ = torch.zeros(v.shape, **grad)
    num_buckets = relative_bias[1] if relative_bias is not None else 2
    biased = _per_element_bias(
        {
            "HAS_RELATIVE_BIAS": relative_bias is not None,
            "HAS_ALIBI": options.alibi_slopes is not None,
            "HAS_MASK": mask is not None,
            "MASK_IS_BOOL": mask is not None and mask.dtype == torch.bool,
        }
    )
    n_mblocks = triton.cdiv(sq, tiles(d, dv, v.dtype, biased)[1][0])
    dtable_part = torch.zeros(
        (batch, hq, n_mblocks, next_pow2(num_buckets)) if relative_bias is not None else (1,),
        **grad,
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
