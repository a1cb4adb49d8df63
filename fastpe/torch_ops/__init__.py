"""fastpe's ops as torch custom ops (``torch.ops.fastpe.*``), so torch.compile traces through them.

Imported only when a torch tensor meets a fastpe op under ``torch.compile`` or with autograd
recording (never by ``import fastpe``); importing this package registers every op, fake and
autograd formula. Each op's real implementation is the ordinary validated, dispatched fastpe op
(its inputs record, then ``dispatch.run``: CPU -> Numba, CUDA -> Triton), run eagerly at
execution time; its fake implementation gives shapes and dtypes for tracing. Options that are
dicts or unions in the public API (``rope``, ``relative_bias``, ``positions``, ``scaling``) are
flattened into typed arguments by each op's ``call_*`` function.

One module per op family, each holding only the registrations and the schema conversions:

- ``tables``: ``sinusoidal_table``, ``rope_table``;
- ``rope``: ``apply_rope``, ``apply_rope_group`` and ``apply_rope_backward``;
- ``embed``: ``embed`` and ``embed_backward``;
- ``attention``: ``attention`` and ``attention_backward``;
- ``merge``: ``merge_attention`` and ``merge_attention_backward``;
- ``serving``: ``attention_varlen`` with ``attention_varlen_backward``, and
  ``attention_kvcache`` (writes into its caches, declared ``mutates_args``; no backward);
- ``_common``: the schema helpers and the one autograd pattern (``register_autograd``) every
  differentiable op uses (docs/math.md#gradients, #attention-backward and #merge-gradients).
"""

from __future__ import annotations

from fastpe.torch_ops._common import _no_backward
from fastpe.torch_ops.attention import (
    attention_backward_op,
    attention_op,
    call_attention,
    call_attention_backward,
)
from fastpe.torch_ops.embed import call_embed, embed_backward_op, embed_op
from fastpe.torch_ops.merge import (
    call_merge_attention,
    merge_attention_backward_op,
    merge_attention_op,
)
from fastpe.torch_ops.rope import (
    apply_rope_backward_op,
    apply_rope_group_op,
    apply_rope_op,
    call_apply_rope,
    call_apply_rope_group,
)
from fastpe.torch_ops.serving import (
    attention_kvcache_op,
    attention_varlen_backward_op,
    attention_varlen_op,
    call_attention_kvcache,
    call_attention_varlen,
)
from fastpe.torch_ops.tables import (
    call_rope_table,
    call_sinusoidal_table,
    rope_table_op,
    sinusoidal_table_op,
)

__all__ = [
    "_no_backward",
    "apply_rope_backward_op",
    "apply_rope_group_op",
    "apply_rope_op",
    "attention_backward_op",
    "attention_kvcache_op",
    "attention_op",
    "attention_varlen_backward_op",
    "attention_varlen_op",
    "call_apply_rope",
    "call_apply_rope_group",
    "call_attention",
    "call_attention_backward",
    "call_attention_kvcache",
    "call_attention_varlen",
    "call_embed",
    "call_merge_attention",
    "call_rope_table",
    "call_sinusoidal_table",
    "embed_backward_op",
    "embed_op",
    "merge_attention_backward_op",
    "merge_attention_op",
    "rope_table_op",
    "sinusoidal_table_op",
]
