"""The Numba kernels' tile products (``kernels/numba/_blas.gemm``) against NumPy in float64."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from fastpe.kernels.numba._blas import gemm  # noqa: E402


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
