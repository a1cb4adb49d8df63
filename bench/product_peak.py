"""How close dense float32 attention runs to the speed of its own tile products on this CPU.

    python bench/product_peak.py [--rounds 5]

Each round times, on one thread, the panel product (``kernels/numba/_panels.py``) on operands
that stay in the L1/L2 caches: the multiply-add rate the attention kernels' products cannot
exceed here. Then it times ``fastpe.attention`` (B1 H16 1024² D64, non-causal: only products,
softmax and packing, no masks) on all of Numba's threads and converts it to the same unit,
multiply-adds per second per thread (4·Sq·Sk·D per head). The ratio is the attention's share
of that ceiling: what is left for any change to the kernel (softmax, packing, the row blocks
that do not fill the registers) and what bounds fastpe against an SDPA whose products run at
the same peak. Median [min, max] over the rounds; nothing is written.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np
from fastpe.kernels.numba._panels import panel_columns, panel_product
from numba import njit

import fastpe


@njit(cache=True)
def _repeat_product(c, a, panels, repeats):
    for _ in range(repeats):
        panel_product(c, a, panels, True, a.shape[1])


def product_rate(repeats: int = 2000) -> float:
    """GFLOP/s of one thread's panel products on cache-resident operands."""
    rows, terms, columns = 96, 256, 64  # 16 blocks of 6 rows; 4 panels; 160 KB in all
    width = panel_columns(np.float32)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((rows, terms), dtype=np.float32)
    panels = rng.standard_normal((columns // width, terms, width), dtype=np.float32)
    c = np.zeros((rows, columns), np.float32)
    _repeat_product(c, a, panels, 1)
    start = time.perf_counter()
    _repeat_product(c, a, panels, repeats)
    return 2 * rows * terms * columns * repeats / (time.perf_counter() - start) / 1e9


def attention_rate(calls: int = 10) -> float:
    """GFLOP/s per thread of non-causal float32 attention, B1 H16 1024² D64."""
    heads, seq, dim = 16, 1024, 64
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, heads, seq, dim), dtype=np.float32) for _ in range(3))
    fastpe.attention(q, k, v)
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fastpe.attention(q, k, v)
        best = min(best, time.perf_counter() - start)
    return 4 * heads * seq * seq * dim / best / 1e9 / numba.get_num_threads()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    products, attentions = [], []
    for _ in range(rounds):
        products.append(product_rate())
        attentions.append(attention_rate())
    ratios = [a / p for a, p in zip(attentions, products, strict=True)]

    def show(values, unit):
        return f"{statistics.median(values):.1f}{unit} [{min(values):.1f}, {max(values):.1f}]"

    print(f"threads: {numba.get_num_threads()}")
    print(f"panel product, one thread, cache-resident:  {show(products, ' GFLOP/s')}")
    print(f"attention non-causal 1024² D64, per thread: {show(attentions, ' GFLOP/s')}")
    print(
        f"attention / product peak: {statistics.median(ratios):.2f} "
        f"[{min(ratios):.2f}, {max(ratios):.2f}]"
    )


if __name__ == "__main__":
    main()
