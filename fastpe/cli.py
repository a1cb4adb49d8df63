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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fastpe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, backends and why each is or isn't available")
    sub.add_parser("demo", help="run every op once and print its error against the float64 oracle")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(info())
    else:
        print(info(), end="\n\n")
        print(demo())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
