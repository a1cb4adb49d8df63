"""``fastpe::attention`` and its backward ``attention_backward`` (docs/math.md#attention-backward),
with the one place where attention's structured options meet the op schema, which takes only
flat typed arguments: the options every attention op shares come flattened by
``AttentionOptions`` (its ``SCHEMA``, ``flatten`` and ``unflatten``), the dense-only ones
(``mask``, ``key_lengths``, the ``relative_bias=`` dict) by this module."""

from __future__ import annotations

import torch

from fastpe import dispatch
from fastpe._inputs import AttentionBackwardInputs, AttentionInputs
from fastpe._options import AttentionOptions, RelativeBias
from fastpe.torch_ops._common import (
    _backend,
    _plain,
    _schema_int,
    refuse_no_gradient,
    refuse_second_derivative,
    register_autograd,
    schema_names,
)

# Everything between (q, k, v) and the backend in both ops' schemas: the dense-only arguments,
# then the shared options.
_ARGUMENTS = (
    "Tensor? mask, Tensor? key_lengths, Tensor? relative_bias_table, "
    "int relative_bias_num_buckets, int relative_bias_max_distance, "
    f"bool relative_bias_bidirectional, {AttentionOptions.SCHEMA}"
)
_NAMES = schema_names(_ARGUMENTS)
_DENSE = len(_NAMES) - len(AttentionOptions.SCHEMA_NAMES)  # the dense-only arguments
# inputs that get no gradient (docs/README.md#training): asking for one is an error
_NO_GRADIENT = {
    3 + _NAMES.index(name): name for name in ("mask", "rope_cos", "rope_sin", "alibi_slopes")
}


def _attention_inputs(q, k, v, arguments) -> AttentionInputs:
    """The validated forward record of the schema's ``_ARGUMENTS`` (with lse: the backward
    needs it)."""
    mask, key_lengths, *bias = arguments[:_DENSE]
    return AttentionInputs.build(
        q,
        k,
        v,
        mask=mask,
        key_lengths=key_lengths,
        relative_bias=_relative_bias_from_schema(*bias),
        return_lse=True,
        **AttentionOptions.unflatten(arguments[_DENSE:]),
    )


@torch.library.custom_op(
    "fastpe::attention",
    mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, {_ARGUMENTS}, str backend) -> (Tensor, Tensor)",
)
def attention_op(q, k, v, *arguments):
    *arguments, backend = arguments
    out, lse = dispatch.run(_attention_inputs(q, k, v, arguments), _backend(backend))
    return out, lse


@attention_op.register_fake
def _(q, k, v, *args):
    b, hq, sq, _ = q.shape
    return q.new_empty((b, hq, sq, v.shape[3])), q.new_empty((b, hq, sq), dtype=torch.float32)


@torch.library.custom_op(
    "fastpe::attention_backward",
    mutates_args=(),
    schema=(
        "(Tensor grad_out, Tensor grad_lse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        f"{_ARGUMENTS}, str backend) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
)
def attention_backward_op(grad_out, grad_lse, q, k, v, out, lse, *arguments):
    """(dq, dk, dv, dsinks, d relative_bias_table) of one attention_op call; the last two are
    empty when the call had no sinks / no table."""
    *arguments, backend = arguments
    inputs = AttentionBackwardInputs.build(
        _attention_inputs(q, k, v, arguments),
        grad_out=grad_out,
        grad_lse=grad_lse,
        out=out,
        lse=lse,
    )
    dq, dk, dv, dsinks, dtable = dispatch.run(inputs, _backend(backend))
    if dsinks is None:
        dsinks = q.new_empty((0,))
    if dtable is None:
        dtable = q.new_empty((0, 0))
    return dq, dk, dv, dsinks, dtable


@attention_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, *args):
    named = dict(zip(_NAMES, args, strict=False))
    sinks, table = named["sinks"], named["relative_bias_table"]
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
        q.new_empty((0,)) if sinks is None else torch.empty_like(sinks),
        q.new_empty((0, 0)) if table is None else torch.empty_like(table),
    )


def _attention_backward(ctx, grad_out, grad_lse):
    refuse_no_gradient(ctx, "attention", _NO_GRADIENT)
    q, k, v, *arguments = ctx.args
    out, lse = ctx.outputs
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dsinks, dtable = attention_backward_op(
        grad_out, grad_lse, q, k, v, out, lse, *arguments, ctx.backend
    )
    named = dict(zip(_NAMES, arguments, strict=True))
    grads = {
        "sinks": dsinks if named["sinks"] is not None else None,
        "relative_bias_table": dtable if named["relative_bias_table"] is not None else None,
    }
    return (dq, dk, dv, *(grads.get(name) for name in _NAMES), None)


register_autograd("attention", _attention_backward, save_outputs=True)
refuse_second_derivative("attention_backward")


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


def _attention_schema(q, *, mask=None, key_lengths=None, relative_bias=None, **options) -> tuple:
    """The public keyword options as the schema's ``_ARGUMENTS``."""
    return (
        mask,
        key_lengths,
        *_relative_bias_to_schema(relative_bias),
        *AttentionOptions.flatten(q.device, **options),
    )


def call_attention(q, k, v, *, return_lse, backend, **options):
    out, lse = attention_op(q, k, v, *_attention_schema(q, **options), backend or "")
    return (out, lse) if return_lse else out


def call_attention_backward(grad_out, grad_lse, q, k, v, out, lse, *, backend, **options):
    """(dq, dk, dv) of ``attention(q, k, v, **options)`` given its (out, lse) and their gradients.
    ``out``/``lse`` need not come from this call: with the rows of a larger attention's result
    (the same queries over more keys), the result is that attention's gradient restricted to
    these keys, which is how the ring backward (fastpe.distributed) splits one backward."""
    dq, dk, dv, _, _ = attention_backward_op(
        grad_out, grad_lse, q, k, v, out, lse, *_attention_schema(q, **options), backend or ""
    )
    return dq, dk, dv
