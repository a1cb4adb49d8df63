"""``fastpe::apply_rope`` / ``apply_rope_group`` and their backward ``apply_rope_backward``
(the gradient w.r.t. x: the output's gradient rotated by -θ, docs/math.md#gradients)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from fastpe import dispatch
from fastpe._inputs import ApplyRopeInputs
from fastpe._options import Positions
from fastpe.torch_ops._common import _backend, _refuse_grad, register_autograd

# The rotation: everything after the rotated tensor(s) in the three ops' schemas
_ROTATION = (
    "Tensor cos, Tensor sin, Tensor? positions, int offset, bool interleaved, str layout, "
    "str backend"
)


@torch.library.custom_op(
    "fastpe::apply_rope", mutates_args=(), schema=f"(Tensor x, {_ROTATION}) -> Tensor"
)
def apply_rope_op(x, *rotation):
    *rotation, backend = rotation
    return dispatch.run(_rope_inputs(x, *rotation), _backend(backend))


@apply_rope_op.register_fake
def _(x, *_):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op(
    "fastpe::apply_rope_group", mutates_args=(), schema=f"(Tensor[] xs, {_ROTATION}) -> Tensor[]"
)
def apply_rope_group_op(xs, *rotation):
    """``apply_rope((q, k), ...)``: the tensors of one call in one op (one launch on Triton)."""
    return _rotate_group(xs, rotation, inverse=False)


@apply_rope_group_op.register_fake
def _(xs, *_):
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]


@torch.library.custom_op(
    "fastpe::apply_rope_backward",
    mutates_args=(),
    schema=f"(Tensor[] grads, {_ROTATION}) -> Tensor[]",
)
def apply_rope_backward_op(grads, *rotation):
    """The gradients w.r.t. x of ``apply_rope`` / ``apply_rope_group``: each output gradient
    rotated by -θ (docs/math.md#gradients), all of them in one kernel call."""
    return _rotate_group(grads, rotation, inverse=True)


@apply_rope_backward_op.register_fake
def _(grads, *_):
    return [torch.empty_like(g, memory_format=torch.contiguous_format) for g in grads]


def _rope_inputs(x, cos, sin, positions, offset, interleaved, layout):
    """The record of one rotation from the schema's arguments (the op returns a new tensor)."""
    return ApplyRopeInputs.build(
        x,
        cos,
        sin,
        positions=Positions.unflatten(positions, offset),
        interleaved=interleaved,
        layout=layout,
        inplace=False,
    )


def _rotate_group(xs, rotation, *, inverse):
    *rotation, backend = rotation
    first = _rope_inputs(xs[0], *rotation)
    if inverse:
        first = dataclasses.replace(first, inverse=True)
    group = [first, *(first.with_x(x) for x in xs[1:])]
    return list(dispatch.run_group(group, _backend(backend)))


# The three rope ops share a schema after their first argument; the backward reads the table,
# the positions and the options, never the rotated tensors (argument 0, not kept alive).
_ROPE_SAVED = frozenset(range(1, 7))


def _rotation(ctx) -> tuple:
    """(cos, sin, positions, offset, interleaved, layout, backend) of the forward call."""
    return (*ctx.args[1:], ctx.backend)


def _rotated_back(ctx, grads: list[Tensor]) -> list[Tensor | None]:
    """The gradients of the rotated tensors that need one (None for the others), in one call."""
    _refuse_grad(ctx, "apply_rope", {1: "cos", 2: "sin"})
    need = ctx.needs_input_grad[0]
    need = list(need) if isinstance(need, (list, tuple)) else [need]
    if not any(need):
        return [None] * len(need)
    asked = [g for g, n in zip(grads, need, strict=True) if n]
    found = iter(apply_rope_backward_op(asked, *_rotation(ctx)))
    return [next(found) if n else None for n in need]


def _rope_backward(ctx, grad):
    return (_rotated_back(ctx, [grad])[0],) + (None,) * 7


def _rope_group_backward(ctx, grads):
    return (_rotated_back(ctx, grads),) + (None,) * 7


def _rope_double_backward(ctx, grads):
    # the backward is linear in its gradients: its own backward is the forward rotation
    _refuse_grad(ctx, "apply_rope", {1: "cos", 2: "sin"})
    return (apply_rope_group_op(list(grads), *_rotation(ctx)),) + (None,) * 7


register_autograd("apply_rope", _rope_backward, save=_ROPE_SAVED)
register_autograd("apply_rope_group", _rope_group_backward, save=_ROPE_SAVED)
register_autograd("apply_rope_backward", _rope_double_backward, save=_ROPE_SAVED)


def call_apply_rope(x, cos, sin, *, positions, interleaved, layout, inplace, backend):
    tensor, offset = Positions.flatten("positions", positions, x.device)
    out = apply_rope_op(x, cos, sin, tensor, offset or 0, interleaved, layout, backend or "")
    return x.copy_(out) if inplace else out


def call_apply_rope_group(xs, cos, sin, *, positions, interleaved, layout, inplace, backend):
    tensor, offset = Positions.flatten("positions", positions, xs[0].device)
    outs = apply_rope_group_op(
        list(xs), cos, sin, tensor, offset or 0, interleaved, layout, backend or ""
    )
    return tuple(x.copy_(out) for x, out in zip(xs, outs, strict=True)) if inplace else tuple(outs)
