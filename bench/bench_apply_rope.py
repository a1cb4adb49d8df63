"""Benchmark: apply_rope (see bench/conftest.py for the grid and options)."""

from _benchkit import run_case

OP = "apply_rope"


def test_apply_rope(benchmark, case, impl, peaks):
    run_case(benchmark, case, impl, peaks)
