"""The "triton" backend: GPU kernels in ``fastpe.kernels.triton``, imported on first use.

CUDA tensors; CPU torch tensors too under ``TRITON_INTERPRET=1`` (how CI runs these kernels).
The kernels load fp16/bf16/fp32, compute in fp32 and store in the input dtype.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from fastpe import reference
from fastpe.backends import _serving
from fastpe.backends.base import ALL_FLOAT, AttentionVarlenBackward, Implementation

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
            omega,
            inp.num_positions,
            inp.offset,
            inp.layout == "interleaved",
            getattr(torch, inp.dtype),
            inp.placement.device,
        )


class RopeTable(_Triton):
    op = "rope_table"
    dtypes = ALL_FLOAT

    def run(self, inp):
        import torch

        from fastpe.kernels.triton.rope_table import rope_table_triton

        return rope_table_triton(
            inp.inv_freq,
            inp.attention_factor,
            inp.num_positions,
            inp.offset,
            getattr(torch, inp.dtype),
            inp.placement.device,
        )


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
            tuple(inp.x for inp in group),
            first.cos.contiguous(),
            first.sin.contiguous(),
            positions,
            offset,
            interleaved=first.interleaved,
            layout=first.layout,
            inplace=first.inplace,
            inverse=first.inverse,
        )


class Embed(_Triton):
    op = "embed"

    def run(self, inp):
        from fastpe.kernels.triton.embed import embed_triton

        positions, offset = inp.positions.on_device(inp.weight.device)
        types = inp.token_type_ids is not None
        return embed_triton(
            inp.ids,
            inp.weight.contiguous(),
            positions,
            offset,
            scale=inp.scale,
            pe=inp.pe,
            pe_table=None if inp.pe_table is None else inp.pe_table.contiguous(),
            omega=reference.sinusoidal_frequencies(inp.dim, inp.base, inp.freq)
            if inp.pe == "sinusoidal"
            else None,
            interleaved=inp.layout == "interleaved",
            token_type_ids=inp.token_type_ids if types else None,
            token_type_weight=inp.token_type_weight.contiguous() if types else None,
        )


class EmbedBackward(_Triton):
    op = "embed_backward"

    def run(self, inp):
        from fastpe.kernels.triton.embed import scatter_rows_triton

        fwd = inp.forward
        device = inp.grad.device
        rows = (
            (inp.need_weight, lambda: fwd.ids, fwd.weight, fwd.scale),
            (inp.need_pe_table, lambda: _positions_tensor(fwd, device), fwd.pe_table, 1.0),
            (inp.need_token_type_weight, lambda: fwd.token_type_ids, fwd.token_type_weight, 1.0),
        )
        return tuple(
            scatter_rows_triton(index(), inp.grad, table.shape[0], scale) if want else None
            for want, index, table, scale in rows
        )


def _positions_tensor(fwd, device):
    """The [B, S] positions of an embed call as an int64 tensor on ``device``."""
    import torch

    positions = fwd.positions.on_device(device)
    if positions.array is None:
        return torch.arange(positions.offset, positions.offset + fwd.seq, device=device).expand(
            fwd.batch, -1
        )
    return positions.array.expand(fwd.batch, fwd.seq)


# The most queries of one sequence the attention kernels take: their grids hold a sequence's
# query blocks (16 rows or more) on a grid axis of at most 65535 programs (forward_grid in
# kernels/triton/_attention_common.py).
MAX_QUERIES = 65535 * 16


def _attention_reasons(impl, queries, d, dv) -> list[str]:
    reasons = []
    if max(d, dv) > impl.max_head_dim:
        reasons.append(f"head dims up to {impl.max_head_dim}, not {max(d, dv)}")
    if queries > MAX_QUERIES:
        reasons.append(f"at most {MAX_QUERIES} queries per sequence, not {queries}")
    return reasons


class Attention(_Triton):
    op = "attention"
    max_head_dim = 256  # a 128 x 256 q tile and 64 x 256 k/v tiles still fit in shared memory

    def extra_reasons(self, inp):
        b, hq, hkv, sq, sk, d, dv = inp.shape
        return _attention_reasons(self, sq, d, dv)

    def run(self, inp):
        import torch

        from fastpe.kernels.triton.attention import attention_triton

        device = inp.q.device
        rope = inp.options.rope
        if rope is not None:
            rope = rope._replace(
                cos=rope.cos.contiguous(),
                sin=rope.sin.contiguous(),
                q_positions=rope.q_positions.on_device(device),
                k_positions=rope.k_positions.on_device(device),
            )
        out, lse = attention_triton(
            inp.q,
            inp.k,
            inp.v,
            mask=inp.mask,
            key_lengths=None if inp.key_lengths is None else inp.key_lengths.to(torch.int64),
            relative_bias=inp.relative_bias,
            rope=rope,
            options=inp.options.launched(_fp32),
            num_sms=_sms(device),
        )
        return (out, lse) if inp.options.return_lse else out


def _fp32(x):
    """An option array as the kernels read it: fp32, its last dim at unit stride (the kernels
    read ``sinks[h]`` by index; a broadcast [B, Hq] ALiBi view keeps its zero batch stride,
    which they step through, instead of being copied)."""
    x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()


class AttentionBackward(_Triton):
    op = "attention_backward"
    max_head_dim = Attention.max_head_dim

    def extra_reasons(self, inp):
        return Attention.extra_reasons(self, inp.forward)

    def run(self, inp):
        import torch

        from fastpe.kernels.triton.attention import _rotated_first
        from fastpe.kernels.triton.attention_backward import attention_backward_triton

        fwd = inp.forward
        device = fwd.q.device
        q, k, v = fwd.q, fwd.k, fwd.v
        rope = fwd.options.rope
        if rope is not None:
            # rotated before the kernel (in fp32, rounded once to q's dtype, as the forward's
            # dots saw them), the fp32 gradients back by -θ
            cos, sin = rope.cos.float(), rope.sin.float()
            positions = (rope.q_positions.on_device(device), rope.k_positions.on_device(device))
            q, k = _rotated_first(q, k, (cos, sin, rope.interleaved, *positions))
        bias = fwd.relative_bias
        dq, dk, dv, dsinks, dtable = attention_backward_triton(
            q,
            k,
            v,
            inp.out,
            inp.lse,
            inp.grad_out,
            inp.grad_lse,
            mask=fwd.mask,
            key_lengths=None if fwd.key_lengths is None else fwd.key_lengths.to(torch.int64),
            relative_bias=bias,
            options=fwd.options.launched(_fp32),
        )
        if rope is not None:
            dq, dk = _rotated_first(dq, dk, (cos, -sin, rope.interleaved, *positions))
        return (
            dq.to(fwd.q.dtype),
            dk.to(fwd.k.dtype),
            dv.to(fwd.v.dtype),
            None if dsinks is None else dsinks.to(fwd.options.sinks.dtype),
            None if dtable is None else dtable.to(bias.table.dtype),
        )


class MergeAttention(_Triton):
    op = "merge_attention"

    def run(self, inp):
        from fastpe.kernels.triton.attention import merge_attention_triton

        return merge_attention_triton(inp.out_a, inp.lse_a.float(), inp.out_b, inp.lse_b.float())


class MergeAttentionBackward(_Triton):
    """Elementwise work over [B, H, S, Dv] and one sum over Dv: torch's own kernels on the
    device, in float32 (docs/math.md#merge-gradients)."""

    op = "merge_attention_backward"

    def run(self, inp):
        import torch

        fwd = inp.forward
        out_a, out_b, grad_out = (x.float() for x in (fwd.out_a, fwd.out_b, inp.grad_out))
        lse_a, lse_b, grad_lse = (x.float() for x in (fwd.lse_a, fwd.lse_b, inp.grad_lse))
        lse = torch.logaddexp(lse_a, lse_b)
        seen = torch.isfinite(lse)
        safe = torch.where(seen, lse, 0.0)
        weights = [torch.where(seen, torch.exp(part - safe), 0.0) for part in (lse_a, lse_b)]
        # an empty part's out is ignored (it may hold NaN or inf)
        parts = [
            torch.where((w > 0)[..., None], part, 0.0)
            for w, part in zip(weights, (out_a, out_b), strict=True)
        ]
        out = weights[0][..., None] * parts[0] + weights[1][..., None] * parts[1]
        grads = []
        for w, part, like_out, like_lse in zip(
            weights, parts, (fwd.out_a, fwd.out_b), (fwd.lse_a, fwd.lse_b), strict=True
        ):
            d_lse = torch.where(w > 0, w * (((part - out) * grad_out).sum(-1) + grad_lse), 0.0)
            grads += [(w[..., None] * grad_out).to(like_out.dtype), d_lse.to(like_lse.dtype)]
        return tuple(grads)


def _sms(device):
    import torch

    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


class _ServingArrays(_serving.ServingArrays):
    """Device tensors as they are; caches written and read in place."""

    def load(self, x):
        return x

    view = load

    def widen(self, x):
        return x.float()

    def tables(self, cos, sin):
        return cos.contiguous(), sin.contiguous()

    def _on_device(self, host, device):
        """One of the plan's host arrays as its device copy (uploaded once per plan)."""
        return self.inp.plan.on_device(host, device)

    def rotate(self, x, cos, sin, positions, interleaved, *, store):
        from fastpe.kernels.triton.apply_rope import apply_rope_triton

        (rotated,) = apply_rope_triton(
            (x,),
            cos,
            sin,
            self._on_device(positions, x.device).view(x.shape[:2]),
            0,
            interleaved=interleaved,
            layout="bshd",
            inplace=False,
        )
        # fp32 under the interpreter for bf16 (see low_precision_via_fp32)
        return rotated if rotated.dtype == x.dtype else rotated.to(x.dtype)

    def attend(self, args):
        from fastpe.kernels.triton.attention_paged import attention_paged_triton

        device = args.q.device
        return attention_paged_triton(
            args.q,
            args.k,
            args.v,
            q_start=self._on_device(args.q_start, device),
            q_len=self._on_device(args.q_len, device),
            k_len=self._on_device(args.k_len, device),
            page_start=self._on_device(args.page_start, device),
            page_size=args.page_size,
            max_q=args.max_q,
            max_k=args.max_k,
            options=self.inp.options.launched(_fp32),
            num_sms=_sms(device),
            k_scale=args.k_scale,
            v_scale=args.v_scale,
        )

    def output(self, x, dtype):
        return x  # already the caller's tensors, in their dtype (lse float32)


class _Serving(_Triton):
    """The capability table of attention_varlen and attention_kvcache: attention's head dims."""

    max_head_dim = Attention.max_head_dim

    def extra_reasons(self, inp):
        kvcache = inp.op == "attention_kvcache"
        v = inp.v_cache if kvcache else inp.v  # k/v may be absent there
        queries = inp.q.shape[1] if kvcache else inp.max_seqlen_q
        return _attention_reasons(self, queries, inp.q.shape[-1], v.shape[-1])


AttentionVarlen, AttentionKVCache = _serving.implementations(_Serving, _ServingArrays)


class AttentionVarlenBackwardPerSequence(_Triton, AttentionVarlenBackward):
    """The default: this backend's attention backward once per sequence (no packed kernel)."""
