"""``fastpe`` command line: ``fastpe info`` and ``fastpe demo`` (also ``python -m fastpe ...``)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from importlib import metadata

import numpy as np

import fastpe


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def info() -> str:
    """Versions, backends (and why each is or isn't available), threads."""
    lines = [
        f"fastpe {fastpe.__version__} on Python {platform.python_version()} ({platform.machine()}, "
        f"{os.cpu_count()} CPUs)"
    ]
    for dist in ("numpy", "numba", "torch", "triton", "transformers"):
        lines.append(f"  {dist:13s} {_version(dist)}")
    lines.append("backends:")
    for name, status in fastpe.backends().items():
        lines.append(f"  {name:7s} {status}")
    lines.append("threads and devices:")
    try:
        import numba

        lines.append(
            f"  numba threads {numba.get_num_threads()} (numba.set_num_threads / NUMBA_NUM_THREADS)"
        )
    except ImportError:
        pass
    try:
        import torch

        lines.append(f"  torch threads {torch.get_num_threads()}")
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        lines.append(f"  CUDA devices  {', '.join(gpus) if gpus else 'none'}")
    except ImportError:
        lines.append("  torch         not installed (no tensor support, no CUDA)")
    return "\n".join(lines)


def _demo_cases(rng):
    """One small call per op: (label, op name, args, kwargs)."""
    f32 = np.float32
    q = rng.standard_normal((2, 8, 128, 64)).astype(f32)
    k = rng.standard_normal((2, 2, 160, 64)).astype(f32)
    v = rng.standard_normal((2, 2, 160, 64)).astype(f32)
    cos, sin = fastpe.rope_table(4096, 64)
    weight = rng.standard_normal((1000, 256)).astype(f32)
    ids = rng.integers(0, 1000, size=(4, 128))
    out_a, lse_a = fastpe.attention(q, k[:, :, :80], v[:, :, :80], return_lse=True, backend="numpy")
    out_b, lse_b = fastpe.attention(q, k[:, :, 80:], v[:, :, 80:], return_lse=True, backend="numpy")
    return [
        ("sinusoidal_table 1M..1M+512 x 512", "sinusoidal_table", (512, 512), {"offset": 2**20}),
        ("rope_table 4096 x 128, llama3 scaling", "rope_table", (4096, 128),
         {"scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}}),
        ("apply_rope [2,8,128,64] offset 1000", "apply_rope", (q, cos, sin), {"positions": 1000}),
        ("embed [4,128] vocab 1000 d 256 + sinusoidal", "embed", (ids, weight), {"scale": 16.0}),
        ("attention GQA 8/2 heads, causal, ALiBi", "attention", (q, k, v),
         {"causal": True, "alibi_slopes": 2.0 ** -np.arange(1, 9)}),
        ("attention + fused RoPE + key_lengths", "attention", (q, k, v),
         {"rope": {"cos": cos, "sin": sin}, "key_lengths": np.array([160, 97])}),
        ("merge_attention of two key halves", "merge_attention", (out_a, lse_a, out_b, lse_b), {}),
    ]  # fmt: skip


def _max_error(result, reference) -> float:
    pairs = (
        zip(result, reference, strict=True) if isinstance(result, tuple) else [(result, reference)]
    )
    worst = 0.0
    for got, want in pairs:
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        finite = np.isfinite(want)
        worst = max(worst, float(np.max(np.abs(got[finite] - want[finite]), initial=0.0)))
    return worst


def demo() -> str:
    """Run every op once on the automatic backend; report time and max error vs the oracle."""
    rng = np.random.default_rng(0)
    rows = [f"{'op':45s} {'backend':8s} {'time':>10s} {'max |err| vs float64 oracle':>30s}"]
    for label, op, args, kwargs in _demo_cases(rng):
        fn = getattr(fastpe, op)
        chosen = fastpe.explain(op, *args, **kwargs).chosen
        fn(*args, **kwargs)  # warm-up (compilation, caches)
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        elapsed = time.perf_counter() - start
        # tables are compared with the float64 truth, not with its float32 rounding
        exact = {"dtype": "float64"} if op in ("sinusoidal_table", "rope_table") else {}
        reference = fn(*args, backend="numpy", **kwargs, **exact)
        rows.append(
            f"{label:45s} {chosen:8s} {elapsed * 1e3:8.2f}ms {_max_error(result, reference):30.3g}"
        )
    return "\n".join(rows)


def _environment(device: str, peaks: dict) -> dict:
    import numba

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
            d: _version(d) for d in ("fastpe", "numpy", "numba", "torch", "triton", "transformers")
        },
        "numba_threads": numba.get_num_threads(),
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


def run_benchmarks(grid, device: str = "cpu", dtype: str = "float32", progress=print) -> dict:
    """Time every implementation of every case; returns the JSON-able results document."""
    from fastpe import benchmarking as bm

    peaks = bm.measure_peaks()
    rows = []
    for n, case in enumerate(grid, 1):
        inputs = bm.make_inputs(case, device, dtype)
        expected = bm.reference(case, inputs)
        amount, unit = bm.work(
            case, itemsize=np.dtype("float32" if dtype != "float64" else "float64").itemsize
        )
        impls = bm.implementations(case, inputs, device)
        for name, fn in impls.items():
            progress(f"[{n}/{len(grid)}] {case.name}: {name} ...")
            seconds = bm.time_callable(fn, device)
            rate = amount / seconds / 1e9
            peak = peaks["copy_gbps"] if unit == "GB/s" else peaks["sgemm_gflops"]
            rows.append({
                "op": case.op, "case": case.label, "seq": case.seq, "series": case.series, "impl": name,
                "median_s": seconds, "throughput": rate, "unit": unit,
                "fraction_of_peak": rate / peak if device == "cpu" else None,
                "max_abs_error": bm.max_error(case, fn(), expected),
            })  # fmt: skip
        baselines = [
            r
            for r in rows
            if r["case"] == case.label and r["op"] == case.op and not r["impl"].startswith("fastpe")
        ]
        best = min((r["median_s"] for r in baselines), default=None)
        for r in rows:
            if r["case"] == case.label and r["op"] == case.op:
                r["speedup_vs_best_baseline"] = None if best is None else best / r["median_s"]
    return {"environment": _environment(device, peaks), "dtype": dtype, "results": rows}


def format_table(doc: dict, markdown: bool = False) -> str:
    head = [
        "op",
        "case",
        "implementation",
        "median",
        "throughput",
        "% peak",
        "vs best baseline",
        "max |err|",
    ]
    lines = []
    for r in doc["results"]:
        frac = "" if r["fraction_of_peak"] is None else f"{100 * r['fraction_of_peak']:.0f}%"
        speed = (
            "" if r["speedup_vs_best_baseline"] is None else f"{r['speedup_vs_best_baseline']:.2f}x"
        )
        lines.append([r["op"], r["case"], r["impl"], f"{r['median_s'] * 1e3:.2f} ms",
                      f"{r['throughput']:.1f} {r['unit']}", frac, speed, f"{r['max_abs_error']:.1e}"])  # fmt: skip
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(out + ["| " + " | ".join(row) + " |" for row in lines])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
    fmt = "  ".join(f"{{:{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*row) for row in lines])


# The baseline each op's speed target is stated against (what users run today).
TARGET_BASELINE = {
    "sinusoidal_table": "torch eager",
    "rope_table": "torch eager",
    "apply_rope": "transformers",
    "embed": "torch eager",
    "attention": "torch SDPA",
}


def format_summary(doc: dict) -> str:
    """Markdown: per case, fastpe's throughput and its speedup over the target baseline."""
    out = [
        "| op | case | fastpe | throughput | % of peak | baseline | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = doc["results"]
    for r in rows:
        if not r["impl"].startswith("fastpe"):
            continue
        name = TARGET_BASELINE.get(r["op"])
        base = next(
            (b for b in rows if (b["op"], b["case"], b["impl"]) == (r["op"], r["case"], name)), None
        )
        speed = "" if base is None else f"{base['median_s'] / r['median_s']:.2f}x"
        frac = "" if r["fraction_of_peak"] is None else f"{100 * r['fraction_of_peak']:.0f}%"
        out.append(
            f"| {r['op']} | {r['case']} | {r['impl']} | {r['throughput']:.1f} {r['unit']} | {frac} | {name} | {speed} |"
        )
    return "\n".join(out)


def plot(doc: dict, path: str) -> None:
    """Throughput against sequence length, one panel per op, one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r["op"] for r in doc["results"]})
    cols = min(3, len(ops))
    nrows = -(-len(ops) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.8 * nrows), squeeze=False)
    for ax in axes.flat[len(ops) :]:
        ax.set_visible(False)
    for ax, op in zip(axes.flat, ops, strict=False):
        rows = [r for r in doc["results"] if r["op"] == op]
        for impl, series in sorted({(r["impl"], r.get("series", "")) for r in rows}):
            pts = sorted(
                (r["seq"], r["throughput"])
                for r in rows
                if (r["impl"], r.get("series", "")) == (impl, series)
            )
            style = "-" if impl.startswith("fastpe") else "--"
            label = f"{impl} {series}".strip()
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(rows[0]["unit"])
        ax.legend(fontsize=7)
    env = doc["environment"]
    fig.suptitle(f"fastpe on {env.get('gpu', env['machine'])}, {doc['dtype']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def bench(args) -> int:
    import json

    from fastpe import benchmarking as bm

    grid = bm.QUICK_GRID if args.quick else bm.FULL_GRID
    if args.ops:
        grid = [c for c in grid if c.op in args.ops]
    device = args.device
    if device is None:
        try:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            device = "cpu"
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    print(info(), end="\n\n")
    doc = run_benchmarks(
        grid, device, dtype, progress=lambda m: print(m, file=sys.stderr, flush=True)
    )
    print(format_table(doc))
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\nresults: {args.json}")
    if args.plot:
        plot(doc, args.plot)
        print(f"plot:    {args.plot}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fastpe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, backends and why each is or isn't available")
    sub.add_parser("demo", help="run every op once and print its error against the float64 oracle")
    b = sub.add_parser("bench", help="time fastpe against the baselines on this machine")
    b.add_argument("--quick", action="store_true", help="small grid, about a minute")
    b.add_argument(
        "--ops",
        nargs="+",
        choices=["sinusoidal_table", "rope_table", "apply_rope", "embed", "attention"],
    )
    b.add_argument("--json", default="fastpe-bench.json", help="where to write the results")
    b.add_argument(
        "--plot",
        default="fastpe-bench.png",
        help="PNG of throughput vs sequence length ('' for none)",
    )
    b.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    b.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    r = sub.add_parser("report", help="print a results JSON as a markdown table (the README's)")
    r.add_argument("json")
    r.add_argument(
        "--summary", action="store_true", help="fastpe vs each op's target baseline only"
    )
    args = parser.parse_args(argv)
    if args.command == "info":
        print(info())
    elif args.command == "demo":
        print(info(), end="\n\n")
        print(demo())
    elif args.command == "bench":
        return bench(args)
    else:
        import json

        with open(args.json) as f:
            doc = json.load(f)
        print(format_summary(doc) if args.summary else format_table(doc, markdown=True))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
