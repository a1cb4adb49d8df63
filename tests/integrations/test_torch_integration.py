"""torch custom ops, torch.compile, fastpe.nn modules and the transformers attention backend."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fastpe  # noqa: E402
import fastpe.nn  # noqa: E402
import fastpe.torch_ops  # noqa: E402, F401  (registers torch.ops.fastpe)
from fastpe.integrations.transformers import register  # noqa: E402

O = {"backend": "numpy"}


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(2, 4, 9, 16, generator=g),
        torch.randn(2, 2, 11, 16, generator=g),
        torch.randn(2, 2, 11, 16, generator=g),
    )


# ---------------------------------------------------------------------------------------------
# custom ops


def test_opcheck_every_tensor_op(qkv):
    q, k, v = qkv
    cos, sin = fastpe.rope_table(16, 16, device="cpu")
    ids, weight = torch.randint(0, 20, (2, 5)), torch.randn(20, 16)
    mask = torch.rand(9, 11) < 0.8
    lse = torch.randn(2, 4, 9)
    ops = torch.ops.fastpe
    cases = [
        (
            ops.attention.default,
            (q, k, v),
            # by name: the schema's order is the op's own business
            dict(
                mask=mask,
                key_lengths=torch.tensor([11, 7]),
                relative_bias_table=None,
                relative_bias_num_buckets=32,
                relative_bias_max_distance=128,
                relative_bias_bidirectional=True,
                causal=True,
                causal_alignment="bottom_right",
                scale=None,
                window_left=3,
                window_right=0,
                softcap=5.0,
                sinks=torch.linspace(-1, 1, 4),
                alibi_slopes=torch.ones(4),
                rope_cos=cos,
                rope_sin=sin,
                rope_interleaved=True,
                rope_q_positions=None,
                rope_q_positions_offset=None,
                rope_k_positions=None,
                rope_k_positions_offset=0,
                backend="",
            ),
        ),
        (ops.apply_rope.default, (q, cos, sin, torch.arange(9), 0, False, "bhsd", ""), {}),
        (
            ops.embed.default,
            (
                ids,
                weight,
                None,
                3,
                "sinusoidal",
                None,
                4.0,
                10000.0,
                "concat",
                "paper",
                None,
                None,
                "",
            ),
            {},
        ),
        (ops.merge_attention.default, (q, lse, q, lse, ""), {}),
    ]
    for op, args, kwargs in cases:
        torch.library.opcheck(op, args, kwargs)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_attention_rope_embed(qkv, backend):
    q, k, v = qkv
    cos, sin = fastpe.rope_table(16, 16, device="cpu")
    ids, weight = torch.randint(0, 20, (2, 9)), torch.randn(20, 16)
    mask = torch.rand(2, 1, 9, 11) < 0.8

    def block(q, k, v, ids, weight, cos, sin, mask):
        x = fastpe.embed(ids, weight, scale=4.0, positions=2)  # [2, 9, 16]
        q = fastpe.apply_rope(q + x[:, None], cos, sin, positions=2)
        out, lse = fastpe.attention(
            q, k, v, causal=True, mask=mask, rope={"cos": cos, "sin": sin}, return_lse=True
        )
        return out * 2, lse

    args = (q, k, v, ids, weight, cos, sin, mask)
    compiled = torch.compile(block, fullgraph=True, backend=backend)  # raises on any graph break
    got, got_lse = compiled(*args)
    want, want_lse = block(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse, want_lse)
    # and both agree with the oracle
    x = fastpe.embed(ids, weight, scale=4.0, positions=2, **O)
    rq = fastpe.apply_rope(q + x[:, None], cos, sin, positions=2, **O)
    oracle = fastpe.attention(rq, k, v, causal=True, mask=mask, rope={"cos": cos, "sin": sin}, **O)
    torch.testing.assert_close(got, 2 * oracle, rtol=2e-5, atol=2e-5)


def test_compile_tables():
    table = torch.compile(
        lambda: fastpe.sinusoidal_table(12, 8, offset=5, device="cpu") + 0,
        fullgraph=True,
        backend="aot_eager",
    )()
    torch.testing.assert_close(table, fastpe.sinusoidal_table(12, 8, offset=5, device="cpu"))
    scaling = {"rope_type": "linear", "factor": 2.0}
    cos, _ = torch.compile(
        lambda: fastpe.rope_table(12, 8, scaling=scaling, device="cpu"),
        fullgraph=True,
        backend="aot_eager",
    )()
    torch.testing.assert_close(cos, fastpe.rope_table(12, 8, scaling=scaling, device="cpu")[0])


def test_grad_inputs_run_forward_and_merge_has_backward(qkv):
    q, k, v = qkv
    q = q.clone().requires_grad_()
    out = fastpe.attention(q, k, v, causal=True)
    torch.testing.assert_close(out.detach(), fastpe.attention(q.detach(), k, v, causal=True))
    # attention, apply_rope, embed (tests/attention/test_backward.py,
    # tests/pe/test_rope_embed_backward.py) and merge_attention (tests/attention/test_merge_backward.py) have
    # backward passes: attention over two halves of the keys, merged, has the gradients of one
    # call over all of them, lse included
    k, v = k.clone().requires_grad_(), v.clone().requires_grad_()
    n = k.shape[2] // 2
    parts = [
        fastpe.attention(q, k[:, :, s], v[:, :, s], return_lse=True)
        for s in (slice(None, n), slice(n, None))
    ]
    merged = fastpe.merge_attention(*parts[0], *parts[1])
    whole = fastpe.attention(q, k, v, return_lse=True)
    gen = torch.Generator().manual_seed(0)
    upstream = [torch.randn(t.shape, generator=gen) for t in whole]
    got = torch.autograd.grad(merged, (q, k, v), upstream)
    want = torch.autograd.grad(whole, (q, k, v), upstream)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_cpu_tensors_through_the_op(qkv, dtype):
    q, k, v = (t.to(dtype) for t in qkv)
    got = torch.compile(
        lambda q, k, v: fastpe.attention(q, k, v, causal=True), fullgraph=True, backend="aot_eager"
    )(q, k, v)
    assert got.dtype == dtype
    want = fastpe.attention(q.double(), k.double(), v.double(), causal=True, **O)
    plain = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    )
    plain_err = (
        (plain.double() - fastpe.attention(q.double(), k.double(), v.double(), **O)).abs().max()
    )
    assert (got.double() - want).abs().max() <= 2 * plain_err + 1e-6


# ---------------------------------------------------------------------------------------------
# fastpe.nn


def test_sinusoidal_module():
    module = fastpe.nn.SinusoidalPositionalEmbedding(12, layout="concat", max_positions=8)
    torch.testing.assert_close(
        module(5, offset=3), fastpe.sinusoidal_table(5, 12, layout="concat", offset=3, device="cpu")
    )
    positions = torch.tensor([[0, 20, 7], [3, 3, 1]])  # 20 > max_positions: the table grows
    full = fastpe.sinusoidal_table(21, 12, layout="concat", dtype="float64", **O)
    torch.testing.assert_close(
        module(positions).double(), torch.from_numpy(full[positions.numpy()]), rtol=0, atol=1e-7
    )


ROPE_CONFIGS = [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 2.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "dynamic", "factor": 2.0},
]


@pytest.mark.parametrize("params", ROPE_CONFIGS, ids=lambda p: p["rope_type"])
@pytest.mark.parametrize("length", [40, 300])  # inside and beyond max_position_embeddings
def test_rotary_module_matches_transformers(params, length):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        rope_parameters={**params, "rope_theta": 1000.0},
    )
    theirs = LlamaRotaryEmbedding(config)
    ours = fastpe.nn.RotaryEmbedding.from_config(config)
    x = torch.randn(2, 4, length, 32)
    position_ids = torch.arange(length)[None].expand(2, -1)
    cos, sin = ours(x, position_ids)
    want_cos, want_sin = theirs(x, position_ids)
    assert cos.shape == want_cos.shape == (2, length, 32)
    # transformers rounds p·inv_freq to float32 first: its error grows like p·2^-24
    tol = 2e-7 * length + 1e-6
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=tol)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=tol)
    assert ours.attention_scaling == pytest.approx(theirs.attention_scaling)


def test_fused_embedding_in_bert():
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=60,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=40,
        type_vocab_size=2,
    )
    model = BertModel(config).eval()
    ids, types = torch.randint(0, 60, (2, 7)), torch.randint(0, 2, (2, 7))
    emb = model.embeddings
    fused = fastpe.nn.FusedEmbedding.from_embedding(
        emb.word_embeddings,
        position_embedding=emb.position_embeddings,
        token_type_embedding=emb.token_type_embeddings,
    )
    with torch.no_grad():
        hidden = model(
            input_ids=ids, token_type_ids=types, output_hidden_states=True
        ).hidden_states[0]
        ours = emb.dropout(emb.LayerNorm(fused(ids, token_type_ids=types)))
    torch.testing.assert_close(ours, hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["marian", "m2m100"])
def test_fused_embedding_in_sinusoidal_encoders(family):
    if family == "marian":
        from transformers import MarianConfig
        from transformers import MarianModel as Model

        config = MarianConfig(
            vocab_size=50,
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            pad_token_id=0,
            scale_embedding=True,
        )
        options = {"layout": "concat", "freq": "paper"}
        tol = 1e-5  # Marian's table is float64 NumPy rounded to float32
    else:
        from transformers import M2M100Config
        from transformers import M2M100Model as Model

        config = M2M100Config(
            vocab_size=50,
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            pad_token_id=1,
            scale_embedding=True,
        )
        # fairseq's positions start after the padding index; its table is computed in float32
        options = {
            "layout": "concat",
            "freq": "tensor2tensor",
            "position_offset": config.pad_token_id + 1,
        }
        tol = 5e-5
    model = Model(config).eval()
    encoder = model.get_encoder()
    ids = torch.randint(2, 50, (2, 9))
    fused = fastpe.nn.FusedEmbedding.from_embedding(
        encoder.embed_tokens, scale=math.sqrt(32), **options
    )
    with torch.no_grad():
        hidden = encoder(input_ids=ids, output_hidden_states=True).hidden_states[0]
        ours = fused(ids)
    torch.testing.assert_close(ours, hidden, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------
# transformers attention backend


@pytest.fixture
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def left_padded():
    ids = torch.randint(1, 96, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = 0, 0
    ids[2, :1], mask[2, :1] = 0, 0
    return ids, mask


def _count_fastpe_calls(monkeypatch):
    calls = []
    real = fastpe.attention

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fastpe, "attention", counting)
    return calls


def test_llama_logits_match_sdpa_on_left_padded_batch(llama, left_padded, monkeypatch):
    ids, mask = left_padded
    with torch.no_grad():
        llama.set_attn_implementation("sdpa")
        want = llama(input_ids=ids, attention_mask=mask).logits
        calls = _count_fastpe_calls(monkeypatch)
        llama.set_attn_implementation(register())
        got = llama(input_ids=ids, attention_mask=mask).logits
    assert len(calls) == llama.config.num_hidden_layers
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    assert not torch.isnan(got).any()  # fully masked padding rows give zeros, not NaN


def test_llama_greedy_generate_with_kv_cache_matches_sdpa(llama, left_padded, monkeypatch):
    ids, mask = left_padded
    with torch.no_grad():
        llama.set_attn_implementation("sdpa")
        want = llama.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        calls = _count_fastpe_calls(monkeypatch)
        llama.set_attn_implementation(register("fastpe-test"))
        got = llama.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert len(calls) >= 10 * llama.config.num_hidden_layers  # prefill + every decoding step
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_unsupported_kwargs_raise(qkv):
    from fastpe.integrations.transformers import fastpe_attention_forward

    q, k, v = qkv
    module = torch.nn.Module()
    with pytest.raises(NotImplementedError, match="s_aux="):
        fastpe_attention_forward(module, q, k, v, None, sinks=torch.zeros(4))
    with pytest.raises(NotImplementedError, match="output_attentions"):
        fastpe_attention_forward(module, q, k, v, None, output_attentions=True)
    module.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        fastpe_attention_forward(module, q, k, v, None, dropout=0.1)
    module.eval()
    out, weights = fastpe_attention_forward(
        module, q, k, v, None, dropout=0.1
    )  # dropout is off in eval
    assert out.shape == (2, 9, 4, 16) and weights is None
    # no mask: fastpe_mask built none, so the keys end at the last query (bottom-right)
    np.testing.assert_allclose(
        out.transpose(1, 2).numpy(),
        fastpe.attention(q, k, v, causal=True, causal_alignment="bottom_right", **O).numpy(),
        atol=2e-6,
    )
