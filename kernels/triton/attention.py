"""Flash-style scaled dot-product attention forward on CUDA (Triton).

Logical shapes: q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] (any strides)
             -> out [B, Hq, Sq, Dv], lse [B, Hq, Sq] (natural log, fp32).

One program = one block of queries of one (batch, query head), optionally one slice of the keys
(split-KV for decoding, merged afterwards with the log-sum-exp rule). Online softmax in fp32,
scores in natural-log units (finite masks up to fp32's max stay finite) exponentiated as
exp2((s - max)·log2 e); key tiles outside a block's window (above the causal diagonal, before a
sliding window) are never visited. GQA reads kv head h // (Hq / Hkv) in place. Soft-capping
is applied to the scaled scores; an attention sink joins the first key slice's result only, so
that split-KV merging counts it once.
RoPE rotates q and k tiles as they are loaded; ALiBi and the T5-style relative-bias buckets are
computed per tile.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from fastpe.kernels.triton._common import LOG2E, interpreted, low_precision_via_fp32, next_pow2

FP32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _rotated(
    ptr,
    rows,
    cols,
    stride_row,
    stride_col,
    row_ok,
    col_ok,
    pos,
    cos_ptr,
    sin_ptr,
    stride_cos,
    half,
    INTERLEAVED: tl.constexpr,
):
    """Load a [rows, cols] tile and apply RoPE at positions ``pos`` [rows] (columns >= 2·half
    pass through). The partner of column d is d ± half (NeoX) or d ^ 1 (GPT-J)."""
    keep = row_ok[:, None] & col_ok[None, :]
    x = tl.load(
        ptr + rows[:, None] * stride_row + cols[None, :] * stride_col, mask=keep, other=0.0
    ).to(tl.float32)
    rotary = cols < 2 * half
    if INTERLEAVED:
        freq = cols // 2
        partner = cols ^ 1
        sign = tl.where(cols % 2 == 0, -1.0, 1.0)
    else:
        freq = tl.where(cols < half, cols, cols - half)
        partner = tl.where(cols < half, cols + half, cols - half)
        sign = tl.where(cols < half, -1.0, 1.0)
    rot_keep = keep & rotary[None, :]
    xp = tl.load(
        ptr + rows[:, None] * stride_row + partner[None, :] * stride_col, mask=rot_keep, other=0.0
    ).to(tl.float32)
    c = tl.load(cos_ptr + pos[:, None] * stride_cos + freq[None, :], mask=rot_keep, other=1.0).to(
        tl.float32
    )
    s = tl.load(sin_ptr + pos[:, None] * stride_cos + freq[None, :], mask=rot_keep, other=0.0).to(
        tl.float32
    )
    return tl.where(rotary[None, :], x * c + sign[None, :] * xp * s, x)


@triton.jit
def _load_tile(
    base,
    rows,
    cols,
    stride_row,
    stride_col,
    row_ok,
    col_ok,
    HAS_ROPE: tl.constexpr,
    HAS_POS: tl.constexpr,
    pos_ptr,
    stride_pos,
    pos_offset,
    cos_ptr,
    sin_ptr,
    stride_cos,
    half,
    INTERLEAVED: tl.constexpr,
):
    """A [rows, cols] tile of q or k in fp32, rotated by RoPE at its positions when HAS_ROPE
    (positions from ``pos_ptr`` when HAS_POS, else ``pos_offset + row``)."""
    if HAS_ROPE:
        if HAS_POS:
            pos = tl.load(pos_ptr + rows * stride_pos, mask=row_ok, other=0)
        else:
            pos = pos_offset + rows
        tile = _rotated(
            base,
            rows,
            cols,
            stride_row,
            stride_col,
            row_ok,
            col_ok,
            pos,
            cos_ptr,
            sin_ptr,
            stride_cos,
            half,
            INTERLEAVED,
        )
    else:
        tile = tl.load(
            base + rows[:, None] * stride_row + cols[None, :] * stride_col,
            mask=row_ok[:, None] & col_ok[None, :],
            other=0.0,
        ).to(tl.float32)
    return tile


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


def _configs():
    """A single config under the interpreter (multi-config autotuning needs a GPU, and each
    interpreted program costs ~1 ms); on a GPU the list below, pruned per call by ``_prune``."""
    if interpreted():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    return _gpu_configs()


def _gpu_configs():
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
        for bm, bn, w, st in sorted(set().union(*_FITS.values()), reverse=True)
    ]


# (BLOCK_M, BLOCK_N, num_warps, num_stages) that keep every accumulator in registers (no
# spill) and fit the shared memory of sm_80 and sm_90, by head dim (64: D <= 64, 128, 256), by
# whether the keys are rotated in the loop (RoPE keeps four more fp32 [BLOCK_N, D] tiles live:
# k, its partner columns, cos and sin) and by dtype (fp32 takes IEEE fp32 dots). Found with
# `fastpe triton-report` (bench/results/triton-aot.md); change them only with a rerun of it.
_FITS = {
    (64, False, False): {
        (128, 64, 8, 3),
        (128, 32, 4, 3),
        (64, 64, 4, 3),
        (128, 128, 8, 2),
        (64, 32, 4, 2),
    },
    (64, True, False): {(64, 32, 4, 2), (64, 32, 8, 2), (128, 32, 8, 2)},
    (128, False, False): {(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 2), (64, 32, 8, 2)},
    (128, True, False): {(64, 32, 8, 2), (32, 32, 4, 2)},
    (256, False, False): {(64, 32, 8, 2), (32, 32, 4, 2), (32, 32, 8, 2)},
    (256, True, False): {(32, 32, 8, 2)},  # spills a little: not launched (_rope_in_kernel)
    # fp32: the IEEE dot runs on FMA units, each thread holding whole rows of the K dimension
    (64, False, True): {(32, 32, 8, 2), (32, 16, 4, 2)},
    (64, True, True): {(32, 16, 4, 2), (32, 16, 8, 2)},
    (128, False, True): {(32, 16, 8, 2)},
    (128, True, True): {(32, 16, 8, 2)},  # spills: not launched (_rope_in_kernel)
    (256, False, True): {(32, 16, 8, 2)},
    (256, True, True): {(32, 16, 8, 2)},  # spills: not launched (_rope_in_kernel)
}
# the largest tiles spill once scores carry a per-element bias (ALiBi, T5, an additive mask)
_BIASED_OUT = {64: {(128, 128, 8, 2)}, 128: {(128, 64, 8, 3)}, 256: set()}
# ... and with RoPE rotated in the kernel as well, only the narrowest tiles stay out of local
# memory at head dim 64 (wider heads rotate before the kernel then: _rope_in_kernel)
_BIASED_ROPE_OUT = {64: {(128, 32, 8, 2), (64, 32, 4, 2), (32, 16, 4, 2)}, 128: set(), 256: set()}
# GPUs with 99 KB of shared memory per block (sm_86, sm_89, sm_120): no third stage
_SMALL_SMEM = (86, 89, 120, 121)


def _rope_in_kernel(d, dot_fp32, biased=False):
    """Whether q and k tiles are rotated inside the kernel. Wider tiles (fp32 beyond 64 columns,
    fp16/bf16 beyond 128, or beyond 64 when scores also carry a per-element bias) spill with
    every config (bench/results/triton-aot.md): the launcher rotates q and k with the
    apply_rope kernel first (the same fp32 arithmetic, rounded to the input dtype once more,
    and one more pass over q and k)."""
    return d <= (64 if dot_fp32 or biased else 128)


def _per_element_bias(flags) -> bool:
    """Scores carry a term per (query, key): ALiBi, T5 relative bias or an additive mask."""
    return bool(
        flags.get("HAS_RELATIVE_BIAS")
        or flags.get("HAS_ALIBI")
        or (flags.get("HAS_MASK") and not flags.get("MASK_IS_BOOL"))
    )


def _capability(named_args):
    q = named_args.get("q_ptr")
    if q is None or not hasattr(q, "device") or q.device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(q.device)
    return 10 * major + minor


def _prune(configs, named_args, capability=None, **kwargs):
    """The configs of ``_FITS`` for this head dim, RoPE and dtype; tiny query counts (decoding)
    waste most of a 128-row block. ``capability`` (e.g. 90) defaults to the GPU holding q;
    ``kwargs`` are the kernel's constexprs (the AOT report passes both)."""
    if capability is None:
        capability = _capability(named_args)
    d = max(named_args["D"], named_args["Dv"])
    dclass = 64 if d <= 64 else 128 if d <= 128 else 256
    fits = set(_FITS[dclass, bool(kwargs.get("HAS_ROPE")), bool(kwargs.get("DOT_FP32"))])
    biased = _per_element_bias(kwargs) or any(
        kwargs.get(flag) for flag in ("HAS_SOFTCAP", "HAS_WINDOW", "HAS_SINKS")
    )
    if biased:
        fits -= _BIASED_OUT[dclass]
        if kwargs.get("HAS_ROPE"):
            fits -= _BIASED_ROPE_OUT[dclass]
    if capability in _SMALL_SMEM:
        fits = {f for f in fits if f[3] <= 2} or fits
    key = lambda c: (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)  # noqa: E731
    kept = [c for c in configs if key(c) in fits]
    if named_args["Sq"] <= 64:
        kept = [c for c in kept if c.kwargs["BLOCK_M"] <= 64] or kept
    return kept or configs[-1:]


@triton.autotune(
    configs=_configs(),
    # the flags _prune reads are part of the key: a config tuned without RoPE must not be
    # reused for a call with it
    key=[
        "Sq",
        "Sk",
        "D",
        "Dv",
        "group",
        "HAS_ROPE",
        "HAS_RELATIVE_BIAS",
        "HAS_MASK",
        "MASK_IS_BOOL",
        "HAS_ALIBI",
    ],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    mask_ptr,
    key_len_ptr,
    alibi_ptr,
    bias_ptr,
    cos_ptr,
    sin_ptr,
    qpos_ptr,
    kpos_ptr,
    sinks_ptr,
    Hq,
    group,
    Sq,
    Sk,
    D,
    Dv,
    query_shift,
    half,
    keys_per_split,
    q_positions_offset,
    k_positions_offset,
    bias_max_exact,
    bias_log_span,
    win_left,
    win_right,
    stride_qb,
    stride_qh,
    stride_qs,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_osplit,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_lsplit,
    stride_lb,
    stride_lh,
    stride_ls,
    stride_mb,
    stride_mh,
    stride_mq,
    stride_mk,
    stride_ab,
    stride_ah,
    stride_biasb,
    stride_biash,
    stride_cos,
    stride_qpb,
    stride_qps,
    stride_kpb,
    stride_kps,
    scale,
    softcap,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
    HAS_KEY_LEN: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_RELATIVE_BIAS: tl.constexpr,
    RELATIVE_BIAS_BUCKETS: tl.constexpr,
    RELATIVE_BIAS_BIDIRECTIONAL: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    ROPE_INTERLEAVED: tl.constexpr,
    HAS_QPOS: tl.constexpr,
    HAS_KPOS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Sq
    dcols = tl.arange(0, BLOCK_D)
    vcols = tl.arange(0, BLOCK_DV)
    q_base = q_ptr + b * stride_qb + h * stride_qh
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh
    q = _load_tile(
        q_base,
        rows,
        dcols,
        stride_qs,
        stride_qd,
        row_ok,
        dcols < D,
        HAS_ROPE,
        HAS_QPOS,
        qpos_ptr + b * stride_qpb,
        stride_qps,
        q_positions_offset,
        cos_ptr,
        sin_ptr,
        stride_cos,
        half,
        ROPE_INTERLEAVED,
    )
    q = q * scale
    if not DOT_FP32:
        q = q.to(k_ptr.dtype.element_ty)

    # the keys this block may see, then this program's slice of them
    end = Sk
    shift = query_shift
    if HAS_KEY_LEN:
        length = tl.load(key_len_ptr + b)
        end = tl.minimum(end, length)
        if BOTTOM_RIGHT:  # FlashAttention's rule for a ragged KV cache: the last Sq of L_b
            shift = length - Sq
    if CAUSAL:
        end = tl.minimum(end, pid_m * BLOCK_M + BLOCK_M + shift)
    if HAS_WINDOW:  # win_left / win_right: offsets from each query position, large if unbounded
        end = tl.minimum(end, pid_m * BLOCK_M + BLOCK_M + shift + win_right)
    end = tl.maximum(end, 0)
    end_keys = Sk
    if HAS_KEY_LEN:
        end_keys = length
    lo = split * keys_per_split
    hi = tl.minimum(end, lo + keys_per_split)
    if HAS_WINDOW:
        lo = tl.maximum(lo, pid_m * BLOCK_M + shift - win_left)
    qpos_keys = rows + shift  # each query's position on the key axis

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + b * stride_ab + h * stride_ah).to(tl.float32)
        # distances less the row's nearest key: that common part would only cost fp32
        # precision in the scores (it cancels in softmax; lse adds it back)
        near = tl.maximum(tl.maximum(qpos_keys - (end_keys - 1), -qpos_keys), 0)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        k = _load_tile(
            k_base,
            cols,
            dcols,
            stride_ks,
            stride_kd,
            col_ok,
            dcols < D,
            HAS_ROPE,
            HAS_KPOS,
            kpos_ptr + b * stride_kpb,
            stride_kps,
            k_positions_offset,
            cos_ptr,
            sin_ptr,
            stride_cos,
            half,
            ROPE_INTERLEAVED,
        )
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(k_ptr.dtype.element_ty)))
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        valid = row_ok[:, None] & col_ok[None, :]
        if HAS_WINDOW:
            valid = valid & (cols[None, :] >= qpos_keys[:, None] - win_left)
            valid = valid & (cols[None, :] <= qpos_keys[:, None] + win_right)
        if CAUSAL:
            if start + BLOCK_N - 1 > pid_m * BLOCK_M + shift:  # only tiles crossing the diagonal
                valid = valid & (cols[None, :] <= qpos_keys[:, None])
        if HAS_ALIBI:
            s -= slope * (tl.abs(qpos_keys[:, None] - cols[None, :]) - near[:, None]).to(tl.float32)
        if HAS_RELATIVE_BIAS:
            bucket = _relative_bias_bucket(
                (cols[None, :] - qpos_keys[:, None]).to(tl.int32),
                RELATIVE_BIAS_BUCKETS,
                RELATIVE_BIAS_BIDIRECTIONAL,
                bias_max_exact,
                bias_log_span,
            )
            s += tl.load(
                bias_ptr + bucket * stride_biasb + h * stride_biash, mask=valid, other=0.0
            ).to(tl.float32)
        if HAS_MASK:
            m_ptrs = (
                mask_ptr
                + b * stride_mb
                + h * stride_mh
                + rows[:, None] * stride_mq
                + cols[None, :] * stride_mk
            )
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
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
        # the difference first: scores near ±fp32 max must not overflow once scaled
        alpha = tl.exp2((m_i - m_safe) * LOG2E)
        p = tl.exp2((s - m_safe[:, None]) * LOG2E)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + cols[:, None] * stride_vs + vcols[None, :] * stride_vd,
            mask=col_ok[:, None] & (vcols[None, :] < Dv),
            other=0.0,
        )
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v_ptr.dtype.element_ty), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    seen = l_i != 0.0  # NaN too (an overflowed score): it must show, as in SDPA
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    if HAS_ALIBI:
        lse -= slope * near.to(tl.float32)
    if HAS_SINKS:  # logaddexp(lse, sink), on the first key slice only
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        sink = tl.where(split == 0, sink, float("-inf"))
        top = tl.maximum(lse, sink)
        top = tl.where(top == float("-inf"), 0.0, top)
        lse_with = top + tl.log(tl.exp(lse - top) + tl.exp(sink - top))
        out = out * tl.exp(lse - lse_with)[:, None]
        lse = lse_with
    o_ptrs = (
        out_ptr
        + split * stride_osplit
        + b * stride_ob
        + h * stride_oh
        + rows[:, None] * stride_os
        + vcols[None, :] * stride_od
    )
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (vcols[None, :] < Dv))
    tl.store(
        lse_ptr + split * stride_lsplit + b * stride_lb + h * stride_lh + rows * stride_ls,
        lse,
        mask=row_ok,
    )


@triton.jit
def _merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    n_parts,
    rows,
    Dv,
    stride_po_part,
    stride_po_row,
    stride_pl_part,
    stride_o_row,
    BLOCK_R: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """out = Σ_s part_out[s]·exp(lse_s - lse), lse = log Σ_s exp(lse_s); empty rows stay 0/-inf.
    Parts and rows are flattened: part_out [n_parts, rows, Dv], part_lse [n_parts, rows]."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_DV)
    r_ok = r < rows
    top = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    for part in range(n_parts):
        top = tl.maximum(
            top, tl.load(part_lse_ptr + part * stride_pl_part + r, mask=r_ok, other=float("-inf"))
        )
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_DV), tl.float32)
    for part in range(n_parts):
        w = tl.exp(
            tl.load(part_lse_ptr + part * stride_pl_part + r, mask=r_ok, other=float("-inf"))
            - top_safe
        )
        total += w
        x = tl.load(
            part_out_ptr + part * stride_po_part + r[:, None] * stride_po_row + c[None, :],
            mask=r_ok[:, None] & (c[None, :] < Dv),
            other=0.0,
        ).to(tl.float32)
        # a part that saw no key (lse -inf, w = 0) adds nothing, whatever its out holds
        acc += tl.where(w[:, None] == 0.0, 0.0, w[:, None] * x)
    seen = total != 0.0
    out = tl.where(seen[:, None], acc / tl.where(seen, total, 1.0)[:, None], 0.0)
    lse = tl.where(seen, top_safe + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(
        out_ptr + r[:, None] * stride_o_row + c[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=r_ok[:, None] & (c[None, :] < Dv),
    )
    tl.store(lse_ptr + r, lse, mask=r_ok)


def _merge(part_out, part_lse, out_dtype):
    """part_out [n, B, H, S, Dv], part_lse [n, B, H, S] -> (out, lse)."""
    n, b, h, s, dv = part_out.shape
    rows = b * h * s
    po = part_out.reshape(n, rows, dv).contiguous()
    pl = part_lse.reshape(n, rows).contiguous().float()
    out = torch.empty((rows, dv), dtype=out_dtype, device=part_out.device)
    lse = torch.empty(rows, dtype=torch.float32, device=part_out.device)
    block_r = 16
    if rows:
        _merge_kernel[(triton.cdiv(rows, block_r),)](
            po,
            pl,
            out,
            lse,
            n,
            rows,
            dv,
            po.stride(0),
            po.stride(1),
            pl.stride(0),
            out.stride(0),
            BLOCK_R=block_r,
            BLOCK_DV=next_pow2(dv),
        )
    return out.reshape(b, h, s, dv), lse.reshape(b, h, s)


def merge_attention_triton(out_a, lse_a, out_b, lse_b):
    via_fp32 = low_precision_via_fp32(out_a.dtype)
    out, lse = _merge(
        torch.stack([out_a, out_b]),
        torch.stack([lse_a, lse_b]),
        torch.float32 if via_fp32 else out_a.dtype,
    )
    return out.to(out_a.dtype), lse


def _rotated_first(q, k, rope):
    """q and k rotated by the apply_rope kernel, for head dims whose in-loop rotation spills."""
    from fastpe.kernels.triton.apply_rope import apply_rope_triton

    cos, sin, interleaved, (q_pos, q_offset), (k_pos, k_offset) = rope
    cos, sin = cos.contiguous(), sin.contiguous()
    kw = {"interleaved": interleaved, "layout": "bhsd", "inplace": False}
    (q,) = apply_rope_triton((q,), cos, sin, q_pos, q_offset, **kw)
    (k,) = apply_rope_triton((k,), cos, sin, k_pos, k_offset, **kw)
    return q, k


# Split-KV slices are whole multiples of this, so they suit every autotuned BLOCK_N.
SPLIT_GRANULE = 128


def attention_triton(
    q,
    k,
    v,
    *,
    scale,
    causal,
    bottom_right,
    mask=None,
    key_lengths=None,
    alibi_slopes=None,
    relative_bias=None,
    rope=None,
    window=None,
    softcap=None,
    sinks=None,
    num_sms=None,
):
    """Launch on torch tensors (CUDA, or CPU under TRITON_INTERPRET=1).

    Query i of sequence b sits at key position i + L_b - Sq when ``bottom_right`` (L_b =
    key_lengths[b], or Sk), i otherwise. ``mask`` is
    None or bool/float, already broadcast to [B, Hq, Sq, Sk] (a stride-0 view); ``relative_bias``
    None or (table [num_buckets, Hq], num_buckets, max_distance, bidirectional); ``rope`` None or
    (cos, sin, interleaved, q_positions, k_positions), each positions entry (int64 tensor [S] or
    [B, S] or None, int offset): the rows of cos/sin used are tensor values, or offset + index.
    ``window`` None or (left, right), -1 unbounded; ``softcap`` None or > 0; ``sinks`` fp32 [Hq]
    or None. Returns (out [B, Hq, Sq, Dv] in q's dtype, lse fp32 [B, Hq, Sq])."""
    batch, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    device = q.device
    query_shift = sk - sq if bottom_right else 0
    # fp32 inputs get IEEE fp32 dots (Triton's default for fp32 is TF32, ~1e-3 relative)
    dot_fp32 = low_precision_via_fp32(q.dtype) or q.dtype == torch.float32
    # split the keys when (query blocks x heads x batch) cannot fill the GPU: decoding
    programs = triton.cdiv(sq, 64) * batch * hq
    n_splits = 1
    if not interpreted() and num_sms and programs < num_sms and sk > 4 * SPLIT_GRANULE:
        n_splits = min(triton.cdiv(sk, SPLIT_GRANULE), triton.cdiv(2 * num_sms, programs))
    elif interpreted() and sq == 1 and sk > SPLIT_GRANULE:
        n_splits = 2  # keep the split-KV path covered by the interpreter tests
    keys_per_split = triton.cdiv(triton.cdiv(sk, n_splits), SPLIT_GRANULE) * SPLIT_GRANULE
    out_dtype = torch.float32 if (n_splits > 1 or low_precision_via_fp32(q.dtype)) else q.dtype
    part_out = torch.empty((n_splits, batch, hq, sq, dv), dtype=out_dtype, device=device)
    part_lse = torch.empty((n_splits, batch, hq, sq), dtype=torch.float32, device=device)
    dummy = torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=device)
    mask_t = mask if mask is not None else dummy
    pos_dummy = torch.zeros((1, 1), dtype=torch.int64, device=device)

    def pos_strides(p):
        return (0, p.stride(0)) if p.dim() == 1 else (p.stride(0), p.stride(1))

    biased = _per_element_bias(
        {
            "HAS_RELATIVE_BIAS": relative_bias is not None,
            "HAS_ALIBI": alibi_slopes is not None,
            "HAS_MASK": mask is not None,
            "MASK_IS_BOOL": mask is not None and mask.dtype == torch.bool,
        }
    )
    if rope is not None and not _rope_in_kernel(d, q.dtype == torch.float32, biased):
        q, k = _rotated_first(q, k, rope)
        rope = None
    if rope is not None:
        (
            cos,
            sin,
            interleaved,
            (q_positions, q_positions_offset),
            (k_positions, k_positions_offset),
        ) = rope
        cos, sin = cos.contiguous(), sin.contiguous()  # the kernel assumes unit column stride
        half = cos.shape[1]
    else:
        cos = sin = dummy[0, 0]
        interleaved, half = False, 0
        q_positions, q_positions_offset, k_positions, k_positions_offset = None, 0, None, 0
    qpos = q_positions if q_positions is not None else pos_dummy
    kpos = k_positions if k_positions is not None else pos_dummy
    alibi = alibi_slopes if alibi_slopes is not None else dummy[0, 0]
    if relative_bias is not None:
        bias, num_buckets, max_distance, bidirectional = relative_bias
    else:
        bias, num_buckets, max_distance, bidirectional = dummy[0, 0], 2, 2, False
    buckets = num_buckets // 2 if bidirectional else num_buckets
    max_exact = max(buckets // 2, 1)
    key_len = (
        key_lengths if key_lengths is not None else torch.zeros(1, dtype=torch.int64, device=device)
    )
    # offsets from each query's position; "unbounded" reaches past every key (|qpos - j| < Sq + Sk)
    unbounded = sq + sk + 1
    win_left, win_right = (-1, -1) if window is None else window
    win_left = unbounded if win_left < 0 else win_left
    win_right = unbounded if win_right < 0 else win_right
    sinks_t = sinks if sinks is not None else dummy[0, 0]

    def grid(meta):
        return (triton.cdiv(sq, meta["BLOCK_M"]), batch * hq, n_splits)

    if batch * hq * sq:
        _attention_kernel[grid](
            q,
            k,
            v,
            part_out,
            part_lse,
            mask_t,
            key_len,
            alibi,
            bias,
            cos,
            sin,
            qpos,
            kpos,
            sinks_t,
            hq,
            hq // hkv,
            sq,
            sk,
            d,
            dv,
            query_shift,
            half,
            keys_per_split,
            q_positions_offset,
            k_positions_offset,
            max_exact,
            math.log(max_distance / max_exact) if relative_bias is not None else 1.0,
            win_left,
            win_right,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *part_out.stride(),
            *part_lse.stride(),
            *mask_t.stride(),
            alibi.stride(0) if alibi.dim() == 2 else 0,
            alibi.stride(-1),
            bias.stride(0),
            bias.stride(1),
            cos.stride(0),
            *pos_strides(qpos),
            *pos_strides(kpos),
            scale,
            1.0 if softcap is None else float(softcap),
            CAUSAL=causal,
            HAS_WINDOW=window is not None,
            HAS_SOFTCAP=softcap is not None,
            HAS_SINKS=sinks is not None,
            HAS_MASK=mask is not None,
            MASK_IS_BOOL=mask is not None and mask.dtype == torch.bool,
            HAS_KEY_LEN=key_lengths is not None,
            BOTTOM_RIGHT=bottom_right,
            HAS_ALIBI=alibi_slopes is not None,
            HAS_RELATIVE_BIAS=relative_bias is not None,
            RELATIVE_BIAS_BUCKETS=num_buckets,
            RELATIVE_BIAS_BIDIRECTIONAL=bidirectional,
            HAS_ROPE=rope is not None,
            ROPE_INTERLEAVED=interleaved,
            HAS_QPOS=q_positions is not None,
            HAS_KPOS=k_positions is not None,
            DOT_FP32=dot_fp32,
            BLOCK_D=next_pow2(d),
            BLOCK_DV=next_pow2(dv),
        )
    if n_splits == 1:
        out, lse = part_out[0], part_lse[0]
    else:
        out, lse = _merge(part_out, part_lse, torch.float32)
    return out.to(q.dtype), lse
