"""Flash-style scaled dot-product attention on the CPU (Numba).

Logical shapes: q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv]
             -> out [B, Hq, Sq, Dv], lse [B, Hq, Sq] (natural log, float32).

One work item = (batch, kv head, block of query positions, slice of keys). The item packs the
``group = Hq / Hkv`` query heads that share its kv head into one tile of rows, so K and V are
read once per kv head (GQA without copying), and walks its keys in tiles: S = Q·Kᵀ through BLAS
(``np.dot`` into a preallocated tile), masks/biases on S, an online softmax with a
vectorisable exp2, then O += P·V through BLAS. Scores are in log2 units (log2 e folded into the
query scale), or in natural units when a float mask holds values too large to be multiplied by
log2 e (transformers' finfo.min masks): every finite mask value stays a finite score. The causal
rule is the window's right edge at 0: key tiles outside a block's window (above the causal
diagonal, or before a sliding window) are never visited; only tiles crossing an edge are masked.
When B·Hkv·(query blocks) leaves cores idle (decoding), keys are split across items and the
partial results are merged with the log-sum-exp rule of ``merge_attention``; an attention sink
joins the first split's result only, so that it counts once.
"""

from __future__ import annotations

import contextlib
import math

import numba
import numpy as np
from fastpe.kernels.numba._half import _widen
from fastpe.kernels.numba._runtime import njit, single_threaded_blas
from numba import prange, types
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


# Half-precision q/k/v travel as their bits (bfloat16 as uint16, float16 as int16: Numba has
# neither type) and are widened to float32 as they are read, one query block and one key tile at
# a time, into the scratch tiles BLAS multiplies: the full tensors are never converted.
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


# Flags: contraction and reassociation let LLVM fuse and vectorise the row reductions. Not
# nnan/ninf: -inf marks masked scores and must compare and propagate exactly.
_FLAGS = {"contract", "reassoc", "nsz", "arcp"}


@njit(cache=True, fastmath=_FLAGS, inline="always")
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


@njit(cache=True, fastmath=_FLAGS, inline="always")
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
def _softcap(s, cap, is_f32, unit=1.0):
    """s = c·tanh(s / c) on a tile of scores in ``unit``s per natural unit, c = cap·unit.

    Computed as s·(tanh(x)/x) with x = s·(1/c), never as c·tanh(x): c and 1/c are each clamped
    to the compute dtype's largest finite value, so that any finite positive cap works (a huge
    cap's c overflowing to inf made inf·0 = NaN; a tiny one's 1/c likewise), and the product
    with c costs no rounding. Where c overflowed, |x| < 1 for every finite score, so c is only
    ever used finite: for |x| > 9 (float32, where tanh rounds to ±1) or > 1 (float64). A NaN
    score stays NaN; an overflowed (infinite) one becomes ±c.
    """
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
def _exp_shifted(s, row_max, p, r0, r1, n, totals, to_log2):
    """p[r, c] = 2 ** ((s[r, c] - row_max[r])·to_log2) for rows r0 … r1-1; totals[r] =
    Σ_c p[r, c] (fused: one less pass over the tile), NaN when row_max[r] is +inf (a score
    overflowed float32: there is no float32 answer, and SDPA too returns NaN).

    to_log2 is 1 when the scores are in log2 units (the usual case, with its own loop: the
    multiply costs ~15% of this pass), log2 e when natural (the difference is taken first, so
    that scores near ±float32 max never overflow on the way).
    """
    for r in range(r0, r1):
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
def _exp_shifted_f64(s, row_max, p, r0, r1, n, totals, to_nat):
    """float64 inputs keep float64 throughout: libm exp (scalar, accurate)."""
    for r in range(r0, r1):
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


@njit(cache=True, fastmath=_FLAGS)
def _apply_tile_masks(
    s,
    b,
    hk,
    group,
    i0,
    npos,
    j0,
    n,
    query_shift,
    win_left,
    win_right,
    has_mask,
    mask_bool,
    mask,
    mask_is_bool,
    mask_limit,
    unit,
    has_alibi,
    alibi,
    length,
    has_bias,
    bias,
    bias_offset,
):
    """Add biases and set -inf where a row may not attend, on one (group·npos, n) tile.

    Row r is query head hk·group + r // npos at position i0 + r % npos; column c is key j0 + c.
    Query i sits at key position p = i + query_shift and may see keys p - win_left … p +
    win_right (causal: win_right = 0). Scores are in units of ``unit`` per natural unit (log2 e
    or 1); the alibi and bias arrays come already multiplied by it.
    """
    m = group * npos
    if has_alibi or has_bias or has_mask:
        for r in range(m):
            g = r // npos
            h = hk * group + g
            i = i0 + r - g * npos
            qpos = i + query_shift
            if has_alibi:
                # distances less the row's nearest visible one: that common part would only
                # cost float32 precision here (it cancels in softmax; lse adds it back)
                slope = alibi[b, h]
                near = _nearest_key_distance(qpos, length)
                for c in range(n):
                    s[r, c] -= slope * (abs(qpos - (j0 + c)) - near)
            if has_bias:
                base = bias_offset - qpos + j0  # index of distance (j - qpos) in bias[h]
                for c in range(n):
                    s[r, c] += bias[h, base + c]
            if has_mask:
                if mask_is_bool:
                    for c in range(n):
                        if not mask_bool[b, h, i, j0 + c]:
                            s[r, c] = -np.inf
                else:
                    # a finite mask is a score however large: one beyond the compute dtype
                    # (float64 masks on float32) saturates at its largest finite value
                    for c in range(n):
                        x = mask[b, h, i, j0 + c] * unit
                        x = mask_limit if x > mask_limit else x
                        x = -mask_limit if -mask_limit > x > -np.inf else x
                        s[r, c] += x
    # Window (and causal rule): only tiles crossing an edge need masking (the caller never
    # visits tiles wholly outside; key lengths already bound the key range).
    first_pos = i0 + query_shift
    if j0 < first_pos + npos - 1 - win_left or j0 + n - 1 > first_pos + win_right:
        for r in range(m):
            qpos = first_pos + r % npos
            first_seen = min(max(qpos - win_left - j0, 0), n)
            for c in range(first_seen):
                s[r, c] = -np.inf
            for c in range(max(qpos + win_right + 1 - j0, first_seen), n):
                s[r, c] = -np.inf


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


# Row tiles up to this many rows (decoding: the query heads of one kv head at one position)
# multiply by plain loops instead of BLAS: OpenBLAS packs the whole K / V tile on every call,
# which for a few rows costs several times the multiply itself (measured 12 µs against 2-2.5 µs
# per 4 x 256 x 128 product); from about 32 rows BLAS is faster.
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
def _softmax_update(s, p, acc, row_max, row_sum, work, n, unit, is_f32):
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
    to_log2 = s.dtype.type(LOG2E * to_nat)
    for r in range(m):
        alpha[r] = 1.0
        if row_max[r] == -np.inf:
            row_max[r] = _row_max(s, r, n)
        ref[r] = 0.0 if row_max[r] == -np.inf else row_max[r]
    if is_f32:
        _exp_shifted(s, ref, p, 0, m, n, totals, to_log2)
    else:
        _exp_shifted_f64(s, ref, p, 0, m, n, totals, to_nat)
    for r in range(m):
        if totals[r] > n:  # the reference fell behind: redo this row exactly
            mx = max(row_max[r], _row_max(s, r, n))
            alpha[r] = math.exp((row_max[r] - mx) * to_nat)
            row_max[r] = mx
            ref[r] = mx
            if is_f32:
                _exp_shifted(s, ref, p, r, r + 1, n, totals, to_log2)
            else:
                _exp_shifted_f64(s, ref, p, r, r + 1, n, totals, to_nat)
        row_sum[r] = row_sum[r] * alpha[r] + totals[r]
        a = alpha[r]
        if a != 1.0:
            for c in range(acc.shape[1]):
                acc[r, c] *= a


@njit(cache=True, fastmath=_FLAGS)
def _attend_tile(
    qt,
    kt,
    vt,
    s,
    p,
    pv,
    acc,
    row_max,
    row_sum,
    work,
    b,
    hk,
    group,
    i0,
    npos,
    j0,
    query_shift,
    win_left,
    win_right,
    softcap,
    has_mask,
    mask_bool,
    mask,
    mask_is_bool,
    unit,
    has_alibi,
    alibi,
    length,
    has_bias,
    bias,
    bias_offset,
    is_f32,
):
    """One key tile for one row tile: S = Q·Kᵀ, soft-cap, masks, online-softmax update,
    O += P·V."""
    m, n = s.shape
    if m <= SMALL_ROWS:
        _scores_small(qt, kt[:, None], 0, s, 0)
    else:
        np.dot(qt, kt.T, s)
    if softcap > 0.0:
        _softcap(s, softcap, is_f32, unit)
    mask_limit = 3.4028234663852886e38 if is_f32 else 1.7976931348623157e308  # finfo.max
    _apply_tile_masks(
        s,
        b,
        hk,
        group,
        i0,
        npos,
        j0,
        n,
        query_shift,
        win_left,
        win_right,
        has_mask,
        mask_bool,
        mask,
        mask_is_bool,
        mask_limit,
        unit,
        has_alibi,
        alibi,
        length,
        has_bias,
        bias,
        bias_offset,
    )
    _softmax_update(s, p, acc, row_max, row_sum, work, n, unit, is_f32)
    if m <= SMALL_ROWS:
        _add_weighted_values_small(p, 0, vt[:, None], 0, acc)
    else:
        np.dot(p, vt, pv)
        for r in range(m):
            for c in range(acc.shape[1]):
                acc[r, c] += pv[r, c]


@njit(cache=True)
def _split_key_range(first_pos, npos, length, win_left, win_right, block_n, split, n_splits):
    """[j_begin, j_stop): split ``split`` of ``n_splits`` of the keys that ``npos`` queries
    from position ``first_pos`` on can see (below ``length`` and within their windows), cut in
    whole key tiles of ``block_n``."""
    j_lo = max(first_pos - win_left, 0)
    j_end = max(min(length, first_pos + npos + win_right), j_lo)
    tiles = (j_end - j_lo + block_n - 1) // block_n
    per_split = (tiles + n_splits - 1) // n_splits
    j_begin = min(j_lo + split * per_split * block_n, j_end)
    return j_begin, min(j_lo + (split + 1) * per_split * block_n, j_end)


@njit(parallel=True, cache=True, fastmath=_FLAGS)
def _attention_numba(
    q,
    k,
    v,
    part_out,
    part_lse,
    scale,
    win_left,
    win_right,
    softcap,
    query_shift,
    key_len,
    has_mask,
    mask_bool,
    mask,
    mask_is_bool,
    unit,
    has_alibi,
    alibi,
    has_bias,
    bias,
    bias_offset,
    has_sinks,
    sinks,
    block_m,
    block_n,
    n_splits,
    is_f32,
):
    batch, hq, sq, d = q.shape
    hkv, dv = k.shape[1], v.shape[3]
    group = hq // hkv
    n_mblocks = (sq + block_m - 1) // block_m
    for item in prange(batch * hkv * n_mblocks * n_splits):
        split = item % n_splits
        rest = item // n_splits
        mb = rest % n_mblocks
        rest //= n_mblocks
        hk = rest % hkv
        b = rest // hkv
        i0 = mb * block_m
        npos = min(block_m, sq - i0)
        m = group * npos
        j_begin, j_stop = _split_key_range(
            i0 + query_shift[b], npos, key_len[b], win_left, win_right, block_n, split, n_splits
        )

        qt = np.empty((m, d), dtype=part_out.dtype)
        scale_units = part_out.dtype.type(scale * unit)
        for g in range(group):
            for r in range(npos):
                for c in range(d):
                    qt[g * npos + r, c] = _widen(q[b, hk * group + g, i0 + r, c]) * scale_units
        acc = np.zeros((m, dv), dtype=part_out.dtype)
        row_max = np.full(m, -np.inf, dtype=part_out.dtype)
        row_sum = np.zeros(m, dtype=part_out.dtype)
        # per-row alpha, sum and shift of the current tile
        work = np.empty((4, m), dtype=part_out.dtype)
        pv = np.empty((m, dv), dtype=part_out.dtype)
        # full-width tile buffers, and separate ones for the last partial tile (Numba's parallel
        # array analysis forbids re-binding a name to a differently shaped array)
        s_full = np.empty((m, block_n), dtype=part_out.dtype)
        p_full = np.empty((m, block_n), dtype=part_out.dtype)
        tail = (j_stop - j_begin) % block_n
        s_tail = np.empty((m, tail), dtype=part_out.dtype)
        p_tail = np.empty((m, tail), dtype=part_out.dtype)
        # widened k/v tiles for half inputs (empty, and unused, for float ones)
        k_tile = np.empty((block_n if _is_half(k) else 0, d), dtype=part_out.dtype)
        v_tile = np.empty((block_n if _is_half(v) else 0, dv), dtype=part_out.dtype)
        for j0 in range(j_begin, j_stop, block_n):
            # two calls, not conditional arguments: a call of more than 30 arguments compiles
            # to a list of them, where Numba accepts no control flow
            if j_stop - j0 >= block_n:
                _attend_tile(
                    qt,
                    _load_tile(k[b, hk, j0 : j0 + block_n], k_tile),
                    _load_tile(v[b, hk, j0 : j0 + block_n], v_tile),
                    s_full,
                    p_full,
                    pv,
                    acc,
                    row_max,
                    row_sum,
                    work,
                    b,
                    hk,
                    group,
                    i0,
                    npos,
                    j0,
                    query_shift[b],
                    win_left,
                    win_right,
                    softcap,
                    has_mask,
                    mask_bool,
                    mask,
                    mask_is_bool,
                    unit,
                    has_alibi,
                    alibi,
                    key_len[b],
                    has_bias,
                    bias,
                    bias_offset,
                    is_f32,
                )
            else:
                _attend_tile(
                    qt,
                    _load_tile(k[b, hk, j0 : j0 + tail], k_tile),
                    _load_tile(v[b, hk, j0 : j0 + tail], v_tile),
                    s_tail,
                    p_tail,
                    pv,
                    acc,
                    row_max,
                    row_sum,
                    work,
                    b,
                    hk,
                    group,
                    i0,
                    npos,
                    j0,
                    query_shift[b],
                    win_left,
                    win_right,
                    softcap,
                    has_mask,
                    mask_bool,
                    mask,
                    mask_is_bool,
                    unit,
                    has_alibi,
                    alibi,
                    key_len[b],
                    has_bias,
                    bias,
                    bias_offset,
                    is_f32,
                )
        for g in range(group):
            h = hk * group + g
            for r in range(npos):
                row = g * npos + r
                total = row_sum[row]
                # the sink joins the first split only: merged, it counts once
                sink = sinks[h] if has_sinks and split == 0 else -np.inf
                if total != 0.0:  # NaN too (an overflowed score): it must show, as in SDPA
                    lse_row = row_max[row] / unit + math.log(total)
                    if has_alibi:  # the common ALiBi part left out of the scores
                        near = _nearest_key_distance(i0 + r + query_shift[b], key_len[b])
                        lse_row -= alibi[b, h] / unit * near
                    inv = 1.0 / total
                    if sink > -np.inf:  # out · exp(lse_keys - lse) with lse = logaddexp(·, sink)
                        top = max(lse_row, sink)
                        lse_with = top + math.log(math.exp(lse_row - top) + math.exp(sink - top))
                        inv *= math.exp(lse_row - lse_with)
                        lse_row = lse_with
                    for c in range(dv):
                        part_out[split, b, h, i0 + r, c] = acc[row, c] * inv
                    part_lse[split, b, h, i0 + r] = lse_row
                else:  # no key to attend: zeros, lse = -inf (or the sink)
                    for c in range(dv):
                        part_out[split, b, h, i0 + r, c] = 0.0
                    part_lse[split, b, h, i0 + r] = sink


@njit(parallel=True, cache=True)
def _merge_splits_numba(part_out, part_lse, out, lse):
    """out = Σ_s part_out[s]·exp(part_lse[s] - lse), lse = log Σ_s exp(part_lse[s])."""
    n_splits, batch, hq, sq, dv = part_out.shape
    for row in prange(batch * hq * sq):
        i = row % sq
        h = (row // sq) % hq
        b = row // (sq * hq)
        top = -np.inf
        for sp in range(n_splits):
            top = max(top, part_lse[sp, b, h, i])
        if top == -np.inf:
            lse[b, h, i] = -np.inf
            for c in range(dv):
                out[b, h, i, c] = 0.0
            continue
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


# Calls with at most this many multiply-adds (B·Hq·Sq·Sk·(D + Dv): a decode step) run on the
# calling thread, unsplit: a parallel region must wait for a worker, which can take far longer
# than the call when torch's thread pool or another process holds the cores.
SERIAL_WORK = 1 << 23


def _block_sizes(sq: int, sk: int, group: int) -> tuple[int, int]:
    """Query positions per tile (times `group` heads -> rows) and keys per tile.

    128 rows x 256 keys (measured best on AVX-512 with OpenBLAS among 32-128 rows x 128-512
    keys, D 64 and 128) keeps the Q, S/P and accumulator tiles in L2 while each BLAS call does
    enough work to run near peak.
    """
    block_m = max(1, min(sq, max(128 // group, 16)))
    block_n = 256
    return block_m, min(block_n, max(sk, 1))


# BLAS limited to one thread while the kernel runs: Numba's threads already fill the cores, and
# a threaded BLAS inside them oversubscribes. Process-wide, so shared with its lock (_runtime).
_single_threaded_blas = single_threaded_blas


def _largest_finite_magnitude(mask):
    """max |finite value| of a mask, read from its stored elements only (a broadcast view's
    stride-0 axes are collapsed, so this never walks [B, Hq, Sq, Sk] for a smaller mask)."""
    stored = mask[tuple(slice(0, 1) if st == 0 else slice(None) for st in mask.strides)]
    return max(
        float(np.max(stored, where=stored > -np.inf, initial=0.0)),
        -float(np.min(stored, where=stored > -np.inf, initial=0.0)),
    )


def _dummy(dtype, ndim):
    return np.zeros((1,) * ndim, dtype=dtype)


def key_splits(items: int, key_tiles: int, threads: int) -> int:
    """Parts to split each work item's keys into: when the items alone cannot keep every thread
    busy (twice over, for balance), never more parts than key tiles."""
    if items < 2 * threads and key_tiles > 1:
        return min(key_tiles, -(-2 * threads // items))
    return 1


def key_lengths_and_shift(key_lengths, batch: int, sq: int, sk: int, bottom_right: bool):
    """(key lengths int64 [B], each query's offset on the key axis [B]). FlashAttention's rule
    for a ragged KV cache when ``bottom_right``: the queries are the last Sq of each sequence."""
    key_len = (
        np.full(batch, sk, dtype=np.int64)
        if key_lengths is None
        else np.ascontiguousarray(key_lengths, dtype=np.int64)
    )
    return key_len, key_len - sq if bottom_right else np.zeros(batch, np.int64)


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


def attention_numba(
    q,
    k,
    v,
    *,
    scale,
    causal,
    bottom_right,
    mask=None,
    key_lengths=None,
    alibi_slopes=None,
    relative_bias=None,
    window=None,
    softcap=None,
    sinks=None,
):
    """Launch the flash-style kernel on NumPy arrays (float32, float64, or bfloat16 / float16
    bits as uint16 / int16, read tile by tile and computed in float32; any strides).

    Query i of sequence b sits at key position i + L_b - Sq when ``bottom_right`` (L_b =
    key_lengths[b], or Sk), i otherwise. ``mask``: None,
    or a bool (True = attend) or float (added; float32 or float64 whatever q's dtype) array
    already broadcast to [B, Hq, Sq, Sk], typically a stride-0 view: it is read in place, never
    copied. ``key_lengths`` int [B] or None; ``alibi_slopes`` [B, Hq] or None;
    ``relative_bias`` None or (table [num_buckets, Hq], num_buckets, max_distance,
    bidirectional); ``window`` None or (left, right), -1 unbounded; ``softcap`` None or > 0;
    ``sinks`` float64 [Hq] or None. Returns (out [B, Hq, Sq, Dv] in the compute dtype, lse
    float32 [B, Hq, Sq]).
    """
    # half bits (uint16 bfloat16, int16 float16) are computed in float32 and returned so; q and
    # k may already be float32 (rotated by fused RoPE) while v is still half bits
    dtype = np.dtype(np.float32) if v.dtype in (np.uint16, np.int16) else v.dtype
    batch, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    if batch * hq * sq == 0 or sk == 0:  # nothing to compute: empty, or every row sees no key
        lse = np.full((batch, hq, sq), -np.inf, np.float32)
        if sinks is not None:
            lse[...] = np.asarray(sinks, np.float32)[None, :, None]
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
    key_len, query_shift = key_lengths_and_shift(key_lengths, batch, sq, sk, bottom_right)
    win_left, win_right = window_edges(window, causal, unbounded=sq + sk + 1)
    mask_bool, mask_add = _dummy(np.bool_, 4), _dummy(dtype, 4)
    mask_is_bool = mask is not None and mask.dtype == np.bool_
    limit = float(np.finfo(dtype).max)
    # Scores in log2 units (log2 e folded into the query scale: measurably more accurate in
    # float32 than scaling each difference), unless a float mask holds values so large that
    # times log2 e they would overflow: then natural units, where every finite mask stays a
    # finite score (transformers' finfo.min masks)
    unit = LOG2E
    if mask is not None:
        if mask_is_bool:
            mask_bool = mask
        else:
            mask_add = mask
            if _largest_finite_magnitude(mask) > limit / 4:
                unit = 1.0
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
    out = np.empty((n_splits, batch, hq, sq, dv), dtype=dtype)
    # split parts keep their lse in float64 until merged: the merge weighs each part by
    # exp(part_lse - lse), and an lse of size ~40 rounded to float32 is alone a relative 1e-6
    # error of that weight (as large as torch's whole float32 error on a decode step)
    lse = np.empty((n_splits, batch, hq, sq), dtype=np.float64 if n_splits > 1 else np.float32)
    kernel = _attention_numba.serial if serial else _attention_numba
    # rows of a tile: the query heads of a kv head times the positions of a query block; tiles
    # of at most SMALL_ROWS rows never call BLAS, so they need no limit on its threads
    uses_blas = group * block_m > SMALL_ROWS
    with _single_threaded_blas() if uses_blas else contextlib.nullcontext():
        kernel(
            q,
            k,
            v,
            out,
            lse,
            dtype.type(scale),
            win_left,
            win_right,
            0.0 if softcap is None else float(softcap),
            query_shift,
            key_len,
            mask is not None,
            mask_bool,
            mask_add,
            mask_is_bool,
            unit,
            alibi_slopes is not None,
            alibi,
            relative_bias is not None,
            bias,
            bias_offset,
            sinks is not None,
            _dummy(np.float64, 1) if sinks is None else np.ascontiguousarray(sinks, np.float64),
            block_m,
            block_n,
            n_splits,
            dtype == np.float32,
        )
    if n_splits == 1:
        return out[0], lse[0]
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
