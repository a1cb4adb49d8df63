"""The serving ops: ``fastpe::attention_varlen`` (packed sequences) with its backward
``attention_varlen_backward``, and ``fastpe::attention_kvcache``, which writes into its caches."""

from __future__ import annotations

import torch
from torch import Tensor

from fastpe import dispatch
from fastpe._options import Rope
from fastpe._validate import check_bool, check_int
from fastpe.torch_ops._common import (
    _backend,
    _plain,
    _schema_int,
    refuse_no_gradient,
    refuse_second_derivative,
    register_autograd,
    window_and_softcap,
)

# ---------------------------------------------------------------------------------------------
# attention_varlen (packed sequences): a forward op and a backward op, each dispatched to the
# backends like any op.

_VARLEN_OPTIONS = (
    "max_seqlen_q",
    "max_seqlen_k",
    "causal",
    "causal_alignment",
    "scale",
    "rope_cos",
    "rope_sin",
    "rope_interleaved",
    "rope_q_positions",
    "rope_k_positions",
    "alibi_slopes",
    "window_left",
    "window_right",
    "softcap",
    "sinks",
)
# (q, k, v, cu_seqlens_q, cu_seqlens_k) come first in the schema
_VARLEN_NO_GRADIENT = {
    5 + _VARLEN_OPTIONS.index(name): name for name in ("rope_cos", "rope_sin", "alibi_slopes")
}


def _varlen_inputs(
    q,
    k,
    v,
    cu_q,
    cu_k,
    max_seqlen_q,
    max_seqlen_k,
    causal,
    causal_alignment,
    scale,
    rope_cos,
    rope_sin,
    rope_interleaved,
    rope_q_positions,
    rope_k_positions,
    alibi_slopes,
    window_left,
    window_right,
    softcap,
    sinks,
):
    from fastpe._inputs_serving import AttentionVarlenInputs

    rope = None
    if rope_cos is not None or rope_sin is not None:
        rope = {
            "cos": rope_cos,
            "sin": rope_sin,
            "interleaved": rope_interleaved,
            "q_positions": rope_q_positions,
            "k_positions": rope_k_positions,
        }
    return AttentionVarlenInputs.build(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        causal=causal,
        causal_alignment=causal_alignment,
        scale=scale,
        rope=rope,
        alibi_slopes=alibi_slopes,
        window=(window_left, window_right),
        softcap=softcap,
        sinks=sinks,
        return_lse=True,
    )


@torch.library.custom_op("fastpe::attention_varlen", mutates_args=())
def attention_varlen_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    causal: bool,
    causal_alignment: str,
    scale: float | None,
    rope_cos: Tensor | None,
    rope_sin: Tensor | None,
    rope_interleaved: bool,
    rope_q_positions: Tensor | None,
    rope_k_positions: Tensor | None,
    alibi_slopes: Tensor | None,
    window_left: int,
    window_right: int,
    softcap: float | None,
    sinks: Tensor | None,
    backend: str,
) -> tuple[Tensor, Tensor]:
    inputs = _varlen_inputs(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        causal_alignment,
        scale,
        rope_cos,
        rope_sin,
        rope_interleaved,
        rope_q_positions,
        rope_k_positions,
        alibi_slopes,
        window_left,
        window_right,
        softcap,
        sinks,
    )
    out, lse = dispatch.run(inputs, _backend(backend))
    return out, lse


@attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, *args):
    total_q, hq, _ = q.shape
    return q.new_empty((total_q, hq, v.shape[2])), q.new_empty((hq, total_q), dtype=torch.float32)


@torch.library.custom_op("fastpe::attention_varlen_backward", mutates_args=())
def attention_varlen_backward_op(
    grad_out: Tensor,
    grad_lse: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    causal: bool,
    causal_alignment: str,
    scale: float | None,
    rope_cos: Tensor | None,
    rope_sin: Tensor | None,
    rope_interleaved: bool,
    rope_q_positions: Tensor | None,
    rope_k_positions: Tensor | None,
    alibi_slopes: Tensor | None,
    window_left: int,
    window_right: int,
    softcap: float | None,
    sinks: Tensor | None,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks) of one attention_varlen_op call (dsinks empty without sinks); the
    backend's attention_varlen_backward computes them (by default attention's backward once per
    sequence, fastpe.backends.base.AttentionVarlenBackward)."""
    from fastpe._inputs_serving import AttentionVarlenBackwardInputs

    forward = _varlen_inputs(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        causal_alignment,
        scale,
        rope_cos,
        rope_sin,
        rope_interleaved,
        rope_q_positions,
        rope_k_positions,
        alibi_slopes,
        window_left,
        window_right,
        softcap,
        sinks,
    )
    inputs = AttentionVarlenBackwardInputs.build(
        forward, grad_out=grad_out, grad_lse=grad_lse, out=out, lse=lse
    )
    dq, dk, dv, dsinks = dispatch.run(inputs, _backend(backend))
    return dq, dk, dv, q.new_zeros((0,)) if dsinks is None else dsinks


@attention_varlen_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *args):
    sinks = dict(zip(_VARLEN_OPTIONS, args, strict=False))["sinks"]
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
        q.new_empty((0,)) if sinks is None else torch.empty_like(sinks),
    )


def _varlen_backward(ctx, grad_out, grad_lse):
    refuse_no_gradient(ctx, "attention_varlen", _VARLEN_NO_GRADIENT)
    q, k, v, cu_q, cu_k, *options = ctx.args
    out, lse = ctx.outputs
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
    dq, dk, dv, dsinks = attention_varlen_backward_op(
        grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, *options, ctx.backend
    )
    has_sinks = dict(zip(_VARLEN_OPTIONS, options, strict=True))["sinks"] is not None
    grads = {"sinks": dsinks if has_sinks else None}
    return (dq, dk, dv, None, None, *(grads.get(name) for name in _VARLEN_OPTIONS), None)


register_autograd("attention_varlen", _varlen_backward, save_outputs=True)
refuse_second_derivative("attention_varlen_backward")


def _varlen_positions(name: str, positions, device) -> Tensor | None:
    positions = _plain(positions)
    if positions is None or isinstance(positions, Tensor):
        return positions
    if isinstance(positions, (list, tuple)):
        return torch.as_tensor(positions, device=device)
    raise TypeError(
        f"{name} must be None (positions restart at each sequence) or an int tensor of one "
        f"position per packed token; got {positions!r}"
    )


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
    causal,
    causal_alignment,
    scale,
    rope,
    alibi_slopes,
    window,
    softcap,
    sinks,
    return_lse,
    backend,
):
    window_left, window_right, softcap = window_and_softcap(window, softcap)
    if rope is not None:
        Rope.check_keys(rope)
    rope = rope or {}
    out, lse = attention_varlen_op(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        _max_seqlen("max_seqlen_q", max_seqlen_q),
        _max_seqlen("max_seqlen_k", max_seqlen_k),
        check_bool("causal", causal),
        causal_alignment,
        None if scale is None else float(scale),
        rope.get("cos"),
        rope.get("sin"),
        check_bool("rope['interleaved']", rope.get("interleaved", False)),
        _varlen_positions("rope['q_positions']", rope.get("q_positions"), q.device),
        _varlen_positions("rope['k_positions']", rope.get("k_positions"), q.device),
        alibi_slopes,
        window_left,
        window_right,
        softcap,
        sinks,
        backend or "",
    )
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# attention_kvcache: an inference op that writes new k/v into the caches (declared mutations,
# so torch.compile functionalizes it); no backward (autograd refuses it at the call).


@torch.library.custom_op("fastpe::attention_kvcache", mutates_args=("k_cache", "v_cache"))
def attention_kvcache_op(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    cache_seqlens: Tensor | None,
    cache_seqlens_int: int,
    block_table: Tensor | None,
    cache_batch_idx: Tensor | None,
    rotary_cos: Tensor | None,
    rotary_sin: Tensor | None,
    rotary_interleaved: bool,
    causal: bool,
    scale: float | None,
    alibi_slopes: Tensor | None,
    window_left: int,
    window_right: int,
    softcap: float | None,
    sinks: Tensor | None,
    backend: str,
) -> tuple[Tensor, Tensor]:
    from fastpe._inputs_serving import AttentionKVCacheInputs

    inputs = AttentionKVCacheInputs.build(
        q,
        k_cache,
        v_cache,
        k=k,
        v=v,
        cache_seqlens=cache_seqlens_int if cache_seqlens is None else cache_seqlens,
        block_table=block_table,
        cache_batch_idx=cache_batch_idx,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved,
        causal=causal,
        scale=scale,
        alibi_slopes=alibi_slopes,
        window=(window_left, window_right),
        softcap=softcap,
        sinks=sinks,
        return_lse=True,
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
    causal,
    scale,
    alibi_slopes,
    window,
    softcap,
    sinks,
    return_lse,
    backend,
):
    window_left, window_right, softcap = window_and_softcap(window, softcap)
    cache_seqlens = _plain(cache_seqlens)
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
        rotary_cos,
        rotary_sin,
        check_bool("rotary_interleaved", rotary_interleaved),
        check_bool("causal", causal),
        None if scale is None else float(scale),
        alibi_slopes,
        window_left,
        window_right,
        softcap,
        sinks,
        backend or "",
    )
    return (out, lse) if return_lse else out
