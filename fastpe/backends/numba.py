"""The "numba" backend: CPU kernels in ``fastpe.kernels.numba``, imported on first use.

Kernels compute in float32 or float64. bfloat16 and float16 tensors reach apply_rope, embed and
attention's q/k/v as their bits (uint16 / int16; the kernels widen them as they read, and
apply_rope and embed round to nearest even on store, as torch does); attention's float32 output,
and every other half-precision input (masks, merge_attention), go through torch's conversion
(round-to-nearest-even).
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np

from fastpe import _arrays, reference
from fastpe._arrays import compute_dtype, from_host, to_host, to_host_bits
from fastpe.backends import _serving
from fastpe.backends.base import (
    ALL_FLOAT,
    AttentionVarlenBackward,
    Implementation,
    host_option_grads,
    write_inplace,
)

NAME = "numba"
AUTO_DEVICES = frozenset({"cpu"})
IS_ORACLE = False


def unavailable_reason() -> str | None:
    # asked at every call's backend choice: once Numba is imported, it is there
    if "numba" not in sys.modules and importlib.util.find_spec("numba") is None:
        return "numba is not installed (pip install numba)"
    return None


class _Numba(Implementation):
    backend = NAME
    dtypes = ALL_FLOAT  # half types arrive only as torch tensors (validated)

    def unavailable_reason(self):
        return unavailable_reason()


class SinusoidalTable(_Numba):
    op = "sinusoidal_table"

    def run(self, inp):
        from fastpe.kernels.numba.sinusoidal_table import sinusoidal_table_numba

        omega = reference.sinusoidal_frequencies(inp.dim, inp.base, inp.freq)
        table = sinusoidal_table_numba(
            omega,
            inp.num_positions,
            inp.offset,
            inp.layout == "interleaved",
            compute_dtype(inp.dtype),
        )
        return from_host(table, inp.placement, inp.dtype)


class RopeTable(_Numba):
    op = "rope_table"

    def run(self, inp):
        from fastpe.kernels.numba.rope_table import rope_table_numba

        cos, sin = rope_table_numba(
            inp.inv_freq,
            inp.attention_factor,
            inp.num_positions,
            inp.offset,
            compute_dtype(inp.dtype),
        )
        return from_host(cos, inp.placement, inp.dtype), from_host(sin, inp.placement, inp.dtype)


class ApplyRope(_Numba):
    op = "apply_rope"

    def run_group(self, group):
        # (q, k) of a decode step share their tables: convert them once, not per tensor
        first = group[0]
        dtype = compute_dtype(first.dtype)
        if any(
            inp.cos is not first.cos
            or inp.sin is not first.sin
            or compute_dtype(inp.dtype) != dtype
            for inp in group
        ):
            return super().run_group(group)
        tables = (to_host_bits(first.cos, dtype), to_host_bits(first.sin, dtype))
        second = group[-1]
        if (
            len(group) == 2
            and second.positions is first.positions
            and (second.layout, second.interleaved, second.inverse, second.inplace)
            == (first.layout, first.interleaved, first.inverse, first.inplace)
        ):
            # q and k of a decode step (records made by ``with_x``): one launch, positions
            # converted once; in place, the kernel rotates the caller's memory (as in ``run``)
            from fastpe.kernels.numba.apply_rope import apply_rope_pair_numba

            outs = apply_rope_pair_numba(
                to_host_bits(first.x, dtype),
                to_host_bits(second.x, dtype),
                *tables,
                first.positions.as_int64(first.batch, first.seq),
                interleaved=first.interleaved,
                layout=first.layout,
                inverse=first.inverse,
                inplace=first.inplace,
            )
            if first.inplace:
                return first.x, second.x
            return tuple(
                from_host(out, inp.placement, inp.dtype)
                for out, inp in zip(outs, group, strict=True)
            )
        return tuple(self.run(inp, tables) for inp in group)

    def run(self, inp, tables=None):
        from fastpe.kernels.numba.apply_rope import apply_rope_numba

        dtype = compute_dtype(inp.dtype)
        if tables is None:
            tables = (to_host_bits(inp.cos, dtype), to_host_bits(inp.sin, dtype))
        x = to_host_bits(inp.x, dtype)
        # every float array or CPU tensor comes back from to_host_bits as a view of the
        # caller's memory (half types as their bits): rotate that buffer directly. Half tables
        # stay bits too: a decode step reads one row, so widening the whole table would dominate
        direct = inp.inplace
        out = apply_rope_numba(
            x,
            *tables,
            inp.positions.as_int64(inp.batch, inp.seq),
            interleaved=inp.interleaved,
            layout=inp.layout,
            out=x if direct else None,
            inverse=inp.inverse,
        )
        if direct:
            return inp.x
        result = from_host(out, inp.placement, inp.dtype)
        return write_inplace(inp.x, result) if inp.inplace else result


class Embed(_Numba):
    op = "embed"

    def run(self, inp):
        from fastpe.kernels.numba.embed import embed_numba

        dtype = compute_dtype(inp.dtype)
        has_types = inp.token_type_ids is not None
        out = embed_numba(
            _arrays.to_int64(inp.ids),
            to_host_bits(inp.weight, dtype),  # bf16 rows are widened as they are gathered
            inp.positions.as_int64(inp.batch, inp.seq),
            scale=inp.scale,
            pe=inp.pe,
            pe_table=None if inp.pe_table is None else to_host_bits(inp.pe_table, dtype),
            omega=reference.sinusoidal_frequencies(inp.dim, inp.base, inp.freq)
            if inp.pe == "sinusoidal"
            else None,
            interleaved=inp.layout == "interleaved",
            token_type_ids=_arrays.to_int64(inp.token_type_ids) if has_types else None,
            token_type_weight=to_host_bits(inp.token_type_weight, dtype) if has_types else None,
        )
        return from_host(out, inp.placement, inp.dtype)


class EmbedBackward(_Numba):
    op = "embed_backward"

    def run(self, inp):
        from fastpe.kernels.numba.embed import scatter_rows_numba

        fwd = inp.forward
        dtype = compute_dtype(inp.dtype)
        grad = to_host_bits(inp.grad, dtype)
        rows = (
            (inp.need_weight, lambda: _arrays.to_int64(fwd.ids), fwd.weight, fwd.scale),
            (
                inp.need_pe_table,
                lambda: fwd.positions.as_int64(fwd.batch, fwd.seq),
                fwd.pe_table,
                1.0,
            ),
            (
                inp.need_token_type_weight,
                lambda: _arrays.to_int64(fwd.token_type_ids),
                fwd.token_type_weight,
                1.0,
            ),
        )
        return tuple(
            from_host(
                scatter_rows_numba(index(), grad, table.shape[0], scale), inp.placement, inp.dtype
            )
            if want
            else None
            for want, index, table, scale in rows
        )


def _attention_call(fwd, dtype):
    """An attention record as the Numba launchers take it: q, k (rotated into float32 scratch
    where the call fuses RoPE), v, the keyword arguments the forward and backward launchers
    share, and fused RoPE's (cos, sin, q positions, k positions) or None. ``dtype``: the
    compute dtype."""
    from fastpe.kernels.numba.apply_rope import apply_rope_numba

    b, hq, hkv, sq, sk, d, dv = fwd.shape
    # half q/k/v as their bits: the kernel widens them tile by tile (no full-tensor copy)
    q, k, v = (to_host_bits(t, dtype) for t in (fwd.q, fwd.k, fwd.v))
    rope = fwd.options.rope
    tables = None
    if rope is not None:
        # rotated once into scratch: O(S·D) next to the O(Sq·Sk·D) of the attention itself
        tables = (
            to_host(rope.cos, dtype),
            to_host(rope.sin, dtype),
            rope.q_positions.as_int64(b, sq),
            rope.k_positions.as_int64(b, sk),
        )
        cos, sin, *positions = tables
        # half q/k are rotated from their bits into float32: rounding them back to half
        # before the scores would add an error the float32 path does not have
        wide = q.dtype in (np.uint16, np.int16)
        q, k = (
            apply_rope_numba(
                x,
                cos,
                sin,
                p,
                interleaved=rope.interleaved,
                layout="bhsd",
                out=np.empty(x.shape, np.float32) if wide else None,
            )
            for x, p in zip((q, k), positions, strict=True)
        )
    mask = None
    if fwd.mask is not None:  # kept in its own float dtype: a cast would copy [B, Hq, Sq, Sk]
        mask = _arrays.to_bool(fwd.mask) if fwd.mask_is_bool else _host_float(fwd.mask)
    bias = fwd.relative_bias
    kwargs = dict(
        mask=mask,
        key_lengths=None if fwd.key_lengths is None else _arrays.to_int64(fwd.key_lengths),
        relative_bias=None if bias is None else bias._replace(table=to_host(bias.table, dtype)),
        options=fwd.options.launched(_arrays.to_float64),
    )
    return q, k, v, kwargs, tables


class Attention(_Numba):
    op = "attention"

    def run(self, inp):
        from fastpe.kernels.numba.attention import attention_numba

        q, k, v, kwargs, _ = _attention_call(inp, compute_dtype(inp.dtype))
        out, lse = attention_numba(q, k, v, **kwargs)
        out = from_host(out, inp.placement, inp.dtype)
        return (out, from_host(lse, inp.placement, "float32")) if inp.options.return_lse else out


class AttentionBackward(_Numba):
    op = "attention_backward"
    # float32 compute only: the forward's lse is float32, so float64 gradients from it would
    # carry float32 errors (automatic choice gives float64 to the float64 oracle)
    dtypes = frozenset({"float32", "float16", "bfloat16"})

    def run(self, inp):
        from fastpe.kernels.numba.apply_rope import apply_rope_numba
        from fastpe.kernels.numba.attention_backward import attention_backward_numba

        fwd = inp.forward
        dtype = compute_dtype(inp.dtype)  # float32: the dtypes above
        q, k, v, kwargs, tables = _attention_call(fwd, dtype)
        dq, dk, dv_, dsinks, dtable = attention_backward_numba(
            q,
            k,
            v,
            to_host_bits(inp.out, dtype),
            to_host(inp.lse, "float32"),
            to_host_bits(inp.grad_out, dtype),
            None if inp.grad_lse is None else to_host(inp.grad_lse, "float32"),
            **kwargs,
        )
        if tables is not None:  # the rotation's transpose is the rotation by -θ
            cos, sin, *positions = tables
            interleaved = fwd.options.rope.interleaved
            dq, dk = (
                apply_rope_numba(g, cos, -sin, p, interleaved=interleaved, layout="bhsd")
                for g, p in zip((dq, dk), positions, strict=True)
            )
        grads = (from_host(g, inp.placement, inp.dtype) for g in (dq, dk, dv_))
        return (*grads, *host_option_grads(inp, dsinks, dtable))


def _host_float(x):
    """A float array as float32 or float64 NumPy, without a copy when it already is one."""
    name = _arrays.dtype_name(x)
    return to_host(x, compute_dtype(name) if name in ("float32", "float64") else "float32")


class MergeAttention(_Numba):
    op = "merge_attention"

    def run(self, inp):
        from fastpe.kernels.numba.attention import merge_attention_numba

        dtype = compute_dtype(inp.dtype)
        out, lse = merge_attention_numba(
            to_host(inp.out_a, dtype),
            to_host(inp.lse_a, "float32"),
            to_host(inp.out_b, dtype),
            to_host(inp.lse_b, "float32"),
        )
        return from_host(out, inp.placement, inp.dtype), from_host(lse, inp.placement, "float32")


class MergeAttentionBackward(_Numba):
    op = "merge_attention_backward"

    def run(self, inp):
        from fastpe.kernels.numba.merge_attention_backward import merge_attention_backward_numba

        fwd = inp.forward
        dtype = compute_dtype(inp.dtype)
        grads = merge_attention_backward_numba(
            to_host(inp.grad_out, dtype),
            to_host(inp.grad_lse, "float64"),
            to_host(fwd.out_a, dtype),
            to_host(fwd.lse_a, "float64"),
            to_host(fwd.out_b, dtype),
            to_host(fwd.lse_b, "float64"),
        )
        likes = (fwd.out_a, fwd.lse_a, fwd.out_b, fwd.lse_b)
        results = []
        for g, like in zip(grads, likes, strict=True):
            name = _arrays.dtype_name(like)
            results.append(
                from_host(g.astype(compute_dtype(name), copy=False), inp.placement, name)
            )
        return tuple(results)


class _ServingArrays(_serving.ServingArrays):
    """Host arrays for the CPU kernels: CPU tensors and caches come back from to_host_bits as
    views of the caller's memory (half types as their bits, widened by the kernels as they
    read), so the append writes the caller's caches."""

    def __init__(self, inp):
        super().__init__(inp)
        self.dtype = compute_dtype(inp.dtype)

    def load(self, x):
        return to_host_bits(x, self.dtype)

    view = load

    def widen(self, x):
        return to_host(x, self.dtype)

    def tables(self, cos, sin):
        return to_host(cos, self.dtype), to_host(sin, self.dtype)

    def rotate(self, x, cos, sin, positions, interleaved, *, store):
        from fastpe.kernels.numba.apply_rope import apply_rope_numba

        # keys to store are rounded to the cache's dtype (half bits stay bits); half keys and
        # queries only read rotate into float32, as Attention does: rounding them back to half
        # before the scores would add an error the float32 path does not have
        wide = not store and x.dtype in (np.uint16, np.int16)
        return apply_rope_numba(
            x,
            cos,
            sin,
            positions.reshape(x.shape[:2]),
            interleaved=interleaved,
            layout="bshd",
            out=np.empty(x.shape, np.float32) if wide else None,
        )

    def attend(self, args):
        from fastpe.kernels.numba.attention_paged import attention_paged_numba

        return attention_paged_numba(
            args.q,
            args.k,
            args.v,
            q_start=args.q_start,
            q_len=args.q_len,
            k_len=args.k_len,
            page_start=args.page_start,
            page_size=args.page_size,
            max_q=args.max_q,
            max_k=args.max_k,
            options=self.inp.options.launched(_arrays.to_float64),
            k_scale=args.k_scale,
            v_scale=args.v_scale,
        )

    def output(self, x, dtype):
        # a KV cache's lse arrives transposed to [B, Hq, Sq]: returned contiguous
        return from_host(np.ascontiguousarray(x), self.inp.placement, dtype)


AttentionVarlen, AttentionKVCache = _serving.implementations(_Numba, _ServingArrays)


class AttentionVarlenBackwardPerSequence(_Numba, AttentionVarlenBackward):
    """The default: this backend's attention backward once per sequence (no packed kernel)."""
