"""Running the benchmark: which implementations time a case, timing, machine peaks, the results."""

from __future__ import annotations

import importlib.util
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

import numpy as np

import fastpe
from fastpe.backends import kernel_backends, unavailable_reason

from .baselines import BASELINES, Baseline, install_hint
from .cases import OPS, Case, autograd_call, make_inputs, max_error, reference, with_grad, work


def fastpe_backends(device_type: str | None = None) -> dict[str, str | None]:
    """fastpe's kernel backends that serve ``device_type`` (all of them when None), each with the
    reason it cannot run here, or None when it can."""
    return {name: unavailable_reason(name) for name in kernel_backends(device_type)}


def implementation_names(op: str) -> list[str]:
    """Every implementation that could time ``op`` (whether it runs here is decided later)."""
    return [f"fastpe[{n}]" for n in fastpe_backends()] + [b.name for b in BASELINES[op]]


def missing_module(baseline: Baseline) -> str | None:
    """The first module ``baseline`` needs that is not installed here, or None."""
    return next((m for m in baseline.modules if importlib.util.find_spec(m) is None), None)


def missing_baselines(ops, device: str) -> dict[str, list[str]]:
    """Per module that is not installed here, the baselines of ``ops`` on ``device`` that need it
    (names in table order, each once)."""
    device_type = device.split(":")[0]
    missing: dict[str, list[str]] = {}
    for op in ops:
        for baseline in BASELINES.get(op, ()):
            if baseline.devices is not None and device_type not in baseline.devices:
                continue
            module = missing_module(baseline)
            if module is not None and baseline.name not in missing.setdefault(module, []):
                missing[module].append(baseline.name)
    return missing


def baselines_for(op: str, device: str, dtype: str) -> tuple[list[Baseline], dict[str, str]]:
    """The baselines of ``op`` that run on ``device`` here, split into those that take ``dtype``
    and, by name, why the others cannot (a module that is not installed, or the dtype)."""
    device_type = device.split(":")[0]
    runnable, refused = [], {}
    for baseline in BASELINES[op]:
        if baseline.devices is not None and device_type not in baseline.devices:
            continue
        if (module := missing_module(baseline)) is not None:
            refused[baseline.name] = (
                f"needs {module}, which is not installed ({install_hint(module)})"
            )
            continue
        reason = baseline.cannot_take(dtype)
        if reason is None:
            runnable.append(baseline)
        else:
            refused[baseline.name] = reason
    return runnable, refused


def implementations(
    case: Case, inputs: dict, device: str = "cpu", dtype: str = "float32"
) -> dict[str, Callable]:
    """Every runnable implementation of ``case``: fastpe's kernel backends and the baselines that
    run on ``device`` and take ``dtype`` (the dtype ``inputs`` were made in). In the backward
    and full modes each callable returns the gradients (``cases.autograd_call``)."""
    builders: dict[str, Callable] = {}
    for backend, reason in fastpe_backends(device.split(":")[0]).items():
        if reason is None:
            builders[f"fastpe[{backend}]"] = lambda x, backend=backend: OPS[case.op].fastpe(
                case.params, x, backend, device
            )
    for baseline in baselines_for(case.op, device, dtype)[0]:
        if baseline.cannot_run(case) is None:
            builders[baseline.name] = lambda x, baseline=baseline: baseline.build(case, x)
    if case.mode == "forward":
        return {name: build(inputs) for name, build in builders.items()}
    found = {}
    for name, build in builders.items():
        graded, leaves = with_grad(case, inputs)  # its own leaves: no shared graph
        found[name] = autograd_call(build(graded), leaves, case.mode)
    return found


def resolve_device(device: str | None, argument: str = "device") -> str:
    """``device``, or cuda when torch sees a GPU and cpu otherwise; ValueError when no fastpe
    backend can run on it here (the message names ``argument``)."""
    if device is None:
        try:
            import torch
        except ImportError:
            return "cpu"
        return "cuda" if torch.cuda.is_available() else "cpu"
    device_type, _, index = device.partition(":")
    expected = "expected cpu or cuda[:N]"
    backends = fastpe_backends(device_type)
    if not backends:
        raise ValueError(f"{argument} {device!r}: no fastpe backend serves it; {expected}")
    if index and not (device_type == "cuda" and index.isdigit()):
        raise ValueError(f"{argument} {device!r} is malformed; {expected}")
    if device_type == "cuda":
        try:
            import torch
        except ImportError:
            raise ValueError(f"{argument} {device!r} needs torch, which is not installed") from None
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{argument} {device!r}: torch sees no CUDA GPU here")
        if index and int(index) >= count:
            raise ValueError(
                f"{argument} {device!r}: torch sees {count} CUDA GPU(s), 0..{count - 1}"
            )
    if all(reason is not None for reason in backends.values()):
        reasons = "; ".join(f"{name}: {reason}" for name, reason in backends.items())
        raise ValueError(f"{argument} {device!r}: no fastpe backend can run on it here ({reasons})")
    return device


# ---------------------------------------------------------------------------------------------
# Timing and machine peaks


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


@dataclass(frozen=True)
class Timing:
    """Seconds per call over the timed runs."""

    median: float
    iqr: float  # interquartile range: a busy or throttled machine widens it
    min: float
    runs: int

    @classmethod
    def of(cls, times: list[float]) -> Timing:
        q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
        return cls(statistics.median(times), q3 - q1, min(times), len(times))


def time_callable(
    fn: Callable, device: str = "cpu", *, min_time: float = 0.3, max_runs: int = 50
) -> Timing:
    """Seconds per call after a warm-up call (compilation, autotuning, caches), at least 3 runs."""
    fn()
    synchronize(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < max_runs):
        t = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t)
    return Timing.of(times)


def measure_peaks() -> dict[str, float]:
    """This machine's float32 matmul GFLOP/s (NumPy's BLAS) and copy bandwidth GB/s, measured now."""
    a = np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32)
    gemm = time_callable(lambda: a @ a, min_time=0.5).median
    src = np.ones(32 * 2**20, np.float32)  # 128 MiB, well past the caches
    dst = np.empty_like(src)
    copy = time_callable(lambda: np.copyto(dst, src), min_time=0.5).median
    return {"sgemm_gflops": 2 * 2048**3 / gemm / 1e9, "copy_gbps": 2 * src.nbytes / copy / 1e9}


# ---------------------------------------------------------------------------------------------
# The results document


def package_version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment(device: str, peaks: dict) -> dict:
    """The machine, versions, thread counts and peaks a results document was measured with."""
    import numba

    from fastpe.kernels.numba._runtime import threading_layer  # before Numba starts its threads

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu
            )
    except OSError:
        pass
    env = {
        "machine": f"{cpu} ({os.cpu_count()} CPUs)",
        "python": platform.python_version(),
        "versions": {
            d: package_version(d)
            for d in ("fastpe", "numpy", "numba", "torch", "triton", "transformers")
        },
        "numba_threads": numba.get_num_threads(),
        "numba_threading_layer": threading_layer(),
        "device": device,
        "peaks": peaks,
    }
    try:
        import torch

        env["torch_threads"] = torch.get_num_threads()
        if device.startswith("cuda"):
            env["gpu"] = torch.cuda.get_device_name(device)
    except ImportError:
        pass
    return env


def duration(seconds: float) -> str:
    """``seconds`` as a person reads a wait: "35 s", "4 min", "1 h 05 min"."""
    if seconds < 59.5:
        return f"{seconds:.0f} s"
    minutes = int(seconds / 60 + 0.5)  # half up: round() would give 2.5 min as "2 min"
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def time_left(grid, done: dict[str, list[float]], n: int) -> tuple[float, float] | None:
    """Seconds that case ``n`` (1-based) of ``grid`` and the cases after it should take, from the
    seconds ``done`` took per op: each case counts its op's mean so far (an attention case takes
    far longer than a table's), or the mean of every case so far when none of its op has
    finished; None before any has."""
    every = [t for times in done.values() for t in times]
    if not every:
        return None
    overall = sum(every) / len(every)
    guess = [sum(done[c.op]) / len(done[c.op]) if done.get(c.op) else overall for c in grid]
    return guess[n - 1], sum(guess[n:])


def _elapsed(clock, start: float, case_start: float, left: tuple[float, float] | None) -> str:
    """The progress suffix, e.g. "35 s elapsed, ~1 min left": the current case's estimate less
    the time it has taken so far (no less than nothing), plus the later cases' estimates."""
    now = clock()
    text = f"{duration(now - start)} elapsed"
    if left is None:
        return text
    current, later = left
    return f"{text}, ~{duration(max(current - (now - case_start), 0) + later)} left"


def run_benchmarks(
    grid,
    device: str = "cpu",
    dtype: str = "float32",
    progress=print,
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """Time every implementation of every case; returns the JSON-able results document.

    Implementations that cannot take ``dtype`` (a baseline's dtype table, or a fastpe backend's
    capability table) are listed under "skipped" with the reason instead of being timed.
    ``progress`` gets one line per implementation timed, with the time elapsed and an estimate of
    the time left (``clock``: seconds, a parameter for tests)."""
    start = clock()
    peaks = measure_peaks()
    # bytes per element of the timed inputs (NumPy has no bfloat16 to ask)
    itemsize = 2 if dtype in ("float16", "bfloat16") else np.dtype(dtype).itemsize
    rows, skipped = [], []
    done: dict[str, list[float]] = {}  # seconds each finished case took, per op
    for n, case in enumerate(grid, 1):
        case_start, left = clock(), time_left(grid, done, n)
        inputs = make_inputs(case, device, dtype)
        expected = reference(case, inputs)
        amount, unit = work(case, itemsize=itemsize)
        runnable, refused = baselines_for(case.op, device, dtype)
        for baseline in runnable:
            if (reason := baseline.cannot_run(case)) is not None:
                refused[baseline.name] = reason
        for name, reason in refused.items():
            skipped.append({"op": case.op, "case": case.label, "impl": name, "reason": reason})
        case_rows = []
        for name, fn in implementations(case, inputs, device, dtype).items():
            when = _elapsed(clock, start, case_start, left)
            progress(f"[{n}/{len(grid)}] {case.name}: {name} ... {when}")
            try:
                timing = time_callable(fn, device)
            except fastpe.BackendNotSupportedError as exc:  # refused before any kernel ran
                reason = str(exc).replace("\n", " ")
                skipped.append({"op": case.op, "case": case.label, "impl": name, "reason": reason})
                continue
            rate = amount / timing.median / 1e9
            peak = peaks["copy_gbps"] if unit == "GB/s" else peaks["sgemm_gflops"]
            case_rows.append(
                {
                    "op": case.op,
                    "case": case.label,
                    "seq": case.seq,
                    "series": case.series,
                    "mode": case.mode,
                    "impl": name,
                    "median_s": timing.median,
                    "iqr_s": timing.iqr,
                    "min_s": timing.min,
                    "runs": timing.runs,
                    "throughput": rate,
                    "unit": unit,
                    "fraction_of_peak": rate / peak if device == "cpu" else None,
                    "max_abs_error": max_error(case, fn(), expected),
                }
            )
        best = min(
            (r["median_s"] for r in case_rows if not r["impl"].startswith("fastpe")), default=None
        )
        for r in case_rows:
            r["speedup_vs_best_baseline"] = None if best is None else best / r["median_s"]
        rows += case_rows
        done.setdefault(case.op, []).append(clock() - case_start)
    doc = {"environment": environment(device, peaks), "dtype": dtype, "results": rows}
    if skipped:
        doc["skipped"] = skipped
    return doc
