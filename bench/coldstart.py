"""First-call (cold start) times of fastpe's CPU kernels, in fresh processes.

    python bench/coldstart.py [--repeats 3] [--cases NAME ...] [--quick]

Every measurement runs in a new Python process whose caches point at new temporary
directories (NUMBA_CACHE_DIR for fastpe's kernels, TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR
for torch.compile), so nothing compiled by an earlier run or by another program is reused; the
median of ``--repeats`` processes is reported with every run's time. Cases:

- ``attention``: the first float32 ``fastpe.attention`` call, B1 H8 S256 D64 causal, on an
  empty cache (the import is timed apart);
- ``ops``: in one process on an empty cache, the first call of each of the seven main ops
  (sinusoidal_table, rope_table, apply_rope, embed, attention, attention_varlen,
  attention_kvcache) and then a bfloat16 attention; their sum is the row, each op a sub-row;
- ``warm``: a new process's first attention call (as in ``attention``) after ``import fastpe``,
  with a cache filled beforehand by one process making that call;
- ``backward``: training's first step on an empty cache: a float32 attention on torch tensors
  that require grad (as in ``attention``), then its backward, each timed; then the same in
  bfloat16;
- ``flex``: ``torch.compile(flex_attention)``'s first call on the same shape with a causal
  block mask, on an empty inductor cache: the compile-on-first-call cost of the nearest torch
  alternative, on the same machine in the same run.

The machine's load average is printed before and after: compiles are single-threaded and a
busy machine slows them in proportion. ``--quick``: one process per case (the default cases
then are ``attention warm``), to check that the script runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import textwrap

CASES = ("attention", "ops", "warm", "backward", "flex")

# each snippet prints one JSON object of {label: seconds} as its last line
ATTENTION = """
import time
t0 = time.perf_counter()
import numpy as np, fastpe
imported = time.perf_counter() - t0
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 8, 256, 64), dtype=np.float32) for _ in range(3))
t = time.perf_counter()
fastpe.attention(q, k, v, causal=True)
first = time.perf_counter() - t
print(json.dumps({"import fastpe": imported, "first call": first}))
"""

# the end of a child script that defines ``calls`` (name -> call): each call's time, in order
_TIME_CALLS = """
times = {}
for name, call in calls.items():
    t = time.perf_counter()
    call()
    times[name] = time.perf_counter() - t
print(json.dumps(times))
"""

OPS = (
    """
import time, numpy as np, torch, fastpe  # torch for the bfloat16 call, imported before timing
rng = np.random.default_rng(0)
f32 = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
q, k, v = f32(1, 8, 256, 64), f32(1, 2, 256, 64), f32(1, 2, 256, 64)
cos, sin = fastpe.rope_table(512, 64, backend="numpy")
calls = {
    "sinusoidal_table": lambda: fastpe.sinusoidal_table(2048, 512),
    "rope_table": lambda: fastpe.rope_table(4096, 128),
    "apply_rope": lambda: fastpe.apply_rope(q, cos, sin),
    "embed": lambda: fastpe.embed(rng.integers(0, 1000, (4, 128)), f32(1000, 256)),
    "attention": lambda: fastpe.attention(q, k, v, causal=True),
    "attention_varlen": lambda: fastpe.attention_varlen(
        f32(512, 8, 64), f32(512, 2, 64), f32(512, 2, 64),
        np.array([0, 256, 512], np.int32), np.array([0, 256, 512], np.int32), causal=True),
    "attention_kvcache": lambda: fastpe.attention_kvcache(
        f32(2, 1, 8, 64), f32(2, 1024, 2, 64), f32(2, 1024, 2, 64),
        cache_seqlens=np.array([1000, 700], np.int32), causal=True),
}
bf16 = [torch.from_numpy(a).to(torch.bfloat16) for a in (q, k, v)]
calls["attention bfloat16"] = lambda: fastpe.attention(*bf16, causal=True)
"""
    + _TIME_CALLS
)

BACKWARD = """
import time, torch, fastpe
times = {}
for name, dtype in (("", torch.float32), ("bfloat16 ", torch.bfloat16)):
    q, k, v = (torch.randn(1, 8, 256, 64, dtype=dtype, requires_grad=True) for _ in range(3))
    t = time.perf_counter()
    out = fastpe.attention(q, k, v, causal=True)
    times[name + "forward"] = time.perf_counter() - t
    t = time.perf_counter()
    out.sum().backward()
    times[name + "backward"] = time.perf_counter() - t
print(json.dumps(times))
"""

MIXED = (
    """
import time, numpy as np, fastpe
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 8, 256, 64), dtype=np.float32) for _ in range(3))
mask = rng.random((1, 1, 256, 256)) > 0.2
calls = {
    "causal": lambda: fastpe.attention(q, k, v, causal=True),
    "causal softcap": lambda: fastpe.attention(q, k, v, causal=True, softcap=30.0),
    "mask": lambda: fastpe.attention(q, k, v, mask=mask),
}
"""
    + _TIME_CALLS
)

FLEX = """
import time, torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
q, k, v = (torch.randn(1, 8, 256, 64) for _ in range(3))
mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, 256, 256, device="cpu")
compiled = torch.compile(flex_attention)
t = time.perf_counter()
compiled(q, k, v, block_mask=mask)
print(json.dumps({"first call": time.perf_counter() - t}))
"""


def child_env(cache_root: str) -> dict:
    """This environment with every compile cache under ``cache_root``, compile notices off."""
    env = dict(os.environ)
    for name in ("NUMBA_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env[name] = os.path.join(cache_root, name.lower())
    env["FASTPE_QUIET_COMPILE"] = "1"  # the notice would only clutter the table
    return env


def run_child(code: str, cache_root: str) -> dict:
    """Run ``code`` in a new process with every compile cache under ``cache_root``."""
    result = subprocess.run(
        [sys.executable, "-c", "import json\n" + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=child_env(cache_root),
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"a measurement process failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(case: str, repeats: int, say) -> dict[str, list[float]]:
    """{row label: [seconds per process]} for one case."""
    rows: dict[str, list[float]] = {}
    for run in range(repeats):
        with tempfile.TemporaryDirectory(prefix="fastpe-coldstart-") as root:
            if case == "attention":
                got = run_child(ATTENTION, root)
                found = {
                    "attention float32 first call, empty cache": got["first call"],
                    "  import fastpe": got["import fastpe"],
                }
            elif case == "ops":
                got = run_child(OPS, root)
                found = {"7 ops + bfloat16 attention, one process, empty cache": sum(got.values())}
                found.update({f"  {name}": seconds for name, seconds in got.items()})
            elif case == "warm":
                run_child(ATTENTION, root)  # fills the cache
                got = run_child(ATTENTION, root)
                found = {"attention first call, new process, warm cache": got["first call"]}
            elif case == "backward":
                got = run_child(BACKWARD, root)
                found = {
                    "attention float32 backward first call, empty cache": got["backward"],
                    "  the float32 forward's first call": got["forward"],
                    "attention bfloat16 backward first call, after the float32 one": got[
                        "bfloat16 backward"
                    ],
                    "  the bfloat16 forward's first call": got["bfloat16 forward"],
                }
            else:
                got = run_child(FLEX, root)
                found = {"torch.compile(flex_attention) first call, empty cache": got["first call"]}
        for label, seconds in found.items():
            rows.setdefault(label, []).append(seconds)
        say(
            f"[{case} {run + 1}/{repeats}] "
            + ", ".join(f"{k.strip()} {v:.2f} s" for k, v in found.items())
        )
    return rows


def cpu_name() -> str:
    """The CPU's model name (and whether it has AVX-512, which the kernels use)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    name = next(
        (
            line.split(":", 1)[1].strip()
            for line in text.splitlines()
            if line.startswith("model name")
        ),
        platform.machine(),
    )
    return f"{name}{', AVX-512' if 'avx512f' in text else ''}"


def load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="processes per case (%(default)s)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=None, help="%(choices)s")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one process per case, cases attention and warm (a smoke run)",
    )
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    cases = args.cases or (["attention", "warm"] if args.quick else list(CASES))
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    import numba

    import fastpe

    print(
        f"command: python bench/coldstart.py {shlex.join(argv if argv is not None else sys.argv[1:])}"
    )
    print(
        f"machine: {cpu_name()}, {os.cpu_count()} CPUs; "
        f"fastpe {fastpe.__version__}, numba {numba.__version__}, Python "
        f"{platform.python_version()}"
    )
    print(f"load average before: {load()}")
    rows: dict[str, list[float]] = {}
    for case in cases:
        if case in ("ops", "flex"):
            try:
                import torch  # noqa: F401
            except ImportError:
                print(f"skipped {case}: it needs torch (pip install torch)")
                continue
        rows.update(measure(case, repeats, say))
    print(f"load average after:  {load()}")
    print(f"\n| {'first call':60s} | {'median':>8s} | runs (s) |")
    print(f"|{'-' * 62}|{'-' * 10}|----------|")
    for label, times in rows.items():
        runs = " ".join(f"{t:.2f}" for t in times)
        print(f"| {label:60s} | {statistics.median(times):7.2f}s | {runs} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
