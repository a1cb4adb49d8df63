"""Flash-style scaled dot-product attention forward on CUDA (Triton).

Logical shapes: q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] (any strides)
             -> out [B, Hq, Sq, Dv], lse [B, Hq, Sq] (natural log, fp32).

One program = one block of queries of one (batch, query head), optionally one slice of the keys
(split-KV for decoding, merged afterwards with the log-sum-exp rule). Online softmax in fp32,
scores in natural-log units (finite masks up to fp32's max stay finite) exponentiated as
exp2((s - max)·log2 e) (raw q·kᵀ, scale in the exponent, without score modifiers); key tiles
outside a block's window (causal, sliding) are never visited, whole tiles every query sees run
unmasked (``_key_tiles``). GQA reads kv head h // (Hq / Hkv) in place. Soft-capping is applied
to the scaled scores; an attention sink joins the first key slice's result only, so that
split-KV merging counts it once. The options arrive as one record (``options``, described in
``_attention_common``). RoPE rotates q and k tiles as they are loaded; ALiBi and the T5-style
relative-bias buckets are computed per tile.
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
    score_args,
    score_param_args,
    softmax_step,
    softmax_step_full,
)
from fastpe.kernels.triton._common import LOG2E, interpreted, low_precision_via_fp32, next_pow2


@triton.jit
def _rotated(ptr, rows, cols, strides, keep, pos, rope, INTERLEAVED: tl.constexpr):
    """Load a [rows, cols] tile and apply RoPE at positions ``pos`` [rows] (columns >= 2·half
    pass through). The partner of column d is d ± half (NeoX) or d ^ 1 (GPT-J). ``rope``:
    (cos ptr, sin ptr, row stride of both, half); ``keep``: the elements to load (None: all)."""
    cos_ptr, sin_ptr, stride_cos, half = rope
    x = _load(ptr + rows[:, None] * strides[0] + cols[None, :] * strides[1], keep, 0.0)
    x = x.to(tl.float32)
    rotary = cols < 2 * half
    if INTERLEAVED:
        freq = cols // 2
        partner = cols ^ 1
        sign = tl.where(cols % 2 == 0, -1.0, 1.0)
    else:
        freq = tl.where(cols < half, cols, cols - half)
        partner = tl.where(cols < half, cols + half, cols - half)
        sign = tl.where(cols < half, -1.0, 1.0)
    if keep is None:
        rot_keep = rotary[None, :]
    else:
        rot_keep = keep & rotary[None, :]
    xp = tl.load(
        ptr + rows[:, None] * strides[0] + partner[None, :] * strides[1], mask=rot_keep, other=0.0
    ).to(tl.float32)
    c = tl.load(cos_ptr + pos[:, None] * stride_cos + freq[None, :], mask=rot_keep, other=1.0).to(
        tl.float32
    )
    s = tl.load(sin_ptr + pos[:, None] * stride_cos + freq[None, :], mask=rot_keep, other=0.0).to(
        tl.float32
    )
    return tl.where(rotary[None, :], x * c + sign[None, :] * xp * s, x)


@triton.jit
def _load(ptrs, keep, other):
    """tl.load of ``ptrs`` where ``keep`` (``other`` elsewhere); every element when None."""
    if keep is None:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=keep, other=other)
    return x


@triton.jit
def _tile_mask(row_ok, col_ok):
    """The [rows, cols] elements of a tile to load: None (all of them) when neither the rows
    nor the columns are masked (``row_ok``, ``col_ok``: None or a mask each)."""
    if row_ok is None:
        if col_ok is None:
            keep = None
        else:
            keep = col_ok[None, :]
    elif col_ok is None:
        keep = row_ok[:, None]
    else:
        keep = row_ok[:, None] & col_ok[None, :]
    return keep


@triton.jit
def _load_tile(
    base,
    rows,
    cols,
    strides,
    row_ok,
    col_ok,
    b,
    positions,
    rope,
    HAS_ROPE: tl.constexpr,
    HAS_POS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """A [rows, cols] tile of q or k in fp32 (``strides``: of a row, of a column), rotated by
    RoPE at its positions when HAS_ROPE. ``row_ok``/``col_ok``: the rows and columns in bounds
    (None: all of them). ``positions``: (ptr, (stride b, stride s), offset); the positions of
    batch b are read from ptr when HAS_POS, else offset + row."""
    keep = _tile_mask(row_ok, col_ok)
    if HAS_ROPE:
        pos_ptr, pos_strides, pos_offset = positions
        if HAS_POS:
            pos = _load(pos_ptr + b * pos_strides[0] + rows * pos_strides[1], row_ok, 0)
        else:
            pos = pos_offset + rows
        tile = _rotated(base, rows, cols, strides, keep, pos, rope, INTERLEAVED)
    else:
        tile = _load(base + rows[:, None] * strides[0] + cols[None, :] * strides[1], keep, 0.0)
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _key_tiles(
    acc,
    m_i,
    l_i,
    q_tile,
    lo,
    hi,
    kv_bases,
    ks,
    vs,
    rows,
    row_ok,
    dcols,
    vcols,
    sizes,
    b,
    h,
    diagonal,
    qpos_keys,
    slope,
    near,
    score_params,
    relative_bias,
    mask,
    rope,
    k_positions,
    to_log2,
    MASKED: tl.constexpr,
    FULL_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_RELATIVE_BIAS: tl.constexpr,
    RELATIVE_BIAS_BUCKETS: tl.constexpr,
    RELATIVE_BIAS_BIDIRECTIONAL: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    ROPE_INTERLEAVED: tl.constexpr,
    HAS_KPOS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The online softmax over the key tiles [lo, hi) of a query block: (acc, m_i, l_i) after
    them. MASKED: tiles that may hold keys a query must not see (past ``hi``, above the causal
    diagonal — the block's first query sits at key position ``diagonal`` —, outside the window,
    masked out), checked per score; otherwise every tile is whole and seen by every query, and
    neither the loads nor the scores carry a mask. FULL_D: D and Dv are the tiles' widths, no
    column mask. ``kv_bases``: k's and v's (batch, head); ``sizes``: (D, Dv); ``to_log2``: from
    the scores' units to log2 units (``softmax_step``)."""
    d_ok = None
    dv_ok = None
    if not FULL_D:
        d_ok = dcols < sizes[0]
        dv_ok = vcols < sizes[1]
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = None
        if MASKED:
            col_ok = cols < hi
        k_tile = _load_tile(
            kv_bases[0],
            cols,
            dcols,
            (ks[2], ks[3]),
            col_ok,
            d_ok,
            b,
            k_positions,
            rope,
            HAS_ROPE,
            HAS_KPOS,
            ROPE_INTERLEAVED,
        )
        s = qk_scores(q_tile, k_tile, DOT_FP32)
        if MASKED:
            s, valid, _, _ = modify_scores(
                s,
                rows,
                cols,
                row_ok[:, None] & col_ok[None, :],
                qpos_keys,
                b,
                h,
                start + BLOCK_N - 1 > diagonal,
                slope,
                near,
                score_params,
                relative_bias,
                mask,
                CAUSAL,
                HAS_WINDOW,
                HAS_SOFTCAP,
                HAS_ALIBI,
                HAS_RELATIVE_BIAS,
                RELATIVE_BIAS_BUCKETS,
                RELATIVE_BIAS_BIDIRECTIONAL,
                HAS_MASK,
                MASK_IS_BOOL,
            )
            p, alpha, m_i, l_i = softmax_step(s, valid, m_i, l_i, to_log2)
        else:
            s, _, _, _ = modify_scores(
                s,
                rows,
                cols,
                tl.full((1, 1), True, tl.int1),  # (the T5 lookups' mask: every score)
                qpos_keys,
                b,
                h,
                False,
                slope,
                near,
                score_params,
                relative_bias,
                mask,
                False,
                False,
                HAS_SOFTCAP,
                HAS_ALIBI,
                HAS_RELATIVE_BIAS,
                RELATIVE_BIAS_BUCKETS,
                RELATIVE_BIAS_BIDIRECTIONAL,
                False,
                False,
            )
            p, alpha, m_i, l_i = softmax_step_full(s, m_i, l_i, to_log2)
        v_tile = _load(
            kv_bases[1] + cols[:, None] * vs[2] + vcols[None, :] * vs[3],
            _tile_mask(col_ok, dv_ok),
            0.0,
        )
        pv = pv_product(p, v_tile, DOT_FP32)
        acc = acc * alpha[:, None] + pv
    return acc, m_i, l_i


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
# the largest tiles spill once scores carry a per-element bias (ALiBi, T5, an additive mask),
# and 64 x 64 at head dim 128 with ALiBi (8-16 bytes, bench/results/triton-aot-forward.md)
_BIASED_OUT = {64: {(128, 128, 8, 2)}, 128: {(128, 64, 8, 3), (64, 64, 4, 3)}, 256: set()}
# ... and with RoPE rotated in the kernel as well, only the narrowest tiles stay out of local
# memory at head dim 64 (wider heads rotate before the kernel then: _rope_in_kernel)
_BIASED_ROPE_OUT = {64: {(128, 32, 8, 2), (64, 32, 4, 2), (32, 16, 4, 2)}, 128: set(), 256: set()}
# ... and on sm_90 and later, the T5 bucket lookups take the 64 x 64 four-warp tile at head dim
# 128 past 255 registers (a 56-byte spill in bench/results/triton-aot.md)
_T5_SM90_OUT = {64: set(), 128: {(64, 64, 4, 3)}, 256: set()}
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


def tuning_length(n: int) -> int:
    """A sequence length as the autotuning key holds it: rounded down to a power of two, so
    that a decoding loop, whose key length grows by one per token, tunes once per doubling
    (and never while a CUDA graph is captured) rather than at every new length. The best
    tiles do not change within such a range."""
    return 1 << max(n, 1).bit_length() - 1


def _capability(named_args):
    q = named_args.get("q_ptr")
    if q is None or not hasattr(q, "device") or q.device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(q.device)
    return 10 * major + minor


def _prune(configs, named_args, capability=None, **kwargs):
    """The configs of ``_FITS`` for this head dim, RoPE and dtype; tiny query counts (decoding)
    waste most of a 128-row block. ``capability`` (e.g. 90) defaults to q's GPU; ``kwargs``:
    the kernel's constexprs (the AOT report passes both)."""
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
    fits = _sm90_fits(fits, capability, dclass, biased, kwargs)
    if capability in _SMALL_SMEM:
        fits = {f for f in fits if f[3] <= 2} or fits
    key = lambda c: (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)  # noqa: E731
    kept = [c for c in configs if key(c) in fits]
    if named_args["tuning_lengths"][0] <= 32:  # fewer than 64 queries: a decode step
        kept = [c for c in kept if c.kwargs["BLOCK_M"] <= 64] or kept
    return kept or configs[-1:]


@triton.autotune(
    configs=_configs(),
    # the key: the lengths as tuning_length rounds them (a decoding loop tunes once per
    # doubling of its length, not per token), the head dims, the GQA group, and every flag
    # _prune reads (RoPE, the T5 bias, the masks, ALiBi, the soft-cap, the window, sinks):
    # a config tuned without one of them must not be reused for a call with it, whose
    # pruned list can be narrower (the widest tiles spill once scores carry a per-element
    # bias, a cap, a window or sinks). The other constexprs (causal, key lengths, positions,
    # the dtype's DOT_FP32, which follows q's dtype, itself part of Triton's own key) do
    # not change what _prune keeps. The list is one string, split, to keep the decorator
    # as long as it was: Triton's kernel cache keys hold the kernel's line number.
    key=(
        "tuning_lengths D Dv group HAS_ROPE HAS_RELATIVE_BIAS HAS_MASK MASK_IS_BOOL HAS_ALIBI "
        "HAS_SOFTCAP HAS_WINDOW HAS_SINKS"
    ).split(),
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
    rope_tables,
    positions_ptrs,
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
    positions_offsets,
    bias_params,
    window,
    strides,
    scales,
    tuning_lengths,
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
    FULL_D: tl.constexpr,
    RAW_SCORES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """rope_tables: (cos, sin) [P, half]; positions_ptrs and positions_offsets: (q's, k's);
    bias_params: (max_exact, log_span) of the T5 buckets; window and scales: the score_params of
    _attention_common; strides: ((q b, h, s, d), (k …), (v …), (out split, b, h, s, d), (lse split, b, h, s), (mask
    b, h, q, k), (alibi b, h), (bias bucket, h), cos row, (q positions b, s), (k positions b,
    s)).

    Pointers, then sizes, then strides, as the kernel has always taken them: ptxas allocates
    registers differently when the same arguments come in another order (`fastpe
    triton-report`: up to 16 more registers on sm_90 and sm_100 with the strides grouped by
    tensor, up to 7 more with the soft-cap next to the window's offsets)."""
    pid_m, split, b, h, hk = program_ids(Hq, group)
    qs, ks, vs, os, ls, ms, alibi_strides, bias_strides, stride_cos, qps, kps = strides
    # the tuples _attention_common's helpers take
    score_params = (window, scales)
    mask = (mask_ptr, ms)
    alibi = (alibi_ptr, alibi_strides)
    relative_bias = (bias_ptr, bias_strides, bias_params[0], bias_params[1])
    rope = (rope_tables[0], rope_tables[1], stride_cos, half)
    q_positions = (positions_ptrs[0], qps, positions_offsets[0])
    k_positions = (positions_ptrs[1], kps, positions_offsets[1])
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Sq
    dcols = tl.arange(0, BLOCK_D)
    vcols = tl.arange(0, BLOCK_DV)
    k_base = k_ptr + b * ks[0] + hk * ks[1]
    v_base = v_ptr + b * vs[0] + hk * vs[1]
    q_tile = _load_tile(
        q_ptr + b * qs[0] + h * qs[1],
        rows,
        dcols,
        (qs[2], qs[3]),
        row_ok,
        dcols < D,
        b,
        q_positions,
        rope,
        HAS_ROPE,
        HAS_QPOS,
        ROPE_INTERLEAVED,
    )
    if RAW_SCORES:  # the scale joins the exponent: q stays as loaded, a tensor-core operand
        to_log2 = scales[0] * LOG2E
    else:
        q_tile = q_tile * scales[0]
        to_log2 = LOG2E
    if not DOT_FP32:
        q_tile = q_tile.to(k_ptr.dtype.element_ty)

    # the keys this block may see, then this program's slice of them
    end = Sk
    shift = query_shift
    end_keys = Sk
    if HAS_KEY_LEN:
        end_keys = tl.load(key_len_ptr + b)
        end = tl.minimum(end, end_keys)
        if BOTTOM_RIGHT:  # FlashAttention's rule for a ragged KV cache: the last Sq of L_b
            shift = end_keys - Sq
    lo, hi = key_range(
        pid_m, split, end, shift, keys_per_split, score_params, CAUSAL, HAS_WINDOW, BLOCK_M
    )
    qpos_keys = rows + shift  # each query's position on the key axis

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    slope = alibi_slope(alibi, b, h, HAS_ALIBI)
    near = alibi_near(qpos_keys, end_keys, HAS_ALIBI)
    diagonal = pid_m * BLOCK_M + shift  # the block's first query, on the key axis
    # the whole tiles every query of the block sees (below the causal diagonal, before the
    # last, partial tile) go without masks; a window or a mask takes every tile masked
    full_hi = lo
    if not (HAS_WINDOW or HAS_MASK):
        edge = hi
        if CAUSAL:
            edge = tl.minimum(hi, diagonal + 1)
        full_hi = lo + tl.maximum(edge - lo, 0) // BLOCK_N * BLOCK_N
    for masked in tl.static_range(2):  # the unmasked tiles, then the masked ones
        if masked or not (HAS_WINDOW or HAS_MASK):
            acc, m_i, l_i = _key_tiles(
                acc,
                m_i,
                l_i,
                q_tile,
                full_hi if masked else lo,
                hi if masked else full_hi,
                (k_base, v_base),
                ks,
                vs,
                rows,
                row_ok,
                dcols,
                vcols,
                (D, Dv),
                b,
                h,
                diagonal,
                qpos_keys,
                slope,
                near,
                score_params,
                relative_bias,
                mask,
                rope,
                k_positions,
                to_log2,
                masked == 1,
                FULL_D,
                CAUSAL,
                HAS_WINDOW,
                HAS_SOFTCAP,
                HAS_MASK,
                MASK_IS_BOOL,
                HAS_ALIBI,
                HAS_RELATIVE_BIAS,
                RELATIVE_BIAS_BUCKETS,
                RELATIVE_BIAS_BIDIRECTIONAL,
                HAS_ROPE,
                ROPE_INTERLEAVED,
                HAS_KPOS,
                DOT_FP32,
                BLOCK_N,
            )
    if RAW_SCORES:
        m_i = m_i * scales[0]  # the largest score, scaled
    o, row_lse = epilogue(acc, m_i, l_i, slope, near, sinks_ptr, h, split, HAS_ALIBI, HAS_SINKS)
    o_ptrs = (
        out_ptr
        + split * os[0]
        + b * os[1]
        + h * os[2]
        + rows[:, None] * os[3]
        + vcols[None, :] * os[4]
    )
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (vcols[None, :] < Dv))
    tl.store(lse_ptr + split * ls[0] + b * ls[1] + h * ls[2] + rows * ls[3], row_lse, mask=row_ok)


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


# (for _prune) on sm_90 and later, by (head dim class, RoPE in the kernel, fp32 dots), the
# configs that spill 8-16 bytes there (bench/results/triton-aot-forward.md): with key lengths
# at head dim 256, fp32 at 64 ...
_SM90_OUT = {(256, False, False): {(32, 32, 4, 2)}, (64, False, True): {(32, 16, 4, 2)}}
# ... and the only config left, replaced by one that does not spill there: every feature with
# RoPE at head dim 64 (once scores carry extras: ``biased`` in _prune) and fp32 at 256 with a
# per-element bias (ALiBi, T5, a float mask; the soft-cap, window and sinks keep 8 warps)
_SM90_BIASED_SWAP = {
    (64, True, False): ({(64, 32, 8, 2)}, {(32, 32, 4, 2)}),
    (256, False, True): ({(32, 16, 8, 2)}, {(32, 16, 4, 2)}),
}


def _sm90_fits(fits, capability, dclass, biased, kwargs):
    """``fits`` less the configs of _T5_SM90_OUT (with a T5 bias) and _SM90_OUT, with
    _SM90_BIASED_SWAP applied, on sm_90 and later (a part of _prune)."""
    if capability < 90:
        return fits
    if kwargs.get("HAS_RELATIVE_BIAS"):
        fits = fits - _T5_SM90_OUT[dclass]
    key = (dclass, bool(kwargs.get("HAS_ROPE")), bool(kwargs.get("DOT_FP32")))
    fits = fits - _SM90_OUT.get(key, set())
    per_element = _per_element_bias(kwargs)
    if key in _SM90_BIASED_SWAP and (per_element if key[2] else biased):
        out, into = _SM90_BIASED_SWAP[key]
        fits = (fits - out) | into
    return fits


def merge_launch_args(part_out, part_lse, out, lse):
    """(kernel, grid, args, constexprs) of the merge of flattened parts: part_out [n, rows, Dv]
    and part_lse [n, rows] (unit last stride) into out [rows, Dv] and lse [rows]."""
    n, rows, dv = part_out.shape
    block_r = 16
    args = (
        part_out,
        part_lse,
        out,
        lse,
        n,
        rows,
        dv,
        part_out.stride(0),
        part_out.stride(1),
        part_lse.stride(0),
        out.stride(0),
    )
    return (
        _merge_kernel,
        (triton.cdiv(rows, block_r),),
        args,
        {"BLOCK_R": block_r, "BLOCK_DV": next_pow2(dv)},
    )


def _merge(part_out, part_lse, out_dtype):
    """part_out [n, ..., Dv], part_lse [n, ...] -> (out [..., Dv], lse [...])."""
    n, *lead, dv = part_out.shape
    rows = part_lse[0].numel()
    po = part_out.reshape(n, rows, dv).contiguous()
    pl = part_lse.reshape(n, rows).contiguous().float()
    out = torch.empty((rows, dv), dtype=out_dtype, device=part_out.device)
    lse = torch.empty(rows, dtype=torch.float32, device=part_out.device)
    if rows:
        kernel, grid, args, constexprs = merge_launch_args(po, pl, out, lse)
        kernel[grid](*args, **constexprs)
    return out.reshape(*lead, dv), lse.reshape(lead)


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


def split_keys(programs, max_q, keys, num_sms, dtype):
    """(n_splits, keys_per_split, dtype of the parts) of a launch of ``programs`` (query blocks
    x heads x batch) over at most ``keys`` keys: the keys are split when the programs cannot
    fill the GPU (decoding), and split parts are kept in fp32 for the merge. n_splits is at
    most 2·num_sms (a few hundred), far below the 65535 of the grid axis that holds it."""
    n_splits = 1
    if not interpreted() and num_sms and programs < num_sms and keys > 4 * SPLIT_GRANULE:
        n_splits = min(triton.cdiv(keys, SPLIT_GRANULE), triton.cdiv(2 * num_sms, programs))
    elif interpreted() and max_q == 1 and keys > SPLIT_GRANULE:
        n_splits = 2  # keep the split-KV path covered by the interpreter tests
    keys_per_split = triton.cdiv(triton.cdiv(keys, n_splits), SPLIT_GRANULE) * SPLIT_GRANULE
    via_fp32 = n_splits > 1 or low_precision_via_fp32(dtype)
    return n_splits, keys_per_split, torch.float32 if via_fp32 else dtype


def merged(part_out, part_lse):
    """(out, lse) from the parts of the key splits: the only part as it is, else their merge
    (in fp32)."""
    if part_out.shape[0] == 1:
        return part_out[0], part_lse[0]
    return _merge(part_out, part_lse, torch.float32)


def launch_args(
    q,
    k,
    v,
    part_out,
    part_lse,
    *,
    options,
    keys_per_split,
    mask=None,
    key_lengths=None,
    relative_bias=None,
    rope=None,
):
    """(kernel, grid, args, constexprs) of the forward kernel: the one place its arguments are
    assembled, for ``attention_triton`` and for ``fastpe triton-report`` (which calls it on meta
    tensors). part_out [n_splits, B, Hq, Sq, Dv], part_lse [n_splits, B, Hq, Sq]; ``rope`` as in
    ``attention_triton`` and rotated in the kernel; the other options as there. The grid is a
    function of the autotuned block sizes."""
    batch, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    n_splits = part_out.shape[0]
    device = q.device
    dummy = torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=device)
    pos_dummy = torch.zeros((1, 1), dtype=torch.int64, device=device)

    def positions(p):
        if p is None:
            return pos_dummy, (1, 1)
        return p, (0, p.stride(0)) if p.dim() == 1 else (p.stride(0), p.stride(1))

    if rope is not None:
        cos, sin, interleaved, (q_pos, q_offset), (k_pos, k_offset) = rope
        cos, sin = cos.contiguous(), sin.contiguous()  # the kernel assumes unit column stride
    else:
        cos = sin = dummy[0, 0]
        interleaved, q_pos, q_offset, k_pos, k_offset = False, None, 0, None, 0
    (mask_arg, alibi_arg, bias_arg), score_flags = score_args(
        device, options, mask=mask, relative_bias=relative_bias
    )
    # "unbounded" reaches past every key (|qpos - j| < Sq + Sk)
    (window, scales), param_flags = score_param_args(options, sq + sk + 1)
    (q_pos, q_pos_strides), (k_pos, k_pos_strides) = positions(q_pos), positions(k_pos)
    args = (
        q,
        k,
        v,
        part_out,
        part_lse,
        mask_arg[0],
        key_lengths if key_lengths is not None else pos_dummy[0],
        alibi_arg[0],
        bias_arg[0],
        (cos, sin),
        (q_pos, k_pos),
        options.sinks if options.sinks is not None else dummy[0, 0, 0],
        hq,
        hq // hkv,
        sq,
        sk,
        d,
        dv,
        sk - sq if options.bottom_right else 0,
        cos.shape[1] if rope is not None else 0,
        keys_per_split,
        (q_offset, k_offset),
        bias_arg[2:],
        window,
        (
            q.stride(),
            k.stride(),
            v.stride(),
            part_out.stride(),
            part_lse.stride(),
            mask_arg[1],
            alibi_arg[1],
            bias_arg[1],
            cos.stride(0),
            q_pos_strides,
            k_pos_strides,
        ),
        scales,
        (tuning_length(sq), tuning_length(sk)),
    )
    constexprs = dict(
        **forward_flags(options),
        **param_flags,
        HAS_KEY_LEN=key_lengths is not None,
        **score_flags,
        HAS_ROPE=rope is not None,
        ROPE_INTERLEAVED=interleaved,
        HAS_QPOS=rope is not None and rope[3][0] is not None,
        HAS_KPOS=rope is not None and rope[4][0] is not None,
        # fp32 inputs get IEEE fp32 dots (Triton's default for fp32 is TF32, ~1e-3 relative)
        DOT_FP32=low_precision_via_fp32(q.dtype) or q.dtype == torch.float32,
        # D and Dv fill their tiles: no column mask in the key loop
        FULL_D=d == next_pow2(d) and dv == next_pow2(dv),
        # no score modifier needs scaled scores: the loop keeps q·kᵀ raw and scales it in the
        # exponent (with the max, which a positive scale preserves)
        RAW_SCORES=float(options.scale) > 0
        and not (_per_element_bias(score_flags) or param_flags["HAS_SOFTCAP"]),
        BLOCK_D=next_pow2(d),
        BLOCK_DV=next_pow2(dv),
    )

    def grid(meta):
        return forward_grid(triton.cdiv(sq, meta["BLOCK_M"]), batch * hq, n_splits)

    return _attention_kernel, grid, args, constexprs


def attention_triton(
    q, k, v, *, options, mask=None, key_lengths=None, relative_bias=None, rope=None, num_sms=None
):
    """Launch on torch tensors (CUDA, or CPU under TRITON_INTERPRET=1).

    Query i of sequence b sits at key position i + L_b - Sq when ``bottom_right`` (L_b =
    key_lengths[b], or Sk), i otherwise. ``mask`` is
    None or bool/float, already broadcast to [B, Hq, Sq, Sk] (a stride-0 view); ``relative_bias``
    None or (table [num_buckets, Hq], num_buckets, max_distance, bidirectional); ``rope`` None or
    (cos, sin, interleaved, q_positions, k_positions), each positions entry (int64 tensor [S] or
    [B, S] or None, int offset): the rows of cos/sin used are tensor values, or offset + index.
    ``options`` the attention options (see ``_attention_common``). Returns (out [B, Hq, Sq, Dv] in q's dtype, lse fp32 [B, Hq, Sq])."""
    batch, hq, sq, d = q.shape
    sk, dv = k.shape[2], v.shape[3]
    device = q.device
    n_splits, keys_per_split, out_dtype = split_keys(
        triton.cdiv(sq, 64) * batch * hq, sq, sk, num_sms, q.dtype
    )
    part_out = torch.empty((n_splits, batch, hq, sq, dv), dtype=out_dtype, device=device)
    part_lse = torch.empty((n_splits, batch, hq, sq), dtype=torch.float32, device=device)
    biased = _per_element_bias(
        {
            "HAS_RELATIVE_BIAS": relative_bias is not None,
            "HAS_ALIBI": options.alibi_slopes is not None,
            "HAS_MASK": mask is not None,
            "MASK_IS_BOOL": mask is not None and mask.dtype == torch.bool,
        }
    )
    if rope is not None and not _rope_in_kernel(d, q.dtype == torch.float32, biased):
        q, k = _rotated_first(q, k, rope)
        rope = None
    if batch * hq * sq:
        kernel, grid, args, constexprs = launch_args(
            q,
            k,
            v,
            part_out,
            part_lse,
            options=options,
            keys_per_split=keys_per_split,
            mask=mask,
            key_lengths=key_lengths,
            relative_bias=relative_bias,
            rope=rope,
        )
        kernel[grid](*args, **constexprs)
    out, lse = merged(part_out, part_lse)
    return out.to(q.dtype), lse
