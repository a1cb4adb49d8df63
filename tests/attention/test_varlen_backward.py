"""Gradients of ``attention_varlen`` (packed sequences; docs/math.md#packed-variable-length-backward).

Expected gradients: torch autograd through a plain torch softmax attention written here (float64),
run on each packed sequence alone; and a tiny Llama's padding-free training step
(DataCollatorWithFlattening's ``cu_seq_lens_*`` kwargs) against transformers' SDPA run on each
sequence alone.
"""

from __future__ import annotations

import math

import pytest
from _testkit import KERNEL_BACKENDS, schema_options

torch = pytest.importorskip("torch")

import fastpe  # noqa: E402

# per sequence (Lq, Lk): an empty sequence, one with queries but no key, Lq > Lk and Lq < Lk
Q_LENGTHS = (3, 0, 6, 2, 4, 1)
K_LENGTHS = (5, 1, 4, 0, 4, 7)
HQ, HKV, D, DV = 4, 2, 8, 6


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _rotate(x, cos, sin, positions):
    """Rotate-half RoPE (pairs (i, i + R/2)) of x [H, S, D] at the given table rows."""
    c, s = cos[positions][None], sin[positions][None]
    half = cos.shape[1]
    a, b = x[..., :half], x[..., half : 2 * half]
    return torch.cat([a * c - b * s, b * c + a * s, x[..., 2 * half :]], -1)


def eager_varlen(
    q,
    k,
    v,
    cu_q,
    cu_k,
    *,
    causal=False,
    causal_alignment="bottom_right",
    scale=None,
    alibi_slopes=None,
    window=None,
    softcap=None,
    sinks=None,
    rope=None,
):
    """Each sequence alone: softmax(q·kᵀ·scale (soft-capped) + ALiBi, masked) · v, the sink one
    more logit with no value; returns out [Tq, Hq, Dv] and lse [Hq, Tq]."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b] : cu_q[b + 1]].transpose(0, 1)
        kb = k[cu_k[b] : cu_k[b + 1]].transpose(0, 1).repeat_interleave(group, 0)
        vb = v[cu_k[b] : cu_k[b + 1]].transpose(0, 1).repeat_interleave(group, 0)
        sq, sk = qb.shape[1], kb.shape[1]
        shift = sk - sq if causal_alignment == "bottom_right" else 0
        i = torch.arange(sq)[:, None] + shift
        j = torch.arange(sk)[None, :]
        if rope is not None:
            qb = _rotate(qb, rope["cos"], rope["sin"], (torch.arange(sq) + shift).clamp(min=0))
            kb = _rotate(kb, rope["cos"], rope["sin"], torch.arange(sk))
        s = scale * qb @ kb.transpose(-1, -2)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if alibi_slopes is not None:
            s = s - alibi_slopes[b][:, None, None] * (i - j).abs()
        allowed = torch.ones(sq, sk, dtype=torch.bool)
        if causal:
            allowed &= j <= i
        if window is not None:
            if window[0] >= 0:
                allowed &= j >= i - window[0]
            if window[1] >= 0:
                allowed &= j <= i + window[1]
        s = s.masked_fill(~allowed, -math.inf)
        if sinks is not None:
            s = torch.cat([s, sinks[:, None, None].expand(-1, sq, 1)], -1)
            vb = torch.cat([vb, vb.new_zeros(vb.shape[0], 1, vb.shape[2])], 1)
        # a row with no logit at all: out 0, lse -inf, and finite gradients everywhere
        m = s.amax(-1, keepdim=True).detach() if s.shape[-1] else s.new_zeros(*s.shape[:-1], 1)
        m = torch.where(torch.isfinite(m), m, 0.0)
        e = torch.exp(s - m)
        total = e.sum(-1, keepdim=True)
        safe = torch.where(total > 0, total, 1.0)
        outs.append(((e / safe) @ vb).transpose(0, 1))
        lses.append(torch.where(total > 0, m + torch.log(safe), -math.inf)[..., 0])
    return torch.cat(outs), torch.cat(lses, 1)


FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "causal_top_left": {"causal": True, "causal_alignment": "top_left"},
    "window": {"window": (2, 1)},
    "causal_window": {"causal": True, "window": (1, 0)},
    "softcap": {"softcap": 0.7, "causal": True},
    "sinks": {"sinks": True, "causal": True},
    "alibi": {"alibi": True, "causal": True},
    "rope": {"rope": True, "causal": True},
}


def _inputs(dtype, options, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(Q_LENGTHS), sum(K_LENGTHS)
    q = torch.randn(tq, HQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(tk, HKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(tk, HKV, DV, generator=g, dtype=torch.float64)
    kwargs = {
        key: options[key]
        for key in ("causal", "causal_alignment", "window", "softcap")
        if key in options
    }
    if options.get("sinks"):
        kwargs["sinks"] = torch.linspace(-1.0, 2.0, HQ, dtype=torch.float64)
    if options.get("alibi"):
        kwargs["alibi_slopes"] = torch.rand(len(Q_LENGTHS), HQ, generator=g, dtype=torch.float64)
    if options.get("rope"):
        angle = torch.arange(16, dtype=torch.float64)[:, None] * 0.3 ** torch.arange(4.0)
        kwargs["rope"] = {"cos": angle.cos(), "sin": angle.sin()}
    weights = (
        torch.randn(tq, HQ, DV, generator=g, dtype=torch.float64),
        torch.randn(HQ, tq, generator=g, dtype=torch.float64),
    )
    return (q, k, v), kwargs, weights


def _loss(out, lse, weights):
    # lse enters too (its gradient flows into q, k and the sinks); -inf rows are left out
    finite = torch.isfinite(lse)
    return (out * weights[0]).sum() + torch.where(finite, lse * weights[1], 0.0).sum()


def _grads(run, tensors, kwargs, weights):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    extra = {}
    if "sinks" in kwargs:
        extra["sinks"] = kwargs["sinks"].detach().clone().requires_grad_()
        leaves.append(extra["sinks"])
    out, lse = run(*leaves[:3], **{**kwargs, **extra})
    _loss(out.double(), lse.double(), weights).backward()
    return out.detach().double(), [x.grad.double() for x in leaves]


# the forward's lse is float32 (FlashAttention's), and the backward reads it: float64 gradients
# carry float32 rounding
@pytest.mark.parametrize("backend", ["numpy", *KERNEL_BACKENDS])
@pytest.mark.parametrize("feature", FEATURES)
def test_gradients_match_eager_autograd(backend, feature):
    # float64 goes to the oracle only; the kernels compute the backward in float32
    dtype, atol = (torch.float64, 1e-6) if backend == "numpy" else (torch.float32, 2e-4)
    tensors, kwargs, weights = _inputs(dtype, FEATURES[feature])
    cu_q, cu_k = _cu(Q_LENGTHS), _cu(K_LENGTHS)
    want_out, want = _grads(
        lambda q, k, v, **kw: eager_varlen(q, k, v, cu_q, cu_k, **kw), tensors, kwargs, weights
    )
    cast = {
        key: value.to(dtype) if torch.is_tensor(value) else value for key, value in kwargs.items()
    }
    got_out, got = _grads(
        lambda q, k, v, **kw: fastpe.attention_varlen(
            q, k, v, cu_q, cu_k, return_lse=True, backend=backend, **kw
        ),
        [t.to(dtype) for t in tensors],
        cast,
        weights,
    )
    torch.testing.assert_close(got_out, want_out, atol=atol, rtol=atol)
    assert len(got) == len(want)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want, strict=False):
        torch.testing.assert_close(g, w, atol=atol, rtol=atol, msg=lambda m, n=name: f"{n}: {m}")


def test_rope_positions_and_tables_without_gradient():
    """Explicit packed positions (transformers' position_ids) rotate as given; asking for a
    gradient of the RoPE tables or the ALiBi slopes is an error, not a silent zero."""
    tensors, kwargs, weights = _inputs(torch.float64, {"causal": True, "rope": True})
    cu_q, cu_k = _cu(Q_LENGTHS), _cu(K_LENGTHS)
    q_pos = torch.randint(0, 16, (sum(Q_LENGTHS),), generator=torch.Generator().manual_seed(3))
    k_pos = torch.randint(0, 16, (sum(K_LENGTHS),), generator=torch.Generator().manual_seed(4))
    rope = {**kwargs["rope"], "q_positions": q_pos, "k_positions": k_pos}

    def eager(q, k, v, **kw):  # rotate the packed tensors first, then plain attention
        return eager_varlen(
            _rotate(q.transpose(0, 1), rope["cos"], rope["sin"], q_pos).transpose(0, 1),
            _rotate(k.transpose(0, 1), rope["cos"], rope["sin"], k_pos).transpose(0, 1),
            v,
            cu_q,
            cu_k,
            causal=True,
        )

    _, want = _grads(eager, tensors, {}, weights)
    _, got = _grads(
        lambda q, k, v: fastpe.attention_varlen(
            q, k, v, cu_q, cu_k, causal=True, rope=rope, return_lse=True, backend="numpy"
        ),
        tensors,
        {},
        weights,
    )
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    q = tensors[0].clone().requires_grad_()
    cos = rope["cos"].clone().requires_grad_()
    out = fastpe.attention_varlen(q, *tensors[1:], cu_q, cu_k, rope={**rope, "cos": cos})
    with pytest.raises(RuntimeError, match="no gradient for rope_cos"):
        out.sum().backward()
    slopes = torch.ones(len(Q_LENGTHS), HQ, requires_grad=True, dtype=torch.float64)
    out = fastpe.attention_varlen(*tensors, cu_q, cu_k, alibi_slopes=slopes)
    with pytest.raises(RuntimeError, match="no gradient for alibi_slopes"):
        out.sum().backward()


def test_bad_arguments_refused_under_autograd():
    """Through the custom op the errors still name the argument (not the schema's type errors)."""
    q = torch.randn(4, 2, 4, requires_grad=True)
    with pytest.raises(TypeError, match="causal must be True or False; got 1"):
        fastpe.attention_varlen(q, q, q, _cu([4]), _cu([4]), causal=1)
    with pytest.raises(ValueError, match="cu_seqlens_q must end at the packed length 4"):
        fastpe.attention_varlen(q, q, q, _cu([3]), _cu([4]))
    angle = torch.arange(8.0)[:, None] * torch.ones(2)
    with pytest.raises(TypeError, match=r"rope\['q_positions'\] must be None"):
        fastpe.attention_varlen(
            q,
            q,
            q,
            _cu([4]),
            _cu([4]),
            rope={"cos": angle.cos(), "sin": angle.sin(), "q_positions": 2},
        )


def test_opcheck_with_autograd():
    from fastpe import torch_ops  # noqa: F401  (registers the ops)

    torch.manual_seed(0)
    mk = lambda *s: torch.randn(*s, dtype=torch.float64, requires_grad=True)  # noqa: E731
    q, k, v, sinks = mk(7, 4, 8), mk(9, 2, 8), mk(9, 2, 6), mk(4)
    cu_q, cu_k = _cu([3, 0, 4]), _cu([5, 2, 2])
    # by name: the schema's order is the op's own business
    options = dict(
        max_seqlen_q=None,
        max_seqlen_k=None,
        **schema_options(causal=True, window=(3, -1), softcap=2.0, sinks=sinks),
        backend="",
    )
    args = (q, k, v, cu_q, cu_k)
    torch.library.opcheck(torch.ops.fastpe.attention_varlen.default, args, options)
    out, lse = torch.ops.fastpe.attention_varlen.default(*args, **options)
    detached = {name: a.detach() if torch.is_tensor(a) else a for name, a in options.items()}
    backward_args = (
        torch.randn_like(out),
        torch.randn_like(lse),
        q.detach(),
        k.detach(),
        v.detach(),
        out.detach(),
        lse.detach(),
        cu_q,
        cu_k,
    )
    torch.library.opcheck(
        torch.ops.fastpe.attention_varlen_backward.default,
        backward_args,
        detached,
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def test_compiled_backward_matches_eager_autograd():
    """torch.compile(fullgraph=True) through the forward and backward ops (one opaque op each,
    no graph break on the host reads of cu_seqlens), gradients as plain eager attention."""
    tensors, kwargs, weights = _inputs(torch.float64, {"causal": True, "sinks": True})
    cu_q, cu_k = _cu(Q_LENGTHS), _cu(K_LENGTHS)
    _, want = _grads(
        lambda q, k, v, **kw: eager_varlen(q, k, v, cu_q, cu_k, **kw), tensors, kwargs, weights
    )
    compiled = torch.compile(
        lambda q, k, v, cu_q, cu_k, **kw: fastpe.attention_varlen(
            q, k, v, cu_q, cu_k, return_lse=True, backend="numpy", **kw
        ),
        fullgraph=True,
        backend="aot_eager",
    )
    _, got = _grads(
        lambda q, k, v, **kw: compiled(q, k, v, cu_q, cu_k, **kw), tensors, kwargs, weights
    )
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# transformers: a padding-free training step


def test_packed_training_step_matches_sdpa_per_sequence():
    """A random-weight tiny Llama (GQA) on a packed row from DataCollatorWithFlattening: the
    loss and every parameter's gradient through fastpe.attention_varlen match transformers'
    SDPA run on each sequence alone (the per-sequence losses summed the same way)."""
    transformers = pytest.importorskip("transformers")
    from fastpe.integrations.transformers import register

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    model = transformers.LlamaForCausalLM(config).train()
    seqs = [torch.randint(1, 96, (n,)).tolist() for n in (7, 13, 2, 9)]
    collator = transformers.DataCollatorWithFlattening(
        return_flash_attn_kwargs=True, return_tensors="pt"
    )
    batch = collator([{"input_ids": s} for s in seqs])
    total = sum(len(s) - 1 for s in seqs)  # predicted tokens (the collator masks each first label)

    def grads():
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.set_attn_implementation("sdpa")
    model.zero_grad()
    want_loss = 0.0
    for s in seqs:
        ids = torch.tensor([s])
        logits = model(ids).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum") / total
        loss.backward()
        want_loss += loss.item()
    want = grads()

    model.set_attn_implementation(register())
    model.zero_grad()
    calls = []
    original = fastpe.attention_varlen
    fastpe.attention_varlen = lambda *a, **kw: calls.append(1) or original(*a, **kw)
    try:
        loss = model(**batch).loss
        loss.backward()
    finally:
        fastpe.attention_varlen = original
    assert len(calls) == config.num_hidden_layers
    assert abs(loss.item() - want_loss) < 1e-5
    got = grads()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=2e-5, rtol=1e-4, msg=name)


def test_flash_attn_varlen_func_has_gradients():
    """FlashAttention's entry point differentiates through attention_varlen (GQA, causal)."""
    from fastpe.flash_attn import flash_attn_varlen_func

    tensors, kwargs, weights = _inputs(torch.float64, {"causal": True})
    cu_q, cu_k = _cu(Q_LENGTHS), _cu(K_LENGTHS)
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max(Q_LENGTHS), max(K_LENGTHS), causal=True)
    (out * weights[0]).sum().backward()
    want = [t.clone().requires_grad_() for t in tensors]
    want_out, _ = eager_varlen(*want, cu_q, cu_k, causal=True)
    (want_out * weights[0]).sum().backward()
    for g, w in zip(leaves, want, strict=True):
        torch.testing.assert_close(g.grad, w.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_gradients_keep_their_dtype(backend, dtype):
    """Half inputs: packed gradients in the input dtype, close to the float64 ones (within a few
    units of the dtype's epsilon times the largest gradient; the inputs themselves are rounded)."""
    tensors, kwargs, weights = _inputs(torch.float64, {"causal": True, "sinks": True})
    cu_q, cu_k = _cu(Q_LENGTHS), _cu(K_LENGTHS)
    _, want = _grads(
        lambda q, k, v, **kw: eager_varlen(q, k, v, cu_q, cu_k, **kw), tensors, kwargs, weights
    )
    leaves = [t.to(dtype).requires_grad_() for t in tensors]
    sinks = kwargs["sinks"].float().requires_grad_()
    out, lse = fastpe.attention_varlen(
        *leaves, cu_q, cu_k, causal=True, sinks=sinks, return_lse=True, backend=backend
    )
    _loss(out.double(), lse.double(), weights).backward()
    eps = torch.finfo(dtype).eps
    for leaf, w in zip([*leaves, sinks], want, strict=True):
        assert leaf.grad.dtype == leaf.dtype
        scale = w.abs().max().item()
        err = (leaf.grad.double() - w).abs().max().item()
        assert err <= 4 * eps * scale  # measured: at most 1.14 eps·max (inputs rounded to half)
