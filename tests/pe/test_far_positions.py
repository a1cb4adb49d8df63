"""Far positions (issue 11, items 9 and 11): sin/cos of p·ω against an exact reference (mpmath),
the supported position range and its checker, and the cost and cache of the embed PE bases.

Positions are never exact powers of two here: 2^k·ω is exact in float64, which would hide the
rounding of p·ω that these tests are about.
"""

from __future__ import annotations

import mpmath  # a test dependency: the exact reference
import numpy as np
import pytest
from _testkit import torch

import fastpe
from fastpe import reference

D = 16
OMEGA = reference.sinusoidal_frequencies(D, 10000.0, "paper")
INV_FREQ = fastpe.rope_inv_freq(D)[0]  # differs from OMEGA in last bits: each is its own truth


def exact_sincos(positions, omega):
    """[N, F, 2] (sin, cos) of p·ω with p and the float64 ω taken as exact, in 200-bit floats."""
    out = np.empty((len(positions), len(omega), 2))
    with mpmath.workprec(200):
        for i, p in enumerate(positions):
            for j, w in enumerate(omega):
                angle = mpmath.mpf(int(p)) * mpmath.mpf(float(w))
                out[i, j] = float(mpmath.sin(angle)), float(mpmath.cos(angle))
    return out


def interleaved(sincos):
    return sincos.reshape(sincos.shape[0], -1)


def max_error(got, want):
    got = (
        got.detach().double().cpu().numpy()
        if torch is not None and isinstance(got, torch.Tensor)
        else got
    )
    return float(np.max(np.abs(np.asarray(got, dtype=np.float64) - want)))


# ---------------------------------------------------------------------------------------------
# the supported range and its checker


def test_max_position_is_the_documented_bound():
    from fastpe._validate import MAX_POSITION

    assert MAX_POSITION == 2**32


@pytest.mark.parametrize(
    "value,kwargs,match",
    [
        (-1, {}, r"positions = -1, outside the supported range \[0, 2\*\*32 = 4294967296\)"),
        (2**32, {}, r"positions = 4294967296, outside the supported range"),
        (2**63 - 1, {}, r"positions = 9223372036854775807, outside"),
        (2**70, {}, r"positions = 1180591620717411303424, outside"),  # no OverflowError
        (np.int64(2**40), {}, r"positions = 1099511627776, outside"),
        (2**32 - 5, {"count": 10}, r"positions = 4294967291 with 10 positions reaches 4294967300"),
        (
            np.array([[0, 7], [2**32 + 1, 3]]),
            {},
            r"positions contains 4294967297 at index \[1, 0\]",
        ),
        (np.array([3, -2]), {}, r"positions contains -2 at index \[1\]"),
        (
            np.array([2**64 - 1], dtype=np.uint64),
            {},
            r"contains 18446744073709551615 at index \[0\]",
        ),
    ],
)
def test_check_position_rejects(value, kwargs, match):
    from fastpe._validate import check_position

    with pytest.raises(ValueError, match=match):
        check_position("positions", value, **kwargs)


@pytest.mark.parametrize(
    "value,kwargs",
    [
        (0, {}),
        (2**32 - 1, {}),
        (np.int64(5), {}),
        (2**32 - 10, {"count": 10}),
        (np.array([[0, 2**32 - 1]]), {}),
        (np.zeros((0, 3), np.int64), {}),
        (np.array([1, 2], dtype=np.uint64), {}),
    ],
)
def test_check_position_accepts(value, kwargs):
    from fastpe._validate import check_position

    check_position("positions", value, **kwargs)


def test_check_position_types_and_tensors():
    from fastpe._validate import check_position

    with pytest.raises(
        TypeError, match="positions must be an int or an integer array; got float64"
    ):
        check_position("positions", np.array([1.0]))
    with pytest.raises(TypeError, match="got bool"):
        check_position("positions", True)
    if torch is not None:
        check_position("positions", torch.tensor([[0, 2**32 - 1]]))
        with pytest.raises(ValueError, match=r"positions contains 1099511627777 at index \[1\]"):
            check_position("positions", torch.tensor([1, 2**40 + 1]))


# ---------------------------------------------------------------------------------------------
# accuracy at the edge of the range, through the public API (valid inputs once wired)

EDGE = 2**32 - 4  # the last 4 supported positions
EDGE_ROWS = 4


@pytest.mark.parametrize("backend", ["numpy", "numba", "triton"])
@pytest.mark.parametrize("dtype,tol", [("float32", 2.5e-7), ("float64", 1e-14)])
def test_tables_exact_at_the_edge_of_the_range(backend, dtype, tol):
    device = {"device": "cpu"} if backend == "triton" else {}
    if backend == "triton":
        pytest.importorskip("triton")
    table = fastpe.sinusoidal_table(
        EDGE_ROWS, D, offset=EDGE, dtype=dtype, backend=backend, **device
    )
    want = exact_sincos(range(EDGE, EDGE + EDGE_ROWS), OMEGA)
    assert max_error(table, interleaved(want)) <= tol
    cos, sin = fastpe.rope_table(EDGE_ROWS, D, offset=EDGE, dtype=dtype, backend=backend, **device)
    want = exact_sincos(range(EDGE, EDGE + EDGE_ROWS), INV_FREQ)
    assert max(max_error(sin, want[..., 0]), max_error(cos, want[..., 1])) <= tol


@pytest.mark.parametrize("backend", ["numpy", "numba", "triton"])
@pytest.mark.parametrize("dtype,tol", [("float32", 2.5e-7), ("float64", 1e-14)])
def test_fast_frequencies_exact_at_the_edge_of_the_range(backend, dtype, tol):
    """linear factor 0.1 makes ω up to 10: p·ω ~ 2^35 turns' worth of radians at the edge."""
    device = {"device": "cpu"} if backend == "triton" else {}
    if backend == "triton":
        pytest.importorskip("triton")
    scaling = {"rope_type": "linear", "factor": 0.1}
    cos, sin = fastpe.rope_table(
        EDGE_ROWS, D, offset=EDGE, scaling=scaling, dtype=dtype, backend=backend, **device
    )
    inv_freq = fastpe.rope_inv_freq(D, scaling=scaling)[0]
    assert inv_freq.max() == pytest.approx(10.0)
    want = exact_sincos(range(EDGE, EDGE + EDGE_ROWS), inv_freq)
    assert max(max_error(sin, want[..., 0]), max_error(cos, want[..., 1])) <= tol


@pytest.mark.parametrize("backend", ["numpy", "numba", "triton"])
def test_embed_exact_at_the_edge_of_the_range(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    positions = np.array([[2**32 - 1, 2**32 - 12345, 2**31 - 3, 1]])
    weight = np.zeros((3, D), np.float32)
    ids = np.zeros(positions.shape, np.int64)
    if backend == "triton":
        weight, ids, positions = map(torch.from_numpy, (weight, ids, positions))
    got = fastpe.embed(ids, weight, positions=positions, backend=backend)[0]
    assert max_error(got, interleaved(exact_sincos(positions[0].tolist(), OMEGA))) <= 2.5e-7


# ---------------------------------------------------------------------------------------------
# beyond the range: the oracle and the Numba kernels stay exact at any int64 position


FAR = [2**40 - 12345, 2**48 - 7, 2**53 + 3, 2**62 - 12345, 2**63 - 1]


def test_integer_angles_exact_up_to_2_64():
    from fastpe.kernels.numba._angles import sincos_of_integers

    positions = FAR + [2**64 - 1, 0, 1]
    omega = np.concatenate([OMEGA, [2.5, -0.75, 1e-30]])
    sin, cos = sincos_of_integers(np.array(positions, dtype=np.uint64), omega)
    want = exact_sincos(positions, omega)
    assert max(max_error(sin, want[..., 0]), max_error(cos, want[..., 1])) <= 1e-15


def test_oracle_exact_far():
    want = exact_sincos(FAR, OMEGA)
    got = reference.sinusoidal_rows(np.array(FAR), D, 10000.0, "interleaved", "paper")
    assert max_error(got, interleaved(want)) <= 1e-15
    cos, sin = reference.rope_table(3, INV_FREQ, 1.0, 2**53 - 1)
    want = exact_sincos(range(2**53 - 1, 2**53 + 2), INV_FREQ)
    assert max(max_error(sin, want[..., 0]), max_error(cos, want[..., 1])) <= 1e-15


@pytest.mark.parametrize("dtype,tol", [(np.float32, 2.5e-7), (np.float64, 1e-14)])
def test_numba_tables_exact_far(dtype, tol):
    from fastpe.kernels.numba.rope_table import rope_table_numba
    from fastpe.kernels.numba.sinusoidal_table import sinusoidal_table_numba

    for start in FAR[:-1]:
        want = exact_sincos(range(start, start + 3), OMEGA)
        got = sinusoidal_table_numba(OMEGA, 3, start, True, dtype)
        assert max_error(got, interleaved(want)) <= tol, start
        want = exact_sincos(range(start, start + 3), INV_FREQ)
        cos, sin = rope_table_numba(INV_FREQ, 1.0, 3, start, dtype)
        assert max(max_error(sin, want[..., 0]), max_error(cos, want[..., 1])) <= tol, start


# ---------------------------------------------------------------------------------------------
# embed: PE cost follows the tokens, not the span of the positions; the basis cache is bounded


@pytest.mark.parametrize("far", [2**32 - 12345, 2**40 - 12345, 2**62 - 12345])
@pytest.mark.parametrize("dtype,tol", [(np.float32, 2.5e-7), (np.float64, 1e-14)])
def test_embed_numba_far_span_matches_exact_and_oracle(far, dtype, tol):
    from fastpe.kernels.numba.embed import embed_numba

    positions = np.array([[0, far], [far - 1, 5]])
    ids = np.array([[1, 2], [0, 1]])
    weight = np.random.default_rng(0).standard_normal((3, D)).astype(dtype)
    got = embed_numba(ids, weight, positions, scale=1.0, pe="sinusoidal", omega=OMEGA)
    pe = interleaved(exact_sincos(positions.reshape(-1).tolist(), OMEGA)).reshape(2, 2, D)
    assert max_error(got, weight[ids] + pe) <= tol + 4e-16 * (dtype == np.float64)
    oracle = reference.embed(
        ids,
        weight.astype(np.float64),
        positions,
        "sinusoidal",
        None,
        1.0,
        10000.0,
        "interleaved",
        "paper",
        None,
        None,
    )
    assert max_error(got, oracle) <= tol


def test_embed_basis_work_follows_tokens():
    from fastpe.kernels.numba._angles import gather_basis

    omega = reference.sinusoidal_frequencies(1024, 10000.0, "paper")
    for positions in (np.array([0, 2**32]), np.array([0, 2**40]), np.array([5, 2**62 - 1])):
        block, p0, row, hi_a, hi_b, lo_x, lo_y = gather_basis(positions, omega, True, np.float32)
        assert hi_a.shape == hi_b.shape == (2, 1024)  # one hi row per occupied block
        assert lo_x.shape == lo_y.shape == (block, 1024) and block <= 16
        assert p0 == positions[0] and row.tolist() == [0, 1]
    # a contiguous sequence keeps ~2·sqrt(S) rows, as the range bases did
    block, _, row, hi_a, _, lo_x, _ = gather_basis(np.arange(100, 4196), omega, True)
    assert hi_a.shape[0] + lo_x.shape[0] <= 2 * 64 + 2
    assert np.array_equal(row, (np.arange(4096)) // block)


def test_basis_cache_bounded_in_bytes():
    from fastpe.kernels.numba import _angles

    cache = _angles.BASIS_CACHE
    cache.clear()
    omega = reference.sinusoidal_frequencies(1024, 10000.0, "paper")
    one = sum(x.nbytes for x in _angles.column_basis(0, 2**16, omega, True)[1:])  # 8 MiB
    assert 0 < cache.info()["nbytes"] == one
    for k in range(1, 12):  # far more than fits: the oldest entries go
        _angles.column_basis(k * 2**30, 2**16, omega, True)
        info = cache.info()
        assert info["nbytes"] <= info["max_bytes"]
    assert info["entries"] == info["max_bytes"] // one
    # a basis larger than the whole cache is returned but not kept
    cache.clear()
    big = _angles.column_basis(0, 1100**2, omega, True)  # 4 arrays of [1100, 1024] float64
    assert sum(x.nbytes for x in big[1:]) > cache.max_bytes
    assert cache.info() == {"entries": 0, "nbytes": 0, "max_bytes": cache.max_bytes}
    assert not big[1].flags.writeable


@pytest.mark.parametrize("k", [2**32 - 1, -(2**32 - 1), 2**31 + 12345])
def test_relative_transform_far_distances_are_exact(k):
    """T(k) for the largest distances between supported positions, against 50-digit cos/sin
    of k·ω (a float64 product k·ω was off by up to 1e-8 there)."""
    t = fastpe.relative_transform(k, 8)
    omega = 10000.0 ** (-np.arange(0, 8, 2) / 8)
    with mpmath.workdps(50):
        for i, w in enumerate(omega):
            angle = mpmath.mpf(k) * mpmath.mpf(float(w))
            np.testing.assert_allclose(
                t[2 * i, 2 * i], float(mpmath.cos(angle)), rtol=0, atol=1e-15
            )
            np.testing.assert_allclose(
                t[2 * i, 2 * i + 1], float(mpmath.sin(angle)), rtol=0, atol=1e-15
            )
