"""Benchmark: sinusoidal_table (see bench/conftest.py for the grid and options)."""

from _benchkit import run_case

OP = "sinusoidal_table"


def test_sinusoidal_table(benchmark, case, impl, peaks):
    run_case(benchmark, case, impl, peaks)
