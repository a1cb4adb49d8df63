"""fastpe as the attention of today's model families in transformers: sliding windows (Mistral,
Gemma 2, Gemma 3, gpt-oss), logit soft-capping (Gemma 2) and attention sinks (gpt-oss).

Random-weight tiny models (2 layers, one sliding and one full where the family alternates),
sequences longer than the window so that it really cuts. The expected values are transformers'
own eager attention (and SDPA where the model supports it): logits to float32 tolerance on a
left-padded batch (the mask path) and on an unpadded one (no mask built: causal rule and
window in the kernel), and identical greedy generate() tokens with a KV cache.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fastpe  # noqa: E402
from fastpe.integrations.transformers import register  # noqa: E402

WINDOW = 5
VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    pad_token_id=0,
    initializer_range=0.2,
)
ALTERNATING = ["sliding_attention", "full_attention"]


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**COMMON, sliding_window=WINDOW))


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    # a cap small enough to bite on these random scores
    config = Gemma2Config(
        **COMMON,
        sliding_window=WINDOW,
        layer_types=ALTERNATING,
        attn_logit_softcapping=0.5,
        final_logit_softcapping=None,
    )
    return Gemma2ForCausalLM(config)


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(
        Gemma3TextConfig(**COMMON, sliding_window=WINDOW, layer_types=ALTERNATING)
    )


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        **{**COMMON, "intermediate_size": 64},
        sliding_window=WINDOW,
        layer_types=ALTERNATING,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:  # sinks of either sign, large enough to matter
            layer.self_attn.sinks.copy_(torch.linspace(-2.0, 3.0, config.num_attention_heads))
    return model


FAMILIES = {"mistral": _mistral, "gemma2": _gemma2, "gemma3": _gemma3, "gpt_oss": _gpt_oss}
SDPA_FAMILIES = {"mistral", "gemma3"}


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    torch.manual_seed(0)
    try:
        model = FAMILIES[request.param]().eval()
    except (ImportError, AttributeError) as exc:  # an older transformers without the family
        pytest.skip(f"{request.param} not available: {exc}")
    return request.param, model


def _batch(padded: bool):
    ids = torch.randint(1, VOCAB, (3, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        ids[0, :4], mask[0, :4] = 0, 0
        ids[2, :1], mask[2, :1] = 0, 0
    return ids, mask


def _spy(monkeypatch):
    calls = []
    real = fastpe.attention

    def spying(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(fastpe, "attention", spying)
    return calls


def _logits(model, implementation, ids, mask):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("padded", [True, False])
def test_logits_match_eager(family, padded, monkeypatch):
    name, model = family
    ids, mask = _batch(padded)
    wants = {"eager": _logits(model, "eager", ids, mask)}
    if name in SDPA_FAMILIES:
        wants["sdpa"] = _logits(model, "sdpa", ids, mask)
    calls = _spy(monkeypatch)
    got = _logits(model, register(), ids, mask)
    assert len(calls) == model.config.num_hidden_layers
    real = mask.bool()
    for want in wants.values():
        torch.testing.assert_close(got[real], want[real], rtol=2e-5, atol=2e-5)
    assert not torch.isnan(got).any()
    windows = [c["window"] for c in calls]
    if not padded:  # no mask built: the kernel applies the causal rule and the window
        assert all(c["mask"] is None and c["causal"] for c in calls)
        assert (WINDOW - 1, 0) in windows
    else:
        assert all(c["mask"] is not None for c in calls)
    if name == "gemma2":
        assert all(c["softcap"] == 0.5 for c in calls)
    if name == "gpt_oss":
        assert all(c["sinks"] is not None for c in calls)


@pytest.mark.parametrize("padded", [True, False])
def test_greedy_generate_with_kv_cache_matches_eager(family, padded, monkeypatch):
    name, model = family
    ids, mask = _batch(padded)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model.generate(ids, **kw)
        calls = _spy(monkeypatch)
        model.set_attn_implementation(register("fastpe-test"))
        got = model.generate(ids, **kw)
    assert len(calls) >= 8 * model.config.num_hidden_layers  # prefill + every decoding step
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got.shape[1] - 1 > WINDOW  # the cache outgrows the window
