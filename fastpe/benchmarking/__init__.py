"""The benchmark shared by the pytest-benchmark suites in ``bench/`` and by ``fastpe bench``, so
both time the same cases against the same baselines.

``cases``: the grids and, per op, inputs, work and the oracle's answer; ``baselines``: what fastpe
is compared with; ``runner``: which implementations run here, timing, peaks, the results
document; ``report``: tables and the plot of a results document.
"""

from .baselines import BASELINES, TARGET_BASELINE, Baseline, install_hint, target_baseline
from .cases import (
    FULL_GRID,
    MODES,
    OPS,
    QUICK_GRID,
    SMOKE_GRID,
    Case,
    OpSpec,
    error_scale,
    in_modes,
    make_inputs,
    max_error,
    reference,
    with_mode,
    work,
)
from .report import caveats, format_summary, format_table, load_results, plot, speedup_over_target
from .runner import (
    Timing,
    baselines_for,
    fastpe_backends,
    implementation_names,
    implementations,
    measure_peaks,
    missing_baselines,
    resolve_device,
    run_benchmarks,
    time_callable,
)

__all__ = [
    "BASELINES",
    "FULL_GRID",
    "MODES",
    "OPS",
    "QUICK_GRID",
    "SMOKE_GRID",
    "TARGET_BASELINE",
    "Baseline",
    "Case",
    "OpSpec",
    "Timing",
    "baselines_for",
    "caveats",
    "error_scale",
    "fastpe_backends",
    "format_summary",
    "format_table",
    "implementation_names",
    "implementations",
    "in_modes",
    "install_hint",
    "load_results",
    "make_inputs",
    "max_error",
    "measure_peaks",
    "missing_baselines",
    "plot",
    "reference",
    "resolve_device",
    "run_benchmarks",
    "speedup_over_target",
    "target_baseline",
    "time_callable",
    "with_mode",
    "work",
]
