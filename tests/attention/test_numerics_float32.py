"""Numerics of the Numba attention kernels against an independent float64 computation.

The reference is plain torch in float64 with explicit masks and biases (written here, not the
oracle); the yardstick for float32 is the same eager computation in float32 (scores = q·kᵀ·scale,
soft-cap through tanh, ALiBi added, softmax, ·v), whose error against float64 is what a plain
float32 implementation costs.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numba")

import fastpe  # noqa: E402

OPS = ["attention", "attention_varlen", "attention_kvcache"]


class _SoftCap(torch.autograd.Function):
    """c·tanh(s/c) with the derivative written as 1 − tanh²(s/c): autograd's c·(1 − tanh²)·(1/c)
    loses the bits of a subnormal c on the way."""

    @staticmethod
    def forward(ctx, scores, cap):
        capped = torch.tanh(scores / cap)
        ctx.save_for_backward(capped)
        return cap * capped

    @staticmethod
    def backward(ctx, grad):
        (capped,) = ctx.saved_tensors
        return grad * (1.0 - capped * capped), None


def _reference(q, k, v, *, dtype, causal=False, window=None, softcap=None, alibi=None, sinks=None):
    """q [Hq, Sq, D], k/v [Hkv, Sk, D] -> [Hq, Sq, D] in ``dtype``; queries are the last Sq
    positions of the Sk keys (bottom-right alignment)."""
    hq, sq, d = q.shape
    hkv, sk = k.shape[0], k.shape[1]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    k, v = k.repeat_interleave(hq // hkv, 0), v.repeat_interleave(hq // hkv, 0)
    scores = q @ k.transpose(-1, -2) * (1.0 / math.sqrt(d))
    if softcap is not None:
        scores = _SoftCap.apply(scores, softcap)
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    if alibi is not None:
        scores = scores - alibi.to(dtype)[:, None, None] * (i - j).abs().to(dtype)
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window is not None:
        allowed &= (j >= i - window[0]) & (j <= i + window[1])
    scores = scores.masked_fill(~allowed, -math.inf)
    if sinks is not None:  # one more logit per head, with no value
        sink_col = sinks.to(dtype)[:, None, None].expand(hq, sq, 1)
        return torch.softmax(torch.cat([scores, sink_col], -1), -1)[..., :-1] @ v
    return torch.softmax(scores, -1) @ v


def _numba(op, q, k, v, **options):
    """One sequence through ``op`` on the Numba backend, in the [H, S, D] layout of
    ``_reference``."""
    sq, sk = q.shape[1], k.shape[1]
    if op == "attention":
        return fastpe.attention(q[None], k[None], v[None], backend="numba", **options)[0]
    seq_major = [t.transpose(0, 1).contiguous() for t in (q, k, v)]  # [S, H, D]
    if op == "attention_varlen":
        cu_q = torch.tensor([0, sq], dtype=torch.int32)
        cu_k = torch.tensor([0, sk], dtype=torch.int32)
        out = fastpe.attention_varlen(*seq_major, cu_q, cu_k, backend="numba", **options)
        return out.transpose(0, 1)
    out = fastpe.attention_kvcache(
        *(t[None] for t in seq_major),
        cache_seqlens=torch.tensor([sk], dtype=torch.int32),
        backend="numba",
        **options,
    )
    return out[0].transpose(0, 1)


def _inputs(hq, hkv, sq, sk, d, dtype, magnitude=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, sq, d, generator=g, dtype=torch.float64) * magnitude
    k = torch.randn(hkv, sk, d, generator=g, dtype=torch.float64) * magnitude
    v = torch.randn(hkv, sk, d, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# --- any finite positive soft-cap --------------------------------------------------------------

# caps whose c·log2 e or 1/c leaves the compute dtype's range (or lands in its subnormals),
# and ordinary neighbours
_CAPS = {
    torch.float32: [
        1e-320,
        1e-45,
        1e-30,
        1.0,
        1e30,
        3e38,
        3.4028234663852886e38,
        1.5e308,
        1.7976931348623157e308,
    ],
    torch.float64: [1e-320, 1e-300, 1.0, 1e300, 1.5e308, 1.7976931348623157e308],
}
_CAP_CASES = [(dtype, cap) for dtype, caps in _CAPS.items() for cap in caps]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("dtype", "cap"), _CAP_CASES, ids=[f"{d}-{c:g}" for d, c in _CAP_CASES])
@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "causal-alibi"])
def test_softcap_any_finite_positive(op, dtype, cap, alibi):
    """softcap = c for any finite c > 0: c·tanh(s/c) (≈ s for a huge c, ≈ ±c for a tiny one),
    never NaN. A zero key makes exact-zero scores (0·(1/c) with 1/c = inf was NaN)."""
    q, k, v = _inputs(4, 2, 5, 9, 16, dtype)
    k[:, 3] = 0.0
    options = {"softcap": cap}
    if alibi:
        options.update(causal=True, alibi_slopes=torch.tensor([0.5, 0.1, 1e-3, 2.0]))
    want = _reference(
        q, k, v, dtype=torch.float64, softcap=cap, causal=alibi, alibi=options.get("alibi_slopes")
    )
    got = _numba(op, q, k, v, **options).to(torch.float64)
    tol = 2e-6 if dtype == torch.float32 else 1e-13
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= tol


@pytest.mark.parametrize("cap", [1e-320, 1e-30, 3e38, 1.5e308])
def test_softcap_any_finite_positive_backward(cap):
    """The float32 backward under a huge or subnormal cap: gradients of every input within
    float32 rounding of float64 autograd through the reference."""
    q, k, v = _inputs(4, 2, 5, 9, 16, torch.float32)
    k[:, 3] = 0.0
    slopes = torch.tensor([0.5, 0.1, 1e-3, 2.0])
    grad_out = torch.randn(4, 5, 16, generator=torch.Generator().manual_seed(1))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = fastpe.attention(
        *(t[None] for t in leaves), softcap=cap, causal=True, alibi_slopes=slopes, backend="numba"
    )[0]
    got = torch.autograd.grad(out, leaves, grad_out)
    exact = [t.detach().to(torch.float64).requires_grad_(True) for t in (q, k, v)]
    want_out = _reference(*exact, dtype=torch.float64, softcap=cap, causal=True, alibi=slopes)
    want = torch.autograd.grad(want_out, exact, grad_out.to(torch.float64))
    for name, g, w in zip("qkv", got, want, strict=True):
        assert torch.isfinite(g).all(), name
        assert (g.to(torch.float64) - w).abs().max().item() <= 1e-5 * max(1.0, w.abs().max()), name


# --- float32 error against torch's float32 error ---------------------------------------------


def _slopes(heads):
    """ALiBi's slopes for 8 heads (2^-1 … 2^-8), repeated."""
    return torch.tensor([2.0 ** -(h % 8 + 1) for h in range(heads)])


FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (100, 0)},
    "softcap": {"softcap": 30.0},
    "alibi": {"alibi_slopes": True},
    "sinks": {"sinks": True},
    "softcap-alibi": {"softcap": 30.0, "alibi_slopes": True},
    "causal-softcap-alibi-sinks": {
        "causal": True,
        "softcap": 30.0,
        "alibi_slopes": True,
        "sinks": True,
    },
    "window-softcap": {"window": (100, 0), "softcap": 30.0},
}
# (Sq, Sk, D, Hq, Hkv): decode steps and prefills, head dims 64 and 128. Decode has more heads:
# a max over few rows is mostly chance (one row's luckiest rounding decides it).
SHAPES = [(1, 600, 64, 32, 8), (1, 600, 128, 32, 8), (128, 256, 64, 8, 2), (128, 256, 128, 8, 2)]

# Below this both errors are a few roundings of outputs of size ~1 (ulp(1) = 1.2e-7): there a
# ratio measures which rounding happened to land where, not the algorithm.
ROUNDING_FLOOR = 2.5e-7


@pytest.mark.parametrize("magnitude", [4.0, 8.0])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}x{s[1]}-d{s[2]}" for s in SHAPES])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("op", OPS)
def test_float32_error_within_twice_torch(op, feature, shape, magnitude):
    """max |numba float32 − float64| <= 2 x max |torch eager float32 − float64|. q and k have
    entries of size ``magnitude``: scores ~magnitude² (16: Gemma-like against softcap 30; 64:
    soft-capped scores near the cap)."""
    sq, sk, d, hq, hkv = shape
    options = dict(FEATURES[feature])
    if "alibi_slopes" in options:
        options["alibi_slopes"] = _slopes(hq)
    if "sinks" in options:
        options["sinks"] = torch.linspace(-1.0, 3.0, hq)
    q, k, v = _inputs(hq, hkv, sq, sk, d, torch.float32, magnitude=magnitude)
    reference_options = {
        "causal": options.get("causal", False),
        "window": options.get("window"),
        "softcap": options.get("softcap"),
        "alibi": options.get("alibi_slopes"),
        "sinks": options.get("sinks"),
    }
    exact = _reference(q, k, v, dtype=torch.float64, **reference_options)
    plain32 = _reference(q, k, v, dtype=torch.float32, **reference_options)
    got = _numba(op, q, k, v, **options)
    ours = (got.to(torch.float64) - exact).abs().max().item()
    torch_error = (plain32.to(torch.float64) - exact).abs().max().item()
    assert ours <= 2.0 * max(torch_error, ROUNDING_FLOOR), (ours, torch_error)
