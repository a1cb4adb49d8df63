"""The serving adapter layer: what every backend's ``attention_varlen`` and ``attention_kvcache``
share, so that a backend supplies only its paged kernel and the few steps where its array
library differs (``ServingArrays``).

Both ops run one paged kernel. ``paged_arguments`` turns either record into its arguments
(``PagedArguments``): query rows, key/value rows, and where each sequence's queries and keys
lie in them. A packed batch is one page per sequence (its keys are contiguous rows from
``cu_seqlens_k[b]``); a KV cache is read in place, after the rotate-then-append step
(``rotate_then_append``: the new keys rotated at their cache positions and stored, rounded to
the cache's dtype, the queries rotated at theirs).

The kernels read keys as rows of a [R, Hkv, D] array: key j of sequence b is row
``page_start[b, j // block_size] + j % block_size``. A cache [num_blocks, block_size, Hkv, D]
is such a row array without any copy whenever its positions are rows of one stride and its
block stride is a whole number of those rows — contiguous caches, and also the K and V halves
of a ``[num_blocks, 2, block_size, Hkv, D]`` buffer (vLLM's and transformers' allocation), a
cache sliced along its positions or heads, heads or head dims at any stride. The row view is
``as_strided`` over the cache's own memory with ``page_start = page_table · rows_per_block``.
A reshape to rows would instead copy such a cache whole on every call (hundreds of MB per
decode step). Layouts that cannot be addressed this way are refused by ``rows_per_block``
before anything is written (docs/README.md#kv-caches-and-their-memory-layout).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from fastpe import _arrays, _kv_quant


def rows_per_block(name: str, cache) -> int:
    """Rows of the row view between the starts of two consecutive blocks of ``cache``
    [num_blocks, block_size, H, D]; ValueError naming ``name`` for a layout that cannot be read
    in place."""
    if not _arrays.is_tensor(cache) and any(s % cache.itemsize for s in cache.strides):
        raise ValueError(
            f"{name} has byte strides {cache.strides}, not multiples of its item size "
            f"{cache.itemsize}; pass np.ascontiguousarray({name}), made once and kept"
        )
    blocks, width = cache.shape[0], cache.shape[1]
    block_stride, row_stride = _arrays.strides(cache)[:2]
    # strides of dims of size 1 are arbitrary (torch and NumPy report anything there)
    if width == 1:
        return 1  # one row per block: the row stride is the block stride
    if blocks <= 1:
        return width  # only block 0 exists: any multiplier addresses it
    if row_stride > 0 and block_stride >= 0 and block_stride % row_stride == 0:
        return block_stride // row_stride
    raise ValueError(
        f"{name} of shape {tuple(cache.shape)} has strides {_arrays.strides(cache)} (elements): "
        f"its block stride {block_stride} is not a non-negative multiple of its position stride "
        f"{row_stride}, so it cannot be read in place as rows of [block_size, H, D] pages; "
        f"pass {name}.contiguous() (or np.ascontiguousarray), made once and kept for every step"
    )


def row_view(cache, per_block: int):
    """``cache`` [num_blocks, block_size, H, D] as rows [R, H, D] over the same memory (no copy;
    a NumPy array or a tensor, as given): row ``block · per_block + offset`` is
    ``cache[block, offset]``."""
    blocks, width, heads, dim = cache.shape
    if per_block == width and not _arrays.is_tensor(cache) and cache.flags.c_contiguous:
        return cache.reshape(blocks * width, heads, dim)  # the common layout: a plain view
    strides = _arrays.strides(cache)
    row_stride = strides[0] if width == 1 else strides[1]
    rows = (blocks - 1) * per_block + width if blocks else 0
    shape, steps = (rows, heads, dim), (row_stride, *strides[2:])
    if _arrays.is_tensor(cache):
        return cache.as_strided(shape, steps)  # storage offset kept: the cache's first element
    from numpy.lib.stride_tricks import as_strided

    return as_strided(
        cache, shape, tuple(s * cache.itemsize for s in steps), writeable=cache.flags.writeable
    )


def cache_rows(inp, k_cache, v_cache):
    """(k rows, v rows, page_start int64 [B, pages]) for the kernels, from the record's caches
    or their host views (same shapes and strides)."""
    per_block = inp.rows_per_block
    return (
        row_view(k_cache, per_block),
        row_view(v_cache, per_block),
        inp.plan.page_start(per_block),
    )


def write_new_tokens(inp, k_cache, v_cache, k_new, v_new) -> None:
    """k_cache[block, offset] = k_new (and v), for the (block, offset) of every new token.
    The caches are the caller's or views of their memory (CPU kernels write host views); a
    tensor cache is indexed with the plan's device copies of those arrays (no upload here)."""
    block, offset = inp.written_rows()
    for cache, new in ((k_cache, k_new), (v_cache, v_new)):
        if _arrays.is_tensor(cache):
            index = (
                inp.plan.on_device(block, cache.device),
                inp.plan.on_device(offset, cache.device),
            )
            cache[index] = new.to(cache.dtype)
        else:
            cache[block, offset] = new


class PagedArguments(NamedTuple):
    """The arguments of every backend's paged kernel. Sequence b's queries are rows
    ``q_start[b] : q_start[b] + q_len[b]`` of ``q``; its key j is row
    ``page_start[b, j // page_size] + j % page_size`` of ``k`` and ``v``."""

    q: Any  # [Tq, Hq, D], already rotated where the call fuses RoPE
    k: Any  # [R, Hkv, D] rows (a cache's row view: no copy)
    v: Any  # [R, Hkv, Dv]
    # host int64 arrays of the record's plan (a GPU backend finds their device copies there)
    q_start: np.ndarray  # [B]
    q_len: np.ndarray  # [B]
    k_len: np.ndarray  # [B]: keys each sequence reads
    page_start: np.ndarray  # [B, pages]: first row of each page
    page_size: int
    max_q: int  # the longest sequence's queries and keys (launch sizes, read on the host)
    max_k: int
    # quantized caches: the scale of row r of sequence b, kv head h, is k_scale[b, r, h]
    k_scale: Any = None  # [B, R, Hkv] float32 (a view: zero strides where it does not vary)
    v_scale: Any = None


class ServingArrays:
    """A backend's hooks into the shared steps, made per call (``self.inp`` is the record):
    only what differs between array libraries (NumPy float64, host bits for Numba, device
    tensors for Triton) and the kernel call itself."""

    def __init__(self, inp):
        self.inp = inp

    def load(self, x):
        """q (and a packed batch's k/v) as the kernel reads them."""
        raise NotImplementedError

    def view(self, x):
        """A cache, or new keys/values to store in it, as an array over the caller's memory
        (writes through it reach the caller's cache)."""
        raise NotImplementedError

    def widen(self, x):
        """New keys/values for a quantized cache, in float32 or wider (they are quantized
        from it)."""
        raise NotImplementedError

    def tables(self, cos, sin):
        """The RoPE tables as ``rotate`` reads them."""
        raise NotImplementedError

    def rotate(self, x, cos, sin, positions, interleaved: bool, *, store: bool):
        """x [B, T, H, D] rotated at positions (host int64 [B, T], or [T] when B = 1: an array
        of the record's plan, as given, so that a GPU backend finds its device copy). ``store``: keys about to be
        written to the cache, returned in the cache's dtype (what later steps read back); else
        in whatever precision the kernel reads best."""
        raise NotImplementedError

    def attend(self, args: PagedArguments):
        """The backend's paged kernel: (out [Tq, Hq, Dv], lse [Hq, Tq]), with the record's
        options (``self.inp.options.launched(...)``)."""
        raise NotImplementedError

    def output(self, x, dtype: str):
        """A kernel result as the caller's array type, on its device, in ``dtype``."""
        raise NotImplementedError


class ServingImplementation:
    """A backend's ``attention_varlen`` and ``attention_kvcache`` (mixed in before its
    Implementation base by ``implementations``): ``run`` is this layer with the backend's
    ``serving_arrays`` hooks."""

    serving_arrays: type[ServingArrays]

    def run(self, inp):
        return run(inp, self.serving_arrays(inp))


def implementations(backend: type, serving_arrays: type[ServingArrays]) -> tuple[type, type]:
    """A backend's ``AttentionVarlen`` and ``AttentionKVCache``: this layer on its
    ``serving_arrays`` hooks, with the capability table of ``backend`` (the backend's
    ``Implementation`` base, or a subclass of it with the serving ops' limits). Paged and
    contiguous caches both go through the backend's one paged kernel."""
    return tuple(
        type(
            name,
            (ServingImplementation, backend),
            {"op": op, "serving_arrays": serving_arrays, "__module__": backend.__module__},
        )
        for name, op in (
            ("AttentionVarlen", "attention_varlen"),
            ("AttentionKVCache", "attention_kvcache"),
        )
    )


def rotate_then_append(inp, arrays: ServingArrays, q, k_cache, v_cache):
    """Store the call's new keys/values into the caches (keys rotated first where the call
    fuses rotary); returns q, rotated at its positions where the call fuses rotary."""
    quantized = inp.quant is not None  # new rows are quantized from float32 (or wider)
    k_new, v_new = ((arrays.widen if quantized else arrays.view)(x) for x in (inp.k, inp.v))
    rope = inp.options.rope
    if rope is not None:
        cos, sin = arrays.tables(rope.cos, rope.sin)
        k_new = arrays.rotate(
            k_new, cos, sin, rope.k_positions.array, rope.interleaved, store=not quantized
        )
        q = arrays.rotate(q, cos, sin, rope.q_positions.array, rope.interleaved, store=False)
    if quantized:
        _kv_quant.append(inp, k_cache, v_cache, k_new, v_new)
    else:
        write_new_tokens(inp, k_cache, v_cache, k_new, v_new)
    return q


def paged_arguments(inp, arrays: ServingArrays) -> PagedArguments:
    """An ``attention_varlen`` or ``attention_kvcache`` record as paged-kernel arguments (for a
    KV cache, after the rotate-then-append step has written the new tokens)."""
    if inp.op == "attention_varlen":
        q, k, v = (arrays.load(x) for x in (inp.q, inp.k, inp.v))
        rope = inp.options.rope
        if rope is not None:
            # rotated once before the kernel: the packed tokens as one row of one position each
            cos, sin = arrays.tables(rope.cos, rope.sin)
            q, k = [
                arrays.rotate(x[None], cos, sin, positions.array, rope.interleaved, store=False)[0]
                for x, positions in ((q, rope.q_positions), (k, rope.k_positions))
            ]
        # one page per sequence: its keys are the packed rows from cu_k[b]
        plan = inp.plan
        return PagedArguments(
            q,
            k,
            v,
            q_start=plan.q_start,
            q_len=plan.q_len,
            k_len=plan.k_len,
            page_start=plan.page_start,
            page_size=max(plan.max_seqlen_k, 1),
            max_q=plan.longest_q,
            max_k=plan.longest_k,
        )
    batch, sq, hq, d = inp.q.shape
    # CPU caches become views of the caller's memory: the append writes the caller's caches
    q, k_cache, v_cache = arrays.load(inp.q), arrays.view(inp.k_cache), arrays.view(inp.v_cache)
    if inp.k is not None:
        q = rotate_then_append(inp, arrays, q, k_cache, v_cache)
    # the caches are read in place through row views, whatever their strides (a reshape to
    # rows would copy a non-contiguous cache whole on every call)
    k_rows, v_rows, page_start = cache_rows(inp, k_cache, v_cache)
    plan = inp.plan
    scales = {}
    if inp.quant is not None:
        host = not _arrays.is_tensor(k_rows)  # the CPU kernels' host views
        views = _kv_quant.scale_rows(inp.quant, inp.rows_per_block, k_rows.shape[0], host)
        scales = dict(zip(("k_scale", "v_scale"), views, strict=True))
    return PagedArguments(
        q.reshape(batch * sq, hq, d),
        k_rows,
        v_rows,
        q_start=plan.q_start,
        q_len=plan.q_len,
        k_len=plan.seqlens,
        page_start=page_start,
        page_size=plan.block_size,
        max_q=sq if batch else 0,
        max_k=plan.longest_k,
        **scales,
    )


def run(inp, arrays: ServingArrays):
    """The whole op for any backend: arguments, the backend's kernel, results in the record's
    layout and the caller's array type."""
    out, lse = arrays.attend(paged_arguments(inp, arrays))
    kvcache = inp.op == "attention_kvcache"
    if kvcache:
        batch, sq, hq, _ = inp.q.shape
        # explicit dims (not -1): empty work (B, Sq or Hq = 0) has nothing to infer from
        out = out.reshape(batch, sq, hq, inp.v_cache.shape[3])
    out = arrays.output(out, inp.dtype)
    if not inp.options.return_lse:
        return out
    if kvcache:
        lse = lse.reshape(hq, batch, sq).swapaxes(0, 1)  # [B, Hq, Sq]
    return out, arrays.output(lse, "float32")
