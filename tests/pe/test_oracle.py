"""Closed-form facts and independent implementations (torch, transformers) against every backend:
the sinusoidal and RoPE tables, apply_rope and embed.

Each test runs on every registered backend (the ``backend`` fixture of tests/conftest.py): the
float64 oracle with its strict tolerances, the kernels with their dtype's. A backend that cannot
run a case (Triton with NumPy arrays or float64) is skipped with its reasons. NumPy arrays and
torch CPU tensors both.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from _testkit import loose, needs_torch, require, to_fw, to_np, torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastpe

ORACLE = {"backend": "numpy"}


# ---------------------------------------------------------------------------------------------
# sinusoidal tables (docs/math.md#sinusoidal-encoding)


def test_spec_worked_example(backend):
    pe = fastpe.sinusoidal_table(2, 4, dtype="float64", backend=backend)
    np.testing.assert_allclose(pe[0], [0, 1, 0, 1], atol=0)
    np.testing.assert_allclose(pe[1], [0.8415, 0.5403, 0.0100, 0.99995], atol=5e-5)
    np.testing.assert_allclose(
        pe[1], [math.sin(1), math.cos(1), math.sin(0.01), math.cos(0.01)], rtol=1e-15
    )


@pytest.mark.parametrize("layout", ["interleaved", "concat"])
@pytest.mark.parametrize("freq", ["paper", "tensor2tensor"])
def test_position_zero_and_unit_pairs(backend, layout, freq):
    pe = fastpe.sinusoidal_table(50, 12, layout=layout, freq=freq, dtype="float64", backend=backend)
    sin = pe[:, 0::2] if layout == "interleaved" else pe[:, :6]
    cos = pe[:, 1::2] if layout == "interleaved" else pe[:, 6:]
    np.testing.assert_array_equal(sin[0], 0)
    np.testing.assert_array_equal(cos[0], 1)
    np.testing.assert_allclose(sin**2 + cos**2, 1, atol=loose(backend, 1e-15, 1e-14))
    # the first frequency is 1 in both schemes: column 0 is sin(p)
    np.testing.assert_allclose(sin[:, 0], np.sin(np.arange(50)), atol=loose(backend, 1e-15, 1e-14))


@pytest.mark.parametrize("layout", ["interleaved", "concat"])
@pytest.mark.parametrize("freq", ["paper", "tensor2tensor"])
@given(p=st.integers(0, 5000), k=st.integers(-2000, 2000))
@settings(max_examples=25, deadline=None)
def test_relative_transform_shifts_positions(backend, layout, freq, p, k):
    require(backend, "sinusoidal_table", 1, 16, dtype="float64")
    if p + k < 0:
        k = -p
    kwargs = {"layout": layout, "freq": freq}
    pe = fastpe.sinusoidal_table(1, 16, offset=p, dtype="float64", **kwargs, backend=backend)[0]
    shifted = fastpe.sinusoidal_table(
        1, 16, offset=p + k, dtype="float64", **kwargs, backend=backend
    )[0]
    t = fastpe.relative_transform(k, 16, **kwargs)
    np.testing.assert_allclose(t @ pe, shifted, atol=1e-9)
    # T(k) is a rotation: orthogonal, and T(-k) undoes it
    np.testing.assert_allclose(t @ t.T, np.eye(16), atol=1e-12)
    np.testing.assert_allclose(
        fastpe.relative_transform(-k, 16, **kwargs) @ t, np.eye(16), atol=1e-12
    )


def test_offset_is_a_slice_of_the_full_table(backend):
    full = fastpe.sinusoidal_table(40, 8, dtype="float64", backend=backend)
    part = fastpe.sinusoidal_table(10, 8, offset=25, dtype="float64", backend=backend)
    np.testing.assert_allclose(part, full[25:35], rtol=0, atol=loose(backend, 0, 1e-14))


def test_matches_transformers_tables(backend):
    pytest.importorskip("transformers")
    from transformers.models.m2m_100.modeling_m2m_100 import M2M100SinusoidalPositionalEmbedding
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding
    from transformers.models.xlm.modeling_xlm import create_sinusoidal_embeddings

    n, d = 64, 24
    xlm = create_sinusoidal_embeddings(n, d, torch.empty(n, d))
    np.testing.assert_allclose(
        fastpe.sinusoidal_table(n, d, backend=backend), xlm.numpy(), atol=1e-6
    )
    marian = MarianSinusoidalPositionalEmbedding(n, d).create_weight()
    np.testing.assert_allclose(
        fastpe.sinusoidal_table(n, d, layout="concat", backend=backend), marian.numpy(), atol=1e-6
    )
    # M2M100 / fairseq compute p·ω in float32: error grows like p·eps
    m2m = M2M100SinusoidalPositionalEmbedding.get_embedding(n, d)
    ours = fastpe.sinusoidal_table(n, d, layout="concat", freq="tensor2tensor", backend=backend)
    np.testing.assert_allclose(ours, m2m.numpy(), atol=2e-5)


def test_float32_table_is_accurate_at_a_million_positions(backend):
    """The oracle's float32 table is the float64 truth rounded once, even at p ~ 2^20."""
    offset = 2**20 - 16
    table = fastpe.sinusoidal_table(16, 64, offset=offset, backend=backend)
    p = np.arange(offset, offset + 16, dtype=np.float64)[:, None]
    omega = 10000.0 ** (-np.arange(32) * 2 / 64)
    # the oracle rounds the truth once; kernels may add up to 2.5e-7 (within the 1e-6 promise)
    np.testing.assert_allclose(table[:, 0::2], np.sin(p * omega), atol=loose(backend, 6e-8, 3e-7))


@needs_torch
def test_tables_as_torch_tensors(backend):
    pe = fastpe.sinusoidal_table(5, 8, dtype="bfloat16", device="cpu", backend=backend)
    assert isinstance(pe, torch.Tensor) and pe.dtype == torch.bfloat16 and pe.shape == (5, 8)
    ref = fastpe.sinusoidal_table(5, 8, dtype="float64", **ORACLE)
    np.testing.assert_allclose(pe.float().numpy(), ref, atol=4e-3)
    cos, sin = fastpe.rope_table(
        7, 6, dtype=torch.float32, device=torch.device("cpu"), backend=backend
    )
    assert cos.dtype == torch.float32 and cos.shape == (7, 3)


# ---------------------------------------------------------------------------------------------
# RoPE (docs/math.md#rope)


SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 512},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 16,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "truncate": False,
    },
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    {
        "rope_type": "longrope",
        "short_factor": list(np.linspace(1.0, 2.0, 32)),
        "long_factor": list(np.linspace(1.0, 8.0, 32)),
        "original_max_position_embeddings": 256,
        "max_position_embeddings": 2048,
    },
]


@pytest.mark.parametrize(
    "scaling", SCALINGS, ids=lambda s: "default" if s is None else s["rope_type"]
)
@pytest.mark.parametrize("seq_len", [None, 300, 4096])
def test_rope_inv_freq_matches_transformers(scaling, seq_len):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "default"} if scaling is None else dict(scaling)
    mpe = params.pop("max_position_embeddings", 2048)
    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
        max_position_embeddings=mpe,
        rope_parameters={**params, "rope_theta": 50000.0},
    )
    ours, ours_factor = fastpe.rope_inv_freq(
        64,
        base=50000.0,
        scaling=None if scaling is None else {**scaling, "max_position_embeddings": mpe},
        seq_len=seq_len,
    )
    if scaling is None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        theirs, their_factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        theirs, their_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu", seq_len)
    assert ours.dtype == np.float64 and ours.shape == (32,)
    np.testing.assert_allclose(ours, theirs.double().numpy(), rtol=2e-6)
    assert ours_factor == pytest.approx(their_factor, rel=1e-6)


def test_rope_table_closed_form(backend):
    cos, sin = fastpe.rope_table(10, 8, base=100.0, dtype="float64", backend=backend)
    inv = 100.0 ** (-np.arange(0, 8, 2) / 8)
    np.testing.assert_allclose(
        cos,
        np.cos(np.arange(10)[:, None] * inv),
        rtol=loose(backend, 1e-15, 0),
        atol=loose(backend, 0, 1e-14),
    )
    np.testing.assert_allclose(
        sin,
        np.sin(np.arange(10)[:, None] * inv),
        rtol=loose(backend, 1e-15, 0),
        atol=loose(backend, 0, 1e-14),
    )
    scaled = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    c2, s2 = fastpe.rope_table(10, 8, scaling=scaled, dtype="float64", backend=backend)
    _, factor = fastpe.rope_inv_freq(8, scaling=scaled)
    assert factor > 1
    np.testing.assert_allclose(c2**2 + s2**2, factor**2, rtol=1e-14)


def _hf_rotate(x, cos_half, sin_half, positions):
    """transformers' Llama rotate_half formula on [B, H, S, D] with duplicated cos/sin."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos = torch.from_numpy(np.concatenate([cos_half, cos_half], -1)[positions])  # [B, S, R]
    sin = torch.from_numpy(np.concatenate([sin_half, sin_half], -1)[positions])
    r = cos.shape[-1]
    x = torch.from_numpy(x)
    rotated, _ = apply_rotary_pos_emb(x[..., :r], x[..., :r], cos, sin)
    return torch.cat([rotated, x[..., r:]], -1).numpy()


@pytest.mark.parametrize("rotary_dim", [12, 8])
def test_apply_rope_matches_transformers(backend, fw, rng, rotary_dim):
    pytest.importorskip("transformers")
    x = rng.standard_normal((2, 3, 5, 12))
    cos, sin = fastpe.rope_table(20, rotary_dim, dtype="float64", **ORACLE)
    positions = rng.integers(0, 20, size=(2, 5))
    out = fastpe.apply_rope(
        to_fw(x, fw),
        to_fw(cos, fw),
        to_fw(sin, fw),
        positions=to_fw(positions, fw),
        backend=backend,
    )
    np.testing.assert_allclose(to_np(out), _hf_rotate(x, cos, sin, positions), atol=1e-12)
    # bshd layout is the same rotation on a transposed array
    out_bshd = fastpe.apply_rope(
        to_fw(x.transpose(0, 2, 1, 3), fw),
        to_fw(cos, fw),
        to_fw(sin, fw),
        positions=to_fw(positions, fw),
        layout="bshd",
        backend=backend,
    )
    np.testing.assert_allclose(to_np(out_bshd).transpose(0, 2, 1, 3), to_np(out), atol=0)


def test_apply_rope_interleaved_is_gptj_pairing(backend, rng):
    """GPT-J pairs (2i, 2i+1): permuting to halves makes it the NeoX rotation."""
    x = rng.standard_normal((1, 2, 6, 8))
    cos, sin = fastpe.rope_table(6, 8, dtype="float64", **ORACLE)
    gptj = fastpe.apply_rope(x, cos, sin, interleaved=True, backend=backend)
    perm = np.r_[0:8:2, 1:8:2]  # interleaved -> [evens | odds]
    neox = fastpe.apply_rope(x[..., perm], cos, sin, backend=backend)
    np.testing.assert_allclose(gptj[..., perm], neox, atol=loose(backend, 1e-14, 1e-12))


@given(
    shape=st.tuples(
        st.integers(1, 3), st.integers(1, 3), st.integers(1, 6), st.sampled_from([2, 4, 6, 10])
    ),
    interleaved=st.booleans(),
    offset=st.integers(0, 30),
)
@settings(max_examples=30, deadline=None)
def test_rope_preserves_pair_norms_and_is_identity_at_zero(backend, shape, interleaved, offset):
    require(backend, "apply_rope", np.zeros((1, 1, 1, 2)), np.ones((1, 1)), np.zeros((1, 1)))
    x = np.random.default_rng(0).standard_normal(shape)
    d = shape[-1]
    cos, sin = fastpe.rope_table(64, d, dtype="float64", **ORACLE)
    out = fastpe.apply_rope(x, cos, sin, positions=offset, interleaved=interleaved, backend=backend)
    pairs = (
        (lambda a: a[..., 0::2] ** 2 + a[..., 1::2] ** 2)
        if interleaved
        else (lambda a: a[..., : d // 2] ** 2 + a[..., d // 2 :] ** 2)
    )
    np.testing.assert_allclose(pairs(out), pairs(x), rtol=1e-12)
    at_zero = fastpe.apply_rope(
        x,
        cos,
        sin,
        positions=np.zeros(shape[2], np.int64),
        interleaved=interleaved,
        backend=backend,
    )
    np.testing.assert_array_equal(at_zero, x)


def test_apply_rope_positions_forms_agree(backend, rng):
    x = rng.standard_normal((2, 2, 4, 6))
    cos, sin = fastpe.rope_table(16, 6, dtype="float64", **ORACLE)
    by_offset = fastpe.apply_rope(x, cos, sin, positions=3, backend=backend)
    by_seq = fastpe.apply_rope(x, cos, sin, positions=np.arange(3, 7), backend=backend)
    by_batch = fastpe.apply_rope(
        x, cos, sin, positions=np.tile(np.arange(3, 7), (2, 1)), backend=backend
    )
    np.testing.assert_array_equal(by_offset, by_seq)
    np.testing.assert_array_equal(by_offset, by_batch)


def test_apply_rope_inplace_and_inputs_untouched(backend, fw, rng):
    x = to_fw(rng.standard_normal((1, 2, 3, 4)), fw)
    before = to_np(x).copy()
    cos, sin = fastpe.rope_table(3, 4, dtype="float64", **ORACLE)
    out = fastpe.apply_rope(x, to_fw(cos, fw), to_fw(sin, fw), backend=backend)
    np.testing.assert_array_equal(to_np(x), before)
    same = fastpe.apply_rope(x, to_fw(cos, fw), to_fw(sin, fw), inplace=True, backend=backend)
    assert same is x
    np.testing.assert_array_equal(to_np(x), to_np(out))


@needs_torch
def test_apply_rope_low_precision_torch(backend, rng):
    x = torch.from_numpy(rng.standard_normal((1, 2, 8, 16))).to(torch.bfloat16)
    cos, sin = fastpe.rope_table(8, 16, dtype="float32", device="cpu", **ORACLE)
    out = fastpe.apply_rope(x, cos, sin, backend=backend)
    assert out.dtype == torch.bfloat16
    ref = fastpe.apply_rope(
        x.double().numpy(), cos.double().numpy(), sin.double().numpy(), **ORACLE
    )
    np.testing.assert_allclose(out.double().numpy(), ref, atol=2e-2)


# ---------------------------------------------------------------------------------------------
# embedding + PE (docs/math.md#embedding)


def test_embed_is_the_three_way_sum(backend, fw, rng):
    weight = rng.standard_normal((11, 8))
    ids = rng.integers(0, 11, size=(2, 5))
    tt_w = rng.standard_normal((2, 8))
    tt = rng.integers(0, 2, size=(2, 5))
    out = fastpe.embed(
        to_fw(ids, fw),
        to_fw(weight, fw),
        scale=math.sqrt(8),
        positions=4,
        token_type_ids=to_fw(tt, fw),
        token_type_weight=to_fw(tt_w, fw),
        backend=backend,
    )
    pe = fastpe.sinusoidal_table(5, 8, offset=4, dtype="float64", **ORACLE)
    np.testing.assert_allclose(
        to_np(out), math.sqrt(8) * weight[ids] + pe + tt_w[tt], atol=loose(backend, 1e-14, 1e-12)
    )


def test_embed_learned_table_and_no_pe(backend, fw, rng):
    weight = rng.standard_normal((7, 6))
    table = rng.standard_normal((9, 6))
    ids = rng.integers(0, 7, size=(3, 4))
    positions = rng.integers(0, 9, size=(3, 4))
    out = fastpe.embed(
        to_fw(ids, fw),
        to_fw(weight, fw),
        pe="table",
        pe_table=to_fw(table, fw),
        positions=to_fw(positions, fw),
        backend=backend,
    )
    np.testing.assert_allclose(
        to_np(out), weight[ids] + table[positions], atol=loose(backend, 1e-15, 1e-12)
    )
    plain = fastpe.embed(to_fw(ids, fw), to_fw(weight, fw), pe=None, scale=2.0, backend=backend)
    np.testing.assert_allclose(to_np(plain), 2.0 * weight[ids], atol=loose(backend, 0, 1e-12))


def test_embed_matches_bert_embeddings(backend):
    pytest.importorskip("transformers")
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertEmbeddings

    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        max_position_embeddings=32,
        type_vocab_size=2,
        hidden_dropout_prob=0.0,
    )
    emb = BertEmbeddings(config).eval()
    ids = torch.randint(0, 50, (2, 7))
    tt = torch.randint(0, 2, (2, 7))
    with torch.no_grad():
        before_norm = (
            emb.word_embeddings(ids)
            + emb.token_type_embeddings(tt)
            + emb.position_embeddings(torch.arange(7))
        )
        ours = fastpe.embed(
            ids,
            emb.word_embeddings.weight,
            pe="table",
            pe_table=emb.position_embeddings.weight,
            token_type_ids=tt,
            token_type_weight=emb.token_type_embeddings.weight,
            backend=backend,
        )
    torch.testing.assert_close(ours, before_norm, rtol=1e-6, atol=1e-6)
