"""The serving ops: ``fastpe::attention_varlen`` (packed sequences) with its backward
``attention_varlen_backward``, and ``fastpe::attention_kvcache``, which writes into its caches.
The options they share with attention travel as ``AttentionOptions.SCHEMA``."""

from __future__ import annotations

import torch

from fastpe import dispatch
from fastpe._options import AttentionOptions
from fastpe._validate import check_bool, check_int
from fastpe.torch_ops._common import (
    _backend,
    _plain,
    _schema_int,
    refuse_no_gradient,
    refuse_second_derivative,
    register_autograd,
    schema_names,
)

# ---------------------------------------------------------------------------------------------
# attention_varlen (packed sequences): a forward op and a backward op, each dispatched to the
# backends like any op.

# everything after (q, k, v, cu_seqlens_q, cu_seqlens_k) but the backend, in both ops' schemas
_VARLEN_ARGUMENTS = f"int? max_seqlen_q, int? max_seqlen_k, {AttentionOptions.SCHEMA}"
_VARLEN_NAMES = schema_names(_VARLEN_ARGUMENTS)
_VARLEN_NO_GRADIENT = {
    5 + _VARLEN_NAMES.index(name): name for name in ("rope_cos", "rope_sin", "alibi_slopes")
}


def _varlen_inputs(q, k, v, cu_q, cu_k, arguments):
    from fastpe._inputs_serving import AttentionVarlenInputs

    max_seqlen_q, max_seqlen_k, *options = arguments
    return AttentionVarlenInputs.build(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        return_lse=True,
        **AttentionOptions.unflatten(options),
    )


@torch.library.custom_op(
    "fastpe::attention_varlen",
    mutates_args=(),
    schema=(
        "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        f"{_VARLEN_ARGUMENTS}, str backend) -> (Tensor, Tensor)"
    ),
)
def attention_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, *arguments):
    *arguments, backend = arguments
    inputs = _varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, arguments)
    out, lse = dispatch.run(inputs, _backend(backend))
    return out, lse


@attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, *args):
    total_q, hq, _ = q.shape
    return q.new_empty((total_q, hq, v.shape[2])), q.new_empty((hq, total_q), dtype=torch.float32)


@torch.library.custom_op(
    "fastpe::attention_varlen_backward",
    mutates_args=(),
    schema=(
        "(Tensor grad_out, Tensor grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        f"Tensor cu_seqlens_q, Tensor cu_seqlens_k, {_VARLEN_ARGUMENTS}, str backend) -> "
        "(Tensor, Tensor, Tensor, Tensor)"
    ),
)
def attention_varlen_backward_op(
    grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *arguments
):
    """(dq, dk, dv, dsinks) of one attention_varlen_op call (dsinks empty without sinks); the
    backend's attention_varlen_backward computes them (by default attention's backward once per
    sequence, fastpe.backends.base.AttentionVarlenBackward)."""
    from fastpe._inputs_serving import AttentionVarlenBackwardInputs

    *arguments, backend = arguments
    forward = _varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, arguments)
    inputs = AttentionVarlenBackwardInputs.build(
        forward, grad_out=grad_out, grad_lse=grad_lse, out=out, lse=lse
    )
    dq, dk, dv, dsinks = dispatch.run(inputs, _backend(backend))
    return dq, dk, dv, q.new_zeros((0,)) if dsinks is None else dsinks


@attention_varlen_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *args):
    sinks = dict(zip(_VARLEN_NAMES, args, strict=False))["sinks"]
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
        q.new_empty((0,)) if sinks is None else torch.empty_like(sinks),
    )


def _varlen_backward(ctx, grad_out, grad_lse):
    refuse_no_gradient(ctx, "attention_varlen", _VARLEN_NO_GRADIENT)
    q, k, v, cu_q, cu_k, *arguments = ctx.args
    out, lse = ctx.outputs
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
    dq, dk, dv, dsinks = attention_varlen_backward_op(
        grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, *arguments, ctx.backend
    )
    has_sinks = dict(zip(_VARLEN_NAMES, arguments, strict=True))["sinks"] is not None
    grads = {"sinks": dsinks if has_sinks else None}
    return (dq, dk, dv, None, None, *(grads.get(name) for name in _VARLEN_NAMES), None)


register_autograd("attention_varlen", _varlen_backward, save_outputs=True)
refuse_second_derivative("attention_varlen_backward")


def _max_seqlen(name, value):
    """A bound the schema's int64 can carry: the record stores at most the packed total, so a
    bound past 2**62 means the same as 2**62 (the eager path accepts any such bound)."""
    return None if value is None else min(check_int(name, value, minimum=0), 2**62)


def call_attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    max_seqlen_q,
    max_seqlen_k,
    return_lse,
    backend,
    **options,
):
    out, lse = attention_varlen_op(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        _max_seqlen("max_seqlen_q", max_seqlen_q),
        _max_seqlen("max_seqlen_k", max_seqlen_k),
        *AttentionOptions.flatten(q.device, **options),
        backend or "",
    )
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# attention_kvcache: an inference op that writes new k/v into the caches (declared mutations,
# so torch.compile functionalizes it); no backward (autograd refuses it at the call). Its fused
# RoPE (rotary_cos, rotary_sin, rotary_interleaved) travels in the schema's rope arguments.


@torch.library.custom_op(
    "fastpe::attention_kvcache",
    # int8 caches' scales are written by an append
    mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"),
    schema=(
        "(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
        "Tensor? cache_seqlens, int cache_seqlens_int, Tensor? block_table, "
        "Tensor? cache_batch_idx, Tensor(c!)? k_scale, Tensor(d!)? v_scale, "
        f"{AttentionOptions.SCHEMA}, str backend) -> (Tensor, Tensor)"
    ),
)
def attention_kvcache_op(
    q,
    k_cache,
    v_cache,
    k,
    v,
    cache_seqlens,
    cache_seqlens_int,
    block_table,
    cache_batch_idx,
    k_scale,
    v_scale,
    *args,
):
    from fastpe._inputs_serving import AttentionKVCacheInputs

    *options, backend = args
    options = AttentionOptions.unflatten(options)
    rotary = options.pop("rope") or {}
    inputs = AttentionKVCacheInputs.build(
        q,
        k_cache,
        v_cache,
        k=k,
        v=v,
        cache_seqlens=cache_seqlens_int if cache_seqlens is None else cache_seqlens,
        block_table=block_table,
        cache_batch_idx=cache_batch_idx,
        rotary_cos=rotary.get("cos"),
        rotary_sin=rotary.get("sin"),
        rotary_interleaved=rotary.get("interleaved", False),
        return_lse=True,
        k_scale=k_scale,
        v_scale=v_scale,
        **options,
    )
    out, lse = dispatch.run(inputs, _backend(backend))
    return out, lse


@attention_kvcache_op.register_fake
def _(q, k_cache, v_cache, *args):
    b, sq, hq, _ = q.shape
    return q.new_empty((b, sq, hq, v_cache.shape[3])), q.new_empty((b, hq, sq), dtype=torch.float32)


# no autograd registration: torch refuses one for an op that mutates its inputs; the public
# function refuses inputs that require grad before reaching here (outside torch.compile)


def call_attention_kvcache(
    q,
    k_cache,
    v_cache,
    k,
    v,
    *,
    cache_seqlens,
    block_table,
    cache_batch_idx,
    rotary_cos,
    rotary_sin,
    rotary_interleaved,
    return_lse,
    backend,
    k_scale=None,
    v_scale=None,
    **options,
):
    cache_seqlens = _plain(cache_seqlens)
    # a float fp8 scale travels as a 0-dim tensor (the schema's Tensor?)
    k_scale, v_scale = (
        torch.tensor(float(x), dtype=torch.float32, device=q.device)
        if isinstance(x, (int, float)) and not isinstance(x, bool)
        else x
        for x in (k_scale, v_scale)
    )
    if isinstance(cache_seqlens, int):
        cache_seqlens = _schema_int("cache_seqlens", cache_seqlens)
    length = cache_seqlens if isinstance(cache_seqlens, int) else 0
    lengths, block_table, cache_batch_idx = (
        torch.as_tensor(x, device=q.device) if isinstance(x, (list, tuple)) else x
        for x in (
            None if isinstance(cache_seqlens, int) else cache_seqlens,
            block_table,
            cache_batch_idx,
        )
    )
    rope = None
    if rotary_cos is not None or rotary_sin is not None:
        interleaved = check_bool("rotary_interleaved", rotary_interleaved)
        rope = {"cos": rotary_cos, "sin": rotary_sin, "interleaved": interleaved}
    out, lse = attention_kvcache_op(
        q,
        k_cache,
        v_cache,
        k,
        v,
        lengths,
        length,
        block_table,
        cache_batch_idx,
        k_scale,
        v_scale,
        *AttentionOptions.flatten(q.device, rope=rope, **options),
        backend or "",
    )
    return (out, lse) if return_lse else out
