"""The tile steps shared by the dense and paged/varlen Numba attention kernels: half-precision
reads, the few-row products of decoding, one key tile's update of a row tile's online softmax,
the key range of a split, the rows' final normalisation, and the merge of split results.
"""

from __future__ import annotations

import math

import numpy as np
from fastpe.kernels.numba._attention_common import (
    _FLAGS,
    _edges_only,
    _modify_scores,
    _nearest_key_distance,
    _softmax_update,
)
from fastpe.kernels.numba._half import _widen
from fastpe.kernels.numba._pair_products import pair_product, round_weight_pairs
from fastpe.kernels.numba._panels import WIDEST_PANEL, panel_product
from fastpe.kernels.numba._runtime import njit
from numba import prange, types
from numba.extending import overload


# Half-precision q/k/v travel as their bits (bfloat16 as uint16, float16 as int16: Numba has
# neither type) and are widened to float32 as they are read: one query block and one key tile at
# a time into scratch tiles, or into the panels of packed keys and values (``_panels``); the
# tensors are never converted whole.
def _load_tile(src, scratch):
    """A [n, d] tile of k or v as the compute dtype: ``src`` itself for float arrays, else
    widened into ``scratch[:n]``."""


def _is_half(array):
    """True for arrays of half bits (a compile-time constant)."""


@overload(_is_half, inline="always")
def _is_half_impl(array):
    half = array.dtype in (types.uint16, types.int16)
    return lambda array: half


@overload(_load_tile, inline="always")
def _load_tile_impl(src, scratch):
    if src.dtype in (types.uint16, types.int16):

        def widen_into(src, scratch):
            n, d = src.shape
            for r in range(n):
                for c in range(d):
                    scratch[r, c] = _widen(src[r, c])
            return scratch[:n]

        return widen_into
    return lambda src, scratch: src


# Row tiles up to this many rows (decoding: the query heads of one kv head at one position)
# multiply by plain loops on K and V as they are; wider ones by panel products (``_panels``).
# Packing K and V into panels reads and writes them once more, which the products of a few rows
# do not repay: decoding is bound by reading K and V once.
SMALL_ROWS = 16


@njit(cache=True, fastmath=_FLAGS)
def _scores_small(qt, kt, hk, s, col):
    """s[:, col + c] = qt·kt[c, hk] for a few query rows, four keys at a time: each query
    element read serves four independent sums (one key at a time was 2x slower: a horizontal
    sum per score).

    qt [m, D]; kt [n, H, D]: n key rows each holding H heads side by side (H = 1 for one
    head's tile, H = Hkv for rows of a paged cache, read in place); s [m, >= col + n]. All
    C-contiguous: on a strided 2D view of one head (layout 'A') the loop over D does not know
    its unit stride and ran 9x slower. Half-precision bits are widened as read."""
    m, d = qt.shape
    n = kt.shape[0]
    full = n - n % 4
    zero = s.dtype.type(0.0)
    for c in range(0, full, 4):
        for r in range(m):
            s0 = s1 = s2 = s3 = zero
            for e in range(d):
                x = qt[r, e]
                s0 += x * _widen(kt[c, hk, e])
                s1 += x * _widen(kt[c + 1, hk, e])
                s2 += x * _widen(kt[c + 2, hk, e])
                s3 += x * _widen(kt[c + 3, hk, e])
            j = col + c
            s[r, j], s[r, j + 1], s[r, j + 2], s[r, j + 3] = s0, s1, s2, s3
    for c in range(full, n):
        for r in range(m):
            total = zero
            for e in range(d):
                total += qt[r, e] * _widen(kt[c, hk, e])
            s[r, col + c] = total


@njit(cache=True, fastmath=_FLAGS)
def _add_weighted_values_small(p, col, vt, hk, acc):
    """acc += p[:, col : col + n]·vt[:, hk] for a few rows, four value rows at a time (they
    stay in L1 across the rows; one at a time, the load and store of acc per multiply-add made
    it 2.5x slower). vt [n, H, Dv] as kt in ``_scores_small``."""
    m = p.shape[0]
    n, dv = vt.shape[0], vt.shape[2]
    full = n - n % 4
    for c in range(0, full, 4):
        j = col + c
        for r in range(m):
            w0, w1, w2, w3 = p[r, j], p[r, j + 1], p[r, j + 2], p[r, j + 3]
            for e in range(dv):
                acc[r, e] += (
                    w0 * _widen(vt[c, hk, e])
                    + w1 * _widen(vt[c + 1, hk, e])
                    + w2 * _widen(vt[c + 2, hk, e])
                    + w3 * _widen(vt[c + 3, hk, e])
                )
    for c in range(full, n):
        for r in range(m):
            w = p[r, col + c]
            for e in range(dv):
                acc[r, e] += w * _widen(vt[c, hk, e])


@njit(cache=True, fastmath=_FLAGS)
def _attend_tile(qt, kt, vt, s, p, acc, row_max, row_sum, work, mods, tile, j0):
    """Keys j0 … j0 + n - 1 for a ``RowTile`` of at most SMALL_ROWS rows, K and V as rows
    (kt, vt [n, D]): S = Q·Kᵀ, its modifiers, online-softmax update, O += P·V (s, p and acc
    may be wider than n and Dv: ``_row_buffers``)."""
    n = kt.shape[0]
    _scores_small(qt, kt[:, None], 0, s, 0)
    _modify_scores(s, mods, tile, j0, n)
    _softmax_update(s, p, acc, row_max, row_sum, work, n, mods.unit)
    _add_weighted_values_small(p, 0, vt[:, None], 0, acc)


# Q·Kᵀ sums over the head dim in parts of this many terms (``panel_product``): float32 scores
# in one part had twice SDPA's error at head dim 128
SCORE_SUM_TERMS = 32


@njit(cache=True, fastmath=_FLAGS)
def _attend_panels(qt, k_panels, v_panels, s, p, acc, row_max, row_sum, work, mods, tile, j0):
    """``_attend_tile`` for wider tiles, on keys and values in panels (``_panels``): k_panels
    holds Kᵀ of keys j0 … j0 + n - 1 from its first column (and whatever follows, up to s's
    padded width), v_panels [*, n, W] their values."""
    n = v_panels.shape[1]
    panel_product(s, qt, k_panels, False, SCORE_SUM_TERMS)
    _modify_scores(s, mods, tile, j0, n)
    _softmax_update(s, p, acc, row_max, row_sum, work, n, mods.unit)
    # the tile's weighted sum joins acc at once
    panel_product(acc, p[:, :n], v_panels, True, n)


@njit(cache=True, fastmath=_FLAGS)
def _attend_pairs(
    qt, k_pairs, v_pairs, s, p, p_pairs, acc, row_max, row_sum, work, mods, tile, j0, n
):
    """``_attend_panels`` on bfloat16 pairs (``_pair_products``): qt the row tile's query
    pairs (unscaled), k_pairs Kᵀ's pairs of keys j0 … from its first panel, v_pairs the value
    pairs of keys j0 … j0 + n - 1, p_pairs scratch for P rounded to bfloat16 pairs."""
    pair_product(s, qt, k_pairs, False)
    scale_units = s.dtype.type(mods.scale * mods.unit)
    for r in range(s.shape[0]):
        for c in range(n):
            s[r, c] *= scale_units
    _modify_scores(s, mods, tile, j0, n)
    _softmax_update(s, p, acc, row_max, row_sum, work, n, mods.unit)
    half = (n + 1) // 2
    round_weight_pairs(p, n, p_pairs)
    pair_product(acc, p_pairs[:, :half], v_pairs[:, :half], True)


@njit(cache=True)
def scaled_query_row(row, out, scale_units):
    """out = one query row, widened and times the score scale (``scale_units``)."""
    for c in range(row.shape[0]):
        out[c] = _widen(row[c]) * scale_units


@njit(cache=True)
def _query_tile(q, tile, mods, like):
    """The query rows of a ``RowTile`` from dense q [B, Hq, Sq, D], widened and times the
    score scale in ``mods``' units, as a new [group · npos, D] array in ``like``'s dtype."""
    b, hk, group, i0, npos = tile
    qt = np.empty((group * npos, q.shape[3]), dtype=like.dtype)
    scale_units = like.dtype.type(mods.scale * mods.unit)
    for g in range(group):
        for r in range(npos):
            scaled_query_row(q[b, hk * group + g, i0 + r], qt[g * npos + r], scale_units)
    return qt


@njit(cache=True)
def _row_buffers(like, m, dv, block_n, tail, pad_to):
    """The buffers of one row tile of m rows, in ``like``'s dtype: the output accumulator
    [m, Dv] (zeros), running max (-inf) and sum (zeros) [m], work [4, m] (per-row alpha, sum
    and shift of the current tile), and the S and P tiles at full width [m, block_n] and for
    the last partial key tile [m, tail] (separate arrays: Numba's parallel array analysis
    forbids re-binding a name to a differently shaped array).

    Every buffer comes from ``np.empty`` of a 2-D shape (the row statistics are rows of one
    array) and is filled by loops: each other allocation form (``np.zeros``, ``np.full``, a 1-D
    shape) is one more Numba compile on a first call, about 0.2 s apiece.

    The S/P tiles and the accumulator are padded to a multiple of ``pad_to`` columns: the
    panel products (``_panels``) write whole panels, so the kernels that use them pass the
    panel width (the others 1); every step reads only the first n columns (Dv of acc)."""
    dtype = like.dtype
    dv = (dv + pad_to - 1) // pad_to * pad_to
    block_n = (block_n + pad_to - 1) // pad_to * pad_to
    tail = (tail + pad_to - 1) // pad_to * pad_to
    acc = np.empty((m, dv), dtype=dtype)
    stats = np.empty((6, m), dtype=dtype)
    work, row_max, row_sum = stats[:4], stats[4], stats[5]
    for r in range(m):
        row_max[r] = -np.inf
        row_sum[r] = 0.0
        for c in range(dv):
            acc[r, c] = 0.0
    s_full = np.empty((m, block_n), dtype=dtype)
    p_full = np.empty((m, block_n), dtype=dtype)
    s_tail = np.empty((m, tail), dtype=dtype)
    p_tail = np.empty((m, tail), dtype=dtype)
    return acc, row_max, row_sum, work, s_full, p_full, s_tail, p_tail


# the dense kernel's key tiles start at multiples of this: whole panels of packed keys
KEY_ALIGN = WIDEST_PANEL


@njit(cache=True)
def _split_key_range(mods, tile, block_n, split, n_splits, key_align):
    """[j_begin, j_stop): split ``split`` of ``n_splits`` of the keys that the queries of a
    ``RowTile`` can see (below its sequence's length and within their windows), cut in whole
    key tiles of ``block_n`` from a multiple of ``key_align``: the keys this adds before a
    window are masked as in any tile crossing the window's edge (the dense kernel aligns its
    tiles on whole panels of packed keys; a paged cache may hold no page for them)."""
    b, _, _, i0, npos = tile
    first_pos, length = i0 + mods.query_shift[b], mods.key_len[b]
    win_left, win_right = mods.win_left, mods.win_right
    j_lo = max(first_pos - win_left, 0) // key_align * key_align
    j_end = max(min(length, first_pos + npos + win_right), j_lo)
    tiles = (j_end - j_lo + block_n - 1) // block_n
    per_split = (tiles + n_splits - 1) // n_splits
    j_begin = min(j_lo + split * per_split * block_n, j_end)
    return j_begin, min(j_lo + (split + 1) * per_split * block_n, j_end)


# The dense kernel's parts are [B, Hq, Sq, Dv] and [B, Hq, Sq], the packed ones' [Tq, Hq, Dv]
# and [Tq, Hq]: one finishing step for both, by index (transposed views of the dense parts
# would cost a second of compile time each, in Numba's general transpose).
def _out_row(out, b, row, h):
    """out's output vector of query ``row`` (of sequence b) and head h."""


@overload(_out_row, inline="always")
def _out_row_impl(out, b, row, h):
    if out.ndim == 4:
        return lambda out, b, row, h: out[b, h, row]
    return lambda out, b, row, h: out[row, h]


def _set_lse(lse, b, row, h, value):
    """lse of query ``row`` (of sequence b) and head h = value."""


@overload(_set_lse, inline="always")
def _set_lse_impl(lse, b, row, h, value):
    if lse.ndim == 3:

        def dense(lse, b, row, h, value):
            lse[b, h, row] = value

        return dense

    def packed(lse, b, row, h, value):
        lse[row, h] = value

    return packed


def _sink(mods, h, first_split):
    """The sink logit of head h in a split's rows (only the first split's: merged, a sink counts
    once), -inf for none."""


@overload(_sink, inline="always")
def _sink_impl(mods, h, first_split):
    if _edges_only(mods):
        return lambda mods, h, first_split: -np.inf
    return lambda mods, h, first_split: mods.sinks[h] if mods.has_sinks and first_split else -np.inf


def _lse_modifiers(lse_row, inv, mods, b, h, i, sink):
    """(lse, 1 / row sum) of the row of query i, head h (over its keys, as the tile steps
    leave them) -> both with ALiBi's common part and the sink: out · exp(lse_keys - lse) with
    lse = logaddexp(lse_keys, sink)."""


@overload(_lse_modifiers, inline="always")
def _lse_modifiers_impl(lse_row, inv, mods, b, h, i, sink):
    if _edges_only(mods):
        return lambda lse_row, inv, mods, b, h, i, sink: (lse_row, inv)
    return _with_lse_modifiers


def _with_lse_modifiers(lse_row, inv, mods, b, h, i, sink):
    if mods.has_alibi:  # the common ALiBi part the tile step leaves out
        near = _nearest_key_distance(i + mods.query_shift[b], mods.key_len[b])
        lse_row -= mods.alibi[b, h] / mods.unit * near
    if sink > -np.inf:
        top = max(lse_row, sink)
        lse_with = top + math.log(math.exp(lse_row - top) + math.exp(sink - top))
        inv *= math.exp(lse_row - lse_with)
        lse_row = lse_with
    return lse_row, inv


@njit(cache=True)
def _finish_rows(acc, row_max, row_sum, out, lse, row0, tile, mods, first_split):
    """out = acc / row sum and lse for the rows of a ``RowTile`` (its query heads h x its
    queries r, at rows row0 + r of a split's part out and lse: dense or packed). The heads'
    sinks join the first split only: merged, a sink counts once."""
    b, hk, group, i0, npos = tile
    for g in range(group):
        h = hk * group + g
        for r in range(npos):
            row = g * npos + r
            total = row_sum[row]
            sink = _sink(mods, h, first_split)
            if total != 0.0:  # NaN too (an overflowed score): it must show, as in SDPA
                lse_row, inv = _lse_modifiers(
                    row_max[row] / mods.unit + math.log(total), 1.0 / total, mods, b, h,
                    i0 + r, sink,
                )  # fmt: skip
                dst = _out_row(out, b, row0 + r, h)
                for c in range(dst.shape[0]):
                    dst[c] = acc[row, c] * inv
                _set_lse(lse, b, row0 + r, h, lse_row)
            else:  # no key to attend: zeros, lse = -inf (or the sink)
                dst = _out_row(out, b, row0 + r, h)
                for c in range(dst.shape[0]):
                    dst[c] = 0.0
                _set_lse(lse, b, row0 + r, h, sink)


@njit(cache=True)
def _merge_row(part_out, part_lse, out, lse, row):
    """``_merge_splits_numba`` for one row (sequence, head, query)."""
    n_splits, _, hq, sq, dv = part_out.shape
    i = row % sq
    h = (row // sq) % hq
    b = row // (sq * hq)
    top = -np.inf
    for sp in range(n_splits):
        x = part_lse[sp, b, h, i]
        if x > top or x != x:  # a NaN part (NaN queries) makes the row NaN
            top = x
    if top == -np.inf:
        lse[b, h, i] = -np.inf
        for c in range(dv):
            out[b, h, i, c] = 0.0
        return
    total = 0.0
    for sp in range(n_splits):
        total += math.exp(part_lse[sp, b, h, i] - top)
    lse_row = top + math.log(total)
    lse[b, h, i] = lse_row
    for c in range(dv):
        out[b, h, i, c] = 0.0
    for sp in range(n_splits):
        w = math.exp(part_lse[sp, b, h, i] - lse_row)
        if w != 0.0:  # a part that saw no key (lse -inf) adds nothing; NaN shows
            for c in range(dv):
                out[b, h, i, c] += w * part_out[sp, b, h, i, c]


@njit(parallel=True, cache=True)
def _merge_splits_numba(part_out, part_lse, out, lse):
    """out = Σ_s part_out[s]·exp(part_lse[s] - lse), lse = log Σ_s exp(part_lse[s]); the loop's
    body is one call (Numba types a parallel loop's body twice)."""
    _, batch, hq, sq, _ = part_out.shape
    for row in prange(batch * hq * sq):
        _merge_row(part_out, part_lse, out, lse, np.int64(row))


def key_splits(items: int, key_tiles: int, threads: int) -> int:
    """Parts to split each work item's keys into: when the items alone cannot keep every thread
    busy (twice over, for balance), never more parts than key tiles."""
    if items < 2 * threads and key_tiles > 1:
        return min(key_tiles, -(-2 * threads // items))
    return 1
