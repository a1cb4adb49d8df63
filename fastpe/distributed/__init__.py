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

Cost model, layouts and a ``torchrun`` example: docs/distributed.md. Importing this package does
not import torch; calling any function does. ``ring_attention`` and ``all_gather_attention``
are differentiable (their backwards are collective too); ``sharded_kv_decode_attention`` is not.

Modules: ``_layout`` (the shard helpers), ``_group`` (the process group, the agreement round,
collectives and their autograd Functions), ``_api`` (the public functions and their options,
checked and turned into each block's ``fastpe.attention`` keywords), ``_plan`` (what every rank
agreed on: shards, positions, blocks, ring steps), ``_ring`` (ring forward and backward),
``_gather`` (all-gather attention and sharded-KV decoding).
"""

from __future__ import annotations

from fastpe.distributed._api import (
    all_gather_attention,
    ring_attention,
    sharded_kv_decode_attention,
)
from fastpe.distributed._layout import LAYOUTS, shard_positions, shard_sequence, unshard_sequence

__all__ = [
    "LAYOUTS",
    "all_gather_attention",
    "ring_attention",
    "shard_positions",
    "shard_sequence",
    "sharded_kv_decode_attention",
    "unshard_sequence",
]
