"""bfloat16 attention on AVX512-BF16 (``kernels/numba/_pair_products``): the pair product and
the packing against NumPy in float64, and the dense kernel's pair path against the float64
oracle and the float32 (widened) path, under the half-precision rule. Skipped where Numba does
not compile for a CPU with AVX512-BF16: there the widened path runs, which the other attention
tests cover."""

from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")
torch = pytest.importorskip("torch")

from fastpe.kernels.numba import _pair_products as pp  # noqa: E402

import fastpe  # noqa: E402

needs_bf16 = pytest.mark.skipif(
    not pp.available(), reason="Numba does not compile for a CPU with AVX512-BF16 here"
)


def test_fastpe_info_names_the_path():
    from fastpe.cli import info

    line = next(line for line in info().splitlines() if "bf16 tiles" in line)
    assert ("vdpbf16ps" in line) == pp.available(), line


def _bf16_bits(x):
    """float -> bfloat16 bits (uint16), rounded to nearest even (finite inputs)."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def _value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _pairs_of_rows(bits):
    """[m, k] bfloat16 bits -> [m, ceil(k/2)] uint32 pairs (the odd last element with 0)."""
    m, k = bits.shape
    padded = np.zeros((m, k + k % 2), np.uint32)
    padded[:, :k] = bits
    return padded[:, 0::2] | (padded[:, 1::2] << 16)


def _panels_of(b_bits):
    """B [k, n] bfloat16 bits -> panels [n / 16, ceil(k/2), 16]: B[2t, 16p + c] and B[2t + 1,
    16p + c] in panels[p, t, c]."""
    k, n = b_bits.shape
    pairs = _pairs_of_rows(np.ascontiguousarray(b_bits.T))  # [n, ceil(k/2)]
    return np.ascontiguousarray(pairs.reshape(n // 16, 16, -1).transpose(0, 2, 1))


@numba.njit
def _product(c, a, panels, accumulate):
    pp.pair_product(c, a, panels, accumulate)


@needs_bf16
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 13])
@pytest.mark.parametrize("k", [0, 1, 2, 9, 64])
@pytest.mark.parametrize("n", [32, 96])
@pytest.mark.parametrize("accumulate", [False, True])
def test_pair_product_matches_numpy(m, k, n, accumulate):
    rng = np.random.default_rng(m * 1000 + k * 10 + n)
    a_bits = _bf16_bits(rng.standard_normal((m, k)))
    b_bits = _bf16_bits(rng.standard_normal((k, n)))
    a, b = _value(a_bits), _value(b_bits)
    # c is a strided window of a larger array: nothing around it may change
    outer = rng.standard_normal((m + 2, n + 40)).astype(np.float32)
    before = outer.copy()
    c = outer[1 : m + 1, 8 : n + 8]
    _product(c, _pairs_of_rows(a_bits), _panels_of(b_bits), accumulate)
    want = a @ b + (before[1 : m + 1, 8 : n + 8] if accumulate else 0.0)
    # float32 sums of exact products: within k float32 roundings of the sum of |terms|
    bound = (np.abs(a) @ np.abs(b) + np.abs(want)) * (k + 2) * 2.0**-24 + 1e-30
    assert np.all(np.abs(c - want) <= bound)
    outer[1 : m + 1, 8 : n + 8] = before[1 : m + 1, 8 : n + 8]
    assert np.array_equal(outer, before)


@numba.njit
def _pack(k, v, key_panels, value_panels, length):
    pp.pack_key_pairs(k[0, 1], key_panels)
    pp.pack_value_pairs(v[0, 1], value_panels, length)


@needs_bf16
@pytest.mark.parametrize("keys,d,length", [(1, 1, 1), (17, 7, 17), (40, 64, 99), (33, 80, 21)])
def test_packing_layouts(keys, d, length):
    rng = np.random.default_rng(keys + d)
    k = _bf16_bits(rng.standard_normal((1, 2, keys, d)))
    v = _bf16_bits(rng.standard_normal((1, 2, keys, d)))
    n_key_panels = -(-keys // 16) + 2
    key_panels = np.full((n_key_panels, -(-d // 2), 16), 7, np.uint32)
    value_panels = np.full((-(-d // 32) * 2, -(-keys // 2), 16), 7, np.uint32)
    _pack(k, v, key_panels, value_panels, length)
    kt = np.zeros((d, n_key_panels * 16), np.uint16)  # Kᵀ, zeros past the last key
    kt[:, :keys] = k[0, 1].T
    assert np.array_equal(key_panels, _panels_of(kt))
    # zeros past Dv, and for the values from the key length on
    vb = np.zeros((keys, value_panels.shape[0] * 16), np.uint16)
    vb[: min(keys, length), :d] = v[0, 1, :length]
    assert np.array_equal(value_panels, _panels_of(vb))


@needs_bf16
def test_query_pairs_and_rounded_weights():
    rng = np.random.default_rng(5)
    q = _bf16_bits(rng.standard_normal((2, 6, 9, 7)))  # 6 query heads, 2 per kv head
    tile = (1, 2, 2, 3, 4)  # sequence 1, kv head 2, group 2, queries 3 … 6
    got = numba.njit(lambda q, tile: pp.row_tile_pairs(q, tile))(q, tile)
    rows = np.concatenate([q[1, 4, 3:7], q[1, 5, 3:7]])
    assert np.array_equal(got, _pairs_of_rows(rows))

    p = rng.random((5, 32)).astype(np.float32)
    p[0, :4] = [1.0, 0.0, np.float32(1 + 2**-8), np.float32(1 + 3 * 2**-8)]  # ties to even
    out = np.full((5, 16), 9, np.uint32)
    numba.njit(lambda p, n, out: pp.round_weight_pairs(p, n, out))(p, 31, out)
    want = _pairs_of_rows(_bf16_bits(p[:, :31]))
    assert np.array_equal(out, want)
    assert (out[0, 1] & 0xFFFF) == 0x3F80 and (out[0, 1] >> 16) == 0x3F82  # 1 and 1 + 2^-6


@needs_bf16
@pytest.mark.parametrize("rows,n,width", [(5, 31, 32), (8, 64, 64), (1, 3, 32), (7, 40, 64)])
def test_backward_packings(rows, n, width):
    """The backward's transposed operands: a row tile's rows transposed as pairs along the rows,
    and P (or dS) rounded to bfloat16 as panels along the rows, zeros from column n on."""
    rng = np.random.default_rng(rows * 100 + n)
    x = _bf16_bits(rng.standard_normal((1, 4, 9, 7)))
    npos = (rows + 1) // 2
    tile = (0, 1, 2, npos, npos)  # kv head 1 of group 2: heads 2 and 3, queries npos …
    got = numba.njit(lambda x, tile: pp.row_tile_column_pairs(x, tile))(x, tile)
    tile_rows = np.concatenate([x[0, 2, npos : 2 * npos], x[0, 3, npos : 2 * npos]])
    assert np.array_equal(got, _pairs_of_rows(np.ascontiguousarray(tile_rows.T)))

    p = rng.standard_normal((rows, width)).astype(np.float32)
    out = np.full((width // 16, (rows + 1) // 2, 16), 9, np.uint32)
    numba.njit(lambda p, n, out: pp.round_row_panels(p, n, out))(p, n, out)
    bits = _bf16_bits(p)
    bits[:, n:] = 0
    assert np.array_equal(out, _panels_of(bits))


CASES = {
    "causal": dict(causal=True),
    "gqa-window-softcap": dict(causal=True, window=(37, 0), softcap=4.0),
    "alibi-sinks": dict(alibi_slopes=True, sinks=True),
    "mask": dict(mask=True),
    "odd-dims": dict(),
}


def _random_options(options, gen, hq, sq, sk):
    """CASES' flags -> tensors: ALiBi slopes and a bool mask in the returned options, and the
    sinks apart (None without them)."""
    options = dict(options)
    if options.pop("alibi_slopes", False):
        options["alibi_slopes"] = torch.rand(hq, generator=gen) * 0.3
    sinks = torch.randn(hq, generator=gen) if options.pop("sinks", False) else None
    if options.pop("mask", False):
        options["mask"] = torch.rand(sq, sk, generator=gen) > 0.3
    return options, sinks


@needs_bf16
@pytest.mark.parametrize("case", sorted(CASES))
def test_pair_path_within_the_half_precision_rule(case, monkeypatch):
    """The pair path (P rounded to bfloat16) against the float64 oracle: within twice the error
    of a plain torch computation in bfloat16, and near the widened float32 path."""
    gen = torch.Generator().manual_seed(len(case))
    options = dict(CASES[case])
    hq, hkv = (8, 2) if case.startswith("gqa") else (4, 4)
    sq, sk, d = (45, 301, 33) if case == "odd-dims" else (150, 150, 64)
    q = torch.randn(2, hq, sq, d, generator=gen).bfloat16()
    k, v = (torch.randn(2, hkv, sk, d, generator=gen).bfloat16() for _ in range(2))
    options, sinks = _random_options(options, gen, hq, sq, sk)
    if sinks is not None:
        options["sinks"] = sinks
    want = fastpe.attention(q.double(), k.double(), v.double(), backend="numpy", **options)
    got = fastpe.attention(q, k, v, backend="numba", **options)
    monkeypatch.setattr(pp, "available", lambda: False)
    widened = fastpe.attention(q, k, v, backend="numba", **options)
    # a plain torch computation in bfloat16: scores, softmax and P·V each rounded to bfloat16
    scale = d**-0.5
    kk, vv = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    plain_scores = (q @ kk.transpose(-1, -2)).float() * scale
    plain_scores = _modified(plain_scores, q.shape, options, sq, sk).bfloat16()
    plain = (torch.softmax(plain_scores.float(), -1).bfloat16() @ vv).double()
    if "sinks" in options:  # the sink's share of the normaliser, as the oracle has it
        lse = torch.logsumexp(plain_scores.float().double(), -1, keepdim=True)
        sinks = options["sinks"].double()[None, :, None, None]
        plain = plain * torch.exp(lse - torch.logaddexp(lse, sinks))
    err = (got.double() - want).abs().max().item()
    plain_err = (plain - want).abs().max().item()
    assert plain_err < 0.03, plain_err  # a faithful plain computation, so the bound means something
    assert err <= 2 * plain_err, (err, plain_err)
    assert (got.double() - widened.double()).abs().max().item() <= 2 * plain_err


def _modified(scores, shape, options, sq, sk, length=None, bias=None):
    """The score modifiers of CASES on scores [B, H, Sq, Sk] (bottom-right causal against
    ``length`` keys, default Sk), in their dtype; ``bias`` [H, Sq, Sk] is added."""
    length = sk if length is None else length
    i = torch.arange(sq)[:, None] + (length - sq)
    j = torch.arange(sk)[None, :]
    if "softcap" in options:
        cap = options["softcap"]
        scores = cap * torch.tanh(scores / cap)
    if "alibi_slopes" in options:
        slopes = options["alibi_slopes"].to(scores.dtype)
        scores = scores - slopes[None, :, None, None] * (i - j).abs().to(scores.dtype)
    if bias is not None:
        scores = scores + bias
    visible = j < length
    if options.get("causal"):
        visible = visible & (j <= i)
    if "window" in options:
        visible = visible & (j >= i - options["window"][0])
    if "mask" in options:
        visible = visible & options["mask"]
    return scores.masked_fill(~visible, -torch.inf)


def _plain_bf16(q, k, v, causal):
    """A plain torch computation in bfloat16 for one sequence (q [Sq, Hq, D], k/v [Sk, Hkv, D]):
    SDPA on bfloat16 tensors, the causal rule bottom-right."""
    sq, sk = q.shape[0], k.shape[0]
    mask = None
    if causal:
        mask = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(0, 1)


@needs_bf16
@pytest.mark.parametrize("layout", ["varlen", "paged"])
def test_packed_and_paged_prefill_pairs(layout, monkeypatch):
    """The packed/paged kernel's wide tiles gather bfloat16 keys and values as pairs through the
    page table (odd head dim, a sequence shorter than a panel, shuffled pages): against the
    float64 oracle within twice a plain bfloat16 computation's error, and near the widened path."""
    gen = torch.Generator().manual_seed(7)
    hq, hkv, d = 8, 2, 33
    lens_q, lens_k = [37, 150, 9], [60, 301, 9]
    q = torch.randn(sum(lens_q), hq, d, generator=gen).bfloat16()
    k, v = (torch.randn(sum(lens_k), hkv, d, generator=gen).bfloat16() for _ in range(2))
    cu_q = torch.tensor(np.cumsum([0, *lens_q]), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0, *lens_k]), dtype=torch.int32)
    if layout == "varlen":

        def run(q, k, v, backend):
            return fastpe.attention_varlen(q, k, v, cu_q, cu_k, causal=True, backend=backend)

    else:  # every sequence's keys in shuffled pages of 16 rows of one cache
        block, pages = 16, [-(-n // 16) for n in lens_k]
        order = torch.randperm(sum(pages), generator=gen)
        table = torch.zeros(len(lens_k), max(pages), dtype=torch.int32)
        k_cache = torch.zeros(sum(pages), block, hkv, d, dtype=torch.bfloat16)
        v_cache = torch.zeros_like(k_cache)
        used = 0
        for b, n in enumerate(lens_k):
            for page in range(pages[b]):
                slot = int(order[used])
                used += 1
                table[b, page] = slot
                rows = slice(cu_k[b] + page * block, cu_k[b] + min(n, (page + 1) * block))
                k_cache[slot, : rows.stop - rows.start] = k[rows]
                v_cache[slot, : rows.stop - rows.start] = v[rows]
        seqlens = torch.tensor(lens_k, dtype=torch.int32)

        def run(q, k, v, backend):  # the cache already holds every key: q padded per sequence
            dtype = torch.float64 if backend == "numpy" else torch.bfloat16
            qb = torch.zeros(len(lens_q), max(lens_q), hq, d, dtype=dtype)
            for b, n in enumerate(lens_q):
                qb[b, max(lens_q) - n :] = q[cu_q[b] : cu_q[b + 1]]
            out = fastpe.attention_kvcache(
                qb, k_cache.to(dtype), v_cache.to(dtype), cache_seqlens=seqlens,
                block_table=table, causal=True, backend=backend,
            )  # fmt: skip
            return torch.cat([out[b, max(lens_q) - n :] for b, n in enumerate(lens_q)])

    want = run(q.double(), k.double(), v.double(), "numpy")
    got = run(q, k, v, "numba").double()
    monkeypatch.setattr(pp, "available", lambda: False)
    widened = run(q, k, v, "numba").double()
    plain = torch.cat(
        [
            _plain_bf16(
                q[cu_q[b] : cu_q[b + 1]], k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]], True
            )
            for b in range(len(lens_q))
        ]
    ).double()
    plain_err = (plain - want).abs().max().item()
    assert plain_err < 0.03, plain_err
    assert (got - want).abs().max().item() <= 2 * plain_err
    assert (got - widened).abs().max().item() <= 2 * plain_err


@needs_bf16
def test_values_past_a_key_length_never_reach_the_output():
    """A tile ending on an odd key pairs it with the next value (weight 0): the values past a
    sequence's key length (here inf and NaN, as in uninitialised cache rows) must not turn
    that 0 into NaN."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 64, 32, generator=gen).bfloat16()
    k, v = (torch.randn(2, 4, 120, 32, generator=gen).bfloat16() for _ in range(2))
    lengths = torch.tensor([37, 101])
    for b, n in enumerate(lengths.tolist()):
        v[b, :, n] = float("inf")
        v[b, :, n + 1 :] = float("nan")
    got = fastpe.attention(q, k, v, key_lengths=lengths, backend="numba")
    assert torch.isfinite(got).all()
    want = fastpe.attention(
        q.double(), k.double(), v.double().nan_to_num(0.0, 0.0, 0.0), key_lengths=lengths,
        backend="numpy",
    )  # fmt: skip
    assert (got.double() - want).abs().max().item() < 0.02


BACKWARD_CASES = {
    "causal-gqa": dict(causal=True),
    "gqa-window-softcap": dict(causal=True, window=(37, 0), softcap=4.0),
    "alibi-sinks": dict(alibi_slopes=True, sinks=True),
    "mask-t5": dict(mask=True, relative_bias=True),
    "odd-dims": dict(),
    "split-keys": dict(causal=True, key_lengths=True),
}
BACKWARD_SHAPES = {  # B, Hq, Hkv, Sq, Sk, D, Dv
    "odd-dims": (2, 4, 4, 45, 301, 33, 17),
    # one work item: its keys are split across the threads, slices starting past key 0
    "split-keys": (1, 2, 1, 70, 700, 64, 64),
}


@needs_bf16
@pytest.mark.parametrize("case", sorted(BACKWARD_CASES))
def test_pair_backward_within_the_half_precision_rule(case, monkeypatch):
    """The backward's pair path (P and dS rounded to bfloat16) against the float64 oracle's
    gradients: within twice the error of plain torch autograd in bfloat16, and near the
    widened float32 path."""
    from fastpe import reference

    gen = torch.Generator().manual_seed(len(case) + 100)
    options = dict(BACKWARD_CASES[case])
    b, hq, hkv, sq, sk, d, dv = BACKWARD_SHAPES.get(case, (2, 8, 2, 150, 150, 64, 64))
    leaves = {
        "q": torch.randn(b, hq, sq, d, generator=gen),
        "k": torch.randn(b, hkv, sk, d, generator=gen),
        "v": torch.randn(b, hkv, sk, dv, generator=gen),
    }
    grad_out = torch.randn(b, hq, sq, dv, generator=gen).bfloat16()
    length = sk
    if options.pop("key_lengths", False):
        length = sk - 50
        options["key_lengths"] = torch.tensor([length] * b)
        for name in "kv":  # poison: keys past the length are never read
            leaves[name][:, :, length:] = float("nan")
    options, sinks = _random_options(options, gen, hq, sq, sk)
    if sinks is not None:
        leaves["sinks"] = sinks
    t5 = options.pop("relative_bias", False)
    if t5:
        leaves["table"] = torch.randn(32, hq, generator=gen)
    leaves = {name: x.bfloat16() for name, x in leaves.items()}

    def fastpe_grads(dtype, backend):
        xs = {name: x.detach().to(dtype).requires_grad_() for name, x in leaves.items()}
        kw = dict(options)
        if t5:
            kw["relative_bias"] = dict(table=xs["table"], max_distance=20, bidirectional=True)
        out = fastpe.attention(
            xs["q"], xs["k"], xs["v"], sinks=xs.get("sinks"), backend=backend, **kw
        )
        loss = (out * grad_out.to(dtype)).sum()
        return dict(zip(xs, torch.autograd.grad(loss, list(xs.values())), strict=True))

    def plain_grads():  # every step in bfloat16, as torch autograd does it
        xs = {name: x.detach().requires_grad_() for name, x in leaves.items()}
        is_key = (torch.arange(sk) < length)[:, None]
        kk, vv = (xs[n].masked_fill(~is_key, 0.0).repeat_interleave(hq // hkv, dim=1) for n in "kv")
        bias = None
        if t5:
            rel = torch.arange(sk)[None] - (torch.arange(sq)[:, None] + sk - sq)
            buckets = torch.from_numpy(reference.t5_bucket(rel.numpy(), True, 32, 20))
            bias = xs["table"][buckets].permute(2, 0, 1)
        scores = (xs["q"] @ kk.transpose(-1, -2)) * d**-0.5
        scores = _modified(scores, None, options, sq, sk, length, bias)
        if "sinks" in xs:
            sinks = xs["sinks"][None, :, None, None].expand(b, hq, sq, 1)
            weights = torch.softmax(torch.cat([scores, sinks], -1), -1)[..., :sk]
        else:
            weights = torch.softmax(scores, -1)
        out = weights @ vv
        loss = (out * grad_out).sum()
        return dict(zip(xs, torch.autograd.grad(loss, list(xs.values())), strict=True))

    want = fastpe_grads(torch.float64, "numpy")
    got = fastpe_grads(torch.bfloat16, "numba")
    plain = plain_grads()
    monkeypatch.setattr(pp, "available", lambda: False)
    widened = fastpe_grads(torch.bfloat16, "numba")
    for name in want:
        if name == "sinks":
            continue  # computed from the forward's lse alone, by the same code on both paths
        w = want[name]
        size = w.abs().max().item()
        plain_err = (plain[name].double() - w).abs().max().item()
        err = (got[name].double() - w).abs().max().item()
        # a faithful plain computation, so the bound means something
        assert plain_err < 0.05 * size, (name, plain_err, size)
        assert err <= 2 * plain_err, (name, err, plain_err)
        assert (got[name].double() - widened[name].double()).abs().max().item() <= 2 * plain_err


@needs_bf16
@pytest.mark.parametrize("causal", [True, False])
def test_flex_attention_pairs_within_the_half_precision_rule(causal, monkeypatch):
    """flex_attention's forward packs each bfloat16 key tile it reaches as pairs (a score_mod,
    a block mask with skipped, partial and full blocks, paired 64-key blocks, a ragged tail, an
    odd head dim): against the float64 oracle within twice the error of torch's own
    flex_attention run eagerly in bfloat16, and near the widened path."""
    import warnings

    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    gen = torch.Generator().manual_seed(21)
    b, hq, hkv, sq, sk, d = 2, 8, 2, 200, 300, 33
    q = torch.randn(b, hq, sq, d, generator=gen).bfloat16()
    k, v = (torch.randn(b, hkv, sk, d, generator=gen).bfloat16() for _ in range(2))
    slopes = torch.rand(hq, generator=gen) * 0.1

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    def mask_mod(b, h, q_idx, kv_idx):
        visible = q_idx + (sk - sq) >= kv_idx if causal else kv_idx >= 0
        return visible & ((kv_idx // 7) % 5 != 3)

    block_mask = fastpe.create_block_mask(mask_mod, b, None, sq, sk, BLOCK_SIZE=64)

    def run(q, k, v, backend="numba"):
        return fastpe.flex_attention(
            q, k, v, score_mod, block_mask, enable_gqa=True, backend=backend
        )

    want = run(q.double(), k.double(), v.double(), backend="numpy")
    got = run(q, k, v).double()
    torch_mask = torch_block_mask(mask_mod, b, None, sq, sk, device="cpu", BLOCK_SIZE=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile"
        plain = torch_flex(q, k, v, score_mod, torch_mask, enable_gqa=True).double()
    monkeypatch.setattr(pp, "available", lambda: False)
    widened = run(q, k, v).double()
    plain_err = (plain - want).abs().max().item()
    assert plain_err < 0.03, plain_err
    assert (got - want).abs().max().item() <= 2 * plain_err
    assert (got - widened).abs().max().item() <= 2 * plain_err
