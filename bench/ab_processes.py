"""Before / after in one run: a bench script's timing lines from two checkouts (each with its
own interpreter, whose editable install maps fastpe to that checkout), fresh processes
alternating round by round so that a change in the machine's load falls on both alike.

    python bench/ab_processes.py --before /work/venv-base/bin/python:/work/base \\
        --after .venv/bin/python:. --script bench/kv_quant_decode.py --rounds 4 -- --rounds 3

Every line of the script's output of the form ``  NAME median T ms [...]`` is collected; the
summary gives, per name, each checkout's median [min, max] over the rounds and the median of
the per-round ratios before / after (above 1: the after checkout is faster).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
from pathlib import Path

LINE = re.compile(r"^\s+(?P<name>.+?)\s+median\s+(?P<ms>[\d.]+) ms")


def run(python: str, tree: str, script: str, extra: list[str]) -> dict[str, float]:
    env = {**os.environ, "FASTPE_QUIET_COMPILE": "1"}
    out = subprocess.run(
        [python, str(Path(tree) / script), *extra],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {m["name"]: float(m["ms"]) for m in map(LINE.match, out.splitlines()) if m}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="PYTHON:CHECKOUT")
    parser.add_argument("--after", required=True, help="PYTHON:CHECKOUT")
    parser.add_argument(
        "--script",
        required=True,
        help="bench script: relative to each checkout, or one absolute path",
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("extra", nargs="*", help="arguments for the script (after --)")
    args = parser.parse_args()
    sides = {"before": args.before.split(":", 1), "after": args.after.split(":", 1)}
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    times: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
    for round_ in range(1, args.rounds + 1):
        for side, (python, tree) in sides.items():
            result = run(python, tree, args.script, args.extra)
            for name, ms in result.items():
                times[side].setdefault(name, []).append(ms)
            cells = ", ".join(f"{name} {ms:.3g}" for name, ms in result.items())
            print(f"[round {round_}] {side}: {cells} (ms)", flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| case | before ms | after ms | before / after |")
    print("|---|---|---|---|")
    for name in times["after"]:
        if name not in times["before"]:
            continue
        a, b = times["before"][name], times["after"][name]
        ratios = [x / y for x, y in zip(a, b, strict=True)]
        cells = [f"{statistics.median(t):.3g} [{min(t):.3g}, {max(t):.3g}]" for t in (a, b)]
        spread = f"{statistics.median(ratios):.2f}× [{min(ratios):.2f}, {max(ratios):.2f}]"
        print(f"| {name} | {cells[0]} | {cells[1]} | {spread} |")


if __name__ == "__main__":
    main()
