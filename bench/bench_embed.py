"""Benchmark: embed (see bench/conftest.py for the grid and options)."""

from _benchkit import run_case

OP = "embed"


def test_embed(benchmark, case, impl, peaks):
    run_case(benchmark, case, impl, peaks)
