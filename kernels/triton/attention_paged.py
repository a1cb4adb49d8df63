"""Flash-style attention over packed queries and keys read through a page table (Triton).

The Triton twin of ``fastpe.kernels.numba.attention_paged``, for packed variable-length
batches and KV caches (paged or contiguous) alike. Shapes:

- q [Tq, Hq, D]: sequence b's queries are rows q_start[b] … q_start[b] + q_len[b] - 1;
- k [R, Hkv, D], v [R, Hkv, Dv]: key j of sequence b (j < k_len[b]) is physical row
  ``page_start[b, j // page_size] + j % page_size``;
- out [Tq, Hq, Dv], lse [Hq, Tq] (float32, natural log).

One program = (block of one sequence's queries, sequence and query head, key split); programs
whose block lies past their sequence's queries return at once, so the grid is sized by the
longest sequence but no work is done for the others' padding. Keys past k_len[b] are never
read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fastpe.kernels.triton._common import LOG2E, interpreted, low_precision_via_fp32, next_pow2
from fastpe.kernels.triton.attention import SPLIT_GRANULE, _merge, _tanh


@triton.jit
def _attention_paged_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    q_start_ptr,
    q_len_ptr,
    k_len_ptr,
    page_ptr,
    alibi_ptr,
    sinks_ptr,
    Hq,
    group,
    D,
    Dv,
    page_size,
    keys_per_split,
    win_left,
    win_right,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kr,
    stride_kh,
    stride_kd,
    stride_vr,
    stride_vh,
    stride_vd,
    stride_osplit,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lsplit,
    stride_lt,
    stride_lh,
    stride_pb,
    stride_pp,
    stride_ab,
    stride_ah,
    scale,
    softcap,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
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
    q_len = tl.load(q_len_ptr + b)
    if pid_m * BLOCK_M >= q_len:  # this block is past the sequence's queries
        return
    q0 = tl.load(q_start_ptr + b)
    length = tl.load(k_len_ptr + b)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    dcols = tl.arange(0, BLOCK_D)
    vcols = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + (q0 + rows)[:, None] * stride_qt + h * stride_qh + dcols[None, :] * stride_qd,
        mask=row_ok[:, None] & (dcols[None, :] < D),
        other=0.0,
    ).to(tl.float32)
    q = q * scale
    if not DOT_FP32:
        q = q.to(k_ptr.dtype.element_ty)

    shift = 0
    if BOTTOM_RIGHT:  # FlashAttention's rule: the queries are the last q_len of the keys
        shift = length - q_len
    end = length
    if CAUSAL:
        end = tl.minimum(end, pid_m * BLOCK_M + BLOCK_M + shift)
    if HAS_WINDOW:
        end = tl.minimum(end, pid_m * BLOCK_M + BLOCK_M + shift + win_right)
    end = tl.maximum(end, 0)
    lo = split * keys_per_split
    hi = tl.minimum(end, lo + keys_per_split)
    if HAS_WINDOW:
        lo = tl.maximum(lo, pid_m * BLOCK_M + shift - win_left)
    qpos_keys = rows + shift

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + b * stride_ab + h * stride_ah).to(tl.float32)
        # distances less the row's nearest key (cancels in softmax; lse adds it back)
        near = tl.maximum(tl.maximum(qpos_keys - (length - 1), -qpos_keys), 0)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        page = cols // page_size
        prow = tl.load(page_ptr + b * stride_pb + page * stride_pp, mask=col_ok, other=0)
        prow = prow + cols - page * page_size
        k = tl.load(
            k_ptr + prow[:, None] * stride_kr + hk * stride_kh + dcols[None, :] * stride_kd,
            mask=col_ok[:, None] & (dcols[None, :] < D),
            other=0.0,
        )
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        valid = row_ok[:, None] & col_ok[None, :]
        if HAS_WINDOW:
            valid = valid & (cols[None, :] >= qpos_keys[:, None] - win_left)
            valid = valid & (cols[None, :] <= qpos_keys[:, None] + win_right)
        if CAUSAL:
            valid = valid & (cols[None, :] <= qpos_keys[:, None])
        if HAS_ALIBI:
            s -= slope * (tl.abs(qpos_keys[:, None] - cols[None, :]) - near[:, None]).to(tl.float32)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2((m_i - m_safe) * LOG2E)
        p = tl.exp2((s - m_safe[:, None]) * LOG2E)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + prow[:, None] * stride_vr + hk * stride_vh + vcols[None, :] * stride_vd,
            mask=col_ok[:, None] & (vcols[None, :] < Dv),
            other=0.0,
        )
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v_ptr.dtype.element_ty), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    seen = l_i != 0.0  # NaN too: an overflowed score must show
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    if HAS_ALIBI:
        lse -= slope * near.to(tl.float32)
    if HAS_SINKS:  # logaddexp(lse, sink), on the first key split only
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        sink = tl.where(split == 0, sink, float("-inf"))
        top = tl.maximum(lse, sink)
        top = tl.where(top == float("-inf"), 0.0, top)
        lse_with = top + tl.log(tl.exp(lse - top) + tl.exp(sink - top))
        out = out * tl.exp(lse - lse_with)[:, None]
        lse = lse_with
    t = q0 + rows
    o_ptrs = (
        out_ptr
        + split * stride_osplit
        + t[:, None] * stride_ot
        + h * stride_oh
        + vcols[None, :] * stride_od
    )
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (vcols[None, :] < Dv))
    tl.store(lse_ptr + split * stride_lsplit + t * stride_lt + h * stride_lh, lse, mask=row_ok)


def block_sizes(max_q: int, d: int, fp32: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) that compile without register spills on sm_80/sm_90 (checked by
    ``fastpe triton-report``): thin query tiles for decoding, smaller tiles for fp32 and wide
    heads."""
    if fp32:
        return 16, 16
    if max_q <= 16:
        return 16, 64 if d <= 128 else 32
    return (64, 64) if d <= 64 else (32, 32)


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
    scale,
    causal,
    bottom_right,
    alibi_slopes=None,
    window=None,
    softcap=None,
    sinks=None,
    num_sms=None,
):
    """Launch on torch tensors (CUDA, or CPU under TRITON_INTERPRET=1). q_start, q_len, k_len
    int64 [B] and page_start int64 [B, pages] on q's device; ``max_q``/``max_k`` are read from
    the host copies the caller validated (``q_len.max()`` here would sync); ``alibi_slopes`` fp32
    [B, Hq] or None; ``sinks`` fp32 [Hq] or None. Returns (out [Tq, Hq, Dv] in q's dtype, lse fp32
    [Hq, Tq])."""
    total_q, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    batch = q_len.shape[0]
    max_q, max_k = int(q_len.max()) if batch else 0, int(k_len.max()) if batch else 0
    device = q.device
    dot_fp32 = low_precision_via_fp32(q.dtype) or q.dtype == torch.float32
    block_m, block_n = block_sizes(max_q, d, dot_fp32)
    programs = triton.cdiv(max(max_q, 1), block_m) * batch * hq
    n_splits = 1
    if not interpreted() and num_sms and programs < num_sms and max_k > 4 * SPLIT_GRANULE:
        n_splits = min(triton.cdiv(max_k, SPLIT_GRANULE), triton.cdiv(2 * num_sms, programs))
    elif interpreted() and max_q == 1 and max_k > SPLIT_GRANULE:
        n_splits = 2  # keep the split-KV path covered by the interpreter tests
    keys_per_split = (
        triton.cdiv(triton.cdiv(max(max_k, 1), n_splits), SPLIT_GRANULE) * SPLIT_GRANULE
    )
    out_dtype = torch.float32 if (n_splits > 1 or low_precision_via_fp32(q.dtype)) else q.dtype
    part_out = torch.zeros((n_splits, total_q, hq, dv), dtype=out_dtype, device=device)
    part_lse = torch.full(
        (n_splits, total_q, hq), float("-inf"), dtype=torch.float32, device=device
    )
    dummy = torch.zeros(1, dtype=torch.float32, device=device)
    alibi = alibi_slopes if alibi_slopes is not None else dummy[None]
    unbounded = max_q + max_k + 1
    win_left, win_right = (-1, -1) if window is None else window
    win_left = unbounded if win_left < 0 else win_left
    win_right = unbounded if win_right < 0 else win_right
    if total_q * hq and max_k:
        grid = (triton.cdiv(max_q, block_m), batch * hq, n_splits)
        _attention_paged_kernel[grid](
            q,
            k,
            v,
            part_out,
            part_lse,
            q_start,
            q_len,
            k_len,
            page_start,
            alibi,
            sinks if sinks is not None else dummy,
            hq,
            hq // hkv,
            d,
            dv,
            page_size,
            keys_per_split,
            win_left,
            win_right,
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *part_out.stride(),
            *part_lse.stride(),
            page_start.stride(0),
            page_start.stride(1),
            alibi.stride(0),
            alibi.stride(1),
            scale,
            1.0 if softcap is None else float(softcap),
            CAUSAL=causal,
            HAS_WINDOW=window is not None,
            HAS_SOFTCAP=softcap is not None,
            HAS_SINKS=sinks is not None,
            BOTTOM_RIGHT=bottom_right,
            HAS_ALIBI=alibi_slopes is not None,
            DOT_FP32=dot_fp32,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=next_pow2(d),
            BLOCK_DV=next_pow2(dv),
        )
    elif sinks is not None:  # no key anywhere: lse is the sink
        part_lse[0] = sinks[None, :]
    if n_splits == 1:
        out, lse = part_out[0], part_lse[0]
    else:
        out, lse = _merge(part_out[:, None], part_lse[:, None], torch.float32)
        out, lse = out[0], lse[0]
    return out.to(q.dtype), lse.transpose(0, 1).contiguous()
