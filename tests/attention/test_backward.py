"""Attention's backward pass (docs/math.md#attention-backward).

Expected gradients come from outside fastpe's own backward: torch autograd through a plain torch
softmax attention written here (float64), finite differences (``torch.autograd.gradcheck``), and
torch's SDPA; the kernels are then checked against the float64 oracle on a feature grid, and a
tiny Llama's training step against transformers' SDPA attention.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from _testkit import KERNEL_BACKENDS, grid, schema_options

torch = pytest.importorskip("torch")

import fastpe  # noqa: E402
from fastpe import reference  # noqa: E402

O = {"backend": "numpy"}


def eager_attention(
    q,
    k,
    v,
    *,
    scale,
    causal=False,
    bottom_right=True,
    mask=None,
    key_lengths=None,
    alibi_slopes=None,
    bias=None,
    window=None,
    softcap=None,
    sinks=None,
):
    """softmax(q·kᵀ·scale (soft-capped) + biases, masked) · v in plain torch, with the sink as
    one more logit of value 0; returns (out, lse). ``bias``: an additive [B, Hq, Sq, Sk]
    tensor (the T5 table already gathered, so autograd reaches the table through it)."""
    b, hq, sq, _ = q.shape
    sk = k.shape[2]
    group = hq // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    lengths = torch.full((b,), sk) if key_lengths is None else torch.as_tensor(key_lengths)
    is_key = (torch.arange(sk)[None] < lengths[:, None])[:, None, :, None]
    k, v = k.masked_fill(~is_key, 0.0), v.masked_fill(~is_key, 0.0)  # padding holds NaN
    s = scale * q @ k.transpose(-1, -2)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    shift = lengths - sq if bottom_right else torch.zeros(b, dtype=torch.long)
    i = (torch.arange(sq)[None] + shift[:, None])[:, None, :, None]
    j = torch.arange(sk)[None, None, None]
    allowed = (j < lengths[:, None, None, None]).expand(b, hq, sq, sk)
    if causal:
        allowed = allowed & (j <= i)
    if window is not None:
        if window[0] >= 0:
            allowed = allowed & (j >= i - window[0])
        if window[1] >= 0:
            allowed = allowed & (j <= i + window[1])
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed = allowed & mask
        else:
            s = s + mask
    if alibi_slopes is not None:
        s = s - alibi_slopes.reshape(-1, hq)[:, :, None, None] * (i - j).abs()
    if bias is not None:
        s = s + bias
    s = s.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks[None, :, None, None].expand(b, hq, sq, 1)], -1)
        v = torch.cat([v, v.new_zeros(b, hq, 1, v.shape[-1])], 2)
    lse = torch.logsumexp(s, -1)
    seen = torch.isfinite(lse)[..., None]
    p = torch.where(seen, torch.exp(s - torch.where(seen, lse[..., None], 0.0)), 0.0)
    return p @ v, lse


# (B, Hq, Hkv, Sq, Sk, D, Dv)
SHAPES = [
    (2, 4, 2, 5, 7, 6, 3),
    (1, 3, 1, 33, 300, 16, 8),
    (2, 2, 2, 40, 12, 8, 8),
    (1, 3, 1, 20, 40, 16, 8),
]
# Triton's interpreter (16 x 16 tiles there) skips 33 x 300 (~80 s of its ~100 s here): 20 x 40
# crosses ragged query and key tiles in both backward kernels the same way, on 6 tiles, not 57.
SHAPES_GRID = grid(SHAPES, interpreter=[0, 2, 3])
FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "causal_top_left": {"causal": True, "causal_alignment": "top_left"},
    "bool_mask": {"mask": "bool"},
    "float_mask": {"mask": "float", "causal": True},
    "key_lengths": {"key_lengths": True, "causal": True},
    "key_lengths_top_left": {"key_lengths": True, "causal_alignment": "top_left"},
    "alibi": {"alibi_slopes": True, "causal": True},
    "t5": {"relative_bias": True},
    "t5_decoder": {"relative_bias": "unidirectional", "causal": True},
    "window_softcap": {"window": (6, 2), "softcap": 1.5},
    "sinks": {"sinks": True, "causal": True, "key_lengths": True},
    "rope": {"rope": True, "causal": True},
    "everything": {
        "causal": True,
        "mask": "bool",
        "key_lengths": True,
        "alibi_slopes": True,
        "relative_bias": True,
        "rope": True,
        "window": (9, -1),
        "softcap": 2.0,
        "sinks": True,
    },
}


def _case(rng, shape, features, dtype=torch.float32):
    """Leaf tensors (q, k, v and the differentiable options) and the call's other keywords."""
    b, hq, hkv, sq, sk, d, dv = shape
    t = lambda *s: torch.from_numpy(rng.standard_normal(s)).to(dtype)  # noqa: E731
    q, k, v = t(b, hq, sq, d), t(b, hkv, sk, d), t(b, hkv, sk, dv)
    kw, leaves = {}, {}
    for name, value in features.items():
        if name == "mask" and value == "bool":
            kw["mask"] = torch.from_numpy(rng.random((b, 1, sq, sk)) < 0.8)
        elif name == "mask":
            m = t(sq, sk)
            m[torch.from_numpy(rng.random((sq, sk)) < 0.2)] = -math.inf
            kw["mask"] = m
        elif name == "key_lengths":
            lengths = torch.from_numpy(rng.integers(0, sk + 1, size=b))
            lengths[0] = max(sk - 2, 0)
            for bi, length in enumerate(lengths.tolist()):  # poison: padding is never read
                k[bi, :, length:] = math.nan
                v[bi, :, length:] = math.nan
            kw["key_lengths"] = lengths
        elif name == "alibi_slopes":
            kw["alibi_slopes"] = 2.0 ** -torch.arange(1, hq + 1, dtype=dtype)
        elif name == "relative_bias":
            leaves["table"] = t(32, hq)
            kw["relative_bias"] = {"max_distance": 20, "bidirectional": value is True}
        elif name == "sinks":
            leaves["sinks"] = t(hq)
        elif name == "rope":
            cos, sin = fastpe.rope_table(max(sq, sk) + 4, d - d % 4, **O)
            kw["rope"] = {
                "cos": torch.from_numpy(cos).to(dtype),
                "sin": torch.from_numpy(sin).to(dtype),
                "interleaved": True,
            }
        else:
            kw[name] = value
    return {"q": q, "k": k, "v": v, **leaves}, kw


def _call(leaves, kw, **extra):
    """fastpe.attention on the leaves; returns (out, lse)."""
    kw = dict(kw)
    if "table" in leaves:
        kw["relative_bias"] = {**kw["relative_bias"], "table": leaves["table"]}
    return fastpe.attention(
        leaves["q"],
        leaves["k"],
        leaves["v"],
        sinks=leaves.get("sinks"),
        return_lse=True,
        **kw,
        **extra,
    )


def _grads(leaves, kw, grad_out, grad_lse, dtype, **extra):
    leaves = {n: x.detach().to(dtype).requires_grad_() for n, x in leaves.items()}
    kw = {
        n: x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x for n, x in kw.items()
    }
    if "rope" in kw:
        kw["rope"] = {n: x.to(dtype) if torch.is_tensor(x) else x for n, x in kw["rope"].items()}
    out, lse = _call(leaves, kw, **extra)
    finite = torch.isfinite(lse)
    loss = (out * grad_out.to(dtype)).sum() + (
        torch.where(finite, lse, 0.0) * grad_lse.to(dtype)
    ).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return dict(zip(leaves, grads, strict=True))


def _check_close(got, want, tol, what):
    for name in want:
        g, w = got[name].double(), want[name].double()
        assert not torch.isnan(g).any(), f"{what}: NaN in d{name}"
        err = (g - w).abs().max().item() if w.numel() else 0.0
        scale = max(1.0, w.abs().max().item() if w.numel() else 0.0)
        assert err <= tol * scale, f"{what}: d{name} max error {err:.3g} > {tol} x {scale:.3g}"


# ---------------------------------------------------------------------------------------------
# the oracle against independent gradients


def _eager_from_case(leaves, kw, shape):
    """eager_attention with the arguments fastpe.attention got (T5 buckets gathered here)."""
    b, hq, hkv, sq, sk, d, dv = shape
    bottom_right = kw.get("causal_alignment", "bottom_right") == "bottom_right"
    q, k = leaves["q"], leaves["k"]
    lengths = kw.get("key_lengths")
    if "rope" in kw:  # the rotation, written out: (a, b) -> (a·cos - b·sin, b·cos + a·sin)
        cos, sin = kw["rope"]["cos"].double(), kw["rope"]["sin"].double()
        # docs/math.md#fused-rope: bottom-right queries sit at L_b - Sq + i (clamped at 0)
        q_pos = torch.arange(sq)[None].expand(b, sq)
        if bottom_right and lengths is not None:
            q_pos = (lengths[:, None] - sq + q_pos).clamp(min=0)
        elif bottom_right:
            q_pos = q_pos + max(sk - sq, 0)
        k_pos = torch.arange(sk)[None].expand(b, sk)

        def rotate(x, pos):
            half = cos.shape[1]
            c, s = cos[pos][:, None], sin[pos][:, None]
            a, b_ = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
            rot = torch.stack([a * c - b_ * s, b_ * c + a * s], -1).flatten(-2)
            return torch.cat([rot, x[..., 2 * half :]], -1)

        q, k = rotate(q, q_pos), rotate(k, k_pos)
    bias = None
    if "table" in leaves:
        shift = (torch.full((b,), sk) if lengths is None else lengths) - sq
        shift = shift if bottom_right else torch.zeros(b, dtype=torch.long)
        rel = torch.arange(sk)[None, None] - (
            torch.arange(sq)[None, :, None] + shift[:, None, None]
        )
        # the bucket map is the forward's (tested against T5 in test_oracle.py)
        bidirectional = kw["relative_bias"]["bidirectional"]
        buckets = torch.from_numpy(reference.t5_bucket(rel.numpy(), bidirectional, 32, 20))
        bias = leaves["table"][buckets].permute(0, 3, 1, 2)
    mask = kw.get("mask")
    return eager_attention(
        q,
        k,
        leaves["v"],
        scale=d**-0.5,
        causal=kw.get("causal", False),
        bottom_right=bottom_right,
        mask=None if mask is None else (mask if mask.dtype == torch.bool else mask.double()),
        key_lengths=lengths,
        alibi_slopes=None if "alibi_slopes" not in kw else kw["alibi_slopes"].double(),
        bias=bias,
        window=kw.get("window"),
        softcap=kw.get("softcap"),
        sinks=leaves.get("sinks"),
    )


@pytest.mark.parametrize("case", list(FEATURES))
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_oracle_gradients_match_torch_autograd(case, shape):
    rng = np.random.default_rng(7)
    leaves, kw = _case(rng, shape, FEATURES[case], torch.float64)
    b, hq, hkv, sq, sk, d, dv = shape
    grad_out = torch.from_numpy(rng.standard_normal((b, hq, sq, dv)))
    # lse is float32 whatever the inputs: its gradient arrives rounded to float32
    grad_lse = torch.from_numpy(rng.standard_normal((b, hq, sq))).float().double()
    got = _grads(leaves, kw, grad_out, grad_lse, torch.float64, **O)

    plain = {n: x.detach().clone().requires_grad_() for n, x in leaves.items()}
    out, lse = _eager_from_case(plain, kw, shape)
    want_out, want_lse = _call({n: x.detach() for n, x in leaves.items()}, kw, **O)
    finite = torch.isfinite(lse)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)  # the same function
    loss = (out * grad_out).sum() + (torch.where(finite, lse, 0.0) * grad_lse).sum()
    want = dict(zip(plain, torch.autograd.grad(loss, list(plain.values())), strict=True))
    _check_close(got, want, 1e-10, f"oracle {case}")


@pytest.mark.parametrize("backend", ["numpy", *KERNEL_BACKENDS])
def test_a_learned_table_alone_gets_its_gradient(backend):
    """Only the T5 table requires grad (q, k, v frozen): the call must still be recorded. The
    public function looked for grad-requiring tensors among q, k, v, mask, key_lengths,
    alibi_slopes and sinks only, so the output had no grad_fn and the table no gradient."""
    rng = np.random.default_rng(11)
    shape = SHAPES[0]
    leaves, kw = _case(rng, shape, {"relative_bias": True, "causal": True})
    table = leaves["table"].detach().requires_grad_()
    frozen = {n: x.detach() for n, x in leaves.items()}
    out, _ = _call({**frozen, "table": table}, kw, backend=backend)
    grad_out = torch.from_numpy(rng.standard_normal(out.shape)).float()
    (out * grad_out).sum().backward()

    plain = {**{n: x.double() for n, x in frozen.items()}, "table": frozen["table"].double()}
    plain["table"].requires_grad_()
    eager_out, _ = _eager_from_case(plain, kw, shape)
    (want,) = torch.autograd.grad((eager_out * grad_out.double()).sum(), [plain["table"]])
    assert table.grad is not None
    _check_close({"table": table.grad}, {"table": want}, 2e-5, f"{backend} table alone")


@pytest.mark.parametrize(
    "features",
    [
        {"causal": True, "sinks": True, "softcap": 0.8, "window": (3, 1)},
        {"relative_bias": True, "mask": "float", "causal_alignment": "top_left", "causal": True},
        {"rope": True, "alibi_slopes": True, "key_lengths": True},
    ],
)
def test_oracle_gradcheck(features):
    """Finite differences of the float64 forward against the registered backward."""
    rng = np.random.default_rng(3)
    leaves, kw = _case(rng, (2, 4, 2, 4, 6, 4, 3), features, torch.float64)
    if "key_lengths" in kw:  # finite differences would read the NaN padding as inputs
        kw["key_lengths"] = torch.tensor([6, 3])
        leaves = {n: torch.nan_to_num(x) for n, x in leaves.items()}
    names = list(leaves)

    def f(*xs):  # out only: lse is float32, too coarse for finite differences
        return _call(dict(zip(names, xs, strict=True)), kw, **O)[0]

    inputs = tuple(x.clone().requires_grad_() for x in leaves.values())
    assert torch.autograd.gradcheck(f, inputs, atol=1e-7)


def test_oracle_empty_rows_have_zero_gradients():
    """Rows that see no key (bottom-right queries in front of a short sequence, a row masked
    out) get zero gradient and send none to k and v, even with NaN in the padding."""
    rng = np.random.default_rng(0)
    leaves, kw = _case(rng, (2, 2, 1, 6, 8, 4, 4), {"causal": True}, torch.float64)
    kw["key_lengths"] = torch.tensor([3, 0])
    leaves["k"][0, :, 3:] = math.nan
    leaves["v"][0, :, 3:] = math.nan
    mask = torch.ones(2, 2, 6, 8, dtype=torch.bool)
    mask[0, :, 5] = False
    kw["mask"] = mask
    g = torch.ones(2, 2, 6, 4, dtype=torch.float64)
    for backend in ["numpy"] + [p.values[0] for p in KERNEL_BACKENDS]:
        dtype = torch.float64 if backend == "numpy" else torch.float32
        got = _grads(leaves, kw, g, torch.zeros(2, 2, 6), dtype, backend=backend)
        for name, grad in got.items():
            assert not torch.isnan(grad).any(), (backend, name)
        # sequence 0 (L = 3): queries 0-2 sit before the keys, query 5 is masked out
        assert (got["q"][0, :, [0, 1, 2, 5]] == 0).all()
        assert (got["k"][0, :, 3:] == 0).all() and (got["v"][0, :, 3:] == 0).all()
        assert (got["q"][1] == 0).all() and (got["k"][1] == 0).all()


# ---------------------------------------------------------------------------------------------
# the kernels against the oracle


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("case", list(FEATURES))
@pytest.mark.parametrize("shape", SHAPES_GRID)
def test_kernel_gradients_match_oracle(backend, case, shape):
    rng = np.random.default_rng(11)
    leaves, kw = _case(rng, shape, FEATURES[case])
    b, hq, hkv, sq, sk, d, dv = shape
    grad_out = torch.from_numpy(rng.standard_normal((b, hq, sq, dv)))
    grad_lse = torch.from_numpy(rng.standard_normal((b, hq, sq)))
    got = _grads(leaves, kw, grad_out, grad_lse, torch.float32, backend=backend)
    want = _grads(leaves, kw, grad_out, grad_lse, torch.float64, **O)
    _check_close(got, want, 2e-5, f"{backend} {case}")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_kernel_low_precision_flash_rule(backend, dtype):
    """Half inputs: the error against the float64 gradients is at most twice that of torch's
    own attention (SDPA autograd) in that dtype, FlashAttention's rule."""
    tdtype = getattr(torch, dtype)
    rng = np.random.default_rng(5)
    q, k, v = (torch.from_numpy(rng.standard_normal((2, 4, 40, 32))).to(tdtype) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    grad_out = torch.from_numpy(rng.standard_normal((2, 4, 40, 32))).to(tdtype)

    def grads(fn, dt):
        xs = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        return torch.autograd.grad((fn(*xs) * grad_out.to(dt)).sum(), xs)

    want = grads(lambda *xs: fastpe.attention(*xs, causal=True, **O), torch.float64)
    got = grads(lambda *xs: fastpe.attention(*xs, causal=True, backend=backend), tdtype)
    plain = grads(
        lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        ),
        tdtype,
    )
    for name, g, w, p in zip("qkv", got, want, plain, strict=True):
        assert g.dtype == tdtype
        err = (g.double() - w).abs().max().item()
        plain_err = (p.double() - w).abs().max().item()
        assert err <= 2 * plain_err + 1e-6, (name, err, plain_err)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kernel_gradients_are_deterministic(backend):
    """Key slices write their dQ shares apart and sum them in order: two runs are bitwise
    equal (few batch·kv-head items: the keys are split across threads). The Triton backward
    has no threads to split keys across (dQ is a pass of its own): fewer keys keep the
    interpreter's run short."""
    rng = np.random.default_rng(2)
    sk = 96 if backend == "triton" else 700
    leaves, kw = _case(rng, (1, 4, 1, 64, sk, 16, 16), {"causal": True})
    g = torch.from_numpy(rng.standard_normal((1, 4, 64, 16))).float()
    first = _grads(leaves, kw, g, torch.zeros(1, 4, 64), torch.float32, backend=backend)
    second = _grads(leaves, kw, g, torch.zeros(1, 4, 64), torch.float32, backend=backend)
    for name in first:
        assert torch.equal(first[name], second[name]), name


# ---------------------------------------------------------------------------------------------
# torch integration


def test_gradients_match_sdpa_autograd():
    torch.manual_seed(0)
    q = torch.randn(2, 8, 33, 32, requires_grad=True)
    k = torch.randn(2, 2, 33, 32, requires_grad=True)
    v = torch.randn(2, 2, 33, 32, requires_grad=True)
    mask = torch.rand(2, 1, 33, 33) < 0.9
    mask |= torch.eye(33, dtype=torch.bool)  # every row sees a key: SDPA has no empty rows
    g = torch.randn(2, 8, 33, 32)
    for kw, sdpa_kw in (
        ({"causal": True}, {"is_causal": True}),
        ({"mask": mask}, {"attn_mask": mask}),
    ):
        got = torch.autograd.grad((fastpe.attention(q, k, v, **kw) * g).sum(), (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True, **sdpa_kw)
        want = torch.autograd.grad((ref * g).sum(), (q, k, v))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compile_fullgraph_gradients_match_eager():
    rng = np.random.default_rng(4)
    leaves, kw = _case(rng, (2, 4, 2, 9, 11, 8, 8), {"causal": True, "sinks": True, "softcap": 3.0})
    leaves = {n: x.requires_grad_() for n, x in leaves.items()}

    def f(q, k, v, sinks):
        return fastpe.attention(q, k, v, sinks=sinks, **kw).square().sum()

    want = torch.autograd.grad(f(**leaves), list(leaves.values()))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(**leaves), list(leaves.values()))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_opcheck_with_autograd():
    from fastpe import torch_ops  # noqa: F401  (registers the ops)

    torch.manual_seed(0)
    mk = lambda *s: torch.randn(*s, dtype=torch.float64, requires_grad=True)  # noqa: E731
    q, k, v, sinks = mk(2, 4, 5, 8), mk(2, 2, 7, 8), mk(2, 2, 7, 6), mk(4)
    table = mk(32, 4)
    # by name: the schema's order is the op's own business
    options = dict(
        mask=None,
        key_lengths=None,
        relative_bias_table=table,
        relative_bias_num_buckets=32,
        relative_bias_max_distance=20,
        relative_bias_bidirectional=True,
        **schema_options(causal=True, window=(4, -1), softcap=2.0, sinks=sinks),
        backend="",
    )
    torch.library.opcheck(torch.ops.fastpe.attention.default, (q, k, v), options)
    out, lse = torch.ops.fastpe.attention.default(q, k, v, **options)
    detached = {name: a.detach() if torch.is_tensor(a) else a for name, a in options.items()}
    backward_args = (
        torch.randn_like(out),
        torch.randn_like(lse),
        q.detach(),
        k.detach(),
        v.detach(),
        out.detach(),
        lse.detach(),
    )
    torch.library.opcheck(
        torch.ops.fastpe.attention_backward.default,
        backward_args,
        detached,
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


@pytest.mark.parametrize("name", ["mask", "alibi_slopes"])
def test_no_gradient_options_raise(name):
    q = torch.randn(1, 2, 3, 4, requires_grad=True)
    value = torch.zeros(1, 2, 3, 3) if name == "mask" else torch.ones(2)
    value.requires_grad_()
    out = fastpe.attention(q, q, q, **{name: value})
    with pytest.raises(RuntimeError, match=f"no gradient for {name}"):
        out.sum().backward()


# ---------------------------------------------------------------------------------------------
# transformers: a training step


def _llama(transformers):
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**_COMMON, max_position_embeddings=64)
    )


def _bert(transformers):
    config = transformers.BertConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config)


def _gemma2(transformers):  # soft-capping, a sliding window shorter than the batch
    config = transformers.Gemma2Config(
        **_COMMON,
        sliding_window=5,
        attn_logit_softcapping=0.5,
        layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=None,
    )
    return transformers.Gemma2ForCausalLM(config)


def _gpt_oss(transformers):  # learned sinks: their gradient too
    config = transformers.GptOssConfig(
        **{**_COMMON, "intermediate_size": 64},
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-2.0, 3.0, config.num_attention_heads))
    return model


_COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    pad_token_id=0,
    initializer_range=0.2,
)


@pytest.mark.parametrize(
    "family, want_implementation, padding",
    [
        (_llama, "sdpa", "left"),
        (_bert, "sdpa", "right"),
        (_gemma2, "eager", "left"),
        (_gpt_oss, "eager", "left"),
    ],
)
def test_training_step_matches_transformers(family, want_implementation, padding):
    """Random-weight tiny models (GQA where the family has it) on a padded batch: the loss and
    every parameter's gradient with fastpe's attention match transformers' own attention."""
    transformers = pytest.importorskip("transformers")
    from fastpe.integrations.transformers import register

    torch.manual_seed(0)
    try:
        model = family(transformers).train()
    except (ImportError, AttributeError) as exc:  # an older transformers without the family
        pytest.skip(f"{family.__name__} not available: {exc}")
    ids = torch.randint(1, 96, (3, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padding == "left":
        ids[0, :4], mask[0, :4] = 0, 0
        ids[2, :1], mask[2, :1] = 0, 0
    else:
        ids[0, 9:], mask[0, 9:] = 0, 0
        ids[2, 12:], mask[2, 12:] = 0, 0
    labels = ids.masked_fill(mask == 0, -100)
    # a left pad's query sees no key: fastpe (like SDPA) gives 0, eager a uniform average; the
    # loss must not read predictions made at pads (the label after each one)
    labels[:, 1:][mask[:, :-1] == 0] = -100

    def step(implementation):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach(), {
            n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
        }

    want_loss, want = step(want_implementation)
    loss, got = step(register())
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert set(got) == set(want) and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


def test_transformers_dropout_stays_refused():
    from fastpe.integrations.transformers import fastpe_attention_forward

    module = torch.nn.Module().train()
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(NotImplementedError, match="dropout"):
        fastpe_attention_forward(module, q, q, q, None, dropout=0.1)


def test_transformers_trainable_t5_bias_is_refused():
    from fastpe.integrations.transformers import fastpe_attention_forward

    q = torch.randn(1, 2, 3, 4)
    bias = torch.zeros(1, 2, 3, 3, requires_grad=True)
    with pytest.raises(NotImplementedError, match="position_bias"):
        fastpe_attention_forward(torch.nn.Module(), q, q, q, None, position_bias=bias)


def test_second_derivative_is_refused_by_name():
    """First-order gradients only: differentiating a gradient of attention raises a clear error
    instead of returning a wrong (zero or missing) second derivative."""
    rng = np.random.default_rng(5)
    q, k, v = (
        torch.from_numpy(rng.standard_normal((1, 2, 4, 8))).float().requires_grad_()
        for _ in range(3)
    )
    out = fastpe.attention(q, k, v, causal=True, **O)
    (dq,) = torch.autograd.grad(out.sum(), [q], create_graph=True)
    with pytest.raises(
        RuntimeError, match="attention_backward has no backward.*second derivatives"
    ):
        dq.sum().backward()
