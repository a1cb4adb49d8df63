"""The "numpy" backend: the float64 oracle of ``fastpe.reference``.

It runs every feature on any input (torch tensors are copied to the host and back), is the
reference every other backend is tested against, and is the last automatic candidate.
"""

from __future__ import annotations

import sys

import numpy as np

from fastpe import _arrays, _kv_quant, reference
from fastpe._arrays import from_float64, to_float64
from fastpe.backends import _serving
from fastpe.backends.base import (
    ALL_FLOAT,
    AttentionVarlenBackward,
    Implementation,
    host_option_grads,
    write_inplace,
)

NAME = "numpy"
AUTO_DEVICES = frozenset({"cpu", "cuda"})
IS_ORACLE = True


def unavailable_reason() -> str | None:
    return None  # NumPy is a dependency of fastpe itself


class _Numpy(Implementation):
    backend = NAME
    device_types = frozenset({"cpu", "cuda"})  # tensors are copied to the host and back
    dtypes = ALL_FLOAT

    def unavailable_reason(self):
        return unavailable_reason()


class SinusoidalTable(_Numpy):
    op = "sinusoidal_table"

    def run(self, inp):
        table = reference.sinusoidal_table(
            inp.num_positions, inp.dim, inp.base, inp.layout, inp.freq, inp.offset
        )
        return from_float64(table, inp.placement, inp.dtype)


class RopeTable(_Numpy):
    op = "rope_table"

    def run(self, inp):
        cos, sin = reference.rope_table(
            inp.num_positions, inp.inv_freq, inp.attention_factor, inp.offset
        )
        return from_float64(cos, inp.placement, inp.dtype), from_float64(
            sin, inp.placement, inp.dtype
        )


def _bhsd(x, layout):
    return x if layout == "bhsd" else np.swapaxes(x, 1, 2)


class ApplyRope(_Numpy):
    op = "apply_rope"

    def run(self, inp):
        x = _bhsd(to_float64(inp.x), inp.layout)
        positions = inp.positions.as_int64(inp.batch, inp.seq)
        rotate = reference.apply_rope_backward if inp.inverse else reference.apply_rope
        out = rotate(x, to_float64(inp.cos), to_float64(inp.sin), positions, inp.interleaved)
        result = from_float64(_bhsd(out, inp.layout), inp.placement, inp.dtype)
        return write_inplace(inp.x, result) if inp.inplace else result


class Embed(_Numpy):
    op = "embed"

    def run(self, inp):
        tt = inp.token_type_ids is not None
        out = reference.embed(
            _arrays.to_int64(inp.ids),
            to_float64(inp.weight),
            inp.positions.as_int64(inp.batch, inp.seq),
            inp.pe,
            None if inp.pe_table is None else to_float64(inp.pe_table),
            inp.scale,
            inp.base,
            inp.layout,
            inp.freq,
            _arrays.to_int64(inp.token_type_ids) if tt else None,
            to_float64(inp.token_type_weight) if tt else None,
        )
        return from_float64(out, inp.placement, inp.dtype)


class EmbedBackward(_Numpy):
    op = "embed_backward"

    def run(self, inp):
        fwd = inp.forward
        tt = inp.need_token_type_weight
        grads = reference.embed_backward(
            to_float64(inp.grad),
            _arrays.to_int64(fwd.ids),
            fwd.positions.as_int64(fwd.batch, fwd.seq),
            "table" if inp.need_pe_table else None,
            fwd.weight.shape[0],
            None if fwd.pe_table is None else fwd.pe_table.shape[0],
            _arrays.to_int64(fwd.token_type_ids) if tt else None,
            fwd.token_type_weight.shape[0] if tt else None,
            fwd.scale,
        )
        wanted = (inp.need_weight, inp.need_pe_table, tt)
        return tuple(
            from_float64(g, inp.placement, inp.dtype) if want else None
            for g, want in zip(grads, wanted, strict=True)
        )


def _attention_call(fwd):
    """The float64 q, k (rotated where the call fuses RoPE) and v of an attention record, the
    keyword arguments the oracle's attention and its backward share, and fused RoPE's
    (cos, sin, q positions, k positions) or None."""
    b, hq, hkv, sq, sk, d, dv = fwd.shape
    q, k, v = to_float64(fwd.q), to_float64(fwd.k), to_float64(fwd.v)
    rope = fwd.options.rope
    tables = None
    if rope is not None:
        tables = (
            to_float64(rope.cos),
            to_float64(rope.sin),
            rope.q_positions.as_int64(b, sq),
            rope.k_positions.as_int64(b, sk),
        )
        cos, sin, q_pos, k_pos = tables
        q = reference.apply_rope(q, cos, sin, q_pos, rope.interleaved)
        k = reference.apply_rope(k, cos, sin, k_pos, rope.interleaved)
    mask = None
    if fwd.mask is not None:
        mask = _arrays.to_bool(fwd.mask) if fwd.mask_is_bool else to_float64(fwd.mask)
    bias = fwd.relative_bias
    kwargs = dict(
        mask=mask,
        key_lengths=None if fwd.key_lengths is None else _arrays.to_int64(fwd.key_lengths),
        relative_bias=None if bias is None else bias._replace(table=to_float64(bias.table)),
        **fwd.options.launched(to_float64).keywords(),
    )
    return q, k, v, kwargs, tables


class Attention(_Numpy):
    op = "attention"

    def run(self, inp):
        q, k, v, kwargs, _ = _attention_call(inp)
        out, lse = reference.attention(q, k, v, **kwargs)
        out = from_float64(out, inp.placement, inp.dtype)
        if inp.options.return_lse:
            return out, from_float64(lse, inp.placement, "float32")
        return out


class AttentionBackward(_Numpy):
    op = "attention_backward"

    def run(self, inp):
        fwd = inp.forward
        q, k, v, kwargs, tables = _attention_call(fwd)
        dq, dk, dv_, dsinks, dtable = reference.attention_backward(
            q,
            k,
            v,
            to_float64(inp.grad_out),
            None if inp.grad_lse is None else to_float64(inp.grad_lse),
            **kwargs,
        )
        if tables is not None:  # the rotation's transpose is the rotation by -θ
            cos, sin, q_pos, k_pos = tables
            interleaved = fwd.options.rope.interleaved
            dq = reference.apply_rope(dq, cos, -sin, q_pos, interleaved)
            dk = reference.apply_rope(dk, cos, -sin, k_pos, interleaved)
        grads = (from_float64(g, inp.placement, inp.dtype) for g in (dq, dk, dv_))
        return (*grads, *host_option_grads(inp, dsinks, dtable))


class MergeAttention(_Numpy):
    op = "merge_attention"

    def run(self, inp):
        out, lse = reference.merge_attention(
            to_float64(inp.out_a),
            to_float64(inp.lse_a),
            to_float64(inp.out_b),
            to_float64(inp.lse_b),
        )
        return from_float64(out, inp.placement, inp.dtype), from_float64(
            lse, inp.placement, "float32"
        )


class MergeAttentionBackward(_Numpy):
    op = "merge_attention_backward"

    def run(self, inp):
        fwd = inp.forward
        arrays = (inp.grad_out, inp.grad_lse, fwd.out_a, fwd.lse_a, fwd.out_b, fwd.lse_b)
        grads = reference.merge_attention_backward(*(to_float64(x) for x in arrays))
        likes = (fwd.out_a, fwd.lse_a, fwd.out_b, fwd.lse_b)
        return tuple(
            from_float64(g, inp.placement, _arrays.dtype_name(like))
            for g, like in zip(grads, likes, strict=True)
        )


class _ServingArrays(_serving.ServingArrays):
    """Float64 copies for the reference; a cache's keys are gathered through its row views and
    widened only where a sequence reads them (widening whole caches would copy every block of
    a large cache per call)."""

    def load(self, x):
        return to_float64(x)

    def view(self, x):
        return x  # the caller's own caches (arrays or tensors), written in place

    widen = load

    def tables(self, cos, sin):
        return to_float64(cos), to_float64(sin)

    def rotate(self, x, cos, sin, positions, interleaved, *, store):
        positions = positions.reshape(x.shape[:2])
        rotated = reference.apply_rope(
            to_float64(x).transpose(0, 2, 1, 3), cos, sin, positions, interleaved
        ).transpose(0, 2, 1, 3)
        # stored in the cache's dtype first, then read back: what later steps will see
        return from_float64(rotated, self.inp.placement, self.inp.dtype) if store else rotated

    def attend(self, args):
        index = np.concatenate(
            [np.zeros(0, np.int64)]
            + [
                args.page_start[b, j // args.page_size] + j % args.page_size
                for b, j in enumerate(np.arange(n) for n in args.k_len)
            ]
        )
        if args.k_scale is None:
            k, v = (to_float64(_take_rows(rows, index)) for rows in (args.k, args.v))
        else:  # quantized caches: float64 of stored × scale
            seq = np.repeat(np.arange(len(args.k_len)), args.k_len)
            k, v = (
                _kv_quant.dequantize(_take_rows(rows, index), _take_scales(scale, seq, index))
                for rows, scale in ((args.k, args.k_scale), (args.v, args.v_scale))
            )
        # the queries of one sequence follow those of the previous one (packed or [B, Sq])
        ends = args.q_start + args.q_len
        cu_q = np.concatenate([args.q_start[:1], ends]) if len(ends) else np.zeros(1, np.int64)
        cu_k = np.concatenate([[0], np.cumsum(args.k_len)])
        return reference.attention_varlen(
            args.q, k, v, cu_q, cu_k, **self.inp.options.launched(to_float64).keywords()
        )

    def output(self, x, dtype):
        return from_float64(x, self.inp.placement, dtype)


def _take_scales(scale, seq, index):
    """scale[seq, index] of a [B, R, Hkv] scale view (its B may be 1: the same for all)."""
    seq = seq if scale.shape[0] > 1 else np.zeros_like(seq)
    if _arrays.is_tensor(scale):
        torch = sys.modules["torch"]
        return scale[
            torch.from_numpy(seq).to(scale.device), torch.from_numpy(index).to(scale.device)
        ]
    return scale[seq, index]


def _take_rows(rows, index):
    """rows[index] of a NumPy array or a tensor (on its device), index host int64."""
    if _arrays.is_tensor(rows):
        return rows[sys.modules["torch"].from_numpy(index).to(rows.device)]
    return rows[index]


AttentionVarlen, AttentionKVCache = _serving.implementations(_Numpy, _ServingArrays)


class AttentionVarlenBackwardPerSequence(_Numpy, AttentionVarlenBackward):
    """The default: this backend's attention backward once per sequence (no packed kernel)."""
