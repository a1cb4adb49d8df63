"""One first call in a fresh child process, printed for ``bench/ab_processes.py``.

    python bench/first_call.py cold    # first float32 attention call, empty cache
    python bench/first_call.py warm    # the same call from a warm cache (filled once per checkout)
    python bench/first_call.py flex    # flex_attention's first and second variant, then the
                                       # built-in attention(causal, softcap), in one empty cache

Each prints ``  NAME median T ms`` lines (one measurement each: ``ab_processes.py`` runs it once
per round, alternating two checkouts). ``warm`` keeps its cache under the temporary directory,
named after the checkout, so that two checkouts never share one; ``bench/coldstart.py`` gives
medians of these first calls on one checkout.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ATTENTION = """
import json, time
import numpy as np, fastpe
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 8, 256, 64), dtype=np.float32) for _ in range(3))
t = time.perf_counter()
fastpe.attention(q, k, v, causal=True)
print(json.dumps(time.perf_counter() - t))
"""


def child(code: str, cache: str) -> str:
    env = {**os.environ, "NUMBA_CACHE_DIR": cache, "FASTPE_QUIET_COMPILE": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
    ).stdout


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "cold"
    if mode == "cold":
        with tempfile.TemporaryDirectory() as cache:
            seconds = json.loads(child(ATTENTION, cache).splitlines()[-1])
        print(f"  cold first attention median {1000 * seconds:.1f} ms")
    elif mode == "warm":
        import fastpe  # which checkout this interpreter maps fastpe to

        tree = hashlib.sha1(str(Path(fastpe.__file__).parent).encode()).hexdigest()[:8]
        cache = os.path.join(tempfile.gettempdir(), f"fastpe-first-call-{tree}")
        if not os.path.isdir(cache):
            child(ATTENTION, cache)
        seconds = json.loads(child(ATTENTION, cache).splitlines()[-1])
        print(f"  warm first attention median {1000 * seconds:.1f} ms")
    elif mode == "flex":
        script = str(Path(__file__).with_name("flex_attention.py"))
        with tempfile.TemporaryDirectory() as cache:
            for case in ("flex", "flex-window", "builtin"):
                out = subprocess.run(
                    [sys.executable, script, "--seq", "1024", "--first-call", case],
                    env={**os.environ, "NUMBA_CACHE_DIR": cache, "FASTPE_QUIET_COMPILE": "1"},
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                wall = float(re.search(r"wall ([\d.]+) s", out).group(1))
                print(f"  {case} median {1000 * wall:.0f} ms")
    else:
        sys.exit(f"unknown mode {mode!r}: cold, warm or flex")


if __name__ == "__main__":
    main()
