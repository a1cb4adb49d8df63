"""Pieces of attention shared by the dense, paged and backward Triton kernels: the keys a query
block may see, the score modifiers and masks, the online-softmax step and the forward's epilogue.

The launchers take the attention options as one record, ``options``: fastpe's
``AttentionOptions`` as its ``launched(convert)`` gives it (read here by attribute, so that the
kernels never import fastpe). The launchers read ``scale`` (of q·kᵀ), ``causal``,
``bottom_right`` (query i sits at key position i + L - Sq, L the keys of its sequence; else at
i), ``window`` (None or (left, right), -1 unbounded), ``softcap`` (None or > 0: scores become
softcap·tanh(s/softcap)), ``sinks`` (None or fp32 [Hq]: a logit per head that joins the
softmax's normaliser) and ``alibi_slopes`` (None or fp32 [Hq] or [B, Hq]); the arrays come
already converted by the backend, and ``rope`` and ``return_lse`` are the backends' concern.

The optional inputs travel as tuples, one per feature, so that the kernels' argument lists stay
short: ``mask`` (ptr, (stride b, h, q, k)), ``alibi`` (ptr, (stride b, h)), ``relative_bias``
(table ptr, (stride bucket, h), max_exact, log_span), and ``score_params`` ((window left,
window right), (scale, cap)): the window's offsets from each query's position (large when
unbounded), the scale of q·kᵀ and the soft-cap (1 without), built by ``score_param_args``
and unpacked only by the helpers here. The kernels take the two tuples apart, the window after
the sizes and the scales after the strides: ptxas allocates registers by argument order, and
the cap next to the window's offsets costs up to 7 more on sm_90 (`fastpe triton-report`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

FP32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _relative_bias_bucket(
    rel, NUM_BUCKETS: tl.constexpr, BIDIRECTIONAL: tl.constexpr, max_exact, log_span
):
    """T5's bucket of key-minus-query distance ``rel`` (the log in fp32, as T5 evaluates it)."""
    if BIDIRECTIONAL:
        bucket = tl.where(rel > 0, NUM_BUCKETS // 2, 0)
        dist = tl.abs(rel)
        buckets = NUM_BUCKETS // 2
    else:
        bucket = tl.zeros_like(rel)
        dist = -tl.minimum(rel, 0)
        buckets = NUM_BUCKETS
    ratio = tl.maximum(dist, max_exact).to(tl.float32) / max_exact
    large = max_exact + (tl.log(ratio) / log_span * (buckets - max_exact)).to(tl.int32)
    large = tl.minimum(large, buckets - 1)
    return bucket + tl.where(dist < max_exact, dist, large)


@triton.jit
def _tanh(x):
    """tanh from exp: (1 - e)/(1 + e) with e = exp(-2|x|), which cancels near 0, so below
    |x| = 1/4 the odd Taylor series to x^9 (next term < 3e-9)."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    x2 = ax * ax
    small = ax + ax * x2 * (
        -1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))
    )
    t = tl.where(ax < 0.25, small, big)
    return tl.where(x >= 0, t, -t)


@triton.jit
def program_ids(Hq, group):
    """(query block, key split, batch, query head, kv head) of this program of a forward kernel,
    whose grid is ``forward_grid``'s; ``group`` query heads share a kv head. Each index is a
    program id of its own: ptxas recomputes the row indices from it rather than holding them in
    registers through the key loop (the block index folded with batch x heads into axis 0, one
    division apart, costs up to 57 registers and a spill on sm_80: ``fastpe triton-report``)."""
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    b = pid_bh // Hq
    h = pid_bh % Hq
    return pid_m, split, b, h, h // group


# grid axes 1 and 2 hold at most 65535 programs (axis 0: 2^31 - 1)
MAX_GRID_Y = 65535


def forward_grid(n_blocks, batch_heads, n_splits):
    """The launch grid of a forward kernel: (batch x query heads, query blocks, key splits).
    Batch x heads, which passes 65535 at decode batch sizes (2048 x 32), rides on axis 0 (up to
    2^31 - 1); the query blocks stay within 65535 because the launchers' blocks hold at least
    16 queries and the backend takes at most ``MAX_QUERIES`` (65535 x 16) queries per sequence
    (fastpe/backends/triton.py); ``split_keys`` makes at most 2·SMs key splits."""
    if n_blocks > MAX_GRID_Y or n_splits > MAX_GRID_Y:
        raise ValueError(
            f"{n_blocks} query blocks x {n_splits} key splits: grid axes 1 and 2 hold at most "
            f"{MAX_GRID_Y} programs each"
        )
    return (batch_heads, n_blocks, n_splits)


@triton.jit
def key_range(
    pid_m,
    split,
    end,
    shift,
    keys_per_split,
    score_params,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """[lo, hi): the keys below ``end`` that query block ``pid_m`` (queries at key positions
    row + shift) may see, within key slice ``split``. Tiles above the causal diagonal or before
    the window are never visited."""
    (window_left, window_right), _ = score_params
    if CAUSAL:
        end = tl.minimum(end, pid_m * BLOCK_M + BLOCK_M + shift)
    if HAS_WINDOW:
        end = tl.minimum(end, pid_m * BLOCK_M + BLOCK_M + shift + window_right)
    end = tl.maximum(end, 0)
    lo = split * keys_per_split
    hi = tl.minimum(end, lo + keys_per_split)
    if HAS_WINDOW:
        lo = tl.maximum(lo, pid_m * BLOCK_M + shift - window_left)
    return lo, hi


@triton.jit
def alibi_slope(alibi, b, h, HAS_ALIBI: tl.constexpr):
    """The ALiBi slope of (batch b, head h) in fp32; 0 without ALiBi."""
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(alibi[0] + b * alibi[1][0] + h * alibi[1][1]).to(tl.float32)
    return slope


@triton.jit
def alibi_near(qpos, end_keys, HAS_ALIBI: tl.constexpr):
    """Each row's distance to its nearest key (of keys 0 … end_keys - 1): ALiBi's distances are
    taken less it, since that common part would only cost fp32 precision in the scores (it
    cancels in softmax; the epilogue adds it back to lse). 0 without ALiBi."""
    near = tl.zeros_like(qpos)
    if HAS_ALIBI:
        near = tl.maximum(tl.maximum(qpos - (end_keys - 1), -qpos), 0)
    return near


@triton.jit
def qk_scores(q, k, DOT_FP32: tl.constexpr):
    """q·kᵀ of a tile: IEEE fp32 dots for fp32, else tensor cores in q's dtype."""
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    return s


@triton.jit
def modify_scores(
    s,
    rows,
    cols,
    valid,
    qpos,
    b,
    h,
    check_causal,
    slope,
    near,
    score_params,
    relative_bias,
    mask,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_RELATIVE_BIAS: tl.constexpr,
    RELATIVE_BIAS_BUCKETS: tl.constexpr,
    RELATIVE_BIAS_BIDIRECTIONAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
):
    """The scores s [rows, cols] (scaled q·kᵀ) with soft-cap, ALiBi, T5 bias and an additive
    mask applied, and which of them count (``valid``, narrowed by the window, the causal rule
    where ``check_causal`` and a bool mask). Queries sit at key positions ``qpos``; ALiBi
    distances are taken less ``near`` per row. Also
    returns tanh(s/cap) (the backward's dS needs it; 0 without soft-cap) and the T5 buckets (0
    without)."""
    (window_left, window_right), (_, cap) = score_params
    t = tl.zeros((1, 1), tl.float32)
    if HAS_SOFTCAP:
        t = _tanh(s / cap)
        s = cap * t
    if HAS_WINDOW:
        valid = valid & (cols[None, :] >= qpos[:, None] - window_left)
        valid = valid & (cols[None, :] <= qpos[:, None] + window_right)
    if CAUSAL:
        if check_causal:  # only tiles crossing the diagonal
            valid = valid & (cols[None, :] <= qpos[:, None])
    if HAS_ALIBI:
        s -= slope * (tl.abs(qpos[:, None] - cols[None, :]) - near[:, None]).to(tl.float32)
    bucket = tl.zeros((1, 1), tl.int32)
    if HAS_RELATIVE_BIAS:
        table, strides, max_exact, log_span = relative_bias
        bucket = _relative_bias_bucket(
            (cols[None, :] - qpos[:, None]).to(tl.int32),
            RELATIVE_BIAS_BUCKETS,
            RELATIVE_BIAS_BIDIRECTIONAL,
            max_exact,
            log_span,
        )
        s += tl.load(table + bucket * strides[0] + h * strides[1], mask=valid, other=0.0).to(
            tl.float32
        )
    if HAS_MASK:
        mask_ptr, ms = mask
        m_ptrs = mask_ptr + b * ms[0] + h * ms[1] + rows[:, None] * ms[2] + cols[None, :] * ms[3]
        if MASK_IS_BOOL:
            valid = valid & (tl.load(m_ptrs, mask=valid, other=0) != 0)
        else:
            # a finite mask is a score however large: beyond fp32 (a float64 mask) it
            # saturates at fp32's largest finite value rather than becoming ±inf
            m_add = tl.load(m_ptrs, mask=valid, other=0.0)
            m32 = m_add.to(tl.float32)
            m32 = tl.where(m_add > FP32_MAX, FP32_MAX, m32)
            m32 = tl.where((m_add < -FP32_MAX) & (m_add > float("-inf")), -FP32_MAX, m32)
            s += m32
    return s, valid, t, bucket


@triton.jit
def softmax_step(s, valid, m_i, l_i, to_log2):
    """One tile of the online softmax: (p, alpha, m_new, l_new) with p = exp(c·(s - m_new)) for
    the valid scores (0 elsewhere) and alpha = exp(c·(m_old - m_new)), the rescaling of what
    came before; ``to_log2`` = c·log2 e (c: the scale of q·kᵀ where s is the raw product, 1
    where s is already scaled), so that exp2 does the exponentials."""
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
    # the difference first: scores near ±fp32 max must not overflow once scaled
    alpha = tl.exp2((m_i - m_safe) * to_log2)
    p = tl.exp2((s - m_safe[:, None]) * to_log2)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def softmax_step_full(s, m_i, l_i, to_log2):
    """``softmax_step`` for a tile whose every score counts (no mask, no score beyond fp32's
    max / log2 e, which only an additive mask can bring): the exponent as one fused
    multiply-add per score, s·to_log2 - m·to_log2, rather than a subtraction and a product."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # every score -inf (overflowed dots)
    alpha = tl.exp2((m_i - m_safe) * to_log2)
    p = tl.exp2(s * to_log2 - (m_safe * to_log2)[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def pv_product(p, v, DOT_FP32: tl.constexpr):
    """p·v of a tile, p rounded to v's dtype for the tensor cores unless DOT_FP32."""
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return pv


@triton.jit
def epilogue(
    acc,
    m_i,
    l_i,
    slope,
    near,
    sinks_ptr,
    h,
    split,
    HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """(out, lse) of a query block from the online softmax's state: out normalised (0 for rows
    that saw no key, lse -inf), ALiBi's per-row offset ``slope·near`` added back to lse, and the
    attention sink of head h joined on the first key slice only (split-KV merging counts it
    once)."""
    seen = l_i != 0.0  # NaN too (an overflowed score): it must show, as in SDPA
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    if HAS_ALIBI:
        lse -= slope * near.to(tl.float32)
    if HAS_SINKS:  # logaddexp(lse, sink)
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        sink = tl.where(split == 0, sink, float("-inf"))
        top = tl.maximum(lse, sink)
        top = tl.where(top == float("-inf"), 0.0, top)
        lse_with = top + tl.log(tl.exp(lse - top) + tl.exp(sink - top))
        out = out * tl.exp(lse - lse_with)[:, None]
        lse = lse_with
    return out, lse


def score_param_args(options, unbounded, *, causal_edge=False):
    """The kernels' ``score_params`` (window, scales) from ``options`` and the constexpr they
    set: an unbounded side of the window becomes ``unbounded``, which reaches past every key;
    ``causal_edge`` puts the causal rule in the window as its right edge 0 (the backward
    kernels apply it so)."""
    left, right = (-1, -1) if options.window is None else options.window
    left, right = (unbounded if left < 0 else left, unbounded if right < 0 else right)
    if causal_edge and options.causal:
        right = 0
    cap = options.softcap
    scales = (float(options.scale), 1.0 if cap is None else float(cap))
    return ((left, right), scales), {"HAS_SOFTCAP": cap is not None}


def forward_flags(options):
    """The constexprs of the options the dense and paged forward kernels share."""
    return dict(
        CAUSAL=options.causal,
        HAS_WINDOW=options.window is not None,
        HAS_SINKS=options.sinks is not None,
        BOTTOM_RIGHT=options.bottom_right,
    )


def score_args(device, options, *, mask, relative_bias):
    """The kernels' (mask, alibi, relative_bias) tuples from ``options`` and a launcher's mask
    and T5 bias (a dummy tensor for one that is None), and the constexprs they set."""
    alibi_slopes = options.alibi_slopes
    dummy = torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=device)
    mask_t = mask if mask is not None else dummy
    alibi = alibi_slopes if alibi_slopes is not None else dummy[0, 0]
    if relative_bias is not None:
        table, num_buckets, max_distance, bidirectional = relative_bias
    else:
        table, num_buckets, max_distance, bidirectional = dummy[0, 0], 2, 2, False
    max_exact = max((num_buckets // 2 if bidirectional else num_buckets) // 2, 1)
    log_span = math.log(max_distance / max_exact) if relative_bias is not None else 1.0
    args = (
        (mask_t, mask_t.stride()),
        # a [Hq] slope vector is shared by the batch
        (alibi, (alibi.stride(0) if alibi.dim() == 2 else 0, alibi.stride(-1))),
        (table, table.stride(), max_exact, log_span),
    )
    flags = dict(
        HAS_MASK=mask is not None,
        MASK_IS_BOOL=mask is not None and mask.dtype == torch.bool,
        HAS_ALIBI=alibi_slopes is not None,
        HAS_RELATIVE_BIAS=relative_bias is not None,
        RELATIVE_BIAS_BUCKETS=num_buckets,
        RELATIVE_BIAS_BIDIRECTIONAL=bidirectional,
    )
    return args, flags
