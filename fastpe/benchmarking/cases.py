"""What is benchmarked: the Case record, the grids, and per op how to run it and check it.

``OPS`` holds one ``OpSpec`` per op: random inputs, the work a call does, the float64 oracle's
answer and fastpe's own call. Adding an op to the benchmark means adding one entry there (and its
baselines in ``baselines.py``).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

import fastpe

# What a case times, as Liger-Kernel reports it: the call ("forward"), the gradients of an
# already recorded call ("backward": torch.autograd.grad with retain_graph, so nothing is
# accumulated into .grad), or both ("full"). A case's mode is ``params["mode"]`` (absent:
# forward); ops whose OpSpec lists ``grad_inputs`` can be timed in every mode.
MODES = ("forward", "backward", "full")


@dataclass(frozen=True)
class Case:
    op: str  # a key of OPS
    label: str  # shape and options, for tables
    seq: int  # sequence length
    params: dict = field(default_factory=dict)
    series: str = ""  # cases of one series differ only in length (kept in the results JSON)

    @property
    def name(self) -> str:
        return f"{self.op} {self.label}"

    @property
    def mode(self) -> str:
        return self.params.get("mode", "forward")


def with_mode(case: Case, mode: str) -> Case:
    """``case`` timed in ``mode`` (a label and series of its own, so tables and plots keep the
    modes apart)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "forward":
        return case
    if not OPS[case.op].grad_inputs:
        raise ValueError(f"{case.op} has no backward to time in mode {mode!r}")
    series = f"{case.series} {mode}" if case.series else mode
    return Case(case.op, f"{case.label} {mode}", case.seq, {**case.params, "mode": mode}, series)


def in_modes(grid, modes) -> list[Case]:
    """Every case of ``grid`` in each of ``modes`` that its op has (forward always)."""
    return [with_mode(c, m) for c in grid for m in modes if m == "forward" or OPS[c.op].grad_inputs]


def _attn(b, hq, hkv, sq, sk, d, causal, window=None, softcap=None, sinks=False, mode="forward"):
    """``window=W``: the last W keys up to each query (``window=(W - 1, 0)``, transformers'
    sliding_window=W); ``mode``: as ``with_mode`` names it."""
    options = (
        (f" window{window}" if window else "")
        + (f" softcap{softcap:g}" if softcap else "")
        + (" sinks" if sinks else "")
    )
    label = f"B{b} H{hq}/{hkv} Sq{sq} Sk{sk} D{d}" + (" causal" if causal else "") + options
    kind = "decode" if sq == 1 else "causal" if causal else "non-causal"
    series = f"{kind}{options} B{b} H{hq}/{hkv} D{d}"
    params = {
        "shape": (b, hq, hkv, sq, sk, d),
        "causal": causal,
        "window": window,
        "softcap": softcap,
        "sinks": sinks,
    }
    if mode != "forward":
        label, series = f"{label} {mode}", f"{series} {mode}"
        params["mode"] = mode
    return Case("attention", label, sk, params, series)


# The target cases (full grid) and a sequence-length sweep for the plot.
FULL_GRID = [
    Case("sinusoidal_table", "8192 x 1024", 8192, {"positions": 8192, "dim": 1024}),
    Case(
        "sinusoidal_table",
        "512 x 1024 at 2^20",
        512,
        {"positions": 512, "dim": 1024, "offset": 2**20 - 512},
    ),
    Case("rope_table", "8192 x 128", 8192, {"positions": 8192, "rotary_dim": 128}),
    *[
        Case(
            "apply_rope",
            f"q32+k8 S{s} D128",
            s,
            {"seq": s, "q_heads": 32, "k_heads": 8, "dim": 128},
        )
        for s in (1024, 4096)
    ],
    *[
        Case(
            "embed",
            f"8x{s} vocab 32000 d1024",
            s,
            {"batch": 8, "seq": s, "vocab": 32000, "dim": 1024},
        )
        for s in (512, 2048)
    ],
    _attn(1, 16, 16, 1024, 1024, 64, False),
    *[_attn(1, 16, 16, s, s, 64, True) for s in (512, 1024, 2048)],
    _attn(1, 8, 8, 4096, 4096, 128, True),
    _attn(4, 16, 16, 512, 512, 64, True),
    _attn(8, 32, 8, 1, 4096, 128, True),
    # issue 12: one decode step of one layer (q and k rotated by one call at position 700 of a
    # 4096-row table; one query against Sk keys), where per-call overhead and the start of a
    # parallel region weigh as much as the work
    Case(
        "apply_rope",
        "q32+k8 S1 D128 at 700 (one token)",
        1,
        {"seq": 1, "q_heads": 32, "k_heads": 8, "dim": 128, "position": 700},
    ),
    *[_attn(1, 32, 8, 1, sk, 128, True) for sk in (512, 4096)],
    # issue 13: a sliding window costs S·W (compare with the full-causal row at S8192), and
    # soft-capping / sinks cost little over the same call without them
    _attn(1, 16, 16, 8192, 8192, 64, True),
    _attn(1, 16, 16, 8192, 8192, 64, True, window=1024),
    _attn(1, 16, 16, 8192, 8192, 64, True, window=1024, softcap=50.0),
    _attn(1, 16, 16, 8192, 8192, 64, True, window=1024, sinks=True),
]

QUICK_GRID = [
    Case("sinusoidal_table", "2048 x 512", 2048, {"positions": 2048, "dim": 512}),
    Case("rope_table", "2048 x 128", 2048, {"positions": 2048, "rotary_dim": 128}),
    Case(
        "apply_rope", "q32+k8 S512 D128", 512, {"seq": 512, "q_heads": 32, "k_heads": 8, "dim": 128}
    ),
    Case(
        "embed",
        "4x512 vocab 32000 d1024",
        512,
        {"batch": 4, "seq": 512, "vocab": 32000, "dim": 1024},
    ),
    _attn(1, 8, 8, 512, 512, 64, False),
    _attn(1, 8, 8, 512, 512, 64, True),
    _attn(4, 32, 8, 1, 2048, 128, True),
    _attn(1, 8, 8, 2048, 2048, 64, True, window=256),
]

# Tiny shapes for `pytest bench --benchmark-disable` (the CI smoke run): every op, every impl,
# every mode.
SMOKE_GRID = [
    Case("sinusoidal_table", "64 x 32", 64, {"positions": 64, "dim": 32}),
    Case("rope_table", "64 x 16", 64, {"positions": 64, "rotary_dim": 16}),
    *[
        Case(op, label, seq, {**params, "mode": m})
        for op, label, seq, params in (
            ("apply_rope", "q4+k2 S32 D16", 32, {"seq": 32, "q_heads": 4, "k_heads": 2, "dim": 16}),
            ("embed", "2x16 vocab 100 d32", 16, {"batch": 2, "seq": 16, "vocab": 100, "dim": 32}),
        )
        for m in MODES
    ],
    _attn(1, 4, 2, 32, 32, 16, True),
    _attn(2, 4, 2, 1, 64, 16, True),
    _attn(1, 4, 2, 48, 48, 16, True, window=8, softcap=5.0, sinks=True),
    *[_attn(1, 4, 2, 32, 32, 16, causal, mode=m) for causal in (False, True) for m in MODES[1:]],
]


# ---------------------------------------------------------------------------------------------
# Per op: inputs, work, the oracle's answer and fastpe's call


@dataclass(frozen=True)
class OpSpec:
    # (params, rng) -> float64/int64 NumPy arrays by name; make_inputs casts and moves them
    arrays: Callable[[dict, np.random.Generator], dict]
    # (params, itemsize) -> (amount, unit): bytes that must move, or FLOPs for attention
    work: Callable[[dict, int], tuple[float, str]]
    # (params, inputs) -> the float64 oracle's answer (or the part of it `compared` keeps)
    reference: Callable[[dict, dict], object]
    # (params, inputs, backend, device) -> zero-argument callable running fastpe's kernel
    fastpe: Callable[[dict, dict, str, str], Callable]
    # (params, result) -> the part of a result that is compared with `reference`
    compared: Callable[[dict, object], object] = lambda p, result: result
    # (params) -> magnitude of the outputs, which scales the error tolerance of the bench suites
    error_scale: Callable[[dict], float] = lambda p: 1.0
    # inputs (names in `arrays`) that get gradients in the backward and full modes; () when the
    # op has no backward
    grad_inputs: tuple[str, ...] = ()
    # work of the backward pass as a multiple of the forward's (full mode: 1 + this)
    backward_work: float = 1.0
    # (params, inputs) -> the oracle's gradients of `grad_inputs` (or the part of them
    # `compared_grads` keeps) for the upstream gradients of `upstream_gradients`; None: the
    # oracle's whole call under autograd
    grad_reference: Callable[[dict, dict], tuple] | None = None
    # (params, gradients) -> the part of a gradient tuple that is compared with `grad_reference`
    compared_grads: Callable[[dict, tuple], tuple] = lambda p, grads: grads


_ORACLE = {"backend": "numpy"}


def _no_arrays(p, rng):
    return {}


def _rope_arrays(p, rng):
    q = rng.standard_normal((1, p["q_heads"], p["seq"], p["dim"]))
    k = rng.standard_normal((1, p["k_heads"], p["seq"], p["dim"]))
    # "position": tokens at position … position + seq - 1 of a 4096-row table (a decode step);
    # "cos"/"sin" are the rows used, which transformers' baseline receives already gathered
    start = p.get("position", 0)
    rows = 4096 if "position" in p else p["seq"]
    table_cos, table_sin = fastpe.rope_table(rows, p["dim"], dtype="float64", backend="numpy")
    arrays = {
        "q": q,
        "k": k,
        "cos": table_cos[start : start + p["seq"]],
        "sin": table_sin[start : start + p["seq"]],
    }
    if "position" in p:
        arrays.update(
            table_cos=table_cos,
            table_sin=table_sin,
            positions=np.arange(start, start + p["seq"])[None],
        )
    return arrays


def _embed_arrays(p, rng):
    ids = rng.integers(0, p["vocab"], size=(p["batch"], p["seq"]))
    return {"ids": ids, "weight": rng.standard_normal((p["vocab"], p["dim"]))}


def _attention_arrays(p, rng):
    b, hq, hkv, sq, sk, d = p["shape"]
    q = rng.standard_normal((b, hq, sq, d))
    k = rng.standard_normal((b, hkv, sk, d))
    arrays = {"q": q, "k": k, "v": rng.standard_normal((b, hkv, sk, d))}
    if p.get("sinks"):
        arrays["sinks"] = rng.standard_normal(hq)
    return arrays


def _attention_flops(p, itemsize):
    b, hq, _, sq, sk, d = p["shape"]
    # 4·B·H·D per visible (query, key) pair, bottom-right aligned: query i sits at i + Sk - Sq
    left = p.get("window") - 1 if p.get("window") else sk
    right = 0 if p["causal"] or p.get("window") else sk
    pairs = sum(
        max(min(sk - 1, i + sk - sq + right) - max(0, i + sk - sq - left) + 1, 0) for i in range(sq)
    )
    return 4.0 * b * hq * d * pairs, "GFLOP/s"


def _attention_options(p, x, heads=None):
    """fastpe's keywords for the case's window / softcap / sinks (sinks of the first ``heads``)."""
    window = p.get("window")
    sinks = x.get("sinks")
    return {
        "window": None if window is None else (window - 1, 0),
        "softcap": p.get("softcap"),
        "sinks": None if sinks is None else sinks[:heads],
    }


def _attention_reference(p, x):
    heads = p["shape"][1] // p["shape"][2]
    return fastpe.attention(
        _first_group(p, x["q"]),
        x["k"][:1, :1],
        x["v"][:1, :1],
        causal=p["causal"],
        **_attention_options(p, x, heads),
        **_ORACLE,
    )


def _table_call(fn, args, backend, device, **kwargs):
    """fastpe's table ``fn`` as the bench times it: a tensor on ``device``, or a NumPy array when
    torch is not installed (``device=None``; a device asks for a torch tensor)."""
    place = device if importlib.util.find_spec("torch") is not None else None
    return lambda: fn(*args, device=place, backend=backend, **kwargs)


def _float32(a):
    """A float32 copy of a table: torch tensors, or NumPy arrays when torch is not installed."""
    return a.float() if hasattr(a, "float") else a.astype(np.float32)


def _apply_rope_call(p, x, backend, device):
    # q and k in one call, as transformers' apply_rotary_pos_emb takes them
    if "position" in p:  # rows picked by position from the whole table, in the call
        cos, sin = _float32(x["table_cos"]), _float32(x["table_sin"])
        return lambda: fastpe.apply_rope(
            (x["q"], x["k"]), cos, sin, positions=x["positions"], backend=backend
        )
    cos, sin = _float32(x["cos"]), _float32(x["sin"])
    return lambda: fastpe.apply_rope((x["q"], x["k"]), cos, sin, backend=backend)


def _first_group(p, result):
    """Batch 0's query heads that read kv head 0: heads are independent, and the full oracle would
    materialise [B, H, Sq, Sk] in float64."""
    return result[:1, : p["shape"][1] // p["shape"][2]]


def _attention_grad_reference(p, x):
    """The oracle's dq, dk, dv for batch 0, kv head 0 and its query heads: the other heads and
    batches neither read these inputs nor feed their gradients, so the slice of the whole call's
    gradients is exact (the full oracle backward would hold [B, H, Sq, Sk] in float64)."""
    import torch

    heads = p["shape"][1] // p["shape"][2]
    b, hq, _, sq, _, _ = p["shape"]
    (upstream,) = upstream_gradients([(b, hq, sq, x["v"].shape[-1])], x["v"])
    sliced = {"q": _first_group(p, x["q"]), "k": x["k"][:1, :1], "v": x["v"][:1, :1]}
    leaves = [sliced[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
    out = fastpe.attention(
        *leaves, causal=p["causal"], **_attention_options(p, x, heads), **_ORACLE
    )
    return torch.autograd.grad(out, leaves, _first_group(p, upstream))


def _attention_compared_grads(p, grads):
    dq, dk, dv = grads
    return _first_group(p, dq), dk[:1, :1], dv[:1, :1]


OPS: dict[str, OpSpec] = {
    "sinusoidal_table": OpSpec(
        arrays=_no_arrays,
        work=lambda p, itemsize: (p["positions"] * p["dim"] * itemsize, "GB/s"),
        reference=lambda p, x: fastpe.sinusoidal_table(
            p["positions"], p["dim"], offset=p.get("offset", 0), dtype="float64", **_ORACLE
        ),
        fastpe=lambda p, x, backend, device: _table_call(
            fastpe.sinusoidal_table,
            (p["positions"], p["dim"]),
            backend,
            device,
            offset=p.get("offset", 0),
        ),
    ),
    "rope_table": OpSpec(
        arrays=_no_arrays,
        # two [P, R/2] tables
        work=lambda p, itemsize: (p["positions"] * p["rotary_dim"] * itemsize, "GB/s"),
        reference=lambda p, x: fastpe.rope_table(
            p["positions"], p["rotary_dim"], dtype="float64", **_ORACLE
        ),
        fastpe=lambda p, x, backend, device: _table_call(
            fastpe.rope_table, (p["positions"], p["rotary_dim"]), backend, device
        ),
    ),
    "apply_rope": OpSpec(
        arrays=_rope_arrays,
        # q and k read and written
        work=lambda p, itemsize: (
            2 * (p["q_heads"] + p["k_heads"]) * p["seq"] * p["dim"] * itemsize,
            "GB/s",
        ),
        reference=lambda p, x: tuple(
            fastpe.apply_rope(x[n], x["cos"], x["sin"], **_ORACLE) for n in ("q", "k")
        ),
        fastpe=_apply_rope_call,
        grad_inputs=("q", "k"),
    ),
    "embed": OpSpec(
        arrays=_embed_arrays,
        # gathered rows + output
        work=lambda p, itemsize: (2 * p["batch"] * p["seq"] * p["dim"] * itemsize, "GB/s"),
        reference=lambda p, x: fastpe.embed(
            x["ids"], x["weight"], scale=math.sqrt(p["dim"]), **_ORACLE
        ),
        fastpe=lambda p, x, backend, device: (
            lambda: fastpe.embed(x["ids"], x["weight"], scale=math.sqrt(p["dim"]), backend=backend)
        ),
        # outputs are ~sqrt(D)·|w| in magnitude
        error_scale=lambda p: math.sqrt(p["dim"]) * 4,
        grad_inputs=("weight",),
    ),
    "attention": OpSpec(
        arrays=_attention_arrays,
        work=_attention_flops,
        reference=_attention_reference,
        fastpe=lambda p, x, backend, device: (
            lambda: fastpe.attention(
                x["q"],
                x["k"],
                x["v"],
                causal=p["causal"],
                backend=backend,
                **_attention_options(p, x),
            )
        ),
        compared=_first_group,
        grad_inputs=("q", "k", "v"),
        # FlashAttention-2's count: the backward's five matmuls per tile against the forward's two
        backward_work=2.5,
        grad_reference=_attention_grad_reference,
        compared_grads=_attention_compared_grads,
    ),
}


def make_inputs(case: Case, device: str = "cpu", dtype: str = "float32") -> dict:
    """Random inputs for ``case`` as torch tensors on ``device`` (NumPy arrays if torch is absent)."""
    arrays = OPS[case.op].arrays(case.params, np.random.default_rng(0))
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
    """(amount, unit): bytes that must move for memory-bound ops, FLOPs for attention; the
    backward's is ``backward_work`` times the forward's, the full mode's the sum."""
    amount, unit = OPS[case.op].work(case.params, itemsize)
    factor = {"forward": 1.0, "backward": 0.0, "full": 1.0}[case.mode]
    if case.mode != "forward":
        factor += OPS[case.op].backward_work
    return amount * factor, unit


def with_grad(case: Case, inputs: dict) -> tuple[dict, list]:
    """For the backward and full modes: ``inputs`` with fresh leaf copies of the op's
    ``grad_inputs`` that require grad, and those leaves (each implementation gets its own)."""
    inputs = dict(inputs)
    leaves = []
    for name in OPS[case.op].grad_inputs:
        inputs[name] = inputs[name].detach().clone().requires_grad_()
        leaves.append(inputs[name])
    return inputs, leaves


def autograd_call(fn: Callable, leaves: list, mode: str) -> Callable:
    """``fn`` (a call recorded by autograd) as timed in ``mode``: it returns the gradients of
    ``leaves`` for fixed random output gradients (the same for every implementation)."""
    import torch

    outputs = _as_tuple(fn())
    upstream = upstream_gradients([o.shape for o in outputs], outputs[0])
    if mode == "backward":
        return lambda: torch.autograd.grad(outputs, leaves, upstream, retain_graph=True)
    return lambda: torch.autograd.grad(_as_tuple(fn()), leaves, upstream)


def upstream_gradients(shapes, like) -> tuple:
    """The fixed random output gradients for outputs of ``shapes`` (dtype and device of
    ``like``): the same for every implementation and for the oracle."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return tuple(
        torch.randn(tuple(s), generator=generator, dtype=torch.float32).to(like) for s in shapes
    )


def _as_tuple(result) -> tuple:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def reference(case: Case, inputs: dict):
    """The float64 oracle's answer, cast to the inputs' dtype (attention: see ``_first_group``);
    in the backward and full modes, the oracle's gradients (its hand-written backward; attention:
    see ``_attention_grad_reference``)."""
    if case.mode == "forward":
        return OPS[case.op].reference(case.params, inputs)
    if OPS[case.op].grad_reference is not None:
        return tuple(OPS[case.op].grad_reference(case.params, inputs))
    inputs, leaves = with_grad(case, inputs)
    device = str(leaves[0].device)
    fn = OPS[case.op].fastpe(case.params, inputs, "numpy", device)
    return autograd_call(fn, leaves, "backward")()


def max_error(case: Case, result, expected) -> float:
    """Largest absolute difference between ``result`` (one array or a tuple) and the oracle's."""
    if case.mode == "forward":
        result = OPS[case.op].compared(case.params, result)
    else:
        result = OPS[case.op].compared_grads(case.params, tuple(result))
    pairs = (
        zip(result, expected, strict=True) if isinstance(expected, tuple) else [(result, expected)]
    )
    worst = 0.0
    for got, want in pairs:
        diff = _float64(got) - _float64(want)
        worst = max(worst, float(np.max(np.abs(diff), initial=0.0)))
    return worst


def _float64(a) -> np.ndarray:
    # torch tensors through .double(): NumPy cannot take bfloat16 (nor CUDA memory)
    return a.detach().cpu().double().numpy() if hasattr(a, "detach") else np.asarray(a, np.float64)


def error_scale(case: Case) -> float:
    """Magnitude of the case's outputs, to scale an error tolerance."""
    return OPS[case.op].error_scale(case.params)
