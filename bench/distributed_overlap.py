"""Ring attention: overlap of transfer and compute, and balance of the layouts (issue 17).

Run on N processes with torchrun (gloo on CPU):

    NUMBA_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 2 \
        bench/distributed_overlap.py --batch 1 --heads 8 --seq 4096 --dim 64 --causal

Rank 0 prints, per layout, the slowest rank's median time of: one ``ring_attention`` call
(validation included); the ring loop alone, with each transfer overlapping the current block
(as ``ring_attention`` runs it) and serial (each transfer waited for before computing); the same
blocks with every K/V shard already present (compute only); one ring step's transfer alone; and
the balance (slowest rank's compute only / mean over ranks); and the same for the backward: the
ring backward (K/V and the dK/dV accumulators travelling) against its blocks' backward with
every shard present. Measurements, not
assertions: docs/distributed.md records them with the machine they came from.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from fastpe import distributed as fd
from fastpe.distributed import _ring
from fastpe.distributed._api import Options
from fastpe.distributed._group import Group, ring_exchange, wait
from fastpe.distributed._plan import Plan


def _median_times(fns: dict, repeats: int) -> dict:
    """Median wall time of each callable; the callables take turns in every round, so a busy
    spell on this shared machine falls on all of them rather than on one."""
    times = {name: [] for name in fns}
    names = list(fns)
    for round_ in range(repeats):
        # a different one goes first in each round (the first after a pause runs slower here)
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            fn = fns[name]
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    hkv = args.kv_heads or args.heads
    q = torch.randn(args.batch, args.heads, args.seq, args.dim, generator=g)
    k = torch.randn(args.batch, hkv, args.seq, args.dim, generator=g)
    v = torch.randn(args.batch, hkv, args.seq, args.dim, generator=g)
    shard_bytes = 2 * k.numel() * k.element_size() // world

    lines = []
    for layout in fd.LAYOUTS:
        qs, ks, vs = (fd.shard_sequence(x, rank, world, layout=layout) for x in (q, k, v))
        plan = Plan(
            Group(None),
            qs,
            ks,
            vs,
            Options("bench", causal=args.causal),
            layout=layout,
            backend=None,
        )
        # every rank's K/V shard already here: the same blocks with no transfer at all
        shards = [
            fd.shard_sequence(x, r, world, layout=layout) for r in range(world) for x in (k, v)
        ]

        def call(qs=qs, ks=ks, vs=vs, layout=layout):  # the public call, validation included
            fd.ring_attention(qs, ks, vs, causal=args.causal, layout=layout)

        def ring(qs=qs, ks=ks, vs=vs, plan=plan, overlap=True):
            _ring.ring_loop(plan.g, plan, qs, ks, vs, None, overlap=overlap)

        def compute(qs=qs, plan=plan, shards=shards):
            b, h, n = qs.shape[:3]
            acc_out = torch.zeros((b, h, n, args.dim))
            acc_lse = torch.full((b, h, n), -math.inf)
            for step in range(world):
                source = (rank - step) % world
                kk, vv = shards[2 * source], shards[2 * source + 1]
                _ring.ring_compute(plan, qs, kk, vv, acc_out, acc_lse, source, None)

        def transfer(ks=ks, vs=vs, plan=plan):
            kv = (ks.contiguous(), vs.contiguous())
            coming = tuple(torch.empty_like(t) for t in kv)
            wait(ring_exchange(plan.g, send=kv, receive=coming, tag=_ring.KV_TAG))

        # the backward: the ring pass (K/V and the dK/dV accumulators travelling), and the same
        # blocks' backward with every shard present
        out, lse = _ring.ring_loop(plan.g, plan, qs, ks, vs, None)
        grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
        saved = (qs, ks, vs, out, lse, grad_out, grad_lse)

        def ring_backward(plan=plan, saved=saved):
            _ring.ring_backward(plan.g, plan, *saved, None)

        def compute_backward(plan=plan, saved=saved, shards=shards):
            dq = torch.zeros(saved[0].shape)
            for step in range(world):
                source = (rank - step) % world
                kv = (shards[2 * source], shards[2 * source + 1])
                grads = tuple(torch.zeros_like(t) for t in kv)
                _ring.ring_backward_compute(plan, source, saved[0], kv, *saved[3:], dq, grads, None)

        call()  # warm-up: Numba loads its kernels
        ring_backward()
        timings = _median_times(
            {
                "call": call,
                "ring": ring,
                "serial": lambda ring=ring: ring(overlap=False),
                "compute": compute,
                "transfer": transfer,
                "ring_backward": ring_backward,
                "compute_backward": compute_backward,
            },
            args.repeats,
        )
        per_rank = [None] * world
        dist.all_gather_object(per_rank, timings)
        if rank == 0:
            slowest = {key: max(t[key] for t in per_rank) * 1e3 for key in timings}
            computes = [t["compute"] * 1e3 for t in per_rank]
            lines.append(
                f"{layout}: ring_attention {slowest['call']:.1f} ms | ring loop "
                f"{slowest['ring']:.1f} ms overlapped, {slowest['serial']:.1f} ms serial | "
                f"compute only {slowest['compute']:.1f} ms (per rank "
                f"{', '.join(f'{c:.1f}' for c in computes)}) | one transfer "
                f"{slowest['transfer']:.1f} ms ({shard_bytes / 2**20:.1f} MiB)\n"
                f"    ring/compute {slowest['ring'] / slowest['compute']:.3f}  "
                f"serial/compute {slowest['serial'] / slowest['compute']:.3f}  "
                f"balance slowest/mean {max(computes) / statistics.mean(computes):.3f}\n"
                f"    backward: ring {slowest['ring_backward']:.1f} ms, compute only "
                f"{slowest['compute_backward']:.1f} ms, ring/compute "
                f"{slowest['ring_backward'] / slowest['compute_backward']:.3f}"
            )
    if rank == 0:
        print(
            f"B{args.batch} H{args.heads}/{hkv} S{args.seq} D{args.dim} "
            f"{'causal' if args.causal else 'non-causal'} float32, {world} ranks (gloo), "
            f"median of {args.repeats}"
        )
        print("\n".join(lines))
    dist.barrier()  # no rank tears down its gloo pairs while the other still uses them
    dist.destroy_process_group()
    # Once in a while under load a rank aborted after this point ("terminate called without an
    # active exception": a gloo thread still joinable as the interpreter's C++ objects are
    # destroyed). Everything is printed and torn down: leave without running those destructors.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
