"""The cost of reading every attention mask through one kernel argument type.

    python bench/mask_layout.py [--rounds 21] [--reps 200]

The Numba attention kernels take every mask (contiguous, broadcast, or the placeholder of a call
without one) as one non-contiguous array type, so that one compiled kernel serves them all
(``_mask_argument`` in kernels/numba/_attention_common.py); a row of the mask is read through a
run-time contiguity check. This times the mask step alone (``_apply_tile_masks`` on a 128 x 256
score tile, float32 scores) for a contiguous bool and float32 mask passed that way, against the
same mask passed as a contiguous-typed array (what the kernels specialised on before: one
compile per layout), in interleaved rounds of one process. Printed: the median [min, max] of the
per-round ratios and the ratio of the best times (contiguous-typed time / any-layout time; below
1: the any-layout read is slower), and the best time per tile of each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np
from fastpe.kernels.numba import _attention_common as common

from fastpe._options import AttentionOptions


@numba.njit
def _repeat(s, mods, tile, n, reps):
    for _ in range(reps):
        common._apply_tile_masks(s, mods, tile, 0, n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    m, n = 128, 256
    tile = common.RowTile(0, 0, 1, 0, m)
    scores = np.zeros((m, n), np.float32)
    keep = rng.random((1, 1, m, n)) > 0.2
    any_layout = common._mask_argument
    layouts = {
        "contiguous-typed": lambda mask: common._read_only(np.ascontiguousarray(mask)[None]),
        "any-layout": any_layout,
    }
    for name, mask in (("bool", keep), ("float32", np.where(keep, 0, -1e4).astype(np.float32))):
        mods = {}
        for label, argument in layouts.items():
            common._mask_argument = argument
            mods[label] = common.score_mods(
                np.dtype(np.float32),
                1.0,
                AttentionOptions(scale=1.0),
                key_len=np.array([n]),
                q_len=m,
                unbounded=m + n + 1,
                mask=mask,
            )
            _repeat(scores, mods[label], tile, n, 1)  # compile
        common._mask_argument = any_layout
        ratios, best = [], dict.fromkeys(layouts, float("inf"))
        for r in range(args.rounds):
            times = {}
            for label in list(layouts)[:: 1 if r % 2 == 0 else -1]:
                t0 = time.perf_counter()
                _repeat(scores, mods[label], tile, n, args.reps)
                times[label] = (time.perf_counter() - t0) / args.reps
                best[label] = min(best[label], times[label])
            ratios.append(times["contiguous-typed"] / times["any-layout"])
        print(
            f"{name:8s} mask, contiguous: contiguous-typed / any-layout time "
            f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}], "
            f"best {best['contiguous-typed'] / best['any-layout']:.2f}; best per tile "
            f"{best['contiguous-typed'] * 1e6:.1f} us / {best['any-layout'] * 1e6:.1f} us"
        )


if __name__ == "__main__":
    main()
