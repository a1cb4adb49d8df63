"""Interleaved timing rounds for the standalone bench scripts (run as ``python bench/NAME.py``,
which puts this folder on the import path): each round times every function once, in turn, so
a change in the machine's load falls on all of them alike."""

from __future__ import annotations

import time


def best_of(fn, calls):
    """The fastest of ``calls`` calls of ``fn``, in seconds."""
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def rounds(named, n_rounds, calls):
    """{name: [best time of each round]} for ``named`` {name: function}, after one untimed call
    of each (compile, warm caches)."""
    for fn in named.values():
        fn()
    table = {name: [] for name in named}
    for _ in range(n_rounds):
        for name, fn in named.items():
            table[name].append(best_of(fn, calls))
    return table
