"""``fastpe::embed`` (token embedding + positional encoding) and its backward
``embed_backward``: scatter-adds into the tables (docs/math.md#gradients)."""

from __future__ import annotations

import torch
from torch import Tensor

from fastpe import dispatch
from fastpe._inputs import EmbedBackwardInputs, EmbedInputs
from fastpe._options import Positions
from fastpe.torch_ops._common import _backend, register_autograd


@torch.library.custom_op("fastpe::embed", mutates_args=())
def embed_op(
    ids: Tensor,
    weight: Tensor,
    positions: Tensor | None,
    offset: int,
    pe: str,
    pe_table: Tensor | None,
    scale: float,
    base: float,
    layout: str,
    freq: str,
    token_type_ids: Tensor | None,
    token_type_weight: Tensor | None,
    backend: str,
) -> Tensor:
    inputs = _embed_inputs(
        ids,
        weight,
        positions,
        offset,
        pe,
        pe_table,
        scale,
        token_type_ids,
        token_type_weight,
        base=base,
        layout=layout,
        freq=freq,
    )
    return dispatch.run(inputs, _backend(backend))


@embed_op.register_fake
def _(ids, weight, *_):
    return weight.new_empty((ids.shape[0], ids.shape[1], weight.shape[1]))


@torch.library.custom_op("fastpe::embed_backward", mutates_args=())
def embed_backward_op(
    grad: Tensor,
    ids: Tensor,
    weight: Tensor,
    positions: Tensor | None,
    offset: int,
    pe: str,
    pe_table: Tensor | None,
    scale: float,
    token_type_ids: Tensor | None,
    token_type_weight: Tensor | None,
    need_weight: bool,
    need_pe_table: bool,
    need_token_type_weight: bool,
    backend: str,
) -> list[Tensor]:
    """The gradients of ``embed`` w.r.t. weight, pe_table and token_type_weight (those asked
    for, in that order): scatter-adds of ``grad`` over ids / positions / token types."""
    # the gradients do not depend on the sinusoidal encoding's options: any valid ones do
    forward = _embed_inputs(
        ids,
        weight,
        positions,
        offset,
        pe,
        pe_table,
        scale,
        token_type_ids,
        token_type_weight,
        base=10000.0,
        layout="interleaved",
        freq="paper",
    )
    inputs = EmbedBackwardInputs.build(
        forward,
        grad,
        weight=need_weight,
        pe_table=need_pe_table,
        token_type_weight=need_token_type_weight,
    )
    grads = dispatch.run(inputs, _backend(backend))
    return [g for g in grads if g is not None]


def _embed_inputs(
    ids, weight, positions, offset, pe, pe_table, scale, tt_ids, tt_weight, **pe_options
):
    """The forward's record from the schema's arguments (``pe_options``: base, layout, freq)."""
    return EmbedInputs.build(
        ids,
        weight,
        positions=Positions.unflatten(positions, offset),
        pe=pe or None,
        pe_table=pe_table,
        scale=scale,
        token_type_ids=tt_ids,
        token_type_weight=tt_weight,
        **pe_options,
    )


@embed_backward_op.register_fake
def _(
    grad,
    ids,
    weight,
    positions,
    offset,
    pe,
    pe_table,
    scale,
    token_type_ids,
    token_type_weight,
    need_weight,
    need_pe_table,
    need_token_type_weight,
    backend,
):
    tables = (
        (need_weight, weight),
        (need_pe_table, pe_table),
        (need_token_type_weight, token_type_weight),
    )
    return [
        torch.empty_like(t, memory_format=torch.contiguous_format)
        for need, t in tables
        if need and t is not None
    ]


# weight, pe_table and token_type_weight: the arguments that get a gradient (ids, positions and
# token types are integers; the sinusoidal PE has no parameters)
_TABLES = (1, 5, 11)


def _embed_backward(ctx, grad):
    wanted = [ctx.needs_input_grad[i] for i in _TABLES]
    grads = [None] * 13
    if not any(wanted):
        return tuple(grads)
    ids, weight, positions, offset, pe, pe_table, scale, _, _, _, tt_ids, tt_weight = ctx.args
    found = iter(
        embed_backward_op(
            grad,
            ids,
            weight,
            positions,
            offset,
            pe,
            pe_table,
            scale,
            tt_ids,
            tt_weight,
            *(bool(w) for w in wanted),
            ctx.backend,
        )
    )
    for index, want in zip(_TABLES, wanted, strict=True):
        if want:
            grads[index] = next(found)
    return tuple(grads)


register_autograd("embed", _embed_backward)


def call_embed(
    ids,
    weight,
    *,
    positions,
    pe,
    pe_table,
    scale,
    base,
    layout,
    freq,
    token_type_ids,
    token_type_weight,
    backend,
):
    tensor, offset = Positions.flatten("positions", positions, weight.device)
    return embed_op(
        ids,
        weight,
        tensor,
        offset or 0,
        pe or "",
        pe_table,
        float(scale),
        float(base),
        layout,
        freq,
        token_type_ids,
        token_type_weight,
        backend or "",
    )
