"""The process-group layer: the group a call runs on, the agreement round that makes every rank
raise together, the autograd Functions around collectives, and point-to-point exchanges around
the ring. Agreement: every check whose failure could leave other ranks waiting in a collective
is decided from gathered data, so all ranks raise together instead of hanging."""

from __future__ import annotations

import functools


class Group:
    """The process group a call runs on (``group=``; None for the default group), checked, with
    this rank's place in it."""

    def __init__(self, group):
        import torch.distributed as dist

        if not dist.is_available():
            raise RuntimeError("fastpe.distributed needs torch.distributed, which this torch lacks")
        if not dist.is_initialized():
            raise RuntimeError(
                "fastpe.distributed needs an initialised process group: call "
                "torch.distributed.init_process_group('gloo' or 'nccl', ...) first (torchrun sets "
                "the environment for it)"
            )
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"group must be None (the default group) or a torch.distributed.ProcessGroup; got "
                f"{type(group).__name__}"
            )
        self.dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def global_rank(self, rank: int) -> int:
        if self.group is None:
            return rank
        return self.dist.get_global_rank(self.group, rank)

    def gather_objects(self, obj) -> list:
        out = [None] * self.size
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def agree(self, check) -> list:
        """Run ``check()`` here and gather every rank's result in one round; if it failed on any
        rank, raise on every rank (the failing one re-raises its own error)."""
        try:
            result, error = check(), None
        except Exception as exc:  # any failure here must reach the other ranks, or they hang
            result, error = None, exc
        reports = self.gather_objects(
            (result, None if error is None else (type(error).__name__, str(error)))
        )
        if error is not None:
            raise error
        from fastpe.dispatch import BackendNotSupportedError

        kinds = {
            "TypeError": TypeError,
            "IndexError": IndexError,
            "BackendNotSupportedError": BackendNotSupportedError,
        }
        for rank, (_, report) in enumerate(reports):
            if report is not None:
                kind = kinds.get(report[0], ValueError)
                raise kind(f"rank {rank} of the process group rejected its inputs: {report[1]}")
        return [r for r, _ in reports]

    @staticmethod
    def require_same(reports, name, *, but=""):
        """Raise where an entry of the agreed ``reports`` (dicts keyed by the words the error
        uses for each entry) differs between ranks: on every rank, as all hold the same
        reports."""
        for what in reports[0]:
            for rank, report in enumerate(reports):
                if report[what] != reports[0][what]:
                    raise ValueError(
                        f"{name}: every rank must pass the same {what}{but}; rank 0 has "
                        f"{reports[0][what]}, rank {rank} has {report[what]}"
                    )


@functools.cache
def collective_function():
    """An autograd Function around a collective forward/backward pair (built on first use: this
    module must not import torch at import time)."""
    import torch

    class Collective(torch.autograd.Function):
        """``run.forward(*inputs) -> outputs``; ``run.backward(*inputs, *outputs, *grads)`` -> one
        gradient per input (None for an input that is None)."""

        @staticmethod
        def forward(ctx, run, *inputs):
            outputs = run.forward(*inputs)
            ctx.run = run
            ctx.save_for_backward(*inputs, *outputs)
            return outputs

        @staticmethod
        def backward(ctx, *grads):
            return (None, *ctx.run.backward(*ctx.saved_tensors, *grads))

    return Collective


@functools.cache
def gather_function():
    """All-gather whose backward sums the gradients of the gathered tensor over the ranks (one
    all_reduce) and hands each rank the part of its own contribution."""
    import torch

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, g, assemble, take, x):
            ctx.g, ctx.take = g, take
            parts = [torch.empty_like(x) for _ in range(g.size)]
            g.dist.all_gather(parts, x.contiguous(), group=g.group)
            return assemble(parts)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous()
            ctx.g.dist.all_reduce(grad, group=ctx.g.group)
            return None, None, None, ctx.take(grad)

    return Gather


def without_backward(name, compute, inputs, why):
    """Run ``compute()`` without recording; if autograd would record an input, the outputs get a
    backward that raises fastpe's no-backward error saying ``why`` (the forward still runs)."""
    import torch

    with torch.no_grad():
        outputs = compute()
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return outputs
    from fastpe.torch_ops import _no_backward

    class NoBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            return tuple(o.clone() for o in outputs)

        backward = staticmethod(_no_backward(f"distributed.{name}", why))

    return NoBackward.apply(*inputs)


def records_gradients(*tensors) -> bool:
    import torch

    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


def ring_exchange(g, *, send=(), receive=(), tag, to=1, sender=1):
    """Post sends of ``send`` to rank ``to`` places further along the ring (the next one by
    default) and receives into ``receive`` (allocated by the caller) from rank ``sender``
    places back (the previous one); returns the requests without waiting."""
    dist = g.dist
    nxt = g.global_rank((g.rank + to) % g.size)
    prev = g.global_rank((g.rank - sender) % g.size)
    ops = [dist.P2POp(dist.isend, t, nxt, g.group, tag) for t in send]
    ops += [dist.P2POp(dist.irecv, t, prev, g.group, tag) for t in receive]
    return dist.batch_isend_irecv(ops) if ops else []


def wait(requests):
    for request in requests:
        request.wait()
