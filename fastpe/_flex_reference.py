"""The float64 oracle of flex_attention: the captured expressions evaluated over the whole
[B, Hq, Sq, Sk] score grid with NumPy (docs/flex-attention.md). Obviously right, not fast."""

from __future__ import annotations

import numpy as np

from fastpe import _flex_expr


def _grid(batch, hq, sq, sk):
    return {
        "b": np.arange(batch).reshape(-1, 1, 1, 1),
        "h": np.arange(hq).reshape(1, -1, 1, 1),
        "q_idx": np.arange(sq).reshape(1, 1, -1, 1),
        "kv_idx": np.arange(sk).reshape(1, 1, 1, -1),
    }


def _element_states(state, blocks, shape):
    """The block states [Bm, Hm, nq, nk] at every element of ``shape`` [B, Hq, Sq, Sk]."""
    _, _, sq, sk = shape
    rows = np.arange(sq) // blocks[0]
    cols = np.arange(sk) // blocks[1]
    return np.broadcast_to(state[:, :, rows][:, :, :, cols], shape)


def scores(q, k, scale, score, mask, state, blocks, arrays):
    """(Z, dZ/dS or None) in float64: the modified scores, -inf where masked. A block in state
    2 (full) is visible without the mask, 1 (partial) where the mask holds, 0 never, as in
    torch's FlexAttention."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    batch, hq, sq, _ = q.shape
    group = hq // k.shape[1]
    k = np.repeat(k, group, axis=1)
    shape = (batch, hq, q.shape[2], k.shape[2])
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    env = dict(_grid(*shape), score=s)
    z = s if score is None else np.broadcast_to(_flex_expr.evaluate(score, env, arrays), shape)
    states = _element_states(state, blocks, shape)
    keep = states == 2
    if mask is not None:
        keep = keep | (
            (states == 1) & np.broadcast_to(_flex_expr.evaluate(mask, env, arrays), shape)
        )
    else:
        keep = keep | (states == 1)
    z = np.where(keep, z, -np.inf)
    derivative = None
    if score is not None:
        grad = _flex_expr.derivative(score)
        derivative = (
            np.zeros(shape)
            if grad is None
            else np.broadcast_to(_flex_expr.evaluate(grad, env, arrays), shape)
        )
        derivative = np.where(keep, derivative, 0.0)
    return z, derivative


def flex_attention(q, k, v, scale, score, mask, state, blocks, arrays):
    """(out [B, Hq, Sq, Dv], lse [B, Hq, Sq]) in float64; rows that see no key give 0 and
    lse -inf."""
    z, _ = scores(q, k, scale, score, mask, state, blocks, arrays)
    v = np.repeat(np.asarray(v, np.float64), q.shape[1] // v.shape[1], axis=1)
    top = np.max(z, axis=-1, keepdims=True, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0.0)
    weights = np.exp(z - top)
    total = weights.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = (np.log(total) + top)[..., 0]
        p = np.where(total > 0, weights / total, 0.0)
    return np.einsum("bhij,bhjd->bhid", p, v), lse


def flex_attention_backward(
    q, k, v, grad_out, grad_lse, scale, score, mask, state, blocks, arrays, grad_caps=()
):
    """(dq, dk, dv, *captured) in float64 of ``flex_attention``'s out (and lse, when
    ``grad_lse`` is not None): dZ = P∘(dO·Vᵀ - D) with D = rowsum(dO∘O) - dlse, dS = dZ∘∂Z/∂S;
    and for each captured array numbered in ``grad_caps``, its gradient (its shape): every
    visible score's dZ·∂Z/∂read added to the element each of the score's reads indexes."""
    q64 = np.asarray(q, np.float64)
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    z, derivative = scores(q, k, scale, score, mask, state, blocks, arrays)
    kr = np.repeat(np.asarray(k, np.float64), group, axis=1)
    vr = np.repeat(np.asarray(v, np.float64), group, axis=1)
    top = np.max(z, axis=-1, keepdims=True, initial=-np.inf)
    top = np.where(np.isfinite(top), top, 0.0)
    weights = np.exp(z - top)
    total = weights.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(total > 0, weights / total, 0.0)
    go = np.asarray(grad_out, np.float64)
    out = np.einsum("bhij,bhjd->bhid", p, vr)
    delta = np.einsum("bhid,bhid->bhi", go, out)
    if grad_lse is not None:
        delta = delta - np.asarray(grad_lse, np.float64)
    dp = np.einsum("bhid,bhjd->bhij", go, vr)
    dz = p * (dp - delta[..., None])
    ds = dz if derivative is None else dz * derivative
    dq = np.einsum("bhij,bhjd->bhid", ds, kr) * scale
    dk = np.einsum("bhij,bhid->bhjd", ds, q64) * scale
    dv = np.einsum("bhij,bhid->bhjd", p, go)
    batch, _, sk, d = dk.shape
    dk = dk.reshape(batch, hkv, group, sk, d).sum(axis=2)
    dv = dv.reshape(batch, hkv, group, sk, dv.shape[-1]).sum(axis=2)
    captured = [np.zeros(np.shape(arrays[number])) for number in grad_caps]
    if grad_caps:
        shape = dz.shape
        env = dict(_grid(*shape), score=np.einsum("bhid,bhjd->bhij", q64, kr) * scale)
        visible = np.isfinite(z)
        for read, grad in _flex_expr.gradient_leaves(score, grad_caps):
            number = read.args[0].args[0]
            target = captured[grad_caps.index(number)]
            local = np.broadcast_to(_flex_expr.evaluate(grad, env, arrays), shape)
            seen = np.nonzero(visible)
            index = []
            for axis, node in enumerate(read.args[1:]):
                i = np.broadcast_to(_flex_expr.evaluate(node, env, arrays), shape)[seen]
                index.append(np.where(i < 0, i + target.shape[axis], i))
            contribution = dz[seen] * local[seen]
            if index:
                np.add.at(target, tuple(index), contribution)
            else:  # a 0-d array
                target[...] += contribution.sum()
    return (dq, dk, dv, *captured)
