"""Attention's argument edges: huge windows (at and past 2**63 / 2**64) on every attention op and
backend, 0-dim integer tensors; FlashAttention's own argument rules (window adjustment, softcap,
the kv-cache append that needs ``cache_seqlens``) and kv-cache lengths near the int64 limit.

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
from fastpe import flash_attn

ALL_BACKENDS = ["numpy", *KERNEL_BACKENDS]


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
