"""Ring attention: every rank keeps its query shard; key/value shards travel around the ring with
point-to-point ops, the next transfer overlapping the current block's compute, and the partial
results merge in float32 with ``merge_attention``'s log-sum-exp rule. The backward is a second
ring pass in which each K/V shard travels with its dK/dV accumulator."""

from __future__ import annotations

import math
import types

from fastpe.distributed._group import collective_function, ring_exchange, wait
from fastpe.distributed._plan import merge_into, merge_sinks

# Point-to-point tags: K/V and the dK/dV accumulators of the backward travel the same links in
# interleaved order; distinct tags keep a receive from matching the other kind of message.
KV_TAG, GRAD_TAG = 1, 2


def attention(plan, q, k, v, sinks, backend):
    """``ring_attention``'s (out, lse) on this rank, recorded by autograd as one collective."""
    g = plan.g
    run = types.SimpleNamespace(
        forward=lambda q, k, v, sinks: ring_loop(g, plan, q, k, v, backend, sinks=sinks),
        backward=lambda q, k, v, sinks, *rest: ring_backward(
            g, plan, q, k, v, *rest, backend, sinks=sinks
        ),
    )
    return collective_function().apply(run, q, k, v, sinks)


def ring_compute(plan, q, k, v, acc_out, acc_lse, source, backend):
    """Merges into (``acc_out``, ``acc_lse``) what this rank's queries see of ``source``'s K/V."""
    qpos, kpos = plan.positions[plan.g.rank], plan.positions[source]
    for rows, keys, causal in plan.blocks(plan.g.rank, source):
        part = plan.options.attend(
            q[:, :, rows],
            k[:, :, keys],
            v[:, :, keys],
            qpos[rows],
            kpos[keys],
            causal=causal,
            backend=backend,
        )
        if part is not None:
            merge_into(acc_out[:, :, rows], acc_lse[:, :, rows], *part)


def ring_loop(g, plan, q, k, v, backend, *, sinks=None, overlap=True):
    """N steps: at step t this rank computes with the K/V shard of rank (rank - t) mod N while
    (``overlap=True``) the next shard is already on its way. ``overlap=False`` waits for each
    transfer before computing (for measuring what the overlap saves). The sinks, one logit per
    head with no value, join the merged result once at the end."""
    import torch

    b, hq, n = q.shape[:3]
    acc_out = torch.zeros((b, hq, n, v.shape[3]), dtype=torch.float32, device=q.device)
    acc_lse = torch.full((b, hq, n), -math.inf, dtype=torch.float32, device=q.device)
    kv = (k.contiguous(), v.contiguous())
    for step in range(plan.ring_steps):
        source = (g.rank - step) % g.size
        coming, requests = None, []
        if step < plan.ring_steps - 1:  # the shard still has to reach ranks further along
            coming = _empty_shard(plan, kv, (source - 1) % g.size)
            requests = ring_exchange(g, send=kv, receive=coming, tag=KV_TAG)
        if overlap:
            ring_compute(plan, q, kv[0], kv[1], acc_out, acc_lse, source, backend)
        wait(requests)
        if not overlap:
            ring_compute(plan, q, kv[0], kv[1], acc_out, acc_lse, source, backend)
        if coming is not None:
            kv = tuple(coming)
    if sinks is not None:
        merge_sinks(acc_out, acc_lse, sinks)
    return acc_out.to(q.dtype), acc_lse


def _empty_shard(plan, like, source, dtype=None):
    """Uninitialised tensors shaped as ``like``'s (k, v) but holding ``source``'s tokens."""
    import torch

    return tuple(
        torch.empty(
            (*t.shape[:2], plan.seqs[source], t.shape[3]), dtype=dtype or t.dtype, device=t.device
        )
        for t in like
    )


def ring_backward_compute(plan, source, q, kv, out, lse, grad_out, grad_lse, dq, grads, backend):
    """Adds to ``dq`` and to ``grads`` (source's dK, dV) what this rank's queries contribute."""
    from fastpe import torch_ops

    qpos, kpos = plan.positions[plan.g.rank], plan.positions[source]
    for rows, keys, causal in plan.blocks(plan.g.rank, source):
        keywords = plan.options.block(qpos[rows], kpos[keys], causal=causal)
        if keywords is None:
            continue
        parts = torch_ops.call_attention_backward(
            grad_out[:, :, rows],
            grad_lse[:, :, rows],
            q[:, :, rows],
            kv[0][:, :, keys],
            kv[1][:, :, keys],
            out[:, :, rows],
            lse[:, :, rows],
            backend=backend,
            **keywords,
        )
        for acc, part in zip(
            (dq[:, :, rows], grads[0][:, :, keys], grads[1][:, :, keys]), parts, strict=True
        ):
            acc.add_(part)


def ring_backward(g, plan, q, k, v, out, lse, grad_out, grad_lse, backend, *, sinks=None):
    """The gradients of ``ring_loop``. K/V travel around the ring again, each shard followed by
    its dK/dV accumulator (float32): every rank adds what its queries contribute and passes it
    on, and after the last step the accumulator goes back to the shard's owner. With the global
    (out, lse) each block's backward is exact for its keys (``call_attention_backward``).

    Order of messages on a link (rank r-1 -> r), the same on both ends so that backends which
    match point-to-point messages by order (NCCL) agree with those matching by tag (gloo):
    K/V of step t, then the accumulator of step t, then K/V of step t + 1, ... The last rank to
    need a shard sends its accumulator straight to the owner: the next rank after N steps; with
    fewer (``Plan.ring_steps``: sliding windows) a link that carries nothing else.

    Returns (dq, dk, dv, dsinks or None); dsinks is the part of this rank's rows
    (docs/math.md#attention-backward), summed over the ranks like any parameter's gradient.
    """
    import torch

    rank, steps = g.rank, plan.ring_steps
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = (k.contiguous(), v.contiguous())
    sends = []  # accumulator sends in flight; their buffers stay referenced until waited for
    for step in range(steps):
        source = (rank - step) % g.size
        arriving = _empty_shard(plan, kv, source, torch.float32) if step > 0 else ()
        requests = ring_exchange(g, receive=arriving, tag=GRAD_TAG)
        coming = ()
        if step < steps - 1:
            coming = _empty_shard(plan, kv, (source - 1) % g.size)
            requests += ring_exchange(g, send=kv, receive=coming, tag=KV_TAG)
        grads = tuple(torch.zeros_like(t, dtype=torch.float32) for t in kv)
        ring_backward_compute(plan, source, q, kv, out, lse, grad_out, grad_lse, dq, grads, backend)
        wait(requests)
        for acc, part in zip(grads, arriving, strict=False):
            acc.add_(part)
        if step < steps - 1:
            sends += ring_exchange(g, send=grads, tag=GRAD_TAG)
        elif step > 0:  # the last rank to need the shard hands the sum back to its owner
            sends += ring_exchange(g, send=grads, tag=GRAD_TAG, to=-step)
        if coming:
            kv = coming
    if steps > 1:  # from the rank that held this rank's shard last
        grads = _empty_shard(plan, (k, v), rank, torch.float32)
        wait(ring_exchange(g, receive=grads, tag=GRAD_TAG, sender=-(steps - 1)))
    wait(sends)
    dsinks = None
    if sinks is not None:
        d = (grad_out.to(torch.float32) * out.to(torch.float32)).sum(-1) - grad_lse
        weight = torch.exp(sinks.to(torch.float32)[None, :, None] - lse)
        dsinks = (-(weight * d).sum((0, 2))).to(sinks.dtype)
    return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), dsinks
