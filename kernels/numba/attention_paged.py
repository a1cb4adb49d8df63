"""Flash-style attention over packed queries and keys read through a page table (Numba, CPU).

One kernel serves packed variable-length batches (``attention_varlen``) and KV caches, paged
or contiguous (``attention_kvcache``). Logical shapes:

- q [Tq, Hq, D]: the queries of sequence b are rows q_start[b] … q_start[b] + q_len[b] - 1;
- k [R, Hkv, D], v [R, Hkv, Dv]: physical key rows, at any strides (packed views such as
  ``kv[:, 0]``, caches read in place through a row view). Key j of sequence b (j < k_len[b])
  is row ``page_start[b, j // page_size] + j % page_size``. A packed batch is one page per sequence
  (page_start[b, 0] = cu_seqlens_k[b]); a paged cache is [num_blocks·block_size, Hkv, D] with
  page_start = block_table·block_size; a contiguous cache [B, S, Hkv, D] is one page of S rows
  per sequence.
- out [Tq, Hq, Dv] (FlashAttention's layout), lse [Hq, Tq] (float32, natural log).

Work items are (sequence, block of its queries) pairs listed on the host — a sequence has as
many items as its own query blocks, so no thread spends time on another sequence's padding —
times key splits. Two tile steps, both only ever reading keys below k_len[b] (pages past a
sequence's length and unused block-table entries are never touched):

- thin row tiles (decoding: at most SMALL_ROWS = query heads of a kv head x positions), one
  item over every kv head (``_attend_direct``): few-row loops (``_scores_rows``,
  ``_add_values_rows``: four query rows at a time, so that each cache element is widened and
  loaded once per four rows) read the cache rows in place (bfloat16, fp8 and int8 widened as
  read; float16 ones, and rows that are not C-contiguous, copied once per run: ``_loop_rows``),
  in runs of at most RUN_ROWS rows of one page, every head of a run before the next, with the
  next run prefetched, int8 scales with it (the hardware cannot guess where the next page lies);
- larger tiles, one item per kv head: each key tile is gathered (widened) into scratch panels
  and run through the forward kernel's tile step (``_attend_panels``: Q·Kᵀ and P·V by panel
  products; bfloat16 caches on CPUs with AVX512-BF16: gathered as bfloat16 pairs for
  ``_attend_pairs``, ``_pair_products``), also for a row tile that ends up narrow (a
  sequence's last query block): the kernel holds no few-row code to compile.

Both share the score modifiers (``ScoreMods``, ``_modify_scores``), online softmax and final
normalisation of the forward kernel (``_attention_common``, ``_attention_tiles``).
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from fastpe.kernels.numba import _decode_pairs, _pair_products
from fastpe.kernels.numba._attention_common import (
    _FLAGS,
    LOG2E,
    RowTile,
    _modify_scores,
    _softmax_update,
    score_mods,
)
from fastpe.kernels.numba._attention_tiles import (
    SMALL_ROWS,
    _add_weighted_values_small,
    _attend_pairs,
    _attend_panels,
    _finish_rows,
    _merge_splits_numba,
    _row_buffers,
    _scores_small,
    _split_key_range,
    key_splits,
    scaled_query_row,
)
from fastpe.kernels.numba._half import E4M3_UNIT, _e4m3_finite_to_units, _widen
from fastpe.kernels.numba._pair_products import BLOCK_COLUMNS, PANEL, bf16_pair, row_pairs
from fastpe.kernels.numba._panels import panel_width
from fastpe.kernels.numba._runtime import njit
from fastpe.kernels.numba.attention import SERIAL_WORK
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload


def _scale_of(scale, b, row, hk):
    """The dequantization factor of a cache row (1 for caches that are not quantized)."""


@overload(_scale_of, inline="always")
def _scale_of_impl(scale, b, row, hk):
    if isinstance(scale, types.NoneType):
        return lambda scale, b, row, hk: np.float32(1.0)
    # fp8 scales vary with the sequence, not the row; int8 scales with the row (their B is 1)
    return lambda scale, b, row, hk: scale[min(b, scale.shape[0] - 1), row, hk]


def _loop_unit(cache):
    """What an element of ``cache`` as the decode loops widen it (``_cache_widen``) is worth: fp8
    (uint8 bits) E4M3_UNIT, anything else 1 (a compile-time constant)."""


@overload(_loop_unit, inline="always")
def _loop_unit_impl(cache):
    unit = E4M3_UNIT if cache.dtype == types.uint8 else 1.0
    return lambda cache: np.float32(unit)


def _scale_columns(s, col, scale, b, row, n, hk, cache):
    """s[:, col + c] *= the scale of cache row row + c, for c < n: the dequantization of an
    int8 run's keys applied to their scores (values: to their weights), once per score rather
    than once per element read. Nothing for other caches."""


@overload(_scale_columns, inline="always")
def _scale_columns_impl(s, col, scale, b, row, n, hk, cache):
    # fp8 scales (one per sequence and kv head) join the queries and the accumulators once per
    # work item instead (``_head_factor``)
    if isinstance(scale, types.NoneType) or cache.dtype == types.uint8:
        return lambda s, col, scale, b, row, n, hk, cache: None

    def scale_columns(s, col, scale, b, row, n, hk, cache):
        unit = _loop_unit(cache)
        for c in range(n):
            factor = s.dtype.type(_scale_of(scale, b, row + c, hk) * unit)
            for r in range(s.shape[0]):
                s[r, col + c] *= factor

    return scale_columns


def _head_factor(scale, cache, b, hk):
    """What every element of kv head hk of sequence b's rows of an fp8 cache is worth as the
    decode loops read it (its scale times the loops' unit): the thin work items multiply their
    queries by the keys' factor and their accumulators by the values' once, in place of a
    per-score ``_scale_columns``. 1 for other caches."""


@overload(_head_factor, inline="always")
def _head_factor_impl(scale, cache, b, hk):
    if cache.dtype != types.uint8:
        return lambda scale, cache, b, hk: np.float32(1.0)
    return lambda scale, cache, b, hk: np.float32(_scale_of(scale, b, 0, hk) * E4M3_UNIT)


@njit(cache=True, fastmath=_FLAGS)
def _gather_key_panels(src, hk, b, j0, n, page_start, page_size, panels, scale):
    """Keys j0 … j0 + n - 1 of head hk of sequence b, read through the page table, widened
    (and dequantized: times their ``scale``, for quantized caches) into Kᵀ panels
    (``_panels``): panels[p, e, c] = element e of key j0 + p·W + c."""
    width, d = panels.shape[2], src.shape[2]
    r = 0
    while r < n:
        row, run = _page_run(page_start, page_size, b, j0 + r, n - r)
        for t in range(run):
            source = src[row + t, hk]
            factor = panels.dtype.type(_scale_of(scale, b, row + t, hk))
            panel, col = (r + t) // width, (r + t) % width
            for e in range(d):
                panels[panel, e, col] = _widen(source[e]) * factor
        r += run


@njit(cache=True, fastmath=_FLAGS)
def _gather_value_panels(src, hk, b, j0, n, page_start, page_size, panels, scale):
    """``_gather_key_panels`` for values, into V panels (``_panels``): panels[p, r, c] =
    element p·W + c of value j0 + r (zeros past the last element)."""
    width, dv = panels.shape[2], src.shape[2]
    r = 0
    while r < n:
        row, run = _page_run(page_start, page_size, b, j0 + r, n - r)
        whole = dv // width
        for t in range(run):
            source = src[row + t, hk]
            factor = panels.dtype.type(_scale_of(scale, b, row + t, hk))
            for panel in range(whole):  # no bounds test in the loop (pack_value_panels)
                target = panels[panel, r + t]
                for col in range(width):
                    target[col] = _widen(source[panel * width + col]) * factor
            if whole < panels.shape[0]:
                target = panels[whole, r + t]
                for col in range(width):
                    e = whole * width + col
                    target[col] = _widen(source[e]) * factor if e < dv else 0.0
        r += run


@njit(cache=True)
def _gather_key_pairs(src, hk, b, j0, n, page_start, page_size, panels):
    """Keys j0 … j0 + n - 1 of head hk of sequence b (bfloat16 bits), read through the page
    table, into Kᵀ's bfloat16 pairs (``_pair_products``): panels[p, t, c] = dimensions 2t,
    2t + 1 of key j0 + 16p + c; zeros for the keys past n to the panels' end (the pair product
    reads every panel the padded tile spans) and past an odd head dimension."""
    d = src.shape[2]
    half = d // 2
    r = 0
    while r < n:
        row, run = _page_run(page_start, page_size, b, j0 + r, n - r)
        for t in range(run):
            source = src[row + t, hk]
            panel, col = (r + t) // PANEL, (r + t) % PANEL
            for e in range(half):
                panels[panel, e, col] = bf16_pair(source[2 * e], source[2 * e + 1])
            if d % 2:
                panels[panel, half, col] = bf16_pair(source[d - 1], 0)
        r += run
    for key in range(n, panels.shape[0] * PANEL):
        for e in range(panels.shape[1]):
            panels[key // PANEL, e, key % PANEL] = 0


@njit(cache=True)
def _gather_value_pairs(src, hk, b, j0, n, page_start, page_size, panels):
    """``_gather_key_pairs`` for values: panels[p, t, c] = element 16p + c of values j0 + 2t and
    j0 + 2t + 1 (zeros past the last element, and for the value after an odd last one)."""
    dv = src.shape[2]
    for t in range((n + 1) // 2):
        first, _ = _page_run(page_start, page_size, b, j0 + 2 * t, 1)
        second = first
        has_second = 2 * t + 1 < n
        if has_second:
            second, _ = _page_run(page_start, page_size, b, j0 + 2 * t + 1, 1)
        lo, hi = src[first, hk], src[second, hk]
        for panel in range(panels.shape[0]):
            for col in range(PANEL):
                e = panel * PANEL + col
                if e < dv:
                    panels[panel, t, col] = bf16_pair(lo[e], hi[e] if has_second else np.uint16(0))
                else:
                    panels[panel, t, col] = 0


# The packed/paged kernel's two tile paths, float panels or bfloat16 pairs, chosen by the type
# of its ``pairs`` argument: the overloads below return one-line calls of these njit functions
# (an overload's own body is compiled again wherever Numba types the call once more, as in a
# parallel loop's body; a dispatcher's compiled version is reused)
@njit(cache=True)
def _panel_buffers(like, block_n, d, dv):
    width = panel_width(like)
    keys = np.empty(((block_n + width - 1) // width, d, width), like.dtype)
    values = np.empty(((dv + width - 1) // width, block_n, width), like.dtype)
    return keys, values, None


@njit(cache=True)
def _pair_buffers(block_n, m, d, dv):
    columns = (block_n + BLOCK_COLUMNS - 1) // BLOCK_COLUMNS * BLOCK_COLUMNS
    keys = np.empty((columns // PANEL, (d + 1) // 2, PANEL), np.uint32)
    value_panels = (dv + BLOCK_COLUMNS - 1) // BLOCK_COLUMNS * 2
    values = np.empty((value_panels, (block_n + 1) // 2, PANEL), np.uint32)
    return keys, values, np.empty((m, (block_n + 1) // 2), np.uint32)


def _tile_buffers(pairs, like, block_n, m, d, dv):
    """An item's key and value tile buffers (and P's pairs): float panels (``_panels``) when
    pairs is None, else bfloat16 pair panels (``_pair_products``)."""


@overload(_tile_buffers)
def _tile_buffers_impl(pairs, like, block_n, m, d, dv):
    if isinstance(pairs, types.NoneType):
        return lambda pairs, like, block_n, m, d, dv: _panel_buffers(like, block_n, d, dv)
    return lambda pairs, like, block_n, m, d, dv: _pair_buffers(block_n, m, d, dv)


def _tile_padding(pairs, like):
    """The columns ``_row_buffers`` pads an item's tiles to (``_tile_buffers``' products)."""


@overload(_tile_padding, inline="always")
def _tile_padding_impl(pairs, like):
    if isinstance(pairs, types.NoneType):
        return lambda pairs, like: panel_width(like)
    return lambda pairs, like: BLOCK_COLUMNS


@njit(cache=True)
def _widened_queries(q, row0, hk, group, npos, mods, like):
    qt = np.empty((group * npos, q.shape[2]), dtype=like.dtype)
    scale_units = like.dtype.type(mods.scale * mods.unit)
    for g in range(group):
        for r in range(npos):
            scaled_query_row(q[row0 + r, hk * group + g], qt[g * npos + r], scale_units)
    return qt


@njit(cache=True)
def _query_pairs(q, row0, hk, group, npos):
    qt = np.empty((group * npos, (q.shape[2] + 1) // 2), dtype=np.uint32)
    for g in range(group):
        for r in range(npos):
            row_pairs(q[row0 + r, hk * group + g], qt[g * npos + r])
    return qt


def _item_queries(q, row0, hk, group, npos, mods, like, pairs):
    """An item's query rows [group · npos, D] from q [Tq, Hq, D]: widened and times the score
    scale (float panels), or as bfloat16 pairs, unscaled (pair panels)."""


@overload(_item_queries)
def _item_queries_impl(q, row0, hk, group, npos, mods, like, pairs):
    if isinstance(pairs, types.NoneType):
        return lambda q, row0, hk, group, npos, mods, like, pairs: _widened_queries(
            q, row0, hk, group, npos, mods, like
        )
    return lambda q, row0, hk, group, npos, mods, like, pairs: _query_pairs(
        q, row0, hk, group, npos
    )


@njit(cache=True)
def _attend_on_panels(
    qt, k, v, hk, b, j0, n, pages, page_size, k_panels, v_panels, scales, s, p, acc, row_max,
    row_sum, work, mods, tile,
):  # fmt: skip
    _gather_key_panels(k, hk, b, j0, n, pages, page_size, k_panels, scales[0])
    _gather_value_panels(v, hk, b, j0, n, pages, page_size, v_panels, scales[1])
    vp = v_panels[:, :n]
    _attend_panels(qt, k_panels, vp, s, p, acc, row_max, row_sum, work, mods, tile, j0)


@njit(cache=True)
def _attend_on_pairs(
    qt, k, v, hk, b, j0, n, pages, page_size, k_panels, v_panels, p_pairs, s, p, acc, row_max,
    row_sum, work, mods, tile,
):  # fmt: skip
    _gather_key_pairs(k, hk, b, j0, n, pages, page_size, k_panels)
    _gather_value_pairs(v, hk, b, j0, n, pages, page_size, v_panels)
    _attend_pairs(
        qt, k_panels, v_panels, s, p, p_pairs, acc, row_max, row_sum, work, mods, tile, j0, n,
    )  # fmt: skip


def _attend_gathered(
    qt, k, v, hk, b, j0, n, pages, page_size, k_panels, v_panels, p_pairs, scales, s, p, acc,
    row_max, row_sum, work, mods, tile,
):  # fmt: skip
    """Gather keys j0 … j0 + n - 1 into an item's tile buffers and run the tile step on them
    (``_attend_panels``, or ``_attend_pairs`` on pair panels)."""


@overload(_attend_gathered)
def _attend_gathered_impl(
    qt, k, v, hk, b, j0, n, pages, page_size, k_panels, v_panels, p_pairs, scales, s, p, acc,
    row_max, row_sum, work, mods, tile,
):  # fmt: skip
    if isinstance(p_pairs, types.NoneType):

        def on_panels(
            qt, k, v, hk, b, j0, n, pages, page_size, k_panels, v_panels, p_pairs, scales, s, p,
            acc, row_max, row_sum, work, mods, tile,
        ):  # fmt: skip
            _attend_on_panels(
                qt, k, v, hk, b, j0, n, pages, page_size, k_panels, v_panels, scales, s, p,
                acc, row_max, row_sum, work, mods, tile,
            )  # fmt: skip

        return on_panels

    def on_pairs(
        qt, k, v, hk, b, j0, n, pages, page_size, k_panels, v_panels, p_pairs, scales, s, p,
        acc, row_max, row_sum, work, mods, tile,
    ):  # fmt: skip
        _attend_on_pairs(
            qt, k, v, hk, b, j0, n, pages, page_size, k_panels, v_panels, p_pairs, s, p, acc,
            row_max, row_sum, work, mods, tile,
        )  # fmt: skip

    return on_pairs


def _prefetch_codegen(element_index):
    """llvm.prefetch of the cache line at an element index (C-contiguous arrays: the offset is
    the index times the item size) or at a byte offset (any layout)."""

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        offset = context.cast(builder, args[1], signature.args[1], types.intp)
        if element_index:
            element = context.get_data_type(signature.args[0].dtype)
            itemsize = context.get_constant(types.intp, context.get_abi_sizeof(element))
            offset = builder.mul(offset, itemsize)
        byte_ptr = ir.IntType(8).as_pointer()
        address = cgutils.pointer_add(builder, ary.data, offset, byte_ptr)
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", [byte_ptr], fnty)
        # read, locality 2 (L2, not L1, which the current run fills: 3-5% faster than L1), data
        builder.call(fn, [address, i32(0), i32(2), i32(1)])
        return context.get_dummy_value()

    return codegen


@intrinsic
def _prefetch(typingctx, array, index):
    """Ask the CPU to bring the cache line holding element ``index`` (in flat order) of a
    C-contiguous array into its L2 cache: a hint (x86 prefetcht1), no load, no fault, no
    result. The index must lie within the array."""
    if not (isinstance(array, types.Array) and array.layout == "C"):
        return None
    if not isinstance(index, types.Integer):
        return None
    return types.void(array, index), _prefetch_codegen(True)


@intrinsic
def _prefetch_bytes(typingctx, array, offset):
    """``_prefetch`` for arrays of any layout: the line ``offset`` bytes past the first
    element (the caller computes it from the strides; it must lie within the array's memory)."""
    if not isinstance(array, types.Array) or not isinstance(offset, types.Integer):
        return None
    return types.void(array, offset), _prefetch_codegen(False)


def _prefetch_rows(src, row, n, hk):
    """Prefetch head hk of rows row … row + n - 1 of src [R, H, D] (64-byte cache lines)."""


@overload(_prefetch_rows)
def _prefetch_rows_impl(src, row, n, hk):
    if src.layout == "C":
        # elements per 64-byte line, a compile-time constant: the loop divides by shifts
        step = max(1, 512 // src.dtype.bitwidth)  # 512 bits per line

        def contiguous(src, row, n, hk):
            heads, width = src.shape[1], src.shape[2]
            for r in range(row, row + n):
                base = (r * heads + hk) * width
                # each line the slice touches once (lines counted from the array's start, which
                # the allocators align to 64 bytes)
                for line in range(base // step, (base + width - 1) // step + 1):
                    _prefetch(src, line * step)

        return contiguous

    def strided(src, row, n, hk):
        # packed k/v views (kvpacked, every-other-head) and caches read in place through a
        # row view: addresses from the strides; a head's slice is one byte range when its
        # elements are adjacent (one prefetch per line), else one prefetch per element
        row_stride, head_stride, col_stride = src.strides
        step = 64 if col_stride == src.itemsize else col_stride
        span = (src.shape[2] - 1) * col_stride
        for r in range(row, row + n):
            base = r * row_stride + hk * head_stride
            for x in range(base, base + span + 1, max(step, 1)):
                _prefetch_bytes(src, x)
            _prefetch_bytes(src, base + span)  # the last line, when the slice is unaligned

    return strided


def _prefetch_scales(scale, row, n):
    """Prefetch the scales of rows row … row + n - 1 (every kv head) of an int8 cache, whose
    per-token scales are read once per run, from memory as scattered as the cache's pages:
    their view [1, R, Hkv] when its rows lie side by side (one byte range). Nothing for other
    scales (fp8's, one per sequence and head, stay in the CPU's caches) or none."""


@overload(_prefetch_scales)
def _prefetch_scales_impl(scale, row, n):
    if isinstance(scale, types.NoneType):
        return lambda scale, row, n: None

    def prefetch(scale, row, n):
        row_stride, head_stride = scale.strides[1], scale.strides[2]
        if n <= 0 or head_stride != scale.itemsize or row_stride != scale.shape[2] * head_stride:
            return
        first, last = row * row_stride, (row + n) * row_stride - 1
        for x in range(first, last + 1, 64):
            _prefetch_bytes(scale, x)
        _prefetch_bytes(scale, last)  # the last line, when the range is unaligned

    return prefetch


# Rows per page run: every kv head of up to this many cache rows is consumed before the next
# rows are touched. Measured on B 8, Sk 4096, H 32/8, D 128 with 256-row pages: runs of a whole
# page (each head streamed through it in turn) ran 1.3x slower than runs of 16; runs of 4 or 8
# slower too (more, shorter calls).
RUN_ROWS = 16


@njit(cache=True)
def _page_run(page_start, page_size, b, j, left):
    """(first physical row, rows) of the run of key j of sequence b: at most ``left`` rows,
    RUN_ROWS, and the rest of j's page."""
    if left <= 0:  # past the tile: an empty run
        return 0, 0
    page = j // page_size
    run = min(left, (page + 1) * page_size - j, RUN_ROWS)
    return page_start[b, page] + j - page * page_size, run


def _needs_scratch(array):
    """True for arrays the few-row loops may not read in place (a compile-time constant):
    float16 bits and any array that is not C-contiguous (``_loop_rows``), and fp8 caches (a run
    holding a NaN pattern is widened a head at a time, ``_run_scores``)."""


@overload(_needs_scratch, inline="always")
def _needs_scratch_impl(array):
    copy = array.dtype in (types.int16, types.uint8) or array.layout != "C"
    return lambda array: copy


def _loop_rows(rows, scratch):
    """Cache rows [n, H, D] as the few-row loops read them: in place for C-contiguous floats,
    bfloat16, fp8 and int8 (widened as read, ``_cache_widen``); copied (widened) once into the
    flat scratch for
    float16 bits, whose exact conversion branches (widened inside the loops, four times, once
    per query row, it kept them from vectorising and ran 2.3x slower than the contiguous
    decode), and for strided rows (packed k/v views, every-other-head): on layout 'A' the loops
    do not know the unit stride of D and ran 9x slower."""


@njit(cache=True, fastmath=_FLAGS)
def _exact_head(rows, hk, scratch):
    """Head hk of run rows [n, H, D] widened exactly (``_widen``: NaN patterns too) into
    scratch, as [n, 1, D] (read as head 0), in the loops' unit (``_loop_unit``: a power of
    two, so exactly)."""
    n, width = rows.shape[0], rows.shape[2]
    out = scratch[: n * width].reshape((n, 1, width))
    inverse = np.float32(1.0) / _loop_unit(rows)
    for r in range(n):
        for c in range(width):
            out[r, 0, c] = _widen(rows[r, hk, c]) * inverse
    return out


@overload(_loop_rows, inline="always")
def _loop_rows_impl(rows, scratch):
    if rows.dtype == types.int16 or rows.layout != "C":

        def widen_into(rows, scratch):
            n, heads, width = rows.shape
            out = scratch[: n * heads * width].reshape((n, heads, width))
            for r in range(n):
                for h in range(heads):
                    for c in range(width):
                        out[r, h, c] = _widen(rows[r, h, c])
            return out

        return widen_into
    return lambda rows, scratch: rows


class PagedRows(NamedTuple):
    """Where the rows of a call lie (module docstring) and its work items: item t is the query
    block of sequence item_seq[t] from its query item_i0[t] on."""

    q_start: np.ndarray  # int64 [B]
    q_len: np.ndarray  # int64 [B]
    page_start: np.ndarray  # int64 [B, pages]
    page_size: int
    item_seq: np.ndarray  # int64 [items]
    item_i0: np.ndarray  # int64 [items]


@njit(cache=True)
def _item_span(rows, item, hk, group, block_m):
    """(``RowTile`` of work item ``item`` for kv head ``hk``, row of its first query in q)."""
    b = rows.item_seq[item]
    i0 = rows.item_i0[item]
    return RowTile(b, hk, group, i0, min(block_m, rows.q_len[b] - i0)), rows.q_start[b] + i0


def _cache_widen(value):
    """An element of a cache run as the decode loops (``_scores_rows``, ``_add_values_rows``)
    read it: fp8 bits without the NaN step (``_run_scores`` and ``_run_values`` send runs that
    hold a NaN pattern through the exact widening first) and in units of E4M3_UNIT (the value /
    256, exactly: F16C's conversion and no multiply; ``_head_factor`` multiplies the scale by
    the unit instead), anything else as ``_widen``."""


@overload(_cache_widen, inline="always")
def _cache_widen_impl(value):
    if value == types.uint8:
        return lambda value: _e4m3_finite_to_units(value)
    return lambda value: _widen(value)


@njit(cache=True, fastmath=_FLAGS)
def _scores_rows(qt, kt, hk, s, col):
    """s[:, col + c] = qt·kt[c, hk] for the few query rows of a decode tile, four query rows by
    two keys at a time: eight sums per pass over D, each key element (widened once) serving
    four rows and each query element two keys (``_scores_small``, one row by four keys, widens
    every key element once per query row). Rows past a multiple of four go to
    ``_scores_small``. qt [m, D], kt [n, H, D] (a run of cache rows, or its head widened into
    scratch with H = 1), s [m, >= col + n]; all C-contiguous."""
    m, d = qt.shape
    n = kt.shape[0]
    whole_rows = m - m % 4
    whole_keys = n - n % 2
    zero = s.dtype.type(0.0)
    for r in range(0, whole_rows, 4):
        for c in range(0, whole_keys, 2):
            s00 = s01 = s10 = s11 = s20 = s21 = s30 = s31 = zero
            for e in range(d):
                k0, k1 = _cache_widen(kt[c, hk, e]), _cache_widen(kt[c + 1, hk, e])
                x0, x1, x2, x3 = qt[r, e], qt[r + 1, e], qt[r + 2, e], qt[r + 3, e]
                s00 += x0 * k0
                s01 += x0 * k1
                s10 += x1 * k0
                s11 += x1 * k1
                s20 += x2 * k0
                s21 += x2 * k1
                s30 += x3 * k0
                s31 += x3 * k1
            j = col + c
            s[r, j], s[r + 1, j], s[r + 2, j], s[r + 3, j] = s00, s10, s20, s30
            s[r, j + 1], s[r + 1, j + 1], s[r + 2, j + 1], s[r + 3, j + 1] = s01, s11, s21, s31
        for c in range(whole_keys, n):
            s0 = s1 = s2 = s3 = zero
            for e in range(d):
                k0 = _cache_widen(kt[c, hk, e])
                s0 += qt[r, e] * k0
                s1 += qt[r + 1, e] * k0
                s2 += qt[r + 2, e] * k0
                s3 += qt[r + 3, e] * k0
            s[r, col + c], s[r + 1, col + c], s[r + 2, col + c], s[r + 3, col + c] = s0, s1, s2, s3
    if whole_rows < m:
        _scores_small(qt[whole_rows:], kt, hk, s[whole_rows:], col)
        inverse = np.float32(1.0) / _loop_unit(kt)
        if inverse != 1.0:  # _scores_small widens fp8 to its value: in the loops' unit
            for r in range(whole_rows, m):
                for c in range(n):
                    s[r, col + c] *= inverse


@njit(cache=True, fastmath=_FLAGS)
def _add_values_rows(p, col, vt, hk, acc):
    """acc += p[:, col : col + n]·vt[:, hk] for the few rows of a decode tile, four rows by
    four value rows at a time: each value element (widened once) serves four accumulator rows
    (``_add_weighted_values_small`` reads and widens it once per row). Rows past a multiple of
    four go to ``_add_weighted_values_small``. vt [n, H, Dv] as kt in ``_scores_rows``."""
    m = p.shape[0]
    n, dv = vt.shape[0], vt.shape[2]
    whole_rows = m - m % 4
    whole_values = n - n % 4
    for r in range(0, whole_rows, 4):
        for c in range(0, whole_values, 4):
            j = col + c
            w00, w01, w02, w03 = p[r, j], p[r, j + 1], p[r, j + 2], p[r, j + 3]
            w10, w11, w12, w13 = p[r + 1, j], p[r + 1, j + 1], p[r + 1, j + 2], p[r + 1, j + 3]
            w20, w21, w22, w23 = p[r + 2, j], p[r + 2, j + 1], p[r + 2, j + 2], p[r + 2, j + 3]
            w30, w31, w32, w33 = p[r + 3, j], p[r + 3, j + 1], p[r + 3, j + 2], p[r + 3, j + 3]
            for e in range(dv):
                v0, v1 = _cache_widen(vt[c, hk, e]), _cache_widen(vt[c + 1, hk, e])
                v2, v3 = _cache_widen(vt[c + 2, hk, e]), _cache_widen(vt[c + 3, hk, e])
                acc[r, e] += w00 * v0 + w01 * v1 + w02 * v2 + w03 * v3
                acc[r + 1, e] += w10 * v0 + w11 * v1 + w12 * v2 + w13 * v3
                acc[r + 2, e] += w20 * v0 + w21 * v1 + w22 * v2 + w23 * v3
                acc[r + 3, e] += w30 * v0 + w31 * v1 + w32 * v2 + w33 * v3
        for c in range(whole_values, n):
            j = col + c
            w0, w1, w2, w3 = p[r, j], p[r + 1, j], p[r + 2, j], p[r + 3, j]
            for e in range(dv):
                v0 = _cache_widen(vt[c, hk, e])
                acc[r, e] += w0 * v0
                acc[r + 1, e] += w1 * v0
                acc[r + 2, e] += w2 * v0
                acc[r + 3, e] += w3 * v0
    if whole_rows < m:
        inverse = np.float32(1.0) / _loop_unit(vt)
        if inverse != 1.0:  # _add_weighted_values_small widens fp8 to its value: p is in units
            for r in range(whole_rows, m):
                for c in range(n):
                    p[r, col + c] *= inverse
        _add_weighted_values_small(p[whole_rows:], col, vt, hk, acc[whole_rows:])


def _holds_fp8_nan(rows):
    """Whether a run of cache rows [n, H, D] is fp8 holding a NaN pattern (S.1111.111): one
    pass over the run's bytes, every head at once, in byte lanes (32 per AVX2 instruction; the
    byte casts keep Numba from widening the arithmetic to 64 bits, which ran 10x slower). False,
    at compile time, for other caches."""


@njit(cache=True)
def _fp8_run_holds_nan(rows):
    flat = rows.reshape(-1)
    seen = np.uint8(0)
    for i in range(flat.shape[0]):
        # (b & 0x7F) + 1 reaches 0x80 only for the NaN pattern 0x7F
        seen = np.uint8(seen | np.uint8(np.uint8(flat[i] & 0x7F) + 1))
    return seen >= 0x80


@overload(_holds_fp8_nan, inline="always")
def _holds_fp8_nan_impl(rows):
    if rows.dtype != types.uint8 or rows.layout != "C":
        return lambda rows: False
    return lambda rows: _fp8_run_holds_nan(rows)


def _run_scores(qt, rows, hk, s, col, scratch, nan_run):
    """``_scores_rows`` on head hk of a run; an fp8 run holding a NaN pattern (``nan_run``) is
    widened exactly into scratch first, so that a NaN in the cache reaches the output as in
    torch (the loops' own fp8 widening skips the NaN step)."""


@overload(_run_scores, inline="always")
def _run_scores_impl(qt, rows, hk, s, col, scratch, nan_run):
    if rows.dtype == types.uint8:

        def fp8(qt, rows, hk, s, col, scratch, nan_run):
            if nan_run:
                _scores_rows(qt, _exact_head(rows, hk, scratch), 0, s, col)
            else:
                _scores_rows(qt, rows, hk, s, col)

        return fp8
    return lambda qt, rows, hk, s, col, scratch, nan_run: _scores_rows(qt, rows, hk, s, col)


def _run_values(p, col, rows, hk, acc, scratch, nan_run):
    """``_add_values_rows`` on head hk of a run, as ``_run_scores``."""


@overload(_run_values, inline="always")
def _run_values_impl(p, col, rows, hk, acc, scratch, nan_run):
    if rows.dtype == types.uint8:

        def fp8(p, col, rows, hk, acc, scratch, nan_run):
            if nan_run:
                _add_values_rows(p, col, _exact_head(rows, hk, scratch), 0, acc)
            else:
                _add_values_rows(p, col, rows, hk, acc)

        return fp8
    return lambda p, col, rows, hk, acc, scratch, nan_run: _add_values_rows(p, col, rows, hk, acc)


@njit(cache=True)
def _run_and_next(rows, b, j0, n, c0, after_start, after_left):
    """(row, run, last, ahead, ahead_rows): the run of key j0 + c0 of sequence b within keys
    j0 … j0 + n - 1 (``_page_run``), whether it is the pass's last, and the run to prefetch
    while it is multiplied: the pass's next, or after its last, the first run from key
    after_start (at most after_left keys: the other pass's keys, or the next tile's)."""
    page_start, page_size = rows.page_start, rows.page_size
    row, run = _page_run(page_start, page_size, b, j0 + c0, n - c0)
    last = c0 + run == n
    if last:
        ahead, ahead_rows = _page_run(page_start, page_size, b, after_start, after_left)
    else:
        ahead, ahead_rows = _page_run(page_start, page_size, b, j0 + c0 + run, n - c0 - run)
    return row, run, last, ahead, ahead_rows


def _prefetch_next(this, other, last, row, n, hk):
    """Prefetch head hk of the run ``_run_and_next`` names: rows of ``this`` pass's cache, or
    of the ``other``'s after the pass's last run."""


@overload(_prefetch_next, inline="always")
def _prefetch_next_impl(this, other, last, row, n, hk):
    def prefetch(this, other, last, row, n, hk):
        if last:  # a branch, not one variable: k and v may be arrays of different layouts
            _prefetch_rows(other, row, n, hk)
        else:
            _prefetch_rows(this, row, n, hk)

    return prefetch


@njit(cache=True, fastmath=_FLAGS)
def _attend_direct(
    qt, k, v, rows, tile, j0, n, j_stop, s, p, acc, row_max, row_sum, work, mods, scratch, scales
):
    """Keys j0 … j0 + n - 1 for the thin row tiles of every kv head at once (``tile`` names
    the sequence and queries; qt [Hkv, m, D], s/p [Hkv, m, n], acc [Hkv, m, Dv]), reading k and
    v through the page table in place, a run of rows at a time: a cache row holds all kv heads
    side by side, so every head of a run is consumed before the next run is touched, and the
    next run is prefetched head by head while the current one is multiplied (the hardware
    cannot guess where the next page lies); the last run of values prefetches the first keys
    of the next tile (up to j_stop, where the work item's keys end)."""
    hkv = qt.shape[0]
    b = tile.b
    k_scale, v_scale = scales
    c0 = 0
    while c0 < n:
        # prefetch the next run (after the last, V's first) head by head, as it will be read
        row, run, last, ahead, ahead_rows = _run_and_next(rows, b, j0, n, c0, j0, n)
        keys = _loop_rows(k[row : row + run], scratch)
        nan_run = _holds_fp8_nan(keys)
        _prefetch_scales(v_scale if last else k_scale, ahead, ahead_rows)
        for hk in range(hkv):
            _prefetch_next(k, v, last, ahead, ahead_rows, hk)
            _run_scores(qt[hk], keys, hk, s[hk], c0, scratch, nan_run)
            _scale_columns(s[hk], c0, k_scale, b, row, run, hk, k)
        c0 += run
    for hk in range(hkv):
        _modify_scores(s[hk], mods, RowTile(b, hk, tile.group, tile.i0, tile.npos), j0, n)
        _softmax_update(s[hk], p[hk], acc[hk], row_max[hk], row_sum[hk], work[hk], n, mods.unit)
    c0 = 0
    while c0 < n:
        # prefetch the next run (after the last, the next tile's first keys)
        row, run, last, ahead, ahead_rows = _run_and_next(
            rows, b, j0, n, c0, j0 + n, j_stop - j0 - n
        )
        values = _loop_rows(v[row : row + run], scratch)
        nan_run = _holds_fp8_nan(values)
        _prefetch_scales(k_scale if last else v_scale, ahead, ahead_rows)
        for hk in range(hkv):
            _prefetch_next(v, k, last, ahead, ahead_rows, hk)
            _scale_columns(p[hk], c0, v_scale, b, row, run, hk, v)  # p is not read after this
            _run_values(p[hk], c0, values, hk, acc[hk], scratch, nan_run)
        c0 += run


def _run_key_scales(k_scale, k, b, row, n, hk, ones):
    """The dequantization scales of key rows row … row + n - 1 of head hk, as the pair products
    multiply their scores (a 1-D view): int8's, one per row (their B is 1); ones for fp8, whose
    scale the queries carry (``_head_factor``)."""


@overload(_run_key_scales, inline="always")
def _run_key_scales_impl(k_scale, k, b, row, n, hk, ones):
    if k.dtype == types.int8:
        return lambda k_scale, k, b, row, n, hk, ones: k_scale[
            min(b, k_scale.shape[0] - 1), row : row + n, hk
        ]
    return lambda k_scale, k, b, row, n, hk, ones: ones[:n]


def _tile_weights(p, n, v, v_scale, rows, b, j0, state):
    """The weights of a key tile as ``pair_add_values`` takes them, per kv head: int8: p times
    each value row's scale, rounded to int16 with one scale per row (w16, w_scales); fp8: p
    rounded to bfloat16 (its scale, one per head, multiplies the accumulators)."""


@overload(_tile_weights, inline="always")
def _tile_weights_impl(p, n, v, v_scale, rows, b, j0, state):
    if v.dtype == types.int8:

        def int16_weights(p, n, v, v_scale, rows, b, j0, state):
            _, _, _, w16, w_scales, v_factors, _ = state
            scale = v_scale[min(b, v_scale.shape[0] - 1)]
            c0 = 0
            while c0 < n:  # the value rows' scales, as one row per head
                row, run = _page_run(rows.page_start, rows.page_size, b, j0 + c0, n - c0)
                for c in range(run):
                    for hk in range(p.shape[0]):
                        v_factors[hk, c0 + c] = scale[row + c, hk]
                c0 += run
            limit = _decode_pairs.int16_limit(n)
            for hk in range(p.shape[0]):
                _decode_pairs.quantize_rows(p[hk], v_factors[hk], n, limit, w16[hk], w_scales[hk])

        return int16_weights

    def bf16_weights(p, n, v, v_scale, rows, b, j0, state):
        w16 = state[3]
        for hk in range(p.shape[0]):
            _decode_pairs.round_rows(p[hk], n, w16[hk])

    return bf16_weights


@njit(cache=True, fastmath=_FLAGS)
def _attend_direct_pairs(
    k, v, rows, tile, j0, n, j_stop, s, p, acc, row_max, row_sum, work, mods, scales, state
):
    """``_attend_direct`` on an 8-bit cache by pair products (``_decode_pairs``): state =
    (q16 [Hkv, m4, D] and q_scales [Hkv, m4], the queries as the products take them; acc_pairs
    [Hkv, m4, Dv], zeros; w16 [Hkv, m4, block_n + 1], w_scales [Hkv, m4], v_factors, ones:
    scratch for the weights, ``_tile_weights``). A tile's P·V is summed in acc_pairs and added
    to acc once per tile (times each row's weight scale)."""
    q16, q_scales, acc_pairs, w16, w_scales, _, ones = state
    hkv, m = s.shape[0], s.shape[1]
    b = tile.b
    k_scale, v_scale = scales
    c0 = 0
    while c0 < n:  # as in _attend_direct
        row, run, last, ahead, ahead_rows = _run_and_next(rows, b, j0, n, c0, j0, n)
        keys = k[row : row + run]
        _prefetch_scales(v_scale if last else k_scale, ahead, ahead_rows)
        for hk in range(hkv):
            _prefetch_next(k, v, last, ahead, ahead_rows, hk)
            key_scales = _run_key_scales(k_scale, k, b, row, run, hk, ones)
            _decode_pairs.pair_scores(s[hk], c0, q16[hk], q_scales[hk], keys, hk, key_scales)
        c0 += run
    for hk in range(hkv):
        _modify_scores(s[hk], mods, RowTile(b, hk, tile.group, tile.i0, tile.npos), j0, n)
        _softmax_update(s[hk], p[hk], acc[hk], row_max[hk], row_sum[hk], work[hk], n, mods.unit)
    _tile_weights(p, n, v, v_scale, rows, b, j0, state)
    c0 = 0
    while c0 < n:
        row, run, last, ahead, ahead_rows = _run_and_next(
            rows, b, j0, n, c0, j0 + n, j_stop - j0 - n
        )
        values = v[row : row + run]
        _prefetch_scales(k_scale if last else v_scale, ahead, ahead_rows)
        for hk in range(hkv):
            _prefetch_next(v, k, last, ahead, ahead_rows, hk)
            _decode_pairs.pair_add_values(acc_pairs[hk], w16[hk], c0, values, hk)
        c0 += run
    for hk in range(hkv):
        for r in range(m):
            factor = w_scales[hk, r]
            for e in range(acc.shape[2]):
                acc[hk, r, e] += np.float32(acc_pairs[hk, r, e]) * factor
                acc_pairs[hk, r, e] = 0


def _pair_state(q, qt, row0, npos, q_factors, k, dv, block_n, decode_pairs):
    """What ``_attend_direct_pairs`` carries through a work item (None without
    ``decode_pairs``): the queries as the pair products take them (int8: qt [Hkv, m, D], the
    scaled queries, rounded to int16 by rows; fp8: q's bfloat16 bits, the scale q_factors[hk]
    of head hk applied to the scores) and the buffers."""


@overload(_pair_state, inline="always")
def _pair_state_impl(q, qt, row0, npos, q_factors, k, dv, block_n, decode_pairs):
    if isinstance(decode_pairs, types.NoneType):
        return lambda q, qt, row0, npos, q_factors, k, dv, block_n, decode_pairs: None
    if k.dtype == types.int8:

        def int16_state(q, qt, row0, npos, q_factors, k, dv, block_n, decode_pairs):
            hkv, m, d = qt.shape
            m4 = -(-m // _decode_pairs.ROWS) * _decode_pairs.ROWS
            q16 = np.empty((hkv, m4, d), np.int16)
            q_scales = np.empty((hkv, m4), np.float32)
            limit = _decode_pairs.int16_limit(d)
            ones = np.ones(d, np.float32)
            for hk in range(hkv):
                _decode_pairs.quantize_rows(qt[hk], ones, d, limit, q16[hk], q_scales[hk])
            acc_pairs = np.zeros((hkv, m4, dv), np.int32)
            w16 = np.zeros((hkv, m4, block_n + 1), np.int16)
            w_scales = np.empty((hkv, m4), np.float32)
            v_factors = np.empty((hkv, block_n), np.float32)
            return q16, q_scales, acc_pairs, w16, w_scales, v_factors, ones

        return int16_state

    def bf16_state(q, qt, row0, npos, q_factors, k, dv, block_n, decode_pairs):
        hkv, m, d = qt.shape
        group = m // npos
        m4 = -(-m // _decode_pairs.ROWS) * _decode_pairs.ROWS
        q16 = np.zeros((hkv, m4, d), np.uint16)
        q_scales = np.empty((hkv, m4), np.float32)
        w_scales = np.empty((hkv, m4), np.float32)
        for hk in range(hkv):
            for g in range(group):
                for r in range(npos):
                    for c in range(d):
                        q16[hk, g * npos + r, c] = q[row0 + r, hk * group + g, c]
            for r in range(m4):
                q_scales[hk, r] = q_factors[hk]
                w_scales[hk, r] = 1.0
        acc_pairs = np.zeros((hkv, m4, dv), np.float32)
        # zeros: a run of odd length multiplies the weight past its last by 0, which must not
        # be NaN
        w16 = np.zeros((hkv, m4, block_n + 1), np.uint16)
        v_factors = np.empty((hkv, 0), np.float32)
        ones = np.ones(RUN_ROWS, np.float32)
        return q16, q_scales, acc_pairs, w16, w_scales, v_factors, ones

    return bf16_state


def _attend_direct_tile(
    qt, k, v, rows, tile, j0, n, j_stop, s, p, acc, row_max, row_sum, work, mods, scratch,
    scales, pair_state,
):  # fmt: skip
    """One key tile of a thin work item (j_stop: where the item's keys end):
    ``_attend_direct``, or ``_attend_direct_pairs`` when ``pair_state`` holds its state."""


@overload(_attend_direct_tile, inline="always")
def _attend_direct_tile_impl(
    qt, k, v, rows, tile, j0, n, j_stop, s, p, acc, row_max, row_sum, work, mods, scratch,
    scales, pair_state,
):  # fmt: skip
    if isinstance(pair_state, types.NoneType):

        def floats(
            qt, k, v, rows, tile, j0, n, j_stop, s, p, acc, row_max, row_sum, work, mods,
            scratch, scales, pair_state,
        ):  # fmt: skip
            _attend_direct(
                qt, k, v, rows, tile, j0, n, j_stop, s, p, acc, row_max, row_sum, work, mods,
                scratch, scales,
            )  # fmt: skip

        return floats

    def integers(
        qt, k, v, rows, tile, j0, n, j_stop, s, p, acc, row_max, row_sum, work, mods, scratch,
        scales, pair_state,
    ):  # fmt: skip
        _attend_direct_pairs(
            k, v, rows, tile, j0, n, j_stop, s, p, acc, row_max, row_sum, work, mods, scales,
            pair_state,
        )  # fmt: skip

    return integers


@njit(cache=True, fastmath=_FLAGS)
def _direct_item(
    q, k, v, part_out, part_lse, rows, mods, block_m, block_n, n_splits, scales, decode_pairs,
    work_item,
):  # fmt: skip
    """One work item of ``_attention_paged_direct_numba``: (sequence, query block, key split)
    over every kv head."""
    hq, d = q.shape[1], q.shape[2]
    hkv, dv = k.shape[1], v.shape[2]
    group = hq // hkv
    split = work_item % n_splits
    # the tile of kv head 0: its sequence and queries, which every kv head shares here
    tile, row0 = _item_span(rows, work_item // n_splits, 0, group, block_m)
    j_begin, j_stop = _split_key_range(mods, tile, block_n, split, n_splits, 1)
    npos = tile.npos
    m = group * npos
    qt = np.empty((hkv, m, d), dtype=part_out.dtype)
    q_factors = np.empty(hkv, dtype=part_out.dtype)
    k_scale, v_scale = scales
    for hk in range(hkv):
        scale_units = part_out.dtype.type(
            mods.scale * mods.unit * _head_factor(k_scale, k, tile.b, hk)
        )
        q_factors[hk] = scale_units
        for g in range(group):
            for r in range(npos):
                for c in range(d):
                    qt[hk, g * npos + r, c] = _widen(q[row0 + r, hk * group + g, c]) * scale_units
    # np.empty and fill loops: each other allocation form (np.zeros, np.full) is one more Numba
    # compile on a first call (``_row_buffers``)
    acc = np.empty((hkv, m, dv), dtype=part_out.dtype)
    row_max = np.empty((hkv, m), dtype=part_out.dtype)
    row_sum = np.empty((hkv, m), dtype=part_out.dtype)
    for hk in range(hkv):
        for r in range(m):
            row_max[hk, r] = -np.inf
            row_sum[hk, r] = 0.0
            for c in range(dv):
                acc[hk, r, c] = 0.0
    work = np.empty((hkv, 4, m), dtype=part_out.dtype)
    s_full = np.empty((hkv, m, block_n), dtype=part_out.dtype)
    p_full = np.empty((hkv, m, block_n), dtype=part_out.dtype)
    # float16 and strided runs copied (_loop_rows); empty, and unused, for other inputs
    scratch = np.empty(
        RUN_ROWS * hkv * max(d, dv) if _needs_scratch(k) or _needs_scratch(v) else 0, part_out.dtype
    )
    tail = (j_stop - j_begin) % block_n
    s_tail = np.empty((hkv, m, tail), dtype=part_out.dtype)
    p_tail = np.empty((hkv, m, tail), dtype=part_out.dtype)
    pair_state = _pair_state(q, qt, row0, npos, q_factors, k, dv, block_n, decode_pairs)
    for j0 in range(j_begin, j_stop, block_n):
        full = j_stop - j0 >= block_n
        n = block_n if full else tail
        s, p = (s_full, p_full) if full else (s_tail, p_tail)
        _attend_direct_tile(
            qt, k, v, rows, tile, j0, n, j_stop, s, p, acc, row_max, row_sum, work, mods,
            scratch, scales, pair_state,
        )  # fmt: skip
    for hk in range(hkv):
        factor = _head_factor(v_scale, v, tile.b, hk)
        if factor != 1.0:
            for r in range(m):
                for c in range(dv):
                    acc[hk, r, c] *= factor
        head = RowTile(tile.b, hk, group, tile.i0, npos)
        out, lse = part_out[split], part_lse[split]
        _finish_rows(acc[hk], row_max[hk], row_sum[hk], out, lse, row0, head, mods, split == 0)


@njit(parallel=True, cache=True, fastmath=_FLAGS)
def _attention_paged_direct_numba(
    q, k, v, part_out, part_lse, rows, mods, block_m, block_n, n_splits, scales, decode_pairs
):
    """Thin row tiles (decoding): one work item = (sequence, query block, key split) over every
    kv head, so that each cache row is read once, in order. The loop's body is one call: Numba
    types a parallel loop's body twice, once in the kernel and once on its own."""
    for work_item in prange(rows.item_seq.shape[0] * n_splits):
        _direct_item(
            q, k, v, part_out, part_lse, rows, mods, block_m, block_n, n_splits, scales,
            decode_pairs, np.int64(work_item),  # one type in both typings (the loop's own index is unsigned)
        )  # fmt: skip


@njit(cache=True, fastmath=_FLAGS)
def _gathered_item(
    q, k, v, part_out, part_lse, rows, mods, block_m, block_n, n_splits, scales, pairs,
    work_item,
):  # fmt: skip
    """One work item of ``_attention_paged_numba``: (sequence, query block, kv head, key
    split)."""
    hq, d = q.shape[1], q.shape[2]
    hkv, dv = k.shape[1], v.shape[2]
    group = hq // hkv
    split = work_item % n_splits
    rest = work_item // n_splits
    hk = rest % hkv
    tile, row0 = _item_span(rows, rest // hkv, hk, group, block_m)
    j_begin, j_stop = _split_key_range(mods, tile, block_n, split, n_splits, 1)
    b, npos = tile.b, tile.npos
    m = group * npos
    qt = _item_queries(q, row0, hk, group, npos, mods, part_out, pairs)
    tail = (j_stop - j_begin) % block_n
    acc, row_max, row_sum, work, s_full, p_full, s_tail, p_tail = _row_buffers(
        part_out, m, dv, block_n, tail, _tile_padding(pairs, part_out)
    )
    # keys and values gathered (widened, or as bfloat16 pairs) per tile
    k_panels, v_panels, p_pairs = _tile_buffers(pairs, part_out, block_n, m, d, dv)
    pages, page_size = rows.page_start, rows.page_size
    for j0 in range(j_begin, j_stop, block_n):
        n = min(block_n, j_stop - j0)
        s, p = (s_full, p_full) if n == block_n else (s_tail, p_tail)
        _attend_gathered(
            qt, k, v, hk, b, j0, n, pages, page_size, k_panels, v_panels, p_pairs, scales,
            s, p, acc, row_max, row_sum, work, mods, tile,
        )  # fmt: skip
    out, lse = part_out[split], part_lse[split]
    _finish_rows(acc, row_max, row_sum, out, lse, row0, tile, mods, split == 0)


@njit(parallel=True, cache=True, fastmath=_FLAGS)
def _attention_paged_numba(
    q, k, v, part_out, part_lse, rows, mods, block_m, block_n, n_splits, scales, pairs
):
    """Wide row tiles: one work item = (sequence, query block, kv head, key split). pairs: None
    (key tiles gathered into float panels) or an empty uint32 array (bfloat16 caches gathered
    as pairs: ``_pair_products``). The loop's body is one call, as in
    ``_attention_paged_direct_numba``."""
    for work_item in prange(rows.item_seq.shape[0] * k.shape[1] * n_splits):
        _gathered_item(
            q, k, v, part_out, part_lse, rows, mods, block_m, block_n, n_splits, scales,
            pairs, np.int64(work_item),
        )  # fmt: skip


def attention_paged_numba(
    q,
    k,
    v,
    *,
    q_start,
    q_len,
    k_len,
    page_start,
    page_size,
    options,
    k_scale=None,
    v_scale=None,
    max_q=None,
    max_k=None,
):
    """Launch on NumPy arrays (float32, float64, or bfloat16 / float16 bits as uint16 / int16,
    computed in float32). Shapes as in the module docstring; q_start, q_len, k_len int64 [B],
    page_start int64 [B, pages] (entries past a sequence's last key page are never read);
    ``options`` the attention options record (``_attention_common``), its sequence b holding
    q_len[b] queries and k_len[b] keys (``max_q``/``max_k``: their maxima, when the caller
    has them). Quantized caches: k/v float8_e4m3fn bits (uint8) or
    int8, with float32 ``k_scale``/``v_scale`` [B or 1, R, Hkv] (key row r of sequence b, kv head
    h, is worth ``k[r, h] · k_scale[b, r, h]``; B of 1 serves every sequence). Returns (out [Tq,
    Hq, Dv] in the compute dtype, lse float32 [Hq, Tq])."""
    dtype = np.dtype(np.float32) if q.dtype in (np.uint16, np.int16) else q.dtype
    total_q, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    group = hq // hkv
    q_len = np.ascontiguousarray(q_len, np.int64)
    k_len = np.ascontiguousarray(k_len, np.int64)
    batch = q_len.shape[0]
    max_q = int(q_len.max(initial=0)) if max_q is None else max_q
    max_k = int(k_len.max(initial=0)) if max_k is None else max_k
    if total_q * hq == 0 or max_k == 0:
        lse = np.full((hq, total_q), -np.inf, np.float32)
        if options.sinks is not None:
            lse[...] = np.asarray(options.sinks, np.float32)[:, None]
        return np.zeros((total_q, hq, dv), dtype), lse
    block_m = max(1, min(max_q, max(128 // group, 16)))
    block_n = min(256, max_k)
    blocks = -(-q_len // block_m)
    item_seq = np.repeat(np.arange(batch, dtype=np.int64), blocks)
    item_i0 = (
        np.arange(item_seq.shape[0]) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    ) * block_m
    # thin row tiles (decoding: at most SMALL_ROWS rows, multiplied by loops) read
    # k and v in place and take every kv head in one item, so that each cache row is read once
    # and in order; a call too small to be worth waking the pool runs whole on the calling
    # thread (the contiguous kernel's rule); else keys are split when the items cannot keep
    # every thread busy
    direct = group * block_m <= SMALL_ROWS
    serial = total_q * hq * max_k * (d + dv) <= SERIAL_WORK
    threads = 1 if serial else numba.get_num_threads()
    items = item_seq.shape[0] * (1 if direct else hkv)
    key_tiles = -(-max_k // block_n)
    n_splits = key_splits(items, key_tiles, threads)
    # scores in log2 units, as the forward kernel's without a float mask
    mods = score_mods(
        dtype, LOG2E, options, key_len=k_len, q_len=q_len, unbounded=max_q + max_k + 1
    )
    rows = PagedRows(
        np.ascontiguousarray(q_start, np.int64),
        q_len,
        np.ascontiguousarray(page_start, np.int64),
        int(page_size),
        item_seq,
        item_i0,
    )
    part_out = np.empty((n_splits, total_q, hq, dv), dtype=dtype)
    # float64 until merged, as in the contiguous kernel's launcher (attention_numba)
    part_lse = np.empty((n_splits, total_q, hq), dtype=np.float64 if n_splits > 1 else np.float32)
    args = (q, k, v, part_out, part_lse, rows, mods, block_m, block_n, n_splits, (k_scale, v_scale))
    if direct:
        kernel = _attention_paged_direct_numba
        # half-precision queries on 8-bit caches, on CPUs with the instructions: pair products
        pairs = _decode_pairs.decode_pairs(q, k, v)
        args += (np.empty(0, np.int16) if pairs else None,)
    else:
        kernel = _attention_paged_numba
        # bfloat16 caches on CPUs with AVX512-BF16: key tiles gathered as bfloat16 pairs
        half = _pair_products.takes_pairs(q, k, v)
        args += (np.empty(0, np.uint32) if half else None,)
    (kernel.serial if serial else kernel)(*args)
    if n_splits == 1:
        out, lse = part_out[0], part_lse[0]
    else:
        out = np.empty((1, total_q, hq, dv), dtype=dtype)
        lse = np.empty((1, total_q, hq), dtype=np.float32)
        _merge_splits_numba(part_out[:, None], part_lse[:, None], out, lse)
        out, lse = out[0], lse[0]
    return out, np.ascontiguousarray(lse.T)
