"""The Triton kernels compiled ahead of time for real NVIDIA targets, without a GPU (issue 16):
they must compile, fit the target's shared memory, no attention config the autotuner may
pick on sm_80/sm_90 may spill registers, and every fp16/bf16 attention kernel (forward, paged,
backward) must use tensor cores. The default run compiles a representative subset (bf16,
head dims 64 and 128, the causal and everything-on attention variants, sm_80 and sm_90); the
full sweep is ``slow``. Results are cached (~/.cache/fastpe/triton-aot), so a rerun only
compiles kernels whose source changed."""

from __future__ import annotations

import os

import pytest

from fastpe import triton_report as tr

_why = tr.unavailable()
pytestmark = [
    pytest.mark.skipif(_why is not None, reason=f"AOT compilation impossible: {_why}"),
    # one worker runs the module: its module-scoped compile happens once, not once per worker
    pytest.mark.xdist_group("triton_aot"),
]

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
            # ... in the loop over the key tiles, not only in a peeled prologue or epilogue
            assert 0 < r["hot_loop"]["mma"] <= r["tensor_core"], r["key"]


def _record(target=90, pickable=True, kernel="attention", dtype="bfloat16", **stats):
    case = tr.Case(kernel, "plain", dtype, 128, (("BLOCK_M", 64),), target, pickable)
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
        "tensor_core": 32,
    }
    return {"case": tr.dataclasses.asdict(case), "key": case.key(), **base, **stats}


def test_verdicts():
    """The rules themselves, on made-up records."""
    assert tr.problems([_record()]) == []
    # half precision without tensor cores, in any attention kernel; fp32 runs IEEE dots by design
    for kernel in ("attention", "attention_paged", "attention_dkdv", "attention_dq"):
        assert "no tensor-core" in tr.problems([_record(kernel=kernel, tensor_core=0)])[0]
        assert tr.problems([_record(kernel=kernel, dtype="float32", tensor_core=0)]) == []
    assert tr.problems([_record(kernel="merge", tensor_core=0)]) == []
    assert "spills" in tr.problems([_record(stack_bytes=56)])[0]
    assert "spills" in tr.problems([_record(target=80, spill_stores=3)])[0]
    assert tr.problems([_record(pickable=False, stack_bytes=56)]) == []  # never picked
    assert tr.problems([_record(target=120, stack_bytes=56)]) == []  # spills judged on 80/90
    too_big = _record(target=80, shared=163 * 1024, static_shared=1)
    assert "shared memory" in tr.problems([too_big])[0]
    assert "does not compile" in tr.problems([_record(ok=False, error="PTXASError: x")])[0]


# A made-up sm_90 kernel in nvdisasm's layout: a prologue with one HGMMA and a forward branch,
# a loop (.L_x_1 … the backward branch at 0x01c0) holding two HGMMA, five other instructions
# and a NOP, with a wait loop inside it (.L_x_2, one instruction and its branch), an
# epilogue, and the trap loop nvdisasm ends kernels with.
_SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0020*/              @P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0030*/                   WARPGROUP.ARRIVE ;
        /*0040*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
.L_x_2:
        /*0050*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8], R3 ;
        /*0060*/              @!P1 BRA `(.L_x_2) ;
        /*0070*/                   NOP ;
        /*0080*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR12], R24, gsb0 ;
        /*0090*/                   FMUL R4, R4, 1.4426950216293334961 ;
        /*01c0*/              @P2 BRA `(.L_x_1) ;
.L_x_0:
        /*01d0*/                   STG.E desc[UR6][R2.64], R24 ;
        /*01e0*/                   EXIT ;
.L_x_3:
        /*01f0*/                   BRA `(.L_x_3);
"""


def test_hot_loop_counts_one_iteration_of_the_mma_loop():
    # two HGMMA 64x64x16: 2·64·64·16 FLOPs each, a quarter of them per warp
    assert tr.hot_loop(_SASS) == {"mma": 2, "other": 5, "mma_flops": 2 * 2 * 64 * 64 * 16 // 4}
    # no loop holds a tensor-core instruction (an fp32 kernel): the largest loop instead
    fma = _SASS.replace("HGMMA.64x64x16.F32.BF16", "FFMA")
    assert tr.hot_loop(fma) == {"mma": 0, "other": 7, "mma_flops": 0}
    assert tr.hot_loop("        /*0000*/                   EXIT ;") is None
    # a block after the EXIT that jumps back into the body (an mbarrier wait's retry path)
    # is no loop, however many HGMMA its span covers (here the prologue's too)
    retry = _SASS.replace("        /*0010*/", ".L_x_9:\n        /*0010*/").replace(
        "        /*01f0*/                   BRA `(.L_x_3);", "        /*01f0*/   BRA `(.L_x_9);"
    )
    assert tr.hot_loop(retry) == tr.hot_loop(_SASS)


def test_mma_flops_reads_the_shapes():
    assert tr.mma_flops("HGMMA.64x128x16.F32.BF16") == 2 * 64 * 128 * 16 // 4
    assert tr.mma_flops("HGMMA.64x64x16.F32") == 2 * 64 * 64 * 16 // 4
    assert tr.mma_flops("HMMA.16816.F32.BF16") == 2 * 16 * 8 * 16
    assert tr.mma_flops("HMMA.1688.F32.TF32") == 2 * 16 * 8 * 8
    assert tr.mma_flops("FFMA") == 0


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("FASTPE_AOT_FULL", "0") in ("", "0"),
    reason="the full sweep (1197 compilations, 51 worker-minutes uncached) runs with FASTPE_AOT_FULL=1",
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
