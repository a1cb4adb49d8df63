"""The Triton kernels compiled ahead of time for real NVIDIA targets, without a GPU (issue 16):
they must compile, fit the target's shared memory, and no attention config the autotuner may
pick on sm_80/sm_90 may spill registers. The default run compiles a representative subset (bf16,
head dims 64 and 128, the causal and everything-on attention variants, sm_80 and sm_90); the
full sweep is ``slow``. Results are cached (~/.cache/fastpe/triton-aot), so a rerun only
compiles kernels whose source changed."""

from __future__ import annotations

import os

import pytest

from fastpe import triton_report as tr

_why = tr.unavailable()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"AOT compilation impossible: {_why}")

QUICK_TARGETS = (80, 90)


def _records(full: bool, targets):
    return tr.run(tr.plan(full=full, targets=targets), jobs=2, cache_dir=tr.default_cache_dir())


@pytest.fixture(scope="module")
def quick_records():
    return _records(False, QUICK_TARGETS)


def test_every_kernel_and_target_is_covered(quick_records):
    seen = {(r["case"]["kernel"], r["case"]["target"]) for r in quick_records}
    assert seen == {(k, t) for k in tr.KERNELS for t in QUICK_TARGETS}
    # the autotuner keeps at least one config for every attention shape on every target
    for target in QUICK_TARGETS:
        for d in (64, 128):
            assert any(
                r["case"]["kernel"] == "attention"
                and r["case"]["pickable"]
                and (r["case"]["target"], r["case"]["head_dim"]) == (target, d)
                for r in quick_records
            ), (target, d)


def test_kernels_compile(quick_records):
    failed = [f"{r['key']}: {r['error']}" for r in quick_records if not r["ok"]]
    assert not failed, "\n".join(failed)


def test_kernels_fit_and_attention_does_not_spill(quick_records):
    problems = tr.problems(quick_records)
    assert not problems, "\n".join(problems)


def test_attention_uses_tensor_cores_in_half_precision(quick_records):
    """bf16 tiles go through HMMA (sm_80; sm_90 for tiles under 64 rows per warpgroup) or
    HGMMA (sm_90): a silent fallback to FMA would be a 10x slowdown the interpreter cannot see.
    The backward's too, in its causal variant (heads up to 128 without a per-element bias)."""
    backward = ("attention_dkdv", "attention_dq")
    for r in quick_records:
        case = r["case"]
        light_backward = case["kernel"] in backward and case["variant"] == "causal"
        if (case["kernel"] == "attention" or light_backward) and r["ok"]:
            want = {"HMMA"} if r["case"]["target"] == 80 else {"HMMA", "HGMMA"}
            assert want & set(r["tensor_core_ops"]), r["key"]
            assert r["tensor_core"] > 0, r["key"]


def _record(target=90, pickable=True, **stats):
    case = tr.Case("attention", "plain", "bfloat16", 128, (("BLOCK_M", 64),), target, pickable)
    base = {
        "ok": True,
        "error": None,
        "registers": 200,
        "stack_bytes": 0,
        "local_bytes": 0,
        "spill_stores": 0,
        "spill_loads": 0,
        "shared": 1024,
        "static_shared": 0,
    }
    return {"case": tr.dataclasses.asdict(case), "key": case.key(), **base, **stats}


def test_verdicts():
    """The rules themselves, on made-up records."""
    assert tr.problems([_record()]) == []
    assert "spills" in tr.problems([_record(stack_bytes=56)])[0]
    assert "spills" in tr.problems([_record(target=80, spill_stores=3)])[0]
    assert tr.problems([_record(pickable=False, stack_bytes=56)]) == []  # never picked
    assert tr.problems([_record(target=120, stack_bytes=56)]) == []  # spills judged on 80/90
    too_big = _record(target=80, shared=163 * 1024, static_shared=1)
    assert "shared memory" in tr.problems([too_big])[0]
    assert "does not compile" in tr.problems([_record(ok=False, error="PTXASError: x")])[0]


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("FASTPE_AOT_FULL", "0") in ("", "0"),
    reason="the full sweep (1198 compilations, 22 worker-minutes uncached) runs with FASTPE_AOT_FULL=1",
)
def test_full_sweep():
    """What `fastpe triton-report --full` checks: every kernel x dtype x head dim x variant x
    config the autotuner may pick, for every target the bundled toolchain supports."""
    records = _records(True, tuple(tr.TARGETS))
    problems = tr.problems(records)
    assert not problems, "\n".join(problems)


def test_kernels_take_at_most_50_parameters():
    """Every Triton kernel groups its strides and optional inputs into tuples: a kernel's
    argument list stays short enough to read against its launcher's launch_args."""
    import importlib
    import inspect
    import pkgutil

    import fastpe.kernels.triton as package

    counts = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and hasattr(obj, "fn"):
                while hasattr(obj, "fn"):  # the autotuner, then the JIT (or interpreter) wrapper
                    obj = obj.fn
                counts[f"{info.name}.{name}"] = len(inspect.signature(obj).parameters)
    assert "attention._attention_kernel" in counts, counts
    assert {k: n for k, n in counts.items() if n > 50} == {}
