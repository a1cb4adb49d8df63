"""fastpe's CPU attention inside a torch process, as a model calls it: against SDPA, each call
right after a torch op, in the default environment (no OMP_WAIT_POLICY, no thread settings).

    python bench/torch_pipeline.py --rounds 5 [--dtype bfloat16] [--backward]

Each round starts one fresh process per setting, the settings in turn, so that a change in the
machine's load falls on all of them alike:

- ``default``: what a user gets (torch imported first, so fastpe's kernels share torch's OpenMP
  pool; docs/backends.md#processes-and-threads-cpu);
- ``tbb``: ``NUMBA_THREADING_LAYER=tbb``, fastpe's kernels on their own TBB pool beside torch's;
- ``passive``: ``tbb`` with ``OMP_WAIT_POLICY=PASSIVE``, the setting the docs used to advise;
- ``omp-own`` (only when named in ``--settings``): ``NUMBA_THREADING_LAYER=omp``, Numba's OpenMP
  layer on the OpenMP runtime it loads itself, a second pool beside torch's.

In each process, every case alternates ``calls`` pairs: a torch matmul (a [64, 1024] x [1024, 1024]
projection, which wakes torch's pool) then fastpe, and the same matmul then SDPA; the process
prints SDPA's median time over fastpe's (above 1: fastpe is faster); with ``--backward`` each
call is a training step's attention, forward and backward (``out.backward(grad)``), on the cases
other than decoding. The summary gives, per
setting and case, the median [min, max] of those ratios over the rounds. Measurements, not
assertions: bench/results/ keeps them with the machine they came from.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CASES = {  # name: (B, Hq, Hkv, Sq, Sk, D, causal)
    "non-causal 1024² D64": (1, 16, 16, 1024, 1024, 64, False),
    "causal 512 D64": (1, 16, 16, 512, 512, 64, True),
    "causal 1024 D64": (1, 16, 16, 1024, 1024, 64, True),
    "causal 2048 D64": (1, 16, 16, 2048, 2048, 64, True),
    "causal 4096 D128": (1, 8, 8, 4096, 4096, 128, True),
    "decode B8 Sk4096 D128": (8, 32, 8, 1, 4096, 128, False),
}
SETTINGS = {
    "default": {},
    "tbb": {"NUMBA_THREADING_LAYER": "tbb"},
    "passive": {"NUMBA_THREADING_LAYER": "tbb", "OMP_WAIT_POLICY": "PASSIVE"},
    "omp-own": {"NUMBA_THREADING_LAYER": "omp"},
}


def measure(calls: int, cases: list[str], dtype: str = "float32", backward: bool = False) -> dict:
    """One process's ratios: {case: SDPA median / fastpe median}, and the threading layer."""
    import time

    import torch
    import torch.nn.functional as F
    from fastpe.kernels.numba._runtime import threading_layer

    import fastpe

    torch.manual_seed(0)
    weight, x = torch.randn(1024, 1024), torch.randn(64, 1024)
    ratios = {}
    for name in cases:
        b, hq, hkv, sq, sk, d, causal = CASES[name]
        dt = getattr(torch, dtype)
        q = torch.randn(b, hq, sq, d).to(dt)
        k, v = torch.randn(b, hkv, sk, d).to(dt), torch.randn(b, hkv, sk, d).to(dt)
        tol = 1e-4 if dt == torch.float32 else 2e-2

        def ours(q=q, k=k, v=v, causal=causal):
            return fastpe.attention(q, k, v, causal=causal)

        def sdpa(q=q, k=k, v=v, causal=causal):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

        torch.testing.assert_close(ours(), sdpa(), atol=tol, rtol=tol)  # also compiles
        if backward:
            leaves = [x.requires_grad_() for x in (q, k, v)]
            grad = torch.randn(b, hq, sq, d).to(dt)

            def step(attend, leaves=leaves, grad=grad):
                for x in leaves:
                    x.grad = None
                attend().backward(grad)
                return [x.grad for x in leaves]

            ours, sdpa = (lambda attend=fn: step(attend) for fn in (ours, sdpa))
            # gradients of size ~sqrt(Sk): the tolerance relative to that
            torch.testing.assert_close(ours(), sdpa(), atol=4 * tol, rtol=4 * tol)
        times = {ours: [], sdpa: []}
        for _ in range(calls):
            for fn in (ours, sdpa):
                x @ weight
                start = time.perf_counter()
                fn()
                times[fn].append(time.perf_counter() - start)
        ratios[name] = statistics.median(times[sdpa]) / statistics.median(times[ours])
    return {"layer": threading_layer(), "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=15, help="pairs of calls per case")
    parser.add_argument(
        "--settings", nargs="+", choices=list(SETTINGS), default=["default", "tbb", "passive"]
    )
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.backward:
        args.cases = [case for case in args.cases if not case.startswith("decode")]
    if args.child:
        print(json.dumps(measure(args.calls, args.cases, args.dtype, args.backward)))
        return
    print(f"command: python {' '.join(sys.argv)}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY",)}
    base = {k: v for k, v in base.items() if not k.startswith("NUMBA_THREADING_LAYER")}
    base["FASTPE_QUIET_COMPILE"] = "1"
    results = {name: [] for name in args.settings}
    for round_ in range(1, args.rounds + 1):
        for name in args.settings:
            out = subprocess.run(
                [sys.executable, __file__, "--child", "--calls", str(args.calls)]
                + ["--dtype", args.dtype, "--cases", *args.cases]
                + ["--backward"] * args.backward,
                env={**base, **SETTINGS[name]},
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            result = json.loads(out.strip().splitlines()[-1])
            results[name].append(result)
            cells = ", ".join(f"{case} {r:.2f}" for case, r in result["ratios"].items())
            print(f"[round {round_}] {name} ({result['layer']} layer): {cells}", flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("fastpe's speedup over SDPA, median [min, max] over the rounds\n")
    print("| setting | " + " | ".join(args.cases) + " |")
    print("|---|" + "---|" * len(args.cases))
    for name, runs in results.items():
        cells = []
        for case in args.cases:
            values = [run["ratios"][case] for run in runs]
            cells.append(f"{statistics.median(values):.2f}× [{min(values):.2f}, {max(values):.2f}]")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
