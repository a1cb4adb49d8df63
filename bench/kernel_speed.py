"""Run-time speed of the main CPU kernels, for before/after checks of changes to how they compile.

    python bench/ab_processes.py --before VENV_BEFORE/bin/python:CHECKOUT_BEFORE \\
        --after .venv/bin/python:. --script $PWD/bench/kernel_speed.py --rounds 6

Prints ``  NAME median T ms`` over 15 calls per case (after one untimed call; the cases take
turns, ``_interleaved.rounds``), for ``ab_processes.py`` to alternate between two checkouts. The kernel cache lives under the
temporary directory, named after the checkout, so the first round compiles and the later ones
load; torch runs on 2 threads.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import fastpe

_tree = hashlib.sha1(str(Path(fastpe.__file__).parent).encode()).hexdigest()[:8]
os.environ["NUMBA_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"fastpe-speed-{_tree}")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _interleaved import rounds  # noqa: E402


def main() -> None:
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    q, k, v = (randn(1, 8, 1024, 64) for _ in range(3))
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    q1, k_cache, v_cache = randn(8, 1, 32, 128), randn(8, 4096, 8, 128), randn(8, 4096, 8, 128)
    lengths = torch.full((8,), 4000, dtype=torch.int32)
    qg, kg, vg = (randn(1, 8, 512, 64).requires_grad_() for _ in range(3))
    # packed prefill: three sequences of 512, 384 and 128 tokens, 8 heads of 64
    packed = [randn(1024, 8, 64) for _ in range(3)]
    cu_seqlens = torch.tensor([0, 512, 896, 1024], dtype=torch.int32)
    x = randn(1, 32, 1024, 128)
    cos, sin = (torch.from_numpy(t) for t in fastpe.rope_table(1024, 128))

    def forward_backward():
        fastpe.attention(qg, kg, vg, causal=True).sum().backward()

    cases = {
        "attention non-causal 1024": lambda: fastpe.attention(q, k, v),
        "attention causal 1024": lambda: fastpe.attention(q, k, v, causal=True),
        "attention window+softcap": lambda: fastpe.attention(
            q, k, v, causal=True, window=(256, 0), softcap=30.0
        ),
        "attention bf16 causal": lambda: fastpe.attention(qb, kb, vb, causal=True),
        "kvcache decode B8 Sk4096": lambda: fastpe.attention_kvcache(
            q1, k_cache, v_cache, cache_seqlens=lengths, causal=True
        ),
        "varlen prefill 512+384+128": lambda: fastpe.attention_varlen(
            *packed, cu_seqlens, cu_seqlens, max_seqlen_q=512, max_seqlen_k=512, causal=True
        ),
        "fwd+bwd 512": forward_backward,
        "apply_rope 1024": lambda: fastpe.apply_rope(x, cos, sin),
    }
    times = rounds(cases, n_rounds=15, calls=1)  # each case once per round, in turn
    for name, seconds in times.items():
        print(f"  {name} median {np.median(seconds) * 1e3:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
