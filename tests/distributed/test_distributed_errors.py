"""fastpe.distributed when one rank's choice differs: a backend that rank cannot use (a bad name
in ``backend=`` or ``$FASTPE_BACKEND``, or a backend that cannot run its inputs) and options or
gradient recording that differ between ranks. Every rank must raise, naming the rank and the
value; none may wait for the others.

The cases run on ranks 2 and 3 of the spawned run (conftest.py), on a group whose timeout is a
few seconds (far below test_distributed.py's), so a rank left waiting raises a timeout error
here instead of the agreed one: the test fails without hanging.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from _spawn import Phase, members  # noqa: E402
from test_distributed import _case, _full_inputs, _split  # noqa: E402

from fastpe import distributed as fd  # noqa: E402

GROUP_TIMEOUT_S = 5  # a rank left waiting times out long before the spawn's deadline
BAD_RANK = 1

CASES = [
    # a backend name that does not exist, on one rank only, through the env var or the argument
    _case("ring_env", causal=True, bad=("env", "bogus")),
    _case("ring_arg", causal=True, bad=("arg", "bogus")),
    _case("all_gather_env", fn="all_gather", bad=("env", "bogus")),
    _case("all_gather_arg", fn="all_gather", bad=("arg", "bogus")),
    _case("decode_env", fn="decode", seqs=[12, 12], bad=("env", "bogus")),
    _case("decode_arg", fn="decode", seqs=[12, 12], bad=("arg", "bogus")),
    # a real backend that cannot run this rank's inputs (Triton's attention has no float64)
    _case("ring_unsupported", dtype="float64", bad=("arg", "triton")),
    # options that differ on one rank
    _case("window_differs", causal=True, window=(5, 0), differs="window"),
    _case("softcap_differs", softcap=2.0, differs="softcap"),
    _case("dtype_differs", differs="dtype"),
    _case("interleaved_differs", rope=True, differs="interleaved"),
    _case("decode_softcap_differs", fn="decode", seqs=[12, 12], softcap=2.0, differs="softcap"),
    # autograd records on one rank only: that rank's backward would wait for the others
    _case("grad_differs", causal=True, differs="grad"),
    _case("all_gather_grad_differs", fn="all_gather", differs="grad"),
    _case("still_works_after_errors", causal=True, layout="zigzag"),
]


def _run(case, rank, world, group):
    q, k, v, opts = _full_inputs(case)
    opts["group"] = group
    mine = rank == BAD_RANK
    backend = None
    if mine and case.get("bad"):
        how, value = case["bad"]
        if how == "env":
            os.environ["FASTPE_BACKEND"] = value
        else:
            backend = value
    differs = case.get("differs") if mine else None
    if differs == "window":
        opts["window"] = (3, 0)
    if differs == "softcap":
        opts["softcap"] = 3.0
    if differs == "dtype":
        q, k, v = q.double(), k.double(), v.double()
    if differs == "interleaved":
        opts["rope"]["interleaved"] = True
    try:
        if case["fn"] == "decode":
            ks, vs = (x.split(case["seqs"], dim=2)[rank] for x in (k, v))
            extra = {key: opts[key] for key in ("softcap",) if key in opts}
            out = fd.sharded_kv_decode_attention(
                q[:, :, -1:], ks, vs, backend=backend, group=group, **extra
            )
            return (out,)
        qs, ks, vs = (_split(x, case, rank, world) for x in (q, k, v))
        fn = {"ring": fd.ring_attention, "all_gather": fd.all_gather_attention}[case["fn"]]
        if case.get("differs") == "grad" and rank != BAD_RANK:
            qs, ks, vs = (x.requires_grad_(True) for x in (qs, ks, vs))
            out = fn(qs, ks, vs, backend=backend, **opts)
            out.sum().backward()
            return out, qs.grad
        return (fn(qs, ks, vs, backend=backend, **opts),)
    finally:
        os.environ.pop("FASTPE_BACKEND", None)


ERRORS = Phase((2, 3), CASES, run=_run, timeout_s=GROUP_TIMEOUT_S)
PHASES = [ERRORS]  # this file's phase of the spawned run (conftest.py)


@pytest.fixture(scope="module")
def outcomes(spawned):
    results = members(spawned, ERRORS)
    return {case["name"]: [r[case["name"]] for r in results] for case in CASES}


@pytest.mark.parametrize("name", ["ring", "all_gather", "decode"])
@pytest.mark.parametrize("how", ["env", "arg"])
def test_a_bad_backend_on_one_rank_raises_on_every_rank(outcomes, name, how):
    bad, other = outcomes[f"{name}_{how}"][BAD_RANK], outcomes[f"{name}_{how}"][1 - BAD_RANK]
    source = "$FASTPE_BACKEND" if how == "env" else "backend"
    assert bad[:2] == ("error", "ValueError"), bad
    assert f"{source} must be one of numpy, numba, triton" in bad[2] and "'bogus'" in bad[2], bad
    assert other[:2] == ("error", "ValueError"), other
    assert f"rank {BAD_RANK} of the process group rejected its inputs" in other[2], other
    assert "'bogus'" in other[2], other


def test_a_backend_that_cannot_run_on_one_rank_raises_on_every_rank(outcomes):
    bad, other = outcomes["ring_unsupported"][BAD_RANK], outcomes["ring_unsupported"][1 - BAD_RANK]
    for outcome in (bad, other):
        assert outcome[:2] == ("error", "BackendNotSupportedError"), outcome
        assert "backend 'triton' cannot run attention" in outcome[2], outcome
        assert "float64" in outcome[2], outcome
    assert f"rank {BAD_RANK} of the process group" in other[2], other


@pytest.mark.parametrize(
    "name, what",
    [
        ("window_differs", "options"),
        ("softcap_differs", "options"),
        ("dtype_differs", "dtype"),
        ("interleaved_differs", "options"),
        ("decode_softcap_differs", "scale, softcap and sinks"),
        ("grad_differs", "gradient recording"),
        ("all_gather_grad_differs", "gradient recording"),
    ],
)
def test_an_option_that_differs_on_one_rank_raises_on_every_rank(outcomes, name, what):
    for outcome in outcomes[name]:
        assert outcome[:2] == ("error", "ValueError"), outcome
        assert "every rank must pass the same" in outcome[2] and what in outcome[2], outcome
        assert f"rank {BAD_RANK} has" in outcome[2], outcome


def test_the_group_still_works_after_the_errors(outcomes):
    for outcome in outcomes["still_works_after_errors"]:
        assert outcome[0] == "ok", outcome


# both files share one spawned process group (conftest.py): under pytest-xdist, one worker
pytestmark = pytest.mark.xdist_group("distributed")
