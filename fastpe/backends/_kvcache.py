"""What every backend's ``attention_kvcache`` shares: the one write (new keys/values, already
rotated, in the cache's dtype and framework, stored at each sequence's cache positions) and the
row view through which the kernels read a cache in place.

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

import sys

from fastpe import _arrays


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
        inp.page_table * per_block,
    )


def write_new_tokens(inp, k_cache, v_cache, k_new, v_new) -> None:
    """k_cache[block, offset] = k_new (and v), for the (block, offset) of every new token.
    The caches are the caller's or views of their memory (CPU kernels write host views)."""
    block, offset = inp.written_rows()
    for cache, new in ((k_cache, k_new), (v_cache, v_new)):
        if _arrays.is_tensor(cache):
            torch = sys.modules["torch"]
            index = (
                torch.from_numpy(block).to(cache.device),
                torch.from_numpy(offset).to(cache.device),
            )
            cache[index] = new.to(cache.dtype)
        else:
            cache[block, offset] = new
