"""pytest-benchmark suites: fastpe's backends against the baselines, on fastpe.benchmarking's grid.

pytest bench                          # full grid, timed (float32, this machine)
pytest bench --grid quick             # smaller shapes
pytest bench --benchmark-disable      # smoke: tiny grid, every case once, checked vs the oracle
"""

from __future__ import annotations

import pytest

from fastpe import benchmarking as bm

GRIDS = {"smoke": bm.SMOKE_GRID, "quick": bm.QUICK_GRID, "full": bm.FULL_GRID}


def pytest_addoption(parser):
    parser.addoption(
        "--grid",
        choices=sorted(GRIDS),
        default=None,
        help="shape grid (default: full, or smoke with --benchmark-disable)",
    )


def _grid(config):
    name = config.getoption("--grid") or (
        "smoke" if config.getoption("benchmark_disable") else "full"
    )
    return GRIDS[name]


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        op = metafunc.module.OP
        pairs = [
            (case, impl)
            for case in _grid(metafunc.config)
            if case.op == op
            for impl in bm.implementation_names(op)
        ]
        metafunc.parametrize(
            "case,impl", pairs, ids=[f"{impl}-{case.label}" for case, impl in pairs]
        )


@pytest.fixture(scope="session")
def peaks():
    """sgemm GFLOP/s and copy GB/s of this machine, measured once in this run."""
    return bm.measure_peaks()
