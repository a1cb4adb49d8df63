"""Where a decode step is worth the thread pool: each call serial and parallel, in one process.

    python bench/serial_threshold.py [--calls 100] [--torch]

CPU attention calls of at most ``SERIAL_WORK`` multiply-adds (``B·Hq·Sq·Sk·(D + Dv)``) run on
the calling thread. For decode steps of several sizes around that limit, dense (``attention``)
and paged (``attention_kvcache`` with a block table of 16-row pages), this forces each call
serial and then parallel, alternating, and prints the median times. ``--torch`` imports torch
first and runs a torch matmul before every call, as inside a model (fastpe's kernels then run on
torch's thread pool). Measurements, not assertions: bench/results/ keeps them with the machine
they came from.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

# (B, Hq, Hkv, Sk, D) of one decode step
SHAPES = [(4, 16, 16, 1024, 64), (1, 32, 8, 512, 128), (1, 32, 8, 128, 128), (1, 8, 8, 256, 64)]


def decode_calls(rng, b, hq, hkv, sk, d):
    """{"dense": call, "paged": call} of one decode step of this shape."""
    import fastpe

    q = rng.standard_normal((b, hq, 1, d), dtype=np.float32)
    k = rng.standard_normal((b, hkv, sk, d), dtype=np.float32)
    pages = b * sk // 16
    cache = rng.standard_normal((pages, 16, hkv, d), dtype=np.float32)
    table = rng.permutation(pages).reshape(b, sk // 16).astype(np.int32)
    lengths = np.full(b, sk, np.int32)
    q_bshd = q.transpose(0, 2, 1, 3)
    return {
        "dense": lambda: fastpe.attention(q, k, k),
        "paged": lambda: fastpe.attention_kvcache(
            q_bshd, cache, cache, cache_seqlens=lengths, block_table=table
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100, help="timed calls per mode and case")
    parser.add_argument("--torch", action="store_true", help="a torch matmul before each call")
    args = parser.parse_args()
    between = lambda: None  # noqa: E731
    if args.torch:
        import torch

        weight, x = torch.randn(1024, 1024), torch.randn(64, 1024)
        between = lambda: x @ weight  # noqa: E731
    from fastpe.kernels.numba import attention, attention_paged

    rng = np.random.default_rng(0)
    modes = {"serial": 1 << 62, "parallel": -1}
    for b, hq, hkv, sk, d in SHAPES:
        work = b * hq * sk * 2 * d
        for name, call in decode_calls(rng, b, hq, hkv, sk, d).items():
            times = {mode: [] for mode in modes}
            for i in range(-1, args.calls):  # round -1 compiles, loads and warms up
                for mode in modes if i % 2 else reversed(modes):
                    attention.SERIAL_WORK = attention_paged.SERIAL_WORK = modes[mode]
                    between()
                    start = time.perf_counter()
                    call()
                    if i >= 0:
                        times[mode].append(time.perf_counter() - start)
            med = {mode: statistics.median(t) * 1e6 for mode, t in times.items()}
            print(
                f"{name} B{b} H{hq}/{hkv} Sk{sk} D{d} (2^{np.log2(work):.0f} multiply-adds): "
                f"serial {med['serial']:.0f} us, parallel {med['parallel']:.0f} us, "
                f"serial / parallel {med['serial'] / med['parallel']:.2f}"
            )


if __name__ == "__main__":
    main()
