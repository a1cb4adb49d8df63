"""FlashAttention 2's Python entry points on fastpe's kernels (docs/README.md#flashattention-compatible-functions).

Code written for ``flash_attn`` runs unchanged with ``from fastpe.flash_attn import
flash_attn_func, ...``: same signatures, layouts ([B, S, H, D]; packed [total, H, D]),
defaults and semantics — ``causal`` aligned bottom-right when seqlen_q != seqlen_k,
``window_size=(left, right)`` with -1 unbounded, adjusted as FlashAttention does (a side >=
seqlen_k is unbounded: k's length, max_seqlen_k, or the cache's length in
``flash_attn_with_kvcache``, where a window wider than the cache on both sides is thus no window
and rotary queries sit at cache_seqlens unless causal; entries may be 0-dim integer tensors),
``softcap=0.0`` off (NaN and negative values refused), ``alibi_slopes`` [H] or
[B, H], GQA/MQA through fewer k/v heads.

One keyword FlashAttention 2 lacks: ``s_aux`` (keyword only, every function), attention sinks
as transformers passes them to FlashAttention implementations for gpt-oss — one float logit per
query head [Hq] that joins every row's softmax denominator, ``exp(s_aux[h])`` added to the sum
of ``exp(score)`` and no value; it is ``fastpe.attention``'s ``sinks``, and it gets a gradient
where the call has a backward. The backend is fastpe's choice (``fastpe.use_backend``
or $FASTPE_BACKEND pick one). Gradients flow through ``flash_attn_func`` and the varlen
functions (``attention`` / ``attention_varlen`` have backwards); ``flash_attn_with_kvcache`` is
forward only (it compiles; inputs that require grad are refused).

Refused with a ValueError: ``dropout_p > 0`` (no dropout), ``return_attn_probs=True`` (use
``fastpe.attention``/``attention_varlen(..., return_lse=True)`` for the log-sum-exp),
``block_table`` in ``flash_attn_varlen_func``, ``cache_leftpad`` in ``flash_attn_with_kvcache``,
and k/v appended by ``flash_attn_with_kvcache`` without ``cache_seqlens`` (as FlashAttention;
without k/v, no cache_seqlens means the whole cache is valid). ``deterministic`` and
``num_splits`` are accepted and ignored (the forward pass is deterministic; splits are chosen by
the kernels).

No host sync per layer on a GPU: the varlen functions and ``flash_attn_with_kvcache`` check a
step's metadata (``cu_seqlens``, ``max_seqlen``; ``cache_seqlens``, ``block_table``,
``cache_batch_idx``) at the first layer's call and reuse that plan while the same tensors, not
changed in place since, come back (fastpe/_step_plans.py, docs/integrations.md#one-plan-per-step).
"""

from __future__ import annotations

from fastpe import _arrays
from fastpe._options import check_sinks, check_window
from fastpe._step_plans import step_plan
from fastpe._validate import check_float, check_int, is_int_scalar
from fastpe.api import attention, attention_kvcache, attention_varlen, plan_kvcache, plan_varlen

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


def _options(dropout_p, softmax_scale, window_size, softcap, return_attn_probs, seqlen_k) -> dict:
    """fastpe's keyword options from FlashAttention's; ``seqlen_k`` is the key length
    FlashAttention adjusts the window against (None where it is not known: the call is refused
    later for the shape that hides it)."""
    if dropout_p != 0.0:
        raise ValueError(
            f"dropout_p must be 0.0: fastpe.flash_attn has no attention dropout (inference and "
            f"dropout-free training); got dropout_p={dropout_p!r}"
        )
    if return_attn_probs:
        raise ValueError(
            "return_attn_probs=True is not supported (FlashAttention returns those "
            "probabilities for testing only); for the log-sum-exp call fastpe.attention or "
            "fastpe.attention_varlen with return_lse=True"
        )
    softcap = check_float("softcap", softcap)  # a TypeError or ValueError naming softcap
    if softcap < 0:
        raise ValueError(f"softcap must be a float >= 0 (0.0 = off); got {softcap!r}")
    return {
        "scale": softmax_scale,
        "window": _window(window_size, seqlen_k),
        "softcap": softcap if softcap > 0 else None,
    }


def _window(window_size, seqlen_k):
    """FlashAttention's adjustment before its kernels: a side >= seqlen_k (the key length of
    the call, the cache's for flash_attn_with_kvcache) is unbounded (-1). On the right this
    differs from fastpe.attention when seqlen_q > seqlen_k; in flash_attn_with_kvcache a window
    wider than the cache on both sides is no window, so rotary queries sit at cache_seqlens."""
    window = check_window(window_size, name="window_size")
    if window is None or seqlen_k is None:
        return window
    return tuple(-1 if side >= seqlen_k else side for side in window)


def _sinks(s_aux, q, ndim):
    """``s_aux`` as fastpe's ``sinks``: checked here so that errors name s_aux (against q's
    heads when q has its ``ndim`` dims; a q of other dims is refused later, by name)."""
    if s_aux is None:
        return None
    shape = _arrays.as_array(q).shape
    return check_sinks(s_aux, shape[-2], "s_aux") if len(shape) == ndim else s_aux


def _seqlen(x, axis):
    """``x.shape[axis]``, or None when ``x`` has too few dims (refused later, by name)."""
    shape = _arrays.as_array(x).shape
    return shape[axis] if len(shape) > axis else None


def _bhsd(x):
    """[B, S, H, D] <-> [B, H, S, D] (a view)."""
    return _arrays.as_array(x).swapaxes(1, 2)


def _contiguous(x):
    if _arrays.is_tensor(x):
        return x.contiguous()
    import numpy as np

    return np.ascontiguousarray(x)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    s_aux=None,
):
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] -> out [B, Sq, Hq, D]."""
    options = _options(
        dropout_p, softmax_scale, window_size, softcap, return_attn_probs, _seqlen(k, 1)
    )
    out = attention(
        _bhsd(q),
        _bhsd(k),
        _bhsd(v),
        causal=causal,
        causal_alignment="bottom_right",
        alibi_slopes=alibi_slopes,
        sinks=_sinks(s_aux, q, 4),
        **options,
    )
    return _contiguous(_bhsd(out))


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    s_aux=None,
):
    """qkv [B, S, 3, H, D] -> out [B, S, H, D]."""
    qkv = _packed("qkv", qkv, 3, ndim=5)
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], **_passed_on(locals()))


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    s_aux=None,
):
    """q [B, Sq, Hq, D], kv [B, Sk, 2, Hkv, D] -> out [B, Sq, Hq, D]."""
    kv = _packed("kv", kv, 2, ndim=5)
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], **_passed_on(locals()))


# What every packed variant passes on, unchanged and by name, to the function it unpacks for
_PASSED_ON = (
    "dropout_p",
    "softmax_scale",
    "causal",
    "window_size",
    "softcap",
    "alibi_slopes",
    "deterministic",
    "return_attn_probs",
    "s_aux",
)


def _passed_on(arguments, *names) -> dict:
    """The packed variant's arguments (its ``locals()``) that ``_PASSED_ON`` and ``names`` list:
    its signature stays FlashAttention's, spelled out, and its call does not restate it."""
    return {name: arguments[name] for name in (*names, *_PASSED_ON)}


def _packed(name, x, count, *, ndim):
    x = _arrays.as_array(x)
    axis = ndim - 3
    if x.ndim != ndim or x.shape[axis] != count:
        want = {
            (5, 3): "[B, S, 3, H, D]",
            (5, 2): "[B, S, 2, Hkv, D]",
            (4, 3): "[total, 3, H, D]",
            (4, 2): "[total_k, 2, Hkv, D]",
        }[(ndim, count)]
        raise ValueError(f"{name} must be {want}; got shape {tuple(x.shape)}")
    return x


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    s_aux=None,
):
    """q [total_q, Hq, D], k/v [total_k, Hkv, D], cu_seqlens int32 [B + 1] -> out
    [total_q, Hq, D]."""
    seqlen_k = check_int("max_seqlen_k", max_seqlen_k) if is_int_scalar(max_seqlen_k) else None
    options = _options(dropout_p, softmax_scale, window_size, softcap, return_attn_probs, seqlen_k)
    if block_table is not None:
        raise ValueError(
            "block_table in flash_attn_varlen_func (paged keys for packed queries) is not "
            "supported; use flash_attn_with_kvcache(q, k_cache, v_cache, block_table=...)"
        )
    plan = step_plan(
        lambda: plan_varlen(
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k
        ),
        (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
        (),
        q,
    )
    if plan is not None:
        cu_seqlens_q = cu_seqlens_k = max_seqlen_q = max_seqlen_k = None
    return attention_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        plan=plan,
        causal=causal,
        causal_alignment="bottom_right",
        alibi_slopes=alibi_slopes,
        sinks=_sinks(s_aux, q, 3),
        **options,
    )


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    s_aux=None,
):
    """qkv [total, 3, H, D] -> out [total, H, D]."""
    qkv = _packed("qkv", qkv, 3, ndim=4)
    return flash_attn_varlen_func(
        qkv[:, 0],
        qkv[:, 1],
        qkv[:, 2],
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        **_passed_on(locals()),
    )


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    s_aux=None,
):
    """q [total_q, Hq, D], kv [total_k, 2, Hkv, D] -> out [total_q, Hq, D]."""
    kv = _packed("kv", kv, 2, ndim=4)
    return flash_attn_varlen_func(
        q,
        kv[:, 0],
        kv[:, 1],
        **_passed_on(locals(), "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
    )


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    s_aux=None,
    k_scale=None,
    v_scale=None,
    k_descale=None,
    v_descale=None,
):
    """q [B, Sq, Hq, D]; k_cache/v_cache [B_cache, S_cache, Hkv, D] or, with block_table
    [B, max_blocks], [num_blocks, block_size, Hkv, D]; k/v [B, S_new, Hkv, D] are appended
    into the caches in place at cache_seqlens (see fastpe.attention_kvcache). Returns out
    [B, Sq, Hq, D] (and lse [B, Hq, Sq] with return_softmax_lse).

    Quantized caches (keyword only): ``k_scale``/``v_scale`` as in fastpe.attention_kvcache;
    ``k_descale``/``v_descale`` are FlashAttention 3's names for the same factors (value =
    stored × descale; float32 [B, Hkv] there) — pass one name of each pair."""
    k_scale = _one_of("k_scale", k_scale, "k_descale", k_descale)
    v_scale = _one_of("v_scale", v_scale, "v_descale", v_descale)
    if cache_leftpad is not None:
        raise ValueError("cache_leftpad is not supported; pass caches that start at position 0")
    width, pages = _seqlen(k_cache, 1), 1 if block_table is None else _seqlen(block_table, 1)
    capacity = None if width is None or pages is None else width * pages
    options = _options(0.0, softmax_scale, window_size, softcap, False, capacity)
    if cache_seqlens is None:
        if k is not None or v is not None:
            # FlashAttention refuses this too: where the new tokens go is not defined
            raise ValueError(
                "cache_seqlens is required when k/v are appended (an int or an int [B] of "
                "the tokens already in each cache row); got cache_seqlens=None"
            )
        cache_seqlens = capacity  # FlashAttention: the whole cache is valid
    metadata = (cache_seqlens, block_table, cache_batch_idx)
    plan = step_plan(
        lambda: plan_kvcache(
            q,
            k_cache,
            k,
            cache_seqlens=cache_seqlens,
            block_table=block_table,
            cache_batch_idx=cache_batch_idx,
        ),
        metadata,
        _shapes(q, k_cache, k),
        q,
    )
    if plan is not None:
        cache_seqlens = block_table = cache_batch_idx = None
    return attention_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens=cache_seqlens,
        block_table=block_table,
        cache_batch_idx=cache_batch_idx,
        plan=plan,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved,
        causal=causal,
        alibi_slopes=alibi_slopes,
        sinks=_sinks(s_aux, q, 4),
        return_lse=return_softmax_lse,
        k_scale=k_scale,
        v_scale=v_scale,
        **options,
    )


def _shapes(q, k_cache, k):
    """What a KV-cache plan is made for besides its metadata: the batch and query length, the
    cache's blocks and their layout, the new tokens (None where a shape is not a 4-dim array:
    refused by the call, by name)."""
    shapes = [getattr(x, "shape", None) for x in (q, k_cache, k)]
    if any(shape is not None and len(shape) != 4 for shape in shapes):
        return None
    strides = _arrays.strides(k_cache) if _arrays.is_tensor(k_cache) else None
    return (*(None if shape is None else tuple(shape[:2]) for shape in shapes), strides)


def _one_of(name, value, alias, alias_value):
    if value is not None and alias_value is not None:
        raise ValueError(f"pass {name} or {alias} (the same factor), not both")
    return alias_value if value is None else value
