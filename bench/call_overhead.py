"""Per-call cost of one-token (decode-step) calls, where fastpe's Python layer (validation,
backend choice, conversions, the launcher) costs as much as the kernel or more.

    python bench/call_overhead.py [--rounds 7] [--calls 500]

Cases, on float32 CPU tensors, each next to a plain torch computation of the same thing:

- ``apply_rope (q, k) one token``: q [1, 32, 1, 128] and k [1, 8, 1, 128] at position 700 of
  a 4096-row table, a position tensor as transformers passes it; torch: the same rotation
  written as transformers' ``apply_rotary_pos_emb`` (``x·cos + rotate_half(x)·sin``);
- ``attention decode``: q [1, 32, 1, 128] against 4 keys of 8 kv heads (the kernel's own
  work is negligible), causal; torch: SDPA with ``enable_gqa``;
- ``attention_kvcache decode``: the same q against a [1, 512, 8, 128] cache holding 100 keys,
  with and without a ``plan_kvcache`` plan (the serving form: one plan per step, reused by
  every layer).

Each line gives the median [min, max] over ``--rounds`` of the mean time of ``--calls``
calls, in the ``NAME median T ms`` form that ``bench/ab_processes.py`` compares between two
checkouts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fastpe


def _time(call, rounds, calls):
    for _ in range(50):
        call()
    means = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        means.append((time.perf_counter() - start) / calls * 1e3)
    return means


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 1, 128, generator=g)
    k = torch.randn(1, 8, 1, 128, generator=g)
    cos, sin = fastpe.rope_table(4096, 128, dtype="float32", device="cpu")
    position = torch.tensor([[700]])
    full_cos = torch.cat([cos[position], cos[position]], -1)[:, None]  # [1, 1, 1, 128]
    full_sin = torch.cat([sin[position], sin[position]], -1)[:, None]
    keys = torch.randn(1, 8, 4, 128, generator=g)
    values = torch.randn(1, 8, 4, 128, generator=g)
    k_cache = torch.randn(1, 512, 8, 128, generator=g)
    v_cache = torch.randn(1, 512, 8, 128, generator=g)
    q_bshd = q.transpose(1, 2).contiguous()
    lengths = torch.tensor([100], dtype=torch.int32)
    plan = fastpe.plan_kvcache(q_bshd, k_cache, cache_seqlens=lengths)
    cases = {
        "apply_rope (q, k) one token: fastpe": lambda: fastpe.apply_rope(
            (q, k), cos, sin, positions=position
        ),
        "apply_rope (q, k) one token: torch": lambda: (
            q * full_cos + _rotate_half(q) * full_sin,
            k * full_cos + _rotate_half(k) * full_sin,
        ),
        "attention decode: fastpe": lambda: fastpe.attention(q, keys, values, causal=True),
        "attention decode: torch SDPA": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, enable_gqa=True
        ),
        "attention_kvcache decode: fastpe": lambda: fastpe.attention_kvcache(
            q_bshd, k_cache, v_cache, cache_seqlens=lengths, causal=True
        ),
        "attention_kvcache decode: fastpe with plan": lambda: fastpe.attention_kvcache(
            q_bshd, k_cache, v_cache, plan=plan, causal=True
        ),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per call")
    for name, call in cases.items():
        means = _time(call, args.rounds, args.calls)
        print(
            f"  {name} median {statistics.median(means):.4f} ms "
            f"[{min(means):.4f}, {max(means):.4f}]"
        )


if __name__ == "__main__":
    main()
