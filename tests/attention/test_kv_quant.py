"""Quantized KV caches (float8_e4m3fn with per-head scales, int8 with per-token scales) in
attention_kvcache on every backend, against a float64 computation on the cache dequantized by
torch (``cache.to(float64) * scale``), the appended rows against torch's own quantization of the
same rows, and the errors for bad combinations (docs/math.md#quantized-kv-caches)."""

from __future__ import annotations

import math

import pytest

import fastpe
from fastpe import flash_attn

torch = pytest.importorskip("torch")

HQ, HKV, D, BLOCK = 4, 2, 16, 4
LENGTHS = [5, 0, 9]  # tokens already cached per sequence


def _rotate(x, cos, sin, pos):
    """x [S, H, D] float64 rotated at positions pos (non-interleaved halves of cos' width)."""
    half = cos.shape[1]
    c, s = cos[pos][:, None].double(), sin[pos][:, None].double()
    x = x.double().clone()
    a, b = x[..., :half].clone(), x[..., half : 2 * half].clone()
    x[..., :half], x[..., half : 2 * half] = a * c - b * s, b * c + a * s
    return x


def _quantize(kind, x, scale=None):
    """torch's quantization of rows x [n, H, D] (float32): (stored, scale [n, H] or None)."""
    if kind == "fp8":
        return (x / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn), None
    amax = x.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(x / scale[..., None]).to(torch.int8), scale


def _make_cache(kind, paged, gen):
    """(k_cache, v_cache, k_scale, v_scale, block_table) filled with quantized random rows."""
    shape = (12, BLOCK, HKV, D) if paged else (3, 20, HKV, D)
    caches, scales = [], []
    for _ in range(2):
        x = torch.randn(shape, generator=gen) * 3
        if kind == "fp8":
            scale = torch.tensor([0.02, 0.5])  # one per kv head
            stored, _ = _quantize(
                kind, x.reshape(-1, HKV, D), scale.expand(x[..., 0].numel() // HKV, HKV)
            )
        else:
            stored, scale = _quantize(kind, x.reshape(-1, HKV, D))
            scale = scale.reshape(shape[:3])
        caches.append(stored.reshape(shape))
        scales.append(scale)
    table = torch.tensor(
        [[3, 0, 7, 10, -1], [5, 1, 11, -1, -1], [6, 2, 4, 8, 9]], dtype=torch.int32
    )
    return (*caches, *scales, table if paged else None)


def _rows(paged, table, b, positions):
    """(block, offset) index tensors of sequence b's cache positions."""
    positions = torch.as_tensor(positions, dtype=torch.long)
    if paged:
        return table[b, positions // BLOCK].long(), positions % BLOCK
    return torch.full_like(positions, b), positions


def _attend(q, k, v, *, dtype, causal=False, window=None, softcap=None, alibi=None, sinks=None):
    """One sequence, q [Sq, Hq, D] against k, v [L, Hkv, D] (dequantized), in ``dtype``: float64
    (the reference) or a half dtype (a plain torch computation: q·kᵀ and p·v in it, the softmax
    in float64 on its scores). Returns float64 [Sq, Hq, D]."""
    sq, hq, d = q.shape
    length, hkv = k.shape[:2]
    k, v = (x.to(dtype).repeat_interleave(hq // hkv, 1) for x in (k, v))
    s = torch.einsum("ihd,jhd->hij", q.to(dtype), k).double() / math.sqrt(d)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(sq)[:, None] + length - sq
    col = torch.arange(length)[None, :]
    if alibi is not None:
        s = s - alibi.double()[:, None, None] * (pos - col).abs()
    ok = torch.ones(sq, length, dtype=torch.bool)
    if causal:
        ok &= col <= pos
    if window is not None:
        ok &= (col >= pos - window[0]) & (col <= pos + window[1])
    s = s.masked_fill(~ok, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(hq, sq, 1)], -1)
    # a row that sees no key (and no sink) weighs nothing; a NaN query stays NaN
    unseen = ~ok.any(-1) if sinks is None else torch.zeros(sq, dtype=torch.bool)
    p = torch.softmax(s, -1).masked_fill(unseen[:, None], 0.0)[..., :length]
    return torch.einsum("hij,jhd->ihd", p.to(dtype), v).double()


CASES = {
    # several new tokens (9 x 2 query heads per kv head: the Numba tile path), fused rotary on
    # append, causal window, softcap
    "prefill-rope-window-softcap": dict(
        new=9, sq=9, rope=True, causal=True, window=(4, 0), softcap=5.0
    ),
    # one new token (the decode path), sinks and ALiBi; appended rows compared bit for bit
    "decode-sinks-alibi": dict(new=1, sq=1, alibi=True, sinks=True),
    "read-only-sinks-alibi": dict(new=0, sq=1, alibi=True, sinks=True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["numpy", "numba", "triton"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_quantized_cache(kind, paged, backend, case):
    opts = CASES[case]
    new, sq = opts["new"], opts["sq"]
    gen = torch.Generator().manual_seed(len(case) + new)
    k_cache, v_cache, k_scale, v_scale, table = _make_cache(kind, paged, gen)
    batch = len(LENGTHS)
    q = torch.randn(batch, sq, HQ, D, generator=gen)
    k = torch.randn(batch, new, HKV, D, generator=gen) * 2 if new else None
    v = torch.randn(batch, new, HKV, D, generator=gen) * 2 if new else None
    cos = sin = None
    if opts.get("rope"):
        angles = torch.arange(40.0)[:, None] * 10000.0 ** (-torch.arange(8.0) / 8)
        cos, sin = torch.cos(angles), torch.sin(angles)
    alibi = torch.tensor([0.3, 0.1, 0.05, 0.2]) if opts.get("alibi") else None
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0]) if opts.get("sinks") else None
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    if kind == "fp8" and opts.get("alibi"):
        k_scale = torch.tensor([[0.02, 0.5], [0.03, 0.4], [0.05, 0.6]])  # FA3's [B, Hkv] form
    kc, vc, ksc, vsc = (x.clone() for x in (k_cache, v_cache, k_scale, v_scale))
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
        causal=opts.get("causal", False),
        window=opts.get("window"),
        softcap=opts.get("softcap"),
        alibi_slopes=alibi,
        sinks=sinks,
        k_scale=ksc,
        v_scale=vsc,
        backend=backend,
    )

    # the expected caches: torch's quantization of the (rotated) new rows at their positions
    want = [x.clone() for x in (k_cache, v_cache, k_scale, v_scale)]
    written = torch.zeros(k_cache.shape[:3], dtype=torch.bool)
    expected = []
    for b in range(batch):
        c = LENGTHS[b]
        qb = q[b].double()
        if new:
            kb = k[b].double()
            if cos is not None:
                kb = _rotate(kb, cos, sin, torch.arange(c, c + new))
                qb = _rotate(qb, cos, sin, torch.arange(c, c + sq))
            blk, off = _rows(paged, table, b, range(c, c + new))
            written[blk, off] = True
            for cache, scale, rows in ((want[0], want[2], kb), (want[1], want[3], v[b])):
                fp8_scale = scale[b] if scale.dim() == 2 else scale
                row_scale = fp8_scale.expand(new, HKV) if kind == "fp8" else None
                stored, new_scale = _quantize(kind, rows.float(), row_scale)
                cache[blk, off] = stored
                if kind == "int8":
                    scale[blk, off] = new_scale
        blk, off = _rows(paged, table, b, range(c + new))
        deq = []
        for cache, scale in ((want[0], want[2]), (want[1], want[3])):
            if kind == "fp8":
                factor = (scale[b] if scale.dim() == 2 else scale)[None, :, None]
            else:
                factor = scale[blk, off][..., None]
            deq.append(cache[blk, off].to(torch.float64) * factor)
        expected.append(
            _attend(
                qb,
                *deq,
                dtype=torch.float64,
                causal=opts.get("causal", False),
                window=opts.get("window"),
                softcap=opts.get("softcap"),
                alibi=alibi,
                sinks=sinks,
            )
        )
    expected = torch.stack(expected)
    # the float32 rule (docs/dtypes-and-errors.md#accuracy-the-tests-hold), on the dequantized cache
    err = (out.double() - expected).abs().max().item()
    assert err <= 2e-5 * max(1.0, expected.abs().max().item()), err

    # appended rows: torch's quantization of the same rows; every other row untouched
    got = [kc, vc]
    for i, (cache, ref) in enumerate(zip(got, want[:2], strict=True)):
        as_int = (lambda x: x.view(torch.uint8)) if kind == "fp8" else (lambda x: x)
        assert torch.equal(as_int(cache)[~written], as_int(ref)[~written])
        if cos is None or i == 1:  # no rotation (values are never rotated): bit for bit
            assert torch.equal(as_int(cache), as_int(ref))
        else:  # keys rotated in each backend's float32 (or float64): within one quantum
            g, w = cache.to(torch.float64)[written], ref.to(torch.float64)[written]
            assert ((g - w).abs() <= torch.maximum(g.abs(), w.abs()) / 8 + 1).all()
    if kind == "int8":
        for scale, ref in ((ksc, want[2]), (vsc, want[3])):
            assert torch.equal(scale[~written], ref[~written])
            torch.testing.assert_close(scale, ref, rtol=1e-6, atol=0)
    else:
        assert torch.equal(ksc, k_scale) and torch.equal(vsc, v_scale)


def test_int8_numpy_arrays_and_flash_attn_descale_names():
    """NumPy int8 caches (NumPy has no fp8) give the torch tensors' result; flash_attn takes
    FlashAttention 3's k_descale/v_descale for the fp8 scales."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, k_scale, v_scale, _ = _make_cache("int8", False, gen)
    q = torch.randn(3, 1, HQ, D, generator=gen)
    k, v = torch.randn(2, 3, 1, HKV, D, generator=gen)
    arrays = [x.numpy().copy() for x in (k_cache, v_cache, k_scale, v_scale)]
    tensors = [x.clone() for x in (k_cache, v_cache, k_scale, v_scale)]
    for caches, convert in ((arrays, lambda x: x.numpy()), (tensors, lambda x: x)):
        out = fastpe.attention_kvcache(
            convert(q),
            caches[0],
            caches[1],
            convert(k),
            convert(v),
            cache_seqlens=convert(torch.tensor(LENGTHS)),
            k_scale=caches[2],
            v_scale=caches[3],
            backend="numba",
        )
        caches.append(torch.as_tensor(out))
    for a, t in zip(arrays, tensors, strict=True):
        assert torch.equal(torch.as_tensor(a), t)

    k8, v8, ks, vs, table = _make_cache("fp8", True, gen)
    q = torch.randn(3, 1, HQ, D, generator=gen)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    call = dict(cache_seqlens=lengths, block_table=table)
    by_alias = flash_attn.flash_attn_with_kvcache(q, k8, v8, k_descale=ks, v_descale=vs, **call)
    by_name = fastpe.attention_kvcache(q, k8, v8, k_scale=ks, v_scale=vs, **call)
    assert torch.equal(by_alias, by_name)
    scalar = fastpe.attention_kvcache(q, k8, v8, k_scale=0.25, v_scale=0.5, **call)
    tensor = fastpe.attention_kvcache(
        q, k8, v8, k_scale=torch.full((HKV,), 0.25), v_scale=torch.full((HKV,), 0.5), **call
    )
    assert torch.equal(scalar, tensor)


def _bad_calls():
    q = torch.randn(1, 1, HQ, D)
    k8 = torch.zeros(2, BLOCK, HKV, D, dtype=torch.float8_e4m3fn)
    i8 = torch.zeros(2, BLOCK, HKV, D, dtype=torch.int8)
    s8 = torch.ones(2, BLOCK, HKV)
    ones = torch.ones(HKV)
    return [
        (dict(k_cache=i8, v_cache=i8), ValueError, "needs k_scale"),
        (
            dict(k_cache=k8, v_cache=k8, k_scale=torch.ones(3), v_scale=ones),
            ValueError,
            "k_scale of a float8",
        ),
        (
            dict(k_cache=k8, v_cache=k8, k_scale=0.0, v_scale=ones),
            ValueError,
            "k_scale must be finite and > 0",
        ),
        (
            dict(k_cache=k8, v_cache=k8, k_scale=ones, v_scale=torch.tensor([1.0, math.inf])),
            ValueError,
            "v_scale must be finite",
        ),
        (
            dict(k_cache=k8, v_cache=k8, k_scale=ones.double(), v_scale=ones),
            TypeError,
            "k_scale must be float32",
        ),
        (dict(k_cache=k8, v_cache=i8, k_scale=ones, v_scale=s8), TypeError, "quantized alike"),
        (
            dict(k_cache=i8, v_cache=i8, k_scale=s8[:, :2], v_scale=s8),
            ValueError,
            "k_scale of an int8",
        ),
        (dict(k_cache=i8, v_cache=i8, k_scale=1.0, v_scale=s8), TypeError, "k_scale of an int8"),
        (
            dict(q=q.double(), k_cache=k8, v_cache=k8, k_scale=ones, v_scale=ones),
            TypeError,
            "q must be one of",
        ),
        (
            dict(
                k_cache=torch.zeros(2, BLOCK, HKV, D),
                v_cache=torch.zeros(2, BLOCK, HKV, D),
                k_scale=ones,
            ),
            ValueError,
            "k_scale is for quantized",
        ),
        (
            dict(
                k_cache=k8.view(torch.uint8).numpy(),
                v_cache=k8.view(torch.uint8).numpy(),
                q=q.numpy(),
            ),
            TypeError,
            "k_cache is a uint8 NumPy",
        ),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_quantized_calls_name_the_argument(index):
    kwargs, error, match = _bad_calls()[index]
    q = kwargs.pop("q", torch.randn(1, 1, HQ, D))
    k_cache, v_cache = kwargs.pop("k_cache"), kwargs.pop("v_cache")
    with pytest.raises(error, match=match):
        fastpe.attention_kvcache(q, k_cache, v_cache, cache_seqlens=3, **kwargs)
    with pytest.raises(ValueError, match="not both"):
        flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_scale=1.0, k_descale=1.0)


def test_bfloat16_queries_on_an_fp8_cache_hold_the_half_precision_rule():
    """q bfloat16 (the benchmarked decode): out within twice the error of a plain bfloat16
    computation on the same dequantized cache (+1e-6), both against float64."""
    gen = torch.Generator().manual_seed(3)
    k8, v8, ks, vs, table = _make_cache("fp8", True, gen)
    q = torch.randn(3, 1, HQ, D, generator=gen).to(torch.bfloat16)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32) + 3
    out = fastpe.attention_kvcache(
        q, k8, v8, cache_seqlens=lengths, block_table=table, k_scale=ks, v_scale=vs, backend="numba"
    )
    assert out.dtype == torch.bfloat16
    errors = {"fastpe": 0.0, "plain bfloat16": 0.0}
    for b in range(3):
        blk, off = _rows(True, table, b, range(int(lengths[b])))
        keys = k8[blk, off].to(torch.float64) * ks[None, :, None]
        values = v8[blk, off].to(torch.float64) * vs[None, :, None]
        want = _attend(q[b], keys, values, dtype=torch.float64)
        plain = _attend(q[b], keys, values, dtype=torch.bfloat16)
        errors["fastpe"] = max(errors["fastpe"], (out[b].double() - want).abs().max().item())
        errors["plain bfloat16"] = max(
            errors["plain bfloat16"], (plain.double() - want).abs().max().item()
        )
    assert errors["fastpe"] <= 2 * errors["plain bfloat16"] + 1e-6, errors


def test_every_fp8_bit_pattern_widens_to_torchs_value():
    """The Numba kernels' float8_e4m3fn widening (through F16C where the CPU has it, and the
    integer steps for CPUs without) against torch's conversion, for all 256 bit patterns: the
    same float32 bits, NaN for both NaN patterns with their sign."""
    pytest.importorskip("numba")
    import numpy as np
    from fastpe.kernels.numba._half import _e4m3_to_float32, _e4m3_to_float32_integer
    from numba import njit

    @njit
    def widen(bits, fast, integer):
        for i in range(bits.size):
            fast[i] = _e4m3_to_float32(bits[i])
            integer[i] = _e4m3_to_float32_integer(bits[i])

    bits = np.arange(256, dtype=np.uint8)
    fast, integer = np.empty(256, np.float32), np.empty(256, np.float32)
    widen(bits, fast, integer)
    want = torch.from_numpy(bits).view(torch.float8_e4m3fn).float().numpy()
    nan = np.isnan(want)
    assert nan.sum() == 2
    for got in (fast, integer):
        assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
        assert np.isnan(got[nan]).all()
        assert np.array_equal(np.signbit(got[nan]), np.signbit(want[nan]))


@pytest.mark.parametrize("kind", ["bf16", "fp8", "int8"])
def test_decode_row_blocks_and_fp8_nan_patterns(kind):
    """The Numba decode loops on a paged cache with 6 query heads per kv head (a block of four
    query rows and two left over) and runs of 4, 3 and 1 keys (whole and partial key blocks),
    against float64 attention on the dequantized cache; for fp8, a NaN pattern in one key of
    sequence 1 and in one value element of sequence 2 gives NaN where float64 gives NaN (that
    kv head's rows; that value column) and leaves the rest exact."""
    hq, hkv, d, block = 12, 2, 16, 4
    gen = torch.Generator().manual_seed(7)
    lengths = [5, 7, 9]
    x = torch.randn(2, 8, block, hkv, d, generator=gen)
    if kind == "bf16":
        caches = [t.bfloat16() for t in x]
        scales = [None, None]
        deq = [t.double() for t in caches]
    elif kind == "fp8":
        scales = [torch.tensor([0.01, 0.02]), torch.tensor([0.02, 0.01])]
        caches = [
            (t / s[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
            for t, s in zip(x, scales, strict=True)
        ]
        bits = [c.view(torch.uint8) for c in caches]
        bits[0][5, 2, 1, 3] = 0x7F  # sequence 1 (block 5), key 6, kv head 1
        bits[1][7, 0, 0, 9] = 0xFF  # sequence 2 (block 7), value 8, kv head 0, column 9
        deq = [c.double() * s.double()[:, None] for c, s in zip(caches, scales, strict=True)]
    else:
        scales = [t.abs().amax(-1) / 127 for t in x]
        caches = [
            torch.round(t / s[..., None]).to(torch.int8) for t, s in zip(x, scales, strict=True)
        ]
        deq = [c.double() * s.double()[..., None] for c, s in zip(caches, scales, strict=True)]
    table = torch.tensor([[0, 3, -1], [1, 5, -1], [6, 2, 7]], dtype=torch.int32)
    q = torch.randn(3, 1, hq, d, generator=gen)
    q = q.bfloat16() if kind == "bf16" else q
    out = fastpe.attention_kvcache(
        q,
        *caches,
        cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
        block_table=table,
        k_scale=scales[0],
        v_scale=scales[1],
        backend="numba",
    )
    group = hq // hkv
    for b, length in enumerate(lengths):
        blocks = table[b, : -(-length // block)].long()
        k, v = (t[blocks].reshape(-1, hkv, d)[:length] for t in deq)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("hd,jhd->hj", q[b, 0].double(), k) / math.sqrt(d)
        want = torch.einsum("hj,jhd->hd", torch.softmax(s, -1), v)
        got = out[b, 0].double()
        assert torch.equal(got.isnan(), want.isnan()), b
        if kind == "fp8" and b:
            assert want.isnan().any()
        ok = ~want.isnan()
        tol = 1e-2 * max(1.0, want[ok].abs().max().item()) if kind == "bf16" else 2e-5
        assert (got[ok] - want[ok]).abs().max().item() <= tol


PAIR_DECODE = {
    # 6 query heads per kv head (a block of four rows and one padded), odd page runs, tiles of
    # 256 keys with a tail, an empty sequence
    "group6": dict(hq=12, hkv=2, sq=1, lengths=[1, 300, 517, 0]),
    # one long sequence: its keys split between threads, then merged
    "split": dict(hq=8, hkv=2, sq=1, lengths=[1000]),
    # two new positions per sequence (8 rows per kv head), causal, every modifier
    "modifiers": dict(
        hq=8, hkv=2, sq=2, lengths=[40, 299], causal=True, window=(100, 0), softcap=6.0,
        alibi=True, sinks=True,
    ),
}  # fmt: skip


PAIR_CALLS = [
    pytest.param(kind, dtype, case, id=f"{kind}-{name}-{case}")
    for kind, dtype, name in (
        ("int8", torch.bfloat16, "bf16"),
        ("int8", torch.float16, "fp16"),
        # fp8 with float16 queries takes the float loops, as every fp8 call on a CPU without
        # AVX512-BF16: the other tests here cover them
        ("fp8", torch.bfloat16, "bf16"),
    )
    for case in PAIR_DECODE
    # float16 queries differ from bfloat16 ones only in how the queries are widened: the
    # kernel with every modifier is compiled for bfloat16 alone
    if not (name == "fp16" and case == "modifiers")
]


@pytest.mark.parametrize("d", [32, 128])
@pytest.mark.parametrize("kind, dtype, case", PAIR_CALLS)
def test_half_queries_on_8bit_caches_hold_the_half_precision_rule(kind, dtype, case, d):
    """Half-precision queries on 8-bit caches whose head dims are multiples of 32 (the Numba
    decode's pair products where the CPU has them: int8 with bfloat16 or float16 queries on
    AVX512-VNNI, fp8 with bfloat16 queries on AVX512-BF16): out within twice the error of a
    plain computation in the queries' dtype on the same dequantized cache (+1e-6), both against
    float64, for every sequence, head and option; a query head holding a NaN gives NaN in that
    head's output only, and an fp8 NaN pattern in a key NaN in its kv head's rows only."""
    opts = PAIR_DECODE[case]
    hq, hkv, sq, lengths = opts["hq"], opts["hkv"], opts["sq"], opts["lengths"]
    block = 5
    gen = torch.Generator().manual_seed(d + len(case))
    pages = [-(-n // block) for n in lengths]
    num_blocks = sum(pages) + 2
    table = torch.full((len(lengths), max(pages)), -1, dtype=torch.int32)
    order = torch.randperm(num_blocks, generator=gen)
    start = 0
    for b, count in enumerate(pages):
        table[b, :count] = order[start : start + count].to(torch.int32)
        start += count
    caches, scales, deq = [], [], []
    for _ in range(2):
        x = torch.randn(num_blocks, block, hkv, d, generator=gen) * 2
        if kind == "int8":
            scale = x.abs().amax(-1) / 127
            caches.append(torch.round(x / scale[..., None]).to(torch.int8))
            deq.append(caches[-1].double() * scale.double()[..., None])
        else:
            scale = torch.rand(hkv, generator=gen) * 0.02 + 0.005  # one per kv head
            caches.append((x / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn))
            deq.append(caches[-1].double() * scale.double()[:, None])
        scales.append(scale)
    if kind == "fp8" and len(lengths) > 1 and lengths[1] > 3:
        # a NaN pattern in key 3 of sequence 1, kv head 0 (dequantized too: torch widens it)
        blk = int(table[1, 0])
        caches[0].view(torch.uint8)[blk, 3, 0, 5] = 0x7F
        deq[0][blk, 3, 0, 5] = math.nan
    q = torch.randn(len(lengths), sq, hq, d, generator=gen).to(dtype)
    q[0, 0, 1, 3] = math.nan
    alibi = torch.rand(hq, generator=gen) * 0.2 if opts.get("alibi") else None
    sinks = torch.randn(hq, generator=gen) if opts.get("sinks") else None
    mods = dict(
        causal=opts.get("causal", False),
        window=opts.get("window"),
        softcap=opts.get("softcap"),
        alibi=alibi,
        sinks=sinks,
    )
    out = fastpe.attention_kvcache(
        q,
        *caches,
        cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
        block_table=table,
        k_scale=scales[0],
        v_scale=scales[1],
        alibi_slopes=alibi,
        **{key: value for key, value in mods.items() if key != "alibi"},
        backend="numba",
    )
    assert out.dtype == dtype
    errors = {"fastpe": 0.0, "plain": 0.0}
    for b, length in enumerate(lengths):
        got = out[b].double()
        if length == 0:
            continue
        blocks = table[b, : pages[b]].long()
        k, v = (x[blocks].reshape(-1, hkv, d)[:length] for x in deq)
        want = _attend(q[b], k, v, dtype=torch.float64, **mods)
        plain = _attend(q[b], k, v, dtype=dtype, **mods)
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), b
        if b == 0:
            assert nan[0, 1].all() and nan.sum() == d  # the NaN query's head only
        ok = ~nan
        errors["fastpe"] = max(errors["fastpe"], (got[ok] - want[ok]).abs().max().item())
        errors["plain"] = max(errors["plain"], (plain[ok] - want[ok]).abs().max().item())
    assert errors["fastpe"] <= 2 * errors["plain"] + 1e-6, errors
