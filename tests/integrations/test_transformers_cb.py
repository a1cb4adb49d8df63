"""transformers' continuous batching (``generate_batch``, paged cache) with fastpe attention.

``register_flash()`` makes fastpe a FlashAttention implementation for transformers (the one
private loader it wraps is pinned below). Expected values: transformers' own continuous-batching
implementations (``paged|eager``, ``sdpa``) and plain ``generate()`` of each prompt alone with
``sdpa``, greedy, on a seeded random-weight Llama.
"""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fastpe  # noqa: E402
from fastpe.integrations import transformers as fastpe_hf  # noqa: E402

# prompts longer than MAX_BATCH_TOKENS are prefilled in chunks: later chunks attend to keys
# already in the paged cache (seqlen_q < seqlen_k, bottom-right causal)
PROMPT_LENGTHS = (5, 40, 1, 23, 71, 12)
MAX_BATCH_TOKENS = 32
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model_and_prompts():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 128, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    return model, prompts


def _generate_batch(model, prompts, implementation):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model.set_attn_implementation(implementation)
    generation = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    # a fixed cache: sizing it from free memory takes seconds on a CPU
    batching = ContinuousBatchingConfig(
        page_size=16, num_blocks=32, max_batch_tokens=MAX_BATCH_TOKENS, return_logprobs=True
    )
    with torch.no_grad():
        outputs = model.generate_batch(
            prompts, generation_config=generation, continuous_batching_config=batching
        )
    assert len(outputs) == len(prompts)
    ordered = [outputs[f"req_{i}"] for i in range(len(prompts))]
    assert [o.error for o in ordered] == [None] * len(prompts)
    assert model.config._attn_implementation == implementation  # nothing switched it
    return [o.generated_tokens for o in ordered], [o.logprobs for o in ordered]


@pytest.fixture(scope="module")
def reference_runs(model_and_prompts):
    model, prompts = model_and_prompts
    return {impl: _generate_batch(model, prompts, impl) for impl in ("paged|eager", "sdpa")}


def test_generate_batch_runs_fastpe_and_matches_builtin(
    model_and_prompts, reference_runs, monkeypatch
):
    model, prompts = model_and_prompts
    calls = []
    original = fastpe.attention_varlen

    def spy(q, k, v, cu_q, cu_k, **kwargs):
        calls.append((cu_q.diff().tolist(), cu_k.diff().tolist()))
        return original(q, k, v, cu_q, cu_k, **kwargs)

    monkeypatch.setattr(fastpe.flash_attn, "attention_varlen", spy)
    tokens, logprobs = _generate_batch(model, prompts, fastpe_hf.register_flash())
    for impl, (ref_tokens, ref_logprobs) in reference_runs.items():
        assert tokens == ref_tokens, impl
        torch.testing.assert_close(
            torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-5, rtol=1e-5, msg=impl
        )
    # every step went through fastpe: (prefill chunks + decode steps) x layers
    layers = model.config.num_hidden_layers
    assert calls and len(calls) % layers == 0
    pairs = [(q, k) for qs, ks in calls for q, k in zip(qs, ks, strict=True)]
    assert any(1 < q < k for q, k in pairs)  # a later prefill chunk reading cached keys
    assert any(q == 1 and k > 1 for q, k in pairs)  # a decode step
    assert any(len(qs) > 1 for qs, _ in calls)  # several requests in one packed call


def _generate_alone(model, prompts, implementation):
    """Greedy tokens of plain generate() on each prompt by itself (no batching, no paging)."""
    model.set_attn_implementation(implementation)
    alone = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            alone.append(out[0, len(prompt) :].tolist())
    return alone


def test_generate_batch_matches_generate_alone(model_and_prompts, reference_runs):
    """Independent of continuous batching: each prompt alone through plain generate()."""
    model, prompts = model_and_prompts
    alone = _generate_alone(model, prompts, "sdpa")
    tokens, _ = _generate_batch(model, prompts, fastpe_hf.register_flash())
    assert tokens == alone
    assert reference_runs["sdpa"][0] == alone


def test_flash_name_forward_with_padding_matches_sdpa(model_and_prompts, monkeypatch):
    """Outside continuous batching the name goes through transformers' FlashAttention path:
    padding removed, then fastpe's varlen function."""
    model, prompts = model_and_prompts
    calls = []
    original = fastpe.attention_varlen
    monkeypatch.setattr(
        fastpe.flash_attn, "attention_varlen", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    lengths = [len(p) for p in prompts[:3]]
    width = max(lengths)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for row, prompt in enumerate(prompts[:3]):  # left padding, as for generation
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        expected = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation(fastpe_hf.register_flash())
        got = model(input_ids=ids, attention_mask=mask).logits
    assert len(calls) == model.config.num_hidden_layers
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=2e-5, rtol=1e-5)


def test_flash_name_forward_without_padding_matches_sdpa(model_and_prompts, monkeypatch):
    """A full batch (no padding, no packing) takes transformers' dense FlashAttention call."""
    model, prompts = model_and_prompts
    ids = torch.tensor([prompts[1][:20], prompts[4][:20]])
    calls = []
    original = fastpe.attention
    monkeypatch.setattr(
        fastpe.flash_attn, "attention", lambda *a, **k: calls.append(k) or original(*a, **k)
    )
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        expected = model(input_ids=ids).logits
        model.set_attn_implementation(fastpe_hf.register_flash())
        got = model(input_ids=ids).logits
    assert len(calls) == model.config.num_hidden_layers and all(c["causal"] for c in calls)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_register_flash_refuses_names_transformers_would_misread():
    with pytest.raises(ValueError, match='containing "flash"'):
        fastpe_hf.register_flash("fastpe")
    with pytest.raises(ValueError, match="version digit"):
        fastpe_hf.register_flash("fastpe_flash_2")
    with pytest.raises(ValueError, match="Hub kernel"):
        fastpe_hf.register_flash("fastpe/flash")


def test_plain_register_name_is_refused_by_continuous_batching(model_and_prompts):
    """register()'s name is not a FlashAttention implementation: transformers refuses it for
    continuous batching with its own error (never runs it silently on another path)."""
    model, prompts = model_and_prompts
    with pytest.raises(ValueError, match="not supported for continuous batching"):
        _generate_batch(model, prompts[:1], fastpe_hf.register())


def test_patched_place_is_the_one_written_for():
    """Pins the one transformers internal register_flash wraps (written for transformers
    5.23). If this fails after a
    transformers upgrade, read transformers.modeling_flash_attention_utils: update
    _LOADER_PARAMETERS and _wrap_flash_loader in fastpe/integrations/transformers.py (or drop
    the wrap if transformers gained a public way to register a FlashAttention implementation),
    then the continuous-batching paragraphs in docs/integrations.md and docs/README.md."""
    import transformers.modeling_flash_attention_utils as fa_utils

    # checks of the installed transformers, not of its version string: a later release that
    # keeps this loader passes, one that changes it fails here and says where
    name = fastpe_hf.register_flash()
    loader = fa_utils._lazy_imports
    assert getattr(loader, "_fastpe_wrapped", False)
    original = loader.__wrapped__
    assert tuple(inspect.signature(original).parameters) == fastpe_hf._LOADER_PARAMETERS
    # the public entry point still reaches the loader through the module global we replace
    assert "_lazy_imports(" in inspect.getsource(fa_utils.lazy_import_flash_attention)
    (functions, _) = fa_utils.lazy_import_flash_attention(name)
    assert functions[:3] == (fastpe_hf._flash_func, fastpe_hf._flash_varlen_func, None)
    # without the wrap transformers cannot load the name (else the wrap is no longer needed)
    with pytest.raises(ValueError, match="Could not find"):
        original(name)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
def test_generate_batch_windows_softcap_sinks_match_eager_alone(family, monkeypatch):
    """Sliding windows shorter than the prompts (Mistral; Gemma 2 and gpt-oss alternate sliding
    and full layers), Gemma 2's soft-capping and gpt-oss's sinks reach fastpe through
    transformers' FlashAttention wrapper. Reference: each prompt alone through generate() with
    eager attention (paged|eager itself ignores Gemma 2's soft-capping)."""
    from test_transformers_models import FAMILIES

    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    name = fastpe_hf.register_flash()
    if family == "gpt_oss":  # else transformers swaps any flash name for gpt-oss's Hub kernels
        model._compatible_flash_implementations = [name]
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 96, (n,), generator=generator).tolist() for n in (3, 11, 19, 40)]
    alone = _generate_alone(model, prompts, "eager")
    calls = []
    original = fastpe.attention_varlen

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(fastpe.flash_attn, "attention_varlen", spy)
    tokens, _ = _generate_batch(model, prompts, name)
    assert tokens == alone
    assert any(c["window"] not in (None, (-1, -1)) for c in calls)  # the window really cut
    if family == "gemma2":
        assert all(c["softcap"] == model.config.attn_logit_softcapping for c in calls)
    if family == "gpt_oss":
        assert all(c["sinks"] is not None for c in calls)
