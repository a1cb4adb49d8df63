"""fastpe: fused kernels for positional encodings and attention.

``import fastpe`` imports NumPy only: numba, triton and torch are imported by the backends on
first use, and no device is queried until a call needs one. ``fastpe.distributed`` (attention
over a sequence sharded across torch.distributed ranks) is a submodule loaded on first access.
"""

from fastpe import (
    backends,  # the registry; calling it, fastpe.backends(), reports status
    mods,  # flex_attention's functions for NumPy modifiers
)
from fastpe._warmup import warmup  # NumPy only: numba is imported by the warmup workers
from fastpe.api import (
    apply_rope,
    attention,
    attention_kvcache,
    attention_varlen,
    embed,
    explain,
    merge_attention,
    plan_kvcache,
    plan_varlen,
    relative_transform,
    rope_table,
    sinusoidal_table,
)
from fastpe.dispatch import BackendNotSupportedError, use_backend
from fastpe.flex import BlockMask, create_block_mask, flex_attention
from fastpe.rope_scaling import rope_inv_freq

# The one place the version is written: pyproject.toml reads it (`dynamic`), and so does
# `fastpe --version`; record user-visible changes in CHANGELOG.md.
__version__ = "0.1.0"


def __getattr__(name):
    # fastpe.distributed on first access, so that `import fastpe` stays light
    if name == "distributed":
        import importlib

        return importlib.import_module("fastpe.distributed")
    raise AttributeError(f"module 'fastpe' has no attribute {name!r}")


__all__ = [
    "BackendNotSupportedError",
    "BlockMask",
    "apply_rope",
    "attention",
    "attention_kvcache",
    "attention_varlen",
    "backends",
    "create_block_mask",
    "embed",
    "explain",
    "flex_attention",
    "merge_attention",
    "mods",
    "plan_kvcache",
    "plan_varlen",
    "relative_transform",
    "rope_inv_freq",
    "rope_table",
    "sinusoidal_table",
    "use_backend",
    "warmup",
]
