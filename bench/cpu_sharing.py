"""fastpe's Numba threads next to torch's OpenMP pool in one process: one decode step (issue 12).

    python bench/cpu_sharing.py                       # torch and Numba defaults
    python bench/cpu_sharing.py --torch-threads 1     # torch.set_num_threads(1)
    OMP_WAIT_POLICY=PASSIVE python bench/cpu_sharing.py

Prints the median (and 90th percentile) of 150 calls of: fastpe decode attention (B 1, H 32/8,
Sk 512, D 128) right after a torch op (a [16, 1024] @ [1024, 1024] matmul, which wakes torch's
pool) and after 5 ms of sleep; SDPA on the same inputs after the torch op; and a one-token
``apply_rope((q, k))`` after the torch op. Each call is preceded by the torch op or the sleep, so
caches are partly cold: these times are higher than those of back-to-back calls. Measurements, not
assertions: bench/results/README.md ("Sharing the CPU with torch") records them with the machine
they came from. ``OMP_WAIT_POLICY`` must be set before torch is imported, hence the environment variable.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fastpe


def _summary(times: list[float]) -> str:
    times = sorted(times)
    return f"{statistics.median(times) * 1e3:.2f} ms (p90 {times[int(0.9 * len(times))] * 1e3:.2f})"


def _timed(fn, before, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--calls", type=int, default=150)
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    torch.manual_seed(0)
    q = torch.randn(1, 32, 1, 128)
    k, v = torch.randn(1, 8, 512, 128), torch.randn(1, 8, 512, 128)
    k_new = torch.randn(1, 8, 1, 128)
    w, x = torch.randn(1024, 1024), torch.randn(16, 1024)
    cos, sin = fastpe.rope_table(4096, 128, device="cpu")
    position = torch.tensor([[700]])

    def torch_op():
        return x @ w

    def idle():
        time.sleep(0.005)

    def attention():
        return fastpe.attention(q, k, v, causal=True)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def rope():
        return fastpe.apply_rope((q, k_new), cos, sin, positions=position)

    for fn in (attention, sdpa, rope):  # compile / warm up
        fn()
    n = args.calls
    print(
        f"torch threads {torch.get_num_threads()} | fastpe attention after a torch op "
        f"{_summary(_timed(attention, torch_op, n))} | after 5 ms idle "
        f"{_summary(_timed(attention, idle, n))} | SDPA after a torch op "
        f"{_summary(_timed(sdpa, torch_op, n))} | apply_rope((q, k)) after a torch op "
        f"{_summary(_timed(rope, torch_op, n))}"
    )


if __name__ == "__main__":
    main()
