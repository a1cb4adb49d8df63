"""fastpe.integrations.transformers_rope: transformers' rotary application routed through
fastpe gives the installed transformers' own logits, and the patch comes off cleanly."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")

from fastpe.integrations.transformers_rope import patch_rotary  # noqa: E402


def _tiny_llama(dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                         attn_implementation="sdpa")  # fmt: skip
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


def test_bfloat16_close_to_transformers_and_falls_back_for_gradients():
    q, k = (torch.randn(2, h, 9, 16).to(torch.bfloat16) for h in (4, 2))
    emb = modeling_llama.LlamaRotaryEmbedding(_tiny_llama().config)
    cos, sin = emb(q, torch.arange(9)[None].expand(2, 9))
    cos, sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    original = modeling_llama.apply_rotary_pos_emb
    want = original(q.double(), k.double(), cos.double(), sin.double())
    eager = original(q, k, cos, sin)
    with patch_rotary():
        got = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
        qg = q.float().requires_grad_()
        out = modeling_llama.apply_rotary_pos_emb(qg, k.float(), cos.float(), sin.float())
        out[0].sum().backward()  # fell back to transformers' own function: it has a backward
    assert qg.grad is not None
    for g, e, w in zip(got, eager, want, strict=True):
        assert g.dtype == torch.bfloat16
        # one rounding: no further from the float64 answer than transformers' bf16 arithmetic
        assert (g.double() - w).abs().max() <= (e.double() - w).abs().max()


def test_unknown_module_is_a_clear_error():
    with pytest.raises(ValueError, match="no_such_model"):
        patch_rotary("no_such_model")
