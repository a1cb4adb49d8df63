"""The Numba kernels' tile products (``kernels/numba/_blas.gemm``, and ``_panels.panel_product``
on keys and values packed by ``pack_key_panels`` / ``pack_value_panels``) against NumPy in
float64."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from fastpe.kernels.numba._blas import gemm  # noqa: E402
from fastpe.kernels.numba._panels import (  # noqa: E402
    pack_key_panels,
    pack_value_panels,
    panel_product,
    panel_width,
)


@numba.njit
def _gemm(c, a, b, trans_a, trans_b, beta):
    gemm(c, a, b, trans_a, trans_b, beta)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "trans_a,trans_b,beta", list(itertools.product([False, True], [False, True], [0.0, 1.0]))
)
def test_gemm_matches_numpy(dtype, trans_a, trans_b, beta):
    rng = np.random.default_rng(3)
    m, k, n = 37, 19, 11  # no two alike, none a multiple of a vector width
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(dtype)
    c0 = rng.standard_normal((m, n)).astype(dtype)
    c = c0.copy()
    a_before, b_before = a.copy(), b.copy()
    _gemm(c, a, b, trans_a, trans_b, beta)
    op_a = a.T if trans_a else a
    op_b = b.T if trans_b else b
    expected = op_a.astype(np.float64) @ op_b.astype(np.float64) + beta * c0
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(c, expected, rtol=tol, atol=tol * k)
    assert np.array_equal(a, a_before) and np.array_equal(b, b_before)


def test_gemm_takes_only_c_contiguous_tiles_of_one_dtype():
    a = np.ones((4, 3), np.float32)
    with pytest.raises(numba.core.errors.TypingError):
        _gemm(
            np.zeros((4, 4), np.float32),
            a,
            np.asfortranarray(np.ones((3, 4), np.float32)),
            False,
            False,
            0.0,
        )
    with pytest.raises(numba.core.errors.TypingError):
        _gemm(np.zeros((4, 4), np.float32), a, np.ones((3, 4), np.float64), False, False, 0.0)


@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("m,k,n", [(5, 0, 3), (0, 4, 3), (5, 4, 0)])
def test_gemm_with_an_empty_dimension(m, k, n, beta):
    # BLAS takes no empty operand; an empty inner dimension leaves beta·c (zeros or c itself),
    # an empty c is left alone
    c0 = np.full((m, n), 7.0, np.float32)
    c = c0.copy()
    _gemm(c, np.ones((m, k), np.float32), np.ones((n, k), np.float32), False, True, beta)
    np.testing.assert_array_equal(c, beta * c0)


@numba.njit
def _panel_products(q, k, v, p, s, acc, accumulate, sum_terms):
    """s = q·k[0, 0]ᵀ and acc (+)= p·v[0, 0] through packed panels, as the kernels do (s and acc
    padded to whole panels)."""
    width = panel_width(s)
    keys, d, dv = k.shape[2], k.shape[3], v.shape[3]
    k_panels = np.full(((keys + width - 1) // width, d, width), np.nan, s.dtype)
    v_panels = np.full(((dv + width - 1) // width, keys, width), np.nan, s.dtype)
    pack_key_panels(k, 0, 0, k_panels)
    pack_value_panels(v, 0, 0, v_panels)
    panel_product(s, q, k_panels, False, sum_terms)
    panel_product(acc, p, v_panels, accumulate, sum_terms)
    return k_panels, v_panels


def _padded(n, width):
    return -(-n // width) * width


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("sum_terms", [1, 5, 32, 1 << 30])
@pytest.mark.parametrize(
    "m,keys,d,dv",
    [
        (128, 256, 64, 64),  # the kernel's usual tile
        (13, 37, 5, 23),  # rows past every register block (6 + 4 + 2 + 1), partial panels
        (1, 1, 1, 1),
        (3, 4, 0, 5),  # an empty head dim: scores of zero
        (7, 16, 16, 8),  # whole float32 panels, half of one for the values
        (6, 40, 3, 33),
    ],
)
def test_panel_product_matches_numpy(dtype, accumulate, sum_terms, m, keys, d, dv):
    rng = np.random.default_rng(5)
    width = 16 if dtype == np.float32 else 8
    q = rng.standard_normal((m, d)).astype(dtype)
    k = rng.standard_normal((1, 1, keys, d)).astype(dtype)
    v = rng.standard_normal((1, 1, keys, dv)).astype(dtype)
    p = rng.standard_normal((m, keys)).astype(dtype)
    s = np.full((m, _padded(keys, width)), np.nan, dtype)  # overwritten whole: no NaN survives
    acc0 = rng.standard_normal((m, _padded(dv, width))).astype(dtype)
    acc = acc0.copy()
    inputs = [x.copy() for x in (q, k, v, p)]
    k_panels, v_panels = _panel_products(q, k, v, p, s, acc, accumulate, sum_terms)
    as64 = lambda x: x.astype(np.float64)  # noqa: E731
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(s[:, :keys], as64(q) @ as64(k[0, 0]).T, rtol=tol, atol=tol * d)
    np.testing.assert_array_equal(s[:, keys:], 0.0)  # zero keys pad the last panel
    expected = as64(p) @ as64(v[0, 0]) + (as64(acc0[:, :dv]) if accumulate else 0.0)
    np.testing.assert_allclose(acc[:, :dv], expected, rtol=tol, atol=tol * keys)
    # padded value columns are zero: acc's padding keeps what it held, or becomes zero
    np.testing.assert_array_equal(acc[:, dv:], acc0[:, dv:] if accumulate else 0.0)
    assert all(np.array_equal(x, y) for x, y in zip(inputs, (q, k, v, p), strict=True))
    # the packed layouts: Kᵀ and V in column panels, zeros past the last key / value column
    assert k_panels.shape[2] == width
    padded_keys = np.zeros((k_panels.shape[0] * width, d), dtype)
    padded_keys[:keys] = k[0, 0]
    np.testing.assert_array_equal(
        k_panels, padded_keys.reshape(k_panels.shape[0], width, d).transpose(0, 2, 1)
    )
    padded_values = np.zeros((keys, v_panels.shape[0] * width), dtype)
    padded_values[:, :dv] = v[0, 0]
    np.testing.assert_array_equal(
        v_panels, padded_values.reshape(keys, -1, width).transpose(1, 0, 2)
    )


def test_panel_product_reads_strided_operands_and_writes_only_its_tile():
    # the kernel passes slices: a's and c's rows inside wider arrays, panels of a longer run
    rng = np.random.default_rng(6)
    big_c = rng.standard_normal((9, 40)).astype(np.float32)
    before = big_c.copy()
    a = rng.standard_normal((9, 30)).astype(np.float32)
    panels = rng.standard_normal((4, 50, 16)).astype(np.float32)
    _strided_product(big_c, a, panels)
    b = panels[1:3, 10:30].transpose(1, 0, 2).reshape(20, 32)
    expected = before.copy()
    expected[2:7, 5:37] = a[2:7, 3:23].astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(big_c, expected, rtol=1e-5, atol=1e-4)
    untouched = np.ones(big_c.shape, bool)
    untouched[2:7, 5:37] = False
    np.testing.assert_array_equal(big_c[untouched], before[untouched])


@numba.njit
def _strided_product(big_c, a, panels):
    panel_product(big_c[2:7, 5:37], a[2:7, 3:23], panels[1:3, 10:30], False, 7)
