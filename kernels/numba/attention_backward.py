"""Attention's backward pass on the CPU (Numba), FlashAttention-2 style.

Logical shapes: q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] (q and k already
rotated by fused RoPE), out and grad_out [B, Hq, Sq, Dv], lse [B, Hq, Sq] (natural log)
          -> dq [B, Hq, Sq, D], dk [B, Hkv, Sk, D], dv [B, Hkv, Sk, Dv] (float32),
             dsinks [Hq] and the T5 table's gradient [num_buckets, Hq] (float64) when asked.

Scores are recomputed tile by tile from q and k; the softmax weights come back from the
forward's lse, P = exp(z - lse), so no [Sq, Sk] matrix is ever held
(docs/math.md#attention-backward). One work item = (batch, kv head, slice of keys): it walks every query block that can
see its keys (the group's query heads packed into one tile of rows, as in the forward), keeps
dK and dV of its keys in accumulators, and writes dQ of each query block
into its own slice's partial buffer; the partial dQs are summed afterwards in slice order.
No two items write one element, so the result does not depend on thread timing.

bfloat16 inputs on a CPU with AVX512-BF16 take ``_backward_item_pairs``: the same steps on
bfloat16 pairs (``_pair_products``), P and dS rounded to bfloat16 for their products.

The score modifiers (``ScoreMods``, ``_modify_scores_for_backward`` and its derivative), exp2 and
the half-precision reads are the forward's (``_attention_common``, ``_attention_tiles``): one
definition of what a score is (fastpe's cache key covers every kernel file, so a change there
recompiles this one too: ``_runtime._KernelCache``).
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from fastpe.kernels.numba import _pair_products
from fastpe.kernels.numba._attention_common import (
    _FLAGS,
    LOG2E,
    RowTile,
    _exp2,
    _modify_scores_for_backward,
    _nearest_key_distance,
    _relative_bias_by_distance_numba,
    _score_gradient,
    dense_score_mods,
)
from fastpe.kernels.numba._attention_tiles import _load_tile, key_splits
from fastpe.kernels.numba._blas import gemm
from fastpe.kernels.numba._half import _widen
from fastpe.kernels.numba._pair_products import (
    BLOCK_COLUMNS,
    PANEL,
    pack_key_pairs,
    pack_value_pairs,
    pair_product,
    round_row_panels,
    round_weight_pairs,
    row_tile_column_pairs,
    row_tile_pairs,
)
from fastpe.kernels.numba._runtime import njit, single_threaded_blas
from numba import prange


@njit(cache=True, fastmath=_FLAGS, error_model="numpy")
def _weights_and_score_gradient(s, dp, ref, delta, dz_ds, dbias, mods, tile, j0, n):
    """The elementwise part of a (row tile, key tile) step on its first n columns: the
    modified scores s -> P = exp(Z - ref) in place, dP (= dO·Vᵀ) -> dS in place through
    dZ = P∘(dP - delta) (dbias[g, distance] += dZ) and dS = dZ∘∂Z/∂S."""
    m, npos, query_shift = s.shape[0], tile.npos, mods.query_shift[tile.b]
    to_log2 = s.dtype.type(LOG2E)
    for r in range(m):
        shift = ref[r]
        for c in range(n):
            # s is -inf where masked and ref is +inf in rows that saw no key: both give 0
            s[r, c] = _exp2((s[r, c] - shift) * to_log2)
    for r in range(m):
        dr = delta[r]
        for c in range(n):
            dp[r, c] = s[r, c] * (dp[r, c] - dr)
    if mods.has_bias:
        for r in range(m):
            g = r // npos
            base = mods.bias_offset - (tile.i0 + r - g * npos + query_shift) + j0
            for c in range(n):
                dbias[g, base + c] += dp[r, c]
    _score_gradient(dp, dz_ds)


@njit(cache=True, fastmath=_FLAGS)
def _backward_tile(qs, kt, vt, go, ref, delta, dq_acc, dk_acc, dv_acc, dbias, mods, tile, j0):
    """One (row tile, key tile) in float32: S = Qs·Kᵀ (Qs = scale·Q), its modifiers Z,
    P = exp(Z - ref), dP = dO·Vᵀ, dZ = P∘(dP - delta), dS = dZ∘∂Z/∂S; dV += Pᵀ·dO,
    dK += dSᵀ·Qs, dQ += dS·K (scaled by the caller), dbias[g, distance] += dZ."""
    m, n = qs.shape[0], kt.shape[0]
    s = np.empty((m, n), dtype=qs.dtype)
    gemm(s, qs, kt, False, True, 0.0)
    dz_ds = _modify_scores_for_backward(s, mods, tile, j0, n)
    dp = np.empty((m, n), dtype=qs.dtype)
    gemm(dp, go, vt, False, True, 0.0)
    _weights_and_score_gradient(s, dp, ref, delta, dz_ds, dbias, mods, tile, j0, n)
    p, ds = s, dp
    gemm(dv_acc, p, go, True, False, 1.0)
    gemm(dk_acc, ds, qs, True, False, 1.0)
    gemm(dq_acc, ds, kt, False, False, 1.0)


class BackwardGrads(NamedTuple):
    """The kernel's outputs: dq_part [splits, B, Hq, Sq, D] (each key slice's share of dQ),
    dk [B, Hkv, Sk, D], dv [B, Hkv, Sk, Dv], dbias_part [items, group, distances] (each work
    item's gradient of the relative bias by distance)."""

    dq_part: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dbias_part: np.ndarray


# The small steps of a work item are inlined into it (typed with it): a process mostly compiles
# one of the two item functions, and a function compiled apart costs its own compile (about
# 0.1 s of a first backward call each).
@njit(cache=True, inline="always")
def _item_keys(k, grads, item, mods, block_n):
    """Work item ``item``'s (batch b, kv head hk, key slice split) and its keys
    [j_begin, j_stop) (empty when the slice lies past the sequence's keys)."""
    hkv, n_splits = k.shape[1], grads.dq_part.shape[0]
    split = item % n_splits
    hk = (item // n_splits) % hkv
    b = item // (n_splits * hkv)
    length = mods.key_len[b]
    tiles = (length + block_n - 1) // block_n
    per_split = (tiles + n_splits - 1) // n_splits
    j_begin = min(split * per_split * block_n, length)
    j_stop = min((split + 1) * per_split * block_n, length)
    return b, hk, split, j_begin, j_stop


@njit(cache=True, inline="always")
def _query_range(mods, b, j_begin, j_stop, sq):
    """[i_lo, i_hi): the queries that can see a key of [j_begin, j_stop): position
    p = i + shift with j - win_right <= p <= j + win_left."""
    shift = mods.query_shift[b]
    i_lo = max(j_begin - mods.win_right - shift, 0)
    return i_lo, min(j_stop - 1 + mods.win_left - shift + 1, sq)


@njit(cache=True, inline="always")
def _tile_key_range(mods, tile, j_begin, j_stop, align):
    """[j_lo, j_end): the keys of the slice [j_begin, j_stop) that a ``RowTile``'s windows
    reach, j_lo aligned down to a multiple of ``align`` from j_begin (the keys this adds before
    a window are masked, as in any tile crossing its edge)."""
    first_pos = tile.i0 + mods.query_shift[tile.b]
    j_lo = max(j_begin, first_pos - mods.win_left)
    j_lo = j_begin + (j_lo - j_begin) // align * align
    return j_lo, min(j_stop, first_pos + tile.npos + mods.win_right)


@njit(cache=True, inline="always")
def _row_references(lse, delta, mods, tile, dtype):
    """(ref, row_delta) of the rows of a ``RowTile``: the reference each row's weights are
    taken against (the forward's lse; +inf for a row that saw no key) and its delta."""
    b, hk, group, i0, npos = tile
    ref = np.empty(group * npos, dtype=dtype)
    row_delta = np.empty(group * npos, dtype=dtype)
    shift, length = mods.query_shift[b], mods.key_len[b]
    for g in range(group):
        h = hk * group + g
        for r in range(npos):
            row = g * npos + r
            lse_row = lse[b, h, i0 + r]
            if lse_row == -np.inf:
                ref[row] = np.inf  # the row saw nothing: every weight is 0
            else:
                ref[row] = lse_row
                if mods.has_alibi:  # the scores leave out the row's nearest distance
                    ref[row] += mods.alibi[b, h] * _nearest_key_distance(i0 + r + shift, length)
            row_delta[row] = delta[b, h, i0 + r]
    return ref, row_delta


@njit(cache=True, inline="always")
def _store_dq(dq_part, split, tile, dq_acc, scale):
    """This key slice's share of dQ for the rows of a ``RowTile``: dq_acc · scale."""
    b, hk, group, i0, npos = tile
    for g in range(group):
        for r in range(npos):
            dst = dq_part[split, b, hk * group + g, i0 + r]
            for c in range(dst.shape[0]):
                dst[c] = dq_acc[g * npos + r, c] * scale


@njit(cache=True, fastmath=_FLAGS)
def _backward_item_widened(q, k, v, grad_out, lse, delta, grads, item, mods, block_m, block_n):
    """Gradients from work item ``item`` = (batch, kv head, key slice), in float32 (half
    inputs widened as read): dK, dV of the slice's keys and this slice's share of dQ."""
    b, hk, split, j_begin, j_stop = _item_keys(k, grads, item, mods, block_n)
    if j_begin >= j_stop:
        return
    hq, sq, d = q.shape[1], q.shape[2], q.shape[3]
    dvd = v.shape[3]
    group = hq // k.shape[1]
    dtype = grads.dq_part.dtype
    dbias = grads.dbias_part[item]
    dk_acc = np.zeros((j_stop - j_begin, d), dtype=dtype)
    dv_acc = np.zeros((j_stop - j_begin, dvd), dtype=dtype)
    k_tile = np.empty((block_n, d), dtype=dtype)
    v_tile = np.empty((block_n, dvd), dtype=dtype)
    i_lo, i_hi = _query_range(mods, b, j_begin, j_stop, sq)
    for i0 in range(i_lo, i_hi, block_m):
        npos = min(block_m, i_hi - i0)
        m = group * npos
        qs = np.empty((m, d), dtype=dtype)
        go = np.empty((m, dvd), dtype=dtype)
        for g in range(group):
            h = hk * group + g
            for r in range(npos):
                row = g * npos + r
                for c in range(d):
                    qs[row, c] = _widen(q[b, h, i0 + r, c]) * mods.scale
                for c in range(dvd):
                    go[row, c] = grad_out[b, h, i0 + r, c]
        tile = RowTile(b, hk, group, i0, npos)
        ref, row_delta = _row_references(lse, delta, mods, tile, dtype)
        dq_acc = np.zeros((m, d), dtype=dtype)
        j_lo, j_end = _tile_key_range(mods, tile, j_begin, j_stop, 1)
        for j0 in range(j_lo, j_end, block_n):
            n = min(block_n, j_end - j0)
            off = j0 - j_begin
            kt = _load_tile(k[b, hk, j0 : j0 + n], k_tile)
            vt = _load_tile(v[b, hk, j0 : j0 + n], v_tile)
            dk_tile, dv_tile = dk_acc[off : off + n], dv_acc[off : off + n]
            _backward_tile(
                qs, kt, vt, go, ref, row_delta, dq_acc, dk_tile, dv_tile, dbias, mods, tile, j0
            )
        _store_dq(grads.dq_part, split, tile, dq_acc, mods.scale)
    for j in range(j_stop - j_begin):
        for c in range(d):
            grads.dk[b, hk, j_begin + j, c] = dk_acc[j, c]
        for c in range(dvd):
            grads.dv[b, hk, j_begin + j, c] = dv_acc[j, c]


@njit(cache=True, fastmath=_FLAGS)
def _backward_item_pairs(q, k, v, grad_out, lse, delta, grads, item, mods, block_m, block_n):
    """``_backward_item_widened`` on bfloat16 pairs (``_pair_products``; q, k, v and grad_out
    bfloat16 bits): the five products of a tile step by ``pair_product``, with P and dS
    rounded to bfloat16 for theirs and every sum in float32. dK and dV are accumulated
    transposed (dVᵀ += dOᵀ·P, dKᵀ += Qᵀ·dS), so that P and dS are packed row pair by row pair
    (``round_row_panels``) and only Qᵀ and dOᵀ, once per row tile, are transposed. Key tiles
    start at multiples of a panel from the slice's first key (``_tile_key_range``)."""
    b, hk, split, j_begin, j_stop = _item_keys(k, grads, item, mods, block_n)
    if j_begin >= j_stop:
        return
    hq, sq, d = q.shape[1], q.shape[2], q.shape[3]
    dvd = v.shape[3]
    group = hq // k.shape[1]
    dtype = grads.dq_part.dtype
    dbias = grads.dbias_part[item]
    keys = j_stop - j_begin
    # the slice's keys, packed once: Kᵀ and Vᵀ for S = Q·Kᵀ and dP = dO·Vᵀ (pairs along D; a
    # tile's panels from its first key to its padded width), K for dQ = dS·K (pairs along keys)
    key_rows, value_rows = k[b, hk, j_begin:j_stop], v[b, hk, j_begin:j_stop]
    k_t = np.empty((keys // PANEL + 3, (d + 1) // 2, PANEL), dtype=np.uint32)
    v_t = np.empty((keys // PANEL + 3, (dvd + 1) // 2, PANEL), dtype=np.uint32)
    k_n = np.empty((-(-d // BLOCK_COLUMNS) * 2, keys // 2 + 1, PANEL), dtype=np.uint32)
    pack_key_pairs(key_rows, k_t)
    pack_key_pairs(value_rows, v_t)
    pack_value_pairs(key_rows, k_n, keys)
    # dKᵀ and dVᵀ of the slice's keys, wide enough for a tile's padded width from any start
    dk_t = np.zeros((d, keys + BLOCK_COLUMNS), dtype=dtype)
    dv_t = np.zeros((dvd, keys + BLOCK_COLUMNS), dtype=dtype)
    d_pad = -(-d // BLOCK_COLUMNS) * BLOCK_COLUMNS
    scale = dtype.type(mods.scale)
    i_lo, i_hi = _query_range(mods, b, j_begin, j_stop, sq)
    for i0 in range(i_lo, i_hi, block_m):
        npos = min(block_m, i_hi - i0)
        m = group * npos
        tile = RowTile(b, hk, group, i0, npos)
        ref, row_delta = _row_references(lse, delta, mods, tile, dtype)
        q_pairs, go_pairs = row_tile_pairs(q, tile), row_tile_pairs(grad_out, tile)
        q_t, go_t = row_tile_column_pairs(q, tile), row_tile_column_pairs(grad_out, tile)
        row_panels = np.empty((block_n // PANEL + 2, (m + 1) // 2, PANEL), dtype=np.uint32)
        ds_pairs = np.empty((m, (block_n + 1) // 2), dtype=np.uint32)
        dq_acc = np.zeros((m, d_pad), dtype=dtype)
        j_lo, j_end = _tile_key_range(mods, tile, j_begin, j_stop, PANEL)
        for j0 in range(j_lo, j_end, block_n):
            n = min(block_n, j_end - j0)
            off = j0 - j_begin
            width = -(-n // BLOCK_COLUMNS) * BLOCK_COLUMNS
            panels = row_panels[: width // PANEL]
            s = np.empty((m, width), dtype=dtype)
            pair_product(s, q_pairs, k_t[off // PANEL :], False)
            for r in range(m):
                for c in range(n):
                    s[r, c] *= scale
            dz_ds = _modify_scores_for_backward(s, mods, tile, j0, n)
            dp = np.empty((m, width), dtype=dtype)
            pair_product(dp, go_pairs, v_t[off // PANEL :], False)
            _weights_and_score_gradient(s, dp, ref, row_delta, dz_ds, dbias, mods, tile, j0, n)
            p, ds = s, dp
            round_row_panels(p, n, panels)
            pair_product(dv_t[:, off : off + width], go_t, panels, True)
            round_row_panels(ds, n, panels)
            pair_product(dk_t[:, off : off + width], q_t, panels, True)
            half_n = (n + 1) // 2
            round_weight_pairs(ds, n, ds_pairs)
            pair_product(dq_acc, ds_pairs[:, :half_n], k_n[:, off // 2 :], True)
        _store_dq(grads.dq_part, split, tile, dq_acc, mods.scale)
    dk, dv = grads.dk[b, hk], grads.dv[b, hk]
    for j in range(keys):
        for c in range(d):
            dk[j_begin + j, c] = dk_t[c, j] * scale
        for c in range(dvd):
            dv[j_begin + j, c] = dv_t[c, j]


# One parallel kernel per item function, chosen by the launcher: a dispatch inside the parallel
# loop is typed twice, and a first backward call took 0.3 s longer with one.
# (np.int64 item: the parallel loop's index is unsigned where Numba outlines the loop body,
# signed where it types the kernel, and each would compile the item once more)
@njit(parallel=True, cache=True)
def _attention_backward_numba(q, k, v, grad_out, lse, delta, grads, mods, block_m, block_n):
    batch, hkv, n_splits = k.shape[0], k.shape[1], grads.dq_part.shape[0]
    for item in prange(batch * hkv * n_splits):
        _backward_item_widened(
            q, k, v, grad_out, lse, delta, grads, np.int64(item), mods, block_m, block_n
        )


@njit(parallel=True, cache=True)
def _attention_backward_pairs_numba(q, k, v, grad_out, lse, delta, grads, mods, block_m, block_n):
    batch, hkv, n_splits = k.shape[0], k.shape[1], grads.dq_part.shape[0]
    for item in prange(batch * hkv * n_splits):
        _backward_item_pairs(
            q, k, v, grad_out, lse, delta, grads, np.int64(item), mods, block_m, block_n
        )


def _widened(x):
    """float32 of an array or of half bits (uint16 bfloat16, int16 float16)."""
    if x.dtype == np.uint16:
        return (x.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if x.dtype == np.int16:
        return x.view(np.float16).astype(np.float32)
    return np.asarray(x, np.float32)


def attention_backward_numba(
    q,
    k,
    v,
    out,
    lse,
    grad_out,
    grad_lse=None,
    *,
    options,
    mask=None,
    key_lengths=None,
    relative_bias=None,
):
    """Gradients of ``attention_numba``'s call on NumPy arrays (float32, or bfloat16 / float16
    bits as uint16 / int16, computed in float32), given its out and lse and the gradients
    grad_out (and grad_lse, or None) of its results. Arguments as ``attention_numba``.
    Returns (dq, dk, dv) float32, dsinks float64 [Hq] or None, dtable float64
    [num_buckets, Hq] or None."""
    dtype = np.dtype(np.float32)
    batch, hq, sq, d = q.shape
    hkv, sk, dvd = k.shape[1], k.shape[2], v.shape[3]
    group = hq // hkv
    q, k, v = (np.ascontiguousarray(a) for a in (q, k, v))
    # bfloat16 pairs where the CPU has AVX512-BF16: grad_out stays bfloat16 bits for them
    pairs = _pair_products.takes_pairs(q, k, v, grad_out)
    widened_grad_out = _widened(grad_out)
    grad_out = np.ascontiguousarray(grad_out if pairs else widened_grad_out)
    lse = np.ascontiguousarray(lse, dtype=np.float32)
    # D_i = Σ dO∘O - dlse: what every dZ of row i subtracts (docs/math.md#attention-backward)
    delta = np.einsum("bhid,bhid->bhi", widened_grad_out, _widened(out))
    if grad_lse is not None:
        delta = delta - _widened(grad_lse)
    delta = np.ascontiguousarray(delta, dtype=np.float32)
    dsinks = None
    if options.sinks is not None:
        # the sink's weight exp(sink - lse) times its dZ = P_sink·(0 - D)
        sink_weight = np.exp(np.asarray(options.sinks, np.float64)[None, :, None] - lse)
        dsinks = -(sink_weight * delta).sum(axis=(0, 2))

    # scores in natural units, as the forward's lse that P = exp(S - lse) is taken against
    mods = dense_score_mods(
        dtype, 1.0, options, q, k, mask=mask, key_lengths=key_lengths, relative_bias=relative_bias
    )
    # T5's bias is held by key-minus-query distance first … first + count - 1
    first, count = -mods.bias_offset, mods.bias.shape[1]

    block_m = max(1, min(sq, max(128 // group, 16)))
    block_n = max(1, min(256, sk))
    threads = numba.get_num_threads()
    key_tiles = -(-sk // block_n)
    n_splits = key_splits(batch * hkv, key_tiles, threads)
    items = batch * hkv * n_splits
    dq_part = np.zeros((n_splits, batch, hq, sq, d), dtype=dtype)
    dk = np.zeros((batch, hkv, sk, d), dtype=dtype)
    dv = np.zeros((batch, hkv, sk, dvd), dtype=dtype)
    dbias_part = np.zeros(
        (items, group, count) if relative_bias is not None else (items, 1, 1), dtype=dtype
    )
    if batch * hq * sq > 0 and sk > 0:
        with single_threaded_blas():
            grads = BackwardGrads(dq_part, dk, dv, dbias_part)
            kernel = _attention_backward_pairs_numba if pairs else _attention_backward_numba
            kernel(q, k, v, grad_out, lse, delta, grads, mods, block_m, block_n)
    dq = dq_part[0] if n_splits == 1 else dq_part.sum(axis=0)
    dtable = None
    if relative_bias is not None:
        # per distance and head -> per bucket: the bucket of each distance is the table lookup
        # of a table holding its own bucket index
        _, num_buckets, max_distance, bidirectional = relative_bias
        dist = dbias_part.astype(np.float64).reshape(batch * hkv * n_splits, group, count)
        dist = dist.reshape(batch, hkv, n_splits, group, count).sum(axis=(0, 2))
        dist = dist.reshape(hq, count)
        index = np.arange(num_buckets, dtype=np.float64)[:, None]
        buckets = _relative_bias_by_distance_numba(
            index, first, count, bidirectional, num_buckets, max_distance
        )[0].astype(np.int64)
        dtable = np.zeros((num_buckets, hq), np.float64)
        for h in range(hq):
            dtable[:, h] = np.bincount(buckets, weights=dist[h], minlength=num_buckets)
    return dq, dk, dv, dsinks, dtable
