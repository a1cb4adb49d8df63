"""The float64 NumPy oracle: the mathematics of docs/math.md, written to be obviously right.

Every function takes and returns float64 NumPy arrays (ints for ids and positions) whose
arguments were already validated by ``fastpe._inputs``; nothing here is tuned for speed. Every
other backend is tested against these functions.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

# ---------------------------------------------------------------------------------------------
# docs/math.md#sinusoidal-encoding


# 2π to 65 digits: the exact reduction below must not be limited by a float64 constant
_TWO_PI = Fraction("6.28318530717958647692528676655900576839433879875021164194988918462")


def angles(positions, omega: np.ndarray) -> np.ndarray:
    """p·ω [..., F] for integer positions [...] and float64 ω [F] (taken as exact).

    A float64 product is off by up to p·ω·2^-53 rad (1e-4 at p·ω = 2^40), so wherever
    p·ω >= 2^20 it is formed instead in exact rationals and reduced modulo 2π before rounding.
    """
    positions = np.asarray(positions, dtype=np.int64)  # float64 would round p >= 2^53
    angle = positions[..., None].astype(np.float64) * omega
    for index in map(tuple, np.argwhere(np.abs(angle) >= 2.0**20)):
        exact = Fraction(int(positions[index[:-1]])) * Fraction(float(omega[index[-1]]))
        angle[index] = float(exact % _TWO_PI)
    return angle


def sinusoidal_frequencies(dim: int, base: float, freq: str) -> np.ndarray:
    """ω_i for i = 0 … dim/2 - 1.

    paper:          ω_i = base ** (-2i / dim)
    tensor2tensor:  ω_i = base ** (-i / (dim/2 - 1))
    """
    i = np.arange(dim // 2, dtype=np.float64)
    if freq == "paper":
        return base ** (-2.0 * i / dim)
    return base ** (-i / (dim // 2 - 1))


def sinusoidal_rows(positions: np.ndarray, dim: int, base: float, layout: str, freq: str):
    """PE rows for arbitrary (integer-valued) positions, any leading shape -> [..., dim]."""
    angle = angles(positions, sinusoidal_frequencies(dim, base, freq))
    out = np.empty(angle.shape[:-1] + (dim,), dtype=np.float64)
    if layout == "interleaved":
        out[..., 0::2] = np.sin(angle)
        out[..., 1::2] = np.cos(angle)
    else:  # concat: [sin | cos]
        out[..., : dim // 2] = np.sin(angle)
        out[..., dim // 2 :] = np.cos(angle)
    return out


def sinusoidal_table(
    num_positions: int, dim: int, base: float, layout: str, freq: str, offset: int
):
    return sinusoidal_rows(np.arange(offset, offset + num_positions), dim, base, layout, freq)


def relative_transform(k: int, dim: int, base: float, freq: str, layout: str) -> np.ndarray:
    """T(k) with PE[p + k] = T(k) @ PE[p]: one 2x2 rotation per frequency.

    [sin ω(p+k)]   [ cos ωk  sin ωk] [sin ωp]
    [cos ω(p+k)] = [-sin ωk  cos ωk] [cos ωp]
    """
    omega_k = angles(np.array(k), sinusoidal_frequencies(dim, base, freq))  # reduced exactly
    c, s = np.cos(omega_k), np.sin(omega_k)
    t = np.zeros((dim, dim), dtype=np.float64)
    half = dim // 2
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if layout == "interleaved" else (i, half + i)
        t[a, a], t[a, b] = c[i], s[i]
        t[b, a], t[b, b] = -s[i], c[i]
    return t


# ---------------------------------------------------------------------------------------------
# docs/math.md#rope


def rope_table(num_positions: int, inv_freq: np.ndarray, attention_factor: float, offset: int):
    """cos/sin [P, R/2] = attention_factor · cos/sin(p · inv_freq)."""
    angle = angles(np.arange(offset, offset + num_positions, dtype=np.int64), inv_freq)
    return attention_factor * np.cos(angle), attention_factor * np.sin(angle)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray, interleaved):
    """Rotate x [B, H, S, D] by the rows ``positions`` [B, S] of cos/sin [P, R/2].

    (a, b) -> (a·cos - b·sin, b·cos + a·sin); pairs (i, i + R/2) or (2i, 2i + 1); the tail
    R … D-1 is copied.
    """
    half = cos.shape[1]
    c = cos[positions][:, None]  # [B, 1, S, R/2]
    s = sin[positions][:, None]
    out = x.copy()
    if interleaved:
        a, b = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        out[..., 0 : 2 * half : 2] = a * c - b * s
        out[..., 1 : 2 * half : 2] = b * c + a * s
    else:
        a, b = x[..., :half], x[..., half : 2 * half]
        out[..., :half] = a * c - b * s
        out[..., half : 2 * half] = b * c + a * s
    return out


def apply_rope_backward(grad: np.ndarray, cos, sin, positions: np.ndarray, interleaved):
    """Gradient of ``apply_rope`` w.r.t. x [B, H, S, D] from ``grad`` of its output.

    Each pair is multiplied by the rotation R(θ) = [[c, -s], [s, c]], so its gradient is
    R(θ)ᵀ = R(-θ): (g_a, g_b) -> (g_a·cos + g_b·sin, g_b·cos - g_a·sin); the tail passes through.
    """
    half = cos.shape[1]
    c = cos[positions][:, None]
    s = sin[positions][:, None]
    out = grad.copy()
    if interleaved:
        ga, gb = grad[..., 0 : 2 * half : 2], grad[..., 1 : 2 * half : 2]
        out[..., 0 : 2 * half : 2] = ga * c + gb * s
        out[..., 1 : 2 * half : 2] = gb * c - ga * s
    else:
        ga, gb = grad[..., :half], grad[..., half : 2 * half]
        out[..., :half] = ga * c + gb * s
        out[..., half : 2 * half] = gb * c - ga * s
    return out


# ---------------------------------------------------------------------------------------------
# docs/math.md#embedding


def embed(ids, weight, positions, pe, pe_table, scale, base, layout, freq, tt_ids, tt_weight):
    """scale · weight[ids] + PE(positions) [+ tt_weight[tt_ids]] -> [B, S, D]."""
    out = scale * weight[ids]
    if pe == "sinusoidal":
        out = out + sinusoidal_rows(positions, weight.shape[1], base, layout, freq)
    elif pe == "table":
        out = out + pe_table[positions]
    if tt_ids is not None:
        out = out + tt_weight[tt_ids]
    return out


def scatter_rows(index: np.ndarray, grad: np.ndarray, rows: int, scale: float = 1.0):
    """The gradient of a row gather ``table[index]`` [..., D] from ``grad`` [..., D]:
    ``out[r] = scale · Σ_{t : index[t] = r} grad[t]`` ([rows, D]; repeated rows accumulate)."""
    out = np.zeros((rows, grad.shape[-1]), dtype=np.float64)
    np.add.at(out, np.asarray(index).reshape(-1), grad.reshape(-1, grad.shape[-1]))
    return scale * out


def embed_backward(grad, ids, positions, pe, vocab, pe_rows, tt_ids, tt_rows, scale):
    """Gradients of ``embed`` from ``grad`` [B, S, D] -> (d weight [V, D], d pe_table [P, D] or
    None, d token_type_weight [T, D] or None). The sinusoidal PE and the ids / positions have no
    gradient."""
    d_weight = scatter_rows(ids, grad, vocab, scale)
    d_pe = scatter_rows(positions, grad, pe_rows) if pe == "table" else None
    d_types = None if tt_ids is None else scatter_rows(tt_ids, grad, tt_rows)
    return d_weight, d_pe, d_types


# ---------------------------------------------------------------------------------------------
# docs/math.md#attention


def t5_bucket(relative_position, bidirectional: bool, num_buckets: int, max_distance: int):
    """T5's bucket of ``relative_position = key position - query position``.

    The logarithmic part is evaluated in float32 exactly as T5 does, so that bucket boundaries
    (an integer function of float rounding) agree with the models' trained tables.
    """
    rel = np.asarray(relative_position, dtype=np.int64)
    buckets = np.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets += (rel > 0).astype(np.int64) * num_buckets
        rel = np.abs(rel)
    else:
        rel = -np.minimum(rel, 0)
    max_exact = num_buckets // 2
    # the log branch is only used where rel >= max_exact; clamp so it never sees log(0)
    log_ratio = np.log(np.maximum(rel, max_exact).astype(np.float32) / np.float32(max_exact))
    large = max_exact + (
        log_ratio
        / np.float32(math.log(max_distance / max_exact))
        * np.float32(num_buckets - max_exact)
    ).astype(np.int64, copy=False)
    large = np.minimum(large, num_buckets - 1)
    return buckets + np.where(rel < max_exact, rel, large)


def attention(q, k, v, *, sinks=None, **options):
    """Materialised softmax attention on float64 arrays.

    Keywords: ``scale``, ``causal`` and ``bottom_right`` (required), ``mask``, ``key_lengths``,
    ``alibi_slopes``, ``relative_bias``, ``window``, ``softcap`` (``options``, which
    ``_attention_logits`` takes: listed once for this function and its backward) and ``sinks``.
    q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv]. Query i of sequence b sits at key
    position i + L_b - Sq when ``bottom_right`` (the queries are the last Sq of the L_b keys,
    L_b = key_lengths[b], or Sk without key lengths: FlashAttention's rule for a ragged KV
    cache), at i otherwise; that position drives the causal rule, ALiBi and the relative-bias
    distance. ``mask`` is a bool array (True = attend) or a float array to add (any finite value
    is a score, however large), already broadcast to [B, Hq, Sq, Sk]; ``alibi_slopes`` is
    [B, Hq]; ``relative_bias`` is None or (table [num_buckets, Hq], num_buckets, max_distance,
    bidirectional), T5's bucketed bias; ``window`` None or (left, right), keys j with
    qpos - left <= j <= qpos + right (-1: unbounded on that side); ``softcap`` None or c > 0,
    scores c·tanh(score / c) after scaling, before biases and masks; ``sinks`` None or [Hq], one
    extra logit per head in the softmax denominator carrying no value (lse includes it).
    Returns out [B, Hq, Sq, Dv] and lse [B, Hq, Sq]. A row with no visible key (every key
    -inf, False, beyond its length or after it under the causal rule; or Sk = 0) has out = 0
    and lse = -inf: the empty sum.
    """
    scores, v_full, _, _ = _attention_logits(q, k, v, **options)

    row_max = scores.max(axis=-1, keepdims=True, initial=-np.inf)
    # rows with at least one visible key; a NaN (or +inf) score among them makes the row NaN
    seen = row_max != -np.inf
    weights = np.exp(scores - np.where(seen, row_max, 0.0))
    total = weights.sum(axis=-1, keepdims=True)
    out = np.einsum("bhij,bhjd->bhid", weights / np.where(seen, total, 1.0), v_full)
    out = np.where(seen, out, 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, row_max + np.log(np.where(seen, total, 1.0)), -np.inf)[..., 0]
    if sinks is not None:
        # the sink is one more key of score sinks[h] and value 0: merged in as a part of its own
        sink_lse = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None], lse.shape)
        out, lse = merge_attention(out, lse, np.zeros_like(out), sink_lse)
    return out, lse


def attention_backward(q, k, v, grad_out, grad_lse=None, *, sinks=None, **options):
    """Gradients of ``attention`` (docs/math.md#attention-backward), materialised in float64.

    Takes ``attention``'s arguments and the gradients of its outputs, grad_out [B, Hq, Sq, Dv] and grad_lse [B, Hq, Sq] (None: zero). With P = exp(z - lse) the softmax weights (sink
    included in lse), D_i = Σ_d dO_id·O_id - dlse_i and dP = dO·Vᵀ:
    dV = Pᵀ·dO, dZ = P ∘ (dP - D), dS = dZ ∘ (1 - tanh²(s/c)) under a softcap (else dZ),
    dQ = scale·dS·K, dK = scale·dSᵀ·Q (GQA: dK, dV summed over each group's query heads),
    dsinks_h = -Σ_{b,i} exp(sink_h - lse_bhi)·D_bhi, dtable[bucket, h] = Σ dZ over the
    (b, i, j) of that bucket. Masks, ALiBi slopes and key lengths get no gradient. Returns
    (dq, dk, dv, dsinks or None, dtable or None); rows that see no key contribute nothing.
    """
    batch, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    scale, softcap = options["scale"], options.get("softcap")
    key_lengths, relative_bias = options.get("key_lengths"), options.get("relative_bias")
    if key_lengths is not None:
        # padding is never read: 0·NaN in a padded key would still reach dq
        is_key = (np.arange(sk)[None, :] < np.asarray(key_lengths)[:, None])[:, None, :, None]
        k, v = np.where(is_key, k, 0.0), np.where(is_key, v, 0.0)
    out, lse = attention(q, k, v, sinks=sinks, **options)
    scores, v_full, softcap_slope, bucket = _attention_logits(q, k, v, **options)
    k_full = np.repeat(k, group, axis=1)

    seen = np.isfinite(lse)[..., None]
    weights = np.where(seen, np.exp(scores - np.where(seen, lse[..., None], 0.0)), 0.0)
    delta = np.einsum("bhid,bhid->bhi", grad_out, out)
    if grad_lse is not None:
        delta = delta - grad_lse  # d lse / d z_ij = P_ij: dZ gains P·dlse
    grad_weights = np.einsum("bhid,bhjd->bhij", grad_out, v_full)
    grad_logits = weights * (grad_weights - delta[..., None])
    grad_scores = grad_logits if softcap is None else grad_logits * softcap_slope

    dq = scale * np.einsum("bhij,bhjd->bhid", grad_scores, k_full)
    dk = scale * np.einsum("bhij,bhid->bhjd", grad_scores, q)
    dv = np.einsum("bhij,bhid->bhjd", weights, grad_out)
    dk = dk.reshape(batch, hkv, group, sk, -1).sum(axis=2)
    dv = dv.reshape(batch, hkv, group, sk, -1).sum(axis=2)

    dsinks = None
    if sinks is not None:
        # the sink is a key of value 0: its dP is 0, so its dZ is -P_sink·D
        sink_weight = np.exp(np.asarray(sinks, np.float64)[None, :, None] - lse)
        dsinks = -(sink_weight * delta).sum(axis=(0, 2))
    dtable = None
    if relative_bias is not None:
        table, num_buckets = relative_bias[0], relative_bias[1]
        dtable = np.zeros(np.shape(table), np.float64)
        buckets = np.broadcast_to(bucket[:, None], grad_logits.shape)
        for h in range(hq):
            dtable[:, h] = np.bincount(
                buckets[:, h].ravel(), weights=grad_logits[:, h].ravel(), minlength=num_buckets
            )
    return dq, dk, dv, dsinks, dtable


def _attention_logits(
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
):
    """The logits of ``attention`` before the softmax: (scores [B, Hq, Sq, Sk] with -inf where a
    query may not attend, v repeated to Hq heads with padding keys zeroed, the softcap's slope
    1 - tanh²(s/c) [B, Hq, Sq, Sk] or None, T5 buckets [B, Sq, Sk] or None)."""
    batch, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // max(hkv, 1)
    k_full = np.repeat(k, group, axis=1)  # query head h reads kv head h // group
    v_full = np.repeat(v, group, axis=1)
    scores = scale * np.einsum("bhid,bhjd->bhij", q, k_full)
    softcap_slope = None
    if softcap is not None:
        capped = np.tanh(scores / softcap)
        softcap_slope = 1.0 - capped**2  # d(c·tanh(s/c))/ds
        scores = softcap * capped

    lengths = np.full(batch, sk, np.int64) if key_lengths is None else np.asarray(key_lengths)
    query_shift = lengths - sq if bottom_right else np.zeros(batch, np.int64)
    i = (np.arange(sq)[None, :] + query_shift[:, None])[:, None, :, None]  # [B, 1, Sq, 1]
    j = np.arange(sk)[None, None, None, :]  # key positions, [1, 1, 1, Sk]
    allowed = np.ones((batch, hq, sq, sk), dtype=bool)
    if causal:
        allowed &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
    if key_lengths is not None:
        is_key = j[0, 0] < lengths[:, None]  # [B, Sk]
        allowed &= is_key[:, None, None, :]
        # padding is never read: a zero weight times a NaN value would still be NaN
        v_full = np.where(is_key[:, None, :, None], v_full, 0.0)
    if mask is not None:
        if mask.dtype == bool:
            allowed &= mask
        else:
            scores = scores + mask
    if alibi_slopes is not None:
        scores = scores - alibi_slopes[:, :, None, None] * np.abs(i - j)
    if relative_bias is not None:
        table, num_buckets, max_distance, bidirectional = relative_bias
        bucket = t5_bucket(j - i, bidirectional, num_buckets, max_distance)[:, 0]  # [B, Sq, Sk]
        scores = scores + np.moveaxis(table[bucket], -1, 1)
    else:
        bucket = None
    scores = np.where(allowed, scores, -np.inf)

    return scores, v_full, softcap_slope, bucket


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Combine attention over two disjoint key sets:
    lse = logaddexp(lse_a, lse_b), out = out_a·exp(lse_a - lse) + out_b·exp(lse_b - lse).
    A part with lse = -inf saw no key: it contributes nothing, whatever its out holds (0·NaN
    must not poison the sum). Rows that saw no key on either side stay 0 with lse -inf; a NaN lse
    (a part that met a NaN score) makes the row NaN.
    """
    lse = np.logaddexp(lse_a, lse_b)
    seen = np.isfinite(lse)
    safe = np.where(seen, lse, 0.0)
    out = np.zeros(np.broadcast_shapes(out_a.shape, out_b.shape))
    for part, part_lse in ((out_a, lse_a), (out_b, lse_b)):
        w = np.where(seen, np.exp(part_lse - safe), 0.0)[..., None]
        with np.errstate(invalid="ignore"):  # inf · 0 where w = 0, discarded
            out = out + np.where(w > 0.0, part * w, 0.0)
    return np.where(np.isnan(lse)[..., None], np.nan, out), lse


def merge_attention_backward(grad_out, grad_lse, out_a, lse_a, out_b, lse_b):
    """Gradients of ``merge_attention`` (docs/math.md#merge-gradients), float64:
    d out_p = w_p · g, d lse_p = w_p · (⟨g, out_p − out⟩ + g_lse) with w_p = exp(lse_p − lse).
    Returns (d out_a, d lse_a, d out_b, d lse_b). A part with lse = −inf has w = 0 and gets
    exactly zero gradients, whatever its out holds (never NaN).
    """
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    seen = np.isfinite(lse)
    safe = np.where(seen, lse, 0.0)
    grads = []
    for part, part_lse in ((out_a, lse_a), (out_b, lse_b)):
        w = np.where(seen, np.exp(part_lse - safe), 0.0)
        used = w > 0.0
        # the ignored out of an empty part may hold NaN or inf: zeroed before any product
        part = np.where(used[..., None], part, 0.0)
        d_out = w[..., None] * grad_out
        d_lse = np.where(used, w * (np.sum(grad_out * (part - out), axis=-1) + grad_lse), 0.0)
        grads += [d_out, d_lse]
    return tuple(grads)


# ---------------------------------------------------------------------------------------------
# docs/math.md#packed-variable-length-attention


def attention_varlen(
    q,
    k,
    v,
    cu_q,
    cu_k,
    *,
    scale,
    causal,
    bottom_right,
    alibi_slopes=None,
    window=None,
    softcap=None,
    sinks=None,
):
    """``attention`` of each packed sequence on its own, float64.

    q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv]; sequence b is rows cu_q[b] … cu_q[b+1]-1 of
    q and cu_k[b] … cu_k[b+1]-1 of k and v; ``alibi_slopes`` [B, Hq]; other options as
    ``attention``, applied per sequence. Returns out [Tq, Hq, Dv] and lse [Hq, Tq]
    (FlashAttention's varlen layout).
    """
    total_q, hq, _ = q.shape
    out = np.zeros((total_q, hq, v.shape[2]))
    lse = np.full((hq, total_q), -np.inf)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        part, part_lse = attention(
            *(x[None].transpose(0, 2, 1, 3) for x in (q[rows], k[keys], v[keys])),
            scale=scale,
            causal=causal,
            bottom_right=bottom_right,
            alibi_slopes=None if alibi_slopes is None else alibi_slopes[b : b + 1],
            window=window,
            softcap=softcap,
            sinks=sinks,
        )
        out[rows] = part[0].transpose(1, 0, 2)
        lse[:, rows] = part_lse[0]
    return out, lse
