"""Closed-form facts and independent implementations (torch SDPA, transformers' T5 buckets)
against every backend: attention, its biases and fused RoPE, and merge_attention.

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
# attention (docs/math.md#attention)


def test_attention_hand_computed(backend):
    q = np.array([[[[1.0, 0.0]]]])  # [1, 1, 1, 2]
    k = np.array([[[[1.0, 0.0], [0.0, 1.0]]]])
    v = np.array([[[[1.0, 2.0], [3.0, 4.0]]]])
    out, lse = fastpe.attention(q, k, v, scale=1.0, return_lse=True, backend=backend)
    w0 = math.e / (math.e + 1)
    np.testing.assert_allclose(
        out[0, 0, 0],
        [w0 * 1 + (1 - w0) * 3, w0 * 2 + (1 - w0) * 4],
        rtol=loose(backend, 1e-15, 1e-13),
    )
    assert lse[0, 0, 0] == pytest.approx(math.log(math.e + 1), rel=1e-7)
    assert lse.dtype == np.float32


def _sdpa(q, k, v, **kwargs):
    import torch.nn.functional as F

    t = [torch.from_numpy(a) for a in (q, k, v)]
    return F.scaled_dot_product_attention(*t, **kwargs).numpy()


@needs_torch
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 2),
    group=st.integers(1, 3),
    sq=st.integers(1, 7),
    sk=st.integers(1, 9),
    d=st.sampled_from([1, 3, 8]),
    kind=st.sampled_from(["none", "bool", "float", "causal"]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
def test_attention_matches_torch_sdpa(backend, b, hkv, group, sq, sk, d, kind, seed):
    require(backend, "attention", *(np.zeros((1, 1, 1, 1)),) * 3)
    r = np.random.default_rng(seed)
    hq = hkv * group
    q, k, v = (
        r.standard_normal((b, hq, sq, d)),
        r.standard_normal((b, hkv, sk, d)),
        r.standard_normal((b, hkv, sk, d)),
    )
    kwargs, ours = {}, {}
    if kind == "bool":
        mask = r.random((1, hq, sq, sk)) < 0.7
        mask[..., 0] = True  # SDPA gives NaN for fully masked rows; those are tested separately
        kwargs["attn_mask"], ours["mask"] = torch.from_numpy(mask), mask
    elif kind == "float":
        mask = r.standard_normal((sq, sk))
        kwargs["attn_mask"], ours["mask"] = torch.from_numpy(mask), mask
    elif kind == "causal":
        if sk < sq:
            sk = sq
            k, v = r.standard_normal((b, hkv, sk, d)), r.standard_normal((b, hkv, sk, d))
        kwargs["is_causal"], ours["causal"], ours["causal_alignment"] = True, True, "top_left"
    expected = _sdpa(q, k, v, enable_gqa=group > 1, scale=0.7, **kwargs)
    got = fastpe.attention(q, k, v, scale=0.7, **ours, backend=backend)
    np.testing.assert_allclose(got, expected, atol=1e-12)


def test_bottom_right_causal_is_the_kv_cache_rule(backend, rng):
    """The last Sq queries of a causal Sk x Sk attention are a bottom-right causal Sq x Sk call."""
    q, k, v = (rng.standard_normal((2, 3, 9, 5)) for _ in range(3))
    full = fastpe.attention(q, k, v, causal=True, backend=backend)
    tail = fastpe.attention(q[:, :, -3:], k, v, causal=True, backend=backend)
    np.testing.assert_allclose(tail, full[:, :, -3:], atol=loose(backend, 1e-14, 1e-12))
    # a single decoding query sees every key
    last = fastpe.attention(q[:, :, -1:], k, v, causal=True, backend=backend)
    np.testing.assert_allclose(
        last,
        fastpe.attention(q[:, :, -1:], k, v, backend=backend),
        atol=loose(backend, 1e-14, 1e-12),
    )


def test_key_lengths_equal_truncated_keys(backend, rng):
    q, k, v = (
        rng.standard_normal((2, 2, 3, 4)),
        rng.standard_normal((2, 2, 6, 4)),
        rng.standard_normal((2, 2, 6, 4)),
    )
    k[1, :, 2:], v[1, :, 2:] = np.nan, np.nan  # padding must never be read into the result
    out = fastpe.attention(q, k, v, key_lengths=np.array([6, 2]), backend=backend)
    np.testing.assert_allclose(
        out[0],
        fastpe.attention(q[:1], k[:1], v[:1], **ORACLE)[0],
        atol=loose(backend, 1e-14, 1e-12),
    )
    np.testing.assert_allclose(
        out[1],
        fastpe.attention(q[1:], k[1:, :, :2], v[1:, :, :2], **ORACLE)[0],
        atol=loose(backend, 1e-14, 1e-12),
    )


def test_fully_masked_rows_give_zeros_and_minus_inf_lse(backend, fw, rng):
    q, k, v = (to_fw(rng.standard_normal((1, 2, 3, 4)), fw) for _ in range(3))
    mask = np.ones((3, 3), dtype=bool)
    mask[1] = False
    out, lse = fastpe.attention(q, k, v, mask=to_fw(mask, fw), return_lse=True, backend=backend)
    out, lse = to_np(out), to_np(lse)
    np.testing.assert_array_equal(out[:, :, 1], 0)
    assert np.isneginf(lse[:, :, 1]).all() and np.isfinite(lse[:, :, [0, 2]]).all()
    zero_len = to_np(
        fastpe.attention(q, k, v, key_lengths=to_fw(np.array([0]), fw), backend=backend)
    )
    np.testing.assert_array_equal(zero_len, 0)
    # bottom-right causal with more queries than keys: the first Sq - Sk rows see nothing
    early = to_np(fastpe.attention(q, k[:, :, :1], v[:, :, :1], causal=True, backend=backend))
    np.testing.assert_array_equal(early[:, :, :2], 0)
    assert not np.isnan(early).any()


@needs_torch
def test_alibi_and_t5_bias_match_sdpa_with_explicit_bias(backend, rng):
    pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    b, h, sq, sk, d = 2, 4, 5, 8, 6
    q, k, v = (
        rng.standard_normal((b, h, sq, d)),
        rng.standard_normal((b, h, sk, d)),
        rng.standard_normal((b, h, sk, d)),
    )
    slopes = 2.0 ** -np.arange(1, h + 1)
    qpos = np.arange(sq)[:, None] + sk - sq
    bias = -slopes[:, None, None] * np.abs(qpos - np.arange(sk)[None, :])
    np.testing.assert_allclose(
        fastpe.attention(q, k, v, alibi_slopes=slopes, backend=backend),
        _sdpa(q, k, v, attn_mask=torch.from_numpy(bias)),
        atol=1e-12,
    )
    table = rng.standard_normal((32, h))
    rel = torch.from_numpy(np.arange(sk)[None, :] - qpos)
    bucket = T5Attention._relative_position_bucket(
        rel, bidirectional=False, num_buckets=32, max_distance=40
    ).numpy()
    t5_bias = table[bucket].transpose(2, 0, 1)
    got = fastpe.attention(
        q,
        k,
        v,
        relative_bias={"table": table, "max_distance": 40, "bidirectional": False},
        backend=backend,
    )
    np.testing.assert_allclose(got, _sdpa(q, k, v, attn_mask=torch.from_numpy(t5_bias)), atol=1e-12)


@needs_torch
@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (16, 40), (8, 9)])
def test_t5_buckets_match_transformers(bidirectional, num_buckets, max_distance):
    pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    from fastpe.reference import t5_bucket

    rel = np.arange(-600, 601)
    theirs = T5Attention._relative_position_bucket(
        torch.from_numpy(rel),
        bidirectional=bidirectional,
        num_buckets=num_buckets,
        max_distance=max_distance,
    ).numpy()
    np.testing.assert_array_equal(t5_bucket(rel, bidirectional, num_buckets, max_distance), theirs)


def test_fused_rope_equals_rotating_first(backend, rng):
    q, k, v = (
        rng.standard_normal((2, 4, 3, 8)),
        rng.standard_normal((2, 2, 7, 8)),
        rng.standard_normal((2, 2, 7, 8)),
    )
    cos, sin = fastpe.rope_table(16, 6, dtype="float64", **ORACLE)
    fused = fastpe.attention(q, k, v, causal=True, rope={"cos": cos, "sin": sin}, backend=backend)
    # default positions: keys 0..6, queries aligned to the end (4..6)
    rq = fastpe.apply_rope(q, cos, sin, positions=4, **ORACLE)
    rk = fastpe.apply_rope(k, cos, sin, **ORACLE)
    np.testing.assert_allclose(
        fused,
        fastpe.attention(rq, rk, v, causal=True, backend=backend),
        atol=loose(backend, 1e-14, 1e-12),
    )
    qp = rng.integers(0, 16, size=(2, 3))
    explicit = fastpe.attention(
        q,
        k,
        v,
        rope={"cos": cos, "sin": sin, "interleaved": True, "q_positions": qp, "k_positions": 2},
        backend=backend,
    )
    rq = fastpe.apply_rope(q, cos, sin, positions=qp, interleaved=True, **ORACLE)
    rk = fastpe.apply_rope(k, cos, sin, positions=2, interleaved=True, **ORACLE)
    np.testing.assert_allclose(
        explicit, fastpe.attention(rq, rk, v, backend=backend), atol=loose(backend, 1e-14, 1e-12)
    )


@given(split=st.integers(0, 10), causal=st.booleans(), seed=st.integers(0, 1000))
@settings(max_examples=25, deadline=None)
def test_merge_of_disjoint_key_halves_is_the_whole(backend, split, causal, seed):
    require(backend, "attention", *(np.zeros((1, 1, 1, 1)),) * 3)
    r = np.random.default_rng(seed)
    q, k, v = (
        r.standard_normal((1, 2, 10, 4)),
        r.standard_normal((1, 2, 10, 4)),
        r.standard_normal((1, 2, 10, 4)),
    )
    keep = np.arange(10) < split  # keys of part a
    mask_a = np.broadcast_to(keep, (10, 10))
    kw = {"causal": causal, "return_lse": True, "backend": backend}
    out_a, lse_a = fastpe.attention(q, k, v, mask=mask_a, **kw)
    out_b, lse_b = fastpe.attention(q, k, v, mask=~mask_a, **kw)
    out, lse = fastpe.merge_attention(out_a, lse_a, out_b, lse_b, backend=backend)
    full, full_lse = fastpe.attention(q, k, v, causal=causal, return_lse=True, **ORACLE)
    # lse is float32 by contract (docs/math.md), so merge weights carry its ~6e-8 relative rounding
    np.testing.assert_allclose(out, full, atol=1e-6)
    np.testing.assert_allclose(lse, full_lse, rtol=1e-6)


def test_lse_is_logsumexp_of_scores(backend, rng):
    q, k, v = (
        rng.standard_normal((1, 1, 4, 3)),
        rng.standard_normal((1, 1, 5, 3)),
        rng.standard_normal((1, 1, 5, 3)),
    )
    _, lse = fastpe.attention(q, k, v, scale=0.5, return_lse=True, backend=backend)
    scores = 0.5 * q[0, 0] @ k[0, 0].T
    np.testing.assert_allclose(lse[0, 0], np.log(np.exp(scores).sum(-1)), rtol=1e-6)


@needs_torch
def test_attention_torch_in_torch_out(backend, rng):
    q = torch.from_numpy(rng.standard_normal((1, 2, 4, 8))).to(torch.float16)
    out, lse = fastpe.attention(q, q, q, causal=True, return_lse=True, backend=backend)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32 and out.shape == q.shape
