"""Every (backend, op) implementation and its capability table.

"numpy" is the float64 oracle of ``fastpe.reference``: it runs every feature on any input
(torch tensors are copied to the host and back) and is the last automatic candidate.
"numba" and "triton" launch the kernels in ``fastpe.kernels.<backend>.<op>``, imported on first
use so that ``import fastpe`` stays light.
"""

from __future__ import annotations

import numpy as np

from fastpe import _arrays, reference
from fastpe._arrays import from_float64, to_float64
from fastpe.dispatch import Implementation, register

ALL_FLOAT = frozenset(_arrays.FLOAT_DTYPES)


def _write_inplace(x, result):
    """Copy ``result`` into the caller's ``x`` (the only way fastpe modifies an input)."""
    if _arrays.is_tensor(x):
        x.copy_(result)
    else:
        x[...] = result
    return x


# ---------------------------------------------------------------------------------------------
# numpy: the oracle


class _Oracle(Implementation):
    backend = "numpy"
    device_types = frozenset({"cpu", "cuda"})  # tensors are copied to the host and back
    dtypes = ALL_FLOAT


@register
class NumpySinusoidalTable(_Oracle):
    op = "sinusoidal_table"

    def run(self, inp):
        table = reference.sinusoidal_table(
            inp.num_positions, inp.dim, inp.base, inp.layout, inp.freq, inp.offset
        )
        return from_float64(table, inp.placement, inp.dtype)


@register
class NumpyRopeTable(_Oracle):
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


@register
class NumpyApplyRope(_Oracle):
    op = "apply_rope"

    def run(self, inp):
        x = _bhsd(to_float64(inp.x), inp.layout)
        positions = inp.positions.as_int64(inp.batch, inp.seq)
        out = reference.apply_rope(
            x, to_float64(inp.cos), to_float64(inp.sin), positions, inp.interleaved
        )
        result = from_float64(_bhsd(out, inp.layout), inp.placement, inp.dtype)
        return _write_inplace(inp.x, result) if inp.inplace else result


@register
class NumpyEmbed(_Oracle):
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


def _bottom_right(inp):
    return inp.q_offset == inp.k.shape[2] - inp.q.shape[2]


def _relative_bias(inp, table):
    if table is None:
        return None
    return (table, inp.t5_num_buckets, inp.t5_max_distance, inp.t5_bidirectional)


@register
class NumpyAttention(_Oracle):
    op = "attention"

    def run(self, inp):
        b, hq, hkv, sq, sk, d, dv = inp.shape
        q, k, v = to_float64(inp.q), to_float64(inp.k), to_float64(inp.v)
        if inp.rope_cos is not None:
            cos, sin = to_float64(inp.rope_cos), to_float64(inp.rope_sin)
            q = reference.apply_rope(
                q, cos, sin, inp.q_positions.as_int64(b, sq), inp.rope_interleaved
            )
            k = reference.apply_rope(
                k, cos, sin, inp.k_positions.as_int64(b, sk), inp.rope_interleaved
            )
        mask = None
        if inp.mask is not None:
            is_bool = _arrays.dtype_name(inp.mask) == "bool"
            mask = _arrays.to_bool(inp.mask) if is_bool else to_float64(inp.mask)
            mask = np.broadcast_to(mask, (b, hq, sq, sk))
        alibi = None
        if inp.alibi_slopes is not None:
            alibi = np.broadcast_to(to_float64(inp.alibi_slopes), (b, hq))
        table = None if inp.t5_table is None else to_float64(inp.t5_table)
        out, lse = reference.attention(
            q,
            k,
            v,
            scale=inp.scale,
            causal=inp.causal,
            bottom_right=_bottom_right(inp),
            mask=mask,
            key_lengths=None if inp.key_lengths is None else _arrays.to_int64(inp.key_lengths),
            alibi_slopes=alibi,
            relative_bias=_relative_bias(inp, table),
        )
        out = from_float64(out, inp.placement, inp.dtype)
        if inp.return_lse:
            return out, from_float64(lse, inp.placement, "float32")
        return out


@register
class NumpyMergeAttention(_Oracle):
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


# ---------------------------------------------------------------------------------------------
# numba: CPU kernels in fastpe.kernels.numba (float32/float64; torch half types are widened to
# float32 at the boundary and rounded back by torch, round-to-nearest-even)


def _host(x, compute_dtype):
    """A NumPy view (or, for half types and dtype changes, a copy) of an array or CPU tensor."""
    if _arrays.is_tensor(x):
        x = x.detach()
        if _arrays.dtype_name(x) in ("float16", "bfloat16"):
            x = x.float()
        x = x.numpy()
    return np.asarray(x, dtype=compute_dtype)


def _host_bits(x, compute_dtype):
    """Like ``_host``, but a bfloat16 tensor comes as a uint16 view of its bits (no copy), for
    kernels that widen and round bfloat16 themselves (SPEC §5)."""
    if _arrays.is_tensor(x) and _arrays.dtype_name(x) == "bfloat16":
        import torch

        return x.detach().view(torch.int16).numpy().view(np.uint16)
    return _host(x, compute_dtype)


def _back_bits(result, placement, dtype):
    """uint16 bfloat16 bits from a kernel -> a bfloat16 tensor (no copy); else ``_back``."""
    if result.dtype == np.uint16:
        import torch

        return torch.from_numpy(result.view(np.int16)).view(torch.bfloat16)
    return _back(result, placement, dtype)


def _compute_dtype(dtype: str):
    return np.float64 if dtype == "float64" else np.float32


def _back(result, placement, dtype):
    """NumPy result -> the caller's framework and dtype (no copy when already right)."""
    if placement.framework == "numpy":
        return result if result.dtype == dtype else result.astype(dtype)
    import torch

    return torch.from_numpy(result).to(dtype=getattr(torch, dtype))


class _Numba(Implementation):
    backend = "numba"
    dtypes = ALL_FLOAT  # half types arrive only as torch tensors (validated)


@register
class NumbaSinusoidalTable(_Numba):
    op = "sinusoidal_table"

    def run(self, inp):
        from fastpe.kernels.numba.sinusoidal_table import sinusoidal_table_numba

        omega = reference.sinusoidal_frequencies(inp.dim, inp.base, inp.freq)
        table = sinusoidal_table_numba(
            omega,
            inp.num_positions,
            inp.offset,
            inp.layout == "interleaved",
            _compute_dtype(inp.dtype),
        )
        return _back(table, inp.placement, inp.dtype)


@register
class NumbaRopeTable(_Numba):
    op = "rope_table"

    def run(self, inp):
        from fastpe.kernels.numba.rope_table import rope_table_numba

        cos, sin = rope_table_numba(
            inp.inv_freq,
            inp.attention_factor,
            inp.num_positions,
            inp.offset,
            _compute_dtype(inp.dtype),
        )
        return _back(cos, inp.placement, inp.dtype), _back(sin, inp.placement, inp.dtype)


@register
class NumbaApplyRope(_Numba):
    op = "apply_rope"

    def run(self, inp):
        from fastpe.kernels.numba.apply_rope import apply_rope_numba

        dtype = _compute_dtype(inp.dtype)
        x = _host_bits(inp.x, dtype)
        # float32/64 and bfloat16 arrays or CPU tensors come back from _host_bits as views of the
        # caller's memory: rotate that buffer directly; float16 goes through a float32 copy
        direct = inp.inplace and inp.dtype != "float16"
        out = apply_rope_numba(
            x, _host(inp.cos, dtype), _host(inp.sin, dtype), inp.positions.as_int64(inp.batch, inp.seq),
            interleaved=inp.interleaved, layout=inp.layout, out=x if direct else None,
        )  # fmt: skip
        if direct:
            return inp.x
        result = _back_bits(out, inp.placement, inp.dtype)
        return _write_inplace(inp.x, result) if inp.inplace else result


@register
class NumbaEmbed(_Numba):
    op = "embed"

    def run(self, inp):
        from fastpe.kernels.numba.embed import embed_numba

        dtype = _compute_dtype(inp.dtype)
        has_types = inp.token_type_ids is not None
        out = embed_numba(
            _arrays.to_int64(inp.ids),
            _host_bits(inp.weight, dtype),  # bf16 rows are widened as they are gathered
            inp.positions.as_int64(inp.batch, inp.seq),
            scale=inp.scale,
            pe=inp.pe,
            pe_table=None if inp.pe_table is None else _host_bits(inp.pe_table, dtype),
            omega=reference.sinusoidal_frequencies(inp.dim, inp.base, inp.freq)
            if inp.pe == "sinusoidal"
            else None,
            interleaved=inp.layout == "interleaved",
            token_type_ids=_arrays.to_int64(inp.token_type_ids) if has_types else None,
            token_type_weight=_host_bits(inp.token_type_weight, dtype) if has_types else None,
        )
        return _back_bits(out, inp.placement, inp.dtype)


@register
class NumbaAttention(_Numba):
    op = "attention"

    def run(self, inp):
        from fastpe.kernels.numba.apply_rope import apply_rope_numba
        from fastpe.kernels.numba.attention import attention_numba

        b, hq, hkv, sq, sk, d, dv = inp.shape
        dtype = _compute_dtype(inp.dtype)
        q, k, v = (_host(t, dtype) for t in (inp.q, inp.k, inp.v))
        if inp.rope_cos is not None:
            # rotated once into scratch: O(S·D) next to the O(Sq·Sk·D) of the attention itself
            cos, sin = _host(inp.rope_cos, dtype), _host(inp.rope_sin, dtype)
            rotate = lambda x, pos, s: apply_rope_numba(  # noqa: E731
                x, cos, sin, pos.as_int64(b, s), interleaved=inp.rope_interleaved, layout="bhsd"
            )
            q, k = rotate(q, inp.q_positions, sq), rotate(k, inp.k_positions, sk)
        mask = None
        if inp.mask is not None:
            is_bool = _arrays.dtype_name(inp.mask) == "bool"
            # a float64 mask stays float64 (the kernel saturates it, never overflows it)
            mask_dtype = np.float64 if _arrays.dtype_name(inp.mask) == "float64" else np.float32
            mask = _arrays.to_bool(inp.mask) if is_bool else _host(inp.mask, mask_dtype)
            mask = np.broadcast_to(mask, (b, hq, sq, sk))
        out, lse = attention_numba(
            q, k, v, scale=inp.scale, causal=inp.causal, bottom_right=_bottom_right(inp), mask=mask,
            key_lengths=None if inp.key_lengths is None else _arrays.to_int64(inp.key_lengths),
            alibi_slopes=None if inp.alibi_slopes is None else np.broadcast_to(to_float64(inp.alibi_slopes), (b, hq)),
            relative_bias=_relative_bias(inp, None if inp.t5_table is None else _host(inp.t5_table, dtype)),
        )  # fmt: skip
        out = _back(out, inp.placement, inp.dtype)
        return (out, _back(lse, inp.placement, "float32")) if inp.return_lse else out


@register
class NumbaMergeAttention(_Numba):
    op = "merge_attention"

    def run(self, inp):
        from fastpe.kernels.numba.attention import merge_attention_numba

        dtype = _compute_dtype(inp.dtype)
        out, lse = merge_attention_numba(
            _host(inp.out_a, dtype),
            _host(inp.lse_a, np.float32),
            _host(inp.out_b, dtype),
            _host(inp.lse_b, np.float32),
        )
        return _back(out, inp.placement, inp.dtype), _back(lse, inp.placement, "float32")


# ---------------------------------------------------------------------------------------------
# triton: CUDA tensors; CPU torch tensors too under TRITON_INTERPRET=1 (how CI runs these kernels)

LOW_AND_SINGLE = frozenset({"float16", "bfloat16", "float32"})


def _torch_positions(positions, device):
    """Positions record -> (int64 tensor [S] or [B, S] on device, or None, and the offset)."""
    if positions.array is None:
        return None, positions.offset
    import torch

    return positions.array.to(device=device, dtype=torch.int64), 0


class _Triton(Implementation):
    backend = "triton"
    frameworks = frozenset({"torch"})
    dtypes = LOW_AND_SINGLE  # the kernels compute in fp32; float64 goes to numba or numpy

    @property
    def device_types(self):
        from fastpe.dispatch import _triton_interpreted

        return frozenset({"cuda", "cpu"}) if _triton_interpreted() else frozenset({"cuda"})


@register
class TritonSinusoidalTable(_Triton):
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


@register
class TritonRopeTable(_Triton):
    op = "rope_table"
    dtypes = ALL_FLOAT

    def run(self, inp):
        import torch

        from fastpe.kernels.triton.rope_table import rope_table_triton

        return rope_table_triton(
            inp.inv_freq, inp.attention_factor, inp.num_positions, inp.offset,
            getattr(torch, inp.dtype), inp.placement.device,
        )  # fmt: skip


@register
class TritonApplyRope(_Triton):
    op = "apply_rope"

    def run(self, inp):
        return self.run_group([inp])[0]

    def run_group(self, group):
        """q and k (any number of tensors sharing batch, sequence, tables and positions) in one
        launch."""
        from fastpe.kernels.triton.apply_rope import apply_rope_triton

        first = group[0]
        positions, offset = _torch_positions(first.positions, first.x.device)
        return apply_rope_triton(
            tuple(inp.x for inp in group), first.cos.contiguous(), first.sin.contiguous(), positions, offset,
            interleaved=first.interleaved, layout=first.layout, inplace=first.inplace,
        )  # fmt: skip


@register
class TritonEmbed(_Triton):
    op = "embed"

    def run(self, inp):
        from fastpe.kernels.triton.embed import embed_triton

        positions, offset = _torch_positions(inp.positions, inp.weight.device)
        types = inp.token_type_ids is not None
        return embed_triton(
            inp.ids, inp.weight.contiguous(), positions, offset, scale=inp.scale, pe=inp.pe,
            pe_table=None if inp.pe_table is None else inp.pe_table.contiguous(),
            omega=reference.sinusoidal_frequencies(inp.dim, inp.base, inp.freq) if inp.pe == "sinusoidal" else None,
            interleaved=inp.layout == "interleaved",
            token_type_ids=inp.token_type_ids if types else None,
            token_type_weight=inp.token_type_weight.contiguous() if types else None,
        )  # fmt: skip


@register
class TritonAttention(_Triton):
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

        b, hq, hkv, sq, sk, d, dv = inp.shape
        device = inp.q.device
        mask = None if inp.mask is None else inp.mask.expand(b, hq, sq, sk)
        rope = inp.rope_cos is not None
        qpos, qoff = _torch_positions(inp.q_positions, device) if rope else (None, 0)
        kpos, koff = _torch_positions(inp.k_positions, device) if rope else (None, 0)
        sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else None
        )
        out, lse = attention_triton(
            inp.q, inp.k, inp.v, scale=inp.scale, causal=inp.causal, bottom_right=_bottom_right(inp), mask=mask,
            key_lengths=None if inp.key_lengths is None else inp.key_lengths.to(torch.int64),
            alibi_slopes=None if inp.alibi_slopes is None else inp.alibi_slopes.float().expand(b, hq),
            relative_bias=_relative_bias(inp, inp.t5_table),
            rope=(inp.rope_cos, inp.rope_sin, inp.rope_interleaved, (qpos, qoff), (kpos, koff)) if rope else None,
            num_sms=sms,
        )  # fmt: skip
        return (out, lse) if inp.return_lse else out


@register
class TritonMergeAttention(_Triton):
    op = "merge_attention"

    def run(self, inp):
        from fastpe.kernels.triton.attention import merge_attention_triton

        return merge_attention_triton(inp.out_a, inp.lse_a.float(), inp.out_b, inp.lse_b.float())
