"""Validated inputs of the serving ops: packed variable-length attention and KV-cache attention.

Kept apart from ``_inputs.py`` (same conventions, same helpers). Sequence boundaries
(``cu_seqlens``), cache lengths and block tables are read on the host once, here: every later
index computation trusts them, so these checks are what keeps the kernels inside their tensors.
On a GPU that read is one host sync per call (FlashAttention itself reads ``max_seqlen`` from
the caller instead; we check the values because a wrong boundary is an out-of-bounds access).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from fastpe import _arrays, _kv_quant
from fastpe._arrays import Placement
from fastpe._inputs import _AttentionGradients, _features, _Inputs
from fastpe._options import AttentionOptions, Positions, Rope, check_rope_tables
from fastpe._validate import (
    check_bool,
    check_float_array,
    check_int,
    check_int_array,
    check_range,
    check_same_placement,
    is_int_scalar,
)
from fastpe.backends._serving import rows_per_block


def _host_ints(name: str, x, *, ndim: int) -> np.ndarray:
    x = check_int_array(name, x, ndim=ndim)
    return _arrays.to_int64(x)


def check_cu_seqlens(name: str, cu, total: int) -> np.ndarray:
    """``cu`` int32/int64 [B + 1]: starts at 0, non-decreasing, ends at ``total`` (the packed
    length). Returned as host int64."""
    cu_array = check_int_array(name, cu, ndim=1)
    if _arrays.dtype_name(cu_array) not in ("int32", "int64"):
        raise TypeError(f"{name} must be int32 or int64; got {_arrays.dtype_name(cu_array)}")
    values = _arrays.to_int64(cu_array)
    if values.shape[0] < 1:
        raise ValueError(f"{name} must have B + 1 >= 1 entries; got an empty array")
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0; got {name}[0] = {int(values[0])}")
    steps = np.diff(values)
    if (steps < 0).any():
        at = int(np.argmax(steps < 0)) + 1
        raise ValueError(
            f"{name} must be non-decreasing; got {name}[{at}] = {int(values[at])} < "
            f"{name}[{at - 1}] = {int(values[at - 1])}"
        )
    if values[-1] != total:
        raise ValueError(
            f"{name} must end at the packed length {total}; got {name}[-1] = {int(values[-1])}"
        )
    return values


def _check_max_seqlen(name: str, value, lengths: np.ndarray) -> int:
    """The caller's bound on the sequence lengths (None: the longest). Kernels may size work
    by it (varlen key pages), so a bound above the packed total is stored as the total: it
    bounds every sequence just as well and keeps their index arithmetic small."""
    longest = int(lengths.max(initial=0))
    if value is None:
        return longest
    value = check_int(name, value, minimum=0)
    if value < longest:
        raise ValueError(
            f"{name} = {value} is smaller than the longest sequence ({longest}); pass at least "
            f"{longest} or None"
        )
    return min(value, int(lengths.sum()))


def _default_positions(cu: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """Per packed token: its index within its sequence plus that sequence's shift, clamped at 0."""
    lengths = np.diff(cu)
    index = np.arange(cu[-1]) - np.repeat(cu[:-1], lengths)
    return np.maximum(index + np.repeat(shift, lengths), 0)


def _check_dtype_and_dims(named: dict) -> str:
    dtypes = {name: _arrays.dtype_name(x) for name, x in named.items()}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{n}: {d}" for n, d in dtypes.items())
        raise TypeError(f"{', '.join(named)} must share one dtype; got {listing}")
    return next(iter(dtypes.values()))


def _check_heads_and_dim(q, hq, k_name, hkv, d):
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"q heads ({hq}) must be a multiple of {k_name} heads ({hkv}) for "
            "grouped-query attention"
        )
    if d == 0:
        raise ValueError(f"head_dim must be >= 1; got q of shape {tuple(q.shape)}")


@dataclass(frozen=True, eq=False)
class AttentionVarlenInputs(_Inputs):
    op: ClassVar[str] = "attention_varlen"
    q: Any  # [Tq, Hq, D]
    k: Any  # [Tk, Hkv, D]
    v: Any  # [Tk, Hkv, Dv]
    cu_q: np.ndarray  # host int64 [B + 1]
    cu_k: np.ndarray
    max_seqlen_q: int
    max_seqlen_k: int
    options: AttentionOptions  # fused RoPE's positions: host int64, one per packed token
    dtype: str
    placement: Placement

    @property
    def batch(self) -> int:
        return self.cu_q.shape[0] - 1

    @property
    def q_lengths(self) -> np.ndarray:
        return np.diff(self.cu_q)

    @property
    def k_lengths(self) -> np.ndarray:
        return np.diff(self.cu_k)

    @property
    def features(self) -> frozenset[str]:
        return self.options.features() | _features(
            gqa=self.q.shape[1] != self.k.shape[1],
            value_dim_differs=self.q.shape[2] != self.v.shape[2],
        )

    @classmethod
    def build(cls, q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, **options):
        """``options``: the public keywords of ``AttentionOptions.build``."""
        q = check_float_array("q", q, ndim=3)
        k = check_float_array("k", k, ndim=3)
        v = check_float_array("v", v, ndim=3)
        dtype = _check_dtype_and_dims({"q": q, "k": k, "v": v})
        total_q, hq, d = q.shape
        total_k, hkv = k.shape[0], k.shape[1]
        if k.shape[2] != d:
            raise ValueError(f"k's head dim {k.shape[2]} must equal q's head dim {d}")
        if tuple(v.shape[:2]) != (total_k, hkv):
            raise ValueError(
                f"v must be [total_k, Hkv, Dv] matching k's {tuple(k.shape[:2])}; "
                f"got {tuple(v.shape)}"
            )
        _check_heads_and_dim(q, hq, "k/v", hkv, d)
        cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q)
        cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k)
        if cu_q.shape != cu_k.shape:
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must both have B + 1 entries; got "
                f"{cu_q.shape[0]} and {cu_k.shape[0]}"
            )
        batch = cu_q.shape[0] - 1
        q_len, k_len = np.diff(cu_q), np.diff(cu_k)

        def build_rope(value, options):
            shift = k_len - q_len if options.bottom_right else np.zeros(batch, np.int64)
            return Rope.build_packed(
                value,
                head_dim=d,
                q_default=_default_positions(cu_q, shift),
                k_default=_default_positions(cu_k, np.zeros(batch, np.int64)),
            )

        options = AttentionOptions.build(
            **options,
            head_dim=d,
            heads=hq,
            batch=batch,
            # a query and a key of one sequence are less than Sq + Sk positions apart
            span=int(q_len.max(initial=0) + k_len.max(initial=0)),
            build_rope=build_rope,
        )
        rope = options.rope
        placement = check_same_placement(
            {
                "q": q,
                "k": k,
                "v": v,
                "cu_seqlens_q": _arrays.as_array(cu_seqlens_q),
                "cu_seqlens_k": _arrays.as_array(cu_seqlens_k),
                "rope['cos']": None if rope is None else rope.cos,
                "rope['sin']": None if rope is None else rope.sin,
                **options.arrays(),
            }
        )
        return cls(
            q=q,
            k=k,
            v=v,
            cu_q=cu_q,
            cu_k=cu_k,
            max_seqlen_q=_check_max_seqlen("max_seqlen_q", max_seqlen_q, q_len),
            max_seqlen_k=_check_max_seqlen("max_seqlen_k", max_seqlen_k, k_len),
            options=options,
            dtype=dtype,
            placement=placement,
        )


@dataclass(frozen=True, eq=False)
class AttentionKVCacheInputs(_Inputs):
    """``flash_attn_with_kvcache``: queries [B, Sq, Hq, D] against a cache that is paged
    (k_cache [num_blocks, block_size, Hkv, D] + block_table) or contiguous ([Bc, S, Hkv, D],
    rows chosen by cache_batch_idx). Both are held as pages: a contiguous cache is one page of
    S rows per cache row, its "block table" is cache_batch_idx[:, None]."""

    op: ClassVar[str] = "attention_kvcache"
    q: Any  # [B, Sq, Hq, D]
    k_cache: Any
    v_cache: Any
    k: Any  # new keys [B, Sn, Hkv, D] or None
    v: Any
    cache_seqlens: np.ndarray  # host int64 [B]: keys already in the cache
    page_table: np.ndarray  # host int64 [B, pages]
    page_size: int
    rows_per_block: int  # block stride in rows of the caches' row views (backends/_serving.py)
    paged: bool
    # bottom-right aligned; fused RoPE (rotary_cos/sin) positions host int64 [B, Sq] and [B, Sn]
    options: AttentionOptions
    dtype: str
    placement: Placement
    quant: _kv_quant.KVQuant | None = None  # quantized caches: their kind and scales

    @property
    def new_tokens(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    @property
    def seqlens(self) -> np.ndarray:
        """Keys each query row sees: the cache plus the appended tokens."""
        return self.cache_seqlens + self.new_tokens

    @property
    def features(self) -> frozenset[str]:
        return self.options.features() | _features(
            paged=self.paged,
            append=self.k is not None,
            gqa=self.q.shape[2] != self.k_cache.shape[2],
            value_dim_differs=self.q.shape[3] != self.v_cache.shape[3],
        )

    @classmethod
    def build(
        cls,
        q,
        k_cache,
        v_cache,
        *,
        k,
        v,
        cache_seqlens,
        block_table,
        cache_batch_idx,
        rotary_cos,
        rotary_sin,
        rotary_interleaved,
        k_scale=None,
        v_scale=None,
        **options,
    ):
        """``options``: the public keywords of ``AttentionOptions.build`` but ``rope`` (here
        ``rotary_cos``, ``rotary_sin``, ``rotary_interleaved``); always bottom-right aligned."""
        q = check_float_array("q", q, ndim=4)
        k_cache = _kv_quant.check_cache("k_cache", k_cache)
        v_cache = _kv_quant.check_cache("v_cache", v_cache)
        batch, sq, hq, d = q.shape
        rows, width, hkv = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
        if k_cache.shape[3] != d:
            raise ValueError(f"k_cache's head dim {k_cache.shape[3]} must equal q's head dim {d}")
        if tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
            raise ValueError(
                f"v_cache must match k_cache's first three dims {tuple(k_cache.shape[:3])}; "
                f"got {tuple(v_cache.shape)}"
            )
        _check_heads_and_dim(q, hq, "k_cache", hkv, d)
        per_block = _check_cache_layouts(k_cache, v_cache)
        quant = _kv_quant.check(
            q,
            k_cache,
            v_cache,
            k_scale,
            v_scale,
            batch=batch,
            per_block=per_block,
            appending=k is not None,
        )
        named = {"q": q} if quant else {"q": q, "k_cache": k_cache, "v_cache": v_cache}
        if (k is None) != (v is None):
            raise ValueError("k and v (new tokens to append) must be given together")
        if k is not None:
            k = check_float_array("k", k, ndim=4)
            v = check_float_array("v", v, ndim=4)
            if tuple(k.shape) != (batch, k.shape[1], hkv, d) or tuple(v.shape) != (
                *k.shape[:3],
                v_cache.shape[3],
            ):
                raise ValueError(
                    f"k must be [B, S_new, Hkv, D] = [{batch}, S_new, {hkv}, {d}] and v "
                    f"[B, S_new, Hkv, Dv]; got k {tuple(k.shape)}, v {tuple(v.shape)}"
                )
            named.update(k=k, v=v)
            for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
                if not _arrays.is_tensor(cache) and not cache.flags.writeable:
                    raise ValueError(f"appending k/v writes into {name}; got a read-only array")
                if _arrays.may_overlap(cache):
                    raise ValueError(
                        f"appending k/v writes into {name}, whose elements share memory "
                        f"(strides {_arrays.strides(cache)}); pass a cache with distinct elements"
                    )
        dtype = _check_dtype_and_dims(named)
        new = 0 if k is None else k.shape[1]
        paged = block_table is not None
        if paged:
            if cache_batch_idx is not None:
                raise ValueError(
                    "cache_batch_idx selects rows of a contiguous cache; "
                    "with block_table pages are chosen by the table"
                )
            table = _host_ints("block_table", block_table, ndim=2)
            if table.shape[0] != batch:
                raise ValueError(
                    f"block_table must be [B, max_blocks] with B = {batch}; got {table.shape}"
                )
            page_size, capacity = width, table.shape[1] * width
        else:
            if cache_batch_idx is None:
                if rows < batch:
                    raise ValueError(
                        f"k_cache has {rows} rows for a batch of {batch}; pass cache_batch_idx "
                        "or a cache with at least B rows"
                    )
                table = np.arange(batch, dtype=np.int64)[:, None]
            else:
                index = _host_ints("cache_batch_idx", cache_batch_idx, ndim=1)
                if index.shape != (batch,):
                    raise ValueError(
                        f"cache_batch_idx must have shape [B] = [{batch}]; got {index.shape}"
                    )
                check_range("cache_batch_idx", index, 0, rows, what=f"(k_cache has {rows} rows)")
                table = index[:, None]
            page_size, capacity = width, width
        lengths = _check_cache_seqlens(cache_seqlens, batch, capacity, new)
        total = lengths + new
        pages = -(-total // page_size)  # pages each sequence reads
        used = np.arange(table.shape[1])[None, :] < pages[:, None]
        if paged:
            bad = used & ((table < 0) | (table >= rows))
            if bad.any():
                b, p = (int(i) for i in np.argwhere(bad)[0])
                raise IndexError(
                    f"block_table contains {int(table[b, p])} at index [{b}, {p}], outside "
                    f"[0, {rows}) (k_cache has {rows} blocks); sequence {b} reads its first "
                    f"{int(pages[b])} blocks"
                )
        if new:
            _check_no_shared_written_pages(table, used, lengths, total, page_size, paged)

        def build_rope(value, options):
            if k is None:
                raise ValueError(
                    "rotary_cos/rotary_sin rotate the new k and q at their cache positions; "
                    "they need k and v (keys already in the cache are stored rotated)"
                )
            cos, sin = check_rope_tables("rotary_", *value, d)
            k_positions = lengths[:, None] + np.arange(new)[None, :]
            if options.causal or options.window is not None:
                q_positions = lengths[:, None] + np.arange(sq)[None, :]
            else:  # FlashAttention: every query at the first new position
                q_positions = np.broadcast_to(lengths[:, None], (batch, sq))
            needed = int(max(k_positions.max(initial=0), q_positions.max(initial=0))) + 1
            if needed > cos.shape[0]:
                raise IndexError(
                    f"rotary_cos/rotary_sin have {cos.shape[0]} rows; positions up to "
                    f"{needed - 1} are needed (cache_seqlens + new tokens)"
                )
            interleaved = check_bool("rotary_interleaved", rotary_interleaved)
            return Rope(cos, sin, interleaved, Positions(q_positions), Positions(k_positions))

        if (rotary_cos is None) != (rotary_sin is None):
            raise ValueError("rotary_cos and rotary_sin must be given together")
        options = AttentionOptions.build(
            **{"causal_alignment": "bottom_right", **options},
            rope=None if rotary_cos is None else (rotary_cos, rotary_sin),
            head_dim=d,
            heads=hq,
            batch=batch,
            # a query and a key of one sequence are less than Sq + capacity positions apart; a
            # window wider than that restricts nothing and counts as none (for the rotary rule)
            span=sq + capacity,
            build_rope=build_rope,
        )
        if k is not None:
            q, k, v, lengths, table, options = _read_before_the_append(
                k_cache, v_cache, q=q, k=k, v=v, lengths=lengths, table=table, options=options
            )
        rope = options.rope
        placement = check_same_placement(
            {
                **named,
                "rotary_cos": None if rope is None else rope.cos,
                "rotary_sin": None if rope is None else rope.sin,
                "cache_seqlens": _arrays.as_array(cache_seqlens)
                if not is_int_scalar(cache_seqlens)
                else None,
                "block_table": None if block_table is None else _arrays.as_array(block_table),
                "cache_batch_idx": None
                if cache_batch_idx is None
                else _arrays.as_array(cache_batch_idx),
                **options.arrays(),
                **(quant.arrays() if quant else {}),
            }
        )
        return cls(
            q=q,
            k_cache=k_cache,
            v_cache=v_cache,
            k=k,
            v=v,
            cache_seqlens=lengths,
            page_table=table,
            page_size=page_size,
            rows_per_block=per_block,
            paged=paged,
            options=options,
            dtype=dtype,
            placement=placement,
            quant=quant,
        )

    def written_rows(self):
        """(block, offset) index arrays [B, Sn] where the new tokens go."""
        pos = self.cache_seqlens[:, None] + np.arange(self.new_tokens)[None, :]
        page = pos // self.page_size
        block = np.take_along_axis(self.page_table, page, axis=1)
        return block, pos - page * self.page_size


def _check_cache_layouts(k_cache, v_cache) -> int:
    """Rows per block of the row views both caches are read through in place (one page table
    addresses both, so they must agree)."""
    per_k = rows_per_block("k_cache", k_cache)
    per_v = rows_per_block("v_cache", v_cache)
    if per_k != per_v:
        raise ValueError(
            f"k_cache and v_cache must place their blocks the same number of positions apart "
            f"to be read in place with one block table; got block strides of {per_k} (k_cache, "
            f"strides {_arrays.strides(k_cache)}) and {per_v} (v_cache, strides "
            f"{_arrays.strides(v_cache)}) positions; pass caches of one layout, e.g. both "
            f".contiguous(), made once and kept for every step"
        )
    return per_k


def _check_cache_seqlens(cache_seqlens, batch: int, capacity: int, new: int) -> np.ndarray:
    """Host int64 [B] lengths with ``0 <= length <= capacity - new``, compared in that form so
    that lengths near 2**63 cannot wrap past the check (``length + new`` would)."""
    if is_int_scalar(cache_seqlens):
        given = check_int("cache_seqlens", cache_seqlens)
        _check_cache_length("cache_seqlens", given, capacity, new)
        return np.full(batch, given, np.int64)
    lengths = _host_ints("cache_seqlens", cache_seqlens, ndim=1)
    if lengths.shape != (batch,):
        raise ValueError(
            f"cache_seqlens must be an int or have shape [B] = [{batch}]; got {lengths.shape}"
        )
    bad = (lengths < 0) | (lengths > capacity - new)
    if bad.any():
        b = int(np.argmax(bad))
        _check_cache_length(f"cache_seqlens[{b}]", int(lengths[b]), capacity, new)
    return lengths


def _check_cache_length(name: str, length: int, capacity: int, new: int) -> None:
    accepted = f"cache_seqlens must be >= 0 and <= {capacity - new}"
    if length < 0:
        raise ValueError(f"{name} = {length}; {accepted}")
    if length > capacity - new:
        raise ValueError(
            f"{name} = {length} plus {new} new tokens needs {length + new} cache positions; "
            f"the cache holds {capacity} per sequence ({accepted})"
        )


def _check_no_shared_written_pages(table, used, lengths, total, page_size, paged) -> None:
    """A page (cache row) that receives new tokens must belong to one sequence only: another
    sequence reading or writing it would see, or race with, the write."""
    blocks, counts = np.unique(table[used], return_counts=True)
    shared = blocks[counts > 1]
    if not shared.size:
        return
    what = "block_table block" if paged else "cache row (cache_batch_idx)"
    pages = np.arange(table.shape[1])[None, :]
    written = (pages >= (lengths // page_size)[:, None]) & (
        pages <= ((total - 1) // page_size)[:, None]
    )
    written &= (total > lengths)[:, None]
    clash = written & np.isin(table, shared)
    if clash.any():
        b, p = (int(i) for i in np.argwhere(clash)[0])
        block = int(table[b, p])
        users = sorted({int(i) for i in np.argwhere(used & (table == block))[:, 0]})
        raise ValueError(
            f"{what} {block} receives new tokens of sequence {b} but is also read by "
            f"sequences {users} (or twice by one); pages that are appended to must not be shared"
        )


def _read_before_the_append(k_cache, v_cache, *, options, **read):
    """Every argument means its values as passed, read before the append writes into the
    caches (FlashAttention's order: q and the new k/v are read, then stored): one that shares
    memory with a cache is replaced by a private copy, taken here before anything is written,
    so no backend reads a value the append has changed. ``lengths`` and ``table`` are the host
    int64 arrays of cache_seqlens and block_table (views of the caller's memory when it held
    int64). Two caches that share an element have no meaning for an append (which of k and v
    lands there?): refused. Returns the read arguments in order, then ``options`` with its
    arrays (and fused RoPE's tables) read alike."""
    caches = [_arrays.byte_bounds(c) for c in (k_cache, v_cache)]
    if _arrays.bounds_overlap(*caches) and _arrays.shares_element(k_cache, v_cache):
        raise ValueError(
            f"k_cache and v_cache share memory (shapes {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}, strides {_arrays.strides(k_cache)} and "
            f"{_arrays.strides(v_cache)}), and appending k/v writes into both; pass separate "
            "caches (or views of one buffer that share no element), or append nothing"
        )

    def private(x):
        # the conservative address-range test: copying a small argument that shares nothing is
        # harmless, missing one that does is not
        if x is None:
            return x
        bounds = _arrays.byte_bounds(x)
        if _arrays.bounds_overlap(bounds, caches[0]) or _arrays.bounds_overlap(bounds, caches[1]):
            return _arrays.private_copy(x)
        return x

    options = options._replace(**{name: private(x) for name, x in options.arrays().items()})
    if options.rope is not None:
        rope = options.rope
        options = options._replace(rope=rope._replace(cos=private(rope.cos), sin=private(rope.sin)))
    return (*(private(x) for x in read.values()), options)


@dataclass(frozen=True, eq=False)
class AttentionVarlenBackwardInputs(_AttentionGradients):
    """The gradients of one attention_varlen call (docs/math.md#packed-variable-length-backward):
    grad_out, out [Tq, Hq, Dv]; grad_lse, lse [Hq, Tq]."""

    op: ClassVar[str] = "attention_varlen_backward"

    @classmethod
    def build(cls, forward: AttentionVarlenInputs, *, grad_out, grad_lse, out, lse):
        # shapes are checked per sequence, by the attention_backward records the backward builds
        return cls(
            forward=forward,
            grad_out=grad_out,
            grad_lse=grad_lse,
            out=out,
            lse=lse,
            dtype=forward.dtype,
            placement=forward.placement,
        )
