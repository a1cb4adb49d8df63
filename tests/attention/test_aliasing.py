"""Arguments that share memory: every pair of array arguments of ``attention_kvcache`` (and
``flash_attn_with_kvcache``) and ``attention_varlen`` passed as one array or as overlapping
views, checked against an independent float64 computation written here.

The definition (docs/README.md, "Arguments that share memory"): every argument means its values
as passed, read before the append writes into the caches; caches that share an element cannot
be appended to (ValueError naming both, raised before anything is written).

Every argument of a case is a view of one byte buffer (the arena), so the aliasing is real memory
sharing, of any dtypes, and "nothing written" is one comparison of the arena's bytes.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import fastpe
from fastpe.flash_attn import flash_attn_with_kvcache

torch = pytest.importorskip("torch")

BACKENDS = ("numba", "numpy")


# ---------------------------------------------------------------------------------------------
# Independent float64 computation


def _rotate(x, cos, sin, positions, interleaved):
    """x [n, H, D] rotated at one position per row (RoPE on the first 2 * cos.shape[1] dims)."""
    half = cos.shape[1]
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    out = x.copy()
    if interleaved:
        x1, x2 = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        out[..., 0 : 2 * half : 2], out[..., 1 : 2 * half : 2] = x1 * c - x2 * s, x2 * c + x1 * s
    else:
        x1, x2 = x[..., :half], x[..., half : 2 * half]
        out[..., :half], out[..., half : 2 * half] = x1 * c - x2 * s, x2 * c + x1 * s
    return out


def _attend(q, keys, values, *, slopes, sinks):
    """One sequence, causal, bottom-right: q [n, Hq, D], keys [L, Hkv, D], values [L, Hkv, Dv];
    query i sits at key position i + L - n; ALiBi -slope * |qpos - j|; sinks join the softmax."""
    n, hq, d = q.shape
    length, hkv = keys.shape[:2]
    group = hq // hkv
    out = np.zeros((n, hq, values.shape[2]))
    j = np.arange(length)
    for h in range(hq):
        for i in range(n):
            qpos = i + length - n
            scores = keys[:, h // group] @ q[i, h] / np.sqrt(d) - slopes[h] * np.abs(qpos - j)
            visible = j <= qpos
            logits = np.append(scores[visible], sinks[h] if sinks is not None else -np.inf)
            weights = np.exp(logits - logits.max())
            out[i, h] = weights[:-1] @ values[visible, h // group] / weights.sum()
    return out


def _expected_kvcache(a, *, interleaved):
    """The caches after the append, then attention: every argument's values as passed."""
    f64 = {name: np.asarray(x, np.float64) for name, x in a.items()}
    k_cache, v_cache = f64["k_cache"].copy(), f64["v_cache"].copy()
    lengths = a["cache_seqlens"].astype(np.int64)
    batch, sq = a["q"].shape[:2]
    new = a["k"].shape[1]
    rotary = "rotary_cos" in a

    def where(b, p):  # (cache row or block, offset) of key p of sequence b
        if "block_table" in a:
            size = k_cache.shape[1]
            return int(a["block_table"][b, p // size]), p % size
        row = int(a["cache_batch_idx"][b]) if "cache_batch_idx" in a else b
        return row, p

    for b in range(batch):
        positions = lengths[b] + np.arange(new)
        k_new = f64["k"][b]
        if rotary:
            k_new = _rotate(k_new, f64["rotary_cos"], f64["rotary_sin"], positions, interleaved)
        for j, p in enumerate(positions):
            k_cache[where(b, p)] = k_new[j]
            v_cache[where(b, p)] = f64["v"][b, j]
    out = []
    for b in range(batch):
        total = lengths[b] + new
        keys = np.stack([k_cache[where(b, p)] for p in range(total)])
        values = np.stack([v_cache[where(b, p)] for p in range(total)])
        q = f64["q"][b]
        if rotary:  # causal: query i at cache position cache_seqlens[b] + i
            q = _rotate(
                q, f64["rotary_cos"], f64["rotary_sin"], lengths[b] + np.arange(sq), interleaved
            )
        out.append(_attend(q, keys, values, slopes=f64["alibi_slopes"], sinks=f64.get("sinks")))
    return np.stack(out)


def _expected_varlen(a):
    f64 = {name: np.asarray(x, np.float64) for name, x in a.items()}
    cu_q, cu_k = a["cu_seqlens_q"].astype(np.int64), a["cu_seqlens_k"].astype(np.int64)
    out = []
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        tables = f64["cos"], f64["sin"]
        q = _rotate(f64["q"][rows], *tables, a["q_positions"][rows].astype(np.int64), False)
        k = _rotate(f64["k"][keys], *tables, a["k_positions"][keys].astype(np.int64), False)
        out.append(_attend(q, k, f64["v"][keys], slopes=f64["alibi_slopes"], sinks=f64["sinks"]))
    return np.concatenate(out)


# ---------------------------------------------------------------------------------------------
# Cases: canonical values, then the arguments laid out in one arena with one pair aliased

B, SQ, HQ, HKV, D, NEW = 2, 2, 4, 2, 4, 2
LENGTHS = [3, 5]  # keys already cached; + NEW = [5, 7]
BLOCKS, BLOCK_SIZE = 6, 4
TABLE = [[4, 1, 0], [2, 5, 3]]  # the last column is never read (2 pages per sequence)
CACHE_ROWS, CACHE_WIDTH, CACHE_ROW_OF = 6, 8, [2, 0]


def _kvcache_values(paged: bool, rotary: bool, sinks: bool = True) -> dict:
    rng = np.random.default_rng(7 + 2 * paged + rotary)
    cache = (BLOCKS, BLOCK_SIZE) if paged else (CACHE_ROWS, CACHE_WIDTH)

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    values = {
        "q": normal(B, SQ, HQ, D),
        "k_cache": normal(*cache, HKV, D),
        "v_cache": normal(*cache, HKV, D),
        "k": normal(B, NEW, HKV, D),
        "v": normal(B, NEW, HKV, D),
        "cache_seqlens": np.array(LENGTHS, np.int64),
    }
    if paged:
        values["block_table"] = np.array(TABLE, np.int64)
    else:
        values["cache_batch_idx"] = np.array(CACHE_ROW_OF, np.int64)
    if rotary:
        angles = np.arange(10)[:, None] * np.array([1.0, 0.1])[None, :]
        values["rotary_cos"] = np.cos(angles).astype(np.float32)
        values["rotary_sin"] = np.sin(angles).astype(np.float32)
    values["alibi_slopes"] = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    if sinks:
        values["sinks"] = np.array([0.3, -0.5, 1.0, 0.0], np.float32)
    return values


def _varlen_values() -> dict:
    rng = np.random.default_rng(11)
    cu = np.array([0, 3, 7], np.int64)  # int64 like the positions: any of them fits in another
    angles = np.arange(10)[:, None] * np.array([1.0, 0.1])[None, :]
    return {
        "q": rng.standard_normal((7, 2, D)).astype(np.float32),
        "k": rng.standard_normal((7, 2, D)).astype(np.float32),
        "v": rng.standard_normal((7, 2, D)).astype(np.float32),
        "cu_seqlens_q": cu,
        "cu_seqlens_k": cu.copy(),
        "cos": np.cos(angles).astype(np.float32),
        "sin": np.sin(angles).astype(np.float32),
        "q_positions": np.array([2, 0, 5, 1, 3, 9, 4], np.int64),
        "k_positions": np.array([1, 1, 2, 0, 7, 8, 6], np.int64),
        "alibi_slopes": np.array([0.5, 0.25], np.float32),
        "sinks": np.array([0.3, -0.5], np.float32),
    }


def _first_written_byte(values, name) -> int:
    """Where another argument placed inside ``name`` does the most harm: a cache's first row that
    the append writes (sequence 0's first new position); elsewhere an entry whose value any small
    int keeps valid (an unused block-table entry, the last batch entry) or the middle."""
    x = values[name]
    if name in ("k_cache", "v_cache"):
        p = LENGTHS[0]
        if "block_table" in values:
            row = TABLE[0][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        else:
            row = CACHE_ROW_OF[0] * CACHE_WIDTH + p
        return row * x[0, 0].nbytes
    if x.ndim == 1 and np.issubdtype(x.dtype, np.integer) or name == "block_table":
        return x.nbytes - x.itemsize
    return x.nbytes // 2 // 8 * 8


def _arena(values, alias):
    """Every argument as a view of one byte buffer; ``alias`` = None, ("same", a, b) (a is b) or
    ("overlap", a, b) (a starts inside b, at b's most harmful byte). Writes b's values, then a's,
    except that an integer argument is written last (its values must stay valid; a float one
    then holds some integer bits: small denormals). Returns (views, arena)."""
    offsets, cursor = {}, 0
    order = list(values)
    if alias is not None:
        _, a, b = alias
        order = [b, a] + [n for n in order if n not in (a, b)]
    for name in order:
        if alias is not None and alias[0] == "same" and name == alias[1]:
            offsets[name] = offsets[alias[2]]
            continue
        if alias is not None and alias[0] == "overlap" and name == alias[1]:
            offsets[name] = offsets[alias[2]] + _first_written_byte(values, alias[2])
            cursor = max(cursor, offsets[name] + values[name].nbytes)
        else:
            offsets[name] = cursor
            cursor += values[name].nbytes
        cursor = -(-cursor // 64) * 64
    arena = np.zeros(cursor, np.uint8)
    views = {
        name: np.ndarray(values[name].shape, values[name].dtype, buffer=arena, offset=offsets[name])
        for name in values
    }
    if alias is not None and alias[0] == "same":
        views[alias[1]] = views[alias[2]]
    written = [n for n in order if not np.issubdtype(values[n].dtype, np.integer)]
    written += [n for n in order if np.issubdtype(values[n].dtype, np.integer)]
    for name in written:
        views[name][...] = values[name]
    return views, arena


def _pairs(values):
    """(mode, a, b) for every pair: a inside b, b a cache if either is (the append's target),
    else the one that tolerates any small int at its harmful byte; "same" where shapes allow."""
    names = list(values)
    caches = ("k_cache", "v_cache")
    tolerant = ("block_table", "cache_batch_idx", "cache_seqlens", "q_positions", "k_positions")
    for x, y in itertools.combinations(names, 2):
        a, b = (x, y) if y in caches or (x not in caches and y in tolerant) else (y, x)
        both_int = all(np.issubdtype(values[n].dtype, np.integer) for n in (a, b))
        if not (both_int and b not in tolerant):  # two cu_seqlens: only the same array
            yield ("overlap", a, b)
        if values[a].shape == values[b].shape and values[a].dtype == values[b].dtype:
            yield ("same", a, b)


def _call_kvcache(entry, args, backend):
    args = dict(args)
    if entry == "attention_kvcache":
        q, k_cache, v_cache, k, v = (args.pop(n) for n in ("q", "k_cache", "v_cache", "k", "v"))
        return fastpe.attention_kvcache(
            q, k_cache, v_cache, k, v, causal=True, backend=backend, **args
        )
    with fastpe.use_backend(backend):
        return flash_attn_with_kvcache(causal=True, rotary_interleaved=True, **args)


def _to_torch(views):
    """The same memory as tensors (one tensor per distinct view: "same" stays the same)."""
    made = {}
    return {n: made.setdefault(id(x), torch.from_numpy(x)) for n, x in views.items()}


def _failures(values, run, expected, *, framework="numpy"):
    """Run every aliased pair; returns a list of what went wrong (empty: all right)."""
    failures = []
    for alias in [None, *_pairs(values)]:
        views, arena = _arena(values, alias)
        as_passed = {name: np.array(x) for name, x in views.items()}
        before = arena.copy()
        args = _to_torch(views) if framework == "torch" else views
        refused = alias is not None and {alias[1], alias[2]} == {"k_cache", "v_cache"}
        try:
            out = run(args)
        except Exception as exc:  # judged below: only the documented refusal is right
            if refused and isinstance(exc, ValueError) and "k_cache and v_cache" in str(exc):
                if not np.array_equal(arena, before):
                    failures.append(f"{alias}: raised but wrote into the arguments")
                continue
            failures.append(f"{alias}: {type(exc).__name__}: {exc}")
            continue
        if refused:
            failures.append(f"{alias}: ran instead of refusing")
            continue
        got = out.numpy() if framework == "torch" else out
        want = expected(as_passed)
        if not np.allclose(got, want, rtol=1e-5, atol=1e-5):
            failures.append(f"{alias}: max |error| = {np.abs(got - want).max():.3g}")
    return failures


# ---------------------------------------------------------------------------------------------
# attention_kvcache, flash_attn_with_kvcache


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged, rotary", [(True, False), (False, True)], ids=["paged", "rotary"])
def test_kvcache_every_aliased_pair(backend, framework, paged, rotary):
    values = _kvcache_values(paged, rotary)
    failures = _failures(
        values,
        lambda args: _call_kvcache("attention_kvcache", args, backend),
        lambda a: _expected_kvcache(a, interleaved=False),
        framework=framework,
    )
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged, rotary", [(True, False), (False, True)], ids=["paged", "rotary"])
def test_flash_attn_with_kvcache_every_aliased_pair(backend, paged, rotary):
    values = _kvcache_values(paged, rotary, sinks=False)  # FlashAttention has no sinks
    failures = _failures(
        values,
        lambda args: _call_kvcache("flash_attn_with_kvcache", args, backend),
        lambda a: _expected_kvcache(a, interleaved=True),
    )
    assert not failures, "\n".join(failures)


def test_triton_interpreter_reads_q_before_the_append():
    """One small case through the Triton kernels (TRITON_INTERPRET=1 on CPU tensors): q is the
    rows that the append overwrites."""
    from fastpe.backends import unavailable_reason

    if unavailable_reason("triton") is not None:
        pytest.skip(f"triton: {unavailable_reason('triton')}")
    values = _kvcache_values(paged=True, rotary=False)
    views, _ = _arena(values, ("overlap", "q", "k_cache"))
    as_passed = {name: np.array(x) for name, x in views.items()}
    out = _call_kvcache("attention_kvcache", _to_torch(views), "triton")
    np.testing.assert_allclose(
        out.numpy(), _expected_kvcache(as_passed, interleaved=False), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_caches_may_share_memory_when_nothing_is_appended(backend):
    values = _kvcache_values(paged=True, rotary=False)
    del values["k"], values["v"]
    views, _ = _arena(values, ("same", "k_cache", "v_cache"))
    args = {**views, "cache_seqlens": views["cache_seqlens"] + NEW}  # read-only: no append
    q, cache = args.pop("q"), args.pop("k_cache")
    del args["v_cache"]
    out = fastpe.attention_kvcache(q, cache, cache, causal=True, backend=backend, **args)
    lengths = values["cache_seqlens"] + NEW
    expected = []
    for b in range(B):
        rows = [TABLE[b][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(lengths[b])]
        keys = np.asarray(cache, np.float64).reshape(-1, HKV, D)[rows]
        expected.append(
            _attend(
                np.asarray(q[b], np.float64),
                keys,
                keys,
                slopes=values["alibi_slopes"],
                sinks=values["sinks"],
            )
        )
    np.testing.assert_allclose(out, np.stack(expected), rtol=1e-5, atol=1e-5)


def test_refusal_names_both_caches_and_the_fix():
    values = _kvcache_values(paged=True, rotary=False)
    views, arena = _arena(values, ("overlap", "k_cache", "v_cache"))
    before = arena.copy()
    with pytest.raises(ValueError, match="k_cache and v_cache share memory.*pass separate caches"):
        _call_kvcache("attention_kvcache", views, "numpy")
    assert np.array_equal(arena, before)


def test_interleaved_halves_of_one_buffer_are_separate_caches():
    """k_cache = kv[:, 0], v_cache = kv[:, 1] of one [blocks, 2, ...] buffer: address ranges
    overlap, elements do not; the append is allowed."""
    values = _kvcache_values(paged=True, rotary=False)
    kv = np.stack([values["k_cache"], values["v_cache"]], axis=1)
    out = fastpe.attention_kvcache(
        values["q"],
        kv[:, 0],
        kv[:, 1],
        values["k"],
        values["v"],
        causal=True,
        cache_seqlens=values["cache_seqlens"],
        block_table=values["block_table"],
        alibi_slopes=values["alibi_slopes"],
        sinks=values["sinks"],
        backend="numpy",
    )
    np.testing.assert_allclose(out, _expected_kvcache(values, interleaved=False), atol=1e-5)
    np.testing.assert_array_equal(kv[4, 0, 3], values["k"][0, 0])  # the append landed


# ---------------------------------------------------------------------------------------------
# attention_varlen: nothing is written, so every aliasing reads the values as passed


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_every_aliased_pair(backend, framework):
    def run(a):
        rope = {
            "cos": a["cos"],
            "sin": a["sin"],
            "q_positions": a["q_positions"],
            "k_positions": a["k_positions"],
        }
        return fastpe.attention_varlen(
            a["q"],
            a["k"],
            a["v"],
            a["cu_seqlens_q"],
            a["cu_seqlens_k"],
            causal=True,
            rope=rope,
            alibi_slopes=a["alibi_slopes"],
            sinks=a["sinks"],
            backend=backend,
        )

    failures = _failures(_varlen_values(), run, _expected_varlen, framework=framework)
    assert not failures, "\n".join(failures)
