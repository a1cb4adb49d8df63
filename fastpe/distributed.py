"""Context-parallel attention over ``torch.distributed``: a sequence sharded over the ranks of a
process group (gloo on CPU, NCCL on GPU), attended exactly as if it were on one device.

- ``ring_attention``: every rank keeps its query shard; key/value shards travel around the ring
  with point-to-point ops, the next transfer overlapping the current block's compute, and the
  partial results merge in float32 with ``merge_attention``'s log-sum-exp rule.
- ``all_gather_attention``: all-gather K/V, then attend locally (small K/V: few kv heads).
- ``sharded_kv_decode_attention``: decoding against a KV cache sharded over the ranks.
- ``shard_sequence`` / ``unshard_sequence`` / ``shard_positions``: the two layouts, contiguous
  (rank r holds the r-th chunk) and zigzag (rank r holds chunks r and 2N-1-r of 2N, which
  balances causal work).

Cost model, layouts and a ``torchrun`` example: docs/distributed.md. Importing this module does
not import torch; calling any function does. ``ring_attention`` and ``all_gather_attention``
are differentiable (their backwards are collective too); ``sharded_kv_decode_attention`` is not.
"""

from __future__ import annotations

import functools
import math
import types

import numpy as np

from fastpe._validate import check_choice

LAYOUTS = ("contiguous", "zigzag")

__all__ = [
    "LAYOUTS",
    "all_gather_attention",
    "ring_attention",
    "shard_positions",
    "shard_sequence",
    "sharded_kv_decode_attention",
    "unshard_sequence",
]


# ---------------------------------------------------------------------------------------------
# Layouts


def _check_world(rank, world_size):
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1; got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size = {world_size}); got {rank!r}")


def _zigzag_chunk(seq_len: int, world_size: int, what: str) -> int:
    if seq_len % (2 * world_size):
        raise ValueError(
            f"layout='zigzag' cuts the sequence into 2 x world_size = {2 * world_size} equal "
            f"chunks; {what} {seq_len} is not divisible by {2 * world_size} (pad the sequence, or "
            "use layout='contiguous', which allows uneven shards)"
        )
    return seq_len // (2 * world_size)


def shard_positions(seq_len, rank, world_size, *, layout="contiguous", device=None):
    """Global positions (int64 tensor ``[S_local]``, increasing) of the tokens that ``rank`` holds
    when a sequence of ``seq_len`` is sharded by ``shard_sequence``.

    ``"contiguous"``: rank r holds ``torch.tensor_split``'s r-th chunk (the first ``seq_len % N``
    ranks hold one token more). ``"zigzag"``: the sequence is cut into 2N equal chunks and rank r
    holds chunks r and 2N-1-r; ``seq_len`` must be divisible by 2N.
    """
    import torch

    _check_world(rank, world_size)
    layout = check_choice("layout", layout, LAYOUTS)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be an int >= 0; got {seq_len!r}")
    if layout == "zigzag":
        c = _zigzag_chunk(seq_len, world_size, "seq_len")
        late = 2 * world_size - 1 - rank
        return torch.cat(
            [torch.arange(rank * c, (rank + 1) * c), torch.arange(late * c, (late + 1) * c)]
        ).to(device)
    base, extra = divmod(seq_len, world_size)
    start = rank * base + min(rank, extra)
    return torch.arange(start, start + base + (rank < extra), device=device)


def shard_sequence(x, rank, world_size, *, layout="contiguous", dim=2):
    """The shard of ``x`` (a tensor, sequence along ``dim``; 2 for ``[B, H, S, D]``) that ``rank``
    holds in ``layout``: the tokens at ``shard_positions(x.shape[dim], rank, world_size)``."""
    _check_world(rank, world_size)
    layout = check_choice("layout", layout, LAYOUTS)
    seq_len = x.shape[dim]
    if layout == "contiguous":
        return x.tensor_split(world_size, dim=dim)[rank]
    c = _zigzag_chunk(seq_len, world_size, f"x.shape[{dim}] =")
    import torch

    late = 2 * world_size - 1 - rank
    return torch.cat([x.narrow(dim, rank * c, c), x.narrow(dim, late * c, c)], dim=dim)


def unshard_sequence(shards, *, layout="contiguous", dim=2):
    """Inverse of ``shard_sequence``: the full sequence from the list of every rank's shard (in
    rank order). Contiguous shards may be uneven; zigzag shards must have equal, even lengths."""
    import torch

    layout = check_choice("layout", layout, LAYOUTS)
    shards = list(shards)
    if not shards:
        raise ValueError("shards must be a non-empty list of tensors, one per rank")
    if layout == "contiguous":
        return torch.cat(shards, dim=dim)
    lengths = {s.shape[dim] for s in shards}
    if len(lengths) != 1 or next(iter(lengths)) % 2:
        raise ValueError(
            f"zigzag shards must all have one even length along dim {dim}; got "
            f"{[s.shape[dim] for s in shards]}"
        )
    c = next(iter(lengths)) // 2
    early = [s.narrow(dim, 0, c) for s in shards]
    late = [s.narrow(dim, c, c) for s in reversed(shards)]
    return torch.cat(early + late, dim=dim)


# ---------------------------------------------------------------------------------------------
# Agreement across ranks: every check whose failure could leave other ranks waiting in a
# collective is decided from gathered data, so all ranks raise together instead of hanging.


class _Group:
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


@functools.cache
def _collective_function():
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
def _gather_function():
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


def _without_backward(name, compute, inputs, why):
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


def _check_backend(inputs, backend) -> None:
    """The backend this rank's blocks will run on (``backend=``, then ``use_backend``, then
    $FASTPE_BACKEND, then automatic), checked against this rank's inputs inside the agreement
    round: a name that does not exist, or a backend that cannot run these inputs, then raises on
    every rank instead of in this rank's first block while the others wait for its messages.
    Each rank may choose its own backend: the choice changes no communication."""
    from fastpe import dispatch

    dispatch.select(inputs, backend)


def _records_gradients(*tensors) -> bool:
    import torch

    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


# ---------------------------------------------------------------------------------------------
# Validation shared by ring_attention and all_gather_attention


class _Plan:
    """What every rank agreed on: lengths and positions of every shard, and the options.

    One ``all_gather_object`` round: each rank validates its own arguments and sends a summary
    (or its error); every later check reads only the gathered summaries, so all ranks reach the
    same verdict without further communication.
    """

    def __init__(
        self,
        g,
        q,
        k,
        v,
        *,
        causal,
        key_lengths,
        scale,
        rope,
        alibi_slopes,
        mask,
        relative_bias,
        window,
        softcap,
        sinks,
        layout,
        backend,
        name,
    ):
        import torch

        from fastpe._inputs import AttentionInputs, _check_key_lengths
        from fastpe._options import check_window

        self.g = g

        def local():
            if mask is not None:
                raise ValueError(
                    f"{name} does not take mask: an arbitrary [Sq, Sk] mask does not shard with "
                    "the sequence. Use causal=True and key_lengths (global lengths), which it "
                    "supports across shards"
                )
            if relative_bias is not None:
                raise ValueError(
                    f"{name} does not support relative_bias (T5): use fastpe.attention on one "
                    "device; supported across shards are GQA, causal, key_lengths, rope, "
                    "alibi_slopes, window, softcap and sinks"
                )
            for arg, t in (("q", q), ("k", k), ("v", v)):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{name} takes torch tensors; got {arg}: {type(t).__name__}")
            check_choice("layout", layout, LAYOUTS)
            tables = {"alibi_slopes": alibi_slopes}
            if isinstance(rope, dict):
                tables.update({f"rope[{key!r}]": rope.get(key) for key in ("cos", "sin")})
            for arg, t in tables.items():
                if torch.is_grad_enabled() and isinstance(t, torch.Tensor) and t.requires_grad:
                    raise ValueError(
                        f"{name} gives no gradient for {arg}, which requires grad: pass it "
                        "detached (.detach()), or run under torch.no_grad()"
                    )
            if rope is not None:
                from fastpe._options import Rope

                Rope.check_keys(rope)
                given = sorted({"q_positions", "k_positions"} & set(rope))
                if given:
                    raise ValueError(
                        f"rope[{given[0]!r}] cannot be given to {name}: each shard's global "
                        "positions come from the layout (see shard_positions)"
                    )
            inputs = AttentionInputs.build(
                q,
                k,
                v,
                causal=causal,
                causal_alignment="top_left",
                mask=None,
                key_lengths=None,
                scale=scale,
                rope=rope,
                alibi_slopes=alibi_slopes,
                relative_bias=None,
                return_lse=True,
                window=window,
                softcap=softcap,
                sinks=sinks,
            )
            _check_backend(inputs, backend)
            if q.shape[2] != k.shape[2]:
                raise ValueError(
                    f"{name} shards one sequence: q and k/v must hold the same tokens on each "
                    f"rank; got q with {q.shape[2]} and k/v with {k.shape[2]} positions"
                )
            if q.shape[2] == 0:
                raise ValueError(f"{name}: every rank must hold at least one token; got 0")
            kl = None
            if key_lengths is not None:  # the range against the global length is checked below
                kl = _check_key_lengths(key_lengths, q.shape[0], 2**62).tolist()
            slopes = None if alibi_slopes is None else torch.as_tensor(alibi_slopes).tolist()
            sink_values = None if sinks is None else torch.as_tensor(sinks).tolist()
            table = None if rope is None else tuple(inputs.options.rope.cos.shape)
            return {
                "shape": (
                    tuple(q.shape[:2]) + tuple(q.shape[3:]),
                    tuple(k.shape[:2]) + tuple(k.shape[3:]),
                    tuple(v.shape[3:]),
                ),
                "seq": q.shape[2],
                "dtype": str(q.dtype),
                "device": q.device.type,
                # a rank that records gradients runs the collective backward; one that does not
                # never joins it, and the others would wait for it
                "grad": _records_gradients(q, k, v, sinks),
                "options": (
                    bool(causal),
                    layout,
                    inputs.options.scale,
                    table,
                    kl,
                    slopes,
                    # the global window: inputs.window is cut to this shard's length (a side
                    # wider than the shard is unbounded there, not across the whole sequence)
                    check_window(window),
                    inputs.options.softcap,
                    sink_values,
                    None if rope is None else inputs.options.rope.interleaved,
                ),
            }

        reports = g.agree(local)
        for key in ("shape", "dtype", "device", "grad", "options"):
            for rank, report in enumerate(reports):
                if report[key] != reports[0][key]:
                    what = {
                        "shape": "shapes (B, H, D of q; B, Hkv, D of k; Dv of v)",
                        "grad": "gradient recording (whether autograd records q, k, v or sinks: "
                        "the backward is collective, every rank must run it)",
                        "options": "options (causal, layout, scale, rope table shape, "
                        "key_lengths, alibi_slopes, window, softcap, sinks, rope interleaved)",
                    }.get(key, key)
                    raise ValueError(
                        f"{name}: every rank must pass the same {what} except the sequence "
                        f"length; rank 0 has {reports[0][key]}, rank {rank} has {report[key]}"
                    )
        self.seqs = [r["seq"] for r in reports]
        if layout == "zigzag" and (len(set(self.seqs)) != 1 or self.seqs[0] % 2):
            raise ValueError(
                f"{name} with layout='zigzag' needs one even shard length on every rank (a "
                f"sequence divisible by 2 x world_size = {2 * g.size}); got shard lengths "
                f"{self.seqs}"
            )
        self.total = total = sum(self.seqs)
        _, _, self.scale, table, kl, _, self.window, self.softcap, _, _ = reports[0]["options"]
        if kl is not None and max(kl) > total:
            raise IndexError(
                f"key_lengths contains {max(kl)}, more than the global sequence length {total} "
                f"(the sum of the ranks' shards {self.seqs})"
            )
        if table is not None and table[0] < total:
            raise IndexError(
                f"rope['cos'] has {table[0]} rows, but the global positions of the sharded "
                f"sequence go up to {total - 1}: the table must cover the whole sequence"
            )
        self.layout = layout
        self.causal = bool(causal)
        if layout == "zigzag":
            c = self.seqs[0] // 2
            starts = [(r * c, (2 * g.size - 1 - r) * c) for r in range(g.size)]
            host = [np.r_[a : a + c, b : b + c] for a, b in starts]
        else:
            host = [np.arange(sum(self.seqs[:r]), sum(self.seqs[: r + 1])) for r in range(g.size)]
        self.positions = [_Span(h, torch.as_tensor(h, device=q.device)) for h in host]
        self.everything = _Span(np.arange(total), torch.arange(total, device=q.device))
        self.longest_key = None if kl is None else max(kl)
        self.key_lengths = None if kl is None else torch.tensor(kl, device=q.device)
        self.rope = rope
        self.alibi = (
            None
            if alibi_slopes is None
            else torch.as_tensor(alibi_slopes, device=q.device, dtype=torch.float32)
        )

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
                    not _nothing_visible(self, q[rows], k[keys])
                    for rows, keys, _ in _ring_blocks(self, rank, source)
                ):
                    return step + 1
        return 1


class _Span:
    """Global positions of some tokens (increasing): on the host, where the blocks are planned
    without a device sync, and on the device, where the kernels read them."""

    def __init__(self, host, device):
        self.host, self.device = host, device

    def __getitem__(self, part: slice) -> _Span:
        return _Span(self.host[part], self.device[part])


def _nothing_visible(plan, qh, kh) -> bool:
    """Whether no query at host positions ``qh`` may see any key at ``kh`` (both increasing):
    no keys, all of them padding, or all outside every query's window. Decided on the host,
    identically on every rank."""
    if len(kh) == 0 or (plan.longest_key is not None and kh[0] >= plan.longest_key):
        return True
    left, right = plan.window or (-1, -1)
    return (left >= 0 and kh[-1] < qh[0] - left) or (right >= 0 and kh[0] > qh[-1] + right)


def _block_options(plan, q_at, k_at, *, causal):
    """``fastpe.attention``'s options for one block: queries at ``q_at`` against keys at
    ``k_at`` (``_Span``s), or None when no key of the block is allowed.

    ``causal`` is the global rule kpos[j] <= qpos[i]: the kernel's own causal rule (top-left)
    for a block of the same tokens as its queries, a boolean mask otherwise.
    """
    import torch

    if _nothing_visible(plan, q_at.host, k_at.host):
        return None
    qpos, kpos = q_at.device, k_at.device
    key_lengths = None
    if plan.key_lengths is not None:
        # keys are at increasing positions, so those before the global length form a prefix
        key_lengths = (kpos[None, :] < plan.key_lengths[:, None]).sum(1)
    rope = None
    if plan.rope is not None:
        rope = {**plan.rope, "q_positions": qpos, "k_positions": kpos}
    allowed = []  # boolean [Sq_block, Sk_block] rules the kernel cannot apply to local indices
    same_tokens = np.array_equal(q_at.host, k_at.host)
    if causal and not same_tokens:
        allowed.append(kpos[None, :] <= qpos[:, None])
        causal = False
    window = None
    if plan.window is not None:
        left, right = plan.window
        qh = q_at.host
        if same_tokens and qh[-1] - qh[0] == len(qh) - 1:
            window = plan.window  # consecutive positions: local distances are the global ones
        else:
            distance = qpos[:, None] - kpos[None, :]
            if left >= 0:
                allowed.append(distance <= left)
            if right >= 0:
                allowed.append(distance >= -right)
    mask = None
    if plan.alibi is not None:
        # ALiBi needs the global distance |qpos - kpos|, which a block's local indices do not
        # carry: an additive mask [B or 1, Hq, Sq_block, Sk_block] holds it
        distance = (qpos[:, None] - kpos[None, :]).abs().to(torch.float32)
        slopes = plan.alibi if plan.alibi.ndim == 2 else plan.alibi[None]
        mask = -slopes[:, :, None, None] * distance
    if allowed:
        allowed = functools.reduce(torch.logical_and, allowed)
        mask = allowed[None, None] if mask is None else mask.masked_fill(~allowed, -math.inf)
    return dict(
        causal=causal,
        causal_alignment="top_left",
        key_lengths=key_lengths,
        scale=plan.scale,
        rope=rope,
        mask=mask,
        alibi_slopes=None,
        relative_bias=None,
        window=window,
        softcap=plan.softcap,
    )


def _attend(plan, q, k, v, q_at, k_at, *, causal, backend, sinks=None):
    """One block's (out, lse) (``_block_options``), or None when no key of it is allowed."""
    import fastpe

    options = _block_options(plan, q_at, k_at, causal=causal)
    if options is None:
        return None
    return fastpe.attention(q, k, v, **options, sinks=sinks, return_lse=True, backend=backend)


def _merge_into(acc_out, acc_lse, out, lse):
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


def _merge_sinks(acc_out, acc_lse, sinks):
    """The sinks (one logit per head, no value) as one more part: out 0, lse = the sink."""
    import torch

    sink_lse = torch.as_tensor(sinks, device=acc_lse.device).to(torch.float32)
    _merge_into(
        acc_out, acc_lse, torch.zeros_like(acc_out), sink_lse[None, :, None].expand_as(acc_lse)
    )


# ---------------------------------------------------------------------------------------------
# Ring attention


def _ring_blocks(plan, rank, source):
    """The blocks rank ``rank`` computes with the K/V shard of ``source``: a list of
    (query slice, key slice, causal). Causal blocks entirely in the future are left out."""
    n = plan.seqs[rank]
    if not plan.causal:
        return [(slice(0, n), slice(0, plan.seqs[source]), False)]
    if source == rank:  # the same positions on both sides: the local causal rule is exact
        return [(slice(0, n), slice(0, n), True)]
    if plan.layout == "contiguous":
        return [(slice(0, n), slice(0, plan.seqs[source]), False)] if source < rank else []
    c = n // 2
    # zigzag: rank r holds chunks (r, 2N-1-r). An earlier source's first chunk precedes both of
    # ours and its second follows both; a later source's chunks both lie between ours.
    if source < rank:
        return [(slice(0, n), slice(0, c), False)]
    return [(slice(c, n), slice(0, n), False)]


def _ring_compute(plan, q, k, v, acc_out, acc_lse, source, backend):
    qpos, kpos = plan.positions[plan.g.rank], plan.positions[source]
    for rows, keys, causal in _ring_blocks(plan, plan.g.rank, source):
        part = _attend(
            plan,
            q[:, :, rows],
            k[:, :, keys],
            v[:, :, keys],
            qpos[rows],
            kpos[keys],
            causal=causal,
            backend=backend,
        )
        if part is not None:
            _merge_into(acc_out[:, :, rows], acc_lse[:, :, rows], *part)


# Point-to-point tags: K/V and the dK/dV accumulators of the backward travel the same links in
# interleaved order; distinct tags keep a receive from matching the other kind of message.
_KV_TAG, _GRAD_TAG = 1, 2


def _ring_exchange(g, *, send=(), receive=(), tag, to=1, sender=1):
    """Post sends of ``send`` to rank ``to`` places further along the ring (the next one by
    default) and receives into ``receive`` (allocated by the caller) from rank ``sender``
    places back (the previous one); returns the requests without waiting."""
    dist = g.dist
    nxt = g.global_rank((g.rank + to) % g.size)
    prev = g.global_rank((g.rank - sender) % g.size)
    ops = [dist.P2POp(dist.isend, t, nxt, g.group, tag) for t in send]
    ops += [dist.P2POp(dist.irecv, t, prev, g.group, tag) for t in receive]
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(requests):
    for request in requests:
        request.wait()


def ring_attention(
    q,
    k,
    v,
    *,
    group=None,
    causal=False,
    key_lengths=None,
    scale=None,
    rope=None,
    alibi_slopes=None,
    window=None,
    softcap=None,
    sinks=None,
    mask=None,
    relative_bias=None,
    return_lse=False,
    layout="contiguous",
    backend=None,
):
    """Exact attention over a sequence sharded across the ranks of ``group``; each rank passes
    its shard and gets the shard of the full result (docs/distributed.md).

    ``q`` [B, Hq, S_r, D], ``k`` [B, Hkv, S_r, D], ``v`` [B, Hkv, S_r, Dv]: rank r's tokens of one
    sequence (self-attention: q and k/v hold the same positions). ``layout="contiguous"``: rank r
    holds the r-th chunk, chunks may be uneven (S_r >= 1 each); ``"zigzag"``: chunks r and
    2N-1-r of 2N equal chunks (``shard_sequence``), which evens out causal work. Returns
    ``out`` [B, Hq, S_r, Dv] in q's dtype (and ``lse`` [B, Hq, S_r] float32 with
    ``return_lse=True``) equal to ``fastpe.attention`` on the unsharded tensors, sharded alike.

    Options, all with their global meaning: ``causal`` (each query at its global position, as
    ``fastpe.attention(..., causal_alignment="top_left")`` on the whole sequence; with right
    padding by ``key_lengths`` that is the prefill rule), ``key_lengths`` [B] (global lengths),
    ``scale``,
    ``rope=dict(cos=, sin=, interleaved=)`` (the table must cover the global positions, which
    come from the layout), ``alibi_slopes`` [Hq] or [B, Hq] (applied through an additive
    [B, Hq, S_r, S_s] mask per block), ``window=(left, right)`` (global distances; blocks wholly
    outside every query's window are skipped), ``softcap``, GQA. ``mask`` and ``relative_bias``
    are refused.
    Every rank must pass the same options and shapes except S_r and record gradients alike; a
    mismatch, or a backend choice one rank cannot use, raises on all ranks.

    Differentiable in q, k and v: the backward is a second ring pass in which each K/V shard
    travels with its dK/dV accumulator and arrives back at its owner. Like the forward it is
    collective: every rank of the group must run it (as with DistributedDataParallel).
    """
    g = _Group(group)
    plan = _Plan(
        g,
        q,
        k,
        v,
        causal=causal,
        key_lengths=key_lengths,
        scale=scale,
        rope=rope,
        alibi_slopes=alibi_slopes,
        mask=mask,
        relative_bias=relative_bias,
        window=window,
        softcap=softcap,
        sinks=sinks,
        layout=layout,
        backend=backend,
        name="ring_attention",
    )
    run = types.SimpleNamespace(
        forward=lambda q, k, v, sinks: _ring_loop(g, plan, q, k, v, backend, sinks=sinks),
        backward=lambda q, k, v, sinks, *rest: _ring_backward(
            g, plan, q, k, v, *rest, backend, sinks=sinks
        ),
    )
    out, lse = _collective_function().apply(run, q, k, v, sinks)
    return (out, lse) if return_lse else out


def _ring_loop(g, plan, q, k, v, backend, *, sinks=None, overlap=True):
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
            requests = _ring_exchange(g, send=kv, receive=coming, tag=_KV_TAG)
        if overlap:
            _ring_compute(plan, q, kv[0], kv[1], acc_out, acc_lse, source, backend)
        _wait(requests)
        if not overlap:
            _ring_compute(plan, q, kv[0], kv[1], acc_out, acc_lse, source, backend)
        if coming is not None:
            kv = tuple(coming)
    if sinks is not None:
        _merge_sinks(acc_out, acc_lse, sinks)
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


def _ring_backward_compute(plan, source, q, kv, out, lse, grad_out, grad_lse, dq, grads, backend):
    """Adds to ``dq`` and to ``grads`` (source's dK, dV) what this rank's queries contribute."""
    from fastpe import torch_ops

    qpos, kpos = plan.positions[plan.g.rank], plan.positions[source]
    for rows, keys, causal in _ring_blocks(plan, plan.g.rank, source):
        options = _block_options(plan, qpos[rows], kpos[keys], causal=causal)
        if options is None:
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
            **options,
        )
        for acc, part in zip(
            (dq[:, :, rows], grads[0][:, :, keys], grads[1][:, :, keys]), parts, strict=True
        ):
            acc.add_(part)


def _ring_backward(g, plan, q, k, v, out, lse, grad_out, grad_lse, backend, *, sinks=None):
    """The gradients of ``_ring_loop``. K/V travel around the ring again, each shard followed by
    its dK/dV accumulator (float32): every rank adds what its queries contribute and passes it
    on, and after the last step the accumulator goes back to the shard's owner. With the global
    (out, lse) each block's backward is exact for its keys (``call_attention_backward``).

    Order of messages on a link (rank r-1 -> r), the same on both ends so that backends which
    match point-to-point messages by order (NCCL) agree with those matching by tag (gloo):
    K/V of step t, then the accumulator of step t, then K/V of step t + 1, ... The last rank to
    need a shard sends its accumulator straight to the owner: the next rank after N steps; with
    fewer (``_Plan.ring_steps``: sliding windows) a link that carries nothing else.

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
        requests = _ring_exchange(g, receive=arriving, tag=_GRAD_TAG)
        coming = ()
        if step < steps - 1:
            coming = _empty_shard(plan, kv, (source - 1) % g.size)
            requests += _ring_exchange(g, send=kv, receive=coming, tag=_KV_TAG)
        grads = tuple(torch.zeros_like(t, dtype=torch.float32) for t in kv)
        _ring_backward_compute(
            plan, source, q, kv, out, lse, grad_out, grad_lse, dq, grads, backend
        )
        _wait(requests)
        for acc, part in zip(grads, arriving, strict=False):
            acc.add_(part)
        if step < steps - 1:
            sends += _ring_exchange(g, send=grads, tag=_GRAD_TAG)
        elif step > 0:  # the last rank to need the shard hands the sum back to its owner
            sends += _ring_exchange(g, send=grads, tag=_GRAD_TAG, to=-step)
        if coming:
            kv = coming
    if steps > 1:  # from the rank that held this rank's shard last
        grads = _empty_shard(plan, (k, v), rank, torch.float32)
        _wait(_ring_exchange(g, receive=grads, tag=_GRAD_TAG, sender=-(steps - 1)))
    _wait(sends)
    dsinks = None
    if sinks is not None:
        d = (grad_out.to(torch.float32) * out.to(torch.float32)).sum(-1) - grad_lse
        weight = torch.exp(sinks.to(torch.float32)[None, :, None] - lse)
        dsinks = (-(weight * d).sum((0, 2))).to(sinks.dtype)
    return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), dsinks


# ---------------------------------------------------------------------------------------------
# All-gather attention


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

    return _gather_function().apply(g, assemble, take, x)


def _visible_keys(plan, qpos) -> slice:
    """The global key range that queries at (increasing, host) positions ``qpos`` can see under
    causal masking and the window."""
    start, end = 0, plan.total
    left, right = plan.window or (-1, -1)
    if plan.causal:
        end = int(qpos[-1]) + 1
    if right >= 0:
        end = min(end, int(qpos[-1]) + right + 1)
    if left >= 0:
        start = max(0, int(qpos[0]) - left)
    return slice(start, max(start, end))


def all_gather_attention(
    q,
    k,
    v,
    *,
    group=None,
    causal=False,
    key_lengths=None,
    scale=None,
    rope=None,
    alibi_slopes=None,
    window=None,
    softcap=None,
    sinks=None,
    mask=None,
    relative_bias=None,
    return_lse=False,
    layout="contiguous",
    backend=None,
):
    """``ring_attention``'s contract (same arguments, same result) computed by all-gathering K
    and V first and attending locally: one collective instead of N-1 ring steps, at the memory
    cost of the whole K/V on every rank. For small K/V (few kv heads, short sequences).
    Differentiable; the backward sums each K/V gradient over the ranks with one all_reduce (of
    the whole sequence's dK/dV) and, like the forward, must run on every rank."""
    import torch

    g = _Group(group)
    plan = _Plan(
        g,
        q,
        k,
        v,
        causal=causal,
        key_lengths=key_lengths,
        scale=scale,
        rope=rope,
        alibi_slopes=alibi_slopes,
        mask=mask,
        relative_bias=relative_bias,
        window=window,
        softcap=softcap,
        sinks=sinks,
        layout=layout,
        backend=backend,
        name="all_gather_attention",
    )

    # recorded by autograd as it runs: the gathers and fastpe.attention have backwards
    key_all, value_all = _gather_sequence(g, plan, k), _gather_sequence(g, plan, v)
    qpos = plan.positions[g.rank]
    n = q.shape[2]
    # zigzag's two chunks see different key prefixes under causal masking: one call each
    zigzag = plan.causal and plan.layout == "zigzag"
    pieces = [slice(0, n // 2), slice(n // 2, n)] if zigzag else [slice(0, n)]
    outs, lses = [], []
    for rows in pieces:
        keys = _visible_keys(plan, qpos.host[rows])
        part = _attend(
            plan,
            q[:, :, rows],
            key_all[:, :, keys],
            value_all[:, :, keys],
            qpos[rows],
            plan.everything[keys],
            causal=plan.causal,
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
    out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Decoding against a sharded KV cache


def sharded_kv_decode_attention(
    q,
    k_cache_shard,
    v_cache_shard,
    *,
    group=None,
    cache_lengths=None,
    scale=None,
    softcap=None,
    sinks=None,
    return_lse=False,
    backend=None,
):
    """Queries that see a whole KV cache sharded over the ranks (decoding): each rank attends to
    its shard, and the partial results are combined with the lse rule over one ``all_gather``.

    ``q`` [B, Hq, Sq, D], the same on every rank (usually Sq = 1); ``k_cache_shard``
    [B, Hkv, S_r, D] and ``v_cache_shard`` [B, Hkv, S_r, Dv], this rank's part of the cache
    (lengths may differ between ranks); ``cache_lengths`` [B] (optional): how many of this
    rank's S_r slots hold keys, per sequence (the rest is padding, never read). Every query
    attends to every valid key of every shard, with no causal rule and no position bias: keys
    are cached already rotated (RoPE). ``softcap`` applies to every score; ``sinks`` [Hq] join
    the merged result once. Returns ``out`` [B, Hq, Sq, Dv] in q's dtype on every rank (and
    ``lse`` float32 [B, Hq, Sq]); equal to ``fastpe.attention`` on the concatenated valid cache.
    """
    import torch

    from fastpe._inputs import AttentionInputs

    g = _Group(group)

    def local():
        for arg, t in (
            ("q", q),
            ("k_cache_shard", k_cache_shard),
            ("v_cache_shard", v_cache_shard),
        ):
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"sharded_kv_decode_attention takes torch tensors; got {arg}: "
                    f"{type(t).__name__}"
                )
        inputs = AttentionInputs.build(
            q,
            k_cache_shard,
            v_cache_shard,
            causal=False,
            causal_alignment="bottom_right",
            mask=None,
            key_lengths=cache_lengths,
            scale=scale,
            rope=None,
            alibi_slopes=None,
            relative_bias=None,
            return_lse=True,
            softcap=softcap,
            sinks=sinks,
        )
        _check_backend(inputs, backend)
        return {
            "q": tuple(q.shape),
            "kv": (
                k_cache_shard.shape[0],
                k_cache_shard.shape[1],
                k_cache_shard.shape[3],
                v_cache_shard.shape[3],
            ),
            "dtype": str(q.dtype),
            "options": (
                inputs.options.scale,
                inputs.options.softcap,
                None if sinks is None else torch.as_tensor(sinks).tolist(),
            ),
        }

    reports = g.agree(local)
    for key, what in (
        ("q", "q shape"),
        ("kv", "cache shape (B, Hkv, D, Dv)"),
        ("dtype", "dtype"),
        ("options", "scale, softcap and sinks"),
    ):
        for rank, r in enumerate(reports):
            if r[key] != reports[0][key]:
                raise ValueError(
                    f"sharded_kv_decode_attention: every rank must pass the same {what}; "
                    f"rank 0 has {reports[0][key]}, rank {rank} has {r[key]}"
                )

    def compute():
        import fastpe

        out, lse = fastpe.attention(
            q,
            k_cache_shard,
            v_cache_shard,
            key_lengths=cache_lengths,
            scale=scale,
            softcap=softcap,
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
            _merge_into(acc_out, acc_lse, part[..., :-1], part[..., -1])
        if sinks is not None:
            _merge_sinks(acc_out, acc_lse, sinks)
        return acc_out.to(q.dtype), acc_lse

    out, lse = _without_backward(
        "sharded_kv_decode_attention",
        compute,
        (q, k_cache_shard, v_cache_shard),
        "it is for decoding, and every rank holds the whole result, so a gradient would have to "
        "say whose loss counts. Run it under torch.no_grad(); for training, ring_attention and "
        "all_gather_attention have backwards.",
    )
    return (out, lse) if return_lse else out
