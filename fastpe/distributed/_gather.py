"""The collective-gather functions: all-gather attention (all K/V to every rank, then local
attention) and decoding against a KV cache sharded over the ranks (each rank's partial result,
all-gathered and merged)."""

from __future__ import annotations

import math

from fastpe.distributed._group import gather_function, without_backward
from fastpe.distributed._layout import unshard_sequence
from fastpe.distributed._plan import merge_into, merge_sinks


def _gather_sequence(g, plan, x):
    """The whole sequence of ``x`` (sequence on dim 2) in global order, from every rank's shard;
    uneven shards are padded for the collective and cut back. Differentiable: the gradient of
    the whole sequence is summed over the ranks and each rank keeps its own tokens' part."""
    import torch

    padding = max(plan.seqs) - x.shape[2]
    if padding:
        x = torch.cat([x, x.new_zeros((*x.shape[:2], padding, x.shape[3]))], dim=2)

    def assemble(parts):
        parts = [p[:, :, :n] for p, n in zip(parts, plan.seqs, strict=True)]
        return unshard_sequence(parts, layout=plan.layout)

    def take(grad):
        own = grad.index_select(2, plan.positions[g.rank].device)
        return torch.cat([own, own.new_zeros((*own.shape[:2], padding, own.shape[3]))], dim=2)

    return gather_function().apply(g, assemble, take, x)


def attention(plan, q, k, v, sinks, backend):
    """``all_gather_attention``'s (out, lse) on this rank."""
    import torch

    g, options = plan.g, plan.options
    # recorded by autograd as it runs: the gathers and fastpe.attention have backwards
    key_all, value_all = _gather_sequence(g, plan, k), _gather_sequence(g, plan, v)
    qpos = plan.positions[g.rank]
    n = q.shape[2]
    # zigzag's two chunks see different key prefixes under causal masking: one call each
    zigzag = options.causal and plan.layout == "zigzag"
    pieces = [slice(0, n // 2), slice(n // 2, n)] if zigzag else [slice(0, n)]
    outs, lses = [], []
    for rows in pieces:
        keys = options.visible_keys(qpos.host[rows], plan.total)
        part = options.attend(
            q[:, :, rows],
            key_all[:, :, keys],
            value_all[:, :, keys],
            qpos[rows],
            plan.everything[keys],
            causal=options.causal,
            backend=backend,
            sinks=sinks,
        )
        if part is None:  # no key to see: zeros, and lse = the sink (or -inf)
            b, hq, m = q[:, :, rows].shape[:3]
            lse = torch.full((b, hq, m), -math.inf, device=q.device)
            if sinks is not None:
                lse = sinks.to(torch.float32)[None, :, None].expand(b, hq, m)
            part = (q.new_zeros((b, hq, m, v.shape[3])), lse)
        outs.append(part[0])
        lses.append(part[1].to(torch.float32))
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def decode(g, q, k_cache_shard, v_cache_shard, options, backend):
    """``sharded_kv_decode_attention``'s (out, lse), the same on every rank of ``g``."""
    import torch

    def local():  # keyed by the words of the error if ranks differ
        summary = options.check_decode(q, k_cache_shard, v_cache_shard, backend=backend)
        return {
            "q shape": tuple(q.shape),
            "cache shape (B, Hkv, D, Dv)": (
                k_cache_shard.shape[0],
                k_cache_shard.shape[1],
                k_cache_shard.shape[3],
                v_cache_shard.shape[3],
            ),
            "dtype": str(q.dtype),
            options.DECODE_AGREED: summary,
        }

    g.require_same(g.agree(local), options.name)

    def compute():
        import fastpe

        out, lse = fastpe.attention(
            q,
            k_cache_shard,
            v_cache_shard,
            **options.decode_keywords(),
            return_lse=True,
            backend=backend,
        )
        # one collective carries both: [out | lse] in float32
        packed = torch.cat([out.to(torch.float32), lse.to(torch.float32)[..., None]], dim=-1)
        parts = [torch.empty_like(packed) for _ in range(g.size)]
        g.dist.all_gather(parts, packed.contiguous(), group=g.group)
        acc_out = torch.zeros_like(packed[..., :-1])
        acc_lse = torch.full_like(packed[..., -1], -math.inf)
        for part in parts:
            merge_into(acc_out, acc_lse, part[..., :-1], part[..., -1])
        if options.sinks is not None:
            merge_sinks(acc_out, acc_lse, options.sinks)
        return acc_out.to(q.dtype), acc_lse

    return without_backward(
        options.name,
        compute,
        (q, k_cache_shard, v_cache_shard),
        "it is for decoding, and every rank holds the whole result, so a gradient would have to "
        "say whose loss counts. Run it under torch.no_grad(); for training, ring_attention and "
        "all_gather_attention have backwards.",
    )
