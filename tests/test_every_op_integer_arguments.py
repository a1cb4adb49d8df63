"""The integer sweep: every integer argument of every public op (tables, apply_rope, embed, the
attention ops, flash_attn_*, fastpe.nn), given values at and past the int32/int64/uint64 limits,
negative, unsigned or 0-dim. Each call either works — and then gives what the same call with the
plain int / int64 value gives — or raises a ValueError or TypeError naming the argument (or, for
an index outside its table, fastpe's documented IndexError naming it), and writes nothing first.
NumPy backend: the checks run before any kernel.

One table over all ops, so that every op is held to the same rule by the same checker.
"""

from __future__ import annotations

import numpy as np
import pytest
from _testkit import to_np, torch

import fastpe
import fastpe.nn
from fastpe import flash_attn

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
