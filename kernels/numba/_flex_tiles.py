"""How flex_attention's forward kernel (kernels/numba/flex_attention.py) multiplies a key tile:
read as it is reached (the block mask decides which tiles are), either widened to the compute
dtype and multiplied by BLAS (or the few-row loops of decoding), or, for bfloat16 inputs on a
CPU with AVX512-BF16, packed tile by tile as bfloat16 pairs and multiplied by ``pair_product``
(``_pair_products``: Q·Kᵀ on the query's bfloat16 bits, the score scale on the float32 scores,
P rounded to bfloat16 for P·V, as the dense kernel does).

The kernel's ``pairs`` argument chooses at compile time: None for the widened path, an empty
uint32 array for the pairs. Each helper is an overload whose pair version calls an njit function
in one line (an overload's own body inside a parallel loop is typed twice).
"""

from __future__ import annotations

import numpy as np
from fastpe.kernels.numba._attention_common import _FLAGS
from fastpe.kernels.numba._attention_tiles import (
    SMALL_ROWS,
    _add_weighted_values_small,
    _is_half,
    _load_tile,
    _query_tile,
    _scores_small,
)
from fastpe.kernels.numba._blas import gemm
from fastpe.kernels.numba._pair_products import (
    BLOCK_COLUMNS,
    PANEL,
    pack_key_pairs,
    pack_value_pairs,
    pair_product,
    round_weight_pairs,
    row_tile_pairs,
)
from fastpe.kernels.numba._runtime import njit
from numba import types
from numba.extending import overload


def _uses_pairs(pairs) -> bool:
    return isinstance(pairs, types.Array)


def tile_padding(pairs):
    """The columns the row tile's S, P and accumulator are padded to (``_row_buffers``)."""


@overload(tile_padding)
def _tile_padding_impl(pairs):
    pad = BLOCK_COLUMNS if _uses_pairs(pairs) else 1
    return lambda pairs: pad


def tile_queries(q, tile, mods, like, pairs):
    """The row tile's queries: widened and scaled (``_query_tile``), or bfloat16 pairs."""


@overload(tile_queries)
def _tile_queries_impl(q, tile, mods, like, pairs):
    if _uses_pairs(pairs):
        return lambda q, tile, mods, like, pairs: row_tile_pairs(q, tile)
    return lambda q, tile, mods, like, pairs: _query_tile(q, tile, mods, like)


def tile_scratch(k, v, like, m, widest, pairs):
    """Scratch for key tiles of up to ``widest`` keys and a row tile of m rows: (k, v, P) —
    widened half-precision tiles (empty for float inputs; no P), or the tiles' pair panels and
    P's pairs."""


@overload(tile_scratch)
def _tile_scratch_impl(k, v, like, m, widest, pairs):
    if _uses_pairs(pairs):
        return lambda k, v, like, m, widest, pairs: _pair_scratch(k, v, m, widest)

    def widened(k, v, like, m, widest, pairs):
        d, dv = k.shape[3], v.shape[3]
        k_tile = np.empty((widest if _is_half(k) else 0, d), dtype=like.dtype)
        v_tile = np.empty((widest if _is_half(v) else 0, dv), dtype=like.dtype)
        return k_tile, v_tile, np.empty((0, 0), dtype=np.uint32)

    return widened


@njit(cache=True)
def _pair_scratch(k, v, m, widest):
    d, dv = k.shape[3], v.shape[3]
    width = -(-widest // BLOCK_COLUMNS) * BLOCK_COLUMNS  # the widest tile's padded columns
    k_panels = np.empty((width // PANEL, (d + 1) // 2, PANEL), dtype=np.uint32)
    v_panels = np.empty((-(-dv // BLOCK_COLUMNS) * 2, widest // 2 + 1, PANEL), dtype=np.uint32)
    return k_panels, v_panels, np.empty((m, widest // 2 + 1), dtype=np.uint32)


def tile_scores(s, qt, k_rows, k_tile, mods, pairs):
    """s[:, :n] = the scaled Q·Kᵀ of the n keys ``k_rows`` (their raw [n, D] rows)."""


@overload(tile_scores)
def _tile_scores_impl(s, qt, k_rows, k_tile, mods, pairs):
    if _uses_pairs(pairs):
        return lambda s, qt, k_rows, k_tile, mods, pairs: _pair_scores(
            s, qt, k_rows, k_tile, mods.scale * mods.unit
        )

    def widened(s, qt, k_rows, k_tile, mods, pairs):
        kt = _load_tile(k_rows, k_tile)
        if qt.shape[0] <= SMALL_ROWS:
            _scores_small(qt, kt[:, None], 0, s, 0)
        else:
            gemm(s, qt, kt, False, True, 0.0)

    return widened


@njit(cache=True, fastmath=_FLAGS)
def _pair_scores(s, qt, k_rows, k_panels, scale_units):
    """Scores from the query pairs qt and the keys packed into k_panels (zeros past the tile:
    s's padded columns hold zeros)."""
    pack_key_pairs(k_rows, k_panels)
    pair_product(s, qt, k_panels, False)
    factor = s.dtype.type(scale_units)
    for r in range(s.shape[0]):
        for c in range(k_rows.shape[0]):
            s[r, c] *= factor


def tile_weighted_values(acc, p, v_rows, v_tile, p_pairs, pairs):
    """acc += P[:, :n]·V for the n values ``v_rows`` (their raw [n, Dv] rows)."""


@overload(tile_weighted_values)
def _tile_weighted_values_impl(acc, p, v_rows, v_tile, p_pairs, pairs):
    if _uses_pairs(pairs):
        return lambda acc, p, v_rows, v_tile, p_pairs, pairs: _pair_weighted_values(
            acc, p, v_rows, v_tile, p_pairs
        )

    def widened(acc, p, v_rows, v_tile, p_pairs, pairs):
        vt = _load_tile(v_rows, v_tile)
        if acc.shape[0] <= SMALL_ROWS:
            _add_weighted_values_small(p, 0, vt[:, None], 0, acc)
        else:
            gemm(acc, p, vt, False, False, 1.0)

    return widened


@njit(cache=True, fastmath=_FLAGS)
def _pair_weighted_values(acc, p, v_rows, v_panels, p_pairs):
    """P rounded to bfloat16 pairs times the values packed into v_panels (from the tile's
    key count on: zeros)."""
    n = v_rows.shape[0]
    half = (n + 1) // 2
    pack_value_pairs(v_rows, v_panels, n)
    round_weight_pairs(p, n, p_pairs)
    pair_product(acc, p_pairs[:, :half], v_panels[:, :half], True)
