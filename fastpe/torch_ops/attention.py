"""``fastpe::attention`` and its backward ``attention_backward`` (docs/math.md#attention-backward),
with the one place where attention's structured options (``rope=`` and ``relative_bias=`` dicts,
whose values the ``AttentionInputs`` record validates into ``Rope`` / ``RelativeBias``) meet the
op schema, which takes only flat typed arguments."""

from __future__ import annotations

import torch
from torch import Tensor

from fastpe import dispatch
from fastpe._inputs import AttentionBackwardInputs, AttentionInputs
from fastpe._options import RelativeBias, Rope
from fastpe.torch_ops._common import (
    _backend,
    _plain,
    _schema_int,
    _split_positions,
    refuse_no_gradient,
    refuse_second_derivative,
    register_autograd,
    window_and_softcap,
)


def _attention_inputs(
    q,
    k,
    v,
    causal,
    causal_alignment,
    mask,
    key_lengths,
    scale,
    rope_cos,
    rope_sin,
    rope_interleaved,
    rope_q_positions,
    rope_q_positions_offset,
    rope_k_positions,
    rope_k_positions_offset,
    alibi_slopes,
    relative_bias_table,
    relative_bias_num_buckets,
    relative_bias_max_distance,
    relative_bias_bidirectional,
    window_left,
    window_right,
    softcap,
    sinks,
) -> AttentionInputs:
    """The validated forward record of the attention schema's arguments (with lse: the backward
    needs it)."""
    rope = _rope_from_schema(
        rope_cos,
        rope_sin,
        rope_interleaved,
        rope_q_positions,
        rope_q_positions_offset,
        rope_k_positions,
        rope_k_positions_offset,
    )
    relative_bias = _relative_bias_from_schema(
        relative_bias_table,
        relative_bias_num_buckets,
        relative_bias_max_distance,
        relative_bias_bidirectional,
    )
    return AttentionInputs.build(
        q,
        k,
        v,
        causal=causal,
        causal_alignment=causal_alignment,
        mask=mask,
        key_lengths=key_lengths,
        scale=scale,
        rope=rope,
        alibi_slopes=alibi_slopes,
        relative_bias=relative_bias,
        return_lse=True,
        window=(window_left, window_right),
        softcap=softcap,
        sinks=sinks,
    )


@torch.library.custom_op("fastpe::attention", mutates_args=())
def attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    causal_alignment: str,
    mask: Tensor | None,
    key_lengths: Tensor | None,
    scale: float | None,
    rope_cos: Tensor | None,
    rope_sin: Tensor | None,
    rope_interleaved: bool,
    rope_q_positions: Tensor | None,
    rope_q_positions_offset: int | None,
    rope_k_positions: Tensor | None,
    rope_k_positions_offset: int | None,
    alibi_slopes: Tensor | None,
    relative_bias_table: Tensor | None,
    relative_bias_num_buckets: int,
    relative_bias_max_distance: int,
    relative_bias_bidirectional: bool,
    window_left: int,
    window_right: int,
    softcap: float | None,
    sinks: Tensor | None,
    backend: str,
) -> tuple[Tensor, Tensor]:
    inputs = _attention_inputs(
        q,
        k,
        v,
        causal,
        causal_alignment,
        mask,
        key_lengths,
        scale,
        rope_cos,
        rope_sin,
        rope_interleaved,
        rope_q_positions,
        rope_q_positions_offset,
        rope_k_positions,
        rope_k_positions_offset,
        alibi_slopes,
        relative_bias_table,
        relative_bias_num_buckets,
        relative_bias_max_distance,
        relative_bias_bidirectional,
        window_left,
        window_right,
        softcap,
        sinks,
    )
    out, lse = dispatch.run(inputs, _backend(backend))
    return out, lse


@attention_op.register_fake
def _(q, k, v, *args):
    b, hq, sq, _ = q.shape
    return q.new_empty((b, hq, sq, v.shape[3])), q.new_empty((b, hq, sq), dtype=torch.float32)


# The forward's options as they travel to the backward op: everything after (q, k, v) in
# attention_op's schema except the backend, in order.
_ATTENTION_OPTIONS = (
    "causal",
    "causal_alignment",
    "mask",
    "key_lengths",
    "scale",
    "rope_cos",
    "rope_sin",
    "rope_interleaved",
    "rope_q_positions",
    "rope_q_positions_offset",
    "rope_k_positions",
    "rope_k_positions_offset",
    "alibi_slopes",
    "relative_bias_table",
    "relative_bias_num_buckets",
    "relative_bias_max_distance",
    "relative_bias_bidirectional",
    "window_left",
    "window_right",
    "softcap",
    "sinks",
)
# inputs that get no gradient (docs/README.md#training): asking for one is an error
_NO_GRADIENT = {
    3 + _ATTENTION_OPTIONS.index(name): name
    for name in ("mask", "rope_cos", "rope_sin", "alibi_slopes")
}


@torch.library.custom_op("fastpe::attention_backward", mutates_args=())
def attention_backward_op(
    grad_out: Tensor,
    grad_lse: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    causal_alignment: str,
    mask: Tensor | None,
    key_lengths: Tensor | None,
    scale: float | None,
    rope_cos: Tensor | None,
    rope_sin: Tensor | None,
    rope_interleaved: bool,
    rope_q_positions: Tensor | None,
    rope_q_positions_offset: int | None,
    rope_k_positions: Tensor | None,
    rope_k_positions_offset: int | None,
    alibi_slopes: Tensor | None,
    relative_bias_table: Tensor | None,
    relative_bias_num_buckets: int,
    relative_bias_max_distance: int,
    relative_bias_bidirectional: bool,
    window_left: int,
    window_right: int,
    softcap: float | None,
    sinks: Tensor | None,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks, d relative_bias_table) of one attention_op call; the last two are
    empty when the call had no sinks / no table."""
    forward = _attention_inputs(
        q,
        k,
        v,
        causal,
        causal_alignment,
        mask,
        key_lengths,
        scale,
        rope_cos,
        rope_sin,
        rope_interleaved,
        rope_q_positions,
        rope_q_positions_offset,
        rope_k_positions,
        rope_k_positions_offset,
        alibi_slopes,
        relative_bias_table,
        relative_bias_num_buckets,
        relative_bias_max_distance,
        relative_bias_bidirectional,
        window_left,
        window_right,
        softcap,
        sinks,
    )
    inputs = AttentionBackwardInputs.build(
        forward, grad_out=grad_out, grad_lse=grad_lse, out=out, lse=lse
    )
    dq, dk, dv, dsinks, dtable = dispatch.run(inputs, _backend(backend))
    if dsinks is None:
        dsinks = q.new_empty((0,))
    if dtable is None:
        dtable = q.new_empty((0, 0))
    return dq, dk, dv, dsinks, dtable


@attention_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, *args):
    options = dict(zip(_ATTENTION_OPTIONS, args, strict=False))
    sinks, table = options["sinks"], options["relative_bias_table"]
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
        q.new_empty((0,)) if sinks is None else torch.empty_like(sinks),
        q.new_empty((0, 0)) if table is None else torch.empty_like(table),
    )


def _attention_backward(ctx, grad_out, grad_lse):
    refuse_no_gradient(ctx, "attention", _NO_GRADIENT)
    q, k, v, *options = ctx.args
    out, lse = ctx.outputs
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dsinks, dtable = attention_backward_op(
        grad_out, grad_lse, q, k, v, out, lse, *options, ctx.backend
    )
    named = dict(zip(_ATTENTION_OPTIONS, options, strict=True))
    grads = {
        "sinks": dsinks if named["sinks"] is not None else None,
        "relative_bias_table": dtable if named["relative_bias_table"] is not None else None,
    }
    return (dq, dk, dv, *(grads.get(name) for name in _ATTENTION_OPTIONS), None)


register_autograd("attention", _attention_backward, save_outputs=True)
refuse_second_derivative("attention_backward")


def _rope_to_schema(rope, device) -> tuple:
    if rope is None:
        return None, None, False, None, None, None, None
    Rope.check_keys(rope)
    q_positions = _split_positions(rope.get("q_positions"), device, "rope['q_positions']")
    k_positions = _split_positions(rope.get("k_positions"), device, "rope['k_positions']")
    return (
        rope.get("cos"),
        rope.get("sin"),
        rope.get("interleaved", False),
        *q_positions,
        *k_positions,
    )


def _rope_from_schema(
    cos, sin, interleaved, q_positions, q_positions_offset, k_positions, k_positions_offset
):
    if cos is None and sin is None:
        return None
    rope = {"cos": cos, "sin": sin, "interleaved": interleaved}
    for key, tensor, offset in (
        ("q_positions", q_positions, q_positions_offset),
        ("k_positions", k_positions, k_positions_offset),
    ):
        if tensor is not None or offset is not None:  # absent: the record's default positions
            rope[key] = tensor if tensor is not None else offset
    return rope


def _relative_bias_to_schema(relative_bias) -> tuple:
    defaults = RelativeBias._field_defaults
    if relative_bias is not None:
        RelativeBias.check_keys(relative_bias)
    bias = relative_bias or {}
    num_buckets, max_distance, bidirectional = (
        bias.get(key, defaults[key]) for key in RelativeBias._fields[1:]
    )
    return (
        bias.get("table"),
        _schema_int("relative_bias['num_buckets']", num_buckets),
        _schema_int("relative_bias['max_distance']", max_distance),
        _plain(bidirectional),
    )


def _relative_bias_from_schema(table, num_buckets, max_distance, bidirectional):
    if table is None:
        return None
    return {
        "table": table,
        "num_buckets": num_buckets,
        "max_distance": max_distance,
        "bidirectional": bidirectional,
    }


def _attention_schema(
    q,
    *,
    causal,
    causal_alignment,
    mask,
    key_lengths,
    scale,
    rope,
    alibi_slopes,
    relative_bias,
    window=None,
    softcap=None,
    sinks=None,
) -> tuple:
    """The public keyword options as attention_op's schema arguments after (q, k, v), before the
    backend (``_ATTENTION_OPTIONS``' order)."""
    window_left, window_right, softcap = window_and_softcap(window, softcap)
    return (
        causal,
        causal_alignment,
        mask,
        key_lengths,
        None if scale is None else float(scale),
        *_rope_to_schema(rope, q.device),
        alibi_slopes,
        *_relative_bias_to_schema(relative_bias),
        window_left,
        window_right,
        softcap,
        sinks,
    )


def call_attention(q, k, v, *, return_lse, backend, **options):
    schema = _attention_schema(q, **options)
    out, lse = attention_op(q, k, v, *schema, backend or "")
    return (out, lse) if return_lse else out


def call_attention_backward(grad_out, grad_lse, q, k, v, out, lse, *, backend, **options):
    """(dq, dk, dv) of ``attention(q, k, v, **options)`` given its (out, lse) and their gradients.
    ``out``/``lse`` need not come from this call: with the rows of a larger attention's result
    (the same queries over more keys), the result is that attention's gradient restricted to
    these keys, which is how the ring backward (fastpe.distributed) splits one backward."""
    schema = _attention_schema(q, **options)
    dq, dk, dv, _, _ = attention_backward_op(
        grad_out, grad_lse, q, k, v, out, lse, *schema, backend or ""
    )
    return dq, dk, dv
