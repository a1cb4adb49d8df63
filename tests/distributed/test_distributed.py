"""fastpe.distributed on real gloo process groups of 1, 2 and 4 ranks (torch.multiprocessing).

Four processes are spawned once for every test of this folder (_spawn.py: starting one costs
seconds of torch, torch._dynamo and Numba's kernels) and run phases of cases, each phase on its
own group of some of them (``Phase``); every rank writes its output shards (or the error it
raised) to a file, and the test process compares the unsharded result with ``fastpe.attention``
on the unsharded inputs computed by the float64 oracle. A hang fails: each group has a timeout
and the spawn helper kills its workers after its own.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

import fastpe

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from _spawn import SPAWN_TIMEOUT_S, Phase, members  # noqa: E402

from fastpe import distributed as fd  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Cases: one dict each; the same function builds the full inputs in the workers and here.


def _case(name, **spec):
    base = dict(
        fn="ring",
        b=2,
        hq=4,
        hkv=4,
        s=24,
        d=8,
        dv=8,
        causal=False,
        layout="contiguous",
        seqs=None,
        key_lengths=None,
        rope=False,
        rope_rows=None,
        alibi=False,
        error=None,
        subgroups=False,
        dtype="float32",
        grad=False,
        window=None,
        softcap=None,
        sinks=False,
    )
    base.update(spec)
    base["name"] = name
    return base


def _full_inputs(case):
    g = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
    b, hq, hkv, s, d, dv = (case[k] for k in ("b", "hq", "hkv", "s", "d", "dv"))
    q = torch.randn(b, hq, s, d, generator=g)
    k = torch.randn(b, hkv, s, d, generator=g)
    v = torch.randn(b, hkv, s, dv, generator=g)
    opts = {"causal": case["causal"]}
    if case["key_lengths"] is not None:
        lengths = torch.tensor(case["key_lengths"])
        opts["key_lengths"] = lengths
        for i, n in enumerate(case["key_lengths"]):  # padding must never be read
            k[i, :, n:] = math.nan
            v[i, :, n:] = math.nan
    if case["rope"]:
        inv = 1.0 / 100.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.arange(case["rope_rows"] or s + 3, dtype=torch.float64)[:, None] * inv[None]
        opts["rope"] = {"cos": angles.cos().float(), "sin": angles.sin().float()}
    for key in ("window", "softcap"):
        if case[key] is not None:
            opts[key] = case[key]
    if case["sinks"]:
        opts["sinks"] = torch.linspace(-1.0, 2.0, hq)
    if case["alibi"]:
        opts["alibi_slopes"] = torch.tensor([2.0 ** -(h + 1) for h in range(hq)])
    dtype = getattr(torch, case["dtype"])
    return q.to(dtype), k.to(dtype), v.to(dtype), opts


def _split(x, case, rank, world):
    if case["seqs"] is not None:
        return x.split(case["seqs"], dim=2)[rank]
    return fd.shard_sequence(x, rank, world, layout=case["layout"])


def _unsplit(shards, case):
    if case["seqs"] is not None:
        return torch.cat(shards, dim=2)
    return fd.unshard_sequence(shards, layout=case["layout"])


def _run_case(case, rank, world, group):
    """This rank's outputs for ``case`` on ``group`` (None: the default group), of which it is
    rank ``rank`` of ``world``."""
    q, k, v, opts = _full_inputs(case)
    if group is not None:
        opts["group"] = group
    if case["fn"] == "decode":
        q = q[:, :, -1:]  # the same query on every rank, the cache sharded unevenly
        if case["error"] == "decode_q_differs" and rank == 1:
            q = torch.cat([q, q], dim=2)
        lengths = opts.get("key_lengths")
        start = sum(case["seqs"][:rank])
        ks, vs = k.split(case["seqs"], dim=2)[rank], v.split(case["seqs"], dim=2)[rank]
        cache_lengths = None if lengths is None else (lengths - start).clamp(0, case["seqs"][rank])
        if case["error"] == "grad":
            q.requires_grad_(True)
            out = fd.sharded_kv_decode_attention(
                q, ks, vs, cache_lengths=cache_lengths, group=group
            )
            out.sum().backward()
        extra = {key: opts[key] for key in ("softcap", "sinks", "group") if key in opts}
        return fd.sharded_kv_decode_attention(
            q, ks, vs, cache_lengths=cache_lengths, return_lse=True, **extra
        )
    if case["subgroups"]:  # two groups {0, 2} and {1, 3}: group ranks differ from global ranks
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates both
        group, rank, world = groups[rank % 2], rank // 2, 2
        opts["group"] = group
    qs, ks, vs = (_split(x, case, rank, world) for x in (q, k, v))
    error = case["error"]
    if error == "heads_differ" and rank == 1:
        qs, ks, vs = qs[:, :2], ks[:, :2], vs[:, :2]
    if error == "causal_differs" and rank == 1:
        opts["causal"] = not opts["causal"]
    if error == "numpy_on_one_rank" and rank == 1:
        qs = qs.numpy()
    if error == "mask_refused":
        opts["mask"] = torch.ones(qs.shape[2], ks.shape[2], dtype=torch.bool)
    if error == "relative_bias_refused":
        opts["relative_bias"] = {"table": torch.zeros(32, case["hq"])}
    if error == "table_requires_grad":
        opts["rope"]["cos"].requires_grad_(True)
    if error == "rope_positions_refused":
        opts["rope"]["k_positions"] = 0
    fn = {"ring": fd.ring_attention, "all_gather": fd.all_gather_attention}[case["fn"]]
    if not case["grad"]:
        return fn(qs, ks, vs, layout=case["layout"], return_lse=True, **opts)
    leaves = [x.detach().requires_grad_(True) for x in (qs, ks, vs)]
    if case["sinks"]:
        opts["sinks"] = opts["sinks"].requires_grad_(True)
        leaves.append(opts["sinks"])
    out, lse = fn(*leaves[:3], layout=case["layout"], return_lse=True, **opts)
    grad_out, grad_lse = (_split(x, case, rank, world) for x in _output_grads(case))
    torch.autograd.backward([out, lse], [grad_out.to(out.dtype), grad_lse[..., 0]])
    return out, lse, *(x.grad for x in leaves)


def _output_grads(case):
    """Random gradients of the full (out, lse), the same in the workers and in the reference."""
    g = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()) + 1)
    b, hq, s, dv = (case[k] for k in ("b", "hq", "s", "dv"))
    return torch.randn(b, hq, s, dv, generator=g), torch.randn(b, hq, s, 1, generator=g)


def _reference(case):
    """(out, lse) of fastpe.attention on the unsharded inputs by the float64 oracle; for a case
    with ``grad``, also (dq, dk, dv[, dsinks]) of its backward under the same output gradients."""
    q, k, v, opts = _full_inputs(case)
    if case["fn"] == "decode":
        q = q[:, :, -1:]
        opts["causal"] = False
    q, k, v = (x.double() for x in (q, k, v))  # bfloat16 values are exact in float64
    if case["fn"] != "decode":  # a sharded sequence: every query at its global position
        opts["causal_alignment"] = "top_left"
    if not case["grad"]:
        return fastpe.attention(q, k, v, return_lse=True, backend="numpy", **opts)
    leaves = [x.requires_grad_(True) for x in (q, k, v)]
    if case["sinks"]:
        opts["sinks"] = opts["sinks"].double().requires_grad_(True)
        leaves.append(opts["sinks"])
    out, lse = fastpe.attention(*leaves[:3], return_lse=True, backend="numpy", **opts)
    grad_out, grad_lse = _output_grads(case)
    torch.autograd.backward([out, lse], [grad_out.double(), grad_lse[..., 0].double()])
    return out.detach(), lse.detach(), *(x.grad for x in leaves)


def _check(results, cases, world):
    for case in cases:
        outcomes = [r[case["name"]] for r in results]
        if case["error"] is not None:
            continue
        for rank, outcome in enumerate(outcomes):
            assert outcome[0] == "ok", f"{case['name']} rank {rank}: {outcome}"
        ref_out, ref_lse, *ref_grads = _reference(case)  # the grads: only for grad cases
        if case["fn"] == "decode":  # every rank holds the whole result
            for _, out, lse in outcomes:
                _assert_close(case, out, lse, ref_out, ref_lse)
            continue
        members = [[0, 2], [1, 3]] if case["subgroups"] else [list(range(world))]
        for ranks in members:
            out = _unsplit([outcomes[r][1] for r in ranks], case)
            lse = _unsplit([outcomes[r][2][..., None] for r in ranks], case)[..., 0]
            _assert_close(case, out, lse, ref_out, ref_lse)
            for i, (name, ref) in enumerate(zip(("dq", "dk", "dv"), ref_grads, strict=False)):
                grad = _unsplit([outcomes[r][3 + i] for r in ranks], case)
                _assert_grad_close(case, name, grad, ref)
            if case["sinks"] and case["grad"]:  # a parameter: each rank has its rows' part
                grad = sum(outcomes[r][6] for r in ranks)
                _assert_grad_close(case, "dsinks", grad, ref_grads[3])


def _assert_close(case, out, lse, ref_out, ref_lse):
    name = case["name"]
    assert out.dtype == getattr(torch, case["dtype"]) and lse.dtype == torch.float32, name
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), name
    # bfloat16: each block's output is rounded to bfloat16 (2^-9 relative) before the float32
    # merge, and the result once more
    atol, rtol = (2e-6, 1e-5) if case["dtype"] == "float32" else (2e-2, 1e-2)
    np.testing.assert_allclose(
        out.double().numpy(), ref_out.double().numpy(), rtol=rtol, atol=atol, err_msg=name
    )
    ref_lse = ref_lse.double().numpy()
    lse = lse.double().numpy()
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), name
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5, err_msg=name)


def _assert_grad_close(case, name, grad, ref):
    what = f"{case['name']} {name}"
    assert grad.dtype == getattr(torch, case["dtype"]), what
    # the float32 kernels against float64; bfloat16 as _assert_close, plus the inputs' rounding
    # of each block's gradient before the float32 sums
    atol, rtol = (2e-5, 1e-4) if case["dtype"] == "float32" else (5e-2, 2e-2)
    np.testing.assert_allclose(
        grad.double().numpy(), ref.double().numpy(), rtol=rtol, atol=atol, err_msg=what
    )


def _errors(results, case):
    return [r[case["name"]] for r in results]


# ---------------------------------------------------------------------------------------------
# The groups

CASES_2 = [
    _case("plain"),
    _case("causal", causal=True),
    _case("causal_uneven", causal=True, seqs=[17, 7]),
    _case("uneven_noncausal_gqa", hq=6, hkv=2, seqs=[5, 19], dv=5),
    _case("zigzag_causal", causal=True, layout="zigzag"),
    _case(
        "zigzag_everything",
        causal=True,
        layout="zigzag",
        hq=4,
        hkv=2,
        rope=True,
        alibi=True,
        key_lengths=[19, 0],
    ),
    _case("causal_padding_rope", causal=True, key_lengths=[10, 24], rope=True, seqs=[9, 15]),
    _case("alibi_noncausal", alibi=True, seqs=[13, 11]),
    _case(
        "bf16_zigzag",
        causal=True,
        layout="zigzag",
        hkv=2,
        rope=True,
        alibi=True,
        key_lengths=[22, 5],
        dtype="bfloat16",
    ),
    _case("zigzag_noncausal", layout="zigzag", alibi=True, rope=True, key_lengths=[20, 9]),
    _case(
        "all_gather_zigzag",
        fn="all_gather",
        causal=True,
        layout="zigzag",
        hkv=1,
        rope=True,
        alibi=True,
        key_lengths=[21, 4],
    ),
    _case("all_gather_uneven", fn="all_gather", causal=True, seqs=[15, 9], hkv=2, alibi=True),
    _case("all_gather_noncausal", fn="all_gather", seqs=[3, 21], key_lengths=[24, 2], rope=True),
    _case("decode", fn="decode", hq=8, hkv=2, seqs=[30, 11], s=41, key_lengths=[35, 20]),
    _case(
        "decode_sinks_softcap",
        fn="decode",
        hkv=2,
        seqs=[9, 15],
        key_lengths=[24, 0],
        sinks=True,
        softcap=2.5,
    ),
    # sliding windows (global distances) and soft-capping
    _case("window_causal_uneven", causal=True, seqs=[15, 9], window=(5, 0), alibi=True),
    _case(
        "window_zigzag",
        causal=True,
        layout="zigzag",
        hkv=2,
        window=(4, 0),
        rope=True,
        key_lengths=[20, 7],
        softcap=3.0,
    ),
    _case("window_both_sides", seqs=[7, 17], window=(3, 6), softcap=2.0, hkv=1),
    # a window wider than rank 0's shard but not than the sequence
    _case("window_wider_than_a_shard", causal=True, seqs=[4, 20], window=(9, 0)),
    _case(
        "window_all_gather",
        fn="all_gather",
        causal=True,
        layout="zigzag",
        window=(6, 0),
        alibi=True,
    ),
    _case("window_all_gather_right", fn="all_gather", seqs=[11, 13], window=(-1, 2)),
    # attention sinks (gpt-oss): one extra logit per head, joined once per query row
    _case(
        "sinks_zigzag",
        causal=True,
        layout="zigzag",
        hkv=2,
        sinks=True,
        window=(5, 0),
        key_lengths=[24, 0],
    ),
    _case("sinks_all_gather", fn="all_gather", seqs=[10, 14], sinks=True, key_lengths=[3, 24]),
    # error cases
    _case("heads_differ", error="heads_differ"),
    _case("causal_differs", error="causal_differs"),
    _case("numpy_on_one_rank", error="numpy_on_one_rank"),
    _case("zigzag_uneven", layout="zigzag", seqs=[10, 14], error="zigzag_uneven"),
    _case("zigzag_odd", layout="zigzag", seqs=[11, 11], s=22, error="zigzag_odd"),
    _case("decode_grad", fn="decode", seqs=[12, 12], error="grad"),
    _case("mask_refused", error="mask_refused"),
    _case("relative_bias_refused", error="relative_bias_refused"),
    _case("rope_positions_refused", rope=True, error="rope_positions_refused"),
    _case("table_requires_grad", fn="all_gather", rope=True, error="table_requires_grad"),
    _case("key_lengths_too_long", key_lengths=[25, 3], error="key_lengths_too_long"),
    _case("rope_table_too_short", rope=True, rope_rows=20, error="rope_table_too_short"),
    _case("decode_q_differs", fn="decode", seqs=[12, 12], error="decode_q_differs"),
    _case("after_errors_still_works", causal=True, layout="zigzag", hkv=2),
]

CASES_4 = [
    _case("causal_uneven4", causal=True, seqs=[7, 3, 9, 5]),
    _case(
        "zigzag4",
        causal=True,
        layout="zigzag",
        s=32,
        hq=4,
        hkv=2,
        rope=True,
        alibi=True,
        key_lengths=[29, 6],
    ),
    _case("noncausal4", s=23, rope=True, key_lengths=[23, 12]),
    _case("all_gather4", fn="all_gather", causal=True, layout="zigzag", s=32, hkv=1),
    _case("subgroups4", causal=True, layout="zigzag", subgroups=True, hkv=2),
    _case("decode4", fn="decode", seqs=[5, 9, 1, 6], s=21, key_lengths=[21, 7]),
    _case("window4", causal=True, seqs=[6, 6, 7, 5], window=(4, 0), rope=True),
    _case(
        "window_zigzag4", causal=True, layout="zigzag", s=32, window=(9, 0), softcap=5.0, sinks=True
    ),
    _case("heads_differ4", error="heads_differ"),
]


def _with_grad(cases, names):
    """Gradient twins of the named cases: the same inputs, and backward() on every rank with
    random gradients of out and lse, compared with the oracle's backward (dq, dk, dv)."""
    picked = [c for c in cases if c["name"] in names]
    assert len(picked) == len(names), names
    return [{**c, "grad": True, "name": f"grad_{c['name']}"} for c in picked]


CASES_2 += _with_grad(
    CASES_2,
    [
        "causal_uneven",
        "uneven_noncausal_gqa",
        "zigzag_everything",
        "causal_padding_rope",
        "bf16_zigzag",
        "all_gather_zigzag",
        "all_gather_uneven",
        "window_zigzag",
        "window_both_sides",
        "window_all_gather",
        "sinks_zigzag",
        "sinks_all_gather",
    ],
)
CASES_4 += _with_grad(
    CASES_4, ["causal_uneven4", "zigzag4", "noncausal4", "all_gather4", "window4", "window_zigzag4"]
)


CASES_1 = [
    _case("one_rank_zigzag", causal=True, layout="zigzag", rope=True, grad=True),
    _case("one_rank_all_gather", fn="all_gather", hkv=2, alibi=True, grad=True),
]

# This file's phases of the spawned run (conftest.py), which has 4 processes: CASES_4 on all of
# them, then CASES_2 on ranks 0 and 1 (while test_distributed_errors.py's run on ranks 2 and 3),
# then CASES_1 on rank 0 alone.
GROUP4 = Phase((0, 1, 2, 3), CASES_4, _run_case)
GROUP2 = Phase((0, 1), CASES_2, _run_case)
GROUP1 = Phase((0,), CASES_1, _run_case)
PHASES = [GROUP4, GROUP2, GROUP1]


@pytest.fixture(scope="module")
def group2(spawned):
    return members(spawned, GROUP2)


@pytest.fixture(scope="module")
def group4(spawned):
    return members(spawned, GROUP4)


def test_a_group_of_one_rank_is_plain_attention(spawned):
    _check(members(spawned, GROUP1), CASES_1, 1)


def test_two_ranks_equal_single_process(group2):
    _check(group2, CASES_2, 2)


def test_four_ranks_equal_single_process(group4):
    _check(group4, CASES_4, 4)


def _by_name(cases, name):
    return next(c for c in cases if c["name"] == name)


def test_mismatched_shapes_raise_on_every_rank(group2, group4):
    for results, name in ((group2, "heads_differ"), (group4, "heads_differ4")):
        outcomes = [r[name] for r in results]
        for rank, outcome in enumerate(outcomes):
            assert outcome[0] == "error" and outcome[1] == "ValueError", (rank, outcome)
            assert "every rank must pass the same shapes" in outcome[2], outcome
            assert "(2, 4, 8)" in outcome[2] and "(2, 2, 8)" in outcome[2], outcome


def test_mismatched_options_and_local_errors_raise_on_every_rank(group2):
    for outcome in _errors(group2, _by_name(CASES_2, "causal_differs")):
        assert outcome[:2] == ("error", "ValueError") and "options" in outcome[2], outcome
    rank0, rank1 = _errors(group2, _by_name(CASES_2, "numpy_on_one_rank"))
    assert rank1[:2] == ("error", "TypeError") and "got q: ndarray" in rank1[2], rank1
    assert rank0[:2] == ("error", "TypeError") and "rank 1" in rank0[2], rank0


def test_zigzag_needs_equal_even_shards(group2):
    for name in ("zigzag_uneven", "zigzag_odd"):
        for outcome in _errors(group2, _by_name(CASES_2, name)):
            assert outcome[:2] == ("error", "ValueError"), outcome
            assert "zigzag" in outcome[2] and "2 x world_size = 4" in outcome[2], outcome


def test_global_ranges_are_checked_against_the_whole_sequence(group2):
    for outcome in _errors(group2, _by_name(CASES_2, "key_lengths_too_long")):
        assert outcome[:2] == ("error", "IndexError"), outcome
        assert "key_lengths contains 25" in outcome[2] and "global sequence length 24" in outcome[2]
    for outcome in _errors(group2, _by_name(CASES_2, "rope_table_too_short")):
        assert outcome[:2] == ("error", "IndexError"), outcome
        assert "20 rows" in outcome[2] and "go up to 23" in outcome[2], outcome


def test_decode_queries_must_match_across_ranks(group2):
    for outcome in _errors(group2, _by_name(CASES_2, "decode_q_differs")):
        assert outcome[:2] == ("error", "ValueError") and "same q shape" in outcome[2], outcome
        assert "(2, 4, 1, 8)" in outcome[2] and "(2, 4, 2, 8)" in outcome[2], outcome


def test_options_without_a_global_meaning_are_refused(group2):
    expected = {
        "mask_refused": "does not take mask",
        "relative_bias_refused": "does not support relative_bias (T5)",
        "rope_positions_refused": "rope['k_positions'] cannot be given to ring_attention",
        "table_requires_grad": "all_gather_attention gives no gradient for rope['cos']",
    }
    for name, message in expected.items():
        for outcome in _errors(group2, _by_name(CASES_2, name)):
            assert outcome[:2] == ("error", "ValueError") and message in outcome[2], outcome


def test_decode_backward_raises_the_no_backward_error(group2):
    for outcome in _errors(group2, _by_name(CASES_2, "decode_grad")):
        assert outcome[:2] == ("error", "RuntimeError"), outcome
        assert "distributed.sharded_kv_decode_attention has no backward" in outcome[2], outcome
        assert "torch.no_grad()" in outcome[2], outcome


# ---------------------------------------------------------------------------------------------
# Without a group


def test_missing_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    q = torch.zeros(1, 1, 4, 8)
    for fn in (fd.ring_attention, fd.all_gather_attention):
        with pytest.raises(RuntimeError, match="init_process_group"):
            fn(q, q, q)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.sharded_kv_decode_attention(q, q, q)


def _ring_steps(seqs, *, causal=True, layout="contiguous", window=None, key_lengths=None):
    """Plan.ring_steps on a plan built from its fields alone (no process group needed)."""
    import types

    from fastpe.distributed._api import BlockOptions
    from fastpe.distributed._plan import Plan, Span

    world = len(seqs)
    if layout == "zigzag":
        positions = [
            fd.shard_positions(sum(seqs), r, world, layout="zigzag").numpy() for r in range(world)
        ]
    else:
        starts = np.cumsum([0, *seqs])
        positions = [np.arange(a, b) for a, b in zip(starts[:-1], starts[1:], strict=True)]
    plan = Plan.__new__(Plan)  # its fields alone, without the agreement round
    plan.g, plan.seqs, plan.layout = types.SimpleNamespace(size=world), list(seqs), layout
    plan.options = BlockOptions(
        causal=causal, window=window, longest_key=None if key_lengths is None else max(key_lengths)
    )
    plan.positions = [Span(p, None) for p in positions]
    return plan.ring_steps


def test_the_ring_stops_once_every_window_is_covered():
    # causal, shards of 6, 6, 7, 5: a window of 5 keys reaches one shard back, 7 keys two
    assert _ring_steps([6, 6, 7, 5], window=(4, 0)) == 2
    assert _ring_steps([6, 6, 7, 5], window=(6, 0)) == 2  # key 5 from query 12: 7 back, too far
    assert _ring_steps([6, 6, 7, 5], window=(7, 0)) == 3
    assert _ring_steps([6, 6, 7, 5]) == 4  # causal without a window: rank 3 needs rank 0
    assert _ring_steps([6, 6, 7, 5], causal=False, window=(3, 2)) == 4  # rank 0 needs rank 1
    assert _ring_steps([6, 6, 6, 6], causal=False, key_lengths=[6, 3]) == 4
    # zigzag keeps early chunks away from each other: every rank needs every shard
    assert _ring_steps([8, 8, 8, 8], layout="zigzag", window=(2, 0)) == 4
    assert _ring_steps([8, 8], layout="zigzag", window=(2, 0)) == 2


def test_importing_the_module_does_not_import_torch():
    code = (
        "import sys, fastpe; d = fastpe.distributed; import fastpe.distributed as e; "
        "assert d is e and d.LAYOUTS == ('contiguous', 'zigzag'); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", fd.LAYOUTS)
def test_shard_helpers_partition_the_sequence(world, layout):
    s = 24
    x = torch.arange(s)[None, None, :, None].expand(2, 1, s, 3)
    shards = [fd.shard_sequence(x, r, world, layout=layout) for r in range(world)]
    positions = [fd.shard_positions(s, r, world, layout=layout) for r in range(world)]
    for shard, pos in zip(shards, positions, strict=True):
        assert torch.equal(shard[0, 0, :, 0], pos)  # the helper names the tokens it holds
        assert torch.all(pos[1:] > pos[:-1])
    assert sorted(torch.cat(positions).tolist()) == list(range(s))
    assert torch.equal(fd.unshard_sequence(shards, layout=layout), x)
    if layout == "zigzag":
        c = s // (2 * world)
        assert positions[0][:c].tolist() == list(range(c))
        assert positions[0][c:].tolist() == list(range(s - c, s))


@pytest.mark.slow
def test_overlap_benchmark_runs_under_torchrun():
    """bench/distributed_overlap.py (the measurements in docs/distributed.md) at a tiny size."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",  # torchrun picks its own free port
            "--nproc-per-node",
            "2",
            os.path.join(root, "bench", "distributed_overlap.py"),
            "--seq",
            "64",
            "--heads",
            "2",
            "--dim",
            "16",
            "--causal",
            "--repeats",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=SPAWN_TIMEOUT_S,
        env={**os.environ, "NUMBA_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "zigzag: ring_attention" in result.stdout and "balance slowest/mean" in result.stdout


def test_shard_helpers_errors():
    x = torch.zeros(1, 1, 10, 2)
    with pytest.raises(ValueError, match=r"not divisible by 8"):
        fd.shard_sequence(x, 0, 4, layout="zigzag")
    with pytest.raises(ValueError, match=r"not divisible by 4"):
        fd.shard_positions(10, 0, 2, layout="zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        fd.shard_positions(8, 0, 2, layout="ring")
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, world_size = 2\)"):
        fd.shard_sequence(x, 2, 2)
    with pytest.raises(ValueError, match="zigzag shards must all have one even length"):
        fd.unshard_sequence([x, x[:, :, :4]], layout="zigzag")


def test_contiguous_shards_match_tensor_split_for_uneven_lengths():
    for world in (2, 3, 4):
        s = 10
        expected = [len(c) for c in torch.arange(s).tensor_split(world)]
        assert [len(fd.shard_positions(s, r, world)) for r in range(world)] == expected


# both files share one spawned process group (conftest.py): under pytest-xdist, one worker
pytestmark = pytest.mark.xdist_group("distributed")
