"""Decode products on 8-bit caches in pairs (``kernels/numba/_decode_pairs``): int8 on
AVX512-VNNI against NumPy's int64 matrix products (exact: the sums are integers), fp8 on
AVX512-BF16 against float64 products of the same bfloat16 queries and torch's fp8 values, the
row quantization and rounding against their definitions, and the names ``fastpe info`` gives
the paths. The decode kernel's use of them is held to the half-precision rule in
``test_kv_quant.py``. Each part is skipped where Numba does not compile for a CPU with its
instructions: there the float path runs, which the other tests cover."""

from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from fastpe.kernels.numba import _decode_pairs as dots  # noqa: E402

needs_vnni = pytest.mark.skipif(
    not dots.int8_available(), reason="Numba does not compile for a CPU with AVX512-VNNI here"
)
needs_bf16 = pytest.mark.skipif(
    not dots.fp8_available(), reason="Numba does not compile for a CPU with AVX512-BF16 here"
)


def test_fastpe_info_names_the_paths():
    from fastpe.cli import info

    lines = info().splitlines()
    int8 = next(line for line in lines if "int8 decode" in line)
    fp8 = next(line for line in lines if "fp8 decode" in line)
    assert ("vpdpwssd" in int8) == dots.int8_available(), int8
    assert ("vdpbf16ps" in fp8) == dots.fp8_available(), fp8


@numba.njit
def _scores(s, col, q16, q_scales, rows, hk, k_scales):
    dots.pair_scores(s, col, q16, q_scales, rows, hk, k_scales)


@numba.njit
def _add_values(acc, w16, col, rows, hk):
    dots.pair_add_values(acc, w16, col, rows, hk)


# (rows of s, keys, heads, head dim, head read, column written from): whole and partial blocks
# of 4 rows and 4 keys, one key, odd key counts, every head dim step
SHAPES = [(4, 16, 8, 128, 3, 5), (3, 7, 2, 64, 1, 0), (8, 1, 1, 32, 0, 2), (5, 13, 4, 256, 2, 9)]


@needs_vnni
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_scores_and_weighted_values_equal_integer_products(shape):
    m, n, heads, d, hk, col = shape
    rng = np.random.default_rng(sum(shape))
    padded = -(-m // dots.ROWS) * dots.ROWS
    limit = dots.int16_limit(d)
    q16 = rng.integers(-limit, limit + 1, (padded, d)).astype(np.int16)
    q_scales = rng.random(padded).astype(np.float32)
    rows = rng.integers(-128, 128, (n, heads, d)).astype(np.int8)
    k_scales = rng.random((n, 3)).astype(np.float32)[:, 1]  # a strided view
    s = np.full((m, col + n + 3), -7.0, np.float32)
    _scores(s, col, q16, q_scales, rows, hk, k_scales)
    products = q16[:m].astype(np.int64) @ rows[:, hk].T.astype(np.int64)
    want = products * q_scales[:m, None].astype(np.float64) * k_scales[None].astype(np.float64)
    np.testing.assert_allclose(s[:, col : col + n], want, rtol=1e-6)
    assert (s[:, :col] == -7.0).all() and (s[:, col + n :] == -7.0).all()  # nothing else written

    acc = rng.integers(-1000, 1000, (padded, d)).astype(np.int32)
    w16 = rng.integers(0, 32768, (padded, col + n + 1)).astype(np.int16)
    want = acc + w16[:, col : col + n].astype(np.int64) @ rows[:, hk].astype(np.int64)
    _add_values(acc, w16, col, rows, hk)
    np.testing.assert_array_equal(acc, want)


def test_quantize_rows():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 40)).astype(np.float32)
    x[1] = 0.0
    x[2, 7] = np.inf
    factors = rng.random(40).astype(np.float32) + 0.5
    out = np.full((4, 40), 5, np.int16)
    scales = np.zeros(4, np.float32)
    dots.quantize_rows(x, factors, 33, 32767, out, scales)
    y = x[0, :33].astype(np.float64) * factors[:33]
    assert scales[0] == pytest.approx(np.abs(y).max() / 32767, rel=1e-6)
    assert np.abs(out[0, :33] - y / scales[0]).max() <= 0.5 + 1e-3  # rounded to nearest
    assert np.abs(out[0, :33]).max() == 32767
    assert scales[1] == 1.0 and (out[1, :33] == 0).all()  # a row of zeros
    assert np.isnan(scales[2]) and (out[2, :33] == 0).all()  # a row with an infinity
    assert scales[3] == 1.0 and (out[3, :33] == 0).all()  # a padding row
    assert (out[:, 33:] == 5).all()  # columns past n untouched


def test_sums_cannot_wrap():
    """The int16 limit keeps d products of int8 values within int32."""
    for d in (32, 128, 256, 512, 1024, 4096):
        assert d * 128 * dots.int16_limit(d) < 2**31


def _bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@needs_bf16
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_scores_and_weighted_values_match_float64_products(shape):
    """Every fp8 pattern (NaN ones apart) as torch widens it, divided by the loops' unit; sums of
    exact bfloat16 products in float32: within float32 rounding of the float64 products."""
    torch = pytest.importorskip("torch")
    m, n, heads, d, hk, col = shape
    rng = np.random.default_rng(sum(shape))
    padded = -(-m // dots.ROWS) * dots.ROWS
    finite = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)
    rows = rng.choice(finite, (n, heads, d)).astype(np.uint8)
    values = torch.from_numpy(rows).view(torch.float8_e4m3fn).double().numpy() / dots.E4M3_UNIT
    q = rng.standard_normal((padded, d)).astype(np.float32)
    q16 = (q.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16 bits (truncated)
    q_scales = rng.random(padded).astype(np.float32)
    k_scales = np.ones(n, np.float32)
    s = np.full((m, col + n + 3), -7.0, np.float32)
    _scores(s, col, q16, q_scales, rows, hk, k_scales)
    products = _bf16_value(q16[:m]) @ values[:, hk].T
    want = products * q_scales[:m, None]
    scale = np.abs(_bf16_value(q16[:m])) @ np.abs(values[:, hk]).T * q_scales[:m, None]
    assert (np.abs(s[:, col : col + n] - want) <= 1e-6 * scale + 1e-30).all()
    assert (s[:, :col] == -7.0).all() and (s[:, col + n :] == -7.0).all()

    acc = rng.standard_normal((padded, d)).astype(np.float32)
    weights = rng.random((padded, col + n + 1)).astype(np.float32)
    w16 = (weights.view(np.uint32) >> 16).astype(np.uint16)
    want = acc + _bf16_value(w16[:, col : col + n]) @ values[:, hk]
    bound = np.abs(acc) + _bf16_value(w16[:, col : col + n]) @ np.abs(values[:, hk])
    _add_values(acc, w16, col, rows, hk)
    assert (np.abs(acc - want) <= 1e-6 * bound).all()


@needs_bf16
def test_fp8_widening_covers_every_pattern():
    """Cache rows holding every bit pattern between them, one query element 1 at a time picking
    each element out: exact values, and NaN for the rows holding a NaN pattern (0 · NaN is NaN,
    as in a float dot product)."""
    torch = pytest.importorskip("torch")
    rows = np.arange(256, dtype=np.uint8).reshape(8, 1, 32)
    values = torch.from_numpy(rows).view(torch.float8_e4m3fn).double().numpy() / dots.E4M3_UNIT
    s = np.empty((4, 8), np.float32)
    for e in range(32):
        q16 = np.zeros((4, 32), np.uint16)
        q16[:, e] = 0x3F80  # 1.0
        _scores(s, 0, q16, np.ones(4, np.float32), rows, 0, np.ones(8, np.float32))
        want = values[:, 0, e]
        nan = np.isnan(values[:, 0]).any(-1)
        assert nan.sum() == 2
        assert np.isnan(s[0, nan]).all()
        assert np.array_equal(s[0, ~nan].astype(np.float64), want[~nan])


def test_round_rows():
    x = np.array([[1.0, 1.00390625, -2.5e-3, 3.0e38], [0.5, 0.0, -0.0, 7.0]], np.float32)
    out = np.full((3, 4), 9, np.uint16)
    dots.round_rows(x, 3, out)
    torch = pytest.importorskip("torch")
    want = torch.from_numpy(x[:, :3]).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(out[:2, :3], want)
    assert (out[2, :3] == 0).all() and (out[:, 3] == 9).all()
