"""Every kernel backend against the float64 oracle on the shared test grid: attention (every
option combination) and merge_attention.

Parametrised over the backends the registry has (never the oracle itself); a combination a
backend cannot run is skipped with its reasons. Tolerances per dtype; for float16/bfloat16 the
flash-attention rule: error vs the oracle at most 2x that of a plain computation in that dtype.
"""

from __future__ import annotations

import numpy as np
import pytest
from _testkit import KERNEL_BACKENDS, check_close, grid, to_fw, to_np, torch

import fastpe

O = {"backend": "numpy"}


# ---------------------------------------------------------------------------------------------
ATTN_CASES = {
    "plain": {},
    "causal": {"causal": True},
    "causal_top_left": {"causal": True, "causal_alignment": "top_left"},
    "bool_mask": {"mask": "bool"},
    "float_mask": {"mask": "float"},
    "key_lengths": {"key_lengths": True},
    "alibi": {"alibi_slopes": True, "causal": True},
    "t5": {"relative_bias": True},
    "rope": {"rope": True, "causal": True},
    "everything": {
        "causal": True,
        "mask": "bool",
        "key_lengths": True,
        "alibi_slopes": True,
        "relative_bias": True,
        "rope": True,
    },
}


def _attention_args(rng, fw, b, hq, hkv, sq, sk, d, options, dtype=np.float32):
    q = rng.standard_normal((b, hq, sq, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, sk, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, sk, d)).astype(dtype)
    kw = {}
    for name, value in options.items():
        if name == "mask":
            if value == "bool":
                kw["mask"] = to_fw(rng.random((b, 1, sq, sk)) < 0.8, fw)
            else:
                m = rng.standard_normal((sq, sk)).astype(dtype)
                m[rng.random((sq, sk)) < 0.2] = -np.inf
                kw["mask"] = to_fw(m, fw)
        elif name == "key_lengths":
            lengths = rng.integers(0, sk + 1, size=b)
            for bi, length in enumerate(lengths):  # poison the padding: it must never be read
                k[bi, :, length:] = np.nan
                v[bi, :, length:] = np.nan
            kw["key_lengths"] = to_fw(lengths, fw)
        elif name == "alibi_slopes":
            kw["alibi_slopes"] = to_fw(2.0 ** -np.arange(1, hq + 1), fw)
        elif name == "relative_bias":
            kw["relative_bias"] = {
                "table": to_fw(rng.standard_normal((32, hq)), fw),
                "max_distance": 20,
            }
        elif name == "rope":
            cos, sin = fastpe.rope_table(max(sq, sk) + 4, d - (d % 4), **O)
            kw["rope"] = {"cos": to_fw(cos, fw), "sin": to_fw(sin, fw), "interleaved": True}
        else:
            kw[name] = value
    return (to_fw(q, fw), to_fw(k, fw), to_fw(v, fw)), kw


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("case", list(ATTN_CASES))
@pytest.mark.parametrize(
    "dims",
    grid(
        [
            (1, 1, 1, 1, 1, 4),
            (3, 6, 2, 7, 5, 12),
            (2, 4, 4, 37, 300, 40),
            (1, 8, 2, 1, 700, 64),
            (1, 2, 1, 70, 20, 16),
        ],
        # Triton's interpreter: all but 37 x 300, whose tile edges and many key tiles the
        # 70 x 20 (several query and key tiles of 16, ragged) and 1 x 700 cases also cross
        interpreter=[0, 1, 3, 4],
    ),
)  # (B, Hq, Hkv, Sq, Sk, D): tiny, odd/prime with GQA, tile edges, decode split-KV, Sq > Sk
def test_attention(backend, fw, case, dims, rng):
    args, kw = _attention_args(rng, fw, *dims, ATTN_CASES[case])
    before = [to_np(a).copy() for a in args]
    got, lse = fastpe.attention(*args, return_lse=True, **kw, backend=backend)
    want, want_lse = fastpe.attention(*args, return_lse=True, **kw, **O)
    check_close(got, want, 2e-5, "attention out")
    finite = np.isfinite(to_np(want_lse))
    np.testing.assert_array_equal(np.isfinite(to_np(lse)), finite)
    np.testing.assert_allclose(to_np(lse)[finite], to_np(want_lse)[finite], rtol=2e-6, atol=2e-5)
    for a, b in zip(args, before, strict=True):
        np.testing.assert_array_equal(to_np(a), b)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_attention_non_contiguous(backend, fw, dtype, rng):
    base = to_fw(rng.standard_normal((2, 4, 20, 24)).astype(dtype), fw)
    q, k, v = base[:, :, ::2], base[:, ::2, 1:19], base[:, 1::2, 2:20]  # strided views, GQA 4/2
    got = fastpe.attention(q, k, v, causal=True, backend=backend)
    tol = 1e-12 if dtype == "float64" else 2e-6
    check_close(got, fastpe.attention(q, k, v, causal=True, **O), tol, "strided attention")


@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_attention_low_precision_flash_rule(backend, dtype, rng):
    tdtype = getattr(torch, dtype)
    q, k, v = (torch.from_numpy(rng.standard_normal((2, 4, 50, 32))).to(tdtype) for _ in range(3))
    want = fastpe.attention(q.double(), k.double(), v.double(), causal=True, **O)
    plain = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True
    )  # same-dtype baseline
    got = fastpe.attention(q, k, v, causal=True, backend=backend)
    assert got.dtype == tdtype
    err = (got.double() - want).abs().max().item()
    plain_err = (plain.double() - want).abs().max().item()
    assert err <= 2 * plain_err + 1e-6, (err, plain_err)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_merge_attention(backend, fw, dtype, rng):
    shapes = ((2, 3, 9, 8), (2, 3, 40, 8), (2, 3, 40, 8))
    q, k, v = (rng.standard_normal(shape).astype(dtype) for shape in shapes)
    a = fastpe.attention(q, k[:, :, :15], v[:, :, :15], return_lse=True, **O)
    mask = np.ones((9, 25), bool)
    mask[4] = False  # a row empty on one side
    b = fastpe.attention(q, k[:, :, 15:], v[:, :, 15:], mask=mask, return_lse=True, **O)
    args = [to_fw(t, fw) for t in (*a, *b)]
    got_out, got_lse = fastpe.merge_attention(*args, backend=backend)
    want_out, want_lse = fastpe.merge_attention(*args, **O)
    check_close(got_out, want_out, 1e-6 if dtype == "float64" else 2e-6, "merged out")
    check_close(got_lse, want_lse, 1e-6, "merged lse")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_attention_sharp_scores_and_masked_row_starts(backend, rng):
    """Scores far above a row's early ones (in a later key tile) and rows whose first keys are
    all masked: the online softmax must rescale exactly, not overflow or drop the row."""
    q, k, v = (
        rng.standard_normal((1, 2, 40, 16)),
        rng.standard_normal((1, 2, 600, 16)),
        rng.standard_normal((1, 2, 600, 16)),
    )
    q, k, v = (a.astype(np.float32) for a in (q, k, v))
    k[:, :, 300] = 30 * q[:, :, :1].mean(axis=2)  # one key scores ~100x higher, in the second tile
    k[:, :, 550] = -k[:, :, 300]  # and one ~100x lower
    mask = np.ones((40, 600), bool)
    mask[5:15, :40] = False  # these rows start with masked keys
    mask[20, :] = False  # and this one sees nothing
    for kw in ({}, {"mask": mask}, {"mask": mask, "causal": True, "causal_alignment": "top_left"}):
        got, lse = fastpe.attention(q, k, v, return_lse=True, **kw, backend=backend)
        want, want_lse = fastpe.attention(q, k, v, return_lse=True, **kw, **O)
        check_close(got, want, 2e-5, f"sharp attention {list(kw)}")
        finite = np.isfinite(want_lse)
        np.testing.assert_array_equal(np.isfinite(lse), finite)
        np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=2e-6, atol=2e-5)


def test_numba_follows_set_num_threads(rng):
    """The kernels use numba's thread count (one thread: no split-KV, same answer)."""
    numba = pytest.importorskip("numba")
    if fastpe.backends()["numba"] != "available":
        pytest.skip(fastpe.backends()["numba"])
    q, k, v = (
        rng.standard_normal(s).astype(np.float32)
        for s in ((1, 4, 1, 16), (1, 2, 900, 16), (1, 2, 900, 16))
    )
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = fastpe.attention(q, k, v, backend="numba")
    finally:
        numba.set_num_threads(before)
    many = fastpe.attention(q, k, v, backend="numba")
    check_close(one, fastpe.attention(q, k, v, **O), 2e-6, "one thread")
    check_close(many, one, 2e-6, "all threads vs one")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_attention_rope_wide_fp32_heads(backend, interleaved, rng):
    """fp32 heads wider than 64 columns take the path where the Triton launcher rotates q and k
    before the kernel (the in-loop rotation spills on GPUs): same answer as the oracle, with
    position arrays, partial rotary, GQA and causal masking."""
    if torch is None:
        pytest.skip("needs torch")
    b, hq, hkv, sq, sk, d = 2, 4, 2, 5, 9, 128
    q = torch.from_numpy(rng.standard_normal((b, hq, sq, d)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((b, hkv, sk, d)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((b, hkv, sk, d)).astype(np.float32))
    cos, sin = fastpe.rope_table(64, 96, **O)  # rotary dim 96 < 128: the tail passes through
    rope = {
        "cos": torch.from_numpy(cos),
        "sin": torch.from_numpy(sin),
        "interleaved": interleaved,
        "q_positions": torch.tensor([[7, 3, 9, 1, 60], [0, 1, 2, 3, 4]]),
        "k_positions": torch.arange(20, 20 + sk),
    }
    before = [t.clone() for t in (q, k, v)]
    got = fastpe.attention(q, k, v, rope=rope, causal=True, backend=backend)
    want = fastpe.attention(q, k, v, rope=rope, causal=True, **O)
    check_close(got, want, 2e-5, "attention with rope, D = 128")
    for t, t0 in zip((q, k, v), before, strict=True):
        assert torch.equal(t, t0)
