"""Spawning the processes that every test of tests/distributed shares (conftest.py): 4 processes,
forked once, that run phases of cases, each phase on its own gloo group of some of them, and
write each case's outcome to a file per rank. A hang fails: each group has a timeout, and
``spawn_group`` kills the workers after its own."""

from __future__ import annotations

import dataclasses
import multiprocessing.forkserver
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import fastpe

SPAWN_TIMEOUT_S = 240  # every phase, start-up included; a hang fails here
GROUP_TIMEOUT_S = 60  # a phase's default: any single collective or point-to-point op

# The workers are forked by a server that has imported these once (seconds each: torch, fastpe's
# Numba kernels, torch._dynamo, which a custom op's first autograd call imports) instead of each
# importing them anew; the server runs nothing else, so no thread of its dies in the fork.
PRELOAD = [
    "_spawn",
    "test_distributed",
    "test_distributed_errors",
    "fastpe.torch_ops",
    "fastpe.kernels.numba.attention",
    "fastpe.kernels.numba.attention_backward",
    "fastpe.kernels.numba.apply_rope",
    "torch._dynamo",
]


@dataclasses.dataclass(frozen=True)
class Phase:
    """Cases that the spawned processes of ``ranks`` run on a group of their own (the default
    group when they are all of them), with ``run(case, rank, world, group) -> tensors``, where
    ``rank`` is the process's rank in the group. Every process creates every phase's group and
    runs the phases it belongs to in their order, so phases of disjoint ranks run at once."""

    ranks: tuple
    cases: list
    run: object
    timeout_s: float = GROUP_TIMEOUT_S


def _worker(rank, world, init_method, phases, outdir):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    groups = [  # new_group is collective: every process creates every group, in the same order
        None
        if phase.ranks == tuple(range(world))
        else dist.new_group(list(phase.ranks), timeout=timedelta(seconds=phase.timeout_s))
        for phase in phases
    ]
    results = {}
    for phase, group in zip(phases, groups, strict=True):
        if rank not in phase.ranks:
            continue
        for case in phase.cases:
            try:
                outputs = phase.run(case, phase.ranks.index(rank), len(phase.ranks), group)
                results[case["name"]] = ("ok", *(x.detach() for x in outputs))
            except Exception as exc:  # the test process judges every outcome
                results[case["name"]] = ("error", type(exc).__name__, str(exc))
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def spawn_group(world, phases, tmp_path, timeout=SPAWN_TIMEOUT_S):
    """Run ``phases`` on a fresh gloo group of ``world`` processes; returns per-rank results
    (case name -> outcome). Workers still running after ``timeout`` seconds are killed and the
    test fails."""
    names = [case["name"] for phase in phases for case in phase.cases]
    assert len(set(names)) == len(names), "case names must be unique across the phases"
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    env = {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}  # N processes share the cores
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:  # the server (and every worker it forks) keeps the environment it starts with
        multiprocessing.forkserver.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
    warm_numba()  # while the server imports
    # a file store, not a TCP port picked beforehand: another process (the other test worker)
    # may take a free port between the pick and rank 0's listen
    init_method = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        ctx.Process(target=_worker, args=(r, world, init_method, phases, str(tmp_path)))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    assert not hung, f"ranks {hung} of {world} did not finish within {timeout} s"
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"worker exit codes {codes}"
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def members(results, phase) -> list:
    """The results of ``phase``'s processes, in the order of their ranks in its group."""
    return [results[r] for r in phase.ranks]


def warm_numba():
    """Compile (or load) the Numba kernels the workers use once, here, so that N workers load
    them from the disk cache instead of all compiling at once (the backward's too: every worker
    runs a backward in the first phase)."""
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    for opts in (
        {},
        {
            "causal": True,
            "key_lengths": torch.tensor([3]),
            "mask": torch.zeros(1, 2, 4, 4),
            "rope": {
                "cos": torch.ones(8, 4),
                "sin": torch.zeros(8, 4),
                "q_positions": torch.arange(4),
                "k_positions": torch.arange(4),
            },
        },
    ):
        out, lse = fastpe.attention(q, q, q, return_lse=True, **opts)
        torch.autograd.backward([out, lse], [torch.ones_like(out), torch.ones_like(lse)])
