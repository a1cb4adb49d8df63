"""Packed variable-length attention, KV-cache attention and fastpe.flash_attn.

Expected values come from a plain-torch float64 implementation of FlashAttention's documented
semantics written here (bottom-right causal alignment, window, softcap, ALiBi, GQA, append into
the cache, rotary at cache positions), never from fastpe. The FlashAttention test grids (seqlen
pairs, random padding masks turned into cu_seqlens, GQA/MQA) are ported as our own code: a few
pairs by default, the whole grid under ``slow``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import fastpe
from fastpe import flash_attn

torch = pytest.importorskip("torch")

BACKENDS = ["numpy", "numba", "triton"]


# ------------------------------------------------------------------ independent reference
def ref_attention(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None, scale=None):
    """One sequence, float64: q [Sq, Hq, D], k/v [Sk, Hkv, D] -> (out [Sq, Hq, Dv], lse [Hq, Sq]).
    FlashAttention's rules: query i sits at key position i + Sk - Sq; rows that see no key give
    0 (and lse -inf)."""
    q, k, v = (torch.as_tensor(x).double() for x in (q, k, v))
    sq, hq, d = q.shape
    sk = k.shape[0]
    group = hq // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1 / math.sqrt(d) if scale is None else scale
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    row = torch.arange(sq)[:, None] + sk - sq
    col = torch.arange(sk)[None, :]
    if alibi is not None:
        s = s - torch.as_tensor(alibi).double()[:, None, None] * (row - col).abs()
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        ok &= col <= row
    if window[0] >= 0:
        ok &= col >= row - window[0]
    if window[1] >= 0:
        ok &= col <= row + window[1]
    s = s.masked_fill(~ok, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hij,jhd->ihd", p, v), lse


def ref_varlen(q, k, v, cu_q, cu_k, *, alibi=None, **kw):
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        o, lse = ref_attention(
            q[rows], k[keys], v[keys], alibi=None if alibi is None else alibi[b], **kw
        )
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def close(got, want, atol=2e-5, what=""):
    got = torch.as_tensor(np.asarray(got) if not isinstance(got, torch.Tensor) else got).double()
    want = want.double()
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)), f"{what}: -inf rows differ"
    err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    assert err <= atol, f"{what}: max error {err:.3g} > {atol}"


def random_lengths(rng, batch, max_len, *, zero_ok=True):
    """FlashAttention's random padding mask, as lengths: each row keeps a random prefix."""
    low = 0 if zero_ok else 1
    return rng.integers(low, max_len + 1, size=batch)


def cu(lengths, dtype=torch.int32):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=dtype)


# ------------------------------------------------------------------ attention_varlen
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"causal": True},
        {"causal": True, "window": (5, 0)},
        {"window": (7, 3), "softcap": 4.0},
        {"alibi": True, "causal": True},
    ],
    ids=["full", "causal", "causal-window", "window-softcap", "alibi"],
)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_varlen_matches_per_sequence_reference(backend, opts, hq, hkv):
    rng = np.random.default_rng(0)
    batch = 5
    lq = random_lengths(rng, batch, 40)
    lk = random_lengths(rng, batch, 70)
    lq[1], lk[1] = 0, 0  # an empty sequence
    lq[2], lk[2] = 3, 0  # queries with no key: zeros, lse -inf
    lq[3], lk[3] = 50, 9  # more queries than keys: bottom-right leaves early rows empty
    cu_q, cu_k = cu(lq), cu(lk, torch.int64)
    q = torch.randn(int(cu_q[-1]), hq, 32)
    k = torch.randn(int(cu_k[-1]), hkv, 32)
    v = torch.randn(int(cu_k[-1]), hkv, 24)
    kw = dict(opts)
    alibi = torch.rand(batch, hq) if kw.pop("alibi", False) else None
    out, lse = fastpe.attention_varlen(
        q, k, v, cu_q, cu_k, alibi_slopes=alibi, return_lse=True, backend=backend, **kw
    )
    want, want_lse = ref_varlen(q, k, v, cu_q, cu_k, alibi=alibi, **kw)
    assert out.shape == (int(cu_q[-1]), hq, 24) and lse.shape == (hq, int(cu_q[-1]))
    close(out, want, what="out")
    close(lse, want_lse, what="lse")


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_sinks_and_rope_per_sequence(backend):
    """Fused RoPE restarts at each sequence (keys 0 … L-1, queries at their aligned position);
    a sink is one extra logit per head: the same as a zero-value key of that score."""
    lq, lk = np.array([4, 6, 1]), np.array([9, 6, 5])
    cu_q, cu_k = cu(lq), cu(lk)
    q, k, v = torch.randn(11, 2, 16), torch.randn(20, 2, 16), torch.randn(20, 2, 16)
    angles = torch.arange(32.0)[:, None] * 10000.0 ** (-torch.arange(8.0) / 8)
    cos, sin = torch.cos(angles), torch.sin(angles)
    sinks = torch.tensor([0.5, -1.0])
    out = fastpe.attention_varlen(
        q,
        k,
        v,
        cu_q,
        cu_k,
        causal=True,
        rope={"cos": cos, "sin": sin},
        sinks=sinks,
        backend=backend,
    )

    def rotate(x, pos):  # rotate_half convention, written out
        c, s = cos[pos][:, None], sin[pos][:, None]
        a, b = x[..., :8], x[..., 8:]
        return torch.cat([a * c - b * s, b * c + a * s], -1)

    for b in range(3):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        qb = rotate(q[rows], torch.arange(lq[b]) + lk[b] - lq[b])
        kb = rotate(k[keys], torch.arange(lk[b]))
        # the sink joins the softmax denominator only
        o, lse = ref_attention(qb, kb, v[keys], causal=True)
        total = torch.logaddexp(lse, sinks.double()[:, None])
        want = o * torch.exp(lse - total).T[..., None]
        close(out[rows], want, what=f"sequence {b}")


def test_varlen_lse_layout_is_heads_by_tokens():
    q = torch.randn(7, 3, 8)
    out, lse = fastpe.attention_varlen(q, q, q, cu([3, 4]), cu([3, 4]), return_lse=True)
    assert lse.shape == (3, 7) and lse.dtype == torch.float32


@pytest.mark.parametrize("backend", ["numba", "triton"])
def test_varlen_half_precision(backend):
    lq = np.array([5, 17, 1])
    cu_q = cu(lq)
    q, k, v = (torch.randn(23, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    out = fastpe.attention_varlen(q, k, v, cu_q, cu_q, causal=True, backend=backend)
    want, _ = ref_varlen(q.double(), k.double(), v.double(), cu_q, cu_q, causal=True)
    assert out.dtype == torch.bfloat16
    close(out, want, atol=2e-2)


# FlashAttention's seqlen grid (test_flash_attn_varlen_output and friends), ported
SEQLEN_PAIRS = [(113, 203), (1, 239), (97, 60)]
SEQLEN_PAIRS_SLOW = [
    (128, 217),
    (113, 211),
    (108, 256),
    (256, 512),
    (512, 256),
    (1023, 1024),
    (1024, 1023),
    (2048, 2048),
]


def _padding_grid_case(backend, seqlen_q, seqlen_k, causal, hkv):
    rng = np.random.default_rng(seqlen_q * 7919 + seqlen_k)
    batch, hq, d = 3, 4, 32
    # padded batch + random padding masks, unpadded into packed tensors + cu_seqlens
    qp, kp, vp = (
        torch.randn(batch, s, h, d) for s, h in ((seqlen_q, hq), (seqlen_k, hkv), (seqlen_k, hkv))
    )
    lq = random_lengths(rng, batch, seqlen_q, zero_ok=False)
    lk = random_lengths(rng, batch, seqlen_k, zero_ok=False)
    q_mask = torch.arange(seqlen_q)[None, :] < torch.as_tensor(lq)[:, None]
    k_mask = torch.arange(seqlen_k)[None, :] < torch.as_tensor(lk)[:, None]
    q, k, v = qp[q_mask], kp[k_mask], vp[k_mask]
    out = (
        flash_attn.flash_attn_varlen_func(
            q, k, v, cu(lq), cu(lk), int(lq.max()), int(lk.max()), causal=causal
        )
        if backend is None
        else fastpe.attention_varlen(q, k, v, cu(lq), cu(lk), causal=causal, backend=backend)
    )
    for b in range(batch):
        want, _ = ref_attention(qp[b, : lq[b]], kp[b, : lk[b]], vp[b, : lk[b]], causal=causal)
        close(out[int(cu(lq)[b]) : int(cu(lq)[b + 1])], want, what=f"sequence {b}")


@pytest.mark.parametrize("backend", [None, *BACKENDS])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLEN_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_varlen_grid(backend, seqlen_q, seqlen_k, causal):
    _padding_grid_case(backend, seqlen_q, seqlen_k, causal, hkv=2)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [None, "numba"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLEN_PAIRS_SLOW)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [4, 1])
def test_flash_attn_varlen_grid_full(backend, seqlen_q, seqlen_k, causal, hkv):
    _padding_grid_case(backend, seqlen_q, seqlen_k, causal, hkv)


# ------------------------------------------------------------------ flash_attn module
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 203), (1, 239), (64, 33)])
@pytest.mark.parametrize(
    "opts", [{}, {"causal": True}, {"window_size": (9, 4)}, {"softcap": 3.0, "causal": True}]
)
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_flash_attn_func(seqlen_q, seqlen_k, opts, hkv):
    q = torch.randn(2, seqlen_q, 4, 32)
    k, v = torch.randn(2, seqlen_k, hkv, 32), torch.randn(2, seqlen_k, hkv, 32)
    alibi = torch.rand(4)
    out = flash_attn.flash_attn_func(q, k, v, alibi_slopes=alibi, **opts)
    kw = {
        "causal": opts.get("causal", False),
        "window": opts.get("window_size", (-1, -1)),
        "softcap": opts.get("softcap", 0.0),
        "alibi": alibi,
    }
    assert out.shape == q.shape and out.is_contiguous()
    for b in range(2):
        close(out[b], ref_attention(q[b], k[b], v[b], **kw)[0])


def test_flash_attn_packed_variants():
    qkv = torch.randn(2, 30, 3, 4, 16)
    want = flash_attn.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    close(flash_attn.flash_attn_qkvpacked_func(qkv, causal=True), want.double(), atol=0)
    close(
        flash_attn.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], causal=True),
        want.double(),
        atol=0,
    )
    packed = qkv.reshape(60, 3, 4, 16)
    cu_s = cu([30, 30])
    close(
        flash_attn.flash_attn_varlen_qkvpacked_func(packed, cu_s, 30, causal=True),
        want.reshape(60, 4, 16).double(),
        atol=1e-6,
    )
    close(
        flash_attn.flash_attn_varlen_kvpacked_func(
            packed[:, 0], packed[:, 1:], cu_s, cu_s, 30, 30, causal=True
        ),
        want.reshape(60, 4, 16).double(),
        atol=1e-6,
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"dropout_p": 0.1}, "dropout_p must be 0.0"),
        ({"return_attn_probs": True}, "return_attn_probs=True is not supported"),
        ({"softcap": -1.0}, "softcap must be"),
    ],
)
def test_flash_attn_refusals(kwargs, match):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=match):
        flash_attn.flash_attn_func(q, q, q, **kwargs)
    with pytest.raises(ValueError, match="block_table"):
        flash_attn.flash_attn_varlen_func(
            q[0],
            q[0],
            q[0],
            cu([4]),
            cu([4]),
            4,
            4,
            block_table=torch.zeros(1, 1, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="cache_leftpad"):
        flash_attn.flash_attn_with_kvcache(q, q, q, cache_seqlens=2, cache_leftpad=torch.zeros(1))


# ------------------------------------------------------------------ KV cache
def _rotate(x, cos, sin, pos, interleaved):
    """x [S, H, D] rotated at positions pos [S]."""
    c, s = cos[pos][:, None].double(), sin[pos][:, None].double()
    half = cos.shape[1]
    x = x.double().clone()
    if interleaved:
        a, b = x[..., 0 : 2 * half : 2].clone(), x[..., 1 : 2 * half : 2].clone()
        x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., :half].clone(), x[..., half : 2 * half].clone()
        x[..., :half], x[..., half : 2 * half] = a * c - b * s, b * c + a * s
    return x


def ref_kvcache(
    q, k_cache, v_cache, k, v, cache_seqlens, block_table, cos, sin, interleaved, causal, window
):
    """flash_attn_with_kvcache by hand: returns (out, k_cache', v_cache')."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    batch, sq = q.shape[:2]
    sn = 0 if k is None else k.shape[1]
    bs = k_cache.shape[1]
    outs = []
    for b in range(batch):
        c = int(cache_seqlens[b])
        qb = q[b].double()
        if k is not None:
            kb = k[b]
            if cos is not None:
                kb = _rotate(kb, cos, sin, torch.arange(c, c + sn), interleaved)
                qpos = (
                    torch.arange(c, c + sq)
                    if causal or window != (-1, -1)
                    else torch.full((sq,), c)
                )
                qb = _rotate(qb, cos, sin, qpos, interleaved)
            for i in range(sn):
                page, off = divmod(c + i, bs)
                blk = int(block_table[b, page]) if block_table is not None else b
                row = (blk, off) if block_table is not None else (b, c + i)
                k_cache[row] = kb[i].to(k_cache.dtype)
                v_cache[row] = v[b, i]
        n = c + sn
        idx = [
            (int(block_table[b, j // bs]), j % bs) if block_table is not None else (b, j)
            for j in range(n)
        ]
        keys = torch.stack([k_cache[r] for r in idx]) if n else k_cache[0, :0]
        vals = torch.stack([v_cache[r] for r in idx]) if n else v_cache[0, :0]
        outs.append(ref_attention(qb, keys, vals, causal=causal, window=window)[0])
    return torch.stack(outs), k_cache, v_cache


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (6, 0))])
@pytest.mark.parametrize(
    "new,rotary",
    [(0, None), (1, None), (1, False), (1, True), (3, None), (3, False), (3, True)],
    ids=[
        "read-only",
        "1-new",
        "1-new-rope",
        "1-new-rope-interleaved",
        "3-new",
        "3-new-rope",
        "3-new-rope-interleaved",
    ],
)  # rotary tables rotate the new keys: only with new k/v
def test_kvcache_matches_reference(backend, paged, rotary, causal, window, new):
    gen = torch.Generator().manual_seed(new)
    batch, sq, hq, hkv, d, bs = 3, max(new, 1), 4, 2, 16, 8
    cache_seqlens = torch.tensor([5, 0, 17], dtype=torch.int32)
    if paged:
        k_cache = torch.randn(10, bs, hkv, d, generator=gen)
        block_table = torch.tensor([[7, 2, 9], [4, -1, -1], [0, 5, 3]], dtype=torch.int32)
    else:
        k_cache = torch.randn(batch, 24, hkv, d, generator=gen)
        block_table = None
    v_cache = torch.randn(k_cache.shape, generator=gen)
    q = torch.randn(batch, sq, hq, d, generator=gen)
    k = torch.randn(batch, new, hkv, d, generator=gen) if new else None
    v = torch.randn(batch, new, hkv, d, generator=gen) if new else None
    cos = sin = None
    if rotary is not None:
        angles = torch.arange(40.0)[:, None] * 10000.0 ** (-torch.arange(6.0) / 6)
        cos, sin = torch.cos(angles), torch.sin(angles)
    kc, vc = k_cache.clone(), v_cache.clone()
    out = (
        flash_attn.flash_attn_with_kvcache(
            q,
            kc,
            vc,
            k,
            v,
            rotary_cos=cos,
            rotary_sin=sin,
            cache_seqlens=cache_seqlens,
            block_table=block_table,
            causal=causal,
            window_size=window,
            rotary_interleaved=bool(rotary),
        )
        if backend is None
        else fastpe.attention_kvcache(
            q,
            kc,
            vc,
            k,
            v,
            rotary_cos=cos,
            rotary_sin=sin,
            cache_seqlens=cache_seqlens,
            block_table=block_table,
            causal=causal,
            window=window,
            rotary_interleaved=bool(rotary),
            backend=backend,
        )
    )
    want, want_kc, want_vc = ref_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens,
        block_table,
        cos,
        sin,
        bool(rotary),
        causal,
        window,
    )
    close(out, want, what="out")
    # the cache changed exactly at the appended positions, to the (rotated) new keys
    close(kc, want_kc.double(), atol=1e-6, what="k_cache")
    assert torch.equal(vc, want_vc)
    assert torch.equal(kc != k_cache, want_kc != k_cache)


def test_kvcache_flash_attn_entry_point_and_lse():
    q = torch.randn(2, 1, 4, 16)
    k_cache, v_cache = torch.randn(6, 16, 2, 16), torch.randn(6, 16, 2, 16)
    table = torch.tensor([[1, 4], [3, 0]], dtype=torch.int32)
    out, lse = flash_attn.flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=torch.tensor([20, 9], dtype=torch.int32),
        block_table=table,
        causal=True,
        return_softmax_lse=True,
    )
    assert lse.shape == (2, 4, 1)
    for b, n in enumerate([20, 9]):
        keys = torch.cat([k_cache[int(table[b, 0])], k_cache[int(table[b, 1])]])[:n]
        vals = torch.cat([v_cache[int(table[b, 0])], v_cache[int(table[b, 1])]])[:n]
        want, want_lse = ref_attention(q[b], keys, vals, causal=True)
        close(out[b], want)
        close(lse[b], want_lse)


def test_kvcache_long_cache_splits_keys(monkeypatch):
    """A decode step over a long cache splits the keys across threads (numba) and merges."""
    from fastpe.kernels.numba import attention_paged

    # this call is small enough to run serially, unsplit: force the parallel path
    monkeypatch.setattr(attention_paged, "SERIAL_WORK", -1)
    q = torch.randn(1, 1, 8, 64)
    k_cache, v_cache = torch.randn(40, 64, 2, 64), torch.randn(40, 64, 2, 64)
    table = torch.randperm(40)[None].to(torch.int32)
    out = fastpe.attention_kvcache(
        q, k_cache, v_cache, cache_seqlens=2500, block_table=table, backend="numba"
    )
    keys = k_cache[table[0].long()].reshape(-1, 2, 64)[:2500]
    vals = v_cache[table[0].long()].reshape(-1, 2, 64)[:2500]
    close(out[0], ref_attention(q[0], keys, vals)[0])


# ------------------------------------------------------------------ bad input
def _varlen_call(**over):
    q = torch.randn(6, 2, 8)
    args = {"q": q, "k": q, "v": q, "cu_seqlens_q": cu([2, 4]), "cu_seqlens_k": cu([2, 4])}
    args.update(over)
    return fastpe.attention_varlen(**args)


@pytest.mark.parametrize(
    "over,error,match",
    [
        (
            {"cu_seqlens_q": torch.tensor([1, 2, 6], dtype=torch.int32)},
            ValueError,
            "must start at 0",
        ),
        (
            {"cu_seqlens_q": torch.tensor([0, 4, 3, 6], dtype=torch.int32)},
            ValueError,
            "non-decreasing",
        ),
        (
            {"cu_seqlens_q": torch.tensor([0, 2, 5], dtype=torch.int32)},
            ValueError,
            "end at the packed length 6",
        ),
        ({"cu_seqlens_k": torch.tensor([0, 6], dtype=torch.int32)}, ValueError, "B \\+ 1 entries"),
        ({"cu_seqlens_q": torch.tensor([0.0, 2.0, 6.0])}, TypeError, "integer dtype"),
        ({"cu_seqlens_q": torch.tensor([0, 2, 6], dtype=torch.int16)}, TypeError, "int32 or int64"),
        ({"max_seqlen_q": 3}, ValueError, "max_seqlen_q = 3 is smaller than the longest"),
        (
            {"k": torch.randn(6, 4, 8), "v": torch.randn(6, 4, 8)},
            ValueError,
            "multiple of k/v heads",
        ),
        ({"v": torch.randn(6, 2, 8, dtype=torch.float64)}, TypeError, "share one dtype"),
        ({"alibi_slopes": torch.rand(3)}, ValueError, "alibi_slopes must have shape"),
    ],
)
def test_varlen_bad_input(over, error, match):
    with pytest.raises(error, match=match):
        _varlen_call(**over)


def _kv_call(**over):
    args = {
        "q": torch.randn(2, 1, 4, 8),
        "k_cache": torch.zeros(4, 4, 2, 8),
        "v_cache": torch.zeros(4, 4, 2, 8),
        "k": torch.randn(2, 1, 2, 8),
        "v": torch.randn(2, 1, 2, 8),
        "cache_seqlens": torch.tensor([3, 2], dtype=torch.int32),
        "block_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
    }
    args.update(over)
    return fastpe.attention_kvcache(**args)


@pytest.mark.parametrize(
    "over,error,match",
    [
        (
            {
                "block_table": torch.tensor([[0, 1], [2, 4]], dtype=torch.int32),
                "cache_seqlens": torch.tensor([3, 6], dtype=torch.int32),
            },
            IndexError,
            "block_table contains 4 at index \\[1, 1\\], outside \\[0, 4\\)",
        ),
        (
            {"block_table": torch.tensor([[0, 1], [-1, 3]], dtype=torch.int32)},
            IndexError,
            "block_table contains -1",
        ),
        (
            {"cache_seqlens": torch.tensor([8, 2], dtype=torch.int32)},
            ValueError,
            "plus 1 new tokens needs 9 cache positions; the cache holds 8",
        ),
        ({"cache_seqlens": torch.tensor([-1, 2], dtype=torch.int32)}, ValueError, ">= 0"),
        (
            {
                "block_table": torch.tensor([[0, 1], [0, 3]], dtype=torch.int32),
                "cache_seqlens": torch.tensor([2, 3], dtype=torch.int32),
            },
            ValueError,
            "block_table block 0 receives new tokens",
        ),
        ({"k_cache": torch.zeros(4, 4, 2, 8, dtype=torch.float64)}, TypeError, "share one dtype"),
        ({"k": None}, ValueError, "k and v .* must be given together"),
        (
            {"rotary_cos": torch.ones(3, 4), "rotary_sin": torch.ones(3, 4)},
            IndexError,
            "rotary_cos/rotary_sin have 3 rows; positions up to 3",
        ),
        ({"cache_batch_idx": torch.tensor([0, 1])}, ValueError, "cache_batch_idx selects rows"),
    ],
)
def test_kvcache_bad_input(over, error, match):
    k_cache = over.get("k_cache", torch.zeros(4, 4, 2, 8))
    over.setdefault("k_cache", k_cache)
    with pytest.raises(error, match=match):
        _kv_call(**over)
    assert not k_cache.any(), "a refused call must not write the cache"


def test_kvcache_contiguous_duplicate_rows_refused_when_appending():
    with pytest.raises(ValueError, match="cache row \\(cache_batch_idx\\) 1 receives new tokens"):
        _kv_call(
            block_table=None,
            k_cache=torch.zeros(3, 8, 2, 8),
            v_cache=torch.zeros(3, 8, 2, 8),
            cache_batch_idx=torch.tensor([1, 1]),
        )


def test_kvcache_read_only_numpy_cache_refused_when_appending():
    cache = np.zeros((4, 4, 2, 8), np.float32)
    cache.flags.writeable = False
    with pytest.raises(ValueError, match="writes into k_cache; got a read-only array"):
        fastpe.attention_kvcache(
            np.zeros((2, 1, 4, 8), np.float32),
            cache,
            np.zeros_like(cache),
            np.zeros((2, 1, 2, 8), np.float32),
            np.zeros((2, 1, 2, 8), np.float32),
            cache_seqlens=1,
            block_table=np.array([[0, 1], [2, 3]]),
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "lq,lk,hq,hkv",
    [([40], [700], 1, 1), ([1, 1, 2], [900, 5, 300], 8, 2)],
    ids=["prefill-split", "decode-split"],
)
def test_varlen_long_keys_with_every_option(backend, lq, lk, hq, hkv, monkeypatch):
    """Few work items over long keys: the Numba kernel splits the keys across threads and
    merges the parts (thin decode tiles and BLAS tiles alike); ALiBi's lse correction and the
    sink must survive the merge."""
    from fastpe.kernels.numba import attention_paged

    # the decode case is small enough to run serially, unsplit: force the parallel path
    monkeypatch.setattr(attention_paged, "SERIAL_WORK", -1)
    torch.manual_seed(3)
    cu_q, cu_k = cu(lq), cu(lk)
    q = torch.randn(int(cu_q[-1]), hq, 32)
    k, v = torch.randn(int(cu_k[-1]), hkv, 32), torch.randn(int(cu_k[-1]), hkv, 32)
    alibi, sinks = torch.rand(len(lq), hq) * 0.1, torch.randn(hq)
    out, lse = fastpe.attention_varlen(
        q,
        k,
        v,
        cu_q,
        cu_k,
        causal=True,
        window=(600, 0),
        softcap=6.0,
        alibi_slopes=alibi,
        sinks=sinks,
        return_lse=True,
        backend=backend,
    )
    want, want_lse = ref_varlen(
        q, k, v, cu_q, cu_k, causal=True, window=(600, 0), softcap=6.0, alibi=alibi
    )
    total = torch.logaddexp(want_lse, sinks.double()[:, None])
    close(out, want * torch.exp(want_lse - total).T[..., None], what="out")
    close(lse, total, what="lse")


@pytest.mark.parametrize("backend", BACKENDS)
def test_kvcache_bfloat16_stores_rounded_rotated_keys(backend):
    """Half caches: the new keys are rotated, rounded to the cache's dtype and stored; the
    attention reads them back from the cache."""
    torch.manual_seed(5)
    q = torch.randn(2, 1, 4, 16, dtype=torch.bfloat16)
    k_cache = torch.randn(4, 8, 2, 16, dtype=torch.bfloat16)
    v_cache = torch.randn(4, 8, 2, 16, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 1, 2, 16, dtype=torch.bfloat16) for _ in range(2))
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    lengths = torch.tensor([9, 3], dtype=torch.int32)
    angles = torch.arange(16.0)[:, None] * 10000.0 ** (-torch.arange(8.0) / 8)
    cos, sin = torch.cos(angles), torch.sin(angles)
    kc, vc = k_cache.clone(), v_cache.clone()
    out = fastpe.attention_kvcache(
        q,
        kc,
        vc,
        k,
        v,
        cache_seqlens=lengths,
        block_table=table,
        rotary_cos=cos,
        rotary_sin=sin,
        causal=True,
        backend=backend,
    )
    want, want_kc, want_vc = ref_kvcache(
        q, k_cache, v_cache, k, v, lengths, table, cos, sin, False, True, (-1, -1)
    )
    assert out.dtype == torch.bfloat16
    close(out, want, atol=2e-2)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)


@pytest.mark.parametrize("serial", [True, False], ids=["serial", "parallel"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize(
    "hq,hkv,sq,page",
    [(16, 1, 1, 24), (8, 2, 3, 7), (4, 2, 1, 16)],
    ids=["rows16", "rows12", "rows2"],
)
def test_kvcache_decode_tiles_read_pages_in_place(hq, hkv, sq, page, dtype, serial, monkeypatch):
    """Decode tiles (at most 16 rows: query heads of a kv head times positions) read the cache
    rows through the page table in place, in runs of at most 16 rows within a page (pages of 7
    and 24 rows give runs that are neither whole nor multiples of 4), bfloat16 bits widened as
    read, float16 bits widened once per run;
    small calls run on the calling thread, larger ones in parallel with the keys split across
    threads and merged. Every path must match the float64 reference with ragged lengths,
    window, soft-cap, ALiBi and sinks."""
    from fastpe.kernels.numba import attention_paged

    direct = attention_paged._attention_paged_direct_numba
    calls = []
    twin = direct.serial
    monkeypatch.setattr(direct, "serial", lambda *a: calls.append(1) or twin(*a))
    monkeypatch.setattr(attention_paged, "SERIAL_WORK", 1 << 40 if serial else -1)
    gen = torch.Generator().manual_seed(hq + sq + page)
    dt = getattr(torch, dtype)
    lengths = [0, 300, 61]  # 300 keys: two key tiles, split in two on 2+ threads
    pages = [-(-n // page) for n in lengths]
    table = torch.full((3, max(pages)), -1, dtype=torch.int32)  # unused entries are never read
    perm = torch.randperm(sum(pages), generator=gen).to(torch.int32)
    for b, start in enumerate(np.cumsum([0, *pages[:-1]])):
        table[b, : pages[b]] = perm[start : start + pages[b]]
    k_cache = torch.randn(sum(pages), page, hkv, 32, generator=gen).to(dt)
    v_cache = torch.randn(sum(pages), page, hkv, 32, generator=gen).to(dt)
    q = torch.randn(3, sq, hq, 32, generator=gen).to(dt)
    alibi, sinks = torch.rand(3, hq, generator=gen) * 0.05, torch.randn(hq, generator=gen)
    kw = {"causal": True, "window": (200, 0), "softcap": 5.0}
    out, lse = fastpe.attention_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
        block_table=table,
        alibi_slopes=alibi,
        sinks=sinks,
        return_lse=True,
        backend="numba",
        **kw,
    )
    assert calls if serial else not calls
    for b, n in enumerate(lengths):
        keys = k_cache[table[b, : pages[b]].long()].reshape(-1, hkv, 32)[:n]
        vals = v_cache[table[b, : pages[b]].long()].reshape(-1, hkv, 32)[:n]
        want, want_lse = ref_attention(q[b], keys, vals, alibi=alibi[b], **kw)
        total = torch.logaddexp(want_lse, sinks.double()[:, None])
        want = want * torch.exp(want_lse - total).T[..., None]
        atol = 2e-5 if dtype == "float32" else 1e-2  # half types: the output's rounding
        close(out[b], want, atol=atol, what=f"out {b}")
        close(lse[b], total, atol=2e-5, what=f"lse {b}")
