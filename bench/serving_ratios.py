"""Serving-attention ratios on the CPU, measured in one run (interleaved rounds, median and spread).

    .venv/bin/python bench/serving_ratios.py [--rounds 7] [--dtype float32|bfloat16]

- packed prefill: 8 sequences, lengths spread over 64 … 2048, H 16/4, D 128, causal —
  fastpe.attention_varlen vs torch SDPA on the padded batch with a padding + causal mask;
- paged decode: B 8, Sk 4096, H 32/8, D 128, block size 16 and 256 — fastpe.attention_kvcache
  on a paged cache vs fastpe.attention on the contiguous cache, and vs SDPA on the contiguous
  cache.
Each round times every implementation once (best of a few calls), so machine noise hits all of
them alike; the ratios are per round, reported as median [min, max]. Nothing is written.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
import torch.nn.functional as F
from _interleaved import rounds

import fastpe


def report(title, table, pairs):
    print(f"\n{title}")
    for name, times in table.items():
        print(
            f"  {name:32s} median {statistics.median(times) * 1e3:9.2f} ms  "
            f"[{min(times) * 1e3:.2f}, {max(times) * 1e3:.2f}]"
        )
    for a, b in pairs:
        ratios = [tb / ta for ta, tb in zip(table[a], table[b], strict=True)]
        print(
            f"  {b} / {a}: {statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]"
        )


def packed_prefill(dtype, n_rounds):
    torch.manual_seed(0)
    lengths = np.round(np.geomspace(64, 2048, 8)).astype(int)
    hq, hkv, d, total = 16, 4, 128, int(lengths.sum())
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    q = torch.randn(total, hq, d, dtype=dtype)
    k, v = torch.randn(total, hkv, d, dtype=dtype), torch.randn(total, hkv, d, dtype=dtype)
    s = int(lengths.max())
    qp = torch.zeros(8, hq, s, d, dtype=dtype)
    kp, vp = torch.zeros(8, hkv, s, d, dtype=dtype), torch.zeros(8, hkv, s, d, dtype=dtype)
    for b in range(8):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        qp[b, :, : lengths[b]] = q[rows].transpose(0, 1)
        kp[b, :, : lengths[b]] = k[rows].transpose(0, 1)
        vp[b, :, : lengths[b]] = v[rows].transpose(0, 1)
    pos = torch.arange(s)
    valid = pos[None, :] < torch.as_tensor(lengths)[:, None]
    mask = (pos[None, :, None] >= pos[None, None, :]) & valid[:, None, :]  # [B, S, S]
    mask = mask[:, None]

    named = {
        "fastpe attention_varlen": lambda: fastpe.attention_varlen(
            q, k, v, cu, cu, causal=True, backend="numba"
        ),
        "sdpa padded + mask": lambda: F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=mask, enable_gqa=True
        ),
    }
    out = named["fastpe attention_varlen"]()
    ref = named["sdpa padded + mask"]()
    err = max(
        (out[int(cu[b]) : int(cu[b + 1])].float() - ref[b, :, : lengths[b]].transpose(0, 1).float())
        .abs()
        .max()
        .item()
        for b in range(8)
    )
    table = rounds(named, n_rounds, 2)
    report(
        f"packed prefill, lengths {lengths.tolist()} H16/4 D128 causal {dtype} (max |diff| {err:.1e})",
        table,
        [("fastpe attention_varlen", "sdpa padded + mask")],
    )


def paged_decode(dtype, n_rounds):
    torch.manual_seed(0)
    b, sk, hq, hkv, d = 8, 4096, 32, 8, 128
    q = torch.randn(b, 1, hq, d, dtype=dtype)
    k = torch.randn(b, hkv, sk, d, dtype=dtype)
    v = torch.randn(b, hkv, sk, d, dtype=dtype)
    lengths = torch.full((b,), sk, dtype=torch.int32)
    named = {
        "fastpe attention (contiguous)": lambda: fastpe.attention(
            q.transpose(1, 2), k, v, causal=True, backend="numba"
        ),
        "sdpa (contiguous)": lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, enable_gqa=True
        ),
    }
    for block in (16, 256):
        pages = sk // block
        table = torch.randperm(b * pages, dtype=torch.int32).reshape(b, pages)
        k_cache = torch.empty(b * pages, block, hkv, d, dtype=dtype)
        v_cache = torch.empty(b * pages, block, hkv, d, dtype=dtype)
        k_cache[table.long()] = k.transpose(1, 2).reshape(b, pages, block, hkv, d)
        v_cache[table.long()] = v.transpose(1, 2).reshape(b, pages, block, hkv, d)
        named[f"fastpe paged block {block}"] = lambda kc=k_cache, vc=v_cache, t=table: (
            fastpe.attention_kvcache(
                q, kc, vc, cache_seqlens=lengths, block_table=t, causal=True, backend="numba"
            )
        )
    ref = named["sdpa (contiguous)"]().transpose(1, 2).float()
    err = max((named[n]().float() - ref).abs().max().item() for n in named if "paged" in n)
    results = rounds(named, n_rounds, 3)
    pairs = [
        (f"fastpe paged block {bs}", other)
        for bs in (16, 256)
        for other in ("fastpe attention (contiguous)", "sdpa (contiguous)")
    ]
    report(f"paged decode B8 Sk4096 H32/8 D128 {dtype} (max |diff| {err:.1e})", results, pairs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--only", choices=["prefill", "decode"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"torch threads {torch.get_num_threads()}")
    if args.only != "decode":
        packed_prefill(dtype, args.rounds)
    if args.only != "prefill":
        paged_decode(dtype, args.rounds)


if __name__ == "__main__":
    main()
