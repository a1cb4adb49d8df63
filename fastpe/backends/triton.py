"""The "triton" backend: GPU kernels in ``fastpe.kernels.triton``, imported on first use.

CUDA tensors; CPU torch tensors too under ``TRITON_INTERPRET=1`` (how CI runs these kernels).
The kernels load fp16/bf16/fp32, compute in fp32 and store in the input dtype.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np

from fastpe import reference
from fastpe.backends.base import ALL_FLOAT, Implementation

NAME = "triton"
AUTO_DEVICES = frozenset({"cuda"})
IS_ORACLE = False


def interpreted() -> bool:
    """TRITON_INTERPRET=1: Triton runs the kernels on CPU torch tensors (no GPU needed)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _cuda_present() -> bool:
    """A GPU driver is on this machine. Asks torch only if the caller already imported it."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return bool(torch.cuda.is_available())
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


def unavailable_reason() -> str | None:
    for module in ("torch", "triton"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install 'fastpe[triton]')"
    if not interpreted() and not _cuda_present():
        return "no CUDA GPU found (TRITON_INTERPRET=1 runs the kernels on CPU torch tensors)"
    return None


class _Triton(Implementation):
    backend = NAME
    frameworks = frozenset({"torch"})
    dtypes = frozenset({"float16", "bfloat16", "float32"})  # fp32 compute; float64 goes elsewhere

    def unavailable_reason(self):
        return unavailable_reason()

    @property
    def device_types(self):
        return frozenset({"cuda", "cpu"}) if interpreted() else frozenset({"cuda"})


class SinusoidalTable(_Triton):
    op = "sinusoidal_table"
    dtypes = ALL_FLOAT  # computed from an fp64 product; fp64 output is exact to ~1e-10

    def run(self, inp):
        import torch

        from fastpe.kernels.triton.sinusoidal_table import sinusoidal_table_triton

        omega = reference.sinusoidal_frequencies(inp.dim, inp.base, inp.freq)
        return sinusoidal_table_triton(
            omega, inp.num_positions, inp.offset, inp.layout == "interleaved",
            getattr(torch, inp.dtype), inp.placement.device,
        )  # fmt: skip


class RopeTable(_Triton):
    op = "rope_table"
    dtypes = ALL_FLOAT

    def run(self, inp):
        import torch

        from fastpe.kernels.triton.rope_table import rope_table_triton

        return rope_table_triton(
            inp.inv_freq, inp.attention_factor, inp.num_positions, inp.offset,
            getattr(torch, inp.dtype), inp.placement.device,
        )  # fmt: skip


class ApplyRope(_Triton):
    op = "apply_rope"

    def run(self, inp):
        return self.run_group([inp])[0]

    def run_group(self, group):
        """q and k (any number of tensors sharing batch, sequence, tables and positions) in one
        launch."""
        from fastpe.kernels.triton.apply_rope import apply_rope_triton

        first = group[0]
        positions, offset = first.positions.on_device(first.x.device)
        return apply_rope_triton(
            tuple(inp.x for inp in group), first.cos.contiguous(), first.sin.contiguous(), positions, offset,
            interleaved=first.interleaved, layout=first.layout, inplace=first.inplace,
        )  # fmt: skip


class Embed(_Triton):
    op = "embed"

    def run(self, inp):
        from fastpe.kernels.triton.embed import embed_triton

        positions, offset = inp.positions.on_device(inp.weight.device)
        types = inp.token_type_ids is not None
        return embed_triton(
            inp.ids, inp.weight.contiguous(), positions, offset, scale=inp.scale, pe=inp.pe,
            pe_table=None if inp.pe_table is None else inp.pe_table.contiguous(),
            omega=reference.sinusoidal_frequencies(inp.dim, inp.base, inp.freq) if inp.pe == "sinusoidal" else None,
            interleaved=inp.layout == "interleaved",
            token_type_ids=inp.token_type_ids if types else None,
            token_type_weight=inp.token_type_weight.contiguous() if types else None,
        )  # fmt: skip


class Attention(_Triton):
    op = "attention"
    max_head_dim = 256  # a 128 x 256 q tile and 64 x 256 k/v tiles still fit in shared memory

    def extra_reasons(self, inp):
        b, hq, hkv, sq, sk, d, dv = inp.shape
        if max(d, dv) > self.max_head_dim:
            return [f"head dims up to {self.max_head_dim}, not {max(d, dv)}"]
        return []

    def run(self, inp):
        import torch

        from fastpe.kernels.triton.attention import attention_triton

        device = inp.q.device
        rope = inp.rope
        if rope is not None:
            rope = rope._replace(
                cos=rope.cos.contiguous(),
                sin=rope.sin.contiguous(),
                q_positions=rope.q_positions.on_device(device),
                k_positions=rope.k_positions.on_device(device),
            )
        sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else None
        )
        out, lse = attention_triton(
            inp.q, inp.k, inp.v, scale=inp.scale, causal=inp.causal, bottom_right=inp.bottom_right,
            mask=inp.mask, key_lengths=None if inp.key_lengths is None else inp.key_lengths.to(torch.int64),
            alibi_slopes=None if inp.alibi_slopes is None else inp.alibi_slopes.float(),
            relative_bias=inp.relative_bias, rope=rope, window=inp.window, softcap=inp.softcap,
            sinks=None if inp.sinks is None else inp.sinks.float().contiguous(), num_sms=sms,
        )  # fmt: skip
        return (out, lse) if inp.return_lse else out


class MergeAttention(_Triton):
    op = "merge_attention"

    def run(self, inp):
        from fastpe.kernels.triton.attention import merge_attention_triton

        return merge_attention_triton(inp.out_a, inp.lse_a.float(), inp.out_b, inp.lse_b.float())


IMPLEMENTATIONS = (SinusoidalTable, RopeTable, ApplyRope, Embed, Attention, MergeAttention)


class AttentionVarlen(_Triton):
    op = "attention_varlen"
    max_head_dim = Attention.max_head_dim

    def extra_reasons(self, inp):
        d, dv = inp.q.shape[2], inp.v.shape[2]
        if max(d, dv) > self.max_head_dim:
            return [f"head dims up to {self.max_head_dim}, not {max(d, dv)}"]
        return []

    def run(self, inp):
        import torch

        from fastpe.kernels.triton.attention_varlen import attention_varlen_triton

        device = inp.q.device
        rope = inp.rope
        if rope is not None:
            rope = (
                rope.cos, rope.sin, rope.interleaved,
                torch.from_numpy(rope.q_positions).to(device),
                torch.from_numpy(rope.k_positions).to(device),
            )  # fmt: skip
        sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else None
        )
        out, lse = attention_varlen_triton(
            inp.q, inp.k, inp.v, inp.cu_q, inp.cu_k, scale=inp.scale, causal=inp.causal,
            bottom_right=inp.bottom_right, rope=rope,
            alibi_slopes=None if inp.alibi_slopes is None else inp.alibi_slopes.float(),
            window=inp.window, softcap=inp.softcap,
            sinks=None if inp.sinks is None else inp.sinks.float().contiguous(), num_sms=sms,
        )  # fmt: skip
        return (out, lse) if inp.return_lse else out


IMPLEMENTATIONS = (*IMPLEMENTATIONS, AttentionVarlen)


class AttentionKVCache(_Triton):
    """Contiguous caches only: the forward kernel reads the cache in place (key lengths =
    cache_seqlens + new tokens, bottom-right aligned); a paged cache is refused."""

    op = "attention_kvcache"
    max_head_dim = Attention.max_head_dim
    unsupported_features = frozenset({"paged"})

    def extra_reasons(self, inp):
        d, dv = inp.q.shape[3], inp.v_cache.shape[3]
        if max(d, dv) > self.max_head_dim:
            return [f"head dims up to {self.max_head_dim}, not {max(d, dv)}"]
        return []

    def run(self, inp):
        import torch

        from fastpe.backends._kvcache import write_new_tokens
        from fastpe.kernels.triton.apply_rope import apply_rope_triton
        from fastpe.kernels.triton.attention import attention_triton

        device = inp.q.device
        q = inp.q
        if inp.k is not None:
            k_new = inp.k
            if inp.rotary is not None:
                cos, sin, interleaved = inp.rotary
                cos, sin = cos.contiguous(), sin.contiguous()
                kw = {"interleaved": interleaved, "layout": "bshd", "inplace": False}
                positions = torch.from_numpy(np.array(inp.k_positions)).to(device)
                (k_new,) = apply_rope_triton((k_new,), cos, sin, positions, 0, **kw)
                positions = torch.from_numpy(np.array(inp.q_positions)).to(device)
                (q,) = apply_rope_triton((q,), cos, sin, positions, 0, **kw)
                q = q.to(inp.q.dtype)
            write_new_tokens(inp, inp.k_cache, inp.v_cache, k_new, inp.v)
        rows = inp.page_table[:, 0]
        batch = q.shape[0]
        if np.array_equal(rows, np.arange(batch)):
            k, v = inp.k_cache[:batch], inp.v_cache[:batch]  # views: read in place
        else:
            index = torch.from_numpy(rows).to(device)
            k, v = inp.k_cache[index], inp.v_cache[index]  # cache_batch_idx: gathered
        sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else None
        )
        out, lse = attention_triton(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=inp.scale,
            causal=inp.causal, bottom_right=True,
            key_lengths=torch.from_numpy(inp.seqlens).to(device),
            alibi_slopes=None if inp.alibi_slopes is None else inp.alibi_slopes.float(),
            window=inp.window, softcap=inp.softcap,
            sinks=None if inp.sinks is None else inp.sinks.float().contiguous(), num_sms=sms,
        )  # fmt: skip
        out = out.transpose(1, 2)
        return (out, lse) if inp.return_lse else out


IMPLEMENTATIONS = (*IMPLEMENTATIONS, AttentionKVCache)
