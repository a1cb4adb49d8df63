"""flex_attention's Triton path: the variant's generated steps, the block mask's lists on the
device, and the launches of ``fastpe.kernels.triton.flex_attention`` (docs/flex-attention.md).

Imported by ``fastpe.flex`` for a call with ``backend="triton"`` (the default for CUDA tensors):
torch tensors on a CUDA device, or CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import torch

from fastpe import _flex_expr

_variants: dict = {}
_variants_lock = threading.Lock()


def variant_statements(score, mask):
    """(statements of the full step, of the partial step, the steps index captured tensors,
    score_mod's derivative is not 1): each step assigns ``value`` (the modified score),
    ``keep`` (the mask; True in the full step) and ``grad`` (∂value/∂score)."""
    value = score if score is not None else _flex_expr.Node("score", (), "float")
    grad = _flex_expr.ONE
    if score is not None:
        grad = _flex_expr.derivative(score) or _flex_expr.ZERO
    true = _flex_expr.const(True)
    full = _flex_expr.triton_statements({"value": value, "keep": true, "grad": grad})
    partial = _flex_expr.triton_statements(
        {"value": value, "keep": mask if mask is not None else true, "grad": grad}
    )
    checks = any(n.op == "index" for n in _flex_expr.nodes_in_order(value, grad, mask))
    return full, partial, checks, grad != _flex_expr.ONE


def variant(score, mask, reads=()):
    """(module with ``_full_step`` and ``_partial_step``, checks, has_grad) of an expression
    pair, generated and loaded once per process. With ``reads`` (captured-array reads of
    ``score`` to differentiate: ``_flex_expr.trained_reads``) the module also has a
    ``_reads_step``: a module of its own, for the backward of calls that train captured
    tensors only."""
    key = (score, mask, reads)
    found = _variants.get(key)
    if found is not None:
        return found
    from fastpe.kernels.triton import flex_attention as kernels

    full, partial, checks, has_grad = variant_statements(score, mask)
    reads_source = ""
    if reads:
        reads_source = kernels.reads_step_source(
            _flex_expr.triton_statements(_flex_expr.read_gradient_roots(score, reads)),
            [read.args[0].args[0] for read in reads],
        )
    module = kernels.load_variant(kernels.module_source(full, partial, reads_source))
    with _variants_lock:
        return _variants.setdefault(key, (module, checks, has_grad))


def _lists(state):
    """((full counts, full indices), (partial counts, partial indices)) int32 of block states
    [Bm, Hm, n, m]: per leading index, the blocks of the last axis in that state, ascending."""
    result = []
    for wanted in (2, 1):
        hit = state == wanted
        order = np.argsort(~hit, axis=-1, kind="stable").astype(np.int32)
        result.append((hit.sum(axis=-1).astype(np.int32), order))
    return result


_device_lists: OrderedDict = OrderedDict()
_device_lists_lock = threading.Lock()
_KEPT = 64  # block masks whose device lists stay cached (a model's layers share a few)


def device_lists(state, device):
    """(kv lists, q lists) of block states [Bm, Hm, nq, nk] as int32 tensors on ``device``,
    uploaded once per mask and device (keyed by the states' bytes)."""
    key = (state.shape, state.tobytes(), str(device))
    with _device_lists_lock:
        found = _device_lists.get(key)
        if found is not None:
            _device_lists.move_to_end(key)
            return found
    kv = _lists(state)
    q = _lists(np.ascontiguousarray(state.swapaxes(-1, -2)))

    def upload(pairs):
        return tuple(
            tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in pair)
            for pair in pairs
        )

    found = (upload(kv), upload(q))
    with _device_lists_lock:
        _device_lists[key] = found
        while len(_device_lists) > _KEPT:
            _device_lists.popitem(last=False)
    return found


def device_arrays(arrays, device):
    """The captured tensors and arrays as tensors on ``device`` (no copy for a tensor already
    there; half types widened to float32, the dtype the steps compute in)."""
    out = []
    for array in arrays:
        if not isinstance(array, torch.Tensor):
            array = torch.from_numpy(np.ascontiguousarray(array))
        array = array.detach().to(device)
        if array.dtype in (torch.bfloat16, torch.float16):
            array = array.float()
        out.append(array)
    return out


def forward(call, query, key, value):
    """(out in query's dtype, lse fp32) of a call (``fastpe.flex._Call``) on the device."""
    from fastpe.kernels.triton.flex_attention import flex_forward_triton

    module, checks, _ = variant(call.score, call.mask)
    kv_lists, _ = device_lists(call.state, query.device)
    return flex_forward_triton(
        query, key, value, module=module, lists=kv_lists, caps=call.arrays, blocks=call.blocks,
        scale=call.scale, checks=checks,
    )  # fmt: skip


def backward(call, query, key, value, out, lse, grad_out, grad_lse):
    """((dq, dk, dv) fp32, [the fp32 gradient of each captured tensor numbered in
    ``call.grad_caps``]) of a call."""
    from fastpe.kernels.triton.flex_attention import flex_backward_triton

    reads = _flex_expr.trained_reads(call.score, call.grad_caps)
    module, _, has_grad = variant(call.score, call.mask, reads)
    kv_lists, q_lists = device_lists(call.state, query.device)
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dcaps = None
    if reads:  # one per captured tensor, as the steps number them (the untrained ones unused)
        dcaps = [torch.zeros(max(a.numel(), 1), dtype=torch.float32, device=query.device)
                 for a in call.arrays]  # fmt: skip
    grads = flex_backward_triton(
        query, key, value, out, lse, grad_out, grad_lse, module=module, kv_lists=kv_lists,
        q_lists=q_lists, caps=call.arrays, blocks=call.blocks, scale=call.scale,
        has_grad=has_grad, dcaps=dcaps,
    )  # fmt: skip
    captured = [
        dcaps[number][: call.arrays[number].numel()].reshape(call.arrays[number].shape)
        if dcaps is not None
        else torch.zeros(call.arrays[number].shape, dtype=torch.float32, device=query.device)
        for number in call.grad_caps
    ]
    return grads, captured
