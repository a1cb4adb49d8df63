"""Benchmark: attention (see bench/conftest.py for the grid and options)."""

from _benchkit import run_case

OP = "attention"


def test_attention(benchmark, case, impl, peaks):
    run_case(benchmark, case, impl, peaks)
