"""The benchmark grid, the baselines fastpe is compared with, and the machine's measured peaks.

Shared by the pytest-benchmark suites in ``bench/`` and by ``fastpe bench``, so both time the
same cases against the same baselines. Baselines are what a user would otherwise run: NumPy and
torch eager recipes, transformers' ``apply_rotary_pos_emb``, ``torch.nn.functional.
scaled_dot_product_attention``, and on GPU flash-attn / Liger when importable.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

import fastpe
from fastpe.backends import unavailable_reason


@dataclass(frozen=True)
class Case:
    op: str  # "sinusoidal_table" | "rope_table" | "apply_rope" | "embed" | "attention"
    label: str  # shape and options, for tables
    seq: int  # sequence length, the x axis of the plot
    params: dict = field(default_factory=dict)
    series: str = ""  # cases of one series differ only in length: joined by a line in the plot

    @property
    def name(self) -> str:
        return f"{self.op} {self.label}"


def _attn(b, hq, hkv, sq, sk, d, causal):
    label = f"B{b} H{hq}/{hkv} Sq{sq} Sk{sk} D{d}" + (" causal" if causal else "")
    kind = "decode" if sq == 1 else "causal" if causal else "non-causal"
    series = f"{kind} B{b} H{hq}/{hkv} D{d}"
    return Case(
        "attention", label, sk, {"shape": (b, hq, hkv, sq, sk, d), "causal": causal}, series
    )


# The target cases (full grid) and a sequence-length sweep for the plot.
FULL_GRID = [
    Case("sinusoidal_table", "8192 x 1024", 8192, {"positions": 8192, "dim": 1024}),
    Case("sinusoidal_table", "512 x 1024 at 2^20", 512, {"positions": 512, "dim": 1024, "offset": 2**20 - 512}),
    Case("rope_table", "8192 x 128", 8192, {"positions": 8192, "rotary_dim": 128}),
    *[Case("apply_rope", f"q32+k8 S{s} D128", s, {"seq": s, "q_heads": 32, "k_heads": 8, "dim": 128})
      for s in (1024, 4096)],
    *[Case("embed", f"8x{s} vocab 32000 d1024", s, {"batch": 8, "seq": s, "vocab": 32000, "dim": 1024})
      for s in (512, 2048)],
    _attn(1, 16, 16, 1024, 1024, 64, False),
    *[_attn(1, 16, 16, s, s, 64, True) for s in (512, 1024, 2048)],
    _attn(1, 8, 8, 4096, 4096, 128, True),
    _attn(4, 16, 16, 512, 512, 64, True),
    _attn(8, 32, 8, 1, 4096, 128, True),
]  # fmt: skip

QUICK_GRID = [
    Case("sinusoidal_table", "2048 x 512", 2048, {"positions": 2048, "dim": 512}),
    Case("rope_table", "2048 x 128", 2048, {"positions": 2048, "rotary_dim": 128}),
    Case("apply_rope", "q32+k8 S512 D128", 512, {"seq": 512, "q_heads": 32, "k_heads": 8, "dim": 128}),
    Case("embed", "4x512 vocab 32000 d1024", 512, {"batch": 4, "seq": 512, "vocab": 32000, "dim": 1024}),
    _attn(1, 8, 8, 512, 512, 64, False),
    _attn(1, 8, 8, 512, 512, 64, True),
    _attn(4, 32, 8, 1, 2048, 128, True),
]  # fmt: skip

# Tiny shapes for `pytest bench --benchmark-disable` (the CI smoke run): every op, every impl.
SMOKE_GRID = [
    Case("sinusoidal_table", "64 x 32", 64, {"positions": 64, "dim": 32}),
    Case("rope_table", "64 x 16", 64, {"positions": 64, "rotary_dim": 16}),
    Case("apply_rope", "q4+k2 S32 D16", 32, {"seq": 32, "q_heads": 4, "k_heads": 2, "dim": 16}),
    Case("embed", "2x16 vocab 100 d32", 16, {"batch": 2, "seq": 16, "vocab": 100, "dim": 32}),
    _attn(1, 4, 2, 32, 32, 16, True),
    _attn(2, 4, 2, 1, 64, 16, True),
]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Inputs, work and the oracle's answer for a case


def make_inputs(case: Case, device: str = "cpu", dtype: str = "float32") -> dict:
    """Random inputs for ``case`` as torch tensors on ``device`` (NumPy arrays if torch is absent)."""
    rng = np.random.default_rng(0)
    p = case.params
    arrays: dict = {}
    if case.op == "apply_rope":
        arrays["q"] = rng.standard_normal((1, p["q_heads"], p["seq"], p["dim"]))
        arrays["k"] = rng.standard_normal((1, p["k_heads"], p["seq"], p["dim"]))
        cos, sin = fastpe.rope_table(p["seq"], p["dim"], dtype="float64", backend="numpy")
        arrays["cos"], arrays["sin"] = cos, sin
    elif case.op == "embed":
        arrays["ids"] = rng.integers(0, p["vocab"], size=(p["batch"], p["seq"]))
        arrays["weight"] = rng.standard_normal((p["vocab"], p["dim"]))
    elif case.op == "attention":
        b, hq, hkv, sq, sk, d = p["shape"]
        arrays["q"] = rng.standard_normal((b, hq, sq, d))
        arrays["k"] = rng.standard_normal((b, hkv, sk, d))
        arrays["v"] = rng.standard_normal((b, hkv, sk, d))
    try:
        import torch
    except ImportError:
        return {k: a.astype(dtype) if a.dtype.kind == "f" else a for k, a in arrays.items()}
    tdtype = getattr(torch, dtype)
    return {
        k: torch.from_numpy(a).to(
            device=device, dtype=tdtype if a.dtype.kind == "f" else torch.int64
        )
        for k, a in arrays.items()
    }


def work(case: Case, itemsize: int = 4) -> tuple[float, str]:
    """(amount, unit): bytes that must move for memory-bound ops, FLOPs for attention."""
    p = case.params
    if case.op == "sinusoidal_table":
        return p["positions"] * p["dim"] * itemsize, "GB/s"
    if case.op == "rope_table":
        return p["positions"] * p["rotary_dim"] * itemsize, "GB/s"  # two [P, R/2] tables
    if case.op == "apply_rope":
        return 2 * (p["q_heads"] + p["k_heads"]) * p["seq"] * p[
            "dim"
        ] * itemsize, "GB/s"  # read+write
    if case.op == "embed":
        return 2 * p["batch"] * p["seq"] * p["dim"] * itemsize, "GB/s"  # gathered rows + output
    b, hq, _, sq, sk, d = p["shape"]
    # 4·B·H·D per visible (query, key) pair: Sq·Sk, or the bottom-right causal triangle
    pairs = sum(min(sk, i + 1 + sk - sq) for i in range(sq)) if case.params["causal"] else sq * sk
    return 4.0 * b * hq * d * pairs, "GFLOP/s"


def reference(case: Case, inputs: dict):
    """The float64 oracle's answer (attention: the first kv head's query group of batch 0, since
    heads are independent and the full oracle would materialise [B, H, Sq, Sk] in float64)."""
    p = case.params
    o = {"backend": "numpy"}
    if case.op == "sinusoidal_table":
        return fastpe.sinusoidal_table(
            p["positions"], p["dim"], offset=p.get("offset", 0), dtype="float64", **o
        )
    if case.op == "rope_table":
        return fastpe.rope_table(p["positions"], p["rotary_dim"], dtype="float64", **o)
    if case.op == "apply_rope":
        return tuple(
            fastpe.apply_rope(inputs[n], inputs["cos"], inputs["sin"], **o) for n in ("q", "k")
        )
    if case.op == "embed":
        return fastpe.embed(inputs["ids"], inputs["weight"], scale=math.sqrt(p["dim"]), **o)
    group = p["shape"][1] // p["shape"][2]
    q, k, v = inputs["q"][:1, :group], inputs["k"][:1, :1], inputs["v"][:1, :1]
    return fastpe.attention(q, k, v, causal=p["causal"], **o)


def max_error(case: Case, result, expected) -> float:
    if case.op == "attention":
        group = case.params["shape"][1] // case.params["shape"][2]
        result = result[:1, :group]
    pairs = (
        zip(result, expected, strict=True) if isinstance(expected, tuple) else [(result, expected)]
    )
    worst = 0.0
    for got, want in pairs:
        got = (
            got.detach().cpu().double().numpy()
            if hasattr(got, "detach")
            else np.asarray(got, np.float64)
        )
        worst = max(worst, float(np.max(np.abs(got - np.asarray(want, np.float64)), initial=0.0)))
    return worst


# ---------------------------------------------------------------------------------------------
# Implementations: name -> builder(case, inputs) -> zero-argument callable


def _fastpe(backend: str) -> Callable:
    def build(case: Case, x: dict):
        p = case.params
        b = {"backend": backend}
        if case.op == "sinusoidal_table":
            device = "cpu" if backend != "triton" else "cuda"
            return lambda: fastpe.sinusoidal_table(p["positions"], p["dim"], offset=p.get("offset", 0),
                                                   device=device, **b)  # fmt: skip
        if case.op == "rope_table":
            device = "cpu" if backend != "triton" else "cuda"
            return lambda: fastpe.rope_table(p["positions"], p["rotary_dim"], device=device, **b)
        if case.op == "apply_rope":
            cos, sin = x["cos"].float(), x["sin"].float()
            return lambda: fastpe.apply_rope((x["q"], x["k"]), cos, sin, **b)  # one call, as HF's
        if case.op == "embed":
            return lambda: fastpe.embed(x["ids"], x["weight"], scale=math.sqrt(p["dim"]), **b)
        return lambda: fastpe.attention(x["q"], x["k"], x["v"], causal=p["causal"], **b)

    return build


def _torch_eager(case: Case, x: dict):
    """The usual torch recipes (tables computed in float32, columns written strided)."""
    import torch

    p = case.params
    if case.op == "sinusoidal_table":

        def table():  # fmt: skip
            pos = torch.arange(
                p.get("offset", 0), p.get("offset", 0) + p["positions"], dtype=torch.float32
            )[:, None]
            div = torch.exp(
                torch.arange(0, p["dim"], 2, dtype=torch.float32) * (-math.log(10000.0) / p["dim"])
            )
            pe = torch.zeros(p["positions"], p["dim"])
            pe[:, 0::2] = torch.sin(pos * div)
            pe[:, 1::2] = torch.cos(pos * div)
            return pe

        return table
    if case.op == "rope_table":

        def rope():  # fmt: skip
            inv = 1.0 / (
                10000.0
                ** (torch.arange(0, p["rotary_dim"], 2, dtype=torch.float32) / p["rotary_dim"])
            )
            freqs = torch.outer(torch.arange(p["positions"], dtype=torch.float32), inv)
            return freqs.cos(), freqs.sin()

        return rope
    if case.op == "embed":
        scale = math.sqrt(p["dim"])
        pe = torch.from_numpy(fastpe.sinusoidal_table(p["seq"], p["dim"])).to(x["weight"])
        return lambda: x["weight"][x["ids"]] * scale + pe
    return None


def _transformers_rope(case: Case, x: dict):
    if case.op != "apply_rope":
        return None
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos = torch.cat([x["cos"], x["cos"]], -1)[None].to(x["q"].dtype)  # HF's duplicated [1, S, D]
    sin = torch.cat([x["sin"], x["sin"]], -1)[None].to(x["q"].dtype)
    return lambda: apply_rotary_pos_emb(x["q"], x["k"], cos, sin)


def _torch_sdpa(case: Case, x: dict):
    if case.op != "attention":
        return None
    import torch.nn.functional as F

    b, hq, hkv, sq, sk, d = case.params["shape"]
    # SDPA's is_causal is top-left aligned: equal to fastpe's bottom-right when Sq == Sk; for one
    # decoding query every key is visible, i.e. no mask.
    causal = case.params["causal"] and sq == sk
    return lambda: F.scaled_dot_product_attention(
        x["q"], x["k"], x["v"], is_causal=causal, enable_gqa=hq != hkv
    )


def _numpy_recipe(case: Case, x: dict):
    """What a NumPy user writes: the float32 recipe for tables, gather + add for embed."""
    p = case.params
    if case.op == "sinusoidal_table":

        def table():  # fmt: skip
            pos = np.arange(
                p.get("offset", 0), p.get("offset", 0) + p["positions"], dtype=np.float32
            )[:, None]
            div = np.exp(
                np.arange(0, p["dim"], 2, dtype=np.float32)
                * np.float32(-math.log(10000.0) / p["dim"])
            )
            pe = np.empty((p["positions"], p["dim"]), np.float32)
            pe[:, 0::2] = np.sin(pos * div)
            pe[:, 1::2] = np.cos(pos * div)
            return pe

        return table
    if case.op == "embed" and x["weight"].device.type == "cpu":
        w, ids = x["weight"].numpy(), x["ids"].numpy()
        pe = fastpe.sinusoidal_table(p["seq"], p["dim"]).astype(w.dtype)
        scale = np.float32(math.sqrt(p["dim"]))
        return lambda: w[ids] * scale + pe
    return None


def _flash_attn(case: Case, x: dict):
    if case.op != "attention" or x["q"].device.type != "cuda":
        return None
    from flash_attn import flash_attn_func  # noqa: PLC0415 - optional, GPU only

    q, k, v = (t.transpose(1, 2).contiguous() for t in (x["q"], x["k"], x["v"]))  # [B, S, H, D]
    return lambda: flash_attn_func(q, k, v, causal=case.params["causal"])


def _liger_rope(case: Case, x: dict):
    if case.op != "apply_rope" or x["q"].device.type != "cuda":
        return None
    from liger_kernel.ops.rope import LigerRopeFunction  # noqa: PLC0415 - optional, GPU only

    cos = x["cos"].repeat(1, 2)[None].to(x["q"].dtype)
    sin = x["sin"].repeat(1, 2)[None].to(x["q"].dtype)
    return lambda: LigerRopeFunction.apply(x["q"], x["k"], cos, sin)


BASELINES: dict[str, tuple[str, frozenset[str], Callable]] = {
    # name: (module that must import, ops it has, builder)
    "numpy": ("numpy", frozenset({"sinusoidal_table", "embed"}), _numpy_recipe),
    "torch eager": ("torch", frozenset({"sinusoidal_table", "rope_table", "embed"}), _torch_eager),
    "transformers": ("transformers", frozenset({"apply_rope"}), _transformers_rope),
    "torch SDPA": ("torch", frozenset({"attention"}), _torch_sdpa),
    "flash-attn": ("flash_attn", frozenset({"attention"}), _flash_attn),
    "liger": ("liger_kernel", frozenset({"apply_rope"}), _liger_rope),
}
FASTPE_IMPLS = ("fastpe[numba]", "fastpe[triton]")


def implementation_names(op: str) -> list[str]:
    """Every implementation that could time ``op`` (whether it runs here is decided later)."""
    return [*FASTPE_IMPLS, *(name for name, (_, ops, _) in BASELINES.items() if op in ops)]


def implementations(case: Case, inputs: dict, device: str = "cpu") -> dict[str, Callable]:
    """Every runnable implementation of ``case``: fastpe's kernel backends and the baselines."""
    import importlib.util

    found: dict[str, Callable] = {}
    for backend in ("numba", "triton"):
        device_type = "cuda" if backend == "triton" else "cpu"
        if device_type != device.split(":")[0] or unavailable_reason(backend):
            continue
        found[f"fastpe[{backend}]"] = _fastpe(backend)(case, inputs)
    for name, (module, ops, builder) in BASELINES.items():
        if case.op not in ops or importlib.util.find_spec(module) is None:
            continue
        fn = builder(case, inputs)
        if fn is not None:
            found[name] = fn
    return found


# ---------------------------------------------------------------------------------------------
# Timing and machine peaks


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def time_callable(
    fn: Callable, device: str = "cpu", *, min_time: float = 0.3, max_runs: int = 50
) -> float:
    """Median seconds per call after a warm-up call (compilation, autotuning, caches)."""
    fn()
    synchronize(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < max_runs):
        t = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_peaks() -> dict[str, float]:
    """This machine's float32 matmul GFLOP/s (NumPy's BLAS) and copy bandwidth GB/s, measured now."""
    a = np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32)
    gemm = time_callable(lambda: a @ a, min_time=0.5)
    src = np.ones(32 * 2**20, np.float32)  # 128 MiB, well past the caches
    dst = np.empty_like(src)
    copy = time_callable(lambda: np.copyto(dst, src), min_time=0.5)
    return {"sgemm_gflops": 2 * 2048**3 / gemm / 1e9, "copy_gbps": 2 * src.nbytes / copy / 1e9}
