"""Memory layouts of the serving ops' arguments: strided, transposed, sliced and empty arrays.

``attention_varlen`` / ``attention_kvcache`` (and the ``fastpe.flash_attn`` functions built on
them) must give the same answer whatever the strides of their arguments: FlashAttention's packed
functions hand over views (``kv[:, 0]`` of a [T, 2, H, D] buffer), serving stacks allocate K and
V as halves of one buffer, and transformers passes transposed q/k/v. Caches must be read in
place (no copy per call), empty work must return empty results, and a refused call must write
nothing. Expected values: the float64 references of ``test_serving`` (plain torch, written by
hand) on contiguous copies of the same values.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_serving import close, ref_attention, ref_kvcache, ref_varlen  # noqa: E402

import fastpe  # noqa: E402
from fastpe import flash_attn  # noqa: E402

CPU_BACKENDS = ["numba", "numpy"]


# ------------------------------------------------------------------ layouts of the same values
def _index(ndim, dim, item):
    index = [slice(None)] * ndim
    index[dim] = item
    return tuple(index)


def strided(x, dim, fill=-7):
    """x's values as every other element of a buffer twice as long along ``dim`` (the rest
    ``fill``, which a wrong read would show)."""
    shape = list(x.shape)
    shape[dim] *= 2
    big = torch.full(shape, fill, dtype=x.dtype)
    big[_index(x.ndim, dim, slice(None, None, 2))] = x
    return big[_index(x.ndim, dim, slice(None, None, 2))]


def transposed(x, a, b):
    """x's values stored with dims a and b swapped in memory."""
    return x.transpose(a, b).contiguous().transpose(a, b)


def sliced(x, dim, fill=-7):
    """x's values as a slice of a longer buffer along ``dim`` (one fill entry before, two after):
    an offset start, and a non-contiguous view unless dim is the first."""
    shape = list(x.shape)
    shape[dim] += 3
    big = torch.full(shape, fill, dtype=x.dtype)
    big[_index(x.ndim, dim, slice(1, 1 + x.shape[dim]))] = x
    return big[_index(x.ndim, dim, slice(1, 1 + x.shape[dim]))]


def _base(t):
    return t if t._base is None else t._base


# ------------------------------------------------------------------ attention_varlen
VARLEN_LENGTHS_Q, VARLEN_LENGTHS_K = [3, 0, 1, 4], [5, 2, 1, 6]


def _varlen_case(seed=0, hq=4, hkv=2, d=8):
    gen = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(VARLEN_LENGTHS_Q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(VARLEN_LENGTHS_K)]), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d, generator=gen)
    k = torch.randn(int(cu_k[-1]), hkv, d, generator=gen)
    v = torch.randn(int(cu_k[-1]), hkv, d, generator=gen)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


VARLEN_VARIANTS = {
    "strided-heads": lambda x: strided(x, 1),
    "transposed": lambda x: transposed(x, 0, 1),
    "strided-dim": lambda x: strided(x, 2),
    "sliced": lambda x: sliced(x, 0),
}
CU_VARIANTS = {"strided": lambda x: strided(x, 0), "sliced": lambda x: sliced(x, 0)}


def _varlen_sweep():
    for arg in ("q", "k", "v"):
        for kind in VARLEN_VARIANTS:
            yield arg, kind
    for arg in ("cu_seqlens_q", "cu_seqlens_k"):
        for kind in CU_VARIANTS:
            yield arg, kind
    yield "k,v", "strided-heads"  # both halves of one buffer, as kvpacked hands them over


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("arg,kind", list(_varlen_sweep()))
def test_varlen_argument_layouts(backend, causal, arg, kind):
    args = _varlen_case()
    want, want_lse = ref_varlen(
        args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"], causal=causal
    )
    given = dict(args)
    for name in arg.split(","):
        variant = CU_VARIANTS[kind] if name.startswith("cu_") else VARLEN_VARIANTS[kind]
        given[name] = variant(args[name])
        assert torch.equal(given[name], args[name])
    before = {name: x.clone() for name, x in given.items()}
    out, lse = fastpe.attention_varlen(**given, causal=causal, return_lse=True, backend=backend)
    close(out, want, what="out")
    close(lse, want_lse, atol=2e-5, what="lse")
    for name, x in given.items():  # inputs are never modified
        assert torch.equal(x, before[name]), name


def _empty_varlen(case, hq=4, hkv=2, d=8):
    lengths = {
        "B=0": ([], []),
        "all-empty": ([0, 0], [0, 0]),
        "no-queries": ([0, 0], [3, 2]),
        "no-keys": ([2, 1], [0, 0]),
    }[case]
    cu_q, cu_k = (
        torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32) for n in lengths
    )
    return dict(
        q=torch.randn(int(cu_q[-1]), hq, d),
        k=torch.randn(int(cu_k[-1]), hkv, d),
        v=torch.randn(int(cu_k[-1]), hkv, d),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", ["B=0", "all-empty", "no-queries", "no-keys"])
def test_varlen_empty(backend, case):
    args = _empty_varlen(case)
    out, lse = fastpe.attention_varlen(**args, return_lse=True, backend=backend)
    assert out.shape == args["q"].shape and lse.shape == (4, args["q"].shape[0])
    if case == "no-keys":  # rows that see no key: 0, lse -inf
        assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all()


def _kvpacked_case(lengths, seed=1, h=4, d=16):
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    total = int(cu[-1])
    return torch.randn(total, h, d, generator=gen), torch.randn(total, 2, h, d, generator=gen), cu


@pytest.mark.parametrize("backend", [None, "numba", "numpy"])
def test_flash_attn_varlen_packed_short_sequences(backend):
    """kvpacked / qkvpacked hand the kernels k = kv[:, 0], v = kv[:, 1]: strided views."""
    q, kv, cu = _kvpacked_case([3, 1, 5])
    with fastpe.use_backend(backend) if backend else _nothing():
        out = flash_attn.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 5, 5, causal=True)
        qkv = torch.cat([q[:, None], kv], 1)
        out3 = flash_attn.flash_attn_varlen_qkvpacked_func(qkv, cu, 5, causal=True)
    want, _ = ref_varlen(q, kv[:, 0], kv[:, 1], cu, cu, causal=True)
    close(out, want, what="kvpacked")
    close(out3, want, what="qkvpacked")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------ attention_kvcache
def _kvcache_case(paged, *, seed=0, batch=2, sq=2, hq=4, hkv=2, d=8, new=2, rotary=True):
    gen = torch.Generator().manual_seed(seed)
    if paged:
        k_cache = torch.randn(6, 4, hkv, d, generator=gen)
        extra = dict(block_table=torch.tensor([[3, 0, 5], [1, 4, 2]], dtype=torch.int32)[:batch])
    else:
        k_cache = torch.randn(3, 12, hkv, d, generator=gen)
        extra = dict(cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32)[:batch])
    args = dict(
        q=torch.randn(batch, sq, hq, d, generator=gen),
        k_cache=k_cache,
        v_cache=torch.randn(k_cache.shape, generator=gen),
        k=torch.randn(batch, new, hkv, d, generator=gen),
        v=torch.randn(batch, new, hkv, d, generator=gen),
        cache_seqlens=torch.tensor([5, 2], dtype=torch.int32)[:batch],
        **extra,
    )
    if rotary:
        angles = torch.arange(16.0)[:, None] * 10000.0 ** (-torch.arange(d // 2) / (d // 2))
        args.update(rotary_cos=torch.cos(angles), rotary_sin=torch.sin(angles))
    return args


def _kvcache_want(args, causal=True):
    """(out, k_cache', v_cache') by hand, float64, from the contiguous arguments."""
    table = args.get("block_table")
    if args["q"].shape[0] == 0:  # no sequence: nothing read, nothing written
        out = torch.zeros(0, *args["q"].shape[1:3], args["v_cache"].shape[3])
        return out, args["k_cache"], args["v_cache"]
    if table is None:  # the reference reads row b: give it the selected rows
        index = args["cache_batch_idx"].long()
        kc, vc = args["k_cache"][index], args["v_cache"][index]
    else:
        kc, vc = args["k_cache"], args["v_cache"]
    out, want_kc, want_vc = ref_kvcache(
        args["q"],
        kc,
        vc,
        args.get("k"),
        args.get("v"),
        args["cache_seqlens"],
        table,
        args.get("rotary_cos"),
        args.get("rotary_sin"),
        False,
        causal,
        (-1, -1),
    )
    if table is None:  # back into the cache's own rows
        kc, vc = args["k_cache"].clone(), args["v_cache"].clone()
        kc[index], vc[index] = want_kc, want_vc
        want_kc, want_vc = kc, vc
    return out, want_kc, want_vc


FLOAT4_VARIANTS = {
    "strided-heads": lambda x: strided(x, 2),
    "transposed": lambda x: transposed(x, 1, 2),
    "strided-dim": lambda x: strided(x, 3),
}
CACHE_VARIANTS = {
    **FLOAT4_VARIANTS,
    "sliced-positions": lambda x: sliced(x, 1),  # a cache with spare positions per block
    "sliced-heads": lambda x: sliced(x, 2),  # the heads of one layer out of a wider buffer
    "kv-halves": None,  # K and V as [:, 0] and [:, 1] of one [blocks, 2, block_size, H, D]
}
SMALL_VARIANTS = {  # int arrays, rotary tables
    "strided": lambda x: strided(x, x.ndim - 1, fill=10**6 if not x.is_floating_point() else -7),
    "sliced": lambda x: sliced(x, 0, fill=10**6 if not x.is_floating_point() else -7),
    "transposed": lambda x: transposed(x, 0, 1) if x.ndim == 2 else None,
}


def _kv_halves(k_cache, v_cache):
    buffer = torch.stack([k_cache, v_cache], 1)
    return buffer[:, 0], buffer[:, 1]


def _kvcache_sweep():
    for paged in (True, False):
        for arg in ("q", "k", "v"):
            for kind in FLOAT4_VARIANTS:
                yield paged, arg, kind
        for kind in CACHE_VARIANTS:
            yield paged, "k_cache,v_cache", kind
        yield paged, "k_cache", "strided-heads"  # one strided cache, the other contiguous
        index = "block_table" if paged else "cache_batch_idx"
        for arg in ("cache_seqlens", index, "rotary_cos", "rotary_sin"):
            for kind in SMALL_VARIANTS:
                if kind == "transposed" and arg not in ("block_table", "rotary_cos", "rotary_sin"):
                    continue
                yield paged, arg, kind


def _call_variant(args, arg, kind, backend, framework="torch"):
    given = {name: x.clone() for name, x in args.items()}
    names = arg.split(",")
    if kind == "kv-halves":
        given["k_cache"], given["v_cache"] = _kv_halves(args["k_cache"], args["v_cache"])
    else:
        for name in names:
            table = {**SMALL_VARIANTS} if args[name].ndim < 4 else {**CACHE_VARIANTS}
            given[name] = table[kind](args[name])
    for name in names:
        assert torch.equal(given[name], args[name]), name
    if framework == "numpy":
        given = {name: x.numpy() for name, x in given.items()}  # views: the same strides
    bases = {name: _base(torch.as_tensor(x)).clone() for name, x in given.items()}
    out = fastpe.attention_kvcache(**given, causal=True, backend=backend)
    return given, bases, out


def _check_kvcache(args, given, bases, out, want):
    want_out, want_kc, want_vc = want
    close(out, want_out, what="out")
    kc, vc = (torch.as_tensor(given[name]) for name in ("k_cache", "v_cache"))
    close(kc, want_kc, atol=1e-6, what="k_cache")
    assert torch.equal(vc, want_vc)
    for name, x in given.items():
        if name in ("k_cache", "v_cache"):
            continue  # appended to (checked above)
        assert torch.equal(_base(torch.as_tensor(x)), bases[name]), f"{name} was modified"
    # the caches' memory outside their own elements (spare positions, the other half's fill
    # in a strided buffer) is untouched
    for name in ("k_cache", "v_cache"):
        base = _base(torch.as_tensor(given[name]))
        if base is torch.as_tensor(given[name]):
            continue
        mask = torch.ones(base.shape, dtype=torch.bool)
        view = torch.as_tensor(given[name])
        flat = torch.zeros(base.numel(), dtype=torch.bool)
        offsets = torch.as_strided(
            torch.arange(base.numel()), view.shape, view.stride(), view.storage_offset()
        )
        flat[offsets.reshape(-1)] = True
        mask = ~flat.reshape(base.shape)
        other = [n for n in ("k_cache", "v_cache") if n != name][0]
        if _base(torch.as_tensor(given[other])) is base:  # kv halves: the other half is written
            offsets = torch.as_strided(
                torch.arange(base.numel()),
                given[other].shape,
                given[other].stride(),
                given[other].storage_offset(),
            )
            mask.view(-1)[offsets.reshape(-1)] = False
        assert torch.equal(base[mask], bases[name][mask]), f"{name}'s buffer written outside it"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("paged,arg,kind", list(_kvcache_sweep()))
def test_kvcache_argument_layouts(backend, paged, arg, kind):
    args = _kvcache_case(paged)
    want = _kvcache_want(args)
    given, bases, out = _call_variant(args, arg, kind, backend)
    _check_kvcache(args, given, bases, out, want)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", ["kv-halves", "sliced-positions", "strided-heads"])
def test_kvcache_numpy_cache_layouts(backend, kind):
    """NumPy caches (the kernels' own host views): the same layouts as tensors."""
    args = _kvcache_case(True)
    want = _kvcache_want(args)
    given, _, out = _call_variant(args, "k_cache,v_cache", kind, backend, framework="numpy")
    close(out, want[0], what="out")
    close(torch.as_tensor(given["k_cache"]), want[1], atol=1e-6, what="k_cache")
    assert np.array_equal(given["v_cache"], want[2].numpy())


@pytest.mark.parametrize("backend", [None, "numba", "numpy"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_flash_attn_with_kvcache_on_cache_halves(backend, paged):
    """flash_attn_with_kvcache on the K and V halves of one buffer, appending: FlashAttention's
    serving layout through its own entry point (rotary_interleaved=False: the reference's)."""
    args = _kvcache_case(paged)
    want = _kvcache_want(args)
    kc, vc = _kv_halves(args["k_cache"], args["v_cache"])
    extra = {n: args[n] for n in ("block_table", "cache_batch_idx") if n in args}
    with fastpe.use_backend(backend) if backend else _nothing():
        out = flash_attn.flash_attn_with_kvcache(
            args["q"],
            kc,
            vc,
            args["k"],
            args["v"],
            rotary_cos=args["rotary_cos"],
            rotary_sin=args["rotary_sin"],
            cache_seqlens=args["cache_seqlens"],
            causal=True,
            rotary_interleaved=False,
            **extra,
        )
    close(out, want[0], what="out")
    close(kc, want[1], atol=1e-6, what="k_cache")
    assert torch.equal(vc, want[2])


@pytest.mark.parametrize(
    "paged,arg,kind",
    [
        (True, "k_cache,v_cache", "kv-halves"),
        (False, "k_cache,v_cache", "sliced-positions"),
        (True, "k", "strided-heads"),
    ],
)
def test_kvcache_argument_layouts_triton(paged, arg, kind):
    """A few of the sweep's cases under the Triton interpreter (each costs seconds)."""
    pytest.importorskip("triton")
    args = _kvcache_case(paged, batch=1, hq=2, hkv=1, d=16, new=1, rotary=False)
    want = _kvcache_want(args)
    given, bases, out = _call_variant(args, arg, kind, "triton")
    _check_kvcache(args, given, bases, out, want)


@pytest.mark.parametrize(
    "arg,kind",
    [
        ("q", "transposed"),
        ("k", "strided-dim"),
        ("k,v", "strided-heads"),
        ("cu_seqlens_k", "strided"),
    ],
)
def test_varlen_argument_layouts_triton(arg, kind):
    """A few of the varlen sweep's cases under the Triton interpreter (tiny shapes)."""
    pytest.importorskip("triton")
    args = _varlen_case(hq=2, hkv=1, d=16)
    want, _ = ref_varlen(
        args["q"], args["k"], args["v"], args["cu_seqlens_q"], args["cu_seqlens_k"], causal=True
    )
    given = dict(args)
    for name in arg.split(","):
        variant = CU_VARIANTS[kind] if name.startswith("cu_") else VARLEN_VARIANTS[kind]
        given[name] = variant(args[name])
    close(fastpe.attention_varlen(**given, causal=True, backend="triton"), want, what="out")


def test_varlen_kvpacked_triton():
    pytest.importorskip("triton")
    q, kv, cu = _kvpacked_case([2, 1], h=2)
    out = fastpe.attention_varlen(q, kv[:, 0], kv[:, 1], cu, cu, causal=True, backend="triton")
    close(out, ref_varlen(q, kv[:, 0], kv[:, 1], cu, cu, causal=True)[0], what="out")


# ------------------------------------------------------------------ caches read in place
def _spy(monkeypatch, module, name):
    seen = []
    original = getattr(module, name)

    def spy(q, k, v, **kw):
        seen.append((k, v))
        return original(q, k, v, **kw)

    monkeypatch.setattr(module, name, spy)
    return seen


def _shares(view, cache):
    """True when the kernel's rows ``view`` is the cache's own memory (no copy)."""
    if isinstance(view, torch.Tensor):
        return view.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    return np.shares_memory(view, np.asarray(cache))


@pytest.mark.parametrize("kind", ["kv-halves", "sliced-positions", "strided-heads"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_kvcache_numba_reads_strided_cache_in_place(monkeypatch, paged, kind):
    import fastpe.kernels.numba.attention_paged as kernel

    seen = _spy(monkeypatch, kernel, "attention_paged_numba")
    args = _kvcache_case(paged)
    want = _kvcache_want(args)
    given, bases, out = _call_variant(args, "k_cache,v_cache", kind, "numba")
    _check_kvcache(args, given, bases, out, want)
    ((k_rows, v_rows),) = seen
    assert _shares(k_rows, given["k_cache"]) and _shares(v_rows, given["v_cache"])


@pytest.mark.parametrize("serial", [True, False], ids=["serial", "parallel"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["kv-halves", "heads-major"])
@pytest.mark.parametrize(
    "hq,hkv,sq", [(16, 1, 1), (8, 2, 12)], ids=["decode-tiles", "gathered-tiles"]
)
def test_kvcache_numba_strided_cache_every_kernel_path(
    hq, hkv, sq, layout, dtype, serial, monkeypatch
):
    """Strided caches through both Numba tile paths (decode tiles of at most 16 rows read in
    place or copied per run; larger tiles gathered), run serially and in parallel with split
    keys, in every dtype: the answer of the same values in contiguous caches, by hand."""
    from fastpe.kernels.numba import attention_paged

    monkeypatch.setattr(attention_paged, "SERIAL_WORK", 1 << 40 if serial else -1)
    gen = torch.Generator().manual_seed(hq + sq)
    dt = getattr(torch, dtype)
    lengths, page, d = [0, 300, 61], 16, 32
    pages = [-(-(n + 0) // page) for n in lengths]
    table = torch.full((3, max(pages)), -1, dtype=torch.int32)
    perm = torch.randperm(sum(pages), generator=gen).to(torch.int32)
    for b, start in enumerate(np.cumsum([0, *pages[:-1]])):
        table[b, : pages[b]] = perm[start : start + pages[b]]
    k_cache = torch.randn(sum(pages), page, hkv, d, generator=gen).to(dt)
    v_cache = torch.randn(sum(pages), page, hkv, d, generator=gen).to(dt)
    if layout == "kv-halves":
        kc, vc = _kv_halves(k_cache, v_cache)
    else:  # [blocks, H, block_size, D] memory seen as [blocks, block_size, H, D]
        kc, vc = transposed(k_cache, 1, 2), transposed(v_cache, 1, 2)
    q = torch.randn(3, sq, hq, d, generator=gen).to(dt)
    out = fastpe.attention_kvcache(
        q,
        kc,
        vc,
        cache_seqlens=torch.tensor(lengths),
        causal=True,
        block_table=table,
        backend="numba",
    )
    for b, n in enumerate(lengths):
        keys = k_cache[table[b, : pages[b]].long()].reshape(-1, hkv, d)[:n]
        vals = v_cache[table[b, : pages[b]].long()].reshape(-1, hkv, d)[:n]
        want, _ = ref_attention(q[b], keys, vals, causal=True)
        close(out[b], want, atol=2e-5 if dtype == "float32" else 1e-2, what=f"out {b}")


def test_kvcache_triton_reads_strided_cache_in_place(monkeypatch):
    pytest.importorskip("triton")
    import fastpe.kernels.triton.attention_paged as kernel

    seen = _spy(monkeypatch, kernel, "attention_paged_triton")
    args = _kvcache_case(True, batch=1, hq=2, hkv=1, d=16, new=1, rotary=False)
    want = _kvcache_want(args)
    given, bases, out = _call_variant(args, "k_cache,v_cache", "kv-halves", "triton")
    _check_kvcache(args, given, bases, out, want)
    ((k_rows, v_rows),) = seen
    assert _shares(k_rows, given["k_cache"]) and _shares(v_rows, given["v_cache"])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_kvcache_strided_numpy_cache_allocates_no_cache_copy(backend):
    """A [blocks, 2, block_size, H, D] NumPy buffer (32 MB), K and V its halves, a short decode:
    the call's peak allocation stays far below one half (a copy of either would exceed it)."""
    rng = np.random.default_rng(0)
    blocks, bs, hkv, d = 1024, 16, 4, 64
    buffer = rng.standard_normal((blocks, 2, bs, hkv, d), dtype=np.float32)
    k_cache, v_cache = buffer[:, 0], buffer[:, 1]
    table = np.array([[7, 100, 3], [250, 0, 9]], np.int32)
    q = rng.standard_normal((2, 1, 8, d), dtype=np.float32)
    lengths = np.array([40, 17], np.int32)
    fastpe.attention_kvcache(
        q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, backend=backend
    )  # compile / warm
    tracemalloc.start()
    try:
        out = fastpe.attention_kvcache(
            q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, backend=backend
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < k_cache.nbytes / 8, f"peak {peak} bytes: a cache copy ({k_cache.nbytes})"
    # the right answer, by hand: each sequence's keys gathered through its blocks
    for b in range(2):
        n = int(lengths[b])
        rows = [(int(table[b, j // bs]), j % bs) for j in range(n)]
        keys = torch.tensor(np.stack([k_cache[r] for r in rows]))
        vals = torch.tensor(np.stack([v_cache[r] for r in rows]))
        want, _ = ref_varlen(torch.tensor(q[b]), keys, vals, [0, 1], [0, n])
        close(out[b], want, what=f"sequence {b}")


# ------------------------------------------------------------------ refusals write nothing
def _refusal_cases():
    def swapped(args):  # positions further apart than blocks: no row view exists
        args["k_cache"] = transposed(args["k_cache"], 0, 1)
        args["v_cache"] = transposed(args["v_cache"], 0, 1)
        return "k_cache", "block stride"

    def mismatched(args):  # K with spare positions per block, V without
        args["k_cache"] = sliced(args["k_cache"], 1)
        return "k_cache and v_cache", "same number of positions apart"

    def short_rotary(args):
        args["rotary_cos"], args["rotary_sin"] = args["rotary_cos"][:3], args["rotary_sin"][:3]
        return "rotary_cos", "rows"

    return {
        "swapped-block-dims": swapped,
        "kv-mismatched": mismatched,
        "short-rotary": short_rotary,
    }


@pytest.mark.parametrize("backend", [*CPU_BACKENDS, "triton"])
@pytest.mark.parametrize("case", list(_refusal_cases()))
def test_kvcache_refusal_writes_nothing(backend, case):
    if backend == "triton":
        pytest.importorskip("triton")
    args = _kvcache_case(True)
    name, words = _refusal_cases()[case](args)
    before = {n: _base(x).clone() for n, x in args.items()}
    with pytest.raises((ValueError, IndexError)) as error:
        fastpe.attention_kvcache(**args, causal=True, backend=backend)
    message = str(error.value)
    assert name.split(" ")[0] in message and words in message, message
    if "contiguous()" not in message and case != "short-rotary":
        pytest.fail(f"the refusal names no fix: {message}")
    for n, x in args.items():
        assert torch.equal(_base(x), before[n]), f"{n} written by a refused call"


# ------------------------------------------------------------------ empty work
EMPTY_KVCACHE = {  # name: (batch, sq, hq, new)
    "B=0": (0, 1, 4, 1),
    "Sq=0": (2, 0, 4, 1),
    "Hq=0": (2, 1, 0, 1),
    "Sq=0,no-append": (2, 0, 4, 0),
    "no-new-tokens": (2, 1, 4, 0),
    "empty-k-v": (2, 1, 4, 0),  # k and v given, with zero new tokens (and rotary tables)
}


def _empty_kvcache_args(paged, batch, sq, hq, new):
    args = _kvcache_case(paged, batch=max(batch, 1), sq=max(sq, 1), new=max(new, 1))
    args["q"] = torch.randn(batch, sq, hq, 8)
    for name in ("k", "v"):
        args[name] = torch.randn(batch, new, 2, 8)
    for name in ("cache_seqlens", "block_table", "cache_batch_idx"):
        if name in args:
            args[name] = args[name][:batch]
    return args


@pytest.mark.parametrize("backend", [*CPU_BACKENDS, "triton"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("case", list(EMPTY_KVCACHE))
def test_kvcache_empty_work(backend, paged, case):
    """Empty results of the right shapes; new tokens are still appended (FlashAttention's
    behaviour: the write does not depend on there being queries)."""
    if backend == "triton":
        pytest.importorskip("triton")
    batch, sq, hq, new = EMPTY_KVCACHE[case]
    args = _empty_kvcache_args(paged, batch, sq, hq, new)
    if not new and case != "empty-k-v":
        args.pop("k"), args.pop("v"), args.pop("rotary_cos"), args.pop("rotary_sin")
    want = _kvcache_want(args)
    given = {n: x.clone() for n, x in args.items()}
    out, lse = fastpe.attention_kvcache(**given, causal=True, return_lse=True, backend=backend)
    assert out.shape == (batch, sq, hq, 8) and lse.shape == (batch, hq, sq)
    close(out, want[0], what="out")
    close(given["k_cache"], want[1], atol=1e-6, what="k_cache")
    assert torch.equal(given["v_cache"], want[2])
    if new and batch:  # the append happened
        assert not torch.equal(given["v_cache"], args["v_cache"])


def test_kvcache_plan_without_new_tokens_keeps_each_table():
    """With zero new tokens the plan's tables are derived lazily, each under its own name: the
    query positions stay [B, Sq] = cache_seqlens + i, not another table's (empty) array."""
    seqlens = torch.tensor([5, 2], dtype=torch.int32)
    plan = fastpe.plan_kvcache(
        torch.zeros(2, 3, 4, 8),
        torch.zeros(6, 4, 2, 8),
        torch.zeros(2, 0, 2, 8),
        cache_seqlens=seqlens,
        block_table=torch.tensor([[3, 0, 5], [1, 4, 2]], dtype=torch.int32),
    )
    assert plan.k_positions.shape == (2, 0) and plan.written_block.shape == (2, 0)
    np.testing.assert_array_equal(plan.q_positions(True), [[5, 6, 7], [2, 3, 4]])
    np.testing.assert_array_equal(plan.q_positions(False), [[5, 5, 5], [2, 2, 2]])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_kvcache_empty_cache_and_table(backend):
    """A paged cache of zero blocks and a block table of zero columns: nothing to read."""
    q = torch.randn(2, 1, 4, 8)
    cache = torch.zeros(0, 4, 2, 8)
    out, lse = fastpe.attention_kvcache(
        q,
        cache,
        cache.clone(),
        cache_seqlens=0,
        block_table=torch.zeros(2, 0, dtype=torch.int32),
        return_lse=True,
        backend=backend,
    )
    assert torch.equal(out, torch.zeros(2, 1, 4, 8)) and torch.isinf(lse).all()


# ------------------------------------------------------------------ transformers, packed
def test_transformers_packed_short_sequences():
    """Padding-free packed forward with short sequences (the decode-sized tiles): transformers
    passes q/k/v as transposed views."""
    transformers = pytest.importorskip("transformers")
    from fastpe.integrations.transformers import register

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    seqs = [torch.randint(1, 96, (n,)).tolist() for n in (3, 1, 5, 2)]
    collator = transformers.DataCollatorWithFlattening(
        return_flash_attn_kwargs=True, return_tensors="pt"
    )
    batch = {k: v for k, v in collator([{"input_ids": s} for s in seqs]).items() if k != "labels"}
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        alone = torch.cat([model(torch.tensor([s])).logits[0] for s in seqs])
        model.set_attn_implementation(register())
        with fastpe.use_backend("numba"):
            got = model(**batch).logits[0]
    torch.testing.assert_close(got, alone, atol=2e-5, rtol=1e-5)
