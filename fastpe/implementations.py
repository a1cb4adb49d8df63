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
        out, lse = reference.attention(
            q,
            k,
            v,
            scale=inp.scale,
            causal=inp.causal,
            q_offset=inp.q_offset,
            mask=mask,
            key_lengths=None if inp.key_lengths is None else _arrays.to_int64(inp.key_lengths),
            alibi_slopes=alibi,
            t5_table=None if inp.t5_table is None else to_float64(inp.t5_table),
            t5_num_buckets=inp.t5_num_buckets,
            t5_max_distance=inp.t5_max_distance,
            t5_bidirectional=inp.t5_bidirectional,
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
# numba (CPU) and triton (CUDA; CPU torch tensors under TRITON_INTERPRET=1)

_NUMBA_PENDING = "the Numba kernels have not landed yet (issue #4)"
_TRITON_PENDING = "the Triton kernels have not landed yet (issue #5)"


def _pending(backend_name: str, op_name: str, why: str, devices: frozenset[str]):
    cls = type(
        f"{backend_name.title()}{op_name.title().replace('_', '')}",
        (Implementation,),
        {"backend": backend_name, "op": op_name, "missing": why, "device_types": devices},
    )
    return register(cls)


for _op in (
    "sinusoidal_table",
    "rope_table",
    "apply_rope",
    "embed",
    "attention",
    "merge_attention",
):
    _pending("numba", _op, _NUMBA_PENDING, frozenset({"cpu"}))
    _pending("triton", _op, _TRITON_PENDING, frozenset({"cuda"}))
