"""Decode on a non-contiguous KV cache vs a contiguous cache of the same shape, in one run
(interleaved rounds, median and spread).

    .venv/bin/python bench/strided_cache.py [--rounds 7] [--dtype float32|bfloat16]

B 8, Sk 4096, Hq 32, Hkv 8, D 128, one query per sequence, causal, fastpe.attention_kvcache:

- paged, block 16: K and V as the halves ``kv[:, 0]``, ``kv[:, 1]`` of one
  [blocks, 2, 16, Hkv, D] buffer (vLLM's and transformers' allocation) vs separate contiguous
  [blocks, 16, Hkv, D] caches holding the same values, same block table;
- contiguous: the halves of one [B, 2, S, Hkv, D] buffer vs separate contiguous [B, S, Hkv, D]
  caches;
- heads-major: [B, Hkv, S, D] caches (transposed to [B, S, Hkv, D] views, transformers'
  layout) vs the contiguous [B, S, Hkv, D] ones — strided within a row, read through the
  kernel's per-run copy.

Each round times every variant once (best of a few calls), so machine noise hits them alike;
ratios (strided time / contiguous time) are per round, reported as median [min, max]. Nothing is
written.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from serving_ratios import best_of  # bench/ is the script's folder, on sys.path

import fastpe


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=3, help="calls per round (best is kept)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--backend", default="numba")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    b, sk, hq, hkv, d, block = 8, 4096, 32, 8, 128, 16
    q = torch.randn(b, 1, hq, d, dtype=dtype)
    lengths = torch.full((b,), sk, dtype=torch.int32)
    pages = sk // block
    table = torch.randperm(b * pages, dtype=torch.int32).reshape(b, pages)

    paged_kv = torch.randn(b * pages, 2, block, hkv, d, dtype=dtype)
    paged_k, paged_v = paged_kv[:, 0].contiguous(), paged_kv[:, 1].contiguous()
    flat_kv = torch.randn(b, 2, sk, hkv, d, dtype=dtype)
    flat_k, flat_v = flat_kv[:, 0].contiguous(), flat_kv[:, 1].contiguous()
    heads_k = flat_k.transpose(1, 2).contiguous().transpose(1, 2)
    heads_v = flat_v.transpose(1, 2).contiguous().transpose(1, 2)

    def call(k_cache, v_cache, paged):
        extra = {"block_table": table} if paged else {}
        return lambda: fastpe.attention_kvcache(
            q, k_cache, v_cache, cache_seqlens=lengths, causal=True, backend=args.backend, **extra
        )

    named = {
        "paged b16, contiguous caches": call(paged_k, paged_v, True),
        "paged b16, kv[:, 0] / kv[:, 1]": call(paged_kv[:, 0], paged_kv[:, 1], True),
        "contiguous [B,S,H,D] caches": call(flat_k, flat_v, False),
        "contiguous, kv[:, 0] / kv[:, 1]": call(flat_kv[:, 0], flat_kv[:, 1], False),
        "contiguous, heads-major views": call(heads_k, heads_v, False),
    }
    pairs = [
        ("paged b16, contiguous caches", "paged b16, kv[:, 0] / kv[:, 1]"),
        ("contiguous [B,S,H,D] caches", "contiguous, kv[:, 0] / kv[:, 1]"),
        ("contiguous [B,S,H,D] caches", "contiguous, heads-major views"),
    ]
    outs = {name: fn() for name, fn in named.items()}  # compile / warm caches
    print(f"torch threads {torch.get_num_threads()}, backend {args.backend}, {dtype}")
    print(f"decode B{b} Sk{sk} H{hq}/{hkv} D{d}, block {block}")
    for base, other in pairs:
        diff = (outs[base].float() - outs[other].float()).abs().max().item()
        print(f"  max |{other} - {base}| = {diff:.1e}")
    table_ = {name: [] for name in named}
    for _ in range(args.rounds):
        for name, fn in named.items():
            table_[name].append(best_of(fn, args.calls))
    for name, times in table_.items():
        print(
            f"  {name:34s} median {statistics.median(times) * 1e3:8.2f} ms  "
            f"[{min(times) * 1e3:.2f}, {max(times) * 1e3:.2f}]"
        )
    for base, other in pairs:
        ratios = [t / t0 for t0, t in zip(table_[base], table_[other], strict=True)]
        print(
            f"  {other} / {base}: {statistics.median(ratios):.2f}x "
            f"[{min(ratios):.2f}, {max(ratios):.2f}]"
        )


if __name__ == "__main__":
    main()
