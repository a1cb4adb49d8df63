"""The Numba paged-attention kernel of another revision vs this one, on a contiguous paged
decode, interleaved in one process (a kernel change must not slow the contiguous path).

    git show REV:kernels/numba/attention_paged.py > /tmp/old_attention_paged.py
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/paged_kernel_ab.py \
        /tmp/old_attention_paged.py [--rounds 11]

Both launchers get the same float32 NumPy inputs (B 8, Sk 4096, H 32/8, D 128, block 16,
random block table); each round times each once (best of 3 calls); the ratio this / other is
per round, reported as median [min, max]. Nothing is written. The other file imports this
tree's shared helpers (``_attention_common``, ``_attention_tiles``), so only its own kernels
differ; its launcher takes the options record as ``options=``, as this one does.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from fastpe.kernels.numba import attention_paged as this

from fastpe._options import AttentionOptions


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("other", help="path of the other revision's attention_paged.py")
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    # imported by name from its folder: Numba's on-disk cache of the other kernel pickles
    # references to its module, which must be importable again on the next run
    path = Path(args.other).resolve()
    sys.path.insert(0, str(path.parent))
    other = importlib.import_module(path.stem)

    rng = np.random.default_rng(0)
    b, sk, hq, hkv, d, block = 8, 4096, 32, 8, 128, 16
    pages = sk // block
    q = rng.standard_normal((b, hq, d), dtype=np.float32)
    k = rng.standard_normal((b * pages * block, hkv, d), dtype=np.float32)
    v = rng.standard_normal((b * pages * block, hkv, d), dtype=np.float32)
    table = rng.permutation(b * pages).reshape(b, pages).astype(np.int64)
    kw = dict(
        q_start=np.arange(b),
        q_len=np.ones(b, np.int64),
        k_len=np.full(b, sk, np.int64),
        page_start=table * block,
        page_size=block,
        options=AttentionOptions(scale=d**-0.5, causal=True),
    )
    fns = {
        "other": lambda: other.attention_paged_numba(q, k, v, **kw),
        "this": lambda: this.attention_paged_numba(q, k, v, **kw),
    }
    outs = {name: fn()[0] for name, fn in fns.items()}  # compile / warm
    print(f"max |this - other| {np.abs(outs['this'] - outs['other']).max():.1e}")
    times = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            best = []
            for _ in range(3):
                t = time.perf_counter()
                fn()
                best.append(time.perf_counter() - t)
            times[name].append(min(best))
    for name, t in times.items():
        print(
            f"  {name:6s} median {statistics.median(t) * 1e3:.2f} ms "
            f"[{min(t) * 1e3:.2f}, {max(t) * 1e3:.2f}]"
        )
    ratios = [a / o for a, o in zip(times["this"], times["other"], strict=True)]
    print(
        f"  this / other: {statistics.median(ratios):.3f}x [{min(ratios):.3f}, {max(ratios):.3f}]"
    )


if __name__ == "__main__":
    main()
