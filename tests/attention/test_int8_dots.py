"""int8 decode products on AVX512-VNNI (``kernels/numba/_int8_dots``): the two loops against
NumPy's int64 matrix products (exact: the sums are integers), the row quantization against its
definition, and the name ``fastpe info`` gives the path. The decode kernel's use of them is held
to the half-precision rule in ``test_kv_quant.py``. Skipped where Numba does not compile for a
CPU with AVX512-VNNI: there the float path runs, which the other tests cover."""

from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from fastpe.kernels.numba import _int8_dots as dots  # noqa: E402

needs_vnni = pytest.mark.skipif(
    not dots.available(), reason="Numba does not compile for a CPU with AVX512-VNNI here"
)


def test_fastpe_info_names_the_path():
    from fastpe.cli import info

    line = next(line for line in info().splitlines() if "int8 decode" in line)
    assert ("vpdpwssd" in line) == dots.available(), line


@numba.njit
def _scores(s, col, q16, q_scales, rows, hk, k_scales):
    dots.int8_scores(s, col, q16, q_scales, rows, hk, k_scales)


@numba.njit
def _add_values(acc, w16, col, rows, hk):
    dots.int8_add_values(acc, w16, col, rows, hk)


# (rows of s, keys, heads, head dim, head read, column written from): whole and partial blocks
# of 4 rows and 4 keys, one key, odd key counts, every head dim step
SHAPES = [(4, 16, 8, 128, 3, 5), (3, 7, 2, 64, 1, 0), (8, 1, 1, 32, 0, 2), (5, 13, 4, 256, 2, 9)]


@needs_vnni
@pytest.mark.parametrize("shape", SHAPES)
def test_scores_and_weighted_values_equal_integer_products(shape):
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
