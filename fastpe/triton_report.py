"""Ahead-of-time report on the Triton kernels for real NVIDIA targets, without a GPU.

Triton compiles a kernel for a named target (``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))``) on any machine, and the CUDA tools bundled with Triton read
the cubin: ``cuobjdump --dump-resource-usage`` gives registers and the stack frame (a stack frame
means spilled registers), ``nvdisasm`` the SASS, where HMMA (sm_80), HGMMA (sm_90) and UTC*MMA
(sm_100) are tensor-core instructions and LDG.E.128 a 128-bit load. Every kernel is compiled with
the arguments its launcher passes (the same specialisations the JIT makes: unit strides become
constants, 16-divisible sizes and pointers are marked so) for every config the launcher or the
autotuner may use.

Compiling runs in worker processes with ``TRITON_INTERPRET=0`` (the interpreter replaces
``@triton.jit``), at most two at a time; each result is cached on disk under a key made of the
kernel's source hash, the arguments, the target and the Triton version, so a rerun only compiles
what changed. ``fastpe triton-report`` is the command; ``tests/test_triton_aot.py`` the check.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import json
import multiprocessing
import os
import re
import subprocess
import tempfile
import time
from collections import Counter

from fastpe._triton_launches import (
    ATTENTION_VARIANTS,
    KERNEL_VARIANTS,
    QUICK_ATTENTION_VARIANTS,
    attention_configs,
    config_tuple,
    jit_function,
    launch,
    launched,
)

# max dynamic shared memory per block (opt-in), bytes, from the CUDA programming guide's table
TARGETS = {
    80: ("sm_80 (A100)", 163 * 1024),
    90: ("sm_90 (H100/H200)", 227 * 1024),
    100: ("sm_100 (B200)", 227 * 1024),
    120: ("sm_120 (RTX 50)", 99 * 1024),
}
# the targets on which a spilling attention config the autotuner may pick is a failure
NO_SPILL_TARGETS = (80, 90)
DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIMS = (64, 128, 256)
KERNELS = (
    "sinusoidal_table",
    "rope_table",
    "apply_rope",
    "embed",
    "scatter_rows",
    "attention",
    "merge",
    "attention_dkdv",
    "attention_dq",
    "attention_paged",
    "flex_forward",
    "flex_dkdv",
    "flex_dq",
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One compilation: a kernel with one set of feature flags, dtype, head dim and config, for
    one target. ``pickable``: the launcher or the autotuner (after ``_prune``) may use it there."""

    kernel: str
    variant: str
    dtype: str
    head_dim: int
    config: tuple  # ((name, value), ...) of the block sizes, then num_warps and num_stages
    target: int
    pickable: bool = True

    @property
    def config_label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.config)

    def key(self) -> str:
        return f"{self.kernel}/{self.variant}/{self.dtype}/d{self.head_dim}/{self.config_label}/sm_{self.target}"


def _bin(tool: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def unavailable() -> str | None:
    """Why the report cannot run here (None when it can)."""
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as exc:
        return f"triton is not installed ({exc})"
    for tool in ("ptxas", "cuobjdump", "nvdisasm"):
        if not os.access(_bin(tool), os.X_OK):
            return f"the CUDA tool {tool} bundled with Triton is missing ({_bin(tool)})"
    return None


_BLOCK_NAMES = (
    "BLOCK_M",
    "BLOCK_N",
    "BLOCK_P",
    "BLOCK_F",
    "BLOCK_T",
    "BLOCK_D",
    "BLOCK_H",
    "BLOCK_R",
)


def cases(*, full: bool, targets=tuple(TARGETS), all_configs: bool = False) -> list[Case]:
    """The report's compilations: the attention configs the autotuner may pick (``all_configs``:
    every config in its list, for exploring). ``full``: every dtype x head dim, every attention
    variant on sm_80/sm_90 and the main ones elsewhere; otherwise bf16 (fp16 compiles alike) at
    head dims 64 and 128 with the main attention variants."""
    dtypes = DTYPES if full else ("bfloat16",)
    dims = HEAD_DIMS if full else (64, 128)
    out = []
    for target in targets:
        for dtype in dtypes:
            for d in dims:
                for kernel, variants in KERNEL_VARIANTS.items():
                    for variant in variants if full else variants[:1]:
                        consts = launch(kernel, dtype, d, variant, target)[3]
                        meta = {k: v for k, v in consts.items() if k in _BLOCK_NAMES}
                        # what the launcher passes, else Triton's defaults, 4 warps and 3 stages
                        warps, stages = consts.get("num_warps", 4), consts.get("num_stages", 3)
                        out.append(
                            Case(
                                kernel, variant, dtype, d, config_tuple(meta, warps, stages), target
                            )
                        )
                # every feature variant where spills fail the check (fp16 compiles like bf16:
                # the main variants suffice for it), the main ones elsewhere
                every = full and target in NO_SPILL_TARGETS and dtype != "float16"
                for variant in ATTENTION_VARIANTS if every else QUICK_ATTENTION_VARIANTS:
                    if not launched(dtype, d, variant):
                        continue
                    for config, pickable in attention_configs(dtype, d, variant, target):
                        if not (pickable or all_configs):
                            continue
                        meta = dict(config.kwargs)
                        out.append(
                            Case(
                                "attention",
                                variant,
                                dtype,
                                d,
                                config_tuple(meta, config.num_warps, config.num_stages),
                                target,
                                pickable,
                            )
                        )
    return out


# ------------------------------------------------------------------------------------------
# compiling and reading the cubin (in the workers)


def bind(fn, args, consts: dict, options: dict, target: int):
    """(signature, constexprs, attrs) of JITFunction ``fn`` called with ``args`` (meta tensors
    stand for tensors) and ``consts``, bound and specialised by the JIT's own binder for
    ``target`` as a launch on that GPU would be."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", target, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, _ = binder(*args, **consts)
    _, signature, constexprs, attrs = fn._pack_args(
        backend, dict(options), bound, specialization, None
    )
    return signature, constexprs, attrs


def _source(case: Case):
    """(JITFunction, signature, constexprs, attrs, options, fp32 dots) for ``case``: its
    launcher's arguments bound and specialised by the JIT's own binder for the case's target;
    "fp32 dots": the launcher chose IEEE fp32 dots for the kernel (its DOT_FP32)."""
    config = dict(case.config)
    options = {"num_warps": config.pop("num_warps"), "num_stages": config.pop("num_stages")}
    kernel, _, args, consts = launch(
        case.kernel, case.dtype, case.head_dim, case.variant, case.target
    )
    consts = {**{k: v for k, v in consts.items() if k not in options}, **config}
    fn = jit_function(kernel)
    signature, constexprs, attrs = bind(fn, args, consts, options, case.target)
    return fn, signature, constexprs, attrs, options, bool(consts.get("DOT_FP32", False))


_RESOURCE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_TENSOR_CORE = re.compile(r"\b(HMMA|HGMMA|UTC\w*MMA|IMMA)\b")
# (an opcode's shape holds lowercase x: HGMMA.64x128x16)
_OPCODE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)", re.M)
# one SASS line: its address, opcode and operands; a label (a branch target) on its own line
_INSTRUCTION = re.compile(
    r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*)"
)
_LABEL = re.compile(r"^\s*(\.L\w+):")
_TARGET = re.compile(r"\((\.L\w+)\)")
# the kernels whose inner loop is a matrix product (the autotuned forward first): in fp16/bf16
# it must run on tensor cores
MMA_KERNELS = (
    "attention",
    "attention_paged",
    "attention_dkdv",
    "attention_dq",
    "flex_forward",
    "flex_dkdv",
    "flex_dq",
)
# the kernels of which a spill on sm_80/sm_90 fails the check (the config the launcher or the
# autotuner may pick)
NO_SPILL_KERNELS = ("attention", "flex_forward", "flex_dkdv", "flex_dq")


def is_tensor_core(opcode: str) -> bool:
    return bool(_TENSOR_CORE.match(opcode.split(".")[0]))


# the shapes in a tensor-core opcode: HGMMA.64x128x16.F32.BF16 (one warpgroup's M x N x K) and
# HMMA.16816.F32.BF16 (one warp's m16 n8 k16; HMMA.1688: k8)
_HGMMA_SHAPE = re.compile(r"^HGMMA\.(\d+)x(\d+)x(\d+)\b")
_HMMA_SHAPE = re.compile(r"^HMMA\.(16)(8)(8|16)\b")


def mma_flops(opcode: str) -> int:
    """The multiply-add FLOPs (2·M·N·K) one warp's issue of a tensor-core instruction stands
    for: an HGMMA is issued by the four warps of its warpgroup together, so a quarter of its
    shape's; 0 for a shape this does not read (IMMA, sm_100's UTC*MMA, whose shapes live in
    descriptors) and for other instructions."""
    hgmma = _HGMMA_SHAPE.match(opcode)
    if hgmma:
        m, n, k = map(int, hgmma.groups())
        return 2 * m * n * k // 4
    hmma = _HMMA_SHAPE.match(opcode)
    if hmma:
        m, n, k = map(int, hmma.groups())
        return 2 * m * n * k
    return 0


def hot_loop(sass: str) -> dict | None:
    """The loop of a kernel's SASS that does its matrix products, counted statically: the
    instructions from a backward branch's target to that branch (a loop's body, one iteration
    when Triton software-pipelines it), for the loop holding the most tensor-core instructions
    (the narrowest of those with as many: an inner loop rather than one around it, the unmasked
    loop of a kernel that runs its masked tiles in a second one); where no
    loop holds one (fp32's IEEE dots run on FMA units), the loop with the most instructions.
    A backward branch whose span holds the kernel's EXIT is no loop: sm_90 kernels jump from
    out-of-line blocks after the EXIT (an mbarrier wait's retry) back into their body.
    Returns {"mma": tensor-core instructions, "other": the other instructions, NOP padding
    excluded, "mma_flops": the FLOPs of those tensor-core instructions per warp (``mma_flops``;
    0 where their shapes cannot be read)}, or None for a kernel without a loop."""
    program, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        ins = _INSTRUCTION.match(line)
        if ins:
            address = int(ins.group(1), 16)
            labels.update(dict.fromkeys(pending, address))
            pending = []
            program.append((address, ins.group(2), ins.group(3)))
    best = None
    for address, opcode, operands in program:
        target = _TARGET.search(operands)
        if opcode.split(".")[0] != "BRA" or not target or target.group(1) not in labels:
            continue
        head = labels[target.group(1)]
        if head > address:  # a forward branch
            continue
        body = [op for a, op, _ in program if head <= a <= address and op != "NOP"]
        if "EXIT" in body:  # an out-of-line block (a barrier's retry) jumping back: no loop
            continue
        mma = sum(map(is_tensor_core, body))
        rank = (mma, len(body) if mma == 0 else -len(body))
        if best is None or rank > best[0]:
            flops = sum(map(mma_flops, body))
            best = (rank, {"mma": mma, "other": len(body) - mma, "mma_flops": flops})
    return None if best is None else best[1]


def _read_cubin(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run(
            [_bin("cuobjdump"), "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        sass = subprocess.run(
            [_bin("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True
        ).stdout
    regs, stack, static_shared, local = (int(x) for x in _RESOURCE.search(usage).groups())
    ops = Counter(_OPCODE.findall(sass))
    loads = {op: n for op, n in ops.items() if op.startswith(("LDG", "LDGSTS"))}
    stores = {op: n for op, n in ops.items() if op.startswith("STG")}
    return {
        "registers": regs,
        "stack_bytes": stack,
        "local_bytes": local,
        "static_shared": static_shared,
        "spill_stores": sum(n for op, n in ops.items() if op.startswith("STL")),
        "spill_loads": sum(n for op, n in ops.items() if op.startswith("LDL")),
        "tensor_core": sum(n for op, n in ops.items() if is_tensor_core(op)),
        "tensor_core_ops": sorted({op.split(".")[0] for op in ops if is_tensor_core(op)}),
        "hot_loop": hot_loop(sass),
        "global_loads": loads,
        "global_stores": stores,
        "loads_128": sum(n for op, n in loads.items() if op.endswith(".128")),
        "instructions": sum(ops.values()),
    }


# what _read_cubin reads, in the cache key: a cached record read by an older version lacks
# the newer fields
_READER_VERSION = 4


def _cache_key(case: Case, fn, signature, constexprs, attrs, options) -> str:
    import triton

    text = repr(
        (
            _READER_VERSION,
            fn.cache_key,
            sorted(signature.items()),
            sorted(constexprs.items()),
            sorted(attrs.items()),
            sorted(options.items()),
            case.target,
            triton.__version__,
        )
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def compile_bound(fn, signature, constexprs, attrs, options, target: int) -> dict:
    """Compile a bound kernel (``bind``) for ``target`` and read its cubin: {"ok", "error",
    "shared", "compile_seconds", and ``_read_cubin``'s fields}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.perf_counter()
    try:
        compiled = triton.compile(
            ASTSource(fn, signature, constexprs, attrs),
            target=GPUTarget("cuda", target, 32),
            options=options,
        )
        result = {"ok": True, "error": None, "shared": compiled.metadata.shared}
        result.update(_read_cubin(compiled.asm["cubin"]))
    except Exception as exc:
        message = str(exc).strip().splitlines()
        result = {"ok": False, "error": f"{type(exc).__name__}: {' '.join(message[-3:])[:400]}"}
    result["compile_seconds"] = round(time.perf_counter() - start, 2)
    return result


def compile_case(case: Case, cache_dir: str | None) -> dict:
    """Compile one case and read its cubin (run in a worker with TRITON_INTERPRET=0)."""
    record = {"case": dataclasses.asdict(case), "key": case.key()}
    try:
        fn, signature, constexprs, attrs, options, fp32_dots = _source(case)
    except Exception as exc:  # a spec that no longer matches the kernel's arguments
        return {**record, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    record["fp32_dots"] = fp32_dots
    key = _cache_key(case, fn, signature, constexprs, attrs, options)
    path = os.path.join(cache_dir, key + ".json") if cache_dir else None
    if path and os.path.exists(path):
        with open(path) as f:
            return {**record, **json.load(f), "cached": True}
    result = compile_bound(fn, signature, constexprs, attrs, options, case.target)
    if path:
        os.makedirs(cache_dir, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(path + ".tmp", path)
    return {**record, **result, "cached": False}


def _worker_init():
    # @triton.jit must build real JITFunctions in the workers, whatever the parent runs under
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fastpe", "triton-aot")


def run(case_list, *, jobs: int = 2, cache_dir: str | None = None, progress=None) -> list[dict]:
    """Compile every case in ``jobs`` (at most 2) spawned workers; results in case order."""
    jobs = max(1, min(int(jobs), 2))
    ctx = multiprocessing.get_context("spawn")
    results = [None] * len(case_list)
    with cf.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init) as pool:
        futures = {pool.submit(compile_case, c, cache_dir): i for i, c in enumerate(case_list)}
        for done, future in enumerate(cf.as_completed(futures), 1):
            results[futures[future]] = future.result()
            if progress and (done % 25 == 0 or done == len(case_list)):
                progress(f"{done}/{len(case_list)} compiled")
    return results


def plan(
    *, full: bool, targets=tuple(TARGETS), all_configs: bool = False, kernels=KERNELS
) -> list[Case]:
    """``cases`` computed in a worker (the attention configs come from the kernel module, which
    must be imported with TRITON_INTERPRET=0), only those of ``kernels``."""
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(1, mp_context=ctx, initializer=_worker_init) as pool:
        out = pool.submit(
            cases, full=full, targets=tuple(targets), all_configs=all_configs
        ).result()
    return [c for c in out if c.kernel in kernels]


# ------------------------------------------------------------------------------------------
# verdicts and tables


def problems(records) -> list[str]:
    """What fails the check: a kernel that does not compile, needs more shared memory than its
    target has, an attention config the autotuner may pick on sm_80/sm_90 that spills, or an
    fp16/bf16 attention kernel (forward, paged, backward) without a tensor-core instruction
    where its launcher meant to use them (fp32, and the tiles a launcher widens to fp32 on
    purpose — its DOT_FP32 — take IEEE fp32 dots, on FMA units by design)."""
    out = []
    for r in records:
        case = r["case"]
        if not r["ok"]:
            out.append(f"{r['key']}: does not compile: {r['error']}")
            continue
        limit = TARGETS[case["target"]][1]
        total = r["shared"] + r["static_shared"]
        if case["pickable"] and total > limit:
            out.append(f"{r['key']}: needs {total} bytes of shared memory, the target has {limit}")
        spills = r["stack_bytes"] or r["spill_stores"] or r["local_bytes"]
        # the few stack bytes of the memory-bound kernels come from libdevice sin/cos, whose
        # large-argument path keeps a local array: reported in the table, not failed
        attention = case["kernel"] in NO_SPILL_KERNELS
        if attention and case["pickable"] and case["target"] in NO_SPILL_TARGETS and spills:
            out.append(
                f"{r['key']}: spills ({r['registers']} registers, {r['stack_bytes']}-byte stack, "
                f"{r['spill_stores']} STL / {r['spill_loads']} LDL)"
            )
        half = case["dtype"] in ("float16", "bfloat16")
        meant = case["kernel"] in MMA_KERNELS and half and not r.get("fp32_dots")
        if meant and case["pickable"] and not r["tensor_core"]:
            out.append(f"{r['key']}: no tensor-core instruction in a {case['dtype']} kernel")
    return out


def document(records, *, full: bool, seconds: float, jobs: int, kernels=KERNELS) -> dict:
    import triton

    return {
        "triton": triton.__version__,
        "ptxas": subprocess.run([_bin("ptxas"), "--version"], capture_output=True, text=True)
        .stdout.strip()
        .splitlines()[-1],
        "targets": {f"sm_{k}": {"name": v[0], "shared_limit": v[1]} for k, v in TARGETS.items()},
        "full": full,
        # the kernels compiled (a subset when the command named some)
        "kernels": list(kernels),
        "targets_compiled": sorted({r["case"]["target"] for r in records}),
        "jobs": jobs,
        "wall_seconds": round(seconds, 1),
        "compiled": sum(not r.get("cached") for r in records),
        # what an uncached run costs: the compile times, cached ones included, summed
        "compile_seconds_total": round(sum(r.get("compile_seconds", 0.0) for r in records), 1),
        "problems": problems(records),
        "records": records,
    }


def _fmt_loads(r) -> str:
    if not r["ok"]:
        return ""
    return ", ".join(f"{op} x{n}" for op, n in sorted(r["global_loads"].items()))


def _span(values) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}–{high}"


def _loop_cells(ok) -> str:
    """The hot loop's tensor-core and other instructions over records, and the other
    instructions per 1000 MMA FLOPs: 'mma | other | per kFLOP', each a value or a range."""
    loops = [r["hot_loop"] for r in ok if r.get("hot_loop")]
    if not loops:
        return " | | "
    rates = [1000 * x["other"] / x["mma_flops"] for x in loops if x.get("mma_flops")]
    rate = f"{min(rates):.2f}–{max(rates):.2f}" if rates else ""
    if rates and f"{min(rates):.2f}" == f"{max(rates):.2f}":
        rate = f"{min(rates):.2f}"
    return f"{_span([x['mma'] for x in loops])} | {_span([x['other'] for x in loops])} | {rate}"


def format_markdown(doc: dict) -> str:
    recs = doc["records"]
    kernels = doc.get("kernels", list(KERNELS))
    compiled = doc.get("targets_compiled", sorted(int(t[3:]) for t in doc["targets"]))
    command = "fastpe triton-report" + (" --full" if doc["full"] else "")
    if compiled != sorted(TARGETS):
        command += " --targets " + " ".join(map(str, compiled))
    if list(kernels) != list(KERNELS):
        command += " --kernels " + " ".join(kernels)
    lines = [
        "# Triton kernels compiled ahead of time (no GPU)",
        "",
        f"Triton {doc['triton']}, {doc['ptxas']}. Written by `{command}` in "
        f"{doc['wall_seconds']} s on {doc['jobs']} "
        f"worker(s) ({doc['compiled']} of {len(recs)} compiled, the rest from the cache; "
        f"compiling all of them takes {doc.get('compile_seconds_total', 0) / 60:.0f} "
        "worker-minutes).",
        "Registers and stack from `cuobjdump --dump-resource-usage` (a stack frame and STL/LDL "
        "mean spilled registers); shared memory = Triton's dynamic allocation + static, against "
        "the target's per-block limit; tensor-core instructions (HMMA sm_80, HGMMA sm_90, "
        "UTC*MMA sm_100) counted in `nvdisasm` SASS, in the whole kernel and per iteration of its "
        "hot loop (*MMA/iter*, *other/iter*: the instructions between the head and the backward "
        "branch of the loop holding the most tensor-core instructions, NOPs left out; the "
        "largest loop where none holds one; *other/kFLOP*: the other instructions per 1000 "
        "FLOPs of those tensor-core instructions, per warp, from their HGMMA/HMMA shapes). fp32 attention uses IEEE fp32 dots "
        "(no tensor cores, by design); an fp16/bf16 attention kernel without them is a "
        "problem. *pick*: the autotuner may choose the config on that "
        "target (after `_prune`); unpicked configs are listed for reference only.",
        "",
        f"**Problems: {len(doc['problems'])}**" + ("" if doc["problems"] else " (none)"),
        "",
    ]
    lines += [f"- {p}" for p in doc["problems"]]
    # attention: worst over the feature variants, per (target, dtype, d, config)
    lines += [
        "",
        "## Attention (worst over the feature variants)",
        "",
        "| target | dtype | D | config | pick | variants | max regs | max stack B | "
        "spill ST/LD | max smem KB / limit | tensor-core instr | MMA/iter | other/iter | "
        "other/kFLOP | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups = {}
    for r in recs:
        c = r["case"]
        if c["kernel"] != "attention":
            continue
        groups.setdefault(
            (c["target"], c["dtype"], c["head_dim"], Case(**c).config_label), []
        ).append(r)
    for (target, dtype, d, label), rs in groups.items():
        ok = [r for r in rs if r["ok"]]
        limit = TARGETS[target][1]
        pick = rs[0]["case"]["pickable"]
        if ok:
            regs = max(r["registers"] for r in ok)
            stack = max(r["stack_bytes"] for r in ok)
            st = max(r["spill_stores"] for r in ok)
            ld = max(r["spill_loads"] for r in ok)
            smem = max(r["shared"] + r["static_shared"] for r in ok)
            tc = "/".join(sorted({str(r["tensor_core"]) for r in ok}, key=int))
            stats = (
                f"{regs} | {stack} | {st}/{ld} | {smem / 1024:.0f} / {limit // 1024} | {tc} | "
                + _loop_cells(ok)
            )
        else:
            stats = "| | | | | | | "
        verdict = "yes" if len(ok) == len(rs) else f"{len(rs) - len(ok)} fail"
        lines.append(
            f"| sm_{target} | {dtype} | {d} | {label} | {'yes' if pick else 'no'} | {len(rs)} | "
            f"{stats} | {verdict} |"
        )
    lines += [
        "",
        "## Paged, backward and flex attention (launcher's block sizes; worst over variants)",
        "",
        "| target | kernel | dtype | D | config | variants | max regs | max stack B | "
        "smem KB | tensor-core instr | MMA/iter | other/iter | other/kFLOP | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (target, kernel, dtype, d, label), rs in _launcher_groups(recs, MMA_KERNELS[1:]):
        ok = [r for r in rs if r["ok"]]
        if ok:
            tc = "/".join(sorted({str(r["tensor_core"]) for r in ok}, key=int))
            stats = f"{_launcher_stats(ok)} | {tc} | {_loop_cells(ok)}"
        else:
            stats = "| | | | | | "
        verdict = "yes" if len(ok) == len(rs) else f"{len(rs) - len(ok)} fail"
        lines.append(
            f"| sm_{target} | {kernel} | {dtype} | {d} | {label} | {len(rs)} | {stats} | {verdict} |"
        )
    lines += [
        "",
        "## Memory-bound kernels (launcher's block sizes; worst over variants)",
        "",
        "| target | kernel | dtype | D | config | variants | max regs | max stack B | "
        "smem KB | global loads (SASS) | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    others = [k for k in KERNELS if k not in MMA_KERNELS]
    for (target, kernel, dtype, d, label), rs in _launcher_groups(recs, others):
        ok = [r for r in rs if r["ok"]]
        loads = "; ".join(sorted({_fmt_loads(r) for r in ok}))
        stats = _launcher_stats(ok) if ok else "| |"
        verdict = "yes" if len(ok) == len(rs) else f"{len(rs) - len(ok)} fail"
        lines.append(
            f"| sm_{target} | {kernel} | {dtype} | {d} | {label} | {len(rs)} | {stats} | {loads} | {verdict} |"
        )
    return "\n".join(lines) + "\n"


def _launcher_groups(records, kernels):
    """The records of ``kernels`` by (target, kernel, dtype, head dim, config)."""
    groups = {}
    for r in records:
        c = r["case"]
        if c["kernel"] in kernels:
            key = (c["target"], c["kernel"], c["dtype"], c["head_dim"], Case(**c).config_label)
            groups.setdefault(key, []).append(r)
    return groups.items()


def _launcher_stats(ok) -> str:
    return (
        f"{max(r['registers'] for r in ok)} | {max(r['stack_bytes'] for r in ok)} | "
        f"{max(r['shared'] + r['static_shared'] for r in ok) / 1024:.1f}"
    )
