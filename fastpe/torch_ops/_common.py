"""What every op module of ``fastpe.torch_ops`` shares: the schema's conversions of public
arguments (NumPy scalars, int64 bounds; the option records flatten themselves, as
``Positions.flatten`` and ``AttentionOptions.flatten``) and the one autograd pattern
(``register_autograd``), so no op carries its own copy of either."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from fastpe import dispatch
from fastpe._validate import check_int

_SECOND_DERIVATIVE = (
    "fastpe computes first-order gradients of attention, not second derivatives (double "
    "backward, e.g. gradient penalties). Use an attention implementation that supports them "
    "(e.g. 'eager') for that."
)


def _no_backward(op_name: str, why: str = _SECOND_DERIVATIVE):
    """A backward that raises (the backward ops themselves by default: differentiating a
    gradient) instead of returning a wrong or missing gradient."""

    def backward(ctx, *grads):
        raise RuntimeError(f"fastpe.{op_name} has no backward: {why}")

    return backward


def refuse_second_derivative(op_name: str) -> None:
    """Register ``_no_backward`` for a backward op, whose own gradient fastpe does not give."""
    torch.library.register_autograd(f"fastpe::{op_name}", _no_backward(op_name))


def _backend(name: str):
    return name or None


# ---------------------------------------------------------------------------------------------
# Backward passes. Every differentiable op follows one pattern:
# - its backward kernels are a custom op of their own, ``fastpe::<op>_backward`` with a fake
#   implementation, so torch.compile and opcheck see the backward as one opaque op as well;
# - ``register_autograd`` gives it the shared setup_context: the forward's arguments (all but
#   the trailing backend) and, if asked, its outputs are saved, tensors through
#   ``ctx.save_for_backward`` and other values as they are, with the backend in force;
# - the op's own backward reads them back as ``ctx.args`` / ``ctx.outputs``, refuses inputs that
#   need a gradient the op does not give (``_refuse_grad`` / ``refuse_no_gradient``), calls
#   ``fastpe::<op>_backward`` for the inputs in ``ctx.needs_input_grad`` and returns one entry
#   per forward argument (None for the rest).


def register_autograd(op_name: str, backward, *, save=None, save_outputs: bool = False) -> None:
    """Register ``backward(ctx, *grads)`` for ``fastpe::<op_name>`` with the shared
    setup_context. ``save``: the argument indices the backward reads (default: all); the others
    are dropped, so a large input the backward never reads (apply_rope's x) is not kept alive."""

    def setup_context(ctx, inputs, output):
        *args, backend = inputs
        if save is not None:
            args = [a if i in save else None for i, a in enumerate(args)]
        outputs = list(output) if save_outputs else []
        values = [*args, *outputs]
        ctx.is_tensor = [isinstance(x, Tensor) for x in values]
        ctx.constants = [None if t else x for x, t in zip(values, ctx.is_tensor, strict=True)]
        ctx.num_args = len(args)
        ctx.backend = _forward_backend(backend)
        ctx.save_for_backward(*(x for x, t in zip(values, ctx.is_tensor, strict=True) if t))

    def restored_backward(ctx, *grads):
        saved = iter(ctx.saved_tensors)
        values = [
            next(saved) if t else c for t, c in zip(ctx.is_tensor, ctx.constants, strict=True)
        ]
        ctx.args, ctx.outputs = values[: ctx.num_args], values[ctx.num_args :]
        return backward(ctx, *grads)

    torch.library.register_autograd(
        f"fastpe::{op_name}", restored_backward, setup_context=setup_context
    )


def _refuse_grad(ctx, op_name: str, constants: Mapping[int, str]) -> None:
    """A RuntimeError, as torch's own "derivative not implemented", when an input fastpe treats
    as a constant (``constants``: argument index -> name) needs a gradient."""
    asked = [name for index, name in constants.items() if _needs(ctx.needs_input_grad[index])]
    if asked:
        raise RuntimeError(
            f"fastpe.{op_name} has no gradient w.r.t. {' and '.join(asked)} (treated as constants; "
            "docs/math.md#gradients); detach them (e.g. tables built under torch.no_grad()) or "
            "compute that path with plain torch ops"
        )


def refuse_no_gradient(ctx, op_name: str, constants: Mapping[int, str]) -> None:
    """The attention ops' refusal (docs/README.md#training) of a gradient for an input they
    give none (``constants``: argument index -> name)."""
    for index, name in constants.items():
        if ctx.needs_input_grad[index]:
            raise RuntimeError(
                f"fastpe.{op_name} gives no gradient for {name} (docs/README.md#training); "
                f"pass it detached (.detach()) or compute it outside {op_name}"
            )


def _needs(flag) -> bool:
    return any(flag) if isinstance(flag, (list, tuple)) else bool(flag)


def _forward_backend(backend: str) -> str:
    """The explicit choice in force at the forward call (``backend=``, ``use_backend``,
    $FASTPE_BACKEND), kept for the backward, which may run outside a ``use_backend`` block."""
    return backend or dispatch.requested_backend(None) or ""


# ---------------------------------------------------------------------------------------------
# Public values -> schema arguments. Only what the schema's types would otherwise turn into
# torch's own errors (naming the schema's argument, not the caller's) is checked here; the rest
# is validated once, by the inputs record the op's real implementation builds.


def _plain(value):
    """NumPy scalars and 0-dim arrays -> Python scalars (the schema takes int/float/bool, not
    np.int64; the eager path reads a 0-dim integer array as an int too)."""
    if isinstance(value, np.generic) or isinstance(value, np.ndarray) and value.ndim == 0:
        return value.item()
    return value


def _schema_int(name: str, value) -> int:
    """An integer argument checked by name before it enters an int64 schema argument, for
    which torch's own error would name the schema's argument, not the caller's."""
    value = check_int(name, value)
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{name} must lie in the int64 range [-2**63, 2**63); got {value}")
    return value


def schema_names(arguments: str) -> tuple[str, ...]:
    """The argument names of a schema fragment ("Tensor? mask, int window_left, ...")."""
    return tuple(argument.split()[-1] for argument in arguments.split(", "))


def _torch_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, str(dtype).removeprefix("torch."))
