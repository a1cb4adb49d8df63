"""Argument edges: integers at and past 2**31 / 2**63 / 2**64, negative and unsigned values,
0-dim integer tensors; huge attention windows; FlashAttention's own argument rules (window
adjustment, softcap, the kv-cache append that needs ``cache_seqlens``).

Expected attention values come from the plain float64 NumPy attention with an explicit mask
written here (``_attend``), the mask built with Python integers; errors are checked for their
type, for naming the argument, and for leaving the caches unwritten.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from _testkit import KERNEL_BACKENDS, to_np, torch

import fastpe
import fastpe.nn
from fastpe import flash_attn

ALL_BACKENDS = ["numpy", *KERNEL_BACKENDS]
HUGE = [sys.maxsize, 2**63, 2**64, 10**30]


def _attend(q, k, v, allowed):
    """Softmax attention in float64: q [..., Sq, D], k/v [..., Sk, D] (heads already matched),
    ``allowed`` bool broadcast to [..., Sq, Sk]; a row with no allowed key is 0."""
    q, k, v = (np.asarray(to_np(x), np.float64) for x in (q, k, v))
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    allowed = np.broadcast_to(allowed, scores.shape)
    scores = np.where(allowed, scores, -np.inf)
    top = scores.max(-1, keepdims=True, initial=-np.inf)
    weights = np.where(allowed, np.exp(scores - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = weights.sum(-1, keepdims=True)
    return (weights / np.where(total > 0, total, 1.0)) @ v


def _mask(sq, sk, *, length=None, window=(-1, -1), causal=False):
    """[Sq, Sk] bool: query i sits at key position i + L - Sq (bottom-right, L = length or Sk);
    keys j < L, within ``window`` (-1 = unbounded) and, when causal, j <= position. Python
    integers throughout, so no window is too wide to compare exactly."""
    length = sk if length is None else length
    left, right = (int(side) for side in window)
    allowed = np.zeros((sq, sk), bool)
    for i in range(sq):
        pos = i + length - sq
        for j in range(length):
            allowed[i, j] = (
                (left < 0 or j >= pos - left)
                and (right < 0 or j <= pos + right)
                and (not causal or j <= pos)
            )
    return allowed


def _close(got, want, tol=2e-5):
    got = np.asarray(to_np(got), np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def _for(backend, *arrays):
    """Triton takes torch tensors; the CPU backends take the NumPy arrays as they are."""
    if backend == "triton":
        return tuple(torch.from_numpy(np.ascontiguousarray(x)) for x in arrays)
    return arrays


# ---------------------------------------------------------------------------------------------
# Huge windows are unbounded on every backend and every attention op (they used to mask every
# key: query position + window overflowed int64), and values >= 2**63 are accepted.

WINDOWS = [
    (-1, sys.maxsize),
    (sys.maxsize, -1),
    (sys.maxsize, sys.maxsize),
    (2**63, 2**64),
    (2, 10**30),
    (10**30, 1),
]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_huge_window_attention(backend, window, causal):
    rng = np.random.default_rng(0)
    q, k, v = (
        rng.standard_normal(s).astype(np.float32)
        for s in [(2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8)]
    )
    out = fastpe.attention(*_for(backend, q, k, v), window=window, causal=causal, backend=backend)
    _close(out, _attend(q, k, v, _mask(5, 7, window=window, causal=causal)))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_huge_window_varlen(backend, window, causal):
    rng = np.random.default_rng(1)
    lq, lk = [3, 1, 4], [4, 6, 4]
    cu_q, cu_k = (np.cumsum([0, *n]).astype(np.int32) for n in (lq, lk))
    q = rng.standard_normal((sum(lq), 2, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, sum(lk), 2, 8)).astype(np.float32)
    out = fastpe.attention_varlen(
        *_for(backend, q, k, v, cu_q, cu_k), window=window, causal=causal, backend=backend
    )
    for b in range(3):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        want = _attend(
            q[rows].swapaxes(0, 1),
            k[keys].swapaxes(0, 1),
            v[keys].swapaxes(0, 1),
            _mask(lq[b], lk[b], window=window, causal=causal),
        )
        _close(to_np(out)[rows], want.swapaxes(0, 1))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_huge_window_kvcache(backend, window, causal):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 3, 2, 8)).astype(np.float32)
    k_cache, v_cache = rng.standard_normal((2, 2, 9, 2, 8)).astype(np.float32)
    lengths = np.array([4, 9])
    out = fastpe.attention_kvcache(
        *_for(backend, q, k_cache, v_cache, lengths)[:3],
        cache_seqlens=_for(backend, lengths)[0],
        window=window,
        causal=causal,
        backend=backend,
    )
    for b in range(2):
        allowed = _mask(3, 9, length=int(lengths[b]), window=window, causal=causal)
        want = _attend(
            q[b].swapaxes(0, 1), k_cache[b].swapaxes(0, 1), v_cache[b].swapaxes(0, 1), allowed
        )
        _close(to_np(out)[b], want.swapaxes(0, 1))


@pytest.mark.parametrize("window", [(-1, sys.maxsize), (2**64, -1)], ids=str)
def test_huge_window_through_the_torch_op(window):
    """With a q that requires grad the call goes through fastpe's custom op, whose int64 schema
    cannot carry 2**63 or more."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 4, 8)) for _ in range(3))
    out = fastpe.attention(
        torch.tensor(q, requires_grad=True),
        torch.tensor(k),
        torch.tensor(v),
        window=window,
        backend="numpy",
    )
    _close(out.detach(), _attend(q, k, v, _mask(4, 4, window=window)))


@pytest.mark.parametrize("window_size", [(-1, sys.maxsize), (2**63, 2**64), (2**64, 0)], ids=str)
def test_huge_window_size_flash_attn_func(window_size):
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 4, 2, 8)) for _ in range(3))
    out = flash_attn.flash_attn_func(q, k, v, window_size=window_size)
    want = _attend(
        q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), _mask(4, 4, window=window_size)
    )
    _close(out, want.swapaxes(1, 2))


# ---------------------------------------------------------------------------------------------
# FlashAttention's window adjustment: a side >= seqlen_k is unbounded; 0-dim integer tensors.


def test_flash_attn_right_edge_at_seqlen_k_is_unbounded():
    """Sq = 6 > Sk = 3: FlashAttention turns window_size=(0, 3) into (0, -1), so the first
    queries (at key positions -3 … -1) see every key; fastpe.attention keeps (0, 3)."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 6, 1, 8))
    k, v = rng.standard_normal((2, 1, 3, 1, 8))
    out = flash_attn.flash_attn_func(q, k, v, window_size=(0, 3))
    bhsd = [x.swapaxes(1, 2) for x in (q, k, v)]
    _close(out, _attend(*bhsd, _mask(6, 3, window=(0, -1))).swapaxes(1, 2))
    _close(fastpe.attention(*bhsd, window=(0, 3)), _attend(*bhsd, _mask(6, 3, window=(0, 3))))


def test_flash_attn_varlen_right_edge_at_max_seqlen_k_is_unbounded():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((6, 1, 8))
    k, v = rng.standard_normal((2, 3, 1, 8))
    cu_q, cu_k = np.array([0, 6], np.int32), np.array([0, 3], np.int32)
    out = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 3, window_size=(0, 3))
    want = _attend(*(x.swapaxes(0, 1) for x in (q, k, v)), _mask(6, 3, window=(0, -1)))
    _close(out, want.swapaxes(0, 1))


def _rotate(x, pos, inv_freq):
    """Non-interleaved RoPE (rotate_half) of x [..., S, H, D] at positions pos [S], float64."""
    angle = pos[:, None] * inv_freq[None, :]  # [S, D/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


@pytest.mark.parametrize("window_size", [(8, 8), (2**64, 100)], ids=str)
def test_kvcache_window_wider_than_cache_is_dropped_for_rotary(window_size):
    """A window that reaches past the cache (8 slots) on both sides is dropped by
    FlashAttention: not causal and no window, so every rotary query sits at cache_seqlens."""
    rng = np.random.default_rng(7)
    b, sq, new, h, d, slots, length = 1, 3, 2, 1, 8, 8, 3
    q = rng.standard_normal((b, sq, h, d))
    k_new, v_new = rng.standard_normal((2, b, new, h, d))
    k_cache, v_cache = rng.standard_normal((2, b, slots, h, d))
    inv_freq = 10000.0 ** (-np.arange(0, d, 2) / d)
    angles = np.arange(16)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    want_k = k_cache.copy()
    want_k[0, length : length + new] = _rotate(k_new[0], np.arange(length, length + new), inv_freq)
    want_v = v_cache.copy()
    want_v[0, length : length + new] = v_new[0]
    q_rot = _rotate(q[0], np.full(sq, length), inv_freq)  # every query at cache_seqlens
    out = flash_attn.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k_new,
        v_new,
        rotary_cos=cos,
        rotary_sin=sin,
        cache_seqlens=length,
        window_size=window_size,
        rotary_interleaved=False,
    )
    allowed = np.arange(slots)[None, :] < length + new
    want = _attend(
        q_rot.swapaxes(0, 1), want_k[0].swapaxes(0, 1), want_v[0].swapaxes(0, 1), allowed
    )
    _close(out[0], want.swapaxes(0, 1))
    _close(k_cache, want_k)


def test_window_size_as_0dim_tensors():
    """FlashAttention's tests pass window_size=(torch.tensor(w), torch.tensor(-1))."""
    rng = np.random.default_rng(8)
    q, k, v = (torch.tensor(rng.standard_normal((1, 5, 2, 8))) for _ in range(3))
    out = flash_attn.flash_attn_func(q, k, v, window_size=(torch.tensor(1), torch.tensor(-1)))
    bhsd = [x.numpy().swapaxes(1, 2) for x in (q, k, v)]
    _close(out, _attend(*bhsd, _mask(5, 5, window=(1, -1))).swapaxes(1, 2))
    out = fastpe.attention(*(torch.from_numpy(x) for x in bhsd), window=(np.array(1), np.int64(-1)))
    _close(out, _attend(*bhsd, _mask(5, 5, window=(1, -1))))


# ---------------------------------------------------------------------------------------------
# flash_attn_* argument checks: softcap and window_size errors name the argument.


def _fa_calls():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((1, 4, 2, 8)).astype(np.float32)
    packed = rng.standard_normal((4, 2, 8)).astype(np.float32)
    cu = np.array([0, 4], np.int32)
    cache = np.zeros((1, 8, 2, 8), np.float32)
    return {
        "flash_attn_func": lambda **kw: flash_attn.flash_attn_func(x, x, x, **kw),
        "flash_attn_qkvpacked_func": lambda **kw: flash_attn.flash_attn_qkvpacked_func(
            np.stack([x] * 3, axis=2), **kw
        ),
        "flash_attn_kvpacked_func": lambda **kw: flash_attn.flash_attn_kvpacked_func(
            x, np.stack([x] * 2, axis=2), **kw
        ),
        "flash_attn_varlen_func": lambda **kw: flash_attn.flash_attn_varlen_func(
            packed, packed, packed, cu, cu, 4, 4, **kw
        ),
        "flash_attn_varlen_qkvpacked_func": lambda **kw: (
            flash_attn.flash_attn_varlen_qkvpacked_func(np.stack([packed] * 3, axis=1), cu, 4, **kw)
        ),
        "flash_attn_varlen_kvpacked_func": lambda **kw: flash_attn.flash_attn_varlen_kvpacked_func(
            packed, np.stack([packed] * 2, axis=1), cu, cu, 4, 4, **kw
        ),
        "flash_attn_with_kvcache": lambda **kw: flash_attn.flash_attn_with_kvcache(
            x, cache, cache, x, x, cache_seqlens=2, **kw
        ),
    }


@pytest.mark.parametrize("function", list(_fa_calls()))
@pytest.mark.parametrize(
    "kwargs,error,name",
    [
        ({"softcap": float("nan")}, ValueError, "softcap"),
        ({"softcap": float("inf")}, ValueError, "softcap"),
        ({"softcap": -1.0}, ValueError, "softcap"),
        ({"softcap": "1"}, TypeError, "softcap"),
        ({"softcap": None}, TypeError, "softcap"),
        ({"window_size": 3}, TypeError, "window_size"),
        ({"window_size": (1, 2, 3)}, TypeError, "window_size"),
        ({"window_size": (1.5, -1)}, TypeError, "window_size[0]"),
        ({"window_size": (0, -2)}, ValueError, "window_size[1]"),
        ({"window_size": (torch.tensor(1.0), -1)}, TypeError, "window_size[0]"),
    ],
    ids=lambda p: p.__name__ if isinstance(p, type) else repr(p),
)
def test_flash_attn_bad_options_name_the_argument(function, kwargs, error, name):
    call = _fa_calls()[function]
    with pytest.raises(error) as caught:
        call(**kwargs)
    assert name in str(caught.value), str(caught.value)


def test_flash_attn_softcap_zero_is_off():
    rng = np.random.default_rng(10)
    q, k, v = (rng.standard_normal((1, 3, 1, 8)) for _ in range(3))
    out = flash_attn.flash_attn_func(q, k, v, softcap=0)
    want = _attend(*(x.swapaxes(1, 2) for x in (q, k, v)), np.ones((3, 3), bool))
    _close(out, want.swapaxes(1, 2))


# ---------------------------------------------------------------------------------------------
# flash_attn_with_kvcache without cache_seqlens


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_append_without_cache_seqlens_is_refused(paged):
    """It used to write the new tokens over the last slots of every cache row."""
    rng = np.random.default_rng(11)
    q, k, v = rng.standard_normal((3, 2, 1, 2, 8)).astype(np.float32)
    k_cache, v_cache = rng.standard_normal((2, 4, 4, 2, 8)).astype(np.float32)
    before = k_cache.copy(), v_cache.copy()
    table = np.array([[0, 1], [2, 3]], np.int32) if paged else None
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, block_table=table)
    assert np.array_equal(k_cache, before[0]) and np.array_equal(v_cache, before[1])


def test_kvcache_without_cache_seqlens_reads_the_whole_cache():
    rng = np.random.default_rng(12)
    q = rng.standard_normal((2, 1, 2, 8))
    k_cache, v_cache = rng.standard_normal((2, 2, 5, 2, 8))
    out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache)
    for b in range(2):
        want = _attend(
            q[b].swapaxes(0, 1),
            k_cache[b].swapaxes(0, 1),
            v_cache[b].swapaxes(0, 1),
            np.ones((1, 5), bool),
        )
        _close(out[b], want.swapaxes(0, 1))


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("lengths", [[2**63 - 2, 1], [1, sys.maxsize], [0, 2**63 - 3]], ids=str)
def test_kvcache_lengths_near_int64_max_are_refused_before_writing(paged, lengths):
    """length + 3 new tokens used to wrap past the capacity check into NumPy's IndexError."""
    rng = np.random.default_rng(15)
    q = rng.standard_normal((2, 1, 2, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, 2, 3, 2, 8)).astype(np.float32)
    k_cache, v_cache = rng.standard_normal((2, 4, 4, 2, 8)).astype(np.float32)
    before = k_cache.copy(), v_cache.copy()
    table = np.array([[0, 1], [2, 3]], np.int32) if paged else None
    with pytest.raises(ValueError, match="cache_seqlens"):
        fastpe.attention_kvcache(
            q,
            k_cache,
            v_cache,
            k,
            v,
            cache_seqlens=np.array(lengths),
            block_table=table,
            backend="numpy",
        )
    assert np.array_equal(k_cache, before[0]) and np.array_equal(v_cache, before[1])


@pytest.mark.parametrize("k", [2**32 - 1, -(2**32 - 1), 2**31 + 12345])
def test_relative_transform_far_distances_are_exact(k):
    """T(k) for the largest distances between supported positions, against 50-digit cos/sin
    of k·ω (a float64 product k·ω was off by up to 1e-8 there)."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50
    t = fastpe.relative_transform(k, 8)
    omega = 10000.0 ** (-np.arange(0, 8, 2) / 8)
    for i, w in enumerate(omega):
        angle = mpmath.mpf(k) * mpmath.mpf(float(w))
        np.testing.assert_allclose(t[2 * i, 2 * i], float(mpmath.cos(angle)), rtol=0, atol=1e-15)
        np.testing.assert_allclose(
            t[2 * i, 2 * i + 1], float(mpmath.sin(angle)), rtol=0, atol=1e-15
        )


# ---------------------------------------------------------------------------------------------
# The integer sweep: every integer argument of every public op, given values at and past the
# int32/int64/uint64 limits, negative, unsigned or 0-dim. Each call either works — and then
# gives what the same call with the plain int / int64 value gives — or raises a ValueError or
# TypeError naming the argument (or, for an index outside its table, fastpe's documented
# IndexError naming it), and writes nothing first. NumPy backend: the checks run before any
# kernel.

SCALARS = {
    "2**31": 2**31,
    "2**63": 2**63,
    "2**64": 2**64,
    "-1": -1,
    "uint32": np.uint32(3),
    "uint64": np.uint64(2**64 - 1),
    "0-dim tensor": "tensor",
    "0-dim array": np.array(2),
    "0-dim float tensor": "float tensor",
}
ARRAYS = {
    "2**31": ("int64", 2**31),
    "2**63": ("uint64", 2**63),
    "2**64": ("list", 2**64),
    "-1": ("int64", -1),
    "uint32": ("uint32", None),
    "uint64": ("uint64", None),
    "0-dim tensor": ("0-dim", None),
}


def _scalar(kind):
    value = SCALARS[kind]
    if isinstance(value, str):
        return torch.tensor(3) if value == "tensor" else torch.tensor(3.0)
    return value


def _array(kind, valid):
    """``valid`` (an int64 array) turned into the edge case ``kind``: its first entry replaced
    by a huge or negative value, or all of it in another dtype."""
    how, entry = ARRAYS[kind]
    valid = np.asarray(valid, np.int64)
    if how == "0-dim":
        return torch.tensor(int(valid.flat[0]))
    if entry is None:
        return valid.astype(how)
    if how == "list":
        values = valid.tolist()
        row = values
        while isinstance(row[0], list):
            row = row[0]
        row[0] = entry
        return values
    out = valid.astype(how)
    out.flat[0] = entry
    return out


def _plain(value):
    """The plain value the edge value stands for (None when it stands for nothing plainer)."""
    if isinstance(value, np.ndarray) and value.ndim and value.dtype.kind == "u":
        return value.astype(np.int64)
    if torch is not None and isinstance(value, torch.Tensor) and value.dtype == torch.int64:
        return int(value)
    if isinstance(value, (np.ndarray, np.integer)) and np.ndim(value) == 0:
        return int(value)
    return None


_R = np.random.default_rng(13)
_Q = _R.standard_normal((2, 2, 3, 4)).astype(np.float32)
_K = _R.standard_normal((2, 2, 5, 4)).astype(np.float32)
_COS, _SIN = fastpe.rope_table(16, 4)
_W = _R.standard_normal((6, 4)).astype(np.float32)
_PACKED_Q, _PACKED_K = _R.standard_normal((5, 2, 4)), _R.standard_normal((7, 2, 4))
_CU_Q, _CU_K = np.array([0, 2, 5], np.int32), np.array([0, 3, 7], np.int32)
_NEW = _R.standard_normal((2, 1, 2, 4)).astype(np.float32)


def _caches():
    """Fresh k/v caches, the same values each time (a call's answer is compared with another's)."""
    rng = np.random.default_rng(14)
    return [rng.standard_normal((3, 4, 2, 4)).astype(np.float32) for _ in range(2)]


def _kvcache(caches, **kw):
    kw.setdefault("cache_seqlens", np.array([1, 2]))
    return fastpe.attention_kvcache(_NEW, *caches, _NEW, _NEW, backend="numpy", **kw)


def _fa_kvcache(caches, **kw):
    kw.setdefault("cache_seqlens", np.array([1, 2], np.int32))
    return flash_attn.flash_attn_with_kvcache(_NEW, *caches, _NEW, _NEW, **kw)


# name in errors, index argument (fastpe's IndexError allowed), scalar or array form, call:
# call(value, caches) runs the op with ``value`` for that argument (caches: fresh kv caches);
# ``big`` marks table sizes that would allocate gigabytes when accepted: only validated there.
N = "numpy"
CASES = {
    "sinusoidal_table num_positions": (
        "num_positions",
        "scalar",
        lambda x, c: fastpe.sinusoidal_table(x, 4, backend=N),
        "big",
    ),
    "sinusoidal_table dim": (
        "dim",
        "scalar",
        lambda x, c: fastpe.sinusoidal_table(2, x, backend=N),
        "big",
    ),
    "relative_transform k": ("k", "scalar", lambda x, c: fastpe.relative_transform(x, 4), ""),
    "relative_transform dim": (
        "dim",
        "scalar",
        lambda x, c: fastpe.relative_transform(1, x),
        "big",
    ),
    "sinusoidal_table offset": (
        "offset",
        "scalar",
        lambda x, c: fastpe.sinusoidal_table(2, 4, offset=x, backend=N),
        "",
    ),
    "rope_table num_positions": (
        "num_positions",
        "scalar",
        lambda x, c: fastpe.rope_table(x, 4, backend=N),
        "big",
    ),
    "rope_table rotary_dim": (
        "rotary_dim",
        "scalar",
        lambda x, c: fastpe.rope_table(2, x, backend=N),
        "big",
    ),
    "rope_table offset": (
        "offset",
        "scalar",
        lambda x, c: fastpe.rope_table(2, 4, offset=x, backend=N),
        "",
    ),
    "apply_rope positions int": (
        "positions",
        "scalar",
        lambda x, c: fastpe.apply_rope(_Q, _COS, _SIN, positions=x, backend=N),
        "index",
    ),
    "apply_rope positions array": (
        "positions",
        ([0, 2, 4],),
        lambda x, c: fastpe.apply_rope(_Q, _COS, _SIN, positions=x, backend=N),
        "index",
    ),
    "embed ids": ("ids", ([[1, 2, 3]],), lambda x, c: fastpe.embed(x, _W, backend=N), "index"),
    "embed positions int": (
        "positions",
        "scalar",
        lambda x, c: fastpe.embed(np.zeros((1, 3), np.int64), _W, positions=x, backend=N),
        "",
    ),
    "embed positions array": (
        "positions",
        ([[0, 5, 9]],),
        lambda x, c: fastpe.embed(np.zeros((1, 3), np.int64), _W, positions=x, backend=N),
        "index",
    ),
    "embed token_type_ids": (
        "token_type_ids",
        ([[0, 1, 1]],),
        lambda x, c: fastpe.embed(
            np.zeros((1, 3), np.int64), _W, token_type_ids=x, token_type_weight=_W[:2], backend=N
        ),
        "index",
    ),
    "attention key_lengths": (
        "key_lengths",
        ([5, 3],),
        lambda x, c: fastpe.attention(_Q, _K, _K, key_lengths=x, backend=N),
        "index",
    ),
    "attention window left": (
        "window",
        "scalar",
        lambda x, c: fastpe.attention(_Q, _K, _K, window=(x, 1), backend=N),
        "",
    ),
    "attention window right": (
        "window",
        "scalar",
        lambda x, c: fastpe.attention(_Q, _K, _K, window=(1, x), backend=N),
        "",
    ),
    "attention rope q_positions": (
        "q_positions",
        ([0, 1, 2],),
        lambda x, c: fastpe.attention(
            _Q, _K, _K, rope={"cos": _COS, "sin": _SIN, "q_positions": x}, backend=N
        ),
        "index",
    ),
    "attention relative_bias num_buckets": (
        "num_buckets",
        "scalar",
        lambda x, c: fastpe.attention(
            _Q,
            _K,
            _K,
            relative_bias={"table": np.zeros((8, 2), np.float32), "num_buckets": x},
            backend=N,
        ),
        "",
    ),
    "attention relative_bias max_distance": (
        "max_distance",
        "scalar",
        lambda x, c: fastpe.attention(
            _Q,
            _K,
            _K,
            relative_bias={
                "table": np.zeros((8, 2), np.float32),
                "num_buckets": 8,
                "max_distance": x,
            },
            backend=N,
        ),
        "",
    ),
    "attention_varlen cu_seqlens_q": (
        "cu_seqlens_q",
        ([0, 2, 5],),
        lambda x, c: fastpe.attention_varlen(_PACKED_Q, _PACKED_K, _PACKED_K, x, _CU_K, backend=N),
        "",
    ),
    "attention_varlen cu_seqlens_k": (
        "cu_seqlens_k",
        ([0, 3, 7],),
        lambda x, c: fastpe.attention_varlen(_PACKED_Q, _PACKED_K, _PACKED_K, _CU_Q, x, backend=N),
        "",
    ),
    "attention_varlen max_seqlen_q": (
        "max_seqlen_q",
        "scalar",
        lambda x, c: fastpe.attention_varlen(
            _PACKED_Q, _PACKED_K, _PACKED_K, _CU_Q, _CU_K, max_seqlen_q=x, backend=N
        ),
        "",
    ),
    "attention_varlen max_seqlen_k": (
        "max_seqlen_k",
        "scalar",
        lambda x, c: fastpe.attention_varlen(
            _PACKED_Q, _PACKED_K, _PACKED_K, _CU_Q, _CU_K, max_seqlen_k=x, backend=N
        ),
        "",
    ),
    "attention_kvcache cache_seqlens int": (
        "cache_seqlens",
        "scalar",
        lambda x, c: _kvcache(c, cache_seqlens=x),
        "",
    ),
    "attention_kvcache cache_seqlens array": (
        "cache_seqlens",
        ([1, 2],),
        lambda x, c: _kvcache(c, cache_seqlens=x),
        "",
    ),
    "attention_kvcache block_table": (
        "block_table",
        ([[0], [2]],),
        lambda x, c: _kvcache(c, block_table=x),
        "index",
    ),
    "attention_kvcache cache_batch_idx": (
        "cache_batch_idx",
        ([2, 0],),
        lambda x, c: _kvcache(c, cache_batch_idx=x),
        "index",
    ),
    "flash_attn_func window_size": (
        "window_size",
        "scalar",
        lambda x, c: flash_attn.flash_attn_func(_NEW, _NEW, _NEW, window_size=(x, 0)),
        "",
    ),
    "flash_attn_varlen_func cu_seqlens_q": (
        "cu_seqlens_q",
        ([0, 2, 5],),
        lambda x, c: flash_attn.flash_attn_varlen_func(
            _PACKED_Q, _PACKED_K, _PACKED_K, x, _CU_K, 3, 4
        ),
        "",
    ),
    "flash_attn_varlen_func max_seqlen_k": (
        "max_seqlen_k",
        "scalar",
        lambda x, c: flash_attn.flash_attn_varlen_func(
            _PACKED_Q, _PACKED_K, _PACKED_K, _CU_Q, _CU_K, 3, x
        ),
        "",
    ),
    "flash_attn_with_kvcache cache_seqlens": (
        "cache_seqlens",
        ([1, 2],),
        lambda x, c: _fa_kvcache(c, cache_seqlens=x),
        "",
    ),
    "flash_attn_with_kvcache cache_seqlens int": (
        "cache_seqlens",
        "scalar",
        lambda x, c: _fa_kvcache(c, cache_seqlens=x),
        "",
    ),
    "flash_attn_with_kvcache block_table": (
        "block_table",
        ([[0], [2]],),
        lambda x, c: _fa_kvcache(c, block_table=x),
        "index",
    ),
    "flash_attn_with_kvcache cache_batch_idx": (
        "cache_batch_idx",
        ([2, 0],),
        lambda x, c: _fa_kvcache(c, cache_batch_idx=x),
        "index",
    ),
    "nn.SinusoidalPositionalEmbedding dim": (
        "dim",
        "scalar",
        lambda x, c: fastpe.nn.SinusoidalPositionalEmbedding(x, max_positions=2),
        "big",
    ),
    "nn.SinusoidalPositionalEmbedding max_positions": (
        "max_positions",
        "scalar",
        lambda x, c: fastpe.nn.SinusoidalPositionalEmbedding(4, max_positions=x),
        "big",
    ),
    "nn.RotaryEmbedding rotary_dim": (
        "rotary_dim",
        "scalar",
        lambda x, c: fastpe.nn.RotaryEmbedding(x, max_position_embeddings=2),
        "big",
    ),
    "nn.RotaryEmbedding max_position_embeddings": (
        "max_position_embeddings",
        "scalar",
        lambda x, c: fastpe.nn.RotaryEmbedding(4, max_position_embeddings=x),
        "big",
    ),
}


def _sweep_params():
    for case, (_, form, _, _) in CASES.items():
        kinds = SCALARS if form == "scalar" else ARRAYS
        for kind in kinds:
            yield pytest.param(case, kind, id=f"{case}-{kind}")


def _first(result):
    return to_np(result[0] if isinstance(result, tuple) else result)


@pytest.mark.parametrize("case,kind", list(_sweep_params()))
def test_integer_arguments(case, kind):
    name, form, call, flags = CASES[case]
    value = _scalar(kind) if form == "scalar" else _array(kind, form[0])
    if "big" in flags and kind in ("2**31",):
        pytest.skip("accepted sizes of 2**31 allocate a table of gigabytes")
    _check_outcome(call, value, name, flags, negative=kind == "-1")


def _check_outcome(call, value, name, flags, *, negative):
    """``call(value, caches)`` works (and matches the plain value's answer) or raises a
    ValueError/TypeError (an index: fastpe's IndexError) naming ``name``, caches untouched."""
    caches = _caches()
    before = [c.copy() for c in caches]
    try:
        result = call(value, caches)
    except (ValueError, TypeError, IndexError) as error:
        message = str(error)
        if isinstance(error, IndexError):  # fastpe's documented error for an index off its table
            assert "index" in flags, f"unexpected IndexError: {message}"
        assert name in message, f"{type(error).__name__} does not name {name}: {message}"
        # a uint64 value >= 2**63 once came back as a negative number
        assert negative or not any(f"{lead} -" in message for lead in ("contains", "=", "got"))
    else:
        if isinstance(result, torch.nn.Module):
            return
        got = _first(result)
        assert np.isfinite(got).all()
        plain = _plain(value)
        if plain is not None:  # the same call with the plain value gives the same answer
            np.testing.assert_array_equal(got, _first(call(plain, _caches())))
        return
    for cache, saved in zip(caches, before, strict=True):
        assert np.array_equal(cache, saved), "a refused call wrote into the cache"


# The same arguments where a call goes through fastpe's torch custom op (an input that requires
# grad), whose schema carries int64: values past it must be refused by name before it.
def _grad(*shape):
    """An input that requires grad, the same values each time (answers are compared)."""
    values = np.random.default_rng(16).standard_normal(shape)
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


_TCOS, _TSIN = (torch.from_numpy(t) for t in (_COS, _SIN))
_TK = torch.from_numpy(_K)
_TCU_Q, _TCU_K = torch.from_numpy(_CU_Q), torch.from_numpy(_CU_K)
TORCH_CASES = {
    "apply_rope positions": (
        "positions",
        lambda x, c: fastpe.apply_rope(_grad(2, 2, 3, 4), _TCOS, _TSIN, positions=x, backend=N),
        "index",
    ),
    "embed positions": (
        "positions",
        lambda x, c: fastpe.embed(
            torch.zeros(1, 3, dtype=torch.long), _grad(6, 4), positions=x, backend=N
        ),
        "",
    ),
    "attention window": (
        "window",
        lambda x, c: fastpe.attention(_grad(2, 2, 3, 4), _TK, _TK, window=(x, x), backend=N),
        "",
    ),
    "attention rope q_positions": (
        "q_positions",
        lambda x, c: fastpe.attention(
            _grad(2, 2, 3, 4),
            _TK,
            _TK,
            rope={"cos": _TCOS, "sin": _TSIN, "q_positions": x},
            backend=N,
        ),
        "index",
    ),
    "attention relative_bias num_buckets": (
        "num_buckets",
        lambda x, c: fastpe.attention(
            _grad(2, 2, 3, 4),
            _TK,
            _TK,
            relative_bias={"table": torch.zeros(8, 2), "num_buckets": x},
            backend=N,
        ),
        "",
    ),
    "attention relative_bias max_distance": (
        "max_distance",
        lambda x, c: fastpe.attention(
            _grad(2, 2, 3, 4),
            _TK,
            _TK,
            relative_bias={"table": torch.zeros(8, 2), "num_buckets": 8, "max_distance": x},
            backend=N,
        ),
        "",
    ),
    "attention_varlen max_seqlen_q": (
        "max_seqlen_q",
        lambda x, c: fastpe.attention_varlen(
            _grad(5, 2, 4),
            _grad(7, 2, 4),
            _grad(7, 2, 4),
            _TCU_Q,
            _TCU_K,
            max_seqlen_q=x,
            backend=N,
        ),
        "",
    ),
    "attention_varlen window": (
        "window",
        lambda x, c: fastpe.attention_varlen(
            _grad(5, 2, 4),
            _grad(7, 2, 4),
            _grad(7, 2, 4),
            _TCU_Q,
            _TCU_K,
            window=(x, -1),
            backend=N,
        ),
        "",
    ),
}


@pytest.mark.parametrize("kind", list(SCALARS))
@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_integer_arguments_through_the_torch_op(case, kind):
    name, call, flags = TORCH_CASES[case]
    _check_outcome(call, _scalar(kind), name, flags, negative=kind == "-1")
