"""``fastpe::merge_attention`` (two attention results over disjoint keys -> their union) and its
backward ``merge_attention_backward`` (docs/math.md#merge-gradients)."""

from __future__ import annotations

import torch
from torch import Tensor

from fastpe import dispatch
from fastpe._inputs import MergeAttentionBackwardInputs, MergeAttentionInputs
from fastpe.torch_ops._common import _backend, refuse_second_derivative, register_autograd


@torch.library.custom_op("fastpe::merge_attention", mutates_args=())
def merge_attention_op(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, backend: str
) -> tuple[Tensor, Tensor]:
    out, lse = dispatch.run(
        MergeAttentionInputs.build(out_a, lse_a, out_b, lse_b), _backend(backend)
    )
    return out, lse


@merge_attention_op.register_fake
def _(out_a, lse_a, out_b, lse_b, backend):
    return torch.empty_like(out_a), torch.empty_like(lse_a, dtype=torch.float32)


@torch.library.custom_op("fastpe::merge_attention_backward", mutates_args=())
def merge_attention_backward_op(
    grad_out: Tensor,
    grad_lse: Tensor,
    out_a: Tensor,
    lse_a: Tensor,
    out_b: Tensor,
    lse_b: Tensor,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d out_a, d lse_a, d out_b, d lse_b) of ``merge_attention`` (docs/math.md#merge-gradients)."""
    forward = MergeAttentionInputs.build(out_a, lse_a, out_b, lse_b)
    inputs = MergeAttentionBackwardInputs.build(forward, grad_out, grad_lse)
    return tuple(dispatch.run(inputs, _backend(backend)))


@merge_attention_backward_op.register_fake
def _(grad_out, grad_lse, out_a, lse_a, out_b, lse_b, backend):
    return tuple(
        torch.empty_like(t, memory_format=torch.contiguous_format)
        for t in (out_a, lse_a, out_b, lse_b)
    )


def _merge_backward(ctx, grad_out, grad_lse):
    out_a, lse_a, out_b, lse_b = ctx.args
    if grad_out is None:
        grad_out = torch.zeros_like(out_a)
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse_a, dtype=torch.float32)
    grads = merge_attention_backward_op(
        grad_out.to(out_a.dtype), grad_lse, out_a, lse_a, out_b, lse_b, ctx.backend
    )
    return (
        *(g if need else None for g, need in zip(grads, ctx.needs_input_grad, strict=False)),
        None,
    )


register_autograd("merge_attention", _merge_backward)
refuse_second_derivative("merge_attention_backward")


def call_merge_attention(out_a, lse_a, out_b, lse_b, *, backend):
    return merge_attention_op(out_a, lse_a, out_b, lse_b, backend or "")
