"""Serving-attention ratios on the CPU, measured in one run (interleaved rounds, median and spread).

    .venv/bin/python bench/serving_ratios.py [--rounds 7] [--dtype float32|bfloat16]

- packed prefill: 8 sequences, lengths spread over 64 … 2048, H 16/4, D 128, causal —
  fastpe.attention_varlen vs torch SDPA on the padded batch with a padding + causal mask;
- paged decode: B 8, Sk 4096, H 32/8, D 128, block size 16 and 256 — fastpe.attention_kvcache
  on a paged cache vs fastpe.attention on the contiguous cache, and vs SDPA on the contiguous
  cache; in bfloat16 also fastpe on float8_e4m3fn (a scale per kv head) and int8 (a scale per
  token and kv head) caches of the same values.
Where Intel Extension for PyTorch imports (it needs its own torch: run from a venv that has it,
with fastpe installed there too), also IPEX's kernels, each on its own layout: the packed
prefill by ``ipex.llm.functional.varlen_attention``, the paged decode by
``PagedAttention.single_query_cached_kv_attention`` ([blocks, Hkv, block, D] caches; block 16
only: IPEX 2.8 corrupts its heap at block 256), against fastpe's float cache and its 8-bit ones.
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
from _kv_caches import eight_bit_caches

import fastpe

try:
    import intel_extension_for_pytorch as ipex
except ImportError:
    ipex = None


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
    pairs = [("fastpe attention_varlen", "sdpa padded + mask")]
    if ipex is not None:
        ipex_out = torch.empty_like(q)
        named["ipex varlen_attention"] = lambda: ipex.llm.functional.varlen_attention(
            q, k, v, ipex_out, cu, cu, None, s, s, 0.0, d**-0.5, False, True, False, None
        )
        pairs.append(("fastpe attention_varlen", "ipex varlen_attention"))
    out = named["fastpe attention_varlen"]()
    ref = named["sdpa padded + mask"]()
    err = max(
        (out[int(cu[b]) : int(cu[b + 1])].float() - ref[b, :, : lengths[b]].transpose(0, 1).float())
        .abs()
        .max()
        .item()
        for b in range(8)
    )
    if ipex is not None:
        named["ipex varlen_attention"]()
        err = max(err, (ipex_out.float() - out.float()).abs().max().item())
    table = rounds(named, n_rounds, 2)
    report(
        f"packed prefill, lengths {lengths.tolist()} H16/4 D128 causal {dtype} (max |diff| {err:.1e})",
        table,
        pairs,
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
    heads = torch.arange(hkv, dtype=torch.int32).repeat_interleave(hq // hkv)  # IPEX's GQA map

    def paged(k_cache, v_cache, table, k_scale=None, v_scale=None):
        return lambda: fastpe.attention_kvcache(
            q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, causal=True,
            k_scale=k_scale, v_scale=v_scale, backend="numba",
        )  # fmt: skip

    for block in (16, 256):
        pages = sk // block
        table = torch.randperm(b * pages, dtype=torch.int32).reshape(b, pages)
        k_cache = torch.empty(b * pages, block, hkv, d, dtype=dtype)
        v_cache = torch.empty(b * pages, block, hkv, d, dtype=dtype)
        k_cache[table.long()] = k.transpose(1, 2).reshape(b, pages, block, hkv, d)
        v_cache[table.long()] = v.transpose(1, 2).reshape(b, pages, block, hkv, d)
        named[f"fastpe paged block {block}"] = paged(k_cache, v_cache, table)
        if dtype == torch.bfloat16 and block == 16:
            eight_bit = eight_bit_caches(k_cache, v_cache, fp8_bound=5.0)
            for name, (kq, vq, ks, vs) in eight_bit.items():
                named[f"fastpe paged block 16, {name} 8-bit cache"] = paged(kq, vq, table, ks, vs)
        if ipex is not None and block == 16:  # IPEX 2.8 corrupts its heap at block 256
            from intel_extension_for_pytorch.llm.modules import PagedAttention

            out = torch.empty(b, hq, d, dtype=dtype)
            kc, vc = (c.transpose(1, 2).contiguous() for c in (k_cache, v_cache))
            named[f"ipex paged block {block}"] = lambda kc=kc, vc=vc, t=table, out=out, n=block: (
                PagedAttention.single_query_cached_kv_attention(
                    out, q[:, 0], kc, vc, heads, d**-0.5, t, lengths, n, sk, None
                ),
                out[:, None],
            )[1]
    ref = named["sdpa (contiguous)"]().transpose(1, 2).float()
    err = max(
        (named[n]().float() - ref).abs().max().item()
        for n in named
        if "paged" in n and "bit" not in n
    )  # the 8-bit caches' error is their quantisation's (tests/attention/test_kv_quant.py)
    results = rounds(named, n_rounds, 3)
    pairs = [
        (f"fastpe paged block {bs}", other)
        for bs in (16, 256)
        for other in ("fastpe attention (contiguous)", "sdpa (contiguous)")
    ]
    if ipex is not None:
        pairs.append(("fastpe paged block 16", "ipex paged block 16"))
        pairs += [(n, "ipex paged block 16") for n in named if "bit" in n]
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
