"""Flash-style scaled dot-product attention on the CPU (Numba).

Logical shapes: q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv]
             -> out [B, Hq, Sq, Dv], lse [B, Hq, Sq] (natural log, float32).

One work item = (batch, kv head, block of query positions, slice of keys), or, when the heads
share evenly among the threads, (batch, kv head) with every query block of the head. A row tile
packs the ``group = Hq / Hkv`` query heads that share its kv head, so K and V are read once per
kv head (GQA without copying), and walks its keys in tiles: S = Q·Kᵀ, masks/biases on S, an
online softmax with a vectorisable exp2, then O += P·V. Wide row tiles multiply by panel
products (``_panels``) on K and V packed once per call — for bfloat16 inputs on CPUs with
AVX512-BF16, by bfloat16 pair products (``_pair_products``) on K and V packed as pairs; narrow
ones (decoding) by loops on K and V in place. Scores are in log2 units
(log2 e folded into the query scale), or in natural units when a float mask holds values too
large to be multiplied by log2 e (transformers' finfo.min masks): every finite mask value
stays a finite score. The causal rule is the window's right edge at 0: key tiles outside a
block's window (above the causal diagonal, or before a sliding window) are never visited; only
tiles crossing an edge are masked.
When B·Hkv·(query blocks) leaves cores idle (decoding), keys are split across items and the
partial results are merged with the log-sum-exp rule of ``merge_attention``; an attention sink
joins the first split's result only, so that it counts once.

The score modifiers travel as one ``ScoreMods`` record and the score math lives in
``_attention_common`` (exp2, soft-cap, masks, online softmax), the tile steps in
``_attention_tiles``: the paged/varlen and backward kernels share both.
"""

from __future__ import annotations

import numba
import numpy as np
from fastpe.kernels.numba import _pair_products
from fastpe.kernels.numba._attention_common import _FLAGS, LOG2E, RowTile, dense_score_mods
from fastpe.kernels.numba._attention_tiles import (
    KEY_ALIGN,
    SMALL_ROWS,
    _attend_pairs,
    _attend_panels,
    _attend_tile,
    _finish_rows,
    _is_half,
    _load_tile,
    _merge_splits_numba,
    _query_tile,
    _row_buffers,
    _split_key_range,
    key_splits,
)
from fastpe.kernels.numba._pair_products import (
    BLOCK_COLUMNS,
    PANEL,
    pack_key_pairs,
    pack_value_pairs,
    row_tile_pairs,
)
from fastpe.kernels.numba._panels import pack_key_panels, pack_value_panels, panel_columns
from fastpe.kernels.numba._runtime import njit
from numba import prange, types
from numba.extending import overload


# Each kernel compile holds one of three paths, chosen by k_panels' type (an overload, not a
# branch on its value: Numba would type every branch, and compile every path's code, for every
# call): None, K and V read in place (decoding); float panels (``_panels``); uint32 panels of
# bfloat16 pairs (``_pair_products``, bfloat16 inputs on CPUs with AVX512-BF16).
def _attend_key_tile(
    qt, k, v, k_panels, v_panels, k_tile, v_tile, s, p, acc, row_max, row_sum, work, mods, tile,
    j0, n,
):  # fmt: skip
    """Keys j0 … j0 + n - 1 for a row tile: ``_attend_tile`` on K and V in place when k_panels is
    None (widened into k_tile and v_tile if half), else ``_attend_panels`` on their panels, or
    ``_attend_pairs`` on their bfloat16 pairs (k_tile: the scratch for P's pairs)."""


@overload(_attend_key_tile)
def _attend_key_tile_impl(
    qt, k, v, k_panels, v_panels, k_tile, v_tile, s, p, acc, row_max, row_sum, work, mods, tile,
    j0, n,
):  # fmt: skip
    if isinstance(k_panels, types.NoneType):

        def in_place(
            qt, k, v, k_panels, v_panels, k_tile, v_tile, s, p, acc, row_max, row_sum, work,
            mods, tile, j0, n,
        ):  # fmt: skip
            b, hk = tile[0], tile[1]
            kt = _load_tile(k[b, hk, j0 : j0 + n], k_tile)
            vt = _load_tile(v[b, hk, j0 : j0 + n], v_tile)
            _attend_tile(qt, kt, vt, s, p, acc, row_max, row_sum, work, mods, tile, j0)

        return in_place

    if k_panels.dtype == types.uint32:

        def from_pairs(
            qt, k, v, k_panels, v_panels, k_tile, v_tile, s, p, acc, row_max, row_sum, work,
            mods, tile, j0, n,
        ):  # fmt: skip
            b, hk = tile[0], tile[1]
            kp = k_panels[b, hk, j0 // PANEL :]
            vp = v_panels[b, hk, :, j0 // 2 : (j0 + n + 1) // 2]
            _attend_pairs(qt, kp, vp, s, p, k_tile, acc, row_max, row_sum, work, mods, tile, j0, n)

        return from_pairs

    def from_panels(
        qt, k, v, k_panels, v_panels, k_tile, v_tile, s, p, acc, row_max, row_sum, work, mods,
        tile, j0, n,
    ):  # fmt: skip
        b, hk, width = tile[0], tile[1], k_panels.shape[4]
        kp = k_panels[b, hk, j0 // width : (j0 + n + width - 1) // width]
        vp = v_panels[b, hk, :, j0 : j0 + n]
        _attend_panels(qt, kp, vp, s, p, acc, row_max, row_sum, work, mods, tile, j0)

    return from_panels


def _padding(k_panels):
    """The columns ``_row_buffers`` pads the tiles to: the panel width, a pair product's block
    width, or 1 without panels."""


@overload(_padding, inline="always")
def _padding_impl(k_panels):
    if isinstance(k_panels, types.NoneType):
        return lambda k_panels: 1
    if k_panels.dtype == types.uint32:
        return lambda k_panels: BLOCK_COLUMNS
    return lambda k_panels: k_panels.shape[4]


def _key_scratch(k, k_panels, m, block_n, like):
    """A row tile's k_tile for ``_attend_key_tile``: room to widen a half-precision key tile
    read in place, or for P's bfloat16 pairs (empty otherwise)."""


@overload(_key_scratch)
def _key_scratch_impl(k, k_panels, m, block_n, like):
    if isinstance(k_panels, types.Array) and k_panels.dtype == types.uint32:
        return lambda k, k_panels, m, block_n, like: np.empty((m, (block_n + 1) // 2), np.uint32)
    rows = isinstance(k_panels, types.NoneType) and k.dtype in (types.uint16, types.int16)

    def widen_room(k, k_panels, m, block_n, like):
        return np.empty((block_n if rows else 0, k.shape[3]), like.dtype)

    return widen_room


def _query_operand(q, tile, mods, like, k_panels):
    """The row tile's queries as its products take them: ``row_tile_pairs`` for bfloat16 pairs,
    else ``_query_tile`` (widened and scaled)."""


@overload(_query_operand)
def _query_operand_impl(q, tile, mods, like, k_panels):
    if isinstance(k_panels, types.Array) and k_panels.dtype == types.uint32:
        return lambda q, tile, mods, like, k_panels: row_tile_pairs(q, tile)
    return lambda q, tile, mods, like, k_panels: _query_tile(q, tile, mods, like)


@njit(cache=True, fastmath=_FLAGS)
def _attend_query_block(
    q, k, v, k_panels, v_panels, part_out, part_lse, mods, tile, block_n, split, n_splits
):
    """One work item's rows (a ``RowTile``) against its split of the keys: S = Q·Kᵀ, modifiers,
    online softmax and O += P·V tile by tile, then the rows' output and lse in split ``split``'s
    part. On K and V packed in panels (wide tiles), or with k_panels None on K and V in place
    (decoding): ``_attention_numba``."""
    b, hk, group, i0, npos = tile
    dv = v.shape[3]
    m = group * npos
    j_begin, j_stop = _split_key_range(mods, tile, block_n, split, n_splits, KEY_ALIGN)
    qt = _query_operand(q, tile, mods, part_out, k_panels)
    tail = (j_stop - j_begin) % block_n
    acc, row_max, row_sum, work, s_full, p_full, s_tail, p_tail = _row_buffers(
        part_out, m, dv, block_n, tail, _padding(k_panels)
    )
    # half-precision K and V read in place are widened tile by tile; with bfloat16 pairs,
    # k_tile holds P's pairs
    k_tile = _key_scratch(k, k_panels, m, block_n, part_out)
    v_tile = np.empty((block_n if k_panels is None and _is_half(v) else 0, dv), part_out.dtype)
    for j0 in range(j_begin, j_stop, block_n):
        full = j_stop - j0 >= block_n
        n = block_n if full else tail
        s, p = (s_full, p_full) if full else (s_tail, p_tail)
        _attend_key_tile(
            qt, k, v, k_panels, v_panels, k_tile, v_tile, s, p, acc, row_max, row_sum, work,
            mods, tile, j0, n,
        )  # fmt: skip
    _finish_rows(
        acc, row_max, row_sum, part_out[split], part_lse[split], i0, tile, mods, split == 0
    )


def _pack_head(k, v, b, hk, k_panels, v_panels, length):
    """Kᵀ and V of head hk of sequence b into their panels (``_panels``), or their bfloat16
    pairs (``_pair_products``; values from the sequence's key ``length`` on as zeros)."""


@overload(_pack_head)
def _pack_head_impl(k, v, b, hk, k_panels, v_panels, length):
    if k_panels.dtype == types.uint32:

        def pack_pairs(k, v, b, hk, k_panels, v_panels, length):
            pack_key_pairs(k[b, hk], k_panels[b, hk])
            pack_value_pairs(v[b, hk], v_panels[b, hk], length)

        return pack_pairs

    def pack_panels(k, v, b, hk, k_panels, v_panels, length):
        pack_key_panels(k, b, hk, k_panels[b, hk])
        pack_value_panels(v, b, hk, v_panels[b, hk])

    return pack_panels


@njit(parallel=True, cache=True, fastmath=_FLAGS)
def _attention_numba(
    q, k, v, k_panels, v_panels, part_out, part_lse, mods, block_m, block_n, n_splits,
    head_items,
):  # fmt: skip
    """k_panels [B, Hkv, ceil(Sk / W), D, W] and v_panels [B, Hkv, ceil(Dv / W), Sk, W]
    (``_panels``, W = ``panel_width``): room for K and V packed, for calls whose row tiles are
    wider than SMALL_ROWS, once per call for every query block of a kv head (uint32 bfloat16
    pairs instead, shaped as ``attention_numba`` allocates them: ``_pair_products``); or both None, and
    the few-row tiles of decoding multiply K and V in place (read once). Numba compiles each
    case without the other's code: a prefill's first call does not wait for the decode loops,
    nor a decode step's for the packing and panel products."""
    batch, hq, sq = q.shape[0], q.shape[1], q.shape[2]
    hkv = k.shape[1]
    group = hq // hkv
    n_mblocks = (sq + block_m - 1) // block_m
    # Items: with head_items, one per (sequence, kv head), which packs its own head's K and V
    # and then takes every query block of the head in turn (packing runs on all threads, and
    # the head's panels stay in the core's cache across its query blocks); else one per
    # (sequence, kv head, query block, key split), for calls with too few heads to share among
    # the threads, after packing on the calling thread. One parallel loop for both: each one
    # more costs seconds of the kernel's first compile.
    if k_panels is not None:
        for head in range(0 if head_items else batch * hkv):
            seq = head // hkv
            _pack_head(k, v, seq, head % hkv, k_panels, v_panels, mods.key_len[seq])
    blocks_per_item = n_mblocks if head_items else 1
    block_items = n_mblocks // blocks_per_item  # items per (sequence, kv head, split)
    for item in prange(batch * hkv * block_items * n_splits):
        split = item % n_splits
        rest = item // n_splits
        mb_first = rest % block_items
        rest //= block_items
        hk = rest % hkv
        b = rest // hkv
        if k_panels is not None:  # alone in its test: Numba drops what k_panels' type rules out
            if head_items:
                _pack_head(k, v, b, hk, k_panels, v_panels, mods.key_len[b])
        for mb in range(mb_first, mb_first + blocks_per_item):
            i0 = mb * block_m
            tile = RowTile(b, hk, group, i0, min(block_m, sq - i0))
            _attend_query_block(
                q, k, v, k_panels, v_panels, part_out, part_lse, mods, tile, block_n, split,
                n_splits,
            )  # fmt: skip


# Calls with at most this many multiply-adds (B·Hq·Sq·Sk·(D + Dv): a short decode step) run on
# the calling thread, unsplit: below it, waking the pool costs more than the second thread saves
# (dense and paged decode steps timed both ways, with and without torch's pool: serial about as
# fast at 2^20, faster at 2^18, slower from 2^22 on; bench/serial_threshold.py).
SERIAL_WORK = 1 << 20


def items_per_head(heads: int, threads: int, n_splits: int) -> bool:
    """Whether ``_attention_numba`` takes one work item per (sequence, kv head) rather than
    per query block: when the keys are not split and the heads share evenly among the threads,
    or are many enough that the idle threads of the last round matter little."""
    return n_splits == 1 and (heads % threads == 0 or heads >= 4 * threads)


def _block_sizes(sq: int, sk: int, group: int) -> tuple[int, int]:
    """Query positions per tile (times `group` heads -> rows) and keys per tile.

    128 rows x 256 keys keeps the Q, S/P and accumulator tiles in L2 while each tile product
    does enough work to run near peak (best with BLAS's products among 32-128 rows x 128-512
    keys, D 64 and 128; with the panel products no size among 64-256 rows x 128-512 keys was
    faster beyond the noise of a 2-core AVX2 machine).
    """
    block_m = max(1, min(sq, max(128 // group, 16)))
    block_n = 256
    # a multiple of KEY_ALIGN, so that every key tile starts on a panel of packed keys
    return block_m, min(block_n, -(-max(sk, 1) // KEY_ALIGN) * KEY_ALIGN)


def _largest_finite_magnitude(mask):
    """max |finite value| of a mask, read from its stored elements only (a broadcast view's
    stride-0 axes are collapsed, so this never walks [B, Hq, Sq, Sk] for a smaller mask)."""
    stored = mask[tuple(slice(0, 1) if st == 0 else slice(None) for st in mask.strides)]
    return max(
        float(np.max(stored, where=stored > -np.inf, initial=0.0)),
        -float(np.min(stored, where=stored > -np.inf, initial=0.0)),
    )


def attention_numba(q, k, v, *, options, mask=None, key_lengths=None, relative_bias=None):
    """Launch the flash-style kernel on NumPy arrays (float32, float64, or bfloat16 / float16
    bits as uint16 / int16, read tile by tile and computed in float32; any strides).

    ``options``: the attention options record (``_attention_common``); sequence b has
    key_lengths[b] keys (int [B]; None: Sk). ``mask``: None, or a bool (True = attend) or float
    (added; float32 or float64 whatever q's dtype) array already broadcast to [B, Hq, Sq, Sk],
    typically a stride-0 view: it is read in place, never copied. ``relative_bias``: None or
    (table [num_buckets, Hq], num_buckets, max_distance, bidirectional). Returns (out [B, Hq,
    Sq, Dv] in the compute dtype, lse float32 [B, Hq, Sq]).
    """
    # half bits (uint16 bfloat16, int16 float16) are computed in float32 and returned so; q and
    # k may already be float32 (rotated by fused RoPE) while v is still half bits
    dtype = np.dtype(np.float32) if v.dtype in (np.uint16, np.int16) else v.dtype
    batch, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    if batch * hq * sq == 0 or sk == 0:  # nothing to compute: empty, or every row sees no key
        lse = np.full((batch, hq, sq), -np.inf, np.float32)
        if options.sinks is not None:
            lse[...] = np.asarray(options.sinks, np.float32)[None, :, None]
        return np.zeros((batch, hq, sq, dv), dtype), lse
    q, k, v = (np.ascontiguousarray(a) for a in (q, k, v))  # each in its own (bit) dtype
    group = hq // hkv
    block_m, block_n = _block_sizes(sq, sk, group)
    n_mblocks = -(-sq // block_m)
    # split keys when (batch, kv head, query block) items cannot keep every thread busy; a call
    # too small to be worth waking the pool runs whole on the calling thread
    serial = batch * hq * sq * sk * (d + dv) <= SERIAL_WORK
    threads = 1 if serial else numba.get_num_threads()
    items = batch * hkv * n_mblocks
    key_tiles = -(-sk // block_n)
    n_splits = key_splits(items, key_tiles, threads)
    head_items = items_per_head(batch * hkv, threads, n_splits)
    # Scores in log2 units (log2 e folded into the query scale: measurably more accurate in
    # float32 than scaling each difference), unless a float mask holds values so large that
    # times log2 e they would overflow: then natural units, where every finite mask stays a
    # finite score (transformers' finfo.min masks)
    unit = LOG2E
    if mask is not None and mask.dtype != np.bool_:
        if _largest_finite_magnitude(mask) > float(np.finfo(dtype).max) / 4:
            unit = 1.0
    mods = dense_score_mods(
        dtype, unit, options, q, k, mask=mask, key_lengths=key_lengths, relative_bias=relative_bias
    )
    wide = group * block_m > SMALL_ROWS  # wide row tiles: room for K and V packed in panels
    if wide and _pair_products.takes_pairs(q, k, v):
        # bfloat16 pairs; keys past Sk to the end of the last tile's padded width are zeros
        k_panels = np.empty((batch, hkv, -(-sk // PANEL) + 2, -(-d // 2), PANEL), np.uint32)
        v_panels = np.empty(
            (batch, hkv, -(-dv // BLOCK_COLUMNS) * 2, -(-sk // 2), PANEL), np.uint32
        )
    elif wide:
        width = panel_columns(dtype)
        k_panels = np.empty((batch, hkv, -(-sk // width), d, width), dtype)
        v_panels = np.empty((batch, hkv, -(-dv // width), sk, width), dtype)
    else:
        k_panels = v_panels = None
    out = np.empty((n_splits, batch, hq, sq, dv), dtype=dtype)
    # split parts keep their lse in float64 until merged: the merge weighs each part by
    # exp(part_lse - lse), and an lse of size ~40 rounded to float32 is alone a relative 1e-6
    # error of that weight (as large as torch's whole float32 error on a decode step); unsplit
    # calls too, so that the kernel has one specialisation fewer to compile
    lse = np.empty((n_splits, batch, hq, sq), dtype=np.float64)
    kernel = _attention_numba.serial if serial else _attention_numba
    kernel(q, k, v, k_panels, v_panels, out, lse, mods, block_m, block_n, n_splits, head_items)
    if n_splits == 1:
        return out[0], lse[0].astype(np.float32)
    merged = np.empty((batch, hq, sq, dv), dtype=dtype)
    merged_lse = np.empty((batch, hq, sq), dtype=np.float32)
    _merge_splits_numba(out, lse, merged, merged_lse)
    return merged, merged_lse


def merge_attention_numba(out_a, lse_a, out_b, lse_b):
    """Merge two partial results (the split-KV combine, exposed as fastpe.merge_attention)."""
    out = np.empty(out_a.shape, dtype=out_a.dtype)
    lse = np.empty(lse_a.shape, dtype=np.float32)
    _merge_splits_numba(
        np.stack([out_a, out_b]), np.stack([lse_a, lse_b]).astype(np.float32), out, lse
    )
    return out, lse
