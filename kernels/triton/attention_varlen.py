"""Packed variable-length attention on Triton: the forward kernel launched once per sequence on
strided views of the packed tensors (no padding is allocated or computed).

One launch per sequence costs launch overhead that a single varlen kernel would not (left for
later: docs/README.md); the numbers it computes are the forward kernel's.
"""

from __future__ import annotations

import torch
from fastpe.kernels.triton.apply_rope import apply_rope_triton
from fastpe.kernels.triton.attention import attention_triton


def _rotated(x, cos, sin, positions, interleaved):
    """Packed x [T, H, D] rotated at positions [T] (int64 tensor)."""
    (out,) = apply_rope_triton(
        (x[None],), cos, sin, positions[None], 0, interleaved=interleaved, layout="bshd",
        inplace=False,
    )  # fmt: skip
    return out[0]


def attention_varlen_triton(
    q, k, v, cu_q, cu_k, *, scale, causal, bottom_right, rope=None, alibi_slopes=None,
    window=None, softcap=None, sinks=None, num_sms=None,
):  # fmt: skip
    """q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv] torch tensors; cu_q, cu_k host int
    sequences [B + 1]; ``rope`` None or (cos, sin, interleaved, q_positions [Tq],
    k_positions [Tk] int64 tensors); ``alibi_slopes`` fp32 [B, Hq] or None. Returns (out
    [Tq, Hq, Dv] in q's dtype, lse fp32 [Hq, Tq])."""
    total_q, hq, _ = q.shape
    if rope is not None:
        cos, sin, interleaved, q_pos, k_pos = rope
        cos, sin = cos.contiguous(), sin.contiguous()
        q = _rotated(q, cos, sin, q_pos, interleaved).to(q.dtype)
        k = _rotated(k, cos, sin, k_pos, interleaved).to(k.dtype)
    out = torch.zeros((total_q, hq, v.shape[2]), dtype=q.dtype, device=q.device)
    lse = torch.full((hq, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if rows.stop == rows.start:
            continue
        part, part_lse = attention_triton(
            *(x[None].transpose(1, 2) for x in (q[rows], k[keys], v[keys])),
            scale=scale, causal=causal, bottom_right=bottom_right,
            alibi_slopes=None if alibi_slopes is None else alibi_slopes[b : b + 1],
            window=window, softcap=softcap, sinks=sinks, num_sms=num_sms,
        )  # fmt: skip
        out[rows] = part[0].transpose(0, 1)
        lse[:, rows] = part_lse[0]
    return out, lse
