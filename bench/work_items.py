"""The dense CPU attention kernel's two work-item layouts, against each other in one process.

    python bench/work_items.py [--calls 40]

``_attention_numba`` takes one work item per (sequence, kv head) — each packs its own head's K
and V, then computes every query block of the head — when the heads share evenly among the
threads (``items_per_head``), else one per (sequence, kv head, query block) after the calling
thread has packed every head. This forces each layout in turn, alternating call by call (each
call right after a torch matmul, as a model calls attention), and prints per case the median
time of each and of SDPA, and the ratios. Measurements, not assertions: bench/results/ keeps
them with the machine they came from.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from fastpe.kernels.numba import attention as kernel

import fastpe

CASES = {  # name: (Hq = Hkv, S, D, causal), B = 1
    "non-causal 1024² D64": (16, 1024, 64, False),
    "causal 1024 D64": (16, 1024, 64, True),
    "causal 4096 D128": (8, 4096, 128, True),
}


LAYOUTS = {"per head": True, "per query block": False}


def timed_call(key, q, k, v, causal):
    """SDPA, or fastpe's attention with the items of layout ``key``."""
    if key == "sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    per_head = LAYOUTS[key]
    kernel.items_per_head = lambda heads, threads, n_splits: per_head and n_splits == 1
    return lambda: fastpe.attention(q, k, v, causal=causal, backend="numba")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40, help="timed calls per layout and case")
    calls = parser.parse_args().calls
    chosen = kernel.items_per_head
    torch.manual_seed(0)
    weight, x = torch.randn(1024, 1024), torch.randn(64, 1024)
    for name, (h, s, d, causal) in CASES.items():
        q, k, v = (torch.randn(1, h, s, d) for _ in range(3))
        times = {**{key: [] for key in LAYOUTS}, "sdpa": []}
        for key in times:  # compile, load, warm up
            timed_call(key, q, k, v, causal)()
        n = calls if s < 4096 else max(calls // 4, 3)
        for i in range(n):
            order = list(times) if i % 2 else list(reversed(times))
            for key in order:
                call = timed_call(key, q, k, v, causal)
                x @ weight
                start = time.perf_counter()
                call()
                times[key].append(time.perf_counter() - start)
        kernel.items_per_head = chosen
        med = {key: statistics.median(t) * 1e3 for key, t in times.items()}
        print(
            f"{name}: per head {med['per head']:.2f} ms, per query block "
            f"{med['per query block']:.2f} ms, sdpa {med['sdpa']:.2f} ms; per-block time / "
            f"per-head time {med['per query block'] / med['per head']:.3f}, sdpa / per head "
            f"{med['sdpa'] / med['per head']:.2f}, sdpa / per block "
            f"{med['sdpa'] / med['per query block']:.2f}"
        )


if __name__ == "__main__":
    main()
