"""The public attention functions and the options they accept, checked and carried in one place.

``Options`` holds a call's attention keywords as the user passed them; ``Options.check`` (or
``check_decode``) validates them on one rank inside the agreement round and summarises what
every rank must share; ``Options.agreed`` turns the agreed summary into ``BlockOptions``, which
decides which blocks have visible keys and gives each block's ``fastpe.attention`` keywords.
This module is the only one of the package that knows fastpe's attention records
(``AttentionInputs``, ``Rope``, ``check_window``): a new attention keyword gets its global
meaning here, or is refused by name as ``mask`` and ``relative_bias`` are.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from fastpe._validate import check_choice
from fastpe.distributed import _gather, _ring
from fastpe.distributed._group import Group
from fastpe.distributed._layout import LAYOUTS
from fastpe.distributed._plan import Plan

# ---------------------------------------------------------------------------------------------
# The options


def _check_tensors(name, tensors: dict) -> None:
    import torch

    for arg, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} takes torch tensors; got {arg}: {type(t).__name__}")


def _check_backend(inputs, backend) -> None:
    """The backend this rank's blocks will run on (``backend=``, then ``use_backend``, then
    $FASTPE_BACKEND, then automatic), checked against this rank's inputs inside the agreement
    round: a name that does not exist, or a backend that cannot run these inputs, then raises on
    every rank instead of in this rank's first block while the others wait for its messages.
    Each rank may choose its own backend: the choice changes no communication."""
    from fastpe import dispatch

    dispatch.select(inputs, backend)


@dataclasses.dataclass(frozen=True, eq=False)
class Options:
    """The attention keywords of one distributed call as passed (all but the tensors, the group,
    the layout and the backend); ``name`` is the public function's, for errors."""

    name: str
    causal: bool = False
    key_lengths: object = None
    scale: object = None
    rope: object = None
    alibi_slopes: object = None
    window: object = None
    softcap: object = None
    sinks: object = None
    mask: object = None
    relative_bias: object = None

    # what ``check``'s and ``check_decode``'s summaries hold, in the error when ranks differ
    AGREED = (
        "options (causal, layout, scale, rope table shape, key_lengths, alibi_slopes, window, "
        "softcap, sinks, rope interleaved)"
    )
    DECODE_AGREED = "scale, softcap and sinks"

    def check(self, q, k, v, *, layout, backend) -> tuple:
        """This rank's checks of a sharded sequence's options (raising), and their summary."""
        import torch

        from fastpe._inputs import AttentionInputs, _check_key_lengths
        from fastpe._options import check_window

        name, rope = self.name, self.rope
        if self.mask is not None:
            raise ValueError(
                f"{name} does not take mask: an arbitrary [Sq, Sk] mask does not shard with the "
                "sequence. Use causal=True and key_lengths (global lengths), which it supports "
                "across shards"
            )
        if self.relative_bias is not None:
            raise ValueError(
                f"{name} does not support relative_bias (T5): use fastpe.attention on one device; "
                "supported across shards are GQA, causal, key_lengths, rope, alibi_slopes, "
                "window, softcap and sinks"
            )
        _check_tensors(name, {"q": q, "k": k, "v": v})
        check_choice("layout", layout, LAYOUTS)
        tables = {"alibi_slopes": self.alibi_slopes}
        if isinstance(rope, dict):
            tables.update({f"rope[{key!r}]": rope.get(key) for key in ("cos", "sin")})
        for arg, t in tables.items():
            if torch.is_grad_enabled() and isinstance(t, torch.Tensor) and t.requires_grad:
                raise ValueError(
                    f"{name} gives no gradient for {arg}, which requires grad: pass it detached "
                    "(.detach()), or run under torch.no_grad()"
                )
        if rope is not None:
            from fastpe._options import Rope

            Rope.check_keys(rope)
            given = sorted({"q_positions", "k_positions"} & set(rope))
            if given:
                raise ValueError(
                    f"rope[{given[0]!r}] cannot be given to {name}: each shard's global positions "
                    "come from the layout (see shard_positions)"
                )
        inputs = AttentionInputs.build(
            q,
            k,
            v,
            causal=self.causal,
            causal_alignment="top_left",
            mask=None,
            key_lengths=None,
            scale=self.scale,
            rope=rope,
            alibi_slopes=self.alibi_slopes,
            relative_bias=None,
            return_lse=True,
            window=self.window,
            softcap=self.softcap,
            sinks=self.sinks,
        )
        _check_backend(inputs, backend)
        lengths = None
        if self.key_lengths is not None:  # the range against the global length: ``agreed``
            lengths = _check_key_lengths(self.key_lengths, q.shape[0], 2**62).tolist()
        return (
            bool(self.causal),
            layout,
            inputs.options.scale,
            None if rope is None else tuple(inputs.options.rope.cos.shape),
            lengths,
            None if self.alibi_slopes is None else torch.as_tensor(self.alibi_slopes).tolist(),
            # the global window: inputs.window is cut to this shard's length (a side wider than
            # the shard is unbounded there, not across the whole sequence)
            check_window(self.window),
            inputs.options.softcap,
            None if self.sinks is None else torch.as_tensor(self.sinks).tolist(),
            None if rope is None else inputs.options.rope.interleaved,
        )

    def agreed(self, summary, seqs, device) -> BlockOptions:
        """The options of ``check``'s ``summary`` as every rank agreed on it, for a sequence
        sharded in lengths ``seqs``: the global ranges are checked against the whole sequence
        (every rank raises alike: all hold the same summary)."""
        import torch

        causal, _, scale, table, lengths, _, window, softcap, _, _ = summary
        total = sum(seqs)
        if lengths is not None and max(lengths) > total:
            raise IndexError(
                f"key_lengths contains {max(lengths)}, more than the global sequence length "
                f"{total} (the sum of the ranks' shards {seqs})"
            )
        if table is not None and table[0] < total:
            raise IndexError(
                f"rope['cos'] has {table[0]} rows, but the global positions of the sharded "
                f"sequence go up to {total - 1}: the table must cover the whole sequence"
            )
        alibi = self.alibi_slopes
        return BlockOptions(
            causal=causal,
            scale=scale,
            window=window,
            softcap=softcap,
            longest_key=None if lengths is None else max(lengths),
            key_lengths=None if lengths is None else torch.tensor(lengths, device=device),
            rope=self.rope,
            alibi=None
            if alibi is None
            else torch.as_tensor(alibi, device=device, dtype=torch.float32),
        )

    def check_decode(self, q, k, v, *, backend) -> tuple:
        """This rank's checks of a decode call's options (raising), and their summary."""
        import torch

        from fastpe._inputs import AttentionInputs

        _check_tensors(self.name, {"q": q, "k_cache_shard": k, "v_cache_shard": v})
        inputs = AttentionInputs.build(
            q,
            k,
            v,
            causal=False,
            causal_alignment="bottom_right",
            mask=None,
            key_lengths=self.key_lengths,
            scale=self.scale,
            rope=None,
            alibi_slopes=None,
            relative_bias=None,
            return_lse=True,
            softcap=self.softcap,
            sinks=self.sinks,
        )
        _check_backend(inputs, backend)
        sinks = None if self.sinks is None else torch.as_tensor(self.sinks).tolist()
        return (inputs.options.scale, inputs.options.softcap, sinks)

    def decode_keywords(self) -> dict:
        """``fastpe.attention``'s keywords for this rank's shard of the cache (the sinks join
        once, after the merge)."""
        return dict(key_lengths=self.key_lengths, scale=self.scale, softcap=self.softcap)


@dataclasses.dataclass(frozen=True, eq=False)
class BlockOptions:
    """The options every rank agreed on, with their global meaning: which blocks of queries and
    keys (at global positions) have anything to compute, and each block's keywords."""

    causal: bool
    scale: float | None = None
    window: tuple | None = None  # global distances (left, right); -1 leaves a side unbounded
    softcap: float | None = None
    longest_key: int | None = None
    key_lengths: object = None  # global lengths, int64 [B] on the device
    rope: dict | None = None  # the table; positions come per block
    alibi: object = None  # float32 [Hq] or [B, Hq] on the device

    def nothing_visible(self, qh, kh) -> bool:
        """Whether no query at host positions ``qh`` may see any key at ``kh`` (both
        increasing): no keys, all of them padding, or all outside every query's window. Decided
        on the host, identically on every rank."""
        if len(kh) == 0 or (self.longest_key is not None and kh[0] >= self.longest_key):
            return True
        left, right = self.window or (-1, -1)
        return (left >= 0 and kh[-1] < qh[0] - left) or (right >= 0 and kh[0] > qh[-1] + right)

    def visible_keys(self, qh, total) -> slice:
        """The global key range (of ``total``) that queries at (increasing, host) positions
        ``qh`` can see under causal masking and the window."""
        start, end = 0, total
        left, right = self.window or (-1, -1)
        if self.causal:
            end = int(qh[-1]) + 1
        if right >= 0:
            end = min(end, int(qh[-1]) + right + 1)
        if left >= 0:
            start = max(0, int(qh[0]) - left)
        return slice(start, max(start, end))

    def block(self, q_at, k_at, *, causal):
        """``fastpe.attention``'s keywords for one block: queries at ``q_at`` against keys at
        ``k_at`` (``Span``s), or None when no key of the block is allowed.

        ``causal`` is the global rule kpos[j] <= qpos[i]: the kernel's own causal rule
        (top-left) for a block of the same tokens as its queries, a boolean mask otherwise.
        """
        import torch

        if self.nothing_visible(q_at.host, k_at.host):
            return None
        qpos, kpos = q_at.device, k_at.device
        key_lengths = None
        if self.key_lengths is not None:
            # keys are at increasing positions, so those before the global length form a prefix
            key_lengths = (kpos[None, :] < self.key_lengths[:, None]).sum(1)
        rope = None
        if self.rope is not None:
            rope = {**self.rope, "q_positions": qpos, "k_positions": kpos}
        allowed = []  # boolean [Sq_block, Sk_block] rules the kernel cannot apply to local indices
        same_tokens = np.array_equal(q_at.host, k_at.host)
        if causal and not same_tokens:
            allowed.append(kpos[None, :] <= qpos[:, None])
            causal = False
        window = None
        if self.window is not None:
            left, right = self.window
            qh = q_at.host
            if same_tokens and qh[-1] - qh[0] == len(qh) - 1:
                window = self.window  # consecutive positions: local distances are the global ones
            else:
                distance = qpos[:, None] - kpos[None, :]
                if left >= 0:
                    allowed.append(distance <= left)
                if right >= 0:
                    allowed.append(distance >= -right)
        mask = None
        if self.alibi is not None:
            # ALiBi needs the global distance |qpos - kpos|, which a block's local indices do not
            # carry: an additive mask [B or 1, Hq, Sq_block, Sk_block] holds it
            distance = (qpos[:, None] - kpos[None, :]).abs().to(torch.float32)
            slopes = self.alibi if self.alibi.ndim == 2 else self.alibi[None]
            mask = -slopes[:, :, None, None] * distance
        if allowed:
            allowed = functools.reduce(torch.logical_and, allowed)
            mask = allowed[None, None] if mask is None else mask.masked_fill(~allowed, -math.inf)
        return dict(
            causal=causal,
            causal_alignment="top_left",
            key_lengths=key_lengths,
            scale=self.scale,
            rope=rope,
            mask=mask,
            alibi_slopes=None,
            relative_bias=None,
            window=window,
            softcap=self.softcap,
        )

    def attend(self, q, k, v, q_at, k_at, *, causal, backend, sinks=None):
        """One block's (out, lse) (``block``), or None when no key of it is allowed."""
        import fastpe

        keywords = self.block(q_at, k_at, causal=causal)
        if keywords is None:
            return None
        return fastpe.attention(q, k, v, **keywords, sinks=sinks, return_lse=True, backend=backend)


# ---------------------------------------------------------------------------------------------
# The public functions


def _sequence_function(name, compute, doc):
    """A public function over a sharded sequence: ``ring_attention`` and
    ``all_gather_attention`` take the same arguments and return the same result, and differ
    only in ``compute(plan, q, k, v, sinks, backend) -> (out, lse)``."""

    def function(
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
        options = Options(
            name,
            causal=causal,
            key_lengths=key_lengths,
            scale=scale,
            rope=rope,
            alibi_slopes=alibi_slopes,
            window=window,
            softcap=softcap,
            sinks=sinks,
            mask=mask,
            relative_bias=relative_bias,
        )
        plan = Plan(Group(group), q, k, v, options, layout=layout, backend=backend)
        out, lse = compute(plan, q, k, v, sinks, backend)
        return (out, lse) if return_lse else out

    function.__name__ = function.__qualname__ = name
    function.__doc__ = doc
    return function


ring_attention = _sequence_function(
    "ring_attention",
    _ring.attention,
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
    """,
)

all_gather_attention = _sequence_function(
    "all_gather_attention",
    _gather.attention,
    """``ring_attention``'s contract (same arguments, same result) computed by all-gathering K
    and V first and attending locally: one collective instead of N-1 ring steps, at the memory
    cost of the whole K/V on every rank. For small K/V (few kv heads, short sequences).
    Differentiable; the backward sums each K/V gradient over the ranks with one all_reduce (of
    the whole sequence's dK/dV) and, like the forward, must run on every rank.""",
)


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
    options = Options(
        "sharded_kv_decode_attention",
        key_lengths=cache_lengths,
        scale=scale,
        softcap=softcap,
        sinks=sinks,
    )
    out, lse = _gather.decode(Group(group), q, k_cache_shard, v_cache_shard, options, backend)
    return (out, lse) if return_lse else out
