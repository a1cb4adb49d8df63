"""fastpe.integrations.transformers_rope: transformers' rotary application routed through
fastpe gives the installed transformers' own logits, and the patch comes off cleanly."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")

import fastpe  # noqa: E402
from fastpe.integrations.transformers_rope import patch_rotary  # noqa: E402


def _tiny_llama(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def test_patched_rotary_gives_transformers_logits_and_is_reversible():
    model = _tiny_llama()
    ids = torch.randint(0, 96, (2, 37), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    # per-sequence position ids (cos/sin get a batch dim), not a shift of each other (RoPE
    # scores would not see a shift)
    position_ids = torch.stack([torch.arange(37), 3 * torch.arange(37)])
    original = modeling_llama.apply_rotary_pos_emb
    with torch.no_grad():
        want = model(ids, attention_mask=mask, position_ids=position_ids).logits
        calls = []
        with patch_rotary("llama"):
            patched = modeling_llama.apply_rotary_pos_emb
            assert patched is not original and patched.__wrapped__ is original

            def counting(*args, **kwargs):
                calls.append(1)
                return patched(*args, **kwargs)

            modeling_llama.apply_rotary_pos_emb = counting
            got = model(ids, attention_mask=mask, position_ids=position_ids).logits
            modeling_llama.apply_rotary_pos_emb = patched
        assert modeling_llama.apply_rotary_pos_emb is original
    assert len(calls) == 2  # one per layer: the patched function was the one called
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_patched_rotary_in_generate_gives_the_same_tokens():
    model = _tiny_llama()
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(2))
    kw = {"max_new_tokens": 8, "do_sample": False}
    with torch.no_grad():
        want = model.generate(ids, **kw)
        with patch_rotary():
            got = model.generate(ids, **kw)
    assert torch.equal(got, want)


def test_patches_nest_and_restore_once():
    original = modeling_llama.apply_rotary_pos_emb
    outer = patch_rotary("llama")
    inner = patch_rotary("transformers.models.llama.modeling_llama")
    patched = modeling_llama.apply_rotary_pos_emb
    inner.restore()
    assert modeling_llama.apply_rotary_pos_emb is patched  # the outer patch still holds
    inner.restore()  # a second restore is a no-op, not an extra undo
    assert modeling_llama.apply_rotary_pos_emb is patched
    outer.restore()
    assert modeling_llama.apply_rotary_pos_emb is original


def test_bfloat16_close_to_transformers_and_gradients(monkeypatch):
    q, k = (torch.randn(2, h, 9, 16).to(torch.bfloat16) for h in (4, 2))
    emb = modeling_llama.LlamaRotaryEmbedding(_tiny_llama().config)
    cos, sin = emb(q, torch.arange(9)[None].expand(2, 9))
    cos, sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    original = modeling_llama.apply_rotary_pos_emb
    want = original(q.double(), k.double(), cos.double(), sin.double())
    eager = original(q, k, cos, sin)
    qf, kf, cf, sf = (t.float() for t in (q, k, cos, sin))
    grads = [torch.randn(qf.shape), torch.randn(kf.shape)]
    want_grads = torch.autograd.grad(
        original(qf.requires_grad_(), kf.requires_grad_(), cf, sf), [qf, kf], grads
    )
    calls = []
    real = fastpe.apply_rope
    monkeypatch.setattr(fastpe, "apply_rope", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with patch_rotary():
        got = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
        # q and k that need gradients go through fastpe, whose backward rotates them back
        got_grads = torch.autograd.grad(
            modeling_llama.apply_rotary_pos_emb(qf, kf, cf, sf), [qf, kf], grads
        )
        assert len(calls) == 2
        # cos/sin that need gradients: transformers' own function (fastpe has none for tables)
        cg = cf.clone().requires_grad_()
        modeling_llama.apply_rotary_pos_emb(qf, kf, cg, sf)[0].sum().backward()
        assert len(calls) == 2 and cg.grad is not None
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    for g, e, w in zip(got, eager, want, strict=True):
        assert g.dtype == torch.bfloat16
        # one rounding: no further from the float64 answer than transformers' bf16 arithmetic
        assert (g.double() - w).abs().max() <= (e.double() - w).abs().max()


def test_patched_llama_trains_like_transformers(monkeypatch):
    """A training step of a tiny Llama with the rotary patch: the same loss and parameter
    gradients as transformers' own rotary application (q and k went through fastpe)."""
    calls = []
    real = fastpe.apply_rope
    monkeypatch.setattr(fastpe, "apply_rope", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ids = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(2))
    position_ids = torch.stack([torch.arange(21), 2 * torch.arange(21)])
    results = []
    for patched in (False, True):
        model = _tiny_llama().train()
        with patch_rotary() if patched else contextlib.nullcontext():
            loss = model(input_ids=ids, position_ids=position_ids, labels=ids).loss
            loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (want_loss, want), (loss, got) = results
    assert len(calls) == 2  # one per layer
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_unknown_module_is_a_clear_error():
    with pytest.raises(ValueError, match="no_such_model"):
        patch_rotary("no_such_model")
