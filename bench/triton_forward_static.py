"""Static instruction mix of the attention forward's key loop against the Triton tutorial's.

Compiles fastpe's dense forward kernel (fp16 and bf16, head dims 64 and 128, causal and not) and
the forward of Triton's fused-attention tutorial (``python/tutorials/06-fused-attention.py`` of
triton-lang/triton, fp16: the tutorial rounds p to fp16) with the same tiles for sm_80 and sm_90,
without a GPU, and counts per iteration of each kernel's hot loop (``fastpe.triton_report.
hot_loop``: the loop holding the most tensor-core instructions, the narrowest of those, so the
causal kernels' unmasked loop where they have two) the tensor-core instructions, the FLOPs they
stand for per warp (HGMMA and HMMA shapes, ``mma_flops``) and the other instructions. The figure
of merit is the other instructions per 1000 MMA FLOPs: the issue slots spent beside the tensor
cores per unit of work. The tutorial's kernel is ``_attn_fwd_tma`` (tensor descriptors: TMA on
sm_90, plain loads on sm_80); its ``_attn_fwd`` takes block pointers, which Triton 3.9 no longer
compiles.

The tutorial is read from a file the user supplies (it is not part of fastpe): only its
``@triton.jit`` forward functions are taken, written to a temporary module and compiled with
meta tensors standing for [2, 8, 1024, D] q, k, v, as its launcher would pass them. Measured
with the tutorial at commit 003da478d84f5bb0f51b3988cf0ea0bbe60282b7; another version may name
its arguments differently (``_tutorial_args`` lists the names it knows).

    python bench/triton_forward_static.py --tutorial 06-fused-attention.py \\
        --markdown bench/results/triton-forward-static.md

Nothing here runs on a GPU: these are static counts, not timings.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # real JITFunctions, whatever the shell says
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as fastpe triton-report compiles

from fastpe import triton_report as tr  # noqa: E402

# (BLOCK_M, BLOCK_N, num_warps, num_stages) compared at each head dim: the tutorial needs
# BLOCK_N <= D
CONFIGS = {
    64: ((128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2)),
    128: ((128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 8, 2)),
}
VARIANTS = ("plain", "causal")
DTYPES = ("float16", "bfloat16")
TUTORIAL_FUNCTIONS = ("_attn_fwd_inner", "_attn_fwd_inner_tma", "_attn_fwd", "_attn_fwd_tma")


def _tutorial_module(path):
    """The tutorial's @triton.jit forward functions as an importable module (its top level
    needs a GPU: it asks the driver for the active device)."""
    with open(path) as f:
        text = f.read()
    tree = ast.parse(text)
    parts = ["import triton", "import triton.language as tl", ""]
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in TUTORIAL_FUNCTIONS:
            start = node.lineno  # the def line: decorators (autotune) dropped
            body = text.splitlines()[start - 1 : node.end_lineno]
            parts += ["@triton.jit", *body, ""]
    folder = tempfile.mkdtemp(prefix="fastpe-tutorial-")
    module_path = os.path.join(folder, "tutorial_attention.py")
    with open(module_path, "w") as f:
        f.write("\n".join(parts))
    spec = importlib.util.spec_from_file_location("tutorial_attention", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tutorial_args(fn, d, causal, config):
    """(args, constexprs) of the tutorial's forward for q, k, v [2, 8, 1024, d] fp16."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, h, s = 2, 8, 1024
    bm, bn = config[:2]
    q = torch.empty((b, h, s, d), dtype=torch.float16, device="meta")
    m = torch.empty((b, h, s), dtype=torch.float32, device="meta")
    rows = b * h * s

    def desc(block):
        return TensorDescriptor(q.view(rows, d), [rows, d], [d, 1], [block, d])

    values = {
        "Q": q,
        "K": q,
        "V": q,
        "Out": q,
        "M": m,
        "sm_scale": 0.125,
        "Z": b,
        "H": h,
        "N_CTX": s,
        "desc_q": desc(bm),
        "desc_k": desc(bn),
        "desc_v": desc(bn),
        "desc_o": desc(bm),
    }
    for t in "qkvo":
        for name, stride in zip(("z", "h", "m", "k"), q.stride(), strict=True):
            values[f"stride_{t}{name}"] = stride
        values[f"stride_{t}n"] = q.stride(2) if t in "kv" else q.stride(3)
    values.update(stride_kk=q.stride(3), stride_vk=q.stride(2), stride_vn=q.stride(3))
    consts = {
        "HEAD_DIM": d,
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "CAUSAL": causal,
        "STAGE": 3 if causal else 1,
        "FP8_OUTPUT": False,
    }
    args, kwargs = [], {}
    for p in fn.params:
        if p.is_constexpr:
            kwargs[p.name] = consts[p.name]
        else:
            args.append(values[p.name])
    return args, kwargs


def compile_tutorial(module, name, d, causal, config, target):
    fn = getattr(module, name)
    args, consts = _tutorial_args(fn, d, causal, config)
    options = {"num_warps": config[2], "num_stages": config[3]}
    signature, constexprs, attrs = tr.bind(fn, args, consts, options, target)
    return tr.compile_bound(fn, signature, constexprs, attrs, options, target)


def _per_kflop(record):
    loop = record.get("hot_loop") if record.get("ok") else None
    if not loop or not loop.get("mma_flops"):
        return None
    return 1000 * loop["other"] / loop["mma_flops"]


def _fmt(x):
    return "—" if x is None else f"{x:.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tutorial", required=True, help="path of 06-fused-attention.py")
    parser.add_argument("--targets", nargs="+", type=int, default=[80, 90])
    parser.add_argument("--markdown", default=None, help="also write the table here")
    parser.add_argument("--cache-dir", default=tr.default_cache_dir())
    args = parser.parse_args(argv)
    module = _tutorial_module(args.tutorial)
    cases = [
        tr.Case(
            "attention",
            variant,
            dtype,
            d,
            tr.config_tuple({"BLOCK_M": c[0], "BLOCK_N": c[1]}, c[2], c[3]),
            target,
        )
        for target in args.targets
        for d, configs in CONFIGS.items()
        for c in configs
        for dtype in DTYPES
        for variant in VARIANTS
    ]
    ours = tr.run(cases, jobs=2, cache_dir=args.cache_dir)
    theirs = {
        (target, d, c, causal): compile_tutorial(module, "_attn_fwd_tma", d, causal, c, target)
        for target in args.targets
        for d, configs in CONFIGS.items()
        for c in configs
        for causal in (False, True)
    }
    lines = [
        "# fastpe's attention forward against the Triton tutorial: static counts per key tile",
        "",
        "Written by `python bench/triton_forward_static.py --tutorial 06-fused-attention.py"
        f" --targets {' '.join(map(str, args.targets))}`: compiled for each target without "
        "a GPU; per iteration of the hot loop, the tensor-core instructions (*MMA*), the FLOPs "
        "they stand for per warp (*kFLOP*) and the other instructions (*other*, NOPs left out); "
        "*other/kFLOP*: other instructions per 1000 MMA FLOPs (lower is better). The tutorial "
        "is fp16 only (it rounds p to fp16): fastpe's bf16 rows are set against its fp16 "
        "kernel. Its kernel is `_attn_fwd_tma` (TMA tensor descriptors on sm_90). *ratio*: "
        "fastpe's other/kFLOP over the tutorial's. Causal kernels with two "
        "loops are measured in the unmasked one (the narrower). Static counts, no GPU timing.",
        "",
        "| target | dtype | D | causal | BLOCK_M×BLOCK_N, warps, stages | fastpe MMA | kFLOP | "
        "other | regs | other/kFLOP | tutorial other | tutorial other/kFLOP | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, r in zip(cases, ours, strict=True):
        c = tuple(v for _, v in case.config)
        config = (c[0], c[1], c[2], c[3])
        causal = case.variant == "causal"
        loop = r.get("hot_loop") or {} if r.get("ok") else {}
        tutorial = theirs[case.target, case.head_dim, config, causal]
        t_main = _per_kflop(tutorial)
        t_other = (tutorial.get("hot_loop") or {}).get("other", "—")
        mine = _per_kflop(r)
        ratio = None if mine is None or t_main is None else mine / t_main
        regs = r.get("registers", "—")
        if r.get("stack_bytes"):
            regs = f"{regs} (spills {r['stack_bytes']} B)"
        lines.append(
            f"| sm_{case.target} | {case.dtype} | {case.head_dim} | {'yes' if causal else 'no'} "
            f"| {config[0]}×{config[1]}, {config[2]}, {config[3]} | {loop.get('mma', '—')} | "
            f"{loop.get('mma_flops', 0) / 1000:.0f} | {loop.get('other', '—')} | {regs} | "
            f"{_fmt(mine)} | {t_other} | {_fmt(t_main)} | {_fmt(ratio)} |"
        )
    failed = [r["key"] + ": " + r["error"] for r in ours if not r["ok"]]
    failed += [f"tutorial {k}: {r['error']}" for k, r in theirs.items() if not r["ok"]]
    if failed:
        lines += ["", "Did not compile:", ""] + [f"- {f}" for f in failed]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
