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
import importlib
import json
import multiprocessing
import os
import re
import subprocess
import tempfile
import time
from collections import Counter

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
_TRITON_TYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}
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
)

# the feature combinations of tests/test_backends.py::ATTN_CASES (+ MHA, positions, non-
# interleaved RoPE): the constexprs each one turns on
ATTENTION_VARIANTS = {
    "plain": {},
    "plain_mha": {"_mha": True},
    "causal": {"CAUSAL": True},
    "bool_mask": {"HAS_MASK": True, "MASK_IS_BOOL": True},
    "float_mask": {"HAS_MASK": True},
    "key_lengths": {"HAS_KEY_LEN": True},
    "alibi": {"HAS_ALIBI": True, "CAUSAL": True},
    "t5": {
        "HAS_RELATIVE_BIAS": True,
        "RELATIVE_BIAS_BUCKETS": 32,
        "RELATIVE_BIAS_BIDIRECTIONAL": True,
    },
    "rope": {"HAS_ROPE": True, "ROPE_INTERLEAVED": True, "CAUSAL": True},
    "rope_neox_positions": {"HAS_ROPE": True, "HAS_QPOS": True, "HAS_KPOS": True},
    "window_softcap_sinks": {
        "CAUSAL": True,
        "HAS_WINDOW": True,
        "HAS_SOFTCAP": True,
        "HAS_SINKS": True,
    },
    "everything": {
        "CAUSAL": True,
        "HAS_MASK": True,
        "MASK_IS_BOOL": True,
        "HAS_KEY_LEN": True,
        "HAS_ALIBI": True,
        "HAS_RELATIVE_BIAS": True,
        "RELATIVE_BIAS_BUCKETS": 32,
        "HAS_ROPE": True,
        "ROPE_INTERLEAVED": True,
        "HAS_WINDOW": True,
        "HAS_SOFTCAP": True,
        "HAS_SINKS": True,
    },
}
# the cheap default (CI) subset
QUICK_ATTENTION_VARIANTS = ("causal", "window_softcap_sinks", "everything")


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


# ------------------------------------------------------------------------------------------
# the arguments each launcher passes. A pointer is "*<type>"; ints and floats are example values
# from a contiguous launch, so the JIT's specialisations (1 -> constant, multiple of 16 ->
# divisibility hint) come out as they would on a GPU.


def _attention_args(dtype, d, variant):
    flags = dict(ATTENTION_VARIANTS[variant])
    mha = flags.pop("_mha", False)
    b, hq, s = 2, 8, 1024
    hkv = hq if mha else 2
    t = "*" + _TRITON_TYPE[dtype]
    half = d // 2
    values = {
        "q_ptr": t,
        "k_ptr": t,
        "v_ptr": t,
        "out_ptr": t,
        "lse_ptr": "*fp32",
        "mask_ptr": "*i1"
        if flags.get("MASK_IS_BOOL")
        else "*" + (_TRITON_TYPE[dtype] if flags.get("HAS_MASK") else "fp32"),
        "key_len_ptr": "*i64",
        "alibi_ptr": "*fp32",
        "bias_ptr": "*fp32",
        "cos_ptr": "*fp32",
        "sin_ptr": "*fp32",
        "qpos_ptr": "*i64",
        "kpos_ptr": "*i64",
        "sinks_ptr": "*fp32",
        "Hq": hq,
        "group": hq // hkv,
        "Sq": s,
        "Sk": s,
        "D": d,
        "Dv": d,
        "query_shift": 0,
        "half": half,
        "keys_per_split": s,
        "q_positions_offset": 0,
        "k_positions_offset": 0,
        "bias_max_exact": 8,
        "bias_log_span": 1.5,
        "win_left": 4095,
        "win_right": 0,
        "stride_qb": hq * s * d,
        "stride_qh": s * d,
        "stride_qs": d,
        "stride_qd": 1,
        "stride_kb": hkv * s * d,
        "stride_kh": s * d,
        "stride_ks": d,
        "stride_kd": 1,
        "stride_vb": hkv * s * d,
        "stride_vh": s * d,
        "stride_vs": d,
        "stride_vd": 1,
        "stride_osplit": b * hq * s * d,
        "stride_ob": hq * s * d,
        "stride_oh": s * d,
        "stride_os": d,
        "stride_od": 1,
        "stride_lsplit": b * hq * s,
        "stride_lb": hq * s,
        "stride_lh": s,
        "stride_ls": 1,
        # a [B, 1, S, S] mask broadcast over heads, a [Hq] slope vector broadcast over batch
        "stride_mb": s * s,
        "stride_mh": 0,
        "stride_mq": s,
        "stride_mk": 1,
        "stride_ab": 0,
        "stride_ah": 1,
        "stride_biasb": hq,
        "stride_biash": 1,
        "stride_cos": half,
        "stride_qpb": 0,
        "stride_qps": 1,
        "stride_kpb": 0,
        "stride_kps": 1,
        "scale": 0.125,
        "softcap": 50.0,
    }
    constexprs = {
        "CAUSAL": False,
        "HAS_WINDOW": False,
        "HAS_SOFTCAP": False,
        "HAS_SINKS": False,
        "BOTTOM_RIGHT": True,
        "HAS_MASK": False,
        "MASK_IS_BOOL": False,
        "HAS_KEY_LEN": False,
        "HAS_ALIBI": False,
        "HAS_RELATIVE_BIAS": False,
        "RELATIVE_BIAS_BUCKETS": 2,
        "RELATIVE_BIAS_BIDIRECTIONAL": False,
        "HAS_ROPE": False,
        "ROPE_INTERLEAVED": False,
        "HAS_QPOS": False,
        "HAS_KPOS": False,
        "DOT_FP32": dtype == "float32",
        "BLOCK_D": _next_pow2(d),
        "BLOCK_DV": _next_pow2(d),
    }
    constexprs.update(flags)
    return values, constexprs


def _next_pow2(n, minimum=16):
    return max(minimum, 1 << (max(int(n), 1) - 1).bit_length())


def _launched(dtype, d, variant) -> bool:
    """False for RoPE variants the launcher never runs (it rotates q and k beforehand and
    launches the kernel without HAS_ROPE, a variant compiled on its own)."""
    from fastpe.kernels.triton import attention

    flags = ATTENTION_VARIANTS[variant]
    biased = attention._per_element_bias(flags)
    return not flags.get("HAS_ROPE") or attention._rope_in_kernel(d, dtype == "float32", biased)


def attention_configs(dtype, d, variant, target):
    """[(config, pickable)]: every config in the autotune list, and whether ``_prune`` keeps it
    on ``target`` for a prefill (Sq = 1024) or a decode (Sq = 1) call of this shape."""
    from fastpe.kernels.triton import attention

    values, constexprs = _attention_args(dtype, d, variant)
    configs = attention._gpu_configs()
    kept = set()
    for sq in (1, 1024):
        named = {**values, "Sq": sq}
        for c in attention._prune(configs, named, capability=target, **constexprs):
            kept.add(id(c))
    return [(c, id(c) in kept) for c in configs]


def _config_tuple(meta: dict, num_warps: int, num_stages: int) -> tuple:
    return (*sorted(meta.items()), ("num_warps", num_warps), ("num_stages", num_stages))


def _kernel_specs(kernel, dtype, d, variant):
    """(module, function name, values, constexprs) for a non-attention kernel, with the block
    sizes its launcher chooses (they mirror the launchers in kernels/triton/)."""
    t = "*" + _TRITON_TYPE[dtype]
    half = d // 2
    if kernel == "sinusoidal_table":
        values = {
            "out_ptr": t,
            "omega_ptr": "*fp64",
            "num_positions": 4096,
            "offset": 0,
            "half": half,
            "stride_out_pos": d,
        }
        consts = {
            "INTERLEAVED": variant == "interleaved",
            "BLOCK_P": 32,
            "BLOCK_F": min(128, _next_pow2(half)),
        }
        return "sinusoidal_table", "_sinusoidal_table_kernel", values, consts
    if kernel == "rope_table":
        values = {
            "cos_ptr": t,
            "sin_ptr": t,
            "inv_freq_ptr": "*fp64",
            "num_positions": 4096,
            "offset": 0,
            "half": half,
            "stride_pos": half,
            "factor": 1.0,
        }
        consts = {"BLOCK_P": 32, "BLOCK_F": min(128, _next_pow2(half))}
        return "rope_table", "_rope_table_kernel", values, consts
    if kernel == "apply_rope":
        h, s = 32, 1024
        rot_half = half // 2 if variant == "partial" else half
        x = {"stride_x1b": h * s * d, "stride_x1h": s * d, "stride_x1s": d, "stride_x1d": 1}
        values = {
            "x1_ptr": t,
            "out1_ptr": t,
            "x2_ptr": t,
            "out2_ptr": t,
            "cos_ptr": t,
            "sin_ptr": t,
            "pos_ptr": "*i64",
            "heads1": h,
            "heads2": 8,
            "seq": s,
            "half": rot_half,
            "dim": d,
            "pos_offset": 0,
            **x,
            **{k.replace("x1", "o1"): v for k, v in x.items()},
            **{k.replace("x1", "x2"): v // 4 if k.endswith("b") else v for k, v in x.items()},
            **{k.replace("x1", "o2"): v // 4 if k.endswith("b") else v for k, v in x.items()},
            "stride_cos_p": rot_half,
            "stride_pos_b": 0,
            "stride_pos_s": 1,
        }
        consts = {
            "HAS_POSITIONS": variant != "neox",
            "INTERLEAVED": variant == "interleaved",
            "COPY_TAIL": variant == "partial",
            "INVERSE": variant == "inverse",
            "BLOCK_H": 16,
            "BLOCK_F": _next_pow2(rot_half, 1),
            "BLOCK_TAIL": _next_pow2(min(d - 2 * rot_half, 64), 1),
        }
        return "apply_rope", "_apply_rope_kernel", values, consts
    if kernel == "embed":
        pe, types, positions = {
            "sinusoidal": (1, False, False),
            "table_positions": (2, False, True),
            "none_types": (0, True, False),
            "sinusoidal_types_positions": (1, True, True),
        }[variant]
        values = {
            "ids_ptr": "*i64",
            "weight_ptr": t,
            "out_ptr": t,
            "pos_ptr": "*i64",
            "omega_ptr": "*fp64",
            "pe_ptr": t,
            "type_ids_ptr": "*i64",
            "type_weight_ptr": t,
            "tokens": 8192,
            "seq": 1024,
            "dim": d,
            "half": half,
            "pos_offset": 0,
            "scale": 1.0,
            "stride_w": d,
            "stride_out": d,
            "stride_pe": d,
            "stride_tw": d,
            "stride_pos_b": 1024,
            "stride_pos_s": 1,
        }
        consts = {
            "PE_KIND": pe,
            "HAS_POSITIONS": positions,
            "HAS_TYPES": types,
            "INTERLEAVED": True,
            "BLOCK_T": 16,
            "BLOCK_D": min(256, _next_pow2(d)),
        }
        return "embed", "_embed_kernel", values, consts
    if kernel == "scatter_rows":  # embed's backward: one program per (row, column block)
        values = {
            "order_ptr": "*i64",
            "starts_ptr": "*i64",
            "rows_ptr": "*i64",
            "grad_ptr": t,
            "out_ptr": t,
            "dim": d,
            "scale": 1.0,
            "stride_grad": d,
            "stride_out": d,
        }
        return "embed", "_scatter_rows_kernel", values, {"BLOCK_D": min(256, _next_pow2(d))}
    if kernel == "merge":
        # split-KV merges fp32 parts into fp32; merge_attention merges parts in the input dtype
        part = "*fp32" if variant == "split_kv" else t
        rows = 2 * 8 * 1024
        values = {
            "part_out_ptr": part,
            "part_lse_ptr": "*fp32",
            "out_ptr": part,
            "lse_ptr": "*fp32",
            "n_parts": 4,
            "rows": rows,
            "Dv": d,
            "stride_po_part": rows * d,
            "stride_po_row": d,
            "stride_pl_part": rows,
            "stride_o_row": d,
        }
        consts = {"BLOCK_R": 16, "BLOCK_DV": _next_pow2(d)}
        return "attention", "_merge_kernel", values, consts
    if kernel in ("attention_dkdv", "attention_dq"):
        # the backward launcher widens every input to fp32; its tiles by head dim
        from fastpe.kernels.triton import attention_backward

        hq, hkv, s = 16, 4, 1024
        dkdv, dq = attention_backward.tiles(d, d)
        block_m, block_n, warps = dkdv if kernel == "attention_dkdv" else dq
        values = {
            "q_ptr": "*fp32",
            "k_ptr": "*fp32",
            "v_ptr": "*fp32",
            "do_ptr": "*fp32",
            "lse_ptr": "*fp32",
            "delta_ptr": "*fp32",
            "dq_ptr": "*fp32",
            "dk_ptr": "*fp32",
            "dv_ptr": "*fp32",
            "dtable_ptr": "*fp32",
            "mask_ptr": "*i1",
            "key_len_ptr": "*i64",
            "alibi_ptr": "*fp32",
            "bias_ptr": "*fp32",
            "Hq": hq,
            "Hkv": hkv,
            "Sq": s,
            "Sk": s,
            "D": d,
            "Dv": d,
            "query_shift": 0,
            "win_left": 2 * s + 1,
            "win_right": 0,
            "stride_mb": s * s,
            "stride_mh": 0,
            "stride_mq": s,
            "stride_mk": 1,
            "stride_ab": hq,
            "stride_ah": 1,
            "stride_biasb": hq,
            "stride_biash": 1,
            "bias_max_exact": 8,
            "bias_log_span": 2.77,
            "scale": 0.125,
            "softcap": 1.0,
        }
        everything = variant == "everything"
        consts = {
            "HAS_SOFTCAP": everything,
            "HAS_MASK": everything,
            "MASK_IS_BOOL": everything,
            "HAS_KEY_LEN": everything,
            "BOTTOM_RIGHT": True,
            "HAS_ALIBI": everything,
            "HAS_RELATIVE_BIAS": everything,
            "RELATIVE_BIAS_BUCKETS": 32,
            "RELATIVE_BIAS_BIDIRECTIONAL": True,
            "BLOCK_B": 32,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "num_warps": warps,
            "num_stages": 1,
            "BLOCK_D": _next_pow2(d),
            "BLOCK_DV": _next_pow2(d),
        }
        name = "_attention_dkdv_kernel" if kernel == "attention_dkdv" else "_attention_dq_kernel"
        return "attention_backward", name, values, consts
    if kernel == "attention_paged":
        from fastpe.kernels.triton.attention_paged import block_sizes

        block_m, block_n = block_sizes(1 if variant == "decode" else 1024, d, dtype == "float32")
        hq, hkv, rows = 32, 8, 8 * 4096
        values = {
            "q_ptr": t,
            "k_ptr": t,
            "v_ptr": t,
            "out_ptr": t,
            "lse_ptr": "*fp32",
            "q_start_ptr": "*i64",
            "q_len_ptr": "*i64",
            "k_len_ptr": "*i64",
            "page_ptr": "*i64",
            "alibi_ptr": "*fp32",
            "sinks_ptr": "*fp32",
            "Hq": hq,
            "group": hq // hkv,
            "D": d,
            "Dv": d,
            "page_size": 16,
            "keys_per_split": 4096,
            "win_left": 8193,
            "win_right": 0,
            "stride_qt": hq * d,
            "stride_qh": d,
            "stride_qd": 1,
            "stride_kr": hkv * d,
            "stride_kh": d,
            "stride_kd": 1,
            "stride_vr": hkv * d,
            "stride_vh": d,
            "stride_vd": 1,
            "stride_osplit": rows * hq * d,
            "stride_ot": hq * d,
            "stride_oh": d,
            "stride_od": 1,
            "stride_lsplit": rows * hq,
            "stride_lt": hq,
            "stride_lh": 1,
            "stride_pb": 256,
            "stride_pp": 1,
            "stride_ab": 0,
            "stride_ah": 1,
            "scale": 0.125,
            "softcap": 50.0,
        }
        everything = variant == "everything"
        consts = {
            "CAUSAL": True,
            "HAS_WINDOW": everything,
            "HAS_SOFTCAP": everything,
            "HAS_SINKS": everything,
            "BOTTOM_RIGHT": True,
            "HAS_ALIBI": everything,
            "DOT_FP32": dtype == "float32",
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "BLOCK_D": _next_pow2(d),
            "BLOCK_DV": _next_pow2(d),
        }
        return "attention_paged", "_attention_paged_kernel", values, consts
    raise ValueError(f"unknown kernel {kernel!r}")


KERNEL_VARIANTS = {
    "sinusoidal_table": ("interleaved", "concat"),
    "rope_table": ("default",),
    "apply_rope": ("neox", "interleaved", "partial", "inverse"),
    "embed": ("sinusoidal", "table_positions", "none_types", "sinusoidal_types_positions"),
    "scatter_rows": ("default",),
    "merge": ("split_kv", "merge_attention"),
    "attention_dkdv": ("causal", "everything"),
    "attention_dq": ("causal", "everything"),
    "attention_paged": ("decode", "prefill", "everything"),
}
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
                        _, _, _, consts = _kernel_specs(kernel, dtype, d, variant)
                        meta = {k: v for k, v in consts.items() if k in _BLOCK_NAMES}
                        # what the launcher passes, else Triton's defaults, 4 warps and 3 stages
                        warps, stages = consts.get("num_warps", 4), consts.get("num_stages", 3)
                        out.append(
                            Case(
                                kernel,
                                variant,
                                dtype,
                                d,
                                _config_tuple(meta, warps, stages),
                                target,
                            )
                        )
                # every feature variant where spills fail the check (fp16 compiles like bf16:
                # the main variants suffice for it), the main ones elsewhere
                every = full and target in NO_SPILL_TARGETS and dtype != "float16"
                for variant in ATTENTION_VARIANTS if every else QUICK_ATTENTION_VARIANTS:
                    if not _launched(dtype, d, variant):
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
                                _config_tuple(meta, config.num_warps, config.num_stages),
                                target,
                                pickable,
                            )
                        )
    return out


# ------------------------------------------------------------------------------------------
# compiling and reading the cubin (in the workers)


def _source(case: Case):
    """(JITFunction, signature, constexprs, attrs, options) for ``case``."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, native_specialize_impl

    config = dict(case.config)
    options = {"num_warps": config.pop("num_warps"), "num_stages": config.pop("num_stages")}
    if case.kernel == "attention":
        module, name = "attention", "_attention_kernel"
        values, consts = _attention_args(case.dtype, case.head_dim, case.variant)
    else:
        module, name, values, consts = _kernel_specs(
            case.kernel, case.dtype, case.head_dim, case.variant
        )
    launch = ("num_warps", "num_stages")  # launch options, in ``options`` already
    consts = {**{k: v for k, v in consts.items() if k not in launch}, **config}
    fn = getattr(importlib.import_module(f"fastpe.kernels.triton.{module}"), name)
    while not isinstance(fn, JITFunction):  # the autotuner wraps the JITFunction
        fn = fn.fn
    signature, constexprs, attrs = {}, dict(consts), {}
    for i, arg in enumerate(fn.arg_names):
        if arg in consts:
            signature[arg] = "constexpr"
            continue
        value = values[arg]
        if isinstance(value, str):  # a tensor: torch allocations are 16-byte aligned
            signature[arg], spec = value, "D"
        else:
            signature[arg], spec = native_specialize_impl(BaseBackend, value, False, True, True)
            if signature[arg] == "constexpr":
                constexprs[arg] = value
                continue
        if spec == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return fn, signature, constexprs, attrs, options


_RESOURCE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_TENSOR_CORE = re.compile(r"\b(HMMA|HGMMA|UTC\w*MMA|IMMA)\b")
_OPCODE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", re.M)


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
        "tensor_core": sum(n for op, n in ops.items() if _TENSOR_CORE.match(op.split(".")[0])),
        "tensor_core_ops": sorted(
            {op.split(".")[0] for op in ops if _TENSOR_CORE.match(op.split(".")[0])}
        ),
        "global_loads": loads,
        "global_stores": stores,
        "loads_128": sum(n for op, n in loads.items() if op.endswith(".128")),
        "instructions": sum(ops.values()),
    }


def _cache_key(case: Case, fn, signature, constexprs, attrs, options) -> str:
    import triton

    text = repr(
        (
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


def compile_case(case: Case, cache_dir: str | None) -> dict:
    """Compile one case and read its cubin (run in a worker with TRITON_INTERPRET=0)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    record = {"case": dataclasses.asdict(case), "key": case.key()}
    try:
        fn, signature, constexprs, attrs, options = _source(case)
    except Exception as exc:  # a spec that no longer matches the kernel's arguments
        return {**record, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    key = _cache_key(case, fn, signature, constexprs, attrs, options)
    path = os.path.join(cache_dir, key + ".json") if cache_dir else None
    if path and os.path.exists(path):
        with open(path) as f:
            return {**record, **json.load(f), "cached": True}
    start = time.perf_counter()
    try:
        compiled = triton.compile(
            ASTSource(fn, signature, constexprs, attrs),
            target=GPUTarget("cuda", case.target, 32),
            options=options,
        )
        result = {"ok": True, "error": None, "shared": compiled.metadata.shared}
        result.update(_read_cubin(compiled.asm["cubin"]))
    except Exception as exc:
        message = str(exc).strip().splitlines()
        result = {"ok": False, "error": f"{type(exc).__name__}: {' '.join(message[-3:])[:400]}"}
    result["compile_seconds"] = round(time.perf_counter() - start, 2)
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


def plan(*, full: bool, targets=tuple(TARGETS), all_configs: bool = False) -> list[Case]:
    """``cases`` computed in a worker: the attention configs come from the kernel module, which
    must be imported with TRITON_INTERPRET=0."""
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(1, mp_context=ctx, initializer=_worker_init) as pool:
        return pool.submit(
            cases, full=full, targets=tuple(targets), all_configs=all_configs
        ).result()


# ------------------------------------------------------------------------------------------
# verdicts and tables


def problems(records) -> list[str]:
    """What fails the check: a kernel that does not compile, needs more shared memory than its
    target has, or an attention config the autotuner may pick on sm_80/sm_90 that spills."""
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
        attention = case["kernel"] == "attention"
        if attention and case["pickable"] and case["target"] in NO_SPILL_TARGETS and spills:
            out.append(
                f"{r['key']}: spills ({r['registers']} registers, {r['stack_bytes']}-byte stack, "
                f"{r['spill_stores']} STL / {r['spill_loads']} LDL)"
            )
    return out


def document(records, *, full: bool, seconds: float, jobs: int) -> dict:
    import triton

    return {
        "triton": triton.__version__,
        "ptxas": subprocess.run([_bin("ptxas"), "--version"], capture_output=True, text=True)
        .stdout.strip()
        .splitlines()[-1],
        "targets": {f"sm_{k}": {"name": v[0], "shared_limit": v[1]} for k, v in TARGETS.items()},
        "full": full,
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


def format_markdown(doc: dict) -> str:
    recs = doc["records"]
    lines = [
        "# Triton kernels compiled ahead of time (no GPU)",
        "",
        f"Triton {doc['triton']}, {doc['ptxas']}. Written by `fastpe triton-report"
        f"{' --full' if doc['full'] else ''}` in {doc['wall_seconds']} s on {doc['jobs']} "
        f"worker(s) ({doc['compiled']} of {len(recs)} compiled, the rest from the cache; "
        f"compiling all of them takes {doc.get('compile_seconds_total', 0) / 60:.0f} "
        "worker-minutes).",
        "Registers and stack from `cuobjdump --dump-resource-usage` (a stack frame and STL/LDL "
        "mean spilled registers); shared memory = Triton's dynamic allocation + static, against "
        "the target's per-block limit; tensor-core instructions (HMMA sm_80, HGMMA sm_90, "
        "UTC*MMA sm_100) counted in `nvdisasm` SASS. fp32 attention uses IEEE fp32 dots "
        "(no tensor cores, by design). *pick*: the autotuner may choose the config on that "
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
        "spill ST/LD | max smem KB / limit | tensor-core instr | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
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
            stats = f"{regs} | {stack} | {st}/{ld} | {smem / 1024:.0f} / {limit // 1024} | {tc}"
        else:
            stats = "| | | | "
        verdict = "yes" if len(ok) == len(rs) else f"{len(rs) - len(ok)} fail"
        lines.append(
            f"| sm_{target} | {dtype} | {d} | {label} | {'yes' if pick else 'no'} | {len(rs)} | "
            f"{stats} | {verdict} |"
        )
    lines += [
        "",
        "## Memory-bound kernels (launcher's block sizes; worst over variants)",
        "",
        "| target | kernel | dtype | D | config | variants | max regs | max stack B | "
        "smem KB | global loads (SASS) | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups = {}
    for r in recs:
        c = r["case"]
        if c["kernel"] == "attention":
            continue
        groups.setdefault(
            (c["target"], c["kernel"], c["dtype"], c["head_dim"], Case(**c).config_label), []
        ).append(r)
    for (target, kernel, dtype, d, label), rs in groups.items():
        ok = [r for r in rs if r["ok"]]
        loads = "; ".join(sorted({_fmt_loads(r) for r in ok}))
        if ok:
            stats = (
                f"{max(r['registers'] for r in ok)} | {max(r['stack_bytes'] for r in ok)} | "
                f"{max(r['shared'] + r['static_shared'] for r in ok) / 1024:.1f}"
            )
        else:
            stats = "| |"
        verdict = "yes" if len(ok) == len(rs) else f"{len(rs) - len(ok)} fail"
        lines.append(
            f"| sm_{target} | {kernel} | {dtype} | {d} | {label} | {len(rs)} | {stats} | {loads} | {verdict} |"
        )
    return "\n".join(lines) + "\n"
