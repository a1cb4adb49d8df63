"""What turns Q·Kᵀ into attention weights, shared by every Numba attention kernel (dense,
paged/varlen, backward): the score modifiers (soft-cap, masks, ALiBi, T5 relative bias, window
and causal edges) grouped in one ``ScoreMods`` record (``EdgesOnlyScoreMods`` when only the
edges apply, so that such calls run kernels compiled without the other modifiers' code) and
applied by ``_modify_scores`` (the backward's ``_modify_scores_for_backward`` also gives their
derivative, which ``_score_gradient`` applies), the vectorisable exp2 and the online softmax.
One definition of what a score is, so that the forward and backward kernels agree; the tile
steps call these and name no modifier.

The launchers (``attention_numba``, ``attention_backward_numba``, ``attention_paged_numba``) take
the call's options as one record, ``options``, read by attribute (the backends pass fastpe's
``AttentionOptions.launched(...)``; any object with these attributes does):

- ``scale``: float, the factor of Q·Kᵀ;
- ``causal``: bool, no key after the query's position;
- ``bottom_right``: bool, query i of sequence b sits at key position i + L_b - Sq (L_b its key
  length, Sq its query count), else at i;
- ``window``: None or (left, right) key offsets from the query's position, -1 unbounded;
- ``softcap``: None or c > 0, scores become c·tanh(s / c) before the masks and biases;
- ``sinks``: None or float64 [Hq], one more logit per head with no value;
- ``alibi_slopes``: None or float64 [B, Hq], minus slope·|i - j| on every score.

Only ``score_mods`` reads it, and for ``sinks`` also the launchers' answers to empty calls and
the backward's gradient of the sinks.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
from fastpe.kernels.numba._runtime import njit, read_only
from numba import types
from numba.extending import overload

LOG2E = 1.4426950408889634

# 2**f for f in [0, 1): degree-6 Chebyshev fit (fitted for fastpe), max relative error 1e-7 when
# evaluated in float32 Horner form — about 1.6 ulp, below float32 attention's own rounding.
_P0, _P1, _P2, _P3 = (
    1.0000000061582057,
    0.6931468377006627,
    0.24023109676226764,
    0.05547891246003817,
)
_P4, _P5, _P6 = 0.009686186295582436, 0.001238241549274018, 0.00021871262471017766


def _is_f32(array):
    """True for a float32 array, as a compile-time constant of each specialisation (so that
    float64 branches fold away inside a float32 tile loop)."""


@overload(_is_f32, inline="always")
def _is_f32_impl(array):
    f32 = array.dtype == types.float32
    return lambda array: f32


# Flags: contraction and reassociation let LLVM fuse and vectorise the row reductions. Not
# nnan/ninf: -inf marks masked scores and must compare and propagate exactly.
_FLAGS = {"contract", "reassoc", "nsz", "arcp"}


# _exp2 and _tanh_ratio64 are plain functions, not inline="always": LLVM inlines them into the
# kernels' loops all the same (their code is linked into each kernel: _link_only_codegen) and
# vectorises those loops as before, while Numba's own inlining typed them again at every call
# site, a tenth of a second or more of each kernel's first compile
@njit(cache=True, fastmath=_FLAGS)
def _exp2(x):
    """2**x in float32, exact 0 at or below -127 (also for -inf, a masked score), clamped at
    2**127 above. Range reduction x = k + f (k = floor x via the vectorisable np.floor, f in
    [0, 1)), 2**f by polynomial, 2**k by writing k into the exponent bits: plain arithmetic
    that LLVM vectorises (Numba's math.exp is a scalar libm call without Intel SVML, which
    PyPI's llvmlite lacks). Relative error <= 1e-7. NaN gives NaN (a NaN score must reach its
    row's sum, as in SDPA), through a final select: the clamps map it to a finite value first
    so that the int conversion below stays defined."""
    y = x if x > -127.0 else np.float32(-127.0)
    y = y if y < 127.0 else np.float32(127.0)
    k = np.floor(y)
    f = y - k
    poly = np.float32(_P6)
    poly = poly * f + np.float32(_P5)
    poly = poly * f + np.float32(_P4)
    poly = poly * f + np.float32(_P3)
    poly = poly * f + np.float32(_P2)
    poly = poly * f + np.float32(_P1)
    poly = poly * f + np.float32(_P0)
    power = poly * np.int32((np.int32(k) + 127) << 23).view(np.float32)
    return power if x == x else x


# tanh(x)/x = P(x²)/Q(x²) on |x| <= 9 (beyond, tanh rounds to ±1 in float32): a degree 4/4
# rational in x² fitted for fastpe (Lawson-reweighted least squares on the relative error over
# [0, 9]); relative error 2.1e-8. Evaluated in float64 even for float32 scores: float32 Horner
# steps alone cost 3 ulp of tanh, and a soft-capped score's rounding error, scaled by the scores'
# size, was the largest term of float32 attention's error (2x torch's with softcap); in float64
# the capped score is rounded once, within 0.85 ulp, for about 6 µs more per 128 x 256 tile.
_TP = (
    0.9999999794671105,
    0.13381017025367345,
    0.003495577585278725,
    2.060889880275588e-05,
    1.3354396314089421e-08,
)
_TQ = (1.0, 0.4671433262729406, 0.025876942889573283, 0.00032856171000776, 7.776451609754166e-07)


@njit(cache=True, fastmath=_FLAGS, error_model="numpy")  # Q(t) >= 1: no zero-division branch
def _tanh_ratio64(t):
    """tanh(x)/x for t = x² <= 81 in float64: one rational, no exp and no branch."""
    p = _TP[4]
    p = p * t + _TP[3]
    p = p * t + _TP[2]
    p = p * t + _TP[1]
    p = p * t + _TP[0]
    q = _TQ[4]
    q = q * t + _TQ[3]
    q = q * t + _TQ[2]
    q = q * t + _TQ[1]
    q = q * t + _TQ[0]
    return p / q


# error_model="numpy": Python's error model guards every division against zero with a branch,
# which stops LLVM vectorising the loop (20x slower); here the divisor Q(x²) is >= 1.
@njit(cache=True, fastmath=_FLAGS, error_model="numpy")
def _softcap(s, cap, unit=1.0):
    """s = c·tanh(s / c) on a tile of scores in ``unit``s per natural unit, c = cap·unit.

    Computed as s·(tanh(x)/x) with x = s·(1/c), never as c·tanh(x): c and 1/c are each clamped
    to the compute dtype's largest finite value, so that any finite positive cap works (a huge
    cap's c overflowing to inf made inf·0 = NaN; a tiny one's 1/c likewise), and the product
    with c costs no rounding. Where c overflowed, |x| < 1 for every finite score, so c is only
    ever used finite: for |x| > 9 (float32, where tanh rounds to ±1) or > 1 (float64). A NaN
    score stays NaN; an overflowed (infinite) one becomes ±c.
    """
    is_f32 = _is_f32(s)
    big = 3.4028234663852886e38 if is_f32 else 1.7976931348623157e308  # finfo.max
    capped = min(cap * unit, big)
    inv = min(1.0 / cap / unit, big)
    if is_f32:
        for r in range(s.shape[0]):
            for c in range(s.shape[1]):
                v = np.float64(s[r, c])
                x = v * inv
                t = x * x
                t = t if t < 81.0 else 81.0  # NaN goes on to v·ratio = NaN
                saturated = abs(x) > 9.0
                s[r, c] = (capped if v > 0.0 else -capped) if saturated else v * _tanh_ratio64(t)
    else:
        for r in range(s.shape[0]):
            for c in range(s.shape[1]):
                v = s[r, c]
                x = v * inv
                if abs(x) > 1.0:
                    s[r, c] = capped * math.tanh(x)
                elif x != 0.0:  # tanh(x)/x is accurate down to the smallest subnormal x
                    s[r, c] = v * (math.tanh(x) / x)


@njit(cache=True, fastmath=_FLAGS)
def _exp_shifted(s, row_max, p, r, n, totals, to_log2):
    """p[r, c] = 2 ** ((s[r, c] - row_max[r])·to_log2) for row r; totals[r] =
    Σ_c p[r, c] (fused: one less pass over the tile), NaN when row_max[r] is +inf (a score
    overflowed float32: there is no float32 answer, and SDPA too returns NaN).

    to_log2 is 1 when the scores are in log2 units (the usual case, with its own loop: the
    multiply costs ~15% of this pass), log2 e when natural (the difference is taken first, so
    that scores near ±float32 max never overflow on the way).
    """
    mx = row_max[r]
    total = np.float32(0.0)
    if to_log2 == 1.0:
        for c in range(n):
            value = _exp2(s[r, c] - mx)
            p[r, c] = value
            total += value
    else:
        for c in range(n):
            value = _exp2((s[r, c] - mx) * to_log2)
            p[r, c] = value
            total += value
    totals[r] = total if mx < np.inf else np.nan


@njit(cache=True, fastmath=_FLAGS)
def _exp_shifted_f64(s, row_max, p, r, n, totals, to_nat):
    """float64 inputs keep float64 throughout: libm exp (scalar, accurate)."""
    mx = row_max[r]
    total = 0.0
    for c in range(n):
        value = math.exp((s[r, c] - mx) * to_nat)
        p[r, c] = value
        total += value
    totals[r] = total


@njit(cache=True)
def _nearest_key_distance(qpos, length):
    """Distance from a query at key position qpos to the nearest of keys 0 … length-1."""
    return max(0, qpos - (length - 1), -qpos)


class ScoreMods(NamedTuple):
    """The score modifiers of one call, one argument for every kernel helper (Numba passes a
    namedtuple by value, field by field: no indirection, and the helpers stay far below the
    argument count at which Numba's calls stop accepting conditional arguments).

    Scores are in ``unit``s per natural unit (log2 e: log2 scores; or 1); ``alibi`` [B, Hq] and
    ``bias`` [Hq, distances] come already multiplied by it; ``sinks`` stay natural. Query i of
    sequence b sits at key position p = i + query_shift[b] and may see keys p - win_left …
    p + win_right (causal: win_right = 0) below key_len[b]. The arrays of an absent modifier are
    1-element placeholders that are never read.
    """

    scale: np.floating  # in the compute dtype, as the queries are scaled
    query_shift: np.ndarray  # int64 [B]
    key_len: np.ndarray  # int64 [B]
    unit: float
    softcap: float  # 0: none
    win_left: int
    win_right: int
    has_mask: bool
    mask_is_bool: bool
    mask_bool: np.ndarray  # [1, B, Hq, Sq, Sk] bool, True = attend (see _mask_argument)
    mask: np.ndarray  # [1, B, Hq, Sq, Sk] float, added (in natural units)
    mask_limit: float  # the compute dtype's largest finite value: a finite mask saturates there
    has_alibi: bool
    alibi: np.ndarray
    has_bias: bool
    bias: np.ndarray  # bias[h, bias_offset + j - p]: T5's bias by distance j - p
    bias_offset: int
    has_sinks: bool
    sinks: np.ndarray  # float64 [Hq]: one more logit per head, with no value


class EdgesOnlyScoreMods(ScoreMods):
    """The ``ScoreMods`` of a call without soft-cap, mask, ALiBi, T5 bias or sinks: only key
    lengths and the causal and window edges apply. A Numba type of its own, so that such calls
    (the usual causal or full one, decode steps) run kernels compiled without the modifiers'
    code: a first float32 attention call compiles 0.8 s sooner (docs/first-calls.md). The first
    call with any modifier compiles the kernel once more, for ``ScoreMods``, whose one compile
    then serves every combination of them."""

    __slots__ = ()


def _edges_only(mods) -> bool:
    """Whether a ``ScoreMods`` Numba type is ``EdgesOnlyScoreMods`` (decided while typing)."""
    return mods.instance_class is EdgesOnlyScoreMods


class RowTile(NamedTuple):
    """A tile of query rows: the ``group`` query heads hk·group … of kv head ``hk`` at
    positions i0 … i0 + npos - 1 of sequence ``b``; row r is head hk·group + r // npos at
    position i0 + r % npos."""

    b: int
    hk: int
    group: int
    i0: int
    npos: int


@functools.cache
def _dummy(dtype, ndim):
    """The placeholder of an absent array argument: one per (dtype, ndim) per process, since
    the kernels read it only behind its ``has_*`` flag and never write it."""
    return read_only(np.zeros((1,) * ndim, dtype=dtype))


def _mask_argument(mask: np.ndarray) -> np.ndarray:
    """A mask [B, Hq, Sq, Sk] (or a placeholder) as the kernels read it: a read-only view with a
    leading axis of 2 at stride 0, which they index at 0 only. No such view is contiguous, so
    Numba types every mask alike — the caller's contiguous mask, a broadcast view, and the
    placeholder of a call without one — and one compiled kernel serves them all (by layout
    alone, each would be a compile of its own)."""
    view = np.lib.stride_tricks.as_strided(
        mask, shape=(2, *mask.shape), strides=(0, *mask.strides), writeable=False
    )
    return view


@functools.cache
def _mask_placeholder(dtype) -> np.ndarray:
    return _mask_argument(_dummy(dtype, 4))


@functools.cache
def _largest_float(dtype) -> float:
    return float(np.finfo(dtype).max)


def score_mods(
    dtype, unit, options, *, key_len, q_len, unbounded, mask=None, relative_bias=None, sq=0, sk=0
):
    """The ``ScoreMods`` of a launcher's ``options`` (module docstring) and dense attention's
    ``mask`` and ``relative_bias`` (as ``attention_numba`` takes them), in ``unit``s and the
    compute ``dtype``. ``key_len`` int64 [B]; ``q_len`` the query count of each sequence (an int
    or int64 [B]), which places the queries when ``options.bottom_right``; ``sq`` and ``sk`` are
    needed with ``relative_bias`` only (its distances span every query and key of the call),
    ``unbounded`` as in ``window_edges``."""
    query_shift = key_len - q_len if options.bottom_right else np.zeros(key_len.shape[0], np.int64)
    win_left, win_right = window_edges(options.window, options.causal, unbounded)
    alibi_slopes, sinks, softcap = options.alibi_slopes, options.sinks, options.softcap
    mask_is_bool = mask is not None and mask.dtype == np.bool_
    alibi = _dummy(dtype, 2)
    if alibi_slopes is not None:
        alibi = np.ascontiguousarray(alibi_slopes * unit, dtype=dtype)
    bias, bias_offset = _dummy(dtype, 2), 0
    if relative_bias is not None:
        table, num_buckets, max_distance, bidirectional = relative_bias
        # distances j - (i + query_shift) over the whole call; O((Sq + Sk)·H), never [Sq, Sk]
        first = -(int(query_shift.max(initial=0)) + sq - 1)
        count = sk - int(query_shift.min(initial=0)) - first
        bias = _relative_bias_by_distance_numba(
            np.ascontiguousarray(table * unit, dtype=dtype),
            first,
            count,
            bidirectional,
            num_buckets,
            max_distance,
        )
        bias_offset = -first
    has_modifier = (
        softcap is not None
        or mask is not None
        or alibi_slopes is not None
        or relative_bias is not None
        or sinks is not None
    )
    return (ScoreMods if has_modifier else EdgesOnlyScoreMods)(
        scale=dtype.type(options.scale),
        query_shift=read_only(query_shift),
        key_len=read_only(key_len),
        unit=unit,
        softcap=0.0 if softcap is None else float(softcap),
        win_left=win_left,
        win_right=win_right,
        has_mask=mask is not None,
        mask_is_bool=mask_is_bool,
        mask_bool=_mask_argument(mask) if mask_is_bool else _mask_placeholder(np.dtype(np.bool_)),
        mask=_mask_argument(mask)
        if mask is not None and not mask_is_bool
        else _mask_placeholder(np.dtype(dtype)),
        mask_limit=_largest_float(dtype),
        has_alibi=alibi_slopes is not None,
        alibi=read_only(alibi),
        has_bias=relative_bias is not None,
        bias=read_only(bias),
        bias_offset=bias_offset,
        has_sinks=sinks is not None,
        sinks=_dummy(np.float64, 1)
        if sinks is None
        else read_only(np.ascontiguousarray(sinks, np.float64)),
    )


@functools.lru_cache(maxsize=256)
def _plain_score_mods(dtype, unit, scale, softcap, window, causal, bottom_right, batch, sq, sk):
    """``score_mods`` of a dense call with none of the array modifiers (mask, key lengths,
    relative bias, ALiBi, sinks), made once per distinct arguments: its arrays are read-only,
    so calls share them."""
    options = _ScalarOptions(scale, softcap, window, causal, bottom_right, None, None)
    return score_mods(
        dtype, unit, options, key_len=_every_sequence(batch, sk), q_len=sq, unbounded=sq + sk + 1
    )


class _ScalarOptions(NamedTuple):
    """The fields of an options record that ``score_mods`` reads, for ``_plain_score_mods``."""

    scale: float
    softcap: float | None
    window: tuple | None
    causal: bool
    bottom_right: bool
    alibi_slopes: None
    sinks: None


@functools.lru_cache(maxsize=256)
def _every_sequence(batch: int, count: int) -> np.ndarray:
    """int64 [batch] of ``count`` each, read-only: made once per shape, not at every call (a
    decode step's launch costs about as much as its kernel)."""
    return read_only(np.full(batch, count, dtype=np.int64))


def dense_score_mods(dtype, unit, options, q, k, *, mask, key_lengths, relative_bias):
    """``score_mods`` of a dense launcher's call (``attention_numba``'s arguments, q [B, Hq, Sq,
    D] and k [B, Hkv, Sk, D]): sequence b has key_lengths[b] keys (None: Sk) and Sq queries."""
    batch, sq, sk = q.shape[0], q.shape[2], k.shape[2]
    if (
        mask is None
        and key_lengths is None
        and relative_bias is None
        and options.alibi_slopes is None
        and options.sinks is None
    ):
        # no array among the modifiers: the record depends on scalars only (a decode step's
        # call repeats them every layer and token)
        return _plain_score_mods(
            np.dtype(dtype), unit, options.scale, options.softcap, options.window,
            options.causal, options.bottom_right, batch, sq, sk,
        )  # fmt: skip
    key_len = (
        _every_sequence(batch, sk)
        if key_lengths is None
        else np.ascontiguousarray(key_lengths, dtype=np.int64)
    )
    return score_mods(
        dtype,
        unit,
        options,
        key_len=key_len,
        q_len=sq,
        unbounded=sq + sk + 1,
        mask=mask,
        relative_bias=relative_bias,
        sq=sq,
        sk=sk,
    )


@njit(cache=True, fastmath=_FLAGS)
def _apply_tile_masks(s, mods, tile, j0, n):
    """Add biases and set -inf where a row of a ``RowTile`` may not attend, on its scores
    against keys j0 … j0 + n - 1 (s [group·npos, n])."""
    b, hk, group, i0, npos = tile
    query_shift = mods.query_shift[b]
    m = group * npos
    if mods.has_alibi or mods.has_bias or mods.has_mask:
        for r in range(m):
            g = r // npos
            h = hk * group + g
            i = i0 + r - g * npos
            qpos = i + query_shift
            if mods.has_alibi:
                # distances less the row's nearest visible one: that common part would only
                # cost float32 precision here (it cancels in softmax; lse adds it back)
                slope = mods.alibi[b, h]
                near = _nearest_key_distance(qpos, mods.key_len[b])
                for c in range(n):
                    s[r, c] -= slope * (abs(qpos - (j0 + c)) - near)
            if mods.has_bias:
                base = mods.bias_offset - qpos + j0  # index of distance (j - qpos) in bias[h]
                for c in range(n):
                    s[r, c] += mods.bias[h, base + c]
            if mods.has_mask:
                # the mask's layout is known only at run time (_mask_argument): a row of
                # adjacent elements (the usual case, broadcast or not) is read as a contiguous
                # view, which LLVM vectorises; any other row is copied first
                if mods.mask_is_bool:
                    row = np.ascontiguousarray(mods.mask_bool[0, b, h, i, j0 : j0 + n])
                    for c in range(n):
                        if not row[c]:
                            s[r, c] = -np.inf
                else:
                    # a finite mask is a score however large: one beyond the compute dtype
                    # (float64 masks on float32) saturates at its largest finite value
                    row = np.ascontiguousarray(mods.mask[0, b, h, i, j0 : j0 + n])
                    for c in range(n):
                        x = row[c] * mods.unit
                        x = mods.mask_limit if x > mods.mask_limit else x
                        x = -mods.mask_limit if -mods.mask_limit > x > -np.inf else x
                        s[r, c] += x
    _mask_edges(s, mods, tile, j0, n)


@njit(cache=True, fastmath=_FLAGS)
def _mask_edges(s, mods, tile, j0, n):
    """Set -inf where a row of a ``RowTile`` lies beyond the window (and causal) edges, on its
    scores against keys j0 … j0 + n - 1. Only tiles crossing an edge need masking (the caller
    never visits tiles wholly outside; key lengths already bound the key range)."""
    b, hk, group, i0, npos = tile
    m = group * npos
    first_pos = i0 + mods.query_shift[b]
    if j0 < first_pos + npos - 1 - mods.win_left or j0 + n - 1 > first_pos + mods.win_right:
        for r in range(m):
            qpos = first_pos + r % npos
            first_seen = min(max(qpos - mods.win_left - j0, 0), n)
            for c in range(first_seen):
                s[r, c] = -np.inf
            for c in range(max(qpos + mods.win_right + 1 - j0, first_seen), n):
                s[r, c] = -np.inf


def _modify_scores(s, mods, tile, j0, n):
    """Q·Kᵀ (in ``mods.unit``s, scaled) -> the scores the softmax takes, for a ``RowTile``
    against keys j0 … j0 + n - 1 (s [group·npos, n], in place): soft-cap, then the biases and
    masks (of ``EdgesOnlyScoreMods``: the edges alone)."""


@overload(_modify_scores, inline="always")
def _modify_scores_impl(s, mods, tile, j0, n):
    if _edges_only(mods):
        return lambda s, mods, tile, j0, n: _mask_edges(s, mods, tile, j0, n)
    return lambda s, mods, tile, j0, n: _apply_modifiers(s, mods, tile, j0, n)


@njit(cache=True, fastmath=_FLAGS)
def _apply_modifiers(s, mods, tile, j0, n):
    if mods.softcap > 0.0:
        _softcap(s, mods.softcap, mods.unit)
    _apply_tile_masks(s, mods, tile, j0, n)


def _modify_scores_for_backward(s, mods, tile, j0, n):
    """``_modify_scores`` for the backward pass (natural units, float32 tiles, the soft-cap
    by libm tanh as the gradient formula's 1 - tanh² takes it), returning dz_ds = ∂Z/∂S
    elementwise, the factor ``_score_gradient`` applies: an empty array when every modifier
    in use only adds to or masks the scores (∂Z/∂S = 1 where a key is visible)."""


@overload(_modify_scores_for_backward, inline="always")
def _modify_scores_for_backward_impl(s, mods, tile, j0, n):
    if _edges_only(mods):

        def edges(s, mods, tile, j0, n):
            _mask_edges(s, mods, tile, j0, n)
            return np.empty((0, 0), dtype=s.dtype)

        return edges
    return lambda s, mods, tile, j0, n: _apply_modifiers_for_backward(s, mods, tile, j0, n)


# error_model="numpy", as the backward's tile step that calls it: no zero-division branch
# around 1/c (c > 0 here)
@njit(cache=True, fastmath=_FLAGS, error_model="numpy")
def _apply_modifiers_for_backward(s, mods, tile, j0, n):
    m = s.shape[0]
    cap = mods.softcap
    dz_ds = np.empty((m, n) if cap > 0.0 else (0, 0), dtype=s.dtype)
    if cap > 0.0:
        # clamped: the reciprocal of a subnormal cap is inf, and 0·inf (a zero score) NaN
        inv = min(1.0 / cap, 1.7976931348623157e308)
        for r in range(m):
            for c in range(n):
                t = np.tanh(s[r, c] * inv)
                s[r, c] = cap * t
                dz_ds[r, c] = 1.0 - t * t
    _apply_tile_masks(s, mods, tile, j0, n)
    return dz_ds


@njit(cache=True, fastmath=_FLAGS)
def _score_gradient(dz, dz_ds):
    """dZ (the gradient of the modified scores, in place) -> dS = dZ∘dz_ds, the gradient of
    Q·Kᵀ; dz_ds from ``_modify_scores_for_backward`` (empty: dS = dZ), on its n columns
    (dz may be padded wider)."""
    if dz_ds.size > 0:
        for r in range(dz.shape[0]):
            for c in range(dz_ds.shape[1]):
                dz[r, c] *= dz_ds[r, c]


@njit(cache=True, fastmath={"nnan", "reassoc", "nsz"})
def _row_max(s, r, n):
    """max of s[r, :n], -inf for an empty or fully masked row.

    LLVM does not vectorise a float max *reduction* from Numba's IR (it emits a serial chain of
    scalar maxss), nor running maxima kept in a scratch array (a store per element); eight
    independent running maxima in locals, as selects, it does (3.5x faster than 16 in an array,
    as fast as the exp pass). Padding is never read and masks are validated, so a NaN score comes
    only from NaN in q or k; whether it wins this max (``nnan``) does not matter, since the exp
    pass turns it into a NaN row sum either way. -inf compares exactly.
    """
    full = n - n % 8
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = s.dtype.type(-np.inf)
    for c0 in range(0, full, 8):
        v = s[r, c0]
        m0 = v if v > m0 else m0
        v = s[r, c0 + 1]
        m1 = v if v > m1 else m1
        v = s[r, c0 + 2]
        m2 = v if v > m2 else m2
        v = s[r, c0 + 3]
        m3 = v if v > m3 else m3
        v = s[r, c0 + 4]
        m4 = v if v > m4 else m4
        v = s[r, c0 + 5]
        m5 = v if v > m5 else m5
        v = s[r, c0 + 6]
        m6 = v if v > m6 else m6
        v = s[r, c0 + 7]
        m7 = v if v > m7 else m7
    m0 = m1 if m1 > m0 else m0
    m2 = m3 if m3 > m2 else m2
    m4 = m5 if m5 > m4 else m4
    m6 = m7 if m7 > m6 else m6
    m0 = m2 if m2 > m0 else m0
    m4 = m6 if m6 > m4 else m4
    mx = m4 if m4 > m0 else m0
    for c in range(full, n):
        v = s[r, c]
        mx = v if v > mx else mx
    return mx


def _exp_row(s, ref, p, r, n, totals, unit):
    """p[r, :n] = exp(s[r, :n] - ref[r]) and totals[r] = their sum, scores in ``unit``s: by exp2
    in float32 (``_exp_shifted``), by libm exp in float64; decided while typing, so that a
    kernel holds only its dtype's."""


@overload(_exp_row, inline="always")
def _exp_row_impl(s, ref, p, r, n, totals, unit):
    if s.dtype == types.float32:

        def by_exp2(s, ref, p, r, n, totals, unit):
            _exp_shifted(s, ref, p, r, n, totals, np.float32(LOG2E * (1.0 / unit)))

        return by_exp2

    def by_exp(s, ref, p, r, n, totals, unit):
        _exp_shifted_f64(s, ref, p, r, n, totals, 1.0 / unit)

    return by_exp


@njit(cache=True, fastmath=_FLAGS)
def _softmax_update(s, p, acc, row_max, row_sum, work, n, unit):
    """The online-softmax step on one row tile's masked scores s [m, n]: p = the weights
    against each row's running reference, row sums updated, acc rescaled to the new reference
    (the caller then adds P·V). work [4, m] is scratch.

    The reference is lazy: each row's scores are exponentiated against its running reference
    row_max, which is the exact max of the row's first tile with a visible key (so that tile's
    largest weight is exactly 1: a rounded dominant weight roughly doubled the worst-case
    float32 error) but afterwards need not be the exact max — the max reduction costs more
    than the exp pass — only never far below it: whenever a score outruns it so far that the
    tile's sum exceeds the tile's width n (a bound the exact max would keep; read for free from
    the sums the exp pass computes), the row is redone against its exact max. So the running
    sum stays below Sk as with an exact max, and P·V cannot overflow where the exact
    computation does not (|v| within float32 max / Sk).
    """
    m = s.shape[0]
    alpha, totals, ref = work[0], work[1], work[3]
    to_nat = 1.0 / unit
    for r in range(m):
        alpha[r] = 1.0
        if row_max[r] == -np.inf:
            row_max[r] = _row_max(s, r, n)
        ref[r] = 0.0 if row_max[r] == -np.inf else row_max[r]
        # one row at a time, here and below: a call with a constant row (0) would compile a
        # second copy of the function, specialised to the constant
        _exp_row(s, ref, p, r, n, totals, unit)
    for r in range(m):
        if totals[r] > n:  # the reference fell behind: redo this row exactly
            mx = max(row_max[r], _row_max(s, r, n))
            alpha[r] = math.exp((row_max[r] - mx) * to_nat)
            row_max[r] = mx
            ref[r] = mx
            _exp_row(s, ref, p, r, n, totals, unit)
        row_sum[r] = row_sum[r] * alpha[r] + totals[r]
        a = alpha[r]
        if a != 1.0:
            for c in range(acc.shape[1]):
                acc[r, c] *= a


def window_edges(window, causal: bool, unbounded: int) -> tuple[int, int]:
    """(left, right) window edges as offsets from each query's position; -1 (unbounded on that
    side) becomes ``unbounded``, any offset that reaches past every key from every query (e.g.
    Sq + Sk + 1); the causal rule is a right edge of 0."""
    left, right = (-1, -1) if window is None else window
    left = unbounded if left < 0 else left
    right = unbounded if right < 0 else right
    return left, 0 if causal else right


@njit(cache=True)
def _relative_bias_by_distance_numba(table, first, count, bidirectional, num_buckets, max_distance):
    """bias[h, t] = table[bucket(first + t), h] for key-minus-query distances first … first+count-1.

    T5's bucketing: half the buckets (per direction when bidirectional) are exact distances, the
    rest logarithmic up to max_distance; the log is taken in float32 as T5 does, so the bucket
    edges land where the trained tables expect them.
    """
    heads = table.shape[1]
    out = np.empty((heads, count), dtype=table.dtype)
    buckets = num_buckets // 2 if bidirectional else num_buckets
    max_exact = buckets // 2
    log_span = np.float32(math.log(max_distance / max_exact))
    for t in range(count):
        rel = first + t
        bucket = 0
        if bidirectional:
            if rel > 0:
                bucket = buckets
            rel = abs(rel)
        else:
            rel = -min(rel, 0)
        if rel < max_exact:
            bucket += rel
        else:
            ratio = np.float32(np.float32(rel) / np.float32(max_exact))
            large = max_exact + int(
                np.float32(np.log(ratio) / log_span * np.float32(buckets - max_exact))
            )
            bucket += min(large, buckets - 1)
        for h in range(heads):
            out[h, t] = table[bucket, h]
    return out
