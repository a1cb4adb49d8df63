"""The plan of a sharded sequence that every rank agrees on: each shard's length and global
positions, the options (``BlockOptions``), and from them the blocks each rank computes with each
shard, how many ring steps are needed, and how partial results merge."""

from __future__ import annotations

import functools

import numpy as np

from fastpe.distributed._group import records_gradients
from fastpe.distributed._layout import layout_positions

_GRAD = (
    "gradient recording (whether autograd records q, k, v or sinks: the backward is collective, "
    "every rank must run it)"
)


class Span:
    """Global positions of some tokens (increasing): on the host, where the blocks are planned
    without a device sync, and on the device, where the kernels read them."""

    def __init__(self, host, device):
        self.host, self.device = host, device

    def __getitem__(self, part: slice) -> Span:
        return Span(self.host[part], self.device[part])


class Plan:
    """What every rank agreed on: lengths and positions of every shard, and the options.

    One ``all_gather_object`` round: each rank validates its own arguments (``options``, an
    ``Options``) and sends a summary (or its error); every later check reads only the gathered
    summaries, so all ranks reach the same verdict without further communication.
    """

    def __init__(self, g, q, k, v, options, *, layout, backend):
        import torch

        self.g = g
        name = options.name

        def local():
            summary = options.check(q, k, v, layout=layout, backend=backend)
            if q.shape[2] != k.shape[2]:
                raise ValueError(
                    f"{name} shards one sequence: q and k/v must hold the same tokens on each "
                    f"rank; got q with {q.shape[2]} and k/v with {k.shape[2]} positions"
                )
            if q.shape[2] == 0:
                raise ValueError(f"{name}: every rank must hold at least one token; got 0")
            return (
                q.shape[2],
                {  # keyed by the words of the error if ranks differ
                    "shapes (B, H, D of q; B, Hkv, D of k; Dv of v)": (
                        tuple(q.shape[:2]) + tuple(q.shape[3:]),
                        tuple(k.shape[:2]) + tuple(k.shape[3:]),
                        tuple(v.shape[3:]),
                    ),
                    "dtype": str(q.dtype),
                    "device": q.device.type,
                    # a rank that records gradients runs the collective backward; one that
                    # does not never joins it, and the others would wait for it
                    _GRAD: records_gradients(q, k, v, options.sinks),
                    options.AGREED: summary,
                },
            )

        reports = g.agree(local)
        same = [report for _, report in reports]
        g.require_same(same, name, but=" except the sequence length")
        self.seqs = [seq for seq, _ in reports]
        if layout == "zigzag" and (len(set(self.seqs)) != 1 or self.seqs[0] % 2):
            raise ValueError(
                f"{name} with layout='zigzag' needs one even shard length on every rank (a "
                f"sequence divisible by 2 x world_size = {2 * g.size}); got shard lengths "
                f"{self.seqs}"
            )
        self.total = total = sum(self.seqs)
        self.layout = layout
        self.options = options.agreed(same[0][options.AGREED], self.seqs, q.device)
        host = layout_positions(layout, self.seqs)
        self.positions = [Span(h, torch.as_tensor(h, device=q.device)) for h in host]
        self.everything = Span(np.arange(total), torch.arange(total, device=q.device))

    def blocks(self, rank, source):
        """The blocks rank ``rank`` computes with the K/V shard of ``source``: a list of
        (query slice, key slice, causal). Causal blocks entirely in the future are left out."""
        n = self.seqs[rank]
        if not self.options.causal:
            return [(slice(0, n), slice(0, self.seqs[source]), False)]
        if source == rank:  # the same positions on both sides: the local causal rule is exact
            return [(slice(0, n), slice(0, n), True)]
        if self.layout == "contiguous":
            return [(slice(0, n), slice(0, self.seqs[source]), False)] if source < rank else []
        c = n // 2
        # zigzag: rank r holds chunks (r, 2N-1-r). An earlier source's first chunk precedes both
        # of ours and its second follows both; a later source's chunks both lie between ours.
        if source < rank:
            return [(slice(0, n), slice(0, c), False)]
        return [(slice(c, n), slice(0, n), False)]

    @functools.cached_property
    def ring_steps(self) -> int:
        """How many ring steps any rank needs: 1 + the furthest distance around the ring at which
        some rank still sees some key of another's shard. Usually N; with a sliding window (or
        shards that are all padding) the ring stops, and its transfers with it, once every
        visible key has been seen."""
        size = self.g.size
        for step in reversed(range(1, size)):
            for rank in range(size):
                source = (rank - step) % size
                q, k = self.positions[rank].host, self.positions[source].host
                if any(
                    not self.options.nothing_visible(q[rows], k[keys])
                    for rows, keys, _ in self.blocks(rank, source)
                ):
                    return step + 1
        return 1


# ---------------------------------------------------------------------------------------------
# Merging partial results


def merge_into(acc_out, acc_lse, out, lse):
    """merge_attention's rule in place, in float32: lse = logaddexp(lse_acc, lse_part) and
    out = out_acc·exp(lse_acc - lse) + out_part·exp(lse_part - lse); rows empty on both sides
    (lse = -inf) keep out = 0 instead of 0·exp(nan)."""
    import torch

    lse = lse.to(torch.float32)
    new = torch.logaddexp(acc_lse, lse)
    empty = torch.isneginf(new)
    w_acc = torch.where(empty, 0.0, torch.exp(acc_lse - new))
    w_part = torch.where(empty, 0.0, torch.exp(lse - new))
    acc_out.mul_(w_acc[..., None]).add_(out.to(torch.float32) * w_part[..., None])
    acc_lse.copy_(new)


def merge_sinks(acc_out, acc_lse, sinks):
    """The sinks (one logit per head, no value) as one more part: out 0, lse = the sink."""
    import torch

    sink_lse = torch.as_tensor(sinks, device=acc_lse.device).to(torch.float32)
    merge_into(
        acc_out, acc_lse, torch.zeros_like(acc_out), sink_lse[None, :, None].expand_as(acc_lse)
    )
