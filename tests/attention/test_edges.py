"""Attention at its edges: empty shapes, huge finite masks, softmax overflow, merging an empty
part, ragged KV caches with bottom-right alignment, and float32 accuracy against torch's SDPA.

Expected values come from the float64 oracle (itself checked here against closed-form facts:
empty in gives empty out, a ragged batch equals each sequence attended unpadded) or from torch.
Every kernel backend is compared; closed-form checks also run on the oracle ("numpy").
"""

from __future__ import annotations

import numpy as np
import pytest
from _testkit import KERNEL_BACKENDS, to_fw, to_np, torch

import fastpe

O = {"backend": "numpy"}
ALL_BACKENDS = ["numpy", *KERNEL_BACKENDS]
F32_MAX = float(np.finfo(np.float32).max)


def _qkv(rng, b, hq, hkv, sq, sk, d, dtype=np.float32):
    return (
        rng.standard_normal((b, hq, sq, d)).astype(dtype),
        rng.standard_normal((b, hkv, sk, d)).astype(dtype),
        rng.standard_normal((b, hkv, sk, d)).astype(dtype),
    )


def _close(got, want, tol, what):
    got, want = to_np(got).astype(np.float64), np.asarray(to_np(want), np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert not np.isnan(got).any(), f"NaN in {what}"
    err = np.max(np.abs(got - want), initial=0.0)
    bound = tol * max(1.0, np.max(np.abs(want), initial=0.0))
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


# ---------------------------------------------------------------------------------------------
# empty in, empty out


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize(
    "dims",
    [
        (0, 2, 2, 3, 300, 8),  # no batch, keys over one tile
        (1, 2, 2, 0, 300, 8),  # no query
        (1, 0, 1, 3, 30, 8),  # no query head
        (2, 2, 1, 3, 0, 8),  # no key: zeros, lse -inf
        (1, 2, 2, 0, 0, 8),  # neither
    ],
)
@pytest.mark.parametrize("extras", ["plain", "causal_alibi", "relative_bias"])
def test_attention_zero_size(backend, fw, dims, extras, rng):
    b, hq, hkv, sq, sk, d = dims
    args = [to_fw(a, fw) for a in _qkv(rng, *dims)]
    kw = {}
    if extras == "causal_alibi":
        kw = {"causal": True, "alibi_slopes": to_fw(np.full(hq, 0.5), fw)}
    elif extras == "relative_bias":
        kw = {"relative_bias": {"table": to_fw(rng.standard_normal((32, hq)), fw)}}
    out, lse = fastpe.attention(*args, return_lse=True, **kw, backend=backend)
    assert tuple(out.shape) == (b, hq, sq, d) and tuple(lse.shape) == (b, hq, sq)
    np.testing.assert_array_equal(to_np(out), 0.0)  # no key: the empty sum
    assert np.all(to_np(lse) == -np.inf)  # log of the empty sum (vacuous when out is empty)


# ---------------------------------------------------------------------------------------------
# finite masks, however large, are scores; only -inf / False / length / causal hide a key


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_mask_at_finfo_min_is_not_empty(backend, fw, rng):
    """transformers' eager masks fill with finfo(dtype).min: a row of them is a uniform
    softmax (equal scores), not an empty row."""
    q, k, v = _qkv(rng, 2, 2, 1, 6, 40, 16)
    mask = np.zeros((6, 40), np.float32)
    mask[0] = np.finfo(np.float32).min  # all keys at finfo.min: uniform average
    mask[1, 10:] = np.finfo(np.float32).min  # the usual padding mask
    mask[2, ::2] = np.finfo(np.float32).min
    mask[2, 1::2] = -np.inf
    args = [to_fw(a, fw) for a in (q, k, v, mask)]
    got = fastpe.attention(*args[:3], mask=args[3], backend=backend)
    want = fastpe.attention(*args[:3], mask=args[3], **O)
    _close(got, want, 2e-5, "finfo.min mask")
    uniform = v.astype(np.float64).mean(axis=2)[:, [0, 0]]  # the closed form for row 0
    _close(to_np(got)[:, :, 0], uniform, 2e-5, "row of finfo.min = mean of v")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize(
    "fill", [(-1e300, "float64"), (1e300, "float64"), (3e38, "float32"), (-3e38, "float32")]
)
def test_huge_finite_mask_values(backend, fw, fill, rng):
    """Finite masks beyond float32's range (float64 ±1e300) or at its edge (±3e38, which
    overflow once scaled by log2 e) still dominate or vanish as in exact arithmetic."""
    value, mdtype = fill
    q, k, v = _qkv(rng, 1, 2, 2, 5, 30, 8)
    mask = np.zeros((5, 30), mdtype)
    mask[0] = value  # the whole row: uniform
    mask[1, 3:7] = value  # a few keys dominate (value > 0) or vanish (value < 0)
    mask[2, ::3] = value
    args = [to_fw(a, fw) for a in (q, k, v, mask)]
    got = fastpe.attention(*args[:3], mask=args[3], backend=backend)
    _close(got, fastpe.attention(*args[:3], mask=args[3], **O), 2e-5, f"mask {value}")


# ---------------------------------------------------------------------------------------------
# mask layouts


def test_every_mask_layout_is_one_kernel_argument_type():
    """A contiguous mask and a broadcast view reach the Numba kernels as one argument type (so
    one compiled kernel serves them all), as do calls with any other modifier; a call with
    none of them gets a type of its own (kernels compiled without the modifiers' code), with
    the same fields."""
    numba = pytest.importorskip("numba")
    from fastpe.kernels.numba._attention_common import EdgesOnlyScoreMods, ScoreMods, score_mods

    from fastpe._options import AttentionOptions

    def mods(mask=None, **options):
        return score_mods(
            np.dtype(np.float32),
            1.0,
            AttentionOptions(scale=1.0, **options),
            key_len=np.array([8]),
            q_len=4,
            unbounded=13,
            mask=mask,
        )

    full = np.ones((1, 2, 4, 8), bool)
    broadcast = np.broadcast_to(np.ones((1, 1, 4, 8), bool), full.shape)
    floats = (full.astype(np.float32), np.zeros((1, 2, 4, 1), np.float32))
    float_broadcast = np.broadcast_to(floats[1], (1, 2, 4, 8))
    with_modifiers = [mods(m) for m in (full, broadcast, floats[0], float_broadcast)]
    with_modifiers += [mods(softcap=30.0), mods(sinks=np.zeros(2))]
    with_modifiers += [mods(alibi_slopes=np.ones((1, 2)))]
    assert {type(m) for m in with_modifiers} == {ScoreMods}
    typed = {numba.typeof(m) for m in with_modifiers}
    assert len(typed) == 1, typed
    plain = [mods(), mods(causal=True), mods(window=(2, 0))]
    assert {type(m) for m in plain} == {EdgesOnlyScoreMods}
    (plain_type,) = {numba.typeof(m) for m in plain}
    assert plain_type.types == next(iter(typed)).types


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("layout", ["contiguous", "key-broadcast", "transposed"])
def test_masks_of_any_layout(backend, layout, rng):
    """Rows of a mask whose keys are not adjacent in memory (broadcast along keys, or a
    transposed view) give the oracle's result, as contiguous ones do."""
    q, k, v = _qkv(rng, 1, 2, 2, 5, 7, 8)
    if layout == "key-broadcast":  # one value per query row, for every key
        mask = np.broadcast_to(rng.standard_normal((1, 2, 5, 1)).astype(np.float32), (1, 2, 5, 7))
    elif layout == "transposed":
        mask = np.swapaxes(rng.random((1, 2, 7, 5)) > 0.4, 2, 3)
        mask[..., 0] = True  # every row sees a key
    else:
        mask = rng.random((1, 2, 5, 7)) > 0.4
        mask[..., 0] = True
    got = fastpe.attention(q, k, v, mask=mask, backend=backend)
    _close(got, fastpe.attention(q, k, v, mask=mask, **O), 2e-6, layout)


# ---------------------------------------------------------------------------------------------
# softmax overflow


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_later_tile_far_above_with_huge_values(backend, fw, rng):
    """Keys of a later tile score 21 above the earlier ones while |v| ~ 1e30: the running
    sums must be rescaled before they overflow (the oracle's answer is ~1e30, finite)."""
    q, k, v = _qkv(rng, 1, 1, 1, 4, 600, 8)
    q[:] = 1.0
    k[:] = 0.0  # every score 0 …
    k[0, 0, 300] = 21.0 / np.sqrt(8)  # … but key 300's, in a later tile: 21
    v *= np.float32(1e30)
    args = [to_fw(a, fw) for a in (q, k, v)]
    got, lse = fastpe.attention(*args, return_lse=True, backend=backend)
    want, want_lse = fastpe.attention(*args, return_lse=True, **O)
    assert np.isfinite(to_np(want)).all()
    _close(got, want, 2e-5, "huge values")
    _close(lse, want_lse, 2e-6, "huge values lse")


@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_scores_beyond_float32_are_nan_like_sdpa(backend, rng):
    """A score that overflows float32 has no float32 answer: torch's SDPA returns NaN for the
    row, and so must every float32 kernel (never a finite guess). Other rows are unaffected."""
    q, k, v = (torch.from_numpy(a) for a in _qkv(rng, 1, 1, 1, 3, 20, 4))
    q[0, 0, 1] = 1e20
    k[0, 0, 5] = 1e20  # row 1 scores 2e40 at key 5
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.isnan(sdpa[0, 0, 1]).all() and not torch.isnan(sdpa[0, 0, [0, 2]]).any()
    got = fastpe.attention(q, k, v, backend=backend)
    assert torch.isnan(got[0, 0, 1]).all()
    _close(got[0, 0, [0, 2]], fastpe.attention(q, k, v, **O)[0, 0, [0, 2]], 2e-5, "other rows")


@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_reaches_the_rows_that_see_it(backend, where, rng):
    """A NaN in q, or in the k of a key a row attends to, makes that row NaN (lse too); a NaN in
    the v of such a key makes that column of the row NaN — as IEEE arithmetic does in eager
    attention (the independent reference here). Rows that never see the key (causal: queries
    before it) stay finite and exact, except that a NaN value of an unseen key may still reach
    them (0 · NaN in a dense product; not where a kernel skips the masked tile). The kernels
    and the oracle used to drop a NaN score as if its key were masked: a finite wrong answer."""
    q, k, v = (torch.from_numpy(a) for a in _qkv(rng, 1, 2, 1, 6, 6, 8))
    clean = to_np(fastpe.attention(q, k, v, causal=True, **O))[0]
    if where == "q":
        q[0, 1, 3, 2] = float("nan")  # head 1, query 3
        heads, rows, cols = [1], [3], range(8)
    elif where == "k":
        k[0, 0, 3, 2] = float("nan")  # key 3: seen by queries 3, 4, 5 of both heads
        heads, rows, cols = [0, 1], [3, 4, 5], range(8)
    else:
        v[0, 0, 3, 5] = float("nan")  # key 3's value, column 5
        heads, rows, cols = [0, 1], [3, 4, 5], [5]
    nan = np.zeros((2, 6, 8), bool)
    nan[np.ix_(heads, rows, cols)] = True
    finite = ~nan
    if where == "v":
        finite[:, :, 5] = False  # unspecified: rows 0-2 do not see key 3
    nan_lse = np.zeros((2, 6), bool)
    if where != "v":
        nan_lse[np.ix_(heads, rows)] = True

    scores = q.double() @ k.double().transpose(-1, -2) / np.sqrt(8.0)
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), -torch.inf)
    eager = (torch.softmax(scores, dim=-1) @ v.double())[0].numpy()
    assert np.isnan(eager[nan]).all() and not np.isnan(eager[finite]).any()

    out, lse = fastpe.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    out, lse = to_np(out)[0].astype(np.float64), to_np(lse)[0]
    assert np.isnan(out[nan]).all(), np.argwhere(~np.isnan(out) & nan)
    np.testing.assert_allclose(out[finite], clean[finite], rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(np.isnan(lse), nan_lse)


# ---------------------------------------------------------------------------------------------
# merge: a part with lse = -inf saw no key and contributes nothing


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_merge_ignores_parts_with_no_key(backend, fw, dtype, rng):
    out_a, out_b = (rng.standard_normal((1, 2, 4, 8)).astype(dtype) for _ in range(2))
    lse_a, lse_b = (rng.standard_normal((1, 2, 4)).astype(np.float32) for _ in range(2))
    out_a[:, :, :2] = np.nan  # rows 0, 1 of part a: garbage behind lse = -inf
    lse_a[:, :, :2] = -np.inf
    lse_b[:, :, 1] = -np.inf  # row 1: neither part saw a key
    out_b[:, :, 1] = np.inf
    args = [to_fw(a, fw) for a in (out_a, lse_a, out_b, lse_b)]
    out, lse = fastpe.merge_attention(*args, backend=backend)
    out, lse = to_np(out), to_np(lse)
    np.testing.assert_allclose(out[:, :, 0], out_b[:, :, 0], rtol=1e-6)
    np.testing.assert_allclose(lse[:, :, 0], lse_b[:, :, 0], rtol=1e-6)
    np.testing.assert_array_equal(out[:, :, 1], 0.0)
    assert np.all(lse[:, :, 1] == -np.inf)
    top = np.maximum(lse_a[:, :, 2:], lse_b[:, :, 2:]).astype(np.float64)
    wa, wb = np.exp(lse_a[:, :, 2:] - top), np.exp(lse_b[:, :, 2:] - top)
    want = (out_a[:, :, 2:] * wa[..., None] + out_b[:, :, 2:] * wb[..., None]) / (wa + wb)[
        ..., None
    ]
    np.testing.assert_allclose(out[:, :, 2:], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse[:, :, 2:], top + np.log(wa + wb), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# ragged KV cache: with bottom-right alignment, query i of sequence b sits at L_b - Sq + i


RAGGED_OPTIONS = {
    "causal": {"causal": True},
    "alibi": {"alibi_slopes": True},
    "causal_alibi_bias": {"causal": True, "alibi_slopes": True, "relative_bias": True},
}


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("option", list(RAGGED_OPTIONS))
@pytest.mark.parametrize("sq", [1, 5])
def test_key_lengths_align_queries_to_each_length(backend, fw, option, sq, rng):
    """A padded batch with key_lengths equals each sequence attended unpadded (FlashAttention's
    rule for a ragged KV cache), for the causal rule, ALiBi and relative-bias distances."""
    b, hq, sk, d = 3, 2, 40, 8
    lengths = np.array([40, 23, 3])  # full, ragged, shorter than Sq
    q, k, v = _qkv(rng, b, hq, hq, sq, sk, d)
    for bi, length in enumerate(lengths):
        k[bi, :, length:] = np.nan  # padding is never read
        v[bi, :, length:] = np.nan
    kw = {}
    for name in RAGGED_OPTIONS[option]:
        if name == "causal":
            kw["causal"] = True
        elif name == "alibi_slopes":
            kw["alibi_slopes"] = to_fw(np.array([0.5, 0.125]), fw)
        else:
            kw["relative_bias"] = {
                "table": to_fw(rng.standard_normal((16, hq)), fw),
                "num_buckets": 16,
            }
    args = [to_fw(a, fw) for a in (q, k, v)]
    got, lse = fastpe.attention(
        *args, key_lengths=to_fw(lengths, fw), return_lse=True, **kw, backend=backend
    )
    got, lse = to_np(got), to_np(lse)
    for bi, length in enumerate(lengths):
        one = [to_fw(a[bi : bi + 1, :, : (sq if a is q else length)], fw) for a in (q, k, v)]
        want, want_lse = (to_np(x) for x in fastpe.attention(*one, return_lse=True, **kw, **O))
        _close(got[bi : bi + 1], want, 2e-5, f"sequence {bi} (length {length})")
        seen = np.isfinite(want_lse)
        np.testing.assert_array_equal(np.isfinite(lse[bi : bi + 1]), seen)
        np.testing.assert_allclose(lse[bi : bi + 1][seen], want_lse[seen], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_alibi_far_from_every_key_keeps_float32_precision(backend, fw, rng):
    """Queries thousands of positions past the few keys they see (top-left alignment, short
    key lengths): ALiBi's large common offset must not swamp the scores' float32 precision,
    and lse still includes it."""
    q, k, v = _qkv(rng, 2, 2, 2, 2000, 6, 8)
    q[:, :, :-4] = 0.0  # only the last rows (positions ~2000) carry a query
    kw = {"causal_alignment": "top_left", "alibi_slopes": to_fw(np.array([1.0, 0.75]), fw)}
    args = [to_fw(a, fw) for a in (q, k, v)]
    lengths = to_fw(np.array([6, 4]), fw)
    got, lse = fastpe.attention(*args, key_lengths=lengths, return_lse=True, **kw, backend=backend)
    want, want_lse = fastpe.attention(*args, key_lengths=lengths, return_lse=True, **kw, **O)
    _close(got, want, 2e-6, "far ALiBi out")
    np.testing.assert_allclose(to_np(lse), to_np(want_lse), rtol=4e-7, atol=2e-6)


# ---------------------------------------------------------------------------------------------
# float32 accuracy: within 2x of torch's float32 SDPA error against float64 (FlashAttention's grid)

FA_SEQLENS = [
    (113, 203),
    (128, 217),
    (113, 211),
    (108, 256),
    (256, 512),
    (512, 256),
    (1024, 1024),
    (1023, 1024),
    (1024, 1023),
    (2048, 2048),
]
FAST_GRID = [((113, 203), 64, True), ((256, 512), 128, False), ((1023, 1024), 32, True)]


def _point(point, slow):
    # Triton's interpreter runs the smallest sequence pair with every head size (a constexpr)
    # and causal flag: the kernel's logic is the same at every length; the lengths run on numba.
    marks = [pytest.mark.slow] if slow else []
    if point[0] != (113, 203):
        marks.append(pytest.mark.grid_only)
    return pytest.param(point, marks=marks)


FULL_GRID = [
    _point((s, d, c), slow=True)
    for s in FA_SEQLENS
    for d in (32, 64, 128)
    for c in (False, True)
    if (s, d, c) not in FAST_GRID
]
FAST_GRID = [_point(point, slow=False) for point in FAST_GRID]


@pytest.mark.skipif(torch is None, reason="torch not installed")
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("point", FAST_GRID + FULL_GRID)
def test_float32_error_within_twice_sdpa(backend, point):
    (sq, sk), d, causal = point
    if backend == "triton" and sq * sk > 256 * 512:
        pytest.skip("too slow under Triton's interpreter")
    g = torch.Generator().manual_seed(sq * 7 + sk * 13 + d)
    q, k, v = (torch.randn(2, 3, s, d, generator=g) for s in (sq, sk, sk))
    want = fastpe.attention(q.double(), k.double(), v.double(), causal=causal, **O)
    # torch's is_causal is top-left; fastpe's default (bottom-right) needs an explicit mask
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq) if causal else None
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    rows = mask.any(-1).expand(2, 3, sq) if causal else torch.ones(2, 3, sq, dtype=torch.bool)
    sdpa_err = (sdpa.double() - want)[rows].abs().max().item()
    got = fastpe.attention(q, k, v, causal=causal, backend=backend)
    err = (got.double() - want)[rows].abs().max().item()
    assert err <= 2 * sdpa_err, (err, sdpa_err, err / sdpa_err)
