"""One first call in fresh child processes, printed for ``bench/ab_processes.py``.

    python bench/first_call.py cold    # first float32 attention call, empty cache
    python bench/first_call.py warm    # the same call from a warm cache (filled once per checkout)
    python bench/first_call.py ops     # the first calls of the seven main ops and a bfloat16
                                       # attention, in one process, empty cache: each and the sum
    python bench/first_call.py backward  # a float32 attention's forward and backward, then a
                                         # bfloat16 one's, in one process, empty cache
    python bench/first_call.py flex    # flex_attention's first and second variant, then the
                                       # built-in attention(causal, softcap), in one empty cache
    python bench/first_call.py mixed   # float32 attention calls without, then with score
                                       # modifiers (soft-cap, then a mask), in one process

Each prints ``  NAME median T ms`` lines (one measurement each: ``ab_processes.py`` runs it once
per round, alternating two checkouts). The calls and cache settings are ``bench/coldstart.py``'s,
which gives medians of these first calls on one checkout. ``warm`` keeps its cache under the
temporary directory, named after the checkout, so that two checkouts never share one.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from coldstart import ATTENTION, BACKWARD, MIXED, OPS, child_env, run_child


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "mode", choices=("cold", "warm", "ops", "backward", "mixed", "flex"), help="%(choices)s"
    )
    mode = parser.parse_args().mode
    if mode == "cold":
        with tempfile.TemporaryDirectory() as root:
            seconds = run_child(ATTENTION, root)["first call"]
        print(f"  cold first attention median {1000 * seconds:.1f} ms")
    elif mode == "ops":
        with tempfile.TemporaryDirectory() as root:
            seconds = run_child(OPS, root)
        for op, op_seconds in seconds.items():
            print(f"  {op} median {1000 * op_seconds:.1f} ms")
        print(f"  all first calls median {1000 * sum(seconds.values()):.1f} ms")
    elif mode in ("backward", "mixed"):
        with tempfile.TemporaryDirectory() as root:
            seconds = run_child(BACKWARD if mode == "backward" else MIXED, root)
        for step, step_seconds in seconds.items():
            print(f"  {step} median {1000 * step_seconds:.1f} ms")
    elif mode == "warm":
        import fastpe  # which checkout this interpreter maps fastpe to

        tree = hashlib.sha1(str(Path(fastpe.__file__).parent).encode()).hexdigest()[:8]
        root = os.path.join(tempfile.gettempdir(), f"fastpe-first-call-{tree}")
        if not os.path.isdir(child_env(root)["NUMBA_CACHE_DIR"]):
            run_child(ATTENTION, root)  # fills the cache
        seconds = run_child(ATTENTION, root)["first call"]
        print(f"  warm first attention median {1000 * seconds:.1f} ms")
    else:
        script = str(Path(__file__).with_name("flex_attention.py"))
        with tempfile.TemporaryDirectory() as root:
            for case in ("flex", "flex-window", "builtin"):
                out = subprocess.run(
                    [sys.executable, script, "--seq", "1024", "--first-call", case],
                    env=child_env(root),
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                wall = float(re.search(r"wall ([\d.]+) s", out).group(1))
                print(f"  {case} median {1000 * wall:.0f} ms")


if __name__ == "__main__":
    main()
