"""The body of every benchmark test (imported by bench_*.py; conftest.py holds hooks/fixtures)."""

from __future__ import annotations

import pytest

from fastpe import benchmarking as bm


def run_case(benchmark, case, impl, peaks):
    """Time one implementation of one case; record throughput; check fastpe against the oracle."""
    inputs = bm.make_inputs(case)
    impls = bm.implementations(case, inputs)
    if impl not in impls:
        pytest.skip(f"{impl} is not available here")
    fn = impls[impl]
    result = fn()  # warm-up outside the timing (compilation, caches)
    benchmark.group = case.name
    benchmark(fn)
    amount, unit = bm.work(case)
    peak = peaks["copy_gbps"] if unit == "GB/s" else peaks["sgemm_gflops"]
    if benchmark.stats is not None:  # None under --benchmark-disable
        rate = amount / benchmark.stats.stats.median / 1e9
        benchmark.extra_info.update(
            {"throughput": rate, "unit": unit, "fraction_of_peak": rate / peak, **peaks}
        )
    error = bm.max_error(case, result, bm.reference(case, inputs))
    benchmark.extra_info["max_abs_error"] = error
    if impl.startswith("fastpe"):
        tolerance = 1e-5 * bm.error_scale(case)
        assert error <= tolerance, f"{impl} differs from the oracle by {error} > {tolerance:.1e}"
