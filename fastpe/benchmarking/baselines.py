"""The baselines fastpe is compared with: what a user would otherwise run.

NumPy and torch eager recipes, transformers' ``apply_rotary_pos_emb``, ``torch.nn.functional.
scaled_dot_product_attention``, and on GPU flash-attn / Liger when importable. ``BASELINES`` lists
them per op, in the order the tables show them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import fastpe
from fastpe._options import AttentionOptions

from .cases import Case


@dataclass(frozen=True)
class Baseline:
    name: str
    module: str  # must be importable for the baseline to run
    build: Callable[[Case, dict], Callable]  # (case, inputs) -> zero-argument callable
    devices: frozenset[str] | None = None  # device types it runs on (None: any)
    dtypes: frozenset[str] | None = None  # input dtypes it takes (None: any)
    # (case) -> why it cannot compute this case (an option it lacks), or None
    cannot_run: Callable[[Case], str | None] = lambda case: None
    requires: tuple[str, ...] = ()  # other modules it imports (transformers' RoPE: torch)

    @property
    def modules(self) -> tuple[str, ...]:
        return (self.module, *self.requires)

    def cannot_take(self, dtype: str) -> str | None:
        """Why this baseline cannot be timed with ``dtype`` inputs, or None."""
        if self.dtypes is None or dtype in self.dtypes:
            return None
        return f"takes {', '.join(sorted(self.dtypes))} inputs, not {dtype}"


# NumPy recipes: what a NumPy user writes (the float32 recipe for tables, gather + add for embed)


def _numpy_sinusoidal(case: Case, x: dict):
    p = case.params

    def table():
        pos = np.arange(p.get("offset", 0), p.get("offset", 0) + p["positions"], dtype=np.float32)
        div = np.exp(
            np.arange(0, p["dim"], 2, dtype=np.float32) * np.float32(-math.log(10000.0) / p["dim"])
        )
        pe = np.empty((p["positions"], p["dim"]), np.float32)
        pe[:, 0::2] = np.sin(pos[:, None] * div)
        pe[:, 1::2] = np.cos(pos[:, None] * div)
        return pe

    return table


def _numpy_embed(case: Case, x: dict):
    p = case.params
    # the inputs are torch tensors on the CPU, or NumPy arrays when torch is not installed
    w, ids = np.asarray(x["weight"]), np.asarray(x["ids"])
    pe = fastpe.sinusoidal_table(p["seq"], p["dim"]).astype(w.dtype)
    scale = np.float32(math.sqrt(p["dim"]))
    return lambda: w[ids] * scale + pe


# torch eager recipes (tables computed in float32, columns written strided)


def _torch_sinusoidal(case: Case, x: dict):
    import torch

    p = case.params

    def table():
        start = p.get("offset", 0)
        pos = torch.arange(start, start + p["positions"], dtype=torch.float32)[:, None]
        div = torch.exp(
            torch.arange(0, p["dim"], 2, dtype=torch.float32) * (-math.log(10000.0) / p["dim"])
        )
        pe = torch.zeros(p["positions"], p["dim"])
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        return pe

    return table


def _torch_rope_table(case: Case, x: dict):
    import torch

    p = case.params

    def rope():
        r = p["rotary_dim"]
        inv = 1.0 / (10000.0 ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
        freqs = torch.outer(torch.arange(p["positions"], dtype=torch.float32), inv)
        return freqs.cos(), freqs.sin()

    return rope


def _torch_embed(case: Case, x: dict):
    import torch

    p = case.params
    scale = math.sqrt(p["dim"])
    pe = torch.from_numpy(fastpe.sinusoidal_table(p["seq"], p["dim"])).to(x["weight"])
    return lambda: x["weight"][x["ids"]] * scale + pe


def _nn_embedding(case: Case, x: dict):
    """``nn.Embedding`` + PE: what a model's embedding layer runs (its backward is torch's
    embedding_dense_backward, not index_put's)."""
    import torch

    p = case.params
    scale = math.sqrt(p["dim"])
    pe = torch.from_numpy(fastpe.sinusoidal_table(p["seq"], p["dim"])).to(x["weight"])
    return lambda: torch.nn.functional.embedding(x["ids"], x["weight"]) * scale + pe


def _forward_only(case: Case) -> str | None:
    return None if case.mode == "forward" else "NumPy has no autograd"


def _transformers_rope(case: Case, x: dict):
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos = torch.cat([x["cos"], x["cos"]], -1)[None].to(x["q"].dtype)  # HF's duplicated [1, S, D]
    sin = torch.cat([x["sin"], x["sin"]], -1)[None].to(x["q"].dtype)
    return lambda: apply_rotary_pos_emb(x["q"], x["k"], cos, sin)


def _torch_sdpa(case: Case, x: dict):
    import torch
    import torch.nn.functional as F

    b, hq, hkv, sq, sk, d = case.params["shape"]
    window = case.params.get("window")
    if window:  # the equivalent boolean mask, built once outside the timing (bottom-right)
        qpos = torch.arange(sq, device=x["q"].device)[:, None] + (sk - sq)
        j = torch.arange(sk, device=x["q"].device)[None, :]
        mask = (j > qpos - window) & (j <= qpos)  # the last `window` keys
        return lambda: F.scaled_dot_product_attention(
            x["q"], x["k"], x["v"], attn_mask=mask, enable_gqa=hq != hkv
        )
    # SDPA's is_causal is top-left aligned: equal to fastpe's bottom-right when Sq == Sk; for one
    # decoding query every key is visible, i.e. no mask.
    causal = case.params["causal"] and sq == sk
    return lambda: F.scaled_dot_product_attention(
        x["q"], x["k"], x["v"], is_causal=causal, enable_gqa=hq != hkv
    )


# The attention options torch SDPA can express: is_causal, and a window as a boolean mask
_SDPA_OPTIONS = frozenset({"causal", "window"})


def _sdpa_cannot_run(case: Case) -> str | None:
    missing = [
        name
        for name in AttentionOptions.FEATURES
        if case.params.get(name) and name not in _SDPA_OPTIONS
    ]
    return f"SDPA has no {' or '.join(missing)}" if missing else None


def _flash_attn(case: Case, x: dict):
    from flash_attn import flash_attn_func  # optional, GPU only

    q, k, v = (t.transpose(1, 2).contiguous() for t in (x["q"], x["k"], x["v"]))  # [B, S, H, D]
    return lambda: flash_attn_func(q, k, v, causal=case.params["causal"])


def _liger_rope(case: Case, x: dict):
    from liger_kernel.ops.rope import LigerRopeFunction  # optional, GPU only

    cos = x["cos"].repeat(1, 2)[None].to(x["q"].dtype)
    sin = x["sin"].repeat(1, 2)[None].to(x["q"].dtype)
    return lambda: LigerRopeFunction.apply(x["q"], x["k"], cos, sin)


_CPU, _CUDA = frozenset({"cpu"}), frozenset({"cuda"})
_NUMPY_DTYPES = frozenset({"float16", "float32", "float64"})  # NumPy has no bfloat16
_HALF = frozenset({"float16", "bfloat16"})  # flash-attn's kernels

BASELINES: dict[str, tuple[Baseline, ...]] = {
    "sinusoidal_table": (
        Baseline("numpy", "numpy", _numpy_sinusoidal, dtypes=_NUMPY_DTYPES),
        Baseline("torch eager", "torch", _torch_sinusoidal),
    ),
    "rope_table": (Baseline("torch eager", "torch", _torch_rope_table),),
    "apply_rope": (
        Baseline("transformers", "transformers", _transformers_rope, requires=("torch",)),
        Baseline("liger", "liger_kernel", _liger_rope, devices=_CUDA, requires=("torch",)),
    ),
    "embed": (
        # reads the tensors' memory
        Baseline(
            "numpy",
            "numpy",
            _numpy_embed,
            devices=_CPU,
            dtypes=_NUMPY_DTYPES,
            cannot_run=_forward_only,
        ),
        Baseline("torch eager", "torch", _torch_embed),
        Baseline("nn.Embedding", "torch", _nn_embedding),
    ),
    "attention": (
        Baseline("torch SDPA", "torch", _torch_sdpa, cannot_run=_sdpa_cannot_run),
        Baseline(
            "flash-attn",
            "flash_attn",
            _flash_attn,
            devices=_CUDA,
            dtypes=_HALF,
            requires=("torch",),
        ),
    ),
}

# What to pip install for a module a baseline needs, where the names differ
PIP_NAMES = {"flash_attn": "flash-attn", "liger_kernel": "liger-kernel"}


def install_hint(module: str) -> str:
    return f"pip install {PIP_NAMES.get(module, module)}"


# The baseline each op's speed target is stated against (what users run today).
TARGET_BASELINE = {
    "sinusoidal_table": "torch eager",
    "rope_table": "torch eager",
    "apply_rope": "transformers",
    "embed": "torch eager",
    "attention": "torch SDPA",
    "generate": "sdpa",  # `fastpe bench --ops generate`: transformers' attn_implementation="sdpa"
}
# where the target of the backward and full modes is another baseline
_GRAD_TARGET_BASELINE = {"embed": "nn.Embedding"}


def target_baseline(op: str, mode: str = "forward") -> str | None:
    """The baseline ``op``'s speed target in ``mode`` is stated against."""
    if mode != "forward" and op in _GRAD_TARGET_BASELINE:
        return _GRAD_TARGET_BASELINE[op]
    return TARGET_BASELINE.get(op)
