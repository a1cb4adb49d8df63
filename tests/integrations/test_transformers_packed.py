"""Padding-free packed batches in transformers with attn_implementation="fastpe".

``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` packs sequences into one row with
position ids restarting per sequence and FlashAttention's ``cu_seq_lens_q/k``; transformers
forwards those to the attention function, which runs ``fastpe.attention_varlen``. Expected
values: transformers' SDPA on each sequence alone, and SDPA on the packed row (its
block-diagonal mask), on a random-weight Llama.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fastpe  # noqa: E402
from fastpe.integrations.transformers import register  # noqa: E402

LENGTHS = (7, 13, 1, 20)


@pytest.fixture(scope="module")
def model_and_batch():
    from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config).eval()
    seqs = [torch.randint(1, 96, (n,)).tolist() for n in LENGTHS]
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_tensors="pt")
    batch = {k: v for k, v in collator([{"input_ids": s} for s in seqs]).items() if k != "labels"}
    return model, seqs, batch


def test_packed_batch_runs_varlen_and_matches_sdpa(model_and_batch, monkeypatch):
    model, seqs, batch = model_and_batch
    calls = []
    original = fastpe.attention_varlen
    monkeypatch.setattr(
        fastpe, "attention_varlen", lambda *a, **k: calls.append(a[3]) or original(*a, **k)
    )
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        alone = torch.cat([model(torch.tensor([s])).logits[0] for s in seqs])
        packed_sdpa = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits[0]  # no cache: transformers then reads the packing from position_ids
        model.set_attn_implementation(register())
        got = model(**batch).logits[0]
    assert len(calls) == model.config.num_hidden_layers  # one varlen call per layer
    assert torch.equal(calls[0].cpu(), batch["cu_seq_lens_q"])
    torch.testing.assert_close(got, alone, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got, packed_sdpa, atol=2e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), alone.argmax(-1))


def test_packed_batch_refuses_a_batch_of_rows(model_and_batch):
    model, _, batch = model_and_batch
    doubled = {
        k: torch.cat([v, v]) if k in ("input_ids", "position_ids") else v for k, v in batch.items()
    }
    model.set_attn_implementation(register())
    with torch.no_grad(), pytest.raises(ValueError, match="one packed row; got a batch of 2"):
        model(**doubled)
