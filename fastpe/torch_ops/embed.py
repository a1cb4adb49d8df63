"""``fastpe::embed`` (token embedding + positional encoding) and its backward
``embed_backward``: scatter-adds into the tables (docs/math.md#gradients)."""

from __future__ import annotations

import torch

from fastpe import dispatch
from fastpe._inputs import EmbedBackwardInputs, EmbedInputs
from fastpe._options import Positions
from fastpe.torch_ops._common import _backend, register_autograd, schema_names

# The forward's arguments, the first in both ops' schemas (the backward rebuilds the forward's
# record from them)
_ARGUMENTS = (
    "Tensor ids, Tensor weight, Tensor? positions, int offset, str pe, Tensor? pe_table, "
    "float scale, float base, str layout, str freq, Tensor? token_type_ids, "
    "Tensor? token_type_weight"
)
_NAMES = schema_names(_ARGUMENTS)
# weight, pe_table and token_type_weight: the arguments that get a gradient (ids, positions and
# token types are integers; the sinusoidal PE has no parameters)
_TABLES = tuple(_NAMES.index(name) for name in ("weight", "pe_table", "token_type_weight"))


def _embed_inputs(arguments) -> EmbedInputs:
    """The validated forward record of the schema's ``_ARGUMENTS``."""
    named = dict(zip(_NAMES, arguments, strict=True))
    ids, weight = named.pop("ids"), named.pop("weight")
    positions = Positions.unflatten(named.pop("positions"), named.pop("offset"))
    pe = named.pop("pe") or None
    return EmbedInputs.build(ids, weight, positions=positions, pe=pe, **named)


@torch.library.custom_op(
    "fastpe::embed", mutates_args=(), schema=f"({_ARGUMENTS}, str backend) -> Tensor"
)
def embed_op(*arguments):
    *arguments, backend = arguments
    return dispatch.run(_embed_inputs(arguments), _backend(backend))


@embed_op.register_fake
def _(ids, weight, *_):
    return weight.new_empty((ids.shape[0], ids.shape[1], weight.shape[1]))


@torch.library.custom_op(
    "fastpe::embed_backward",
    mutates_args=(),
    schema=(
        f"(Tensor grad, {_ARGUMENTS}, bool need_weight, bool need_pe_table, "
        "bool need_token_type_weight, str backend) -> Tensor[]"
    ),
)
def embed_backward_op(grad, *arguments):
    """The gradients of ``embed`` w.r.t. weight, pe_table and token_type_weight (those asked
    for, in that order): scatter-adds of ``grad`` over ids / positions / token types."""
    *arguments, need_weight, need_pe_table, need_token_type_weight, backend = arguments
    inputs = EmbedBackwardInputs.build(
        _embed_inputs(arguments),
        grad,
        weight=need_weight,
        pe_table=need_pe_table,
        token_type_weight=need_token_type_weight,
    )
    grads = dispatch.run(inputs, _backend(backend))
    return [g for g in grads if g is not None]


@embed_backward_op.register_fake
def _(grad, *arguments):
    *arguments, need_weight, need_pe_table, need_token_type_weight, _ = arguments
    tables = [arguments[i] for i in _TABLES]
    return [
        torch.empty_like(t, memory_format=torch.contiguous_format)
        for need, t in zip(
            (need_weight, need_pe_table, need_token_type_weight), tables, strict=True
        )
        if need and t is not None
    ]


def _embed_backward(ctx, grad):
    wanted = [bool(ctx.needs_input_grad[i]) for i in _TABLES]
    grads = [None] * (len(_NAMES) + 1)  # and the backend's
    if not any(wanted):
        return tuple(grads)
    found = iter(embed_backward_op(grad, *ctx.args, *wanted, ctx.backend))
    for index, want in zip(_TABLES, wanted, strict=True):
        if want:
            grads[index] = next(found)
    return tuple(grads)


register_autograd("embed", _embed_backward)


def call_embed(ids, weight, *, positions, pe, scale, base, backend, **as_given):
    """``embed``'s public arguments in the schema's order (``as_given``: pe_table, layout, freq,
    token_type_ids, token_type_weight, passed as they are)."""
    tensor, offset = Positions.flatten("positions", positions, weight.device)
    named = dict(
        as_given,
        ids=ids,
        weight=weight,
        positions=tensor,
        offset=offset or 0,
        pe=pe or "",
        scale=float(scale),
        base=float(base),
    )
    return embed_op(*(named[name] for name in _NAMES), backend or "")
