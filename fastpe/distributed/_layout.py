"""The two layouts of a sequence sharded over N ranks, and the helpers that cut, join and place
its shards: contiguous (rank r holds the r-th chunk) and zigzag (rank r holds chunks r and
2N-1-r of 2N, which balances causal work)."""

from __future__ import annotations

from fastpe._validate import check_choice

LAYOUTS = ("contiguous", "zigzag")


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


def layout_positions(layout: str, seqs: list[int]) -> list:
    """Every rank's global positions (increasing int64 NumPy arrays) for shard lengths ``seqs``
    (rank order) that every rank agreed on: contiguous shards may be uneven, zigzag shards are
    equal (two chunks each)."""
    import numpy as np

    if layout == "zigzag":
        size, c = len(seqs), seqs[0] // 2
        late = [2 * size - 1 - r for r in range(size)]
        return [np.r_[r * c : (r + 1) * c, t * c : (t + 1) * c] for r, t in enumerate(late)]
    ends = np.cumsum(seqs)
    return [np.arange(end - n, end) for n, end in zip(seqs, ends, strict=True)]
