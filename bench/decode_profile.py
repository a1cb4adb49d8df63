"""Where paged decode time goes, on measures a shared machine disturbs less: the CPU time of
the kernel on one thread (Numba and torch set to 1 thread; CPU time, not wall time, so that
other processes' load shows less), per cache dtype, with the cache cold (a random block table
over the whole cache: read from memory) and hot (every sequence's pages mapped onto the same
16 blocks: the same arithmetic on data held in the CPU's caches), and the bytes read per
second against this machine's single-thread read bandwidth (a NumPy sum of 64 MiB).

    python bench/decode_profile.py [--rounds 5]

B 8, Sk 4096, Hq 32 / Hkv 8, D 128, block 16: float32 (float32 queries), bfloat16, fp8 and
int8 caches (bfloat16 queries). Each round times every (cache, cold/hot) once, in turn.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy
import torch

import fastpe

B, SK, HQ, HKV, D, BLOCK = 8, 4096, 32, 8, 128, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    numba.set_num_threads(1)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    pages = SK // BLOCK
    shape = (B * pages, BLOCK, HKV, D)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tables = {
        "cold": torch.randperm(B * pages, generator=gen).reshape(B, pages).to(torch.int32),
        "hot": (torch.arange(B * pages) % 16).reshape(B, pages).to(torch.int32),
    }
    q = torch.randn(B, 1, HQ, D, generator=gen)
    fp8_scale = torch.full((HKV,), 4.0 / 448)
    runs = {"f32": (k, v, None, None), "bf16": (k.bfloat16(), v.bfloat16(), None, None)}
    runs["fp8"] = tuple(
        (x / fp8_scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn) for x in (k, v)
    ) + (fp8_scale, fp8_scale)
    int8 = []
    for x in (k, v):
        scale = x.abs().amax(-1) / 127
        int8.append((torch.round(x / scale[..., None]).to(torch.int8), scale))
    runs["int8"] = (int8[0][0], int8[1][0], int8[0][1], int8[1][1])
    lengths = torch.full((B,), SK, dtype=torch.int32)

    def call(name, table):
        kc, vc, ks, vs = runs[name]
        return fastpe.attention_kvcache(
            q if name == "f32" else q.bfloat16(),
            kc,
            vc,
            cache_seqlens=lengths,
            block_table=tables[table],
            k_scale=ks,
            v_scale=vs,
            backend="numba",
        )

    a = numpy.ones(64 * 2**20 // 8)
    read = min(_cpu(a.sum) for _ in range(5))
    bandwidth = a.nbytes / read / 1e9
    print(f"single-thread read bandwidth (NumPy sum of 64 MiB): {bandwidth:.1f} GB/s")
    cases = [(name, table) for name in runs for table in tables]
    for case in cases:
        call(*case)  # compile, warm
    times = {case: [] for case in cases}
    for _ in range(args.rounds):
        for case in cases:
            times[case].append(_cpu(lambda case=case: call(*case)))
    elements = 2 * B * SK * HKV * D
    print("CPU time of one call, median [min, max]; per cache element; cache bytes per second")
    for (name, table), t in times.items():
        nbytes = sum(x.numel() * x.element_size() for x in runs[name] if x is not None)
        med = statistics.median(t)
        print(
            f"  {name} {table} median {med * 1e3:7.2f} ms [{min(t) * 1e3:.2f}, {max(t) * 1e3:.2f}]"
            f"  {med / elements * 1e9:.3f} ns/element  {nbytes / med / 1e9:.1f} GB/s"
        )


def _cpu(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


if __name__ == "__main__":
    main()
