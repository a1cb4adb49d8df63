"""fastpe's ops as torch custom ops (``torch.ops.fastpe.*``), so torch.compile traces through them.

Imported only when a torch tensor meets a fastpe op under ``torch.compile`` or with autograd
recording (never by ``import fastpe``). Each op's real implementation is the ordinary validated,
dispatched fastpe op (CPU -> Numba, CUDA -> Triton), run eagerly at execution time; its fake
implementation gives shapes and dtypes for tracing. Options that are dicts or unions in the public
API (``rope``, ``relative_bias``, ``positions``) are flattened into typed arguments here.

``apply_rope``, ``embed``, ``attention``, ``attention_varlen`` and ``merge_attention`` have
backward passes (``torch.library.register_autograd``, the pattern below ``_register_backward``;
docs/math.md#gradients, #attention-backward and #merge-gradients). ``attention_kvcache`` writes
into its caches (declared ``mutates_args``) and has no backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from fastpe import dispatch
from fastpe._inputs import (
    ApplyRopeInputs,
    AttentionBackwardInputs,
    AttentionInputs,
    EmbedBackwardInputs,
    EmbedInputs,
    MergeAttentionBackwardInputs,
    MergeAttentionInputs,
    RopeTableInputs,
    SinusoidalTableInputs,
    check_window,
)
from fastpe._options import RelativeBias, Rope
from fastpe._validate import check_bool, check_float, check_int, check_position

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


def _positions(tensor: Tensor | None, offset: int):
    """The schema's (tensor or None, offset) -> the public ``positions`` value."""
    return offset if tensor is None else tensor


def _backend(name: str):
    return name or None


# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("fastpe::sinusoidal_table", mutates_args=())
def sinusoidal_table_op(
    num_positions: int, dim: int, base: float, layout: str, freq: str, offset: int,
    dtype: torch.dtype, device: torch.device, backend: str,
) -> Tensor:  # fmt: skip
    inputs = SinusoidalTableInputs.build(
        num_positions,
        dim,
        base=base,
        layout=layout,
        freq=freq,
        offset=offset,
        dtype=dtype,
        device=device,
    )
    return dispatch.run(inputs, _backend(backend))


@sinusoidal_table_op.register_fake
def _(num_positions, dim, base, layout, freq, offset, dtype, device, backend):
    return torch.empty((num_positions, dim), dtype=dtype, device=device)


@torch.library.custom_op("fastpe::rope_table", mutates_args=())
def rope_table_op(
    num_positions: int, rotary_dim: int, base: float, scaling_layout: str,
    scaling_numbers: Tensor, offset: int,
    dtype: torch.dtype, device: torch.device, backend: str,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    scaling = _scaling_from_schema(scaling_layout, scaling_numbers)
    inputs = RopeTableInputs.build(
        num_positions,
        rotary_dim,
        base=base,
        scaling=scaling,
        offset=offset,
        dtype=dtype,
        device=device,
    )
    cos, sin = dispatch.run(inputs, _backend(backend))
    return cos, sin


@rope_table_op.register_fake
def _(num_positions, rotary_dim, base, scaling_layout, scaling_numbers, offset, dtype, device,
      backend):  # fmt: skip
    shape = (num_positions, rotary_dim // 2)
    return torch.empty(shape, dtype=dtype, device=device), torch.empty(
        shape, dtype=dtype, device=device
    )


# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("fastpe::apply_rope", mutates_args=())
def apply_rope_op(
    x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None, offset: int, interleaved: bool,
    layout: str, backend: str,
) -> Tensor:  # fmt: skip
    inputs = ApplyRopeInputs.build(
        x, cos, sin, positions=_positions(positions, offset), interleaved=interleaved, layout=layout,
        inplace=False,
    )  # fmt: skip
    return dispatch.run(inputs, _backend(backend))


@apply_rope_op.register_fake
def _(x, cos, sin, positions, offset, interleaved, layout, backend):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("fastpe::apply_rope_group", mutates_args=())
def apply_rope_group_op(
    xs: list[Tensor], cos: Tensor, sin: Tensor, positions: Tensor | None, offset: int,
    interleaved: bool, layout: str, backend: str,
) -> list[Tensor]:  # fmt: skip
    """``apply_rope((q, k), ...)``: the tensors of one call in one op (one launch on Triton)."""
    return _rotate_group(xs, cos, sin, positions, offset, interleaved, layout, backend, False)


@apply_rope_group_op.register_fake
def _(xs, cos, sin, positions, offset, interleaved, layout, backend):
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]


@torch.library.custom_op("fastpe::apply_rope_backward", mutates_args=())
def apply_rope_backward_op(
    grads: list[Tensor], cos: Tensor, sin: Tensor, positions: Tensor | None, offset: int,
    interleaved: bool, layout: str, backend: str,
) -> list[Tensor]:  # fmt: skip
    """The gradients w.r.t. x of ``apply_rope`` / ``apply_rope_group``: each output gradient
    rotated by -θ (docs/math.md#gradients), all of them in one kernel call."""
    return _rotate_group(grads, cos, sin, positions, offset, interleaved, layout, backend, True)


@apply_rope_backward_op.register_fake
def _(grads, cos, sin, positions, offset, interleaved, layout, backend):
    return [torch.empty_like(g, memory_format=torch.contiguous_format) for g in grads]


def _rotate_group(xs, cos, sin, positions, offset, interleaved, layout, backend, inverse):
    first = ApplyRopeInputs.build(
        xs[0], cos, sin, positions=_positions(positions, offset), interleaved=interleaved,
        layout=layout, inplace=False,
    )  # fmt: skip
    if inverse:
        first = dataclasses.replace(first, inverse=True)
    group = [first, *(first.with_x(x) for x in xs[1:])]
    return list(dispatch.run_group(group, _backend(backend)))


# Backward passes. Every differentiable op follows this pattern (the attention backward too):
# - its backward kernels are a custom op of their own, ``fastpe::<op>_backward`` with a fake
#   implementation, so torch.compile and opcheck see the backward as one opaque op as well;
# - ``setup_context(ctx, inputs, output)`` saves what the backward reads (tensors through
#   ``ctx.save_for_backward``, options as ctx attributes);
# - ``backward(ctx, *grads)`` first calls ``_refuse_grad`` for inputs that need a gradient the op
#   does not give, then calls ``fastpe::<op>_backward`` for the inputs in
#   ``ctx.needs_input_grad`` and returns one entry per forward argument (None for the rest);
# - ``_register_backward("<op>", setup_context, backward)`` replaces ``_no_backward``.


def _register_backward(op_name: str, setup_context, backward) -> None:
    torch.library.register_autograd(f"fastpe::{op_name}", backward, setup_context=setup_context)


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


def _needs(flag) -> bool:
    return any(flag) if isinstance(flag, (list, tuple)) else bool(flag)


def _forward_backend(backend: str) -> str:
    """The explicit choice in force at the forward call (``backend=``, ``use_backend``,
    $FASTPE_BACKEND), kept for the backward, which may run outside a ``use_backend`` block."""
    return backend or dispatch.requested_backend(None) or ""


def _setup_rope(ctx, inputs, output):
    _, cos, sin, positions, offset, interleaved, layout, backend = inputs
    ctx.save_for_backward(cos, sin, positions)
    ctx.options = (offset, interleaved, layout, _forward_backend(backend))


def _rotated_back(ctx, grads: list[Tensor]) -> list[Tensor | None]:
    """The gradients of the rotated tensors that need one (None for the others), in one call."""
    _refuse_grad(ctx, "apply_rope", {1: "cos", 2: "sin"})
    need = ctx.needs_input_grad[0]
    need = list(need) if isinstance(need, (list, tuple)) else [need]
    if not any(need):
        return [None] * len(need)
    cos, sin, positions = ctx.saved_tensors
    asked = [g for g, n in zip(grads, need, strict=True) if n]
    found = iter(apply_rope_backward_op(asked, cos, sin, positions, *ctx.options))
    return [next(found) if n else None for n in need]


def _rope_backward(ctx, grad):
    return (_rotated_back(ctx, [grad])[0],) + (None,) * 7


def _rope_group_backward(ctx, grads):
    return (_rotated_back(ctx, grads),) + (None,) * 7


_register_backward("apply_rope", _setup_rope, _rope_backward)
_register_backward("apply_rope_group", _setup_rope, _rope_group_backward)


def _rope_double_backward(ctx, grads):
    # the backward is linear in its gradients: its own backward is the forward rotation
    _refuse_grad(ctx, "apply_rope", {1: "cos", 2: "sin"})
    cos, sin, positions = ctx.saved_tensors
    return (apply_rope_group_op(list(grads), cos, sin, positions, *ctx.options),) + (None,) * 7


_register_backward("apply_rope_backward", _setup_rope, _rope_double_backward)


@torch.library.custom_op("fastpe::embed", mutates_args=())
def embed_op(
    ids: Tensor, weight: Tensor, positions: Tensor | None, offset: int, pe: str,
    pe_table: Tensor | None, scale: float, base: float, layout: str, freq: str,
    token_type_ids: Tensor | None, token_type_weight: Tensor | None, backend: str,
) -> Tensor:  # fmt: skip
    inputs = EmbedInputs.build(
        ids, weight, positions=_positions(positions, offset), pe=pe or None, pe_table=pe_table,
        scale=scale, base=base, layout=layout, freq=freq, token_type_ids=token_type_ids,
        token_type_weight=token_type_weight,
    )  # fmt: skip
    return dispatch.run(inputs, _backend(backend))


@embed_op.register_fake
def _(
    ids,
    weight,
    positions,
    offset,
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
    return weight.new_empty((ids.shape[0], ids.shape[1], weight.shape[1]))


@torch.library.custom_op("fastpe::embed_backward", mutates_args=())
def embed_backward_op(
    grad: Tensor, ids: Tensor, weight: Tensor, positions: Tensor | None, offset: int, pe: str,
    pe_table: Tensor | None, scale: float, token_type_ids: Tensor | None,
    token_type_weight: Tensor | None, need_weight: bool, need_pe_table: bool,
    need_token_type_weight: bool, backend: str,
) -> list[Tensor]:  # fmt: skip
    """The gradients of ``embed`` w.r.t. weight, pe_table and token_type_weight (those asked
    for, in that order): scatter-adds of ``grad`` over ids / positions / token types."""
    forward = EmbedInputs.build(
        ids, weight, positions=_positions(positions, offset), pe=pe or None, pe_table=pe_table,
        scale=scale, base=10000.0, layout="interleaved", freq="paper",
        token_type_ids=token_type_ids, token_type_weight=token_type_weight,
    )  # fmt: skip
    inputs = EmbedBackwardInputs.build(
        forward, grad, weight=need_weight, pe_table=need_pe_table,
        token_type_weight=need_token_type_weight,
    )  # fmt: skip
    grads = dispatch.run(inputs, _backend(backend))
    return [g for g in grads if g is not None]


@embed_backward_op.register_fake
def _(grad, ids, weight, positions, offset, pe, pe_table, scale, token_type_ids,
      token_type_weight, need_weight, need_pe_table, need_token_type_weight, backend):  # fmt: skip
    tables = ((need_weight, weight), (need_pe_table, pe_table),
              (need_token_type_weight, token_type_weight))  # fmt: skip
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for need, t in tables
            if need and t is not None]  # fmt: skip


def _setup_embed(ctx, inputs, output):
    ids, weight, positions, offset, pe, pe_table, scale, _, _, _, tt_ids, tt_weight, backend = (
        inputs
    )
    ctx.save_for_backward(ids, weight, positions, pe_table, tt_ids, tt_weight)
    ctx.options = (offset, pe, scale, _forward_backend(backend))


def _embed_backward(ctx, grad):
    # ids, positions and token types are integers; the sinusoidal PE has no parameters
    need = ctx.needs_input_grad
    wanted = (need[1], need[5], need[11])  # weight, pe_table, token_type_weight
    grads = [None] * 13
    if not any(wanted):
        return tuple(grads)
    ids, weight, positions, pe_table, tt_ids, tt_weight = ctx.saved_tensors
    offset, pe, scale, backend = ctx.options
    found = iter(embed_backward_op(
        grad, ids, weight, positions, offset, pe, pe_table, scale, tt_ids, tt_weight,
        bool(wanted[0]), bool(wanted[1]), bool(wanted[2]), backend,
    ))  # fmt: skip
    for index, want in zip((1, 5, 11), wanted, strict=True):
        if want:
            grads[index] = next(found)
    return tuple(grads)


_register_backward("embed", _setup_embed, _embed_backward)


def _attention_inputs(
    q, k, v, causal, causal_alignment, mask, key_lengths, scale, rope_cos, rope_sin,
    rope_interleaved, rope_q_positions, rope_q_positions_offset, rope_k_positions,
    rope_k_positions_offset, alibi_slopes, relative_bias_table, relative_bias_num_buckets,
    relative_bias_max_distance, relative_bias_bidirectional, window_left, window_right, softcap,
    sinks,
) -> AttentionInputs:  # fmt: skip
    """The validated forward record of the attention schema's arguments (with lse: the backward
    needs it)."""
    rope = _rope_from_schema(rope_cos, rope_sin, rope_interleaved, rope_q_positions,
                             rope_q_positions_offset, rope_k_positions, rope_k_positions_offset)  # fmt: skip
    relative_bias = _relative_bias_from_schema(
        relative_bias_table, relative_bias_num_buckets, relative_bias_max_distance,
        relative_bias_bidirectional,
    )  # fmt: skip
    return AttentionInputs.build(
        q, k, v, causal=causal, causal_alignment=causal_alignment, mask=mask,
        key_lengths=key_lengths, scale=scale, rope=rope, alibi_slopes=alibi_slopes,
        relative_bias=relative_bias, return_lse=True, window=(window_left, window_right),
        softcap=softcap, sinks=sinks,
    )  # fmt: skip


@torch.library.custom_op("fastpe::attention", mutates_args=())
def attention_op(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, causal_alignment: str, mask: Tensor | None,
    key_lengths: Tensor | None, scale: float | None, rope_cos: Tensor | None,
    rope_sin: Tensor | None, rope_interleaved: bool, rope_q_positions: Tensor | None,
    rope_q_positions_offset: int | None, rope_k_positions: Tensor | None, rope_k_positions_offset: int | None,
    alibi_slopes: Tensor | None, relative_bias_table: Tensor | None,
    relative_bias_num_buckets: int, relative_bias_max_distance: int,
    relative_bias_bidirectional: bool, window_left: int, window_right: int,
    softcap: float | None, sinks: Tensor | None, backend: str,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    inputs = _attention_inputs(
        q, k, v, causal, causal_alignment, mask, key_lengths, scale, rope_cos, rope_sin, rope_interleaved,
        rope_q_positions, rope_q_positions_offset, rope_k_positions, rope_k_positions_offset,
        alibi_slopes, relative_bias_table, relative_bias_num_buckets, relative_bias_max_distance,
        relative_bias_bidirectional, window_left, window_right, softcap, sinks,
    )  # fmt: skip
    out, lse = dispatch.run(inputs, _backend(backend))
    return out, lse


@attention_op.register_fake
def _(q, k, v, *args):
    b, hq, sq, _ = q.shape
    return q.new_empty((b, hq, sq, v.shape[3])), q.new_empty((b, hq, sq), dtype=torch.float32)


# The forward's options as they travel to the backward op: everything after (q, k, v) in
# attention_op's schema except the backend, in order.
_ATTENTION_OPTIONS = (
    "causal", "causal_alignment", "mask", "key_lengths", "scale", "rope_cos", "rope_sin",
    "rope_interleaved", "rope_q_positions", "rope_q_positions_offset", "rope_k_positions",
    "rope_k_positions_offset", "alibi_slopes", "relative_bias_table",
    "relative_bias_num_buckets", "relative_bias_max_distance", "relative_bias_bidirectional",
    "window_left", "window_right", "softcap", "sinks",
)  # fmt: skip
# inputs that get no gradient (docs/README.md#training): asking for one is an error
_NO_GRADIENT = {3 + _ATTENTION_OPTIONS.index(name): name
                for name in ("mask", "rope_cos", "rope_sin", "alibi_slopes")}  # fmt: skip


@torch.library.custom_op("fastpe::attention_backward", mutates_args=())
def attention_backward_op(
    grad_out: Tensor, grad_lse: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
    lse: Tensor, causal: bool, causal_alignment: str, mask: Tensor | None,
    key_lengths: Tensor | None, scale: float | None, rope_cos: Tensor | None,
    rope_sin: Tensor | None, rope_interleaved: bool, rope_q_positions: Tensor | None,
    rope_q_positions_offset: int | None, rope_k_positions: Tensor | None, rope_k_positions_offset: int | None,
    alibi_slopes: Tensor | None, relative_bias_table: Tensor | None,
    relative_bias_num_buckets: int, relative_bias_max_distance: int,
    relative_bias_bidirectional: bool, window_left: int, window_right: int,
    softcap: float | None, sinks: Tensor | None, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(dq, dk, dv, dsinks, d relative_bias_table) of one attention_op call; the last two are
    empty when the call had no sinks / no table."""
    forward = _attention_inputs(
        q, k, v, causal, causal_alignment, mask, key_lengths, scale, rope_cos, rope_sin, rope_interleaved,
        rope_q_positions, rope_q_positions_offset, rope_k_positions, rope_k_positions_offset,
        alibi_slopes, relative_bias_table, relative_bias_num_buckets, relative_bias_max_distance,
        relative_bias_bidirectional, window_left, window_right, softcap, sinks,
    )  # fmt: skip
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


def _attention_setup_context(ctx, inputs, output):
    q, k, v, *options, backend = inputs
    out, lse = output
    tensors = [q, k, v, out, lse]
    ctx.layout = []  # per option: an index into the saved tensors, or the value itself
    for value in options:
        if isinstance(value, Tensor):
            ctx.layout.append(len(tensors))
            tensors.append(value)
        else:
            ctx.layout.append(None)
    ctx.constants = [None if isinstance(x, Tensor) else x for x in options]
    ctx.backend = _forward_backend(backend)
    ctx.save_for_backward(*tensors)


def _attention_backward(ctx, grad_out, grad_lse):
    for index, name in _NO_GRADIENT.items():
        if ctx.needs_input_grad[index]:
            raise RuntimeError(
                f"fastpe.attention gives no gradient for {name} (docs/README.md#training); "
                f"pass it detached (.detach()) or compute it outside attention"
            )
    saved = ctx.saved_tensors
    q, k, v, out, lse = saved[:5]
    options = [saved[i] if i is not None else c for i, c in zip(ctx.layout, ctx.constants,
                                                                  strict=True)]  # fmt: skip
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dsinks, dtable = attention_backward_op(
        grad_out, grad_lse, q, k, v, out, lse, *options, ctx.backend
    )
    named = dict(zip(_ATTENTION_OPTIONS, options, strict=True))
    grads = {"sinks": dsinks if named["sinks"] is not None else None,
             "relative_bias_table": dtable if named["relative_bias_table"] is not None else None}  # fmt: skip
    return (dq, dk, dv, *(grads.get(name) for name in _ATTENTION_OPTIONS), None)


_register_backward("attention", _attention_setup_context, _attention_backward)
torch.library.register_autograd("fastpe::attention_backward", _no_backward("attention_backward"))


# The one place where attention's structured options (``rope=`` and ``relative_bias=`` dicts,
# whose values are validated into ``Rope`` / ``RelativeBias`` records by AttentionInputs) meet
# the op schema, which takes only flat typed arguments.


def _rope_to_schema(rope, device) -> tuple:
    if rope is None:
        return None, None, False, None, None, None, None
    Rope.check_keys(rope)
    q_positions = _split_positions(rope.get("q_positions"), device, "rope['q_positions']")
    k_positions = _split_positions(rope.get("k_positions"), device, "rope['k_positions']")
    return (rope.get("cos"), rope.get("sin"), rope.get("interleaved", False), *q_positions,
            *k_positions)  # fmt: skip


def _rope_from_schema(
    cos, sin, interleaved, q_positions, q_positions_offset, k_positions, k_positions_offset
):
    if cos is None and sin is None:
        return None
    rope = {"cos": cos, "sin": sin, "interleaved": interleaved}
    for key, tensor, offset in (("q_positions", q_positions, q_positions_offset),
                                ("k_positions", k_positions, k_positions_offset)):  # fmt: skip
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
    return (bias.get("table"), _schema_int("relative_bias['num_buckets']", num_buckets),
            _schema_int("relative_bias['max_distance']", max_distance), _plain(bidirectional))  # fmt: skip


def _relative_bias_from_schema(table, num_buckets, max_distance, bidirectional):
    if table is None:
        return None
    return {"table": table, "num_buckets": num_buckets, "max_distance": max_distance,
            "bidirectional": bidirectional}  # fmt: skip


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
    grad_out: Tensor, grad_lse: Tensor, out_a: Tensor, lse_a: Tensor, out_b: Tensor,
    lse_b: Tensor, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(d out_a, d lse_a, d out_b, d lse_b) of ``merge_attention`` (docs/math.md#merge-gradients)."""
    forward = MergeAttentionInputs.build(out_a, lse_a, out_b, lse_b)
    inputs = MergeAttentionBackwardInputs.build(forward, grad_out, grad_lse)
    return tuple(dispatch.run(inputs, _backend(backend)))


@merge_attention_backward_op.register_fake
def _(grad_out, grad_lse, out_a, lse_a, out_b, lse_b, backend):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in (out_a, lse_a, out_b, lse_b))  # fmt: skip


def _setup_merge(ctx, inputs, output):
    out_a, lse_a, out_b, lse_b, backend = inputs
    ctx.save_for_backward(out_a, lse_a, out_b, lse_b)
    ctx.backend = _forward_backend(backend)


def _merge_backward(ctx, grad_out, grad_lse):
    out_a, lse_a, out_b, lse_b = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out_a)
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse_a, dtype=torch.float32)
    grads = merge_attention_backward_op(
        grad_out.to(out_a.dtype), grad_lse, out_a, lse_a, out_b, lse_b, ctx.backend
    )
    return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad, strict=False)),
            None)  # fmt: skip


_register_backward("merge_attention", _setup_merge, _merge_backward)
torch.library.register_autograd(
    "fastpe::merge_attention_backward", _no_backward("merge_attention_backward")
)


# ---------------------------------------------------------------------------------------------
# The public API's flattened calls (fastpe.api routes here under compile or autograd recording)


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


def _split_positions(positions, device, name="positions") -> tuple[Tensor | None, int | None]:
    """Public ``positions`` (None | int | int array or list) -> (tensor or None, offset or None),
    the same values the eager path accepts."""
    positions = _plain(positions)
    if positions is None or isinstance(positions, int):
        if positions is not None:  # the eager check, before int64 must hold it
            check_position(name, positions)
        return None, positions
    if isinstance(positions, (list, tuple)):  # as eagerly: a list takes the tensors' device
        positions = torch.as_tensor(positions, device=device)
    if not isinstance(positions, Tensor):
        raise TypeError(
            f"all arrays must be NumPy arrays or all torch tensors on one device; got {name}: "
            f"{type(positions).__name__} with torch tensors"
        )
    return positions, None


def call_apply_rope(x, cos, sin, *, positions, interleaved, layout, inplace, backend):
    tensor, offset = _split_positions(positions, x.device)
    out = apply_rope_op(x, cos, sin, tensor, offset or 0, interleaved, layout, backend or "")
    return x.copy_(out) if inplace else out


def call_apply_rope_group(xs, cos, sin, *, positions, interleaved, layout, inplace, backend):
    tensor, offset = _split_positions(positions, xs[0].device)
    outs = apply_rope_group_op(list(xs), cos, sin, tensor, offset or 0, interleaved, layout,
                               backend or "")  # fmt: skip
    return tuple(x.copy_(out) for x, out in zip(xs, outs, strict=True)) if inplace else tuple(outs)


def call_embed(ids, weight, *, positions, pe, pe_table, scale, base, layout, freq,
               token_type_ids, token_type_weight, backend):  # fmt: skip
    tensor, offset = _split_positions(positions, weight.device)
    return embed_op(ids, weight, tensor, offset or 0, pe or "", pe_table, float(scale), float(base), layout,
                    freq, token_type_ids, token_type_weight, backend or "")  # fmt: skip


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
    # checked here too: the schema's types would turn bad values into torch's own errors
    window = check_window(window) or (-1, -1)
    softcap = None if softcap is None else check_float("softcap", softcap, positive=True)
    return (
        causal, causal_alignment, mask, key_lengths, None if scale is None else float(scale),
        *_rope_to_schema(rope, q.device), alibi_slopes, *_relative_bias_to_schema(relative_bias),
        *window, softcap, sinks,
    )  # fmt: skip


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


def call_merge_attention(out_a, lse_a, out_b, lse_b, *, backend):
    return merge_attention_op(out_a, lse_a, out_b, lse_b, backend or "")


def call_sinusoidal_table(
    num_positions, dim, *, base, layout, freq, offset, dtype, device, backend
):
    return sinusoidal_table_op(num_positions, dim, float(base), layout, freq, offset,
                               _torch_dtype(dtype), torch.device(device), backend or "")  # fmt: skip


def call_rope_table(num_positions, rotary_dim, *, base, scaling, offset, dtype, device, backend):
    layout, numbers = _scaling_to_schema(scaling)
    return rope_table_op(num_positions, rotary_dim, float(base), layout, numbers,
                         offset, _torch_dtype(dtype), torch.device(device), backend or "")  # fmt: skip


# A scaling dict travels as a constant layout string (keys, kinds, strings) and a list of its
# numbers. Under torch.compile the numbers may be symbolic after a recompile, so nothing here may
# sort, hash or print them; the keys are constant strings.


def _scaling_to_schema(scaling) -> tuple[str, Tensor]:
    if not scaling:
        return "", torch.empty(0, dtype=torch.float64)
    if not isinstance(scaling, Mapping):
        raise TypeError(f"scaling must be None or a dict; got {type(scaling).__name__}")
    entries, numbers = [], []
    for key in sorted(scaling):
        value = scaling[key]
        if value is None or isinstance(value, (str, bool)):
            entries.append(f"{key}={type(value).__name__}:{value}")
        elif isinstance(value, (list, tuple)):
            entries.append(f"{key}=list:{len(value)}")
            numbers.extend(value)
        else:  # a number (NumPy scalars become 0-d tensors under Dynamo), or a bad value
            try:
                number = torch.as_tensor(value)  # its dtype (static when traced) keeps int-ness
            except (TypeError, RuntimeError, ValueError) as exc:
                raise TypeError(
                    f"scaling[{key!r}] must be a number, a string or a list of numbers; got "
                    f"{value!r}"
                ) from exc
            entries.append(f"{key}={'float' if number.is_floating_point() else 'int'}")
            numbers.append(number)
    # a float64 tensor carries Python floats, symbolic floats and NumPy scalars alike
    numbers = [torch.as_tensor(n, dtype=torch.float64).reshape(-1) for n in numbers]
    tensor = torch.cat(numbers) if numbers else torch.empty(0, dtype=torch.float64)
    return ";".join(entries), tensor


def _scaling_from_schema(layout: str, numbers: Tensor) -> dict | None:
    if not layout:
        return None
    numbers = numbers.tolist()
    scaling, at = {}, 0
    for entry in layout.split(";"):
        key, kind = entry.split("=", 1)
        kind, _, text = kind.partition(":")
        if kind == "list":
            scaling[key] = list(numbers[at : at + int(text)])
            at += int(text)
        elif kind in ("int", "float"):
            scaling[key] = int(numbers[at]) if kind == "int" else numbers[at]
            at += 1
        else:
            scaling[key] = {"NoneType": None, "bool": text == "True", "str": text}[kind]
    return scaling


def _torch_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, str(dtype).removeprefix("torch."))


# ---------------------------------------------------------------------------------------------
# attention_varlen (packed sequences): a forward op and a backward that runs attention's own
# backward once per sequence, on [1, H, S_b, D] views of the packed tensors (no padding).

_VARLEN_OPTIONS = (
    "max_seqlen_q", "max_seqlen_k", "causal", "causal_alignment", "scale", "rope_cos",
    "rope_sin", "rope_interleaved", "rope_q_positions", "rope_k_positions", "alibi_slopes",
    "window_left", "window_right", "softcap", "sinks",
)  # fmt: skip
# (q, k, v, cu_seqlens_q, cu_seqlens_k) come first in the schema
_VARLEN_NO_GRADIENT = {5 + _VARLEN_OPTIONS.index(name): name
                       for name in ("rope_cos", "rope_sin", "alibi_slopes")}  # fmt: skip


def _varlen_inputs(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, causal_alignment,
                   scale, rope_cos, rope_sin, rope_interleaved, rope_q_positions,
                   rope_k_positions, alibi_slopes, window_left, window_right, softcap, sinks):  # fmt: skip
    from fastpe._inputs_serving import AttentionVarlenInputs

    rope = None
    if rope_cos is not None or rope_sin is not None:
        rope = {"cos": rope_cos, "sin": rope_sin, "interleaved": rope_interleaved,
                "q_positions": rope_q_positions, "k_positions": rope_k_positions}  # fmt: skip
    return AttentionVarlenInputs.build(
        q, k, v, cu_q, cu_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        causal=causal, causal_alignment=causal_alignment, scale=scale, rope=rope,
        alibi_slopes=alibi_slopes, window=(window_left, window_right), softcap=softcap,
        sinks=sinks, return_lse=True,
    )  # fmt: skip


@torch.library.custom_op("fastpe::attention_varlen", mutates_args=())
def attention_varlen_op(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int | None, max_seqlen_k: int | None, causal: bool, causal_alignment: str,
    scale: float | None, rope_cos: Tensor | None, rope_sin: Tensor | None,
    rope_interleaved: bool, rope_q_positions: Tensor | None, rope_k_positions: Tensor | None,
    alibi_slopes: Tensor | None, window_left: int, window_right: int, softcap: float | None,
    sinks: Tensor | None, backend: str,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    inputs = _varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
        causal_alignment, scale, rope_cos, rope_sin, rope_interleaved, rope_q_positions,
        rope_k_positions, alibi_slopes, window_left, window_right, softcap, sinks,
    )  # fmt: skip
    out, lse = dispatch.run(inputs, _backend(backend))
    return out, lse


@attention_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, *args):
    total_q, hq, _ = q.shape
    return q.new_empty((total_q, hq, v.shape[2])), q.new_empty((hq, total_q), dtype=torch.float32)


@torch.library.custom_op("fastpe::attention_varlen_backward", mutates_args=())
def attention_varlen_backward_op(
    grad_out: Tensor, grad_lse: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
    lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int | None,
    max_seqlen_k: int | None, causal: bool, causal_alignment: str, scale: float | None,
    rope_cos: Tensor | None, rope_sin: Tensor | None, rope_interleaved: bool,
    rope_q_positions: Tensor | None, rope_k_positions: Tensor | None,
    alibi_slopes: Tensor | None, window_left: int, window_right: int, softcap: float | None,
    sinks: Tensor | None, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(dq, dk, dv, dsinks) of one attention_varlen_op call (dsinks empty without sinks):
    attention's backward on each sequence's [1, H, S_b, D] slice, written into packed buffers
    (docs/math.md#packed-variable-length-backward)."""
    fwd = _varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
        causal_alignment, scale, rope_cos, rope_sin, rope_interleaved, rope_q_positions,
        rope_k_positions, alibi_slopes, window_left, window_right, softcap, sinks,
    )  # fmt: skip
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    dsinks = q.new_zeros((0,)) if sinks is None else torch.zeros_like(sinks, dtype=torch.float32)

    def heads_first(x, rows):  # [T, H, D] rows -> [1, H, S_b, D]
        return x[rows].transpose(0, 1).unsqueeze(0).contiguous()

    for b in range(fwd.batch):
        rows = slice(int(fwd.cu_q[b]), int(fwd.cu_q[b + 1]))
        keys = slice(int(fwd.cu_k[b]), int(fwd.cu_k[b + 1]))
        if rows.start == rows.stop:
            continue
        if keys.start == keys.stop:
            # no key: out = 0 and lse = the sink (or -inf); only a sink sees grad_lse
            if sinks is not None:
                dsinks += grad_lse[:, rows].sum(dim=1).float()
            continue
        rope = None
        if fwd.rope is not None:
            rope = {"cos": fwd.rope.cos, "sin": fwd.rope.sin, "interleaved": fwd.rope.interleaved,
                    "q_positions": torch.as_tensor(fwd.rope.q_positions[rows], device=q.device),
                    "k_positions": torch.as_tensor(fwd.rope.k_positions[keys], device=q.device)}  # fmt: skip
        forward = AttentionInputs.build(
            heads_first(q, rows), heads_first(k, keys), heads_first(v, keys), causal=fwd.causal,
            causal_alignment="bottom_right" if fwd.bottom_right else "top_left", mask=None,
            key_lengths=None, scale=fwd.scale, rope=rope,
            alibi_slopes=None if fwd.alibi_slopes is None else fwd.alibi_slopes[b : b + 1],
            relative_bias=None, return_lse=True, window=fwd.window, softcap=fwd.softcap,
            sinks=fwd.sinks,
        )  # fmt: skip
        inputs = AttentionBackwardInputs.build(
            forward, grad_out=heads_first(grad_out, rows),
            grad_lse=grad_lse[:, rows].unsqueeze(0).contiguous(), out=heads_first(out, rows),
            lse=lse[:, rows].unsqueeze(0).contiguous(),
        )  # fmt: skip
        dq_b, dk_b, dv_b, dsinks_b, _ = dispatch.run(inputs, _backend(backend))
        dq[rows] = dq_b[0].transpose(0, 1)
        dk[keys] = dk_b[0].transpose(0, 1)
        dv[keys] = dv_b[0].transpose(0, 1)
        if sinks is not None:
            dsinks += dsinks_b.float()
    if sinks is not None:
        dsinks = dsinks.to(sinks.dtype)
    return dq, dk, dv, dsinks


@attention_varlen_backward_op.register_fake
def _(grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *args):
    sinks = dict(zip(_VARLEN_OPTIONS, args, strict=False))["sinks"]
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
        q.new_empty((0,)) if sinks is None else torch.empty_like(sinks),
    )


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *options, backend = inputs
    out, lse = output
    tensors = [q, k, v, out, lse, cu_q, cu_k]
    ctx.layout = []  # per option: an index into the saved tensors, or None (a constant)
    for value in options:
        ctx.layout.append(len(tensors) if isinstance(value, Tensor) else None)
        if isinstance(value, Tensor):
            tensors.append(value)
    ctx.constants = [None if isinstance(x, Tensor) else x for x in options]
    ctx.backend = _forward_backend(backend)
    ctx.save_for_backward(*tensors)


def _varlen_backward(ctx, grad_out, grad_lse):
    for index, name in _VARLEN_NO_GRADIENT.items():
        if ctx.needs_input_grad[index]:
            raise RuntimeError(
                f"fastpe.attention_varlen gives no gradient for {name} "
                "(docs/README.md#training); pass it detached (.detach()) or compute it outside "
                "attention_varlen"
            )
    saved = ctx.saved_tensors
    q, k, v, out, lse, cu_q, cu_k = saved[:7]
    options = [saved[i] if i is not None else c for i, c in zip(ctx.layout, ctx.constants,
                                                                  strict=True)]  # fmt: skip
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
    dq, dk, dv, dsinks = attention_varlen_backward_op(
        grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, *options, ctx.backend
    )
    has_sinks = dict(zip(_VARLEN_OPTIONS, options, strict=True))["sinks"] is not None
    grads = {"sinks": dsinks if has_sinks else None}
    return (dq, dk, dv, None, None, *(grads.get(name) for name in _VARLEN_OPTIONS), None)


_register_backward("attention_varlen", _varlen_setup_context, _varlen_backward)
torch.library.register_autograd(
    "fastpe::attention_varlen_backward", _no_backward("attention_varlen_backward")
)


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


def call_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k,
                          causal, causal_alignment, scale, rope, alibi_slopes, window, softcap,
                          sinks, return_lse, backend):  # fmt: skip
    # checked here too: the schema's types would turn bad values into torch's own errors
    window = check_window(window) or (-1, -1)
    softcap = None if softcap is None else check_float("softcap", softcap, positive=True)
    if rope is not None:
        Rope.check_keys(rope)
    rope = rope or {}
    out, lse = attention_varlen_op(
        q, k, v, cu_seqlens_q, cu_seqlens_k, _max_seqlen("max_seqlen_q", max_seqlen_q),
        _max_seqlen("max_seqlen_k", max_seqlen_k),
        check_bool("causal", causal), causal_alignment, None if scale is None else float(scale),
        rope.get("cos"), rope.get("sin"),
        check_bool("rope['interleaved']", rope.get("interleaved", False)),
        _varlen_positions("rope['q_positions']", rope.get("q_positions"), q.device),
        _varlen_positions("rope['k_positions']", rope.get("k_positions"), q.device),
        alibi_slopes, *window, softcap, sinks, backend or "",
    )  # fmt: skip
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# attention_kvcache: an inference op that writes new k/v into the caches (declared mutations,
# so torch.compile functionalizes it); no backward (autograd refuses it at the call).


@torch.library.custom_op("fastpe::attention_kvcache", mutates_args=("k_cache", "v_cache"))
def attention_kvcache_op(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None, v: Tensor | None,
    cache_seqlens: Tensor | None, cache_seqlens_int: int, block_table: Tensor | None,
    cache_batch_idx: Tensor | None, rotary_cos: Tensor | None, rotary_sin: Tensor | None,
    rotary_interleaved: bool, causal: bool, scale: float | None, alibi_slopes: Tensor | None,
    window_left: int, window_right: int, softcap: float | None, sinks: Tensor | None,
    backend: str,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    from fastpe._inputs_serving import AttentionKVCacheInputs

    inputs = AttentionKVCacheInputs.build(
        q, k_cache, v_cache, k=k, v=v,
        cache_seqlens=cache_seqlens_int if cache_seqlens is None else cache_seqlens,
        block_table=block_table, cache_batch_idx=cache_batch_idx, rotary_cos=rotary_cos,
        rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved, causal=causal,
        scale=scale, alibi_slopes=alibi_slopes, window=(window_left, window_right),
        softcap=softcap, sinks=sinks, return_lse=True,
    )  # fmt: skip
    out, lse = dispatch.run(inputs, _backend(backend))
    return out, lse


@attention_kvcache_op.register_fake
def _(q, k_cache, v_cache, *args):
    b, sq, hq, _ = q.shape
    return q.new_empty((b, sq, hq, v_cache.shape[3])), q.new_empty((b, hq, sq), dtype=torch.float32)


# no autograd registration: torch refuses one for an op that mutates its inputs; the public
# function refuses inputs that require grad before reaching here (outside torch.compile)


def call_attention_kvcache(q, k_cache, v_cache, k, v, *, cache_seqlens, block_table,
                           cache_batch_idx, rotary_cos, rotary_sin, rotary_interleaved, causal,
                           scale, alibi_slopes, window, softcap, sinks, return_lse, backend):  # fmt: skip
    # checked here too: the schema's types would turn bad values into torch's own errors
    window = check_window(window) or (-1, -1)
    softcap = None if softcap is None else check_float("softcap", softcap, positive=True)
    cache_seqlens = _plain(cache_seqlens)
    if isinstance(cache_seqlens, int):
        cache_seqlens = _schema_int("cache_seqlens", cache_seqlens)
    length = cache_seqlens if isinstance(cache_seqlens, int) else 0
    lengths, block_table, cache_batch_idx = (
        torch.as_tensor(x, device=q.device) if isinstance(x, (list, tuple)) else x
        for x in (None if isinstance(cache_seqlens, int) else cache_seqlens, block_table,
                  cache_batch_idx)
    )  # fmt: skip
    out, lse = attention_kvcache_op(
        q, k_cache, v_cache, k, v, lengths, length, block_table, cache_batch_idx,
        rotary_cos, rotary_sin, check_bool("rotary_interleaved", rotary_interleaved),
        check_bool("causal", causal),
        None if scale is None else float(scale), alibi_slopes, *window, softcap, sinks,
        backend or "",
    )  # fmt: skip
    return (out, lse) if return_lse else out
