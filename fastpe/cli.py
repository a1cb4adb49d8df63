"""fastpe's command line: ``fastpe info|demo|warmup|cache|bench|report|triton-report`` (also
``python -m fastpe``)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time

import numpy as np

import fastpe
from fastpe import benchmarking as bm
from fastpe.benchmarking.runner import package_version

DTYPES = ("float32", "float64", "float16", "bfloat16")
# the short names people type (and Triton, flash-attn and fastpe's own docs write)
DTYPE_ALIASES = {"fp32": "float32", "fp64": "float64", "fp16": "float16", "bf16": "bfloat16"}


def _dtype(text: str) -> str:
    """A dtype option's value: one of DTYPES, or its short name in DTYPE_ALIASES."""
    if text in DTYPES:
        return text
    if text in DTYPE_ALIASES:
        return DTYPE_ALIASES[text]
    accepted = ", ".join(f"{name} ({short})" for short, name in DTYPE_ALIASES.items())
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {accepted})")


def info() -> str:
    """Versions, backends (and why each is or isn't available), threads."""
    lines = [
        f"fastpe {fastpe.__version__} on Python {platform.python_version()} ({platform.machine()}, "
        f"{os.cpu_count()} CPUs)"
    ]
    for dist in ("numpy", "numba", "torch", "triton", "transformers"):
        lines.append(f"  {dist:13s} {package_version(dist)}")
    lines.append("backends:")
    for name, status in fastpe.backends().items():
        lines.append(f"  {name:7s} {status}")
    lines.append("threads and devices:")
    try:
        import numba

        # the runtime picks fastpe's threading layer; starting Numba before it would pick OpenMP
        from fastpe.kernels.numba._runtime import threading_layer

        lines.append(
            f"  numba threads {numba.get_num_threads()} on the {threading_layer()!r} layer "
            "(numba.set_num_threads / NUMBA_NUM_THREADS)"
        )
        lines.append(f"  kernel cache  {_cache_line()}")
        from fastpe.kernels.numba import _decode_pairs, _pair_products

        paths = (  # (label, the CPU has it, the path, the fallback)
            ("bf16 tiles", _pair_products.available(), "bfloat16 pairs, forward and backward "
             "(AVX512-BF16 vdpbf16ps)", "float32 (this CPU has no AVX512-BF16)"),
            ("int8 decode", _decode_pairs.int8_available(), "int16 products for half-precision "
             "queries (AVX512-VNNI vpdpwssd)", "float32 (this CPU has no AVX512-VNNI)"),
            ("fp8 decode", _decode_pairs.fp8_available(), "bfloat16 pairs for bfloat16 queries "
             "(AVX512-BF16 vdpbf16ps)", "float32 (this CPU has no AVX512-BF16)"),
        )  # fmt: skip
        for label, has, path, fallback in paths:
            lines.append(f"  {label:13s} {path if has else fallback}")
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


def _cache_line() -> str:
    """Where the compiled CPU kernels are kept, and how much is there."""
    from fastpe import _warmup

    stats = _warmup.cache_stats()
    if stats["directory"] is None:
        return (
            "none: no writable cache directory, so every process compiles the CPU kernels "
            "again (set NUMBA_CACHE_DIR to a writable directory)"
        )
    return (
        f"{stats['directory']} ({stats['kernels']} compiled kernels of {stats['functions']} "
        f"functions, {stats['variants']} generated flex_attention variants, "
        f"{stats['bytes'] / 2**20:.1f} MiB; `fastpe warmup` fills it, "
        "`fastpe cache clear` empties it)"
    )


def warmup(args) -> int:
    from fastpe import _warmup

    try:
        items = _warmup.plan(args.ops, args.dtype, args.features, args.model_config, args.flash)
    except (ValueError, FileNotFoundError, OSError) as exc:
        return _fail("warmup", str(exc))
    if args.dry_run:
        for item in items:
            print(
                f"{item.label}  (heads {item.heads}, kv heads {item.kv_heads}, head dim "
                f"{item.head_dim})"
            )
        return 0
    if any(item.dtype in ("float16", "bfloat16") or "backward" in item.features for item in items):
        if not _installed("torch"):
            return _fail(
                "warmup",
                "half dtypes and --features backward are warmed up through torch tensors, and "
                "torch is not installed (pip install torch)",
            )
    report = _warmup.warmup(
        args.ops,
        args.dtype,
        args.features,
        model_config=args.model_config,
        flash=args.flash,
        jobs=args.jobs,
        check=not args.no_check,
    )
    print(report.summary())
    return 0 if report.ok else 1


def cache(args) -> int:
    from fastpe import _warmup

    if args.action == "clear":
        removed = _warmup.clear_cache()
        if removed["directory"] is None:
            print("no kernel cache: no writable cache directory (nothing to remove)")
        else:
            print(
                f"removed {removed['kernels']} compiled kernels of {removed['functions']} "
                f"functions and {removed['variants']} generated flex_attention variants "
                f"({removed['bytes'] / 2**20:.1f} MiB) from {removed['directory']}"
            )
    else:
        print(f"kernel cache: {_cache_line()}")
    return 0


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
        (
            "rope_table 4096 x 128, llama3 scaling",
            "rope_table",
            (4096, 128),
            {
                "scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 1024,
                }
            },
        ),
        ("apply_rope [2,8,128,64] offset 1000", "apply_rope", (q, cos, sin), {"positions": 1000}),
        ("embed [4,128] vocab 1000 d 256 + sinusoidal", "embed", (ids, weight), {"scale": 16.0}),
        (
            "attention GQA 8/2 heads, causal, ALiBi",
            "attention",
            (q, k, v),
            {"causal": True, "alibi_slopes": 2.0 ** -np.arange(1, 9)},
        ),
        (
            "attention + fused RoPE + key_lengths",
            "attention",
            (q, k, v),
            {"rope": {"cos": cos, "sin": sin}, "key_lengths": np.array([160, 97])},
        ),
        ("merge_attention of two key halves", "merge_attention", (out_a, lse_a, out_b, lse_b), {}),
    ]


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


def _fail(command: str, message: str) -> int:
    print(f"fastpe {command}: error: {message}", file=sys.stderr)
    return 2


def _cannot_write(path: str) -> str | None:
    """Why ``path`` cannot be written, found before an hour of benchmarking rather than after."""
    if os.path.isdir(path):
        return f"{path!r} is a directory"
    existed = os.path.exists(path)
    try:
        with open(path, "a"):  # "a": an existing file keeps its contents until the run ends
            pass
    except OSError as exc:
        return f"cannot write {path!r}: {exc.strerror or exc}"
    if not existed:
        os.remove(path)
    return None


def _cannot_plot(path: str) -> str | None:
    ext = os.path.splitext(path)[1][1:].lower()
    if ext:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        if ext not in formats:
            return f"{path!r}: matplotlib cannot write .{ext} files; it writes {', '.join(sorted(formats))}"
    return _cannot_write(path)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _modes_without_torch(args, notes: list[str]) -> list[str]:
    """The modes to time when torch is not installed (forward only: gradients are timed through
    torch autograd), noting in ``notes`` what is left out; ValueError (one line) when the run
    cannot go on without torch."""
    if args.dtype == "bfloat16":
        raise ValueError("--dtype bfloat16 needs torch (NumPy has no bfloat16): pip install torch")
    grads = [m for m in args.modes if m != "forward"]
    if grads:
        why = "gradients are timed through torch autograd, and torch is not installed"
        if len(grads) == len(args.modes):
            raise ValueError(f"--modes {' '.join(grads)}: {why} (pip install torch)")
        notes.append(f"skipped: --modes {' '.join(grads)}: {why} (pip install torch)")
    return [m for m in args.modes if m == "forward"]


def bench(args) -> int:
    try:
        device = bm.resolve_device(args.device, "--device")
    except ValueError as exc:
        return _fail("bench", str(exc))
    # Notes on what this run leaves out because a package is not installed: printed before the
    # run starts (stderr), so that nobody waits an hour to learn the plot was never going to be
    # drawn
    notes: list[str] = []
    modes = args.modes
    if not _installed("torch"):
        try:
            modes = _modes_without_torch(args, notes)
        except ValueError as exc:
            return _fail("bench", str(exc))
    problems = [("--json", _cannot_write(args.json))]
    plot = args.plot
    if plot and not _installed("matplotlib"):
        notes.append(
            "skipped: the plot, as matplotlib is not installed (pip install matplotlib); the "
            "table and the results JSON are written as usual"
        )
        plot = None
    elif plot:
        problems.append(("--plot", _cannot_plot(plot)))
    for option, problem in problems:
        if problem:
            return _fail("bench", f"{option}: {problem}")
    grid = bm.QUICK_GRID if args.quick else bm.FULL_GRID
    if args.ops:
        grid = [c for c in grid if c.op in args.ops]
    generate = bool(args.ops and "generate" in args.ops)
    if args.cases:
        grid = [c for c in grid if any(text in c.name for text in args.cases)]
        if not grid and not generate:
            return _fail("bench", f"--cases: no case of the grid contains {args.cases}")
    grid = bm.in_modes(grid, modes)
    if generate and (absent := [m for m in ("torch", "transformers") if not _installed(m)]):
        why = (
            f"--ops generate: it runs transformers' model.generate(), which needs "
            f"{' and '.join(absent)} (pip install {' '.join(absent)})"
        )
        if not grid:  # nothing else to time
            return _fail("bench", why)
        notes.append(f"skipped: {why}")
        generate = False
    for module, names in bm.missing_baselines(sorted({c.op for c in grid}), device).items():
        fastpe_note = " fastpe is timed on NumPy arrays;" if module == "torch" else ""
        notes.append(
            f"{module} is not installed:{fastpe_note} skipping the baselines that need it "
            f"({', '.join(names)}); {bm.install_hint(module)} to time them"
        )
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    print(info(), end="\n\n")
    for note in notes:
        print(note, file=sys.stderr)
    progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    doc = bm.run_benchmarks(grid, device, dtype, progress=progress)
    if generate:  # opt-in only: minutes on a CPU
        from fastpe.benchmarking.generate import run_generate

        doc["results"] += run_generate(device, dtype, progress=progress)
    print(bm.format_table(doc))
    for line in bm.caveats(doc):
        print(line)
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\nresults: {args.json}")
    if plot and doc["results"]:
        bm.plot(doc, plot)
        print(f"plot:    {plot}")
    elif args.plot and not plot:
        print("plot:    none (matplotlib is not installed: pip install matplotlib)")
    return 0


def report(args) -> int:
    try:
        doc = bm.load_results(args.json)
    except ValueError as exc:
        return _fail("report", str(exc))
    print(bm.format_summary(doc) if args.summary else bm.format_table(doc, markdown=True))
    for line in bm.caveats(doc):  # stderr: stdout is the markdown that goes into the README
        print(line, file=sys.stderr)
    return 0


def triton_report(args) -> int:
    from fastpe import triton_report as tr

    why = tr.unavailable()
    if why:
        return _fail("triton-report", why)
    targets = args.targets or list(tr.TARGETS)
    unknown = [t for t in targets if t not in tr.TARGETS]
    if unknown:
        return _fail(
            "triton-report",
            f"--targets: unknown {unknown}; known: {', '.join(map(str, tr.TARGETS))}",
        )
    for option, path in (("--json", args.json), ("--markdown", args.markdown)):
        problem = path and _cannot_write(path)
        if problem:
            return _fail("triton-report", f"{option}: {problem}")
    start = time.perf_counter()
    kernels = args.kernels or list(tr.KERNELS)
    unknown = [k for k in kernels if k not in tr.KERNELS]
    if unknown:
        return _fail(
            "triton-report", f"--kernels: unknown {unknown}; known: {', '.join(tr.KERNELS)}"
        )
    cases = tr.plan(full=args.full, targets=targets, kernels=kernels)
    print(f"{len(cases)} compilations on {args.jobs} worker(s)", file=sys.stderr, flush=True)
    records = tr.run(
        cases,
        jobs=args.jobs,
        cache_dir=None if args.no_cache else (args.cache_dir or tr.default_cache_dir()),
        progress=lambda m: print(m, file=sys.stderr, flush=True),
    )
    doc = tr.document(
        records,
        full=args.full,
        seconds=time.perf_counter() - start,
        jobs=args.jobs,
        kernels=kernels,
    )
    text = tr.format_markdown(doc)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 1 if doc["problems"] else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastpe",
        description="fastpe: fused kernels for positional encodings, embedding + PE and "
        "attention, checked against a float64 NumPy oracle (also run as `python -m fastpe`).",
        epilog="`fastpe COMMAND --help` describes a command and its options.",
    )
    parser.add_argument("--version", action="version", version=f"fastpe {fastpe.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser(
        "info",
        help="versions, backends (and why each is or isn't available), threads and GPUs",
        description="Print versions, fastpe's backends (and why each is or isn't available), "
        "thread counts and CUDA devices.",
    )
    sub.add_parser(
        "demo",
        help="run every op once; print its time and error against the float64 oracle",
        description="Print `fastpe info`, then run every op once on the automatic backend and "
        "print its time and max |error| against the float64 NumPy oracle.",
    )
    from fastpe import _warmup

    w = sub.add_parser(
        "warmup",
        help="compile the CPU kernels a workload will use, ahead of its first call",
        description="Compile, and keep in the kernel cache, the CPU (Numba) kernels that calls "
        "of these ops, dtypes and features will use — or those a transformers model will use — "
        "so that later processes load them instead of compiling for seconds on their first "
        "call. Each item runs in a worker process; a last fresh process checks that every call "
        "now loads from the cache. Run it at image build time to ship a warm cache.",
    )
    w.add_argument(
        "--ops",
        nargs="+",
        choices=_warmup.OPS,
        metavar="OP",
        help="ops to warm up: %(choices)s (default: attention)",
    )
    w.add_argument(
        "--dtype",
        nargs="+",
        type=_dtype,
        metavar="DTYPE",
        help="dtypes of the inputs (default: float32, or the model config's torch_dtype); "
        "float16/bfloat16 need torch",
    )
    w.add_argument(
        "--features",
        nargs="+",
        choices=_warmup.FEATURES,
        metavar="FEATURE",
        default=None,
        help="what the workload's calls use: %(choices)s ('decode': one-query-row calls "
        "against a cache; 'paged': a block table for attention_kvcache; 'backward': "
        "gradients through torch)",
    )
    w.add_argument(
        "--model-config",
        metavar="PATH|NAME",
        default=None,
        help="a transformers config.json (or a directory holding one, or a Hub name already in "
        "the local Hugging Face cache): warm up what the model runs through "
        "fastpe.integrations.transformers.register() — attention in its dtype, causal, prefill "
        "and decode, with its sliding window, softcap and sinks",
    )
    w.add_argument(
        "--flash",
        action="store_true",
        help="with --model-config: for register_flash() (attention_varlen and attention)",
    )
    w.add_argument(
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help="worker processes (0: in this process; default: one per attention item up to "
        "one per CPU when there are several, else 0: a worker's start costs more than it saves "
        "on short compiles)",
    )
    w.add_argument(
        "--no-check",
        action="store_true",
        help="skip the last fresh process that confirms every call loads from the cache",
    )
    w.add_argument(
        "--dry-run", action="store_true", help="print the items that would run, compile nothing"
    )
    c = sub.add_parser(
        "cache",
        help="show or empty the kernel cache",
        description="`fastpe cache info` shows where the compiled CPU kernels are kept and how "
        "many; `fastpe cache clear` removes fastpe's compiled kernels from it (nothing else).",
    )
    c.add_argument("action", choices=("info", "clear"), help="%(choices)s")
    b = sub.add_parser(
        "bench",
        help="time fastpe against the baselines on this machine",
        description="Time fastpe's kernel backends for the device against the baselines (NumPy, "
        "torch eager, transformers, torch SDPA; flash-attn and Liger on GPU when installed): "
        "median of repeated calls after a warm-up, throughput, fraction of the machine's "
        "measured peak (CPU) and max |error| against the float64 oracle. Prints a table, writes "
        "the results JSON and a plot.",
    )
    b.add_argument(
        "--quick",
        action="store_true",
        help="the small grid (one case per op, three for attention) instead of the full one",
    )
    b.add_argument(
        "--ops",
        nargs="+",
        choices=[*bm.OPS, "generate"],
        metavar="OP",
        help="only these ops: %(choices)s ('generate', never run by default: model.generate() "
        "of a Llama-shaped random-weight model, fastpe attention vs SDPA, minutes on a CPU)",
    )
    b.add_argument(
        "--cases",
        nargs="+",
        metavar="TEXT",
        help="only the cases whose name (op and case, as in the table) contains one of these "
        "strings, e.g. 'Sq1 ' 'one token'",
    )
    b.add_argument(
        "--modes",
        nargs="+",
        choices=bm.MODES,
        default=["forward"],
        metavar="MODE",
        help="what to time, as Liger reports it: %(choices)s (default: forward) — the call, the "
        "gradients of a recorded call, or both; ops without a backward are timed forward only",
    )
    b.add_argument(
        "--json", default="fastpe-bench.json", metavar="PATH", help="results file (%(default)s)"
    )
    b.add_argument(
        "--plot",
        default="fastpe-bench.png",
        metavar="PATH",
        help="bar chart of each case's throughput, one panel per op, format from the "
        "extension (%(default)s; '' for none); skipped with a note when matplotlib is not "
        "installed",
    )
    b.add_argument(
        "--device", default=None, help="cpu or cuda[:N] (default: cuda when torch sees a GPU)"
    )
    b.add_argument(
        "--dtype",
        type=_dtype,
        default=None,
        metavar="DTYPE",
        help="dtype of the inputs: "
        + ", ".join(f"{name} ({short})" for short, name in DTYPE_ALIASES.items())
        + " (default: float32 on CPU, bfloat16 on GPU); "
        "baselines that cannot take it are skipped, and the tables are computed in float32",
    )
    r = sub.add_parser(
        "report",
        help="print a results JSON as markdown (the tables in bench/results and the README)",
        description="Print a results file written by `fastpe bench` as a markdown table: every "
        "row, or with --summary fastpe against each op's target baseline.",
    )
    r.add_argument("json", metavar="PATH", help="a results file written by `fastpe bench`")
    r.add_argument(
        "--summary",
        action="store_true",
        help="only fastpe's rows, with the speedup over each op's target baseline "
        "(" + ", ".join(f"{op}: {name}" for op, name in bm.TARGET_BASELINE.items()) + ")",
    )
    t = sub.add_parser(
        "triton-report",
        help="compile every Triton kernel for sm_80/sm_90/... without a GPU; registers, spills, "
        "shared memory, tensor-core instructions",
        description="Compile every Triton kernel for real NVIDIA targets with Triton's own "
        "compiler (no GPU needed): each kernel x the configs its launcher or autotuner may use x "
        "feature flags x dtype x head dim. Reads registers, stack (spills) and shared memory with "
        "cuobjdump and counts tensor-core instructions (in the kernel and per iteration of its "
        "hot loop) and 128-bit loads in the SASS. Prints a markdown table; exits 1 if a kernel "
        "does not compile, needs more shared memory than its target has, an attention config "
        "the autotuner may pick on sm_80/sm_90 spills, or an fp16/bf16 attention kernel "
        "(forward, paged, backward) has no tensor-core instruction where its launcher did not "
        "choose fp32 dots.",
    )
    t.add_argument(
        "--full",
        action="store_true",
        help="every dtype (fp16, bf16, fp32), head dim (64, 128, 256), feature variant and "
        "config (default: bf16, head dims 64 and 128, the main variants, pickable configs)",
    )
    t.add_argument(
        "--targets",
        nargs="+",
        type=int,
        metavar="SM",
        help="compute capabilities, e.g. 80 90 (default: 80 90 100 120)",
    )
    t.add_argument(
        "--kernels",
        nargs="+",
        metavar="KERNEL",
        help="only these kernels, e.g. attention attention_paged (default: all of them)",
    )
    t.add_argument(
        "--jobs", type=int, default=2, choices=(1, 2), help="worker processes (%(default)s)"
    )
    t.add_argument("--json", default=None, metavar="PATH", help="also write the results JSON")
    t.add_argument("--markdown", default=None, metavar="PATH", help="also write the table")
    t.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help="where compiled results are cached (default: ~/.cache/fastpe/triton-aot)",
    )
    t.add_argument("--no-cache", action="store_true", help="compile everything again")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "info":
        print(info())
    elif args.command == "demo":
        print(info(), end="\n\n")
        print(demo())
    elif args.command == "warmup":
        return warmup(args)
    elif args.command == "cache":
        return cache(args)
    elif args.command == "bench":
        return bench(args)
    elif args.command == "triton-report":
        return triton_report(args)
    else:
        return report(args)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
