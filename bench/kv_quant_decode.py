"""Paged decode on quantized KV caches vs a bfloat16 cache (Numba, CPU), in one run.

    python bench/kv_quant_decode.py [--rounds 9] [--threads 1 2] [--out FILE]

B 8, Sk 4096 (every cache full), Hq 32 / Hkv 8, D 128, block 16, random block table, q
bfloat16 [B, 1, Hq, D]: fastpe.attention_kvcache(backend="numba") on a bfloat16 cache, on a
float8_e4m3fn cache (one scale per kv head) and on an int8 cache (one scale per token and kv
head). Each round runs every thread count in turn (Numba's and torch's threads set alike) and,
within it, times each cache once (best of 3 calls), so machine noise hits all alike; the ratio
bf16 time / quantized time is per round, reported as median [min, max]. Also each quantized
output's max error against the float64 attention on its dequantized cache, to show that the
times are of a correct computation.

What bounds the decode: the bytes each step reads (cache and scales) per second, against this
machine's copy bandwidth measured in the same rounds (torch ``copy_`` of the bfloat16 k and v
caches into other buffers: the same bytes read, and as many written); and each cache timed
"hot", with every page of every sequence mapped onto the same 16 blocks (the same arithmetic on
1/256 of the memory, which stays in the CPU's caches): cold / hot near 1 means memory traffic is
not what limits the kernel, so halving the bytes cannot halve the time. And the kernel's decode
loops alone (the 4 query rows of a kv head against a run of 16 cache rows, widening included, in
L1, one thread: ``_scores_rows`` and ``_add_values_rows``, or for 8-bit caches the pair products
of ``_decode_pairs`` where the CPU has them), in ns per cache element.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy
import torch
from _kv_caches import eight_bit_caches

import fastpe

B, SK, HQ, HKV, D, BLOCK = 8, 4096, 32, 8, 128, 16


def caches():
    gen = torch.Generator().manual_seed(0)
    pages = SK // BLOCK
    shape = (B * pages, BLOCK, HKV, D)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    table = torch.randperm(B * pages, generator=gen).reshape(B, pages).to(torch.int32)
    q = torch.randn(B, 1, HQ, D, generator=gen).to(torch.bfloat16)
    runs = {"bf16": (k.to(torch.bfloat16), v.to(torch.bfloat16), None, None)}
    runs |= eight_bit_caches(k, v, fp8_bound=4.0)  # |x| up to 4 onto the fp8 range
    return q, table, runs


def decode_cost(runs, repeats=2000):
    """ns per cache element of the decode loops alone on one page held in L1: the scores and
    the weighted values of 4 query rows (one kv head's group) against a run of 16 cache rows,
    head by head, as the kernel runs them for bfloat16 queries (widening included; int8 and fp8
    by pair products where the CPU has them, ``_decode_pairs``)."""
    from fastpe.kernels.numba import _decode_pairs
    from fastpe.kernels.numba.attention_paged import _add_values_rows, _scores_rows

    @numba.njit
    def loops(rows, qt, s, p, acc, repeats):
        for _ in range(repeats):
            for hk in range(rows.shape[1]):
                _scores_rows(qt, rows, hk, s, 0)
                _add_values_rows(p, 0, rows, hk, acc)
        return acc[0, 0]

    @numba.njit
    def pair_loops(rows, q16, q_scales, k_scales, s, w16, acc, repeats):
        for _ in range(repeats):
            for hk in range(rows.shape[1]):
                _decode_pairs.pair_scores(s, 0, q16, q_scales, rows, hk, k_scales[:, hk])
                _decode_pairs.pair_add_values(acc, w16, 0, rows, hk)
        return acc[0, 0]

    group = HQ // HKV
    rng = numpy.random.default_rng(0)
    qt = rng.standard_normal((group, D)).astype(numpy.float32)
    s = numpy.zeros((group, BLOCK), numpy.float32)
    p = rng.random((group, BLOCK)).astype(numpy.float32) / BLOCK
    acc = numpy.zeros((group, D), numpy.float32)
    q_scales, k_scales = numpy.ones(group, numpy.float32), numpy.ones((BLOCK, HKV), numpy.float32)
    pair_args = {  # (q16, w16, acc) as each pair path takes them
        "int8": (
            rng.integers(-32767, 32768, (group, D)).astype(numpy.int16),
            rng.integers(0, 32768, (group, BLOCK + 1)).astype(numpy.int16),
            numpy.zeros((group, D), numpy.int32),
        ),
        "fp8": (
            (qt.view(numpy.uint32) >> 16).astype(numpy.uint16),
            (p.view(numpy.uint32) >> 16).astype(numpy.uint16)[:, [*range(BLOCK), 0]],
            numpy.zeros((group, D), numpy.float32),
        ),
    }
    available = {"int8": _decode_pairs.int8_available(), "fp8": _decode_pairs.fp8_available()}
    costs = {}
    for name in ("bf16", "fp8", "int8"):
        rows = runs[name][0][0]  # one block: 16 rows [16, Hkv, D]
        view = {"bf16": torch.uint16, "fp8": torch.uint8}.get(name)
        host = (rows.view(view) if view else rows).numpy()
        if available.get(name):
            q16, w16, pair_acc = pair_args[name]
            args, fn = (host, q16, q_scales, k_scales, s, w16, pair_acc), pair_loops
            name += " (pairs)"
        else:
            args, fn = (host, qt, s, p, acc), loops
        fn(*args, 1)
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            fn(*args, repeats)
            best = min(best, time.perf_counter() - t)
        costs[name] = best / repeats / host.size / 2 * 1e9  # per element of K and of V
    return costs


def max_error(q, table, run, out):
    """max |out - float64 attention on the dequantized cache| over a few sequences."""
    k, v, ks, vs = run
    worst = 0.0
    for b in range(2):
        blocks = table[b].long()
        kb, vb = k[blocks].reshape(SK, HKV, D), v[blocks].reshape(SK, HKV, D)
        kd, vd = kb.to(torch.float64), vb.to(torch.float64)
        if ks is not None:
            kd = kd * (ks if ks.dim() == 1 else ks[blocks].reshape(SK, HKV))[..., None]
            vd = vd * (vs if vs.dim() == 1 else vs[blocks].reshape(SK, HKV))[..., None]
        group = HQ // HKV
        kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
        s = torch.einsum("hd,khd->hk", q[b, 0].double(), kd) / D**0.5
        want = torch.einsum("hk,khd->hd", s.softmax(-1), vd)
        worst = max(worst, (out[b, 0].double() - want).abs().max().item())
    return worst


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, nargs="+", default=[numba.get_num_threads()])
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args()
    load_before = os.getloadavg()
    q, table, runs = caches()
    lengths = torch.full((B,), SK, dtype=torch.int32)
    hot_table = (torch.arange(B * (SK // BLOCK)) % 16).reshape(B, -1).to(torch.int32)

    def call(run, hot=False):
        k, v, ks, vs = run
        return fastpe.attention_kvcache(
            q,
            k,
            v,
            cache_seqlens=lengths,
            block_table=hot_table if hot else table,
            k_scale=ks,
            v_scale=vs,
            backend="numba",
        )

    copy_src = runs["bf16"][:2]
    copy_dst = tuple(torch.empty_like(x) for x in copy_src)

    def copy(run, hot=False):
        for dst, src in zip(copy_dst, copy_src, strict=True):
            dst.copy_(src)

    cpuinfo = Path("/proc/cpuinfo")
    models = [
        line.split(":", 1)[1].strip()
        for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
        if line.startswith("model name")
    ]
    model = models[0] if models else platform.machine()
    lines = [
        f"$ {' '.join(['python', *sys.argv])}",
        f"{model}, {os.cpu_count()} CPUs, torch {torch.__version__}, numba {numba.__version__}",
        f"paged decode B {B}, Sk {SK}, Hq {HQ} / Hkv {HKV}, D {D}, block {BLOCK}, q bfloat16",
        "load average before: " + " ".join(f"{x:.2f}" for x in load_before),
    ]
    nbytes = {}
    for name, run in runs.items():
        out = call(run)  # compile / warm
        nbytes[name] = sum(x.numel() * x.element_size() for x in run if x is not None)
        error = "" if name == "bf16" else f", max error {max_error(q, table, run, out):.1e}"
        lines.append(f"  {name:5s} cache + scales {nbytes[name] / 2**20:.0f} MiB{error}")
    nbytes["copy"] = nbytes["bf16"]
    timed = {name: (call, run, False) for name, run in runs.items()}
    timed.update({f"{name} hot": (call, run, True) for name, run in runs.items()})
    timed["copy"] = (copy, None, False)
    times = {(t, name): [] for t in args.threads for name in timed}
    for _ in range(args.rounds):
        for threads in args.threads:
            numba.set_num_threads(threads)
            torch.set_num_threads(threads)
            for name, (fn, run, hot) in timed.items():
                fn(run, hot)  # the first call after a thread change starts the pool
                best = []
                for _ in range(3):
                    t = time.perf_counter()
                    fn(run, hot)
                    best.append(time.perf_counter() - t)
                times[threads, name].append(min(best))
    lines.append("load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    for threads in args.threads:
        lines.append(f"{threads} thread{'s' if threads > 1 else ''} (Numba and torch):")
        for name in timed:
            t = times[threads, name]
            rate = ""
            if not name.endswith("hot"):
                rates = [nbytes[name] / x / 1e9 for x in t]
                rate = f"  {statistics.median(rates):5.1f} GB/s read"
                if name != "copy":
                    copy_rates = [nbytes["copy"] / x / 1e9 for x in times[threads, "copy"]]
                    share = [r / c for r, c in zip(rates, copy_rates, strict=True)]
                    rate += f" ({statistics.median(share):.0%} of copy's)"
            label = f"{'copy bf16 k, v' if name == 'copy' else name}, {threads}t"
            lines.append(
                f"  {label:19s} median {statistics.median(t) * 1e3:7.2f} ms "
                f"[{min(t) * 1e3:.2f}, {max(t) * 1e3:.2f}]{rate}"
            )
        for name in ("fp8", "int8"):
            ratios = [
                a / b for a, b in zip(times[threads, "bf16"], times[threads, name], strict=True)
            ]
            lines.append(
                f"  bf16 / {name}: {statistics.median(ratios):.2f}x "
                f"[{min(ratios):.2f}, {max(ratios):.2f}] ({args.rounds} rounds)"
            )
        for name in runs:
            ratios = [
                a / b
                for a, b in zip(times[threads, name], times[threads, f"{name} hot"], strict=True)
            ]
            lines.append(
                f"  {name} cold / hot: {statistics.median(ratios):.2f}x "
                f"[{min(ratios):.2f}, {max(ratios):.2f}]"
            )
    numba.set_num_threads(1)
    costs = decode_cost(runs)
    lines.append(
        "decode loops alone (4 query rows x 16 cache rows, head by head, in L1, 1 thread): "
        + ", ".join(f"{name} {ns:.2f} ns/element" for name, ns in costs.items())
    )
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
