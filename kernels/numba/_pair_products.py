"""bfloat16 tile products on CPUs with AVX512-BF16: ``pair_product(c, a, panels, accumulate)``
computes ``c = a · B`` (or ``c += a · B``) in float32 from bfloat16 operands with the
``vdpbf16ps`` instruction, which multiplies two bfloat16 pairs per float32 lane and adds both
products to the lane: twice the float32 multiply-adds per instruction.

Operands hold bfloat16 *pairs* along the summed axis, each pair one uint32 (the even element in
the low half, as the instruction reads them):

- ``a`` [m, k/2]: row r's elements 2t and 2t + 1 in a[r, t];
- ``panels`` [>= n / 16, k/2, 16]: B [k, n] in column panels of 16, B[2t, 16p + c] and
  B[2t + 1, 16p + c] in panels[p, t, c].

The dense attention kernel packs Kᵀ (pairs along the head dimension) and V (pairs along the
keys) so, once per call, and multiplies Q·Kᵀ with the query's bfloat16 bits as they are (the
score scale is applied to the float32 scores) and P·V with P rounded to bfloat16, as
FlashAttention does for half inputs (docs/dtypes-and-errors.md states the error this costs).
The backward packs each work item's keys both ways (Kᵀ for S, K for dQ = dS·K) and Vᵀ, each row
tile's queries and output gradient as pairs along D and as panels along the rows (for dK = dSᵀ·Q
and dV = Pᵀ·dO), and rounds P and dS to bfloat16 for their products, as FlashAttention-2 does.
Every product of two bfloat16 values is exact in float32; the sums are float32.

The register blocks are those of ``_panels`` (``emit_register_blocks``: up to six rows of c) by
two panels (32 columns, 12 of the 32 AVX-512 registers): n must be a multiple of 32, and the
kernels pad their tiles so.
"""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._half import _float32_to_bf16
from ._panels import emit_register_blocks, emit_sum_loop
from ._runtime import njit

PANEL = 16  # float32 lanes of one AVX-512 register: columns of c per panel
BLOCK_COLUMNS = 2 * PANEL  # columns of c per register block: tiles are padded to this
_INTRINSIC = "llvm.x86.avx512bf16.dpbf16ps.512"


class _BFloatType(ir.types._BaseFloatType):
    """LLVM's ``bfloat`` (llvmlite has no class for it): the intrinsic's operand type."""

    null = "0.0"
    intrinsic_name = "bf16"

    def __str__(self):
        return "bfloat"

    def format_constant(self, value):
        return "0.0"


_BFloatType._create_instance()


@functools.cache
def available() -> bool:
    """True when Numba compiles for a CPU with AVX512-BF16 (the host's features, or those that
    NUMBA_CPU_NAME / NUMBA_CPU_FEATURES name): the pair products then replace float32 products
    in bfloat16 attention."""
    from numba.core.registry import cpu_target

    features = getattr(cpu_target.target_context.codegen(), "_tm_features", "") or ""
    return "+avx512bf16" in features.split(",")


def takes_pairs(*arrays) -> bool:
    """True when every array holds bfloat16 bits (uint16) and ``available()``: the kernels'
    test for their pair paths."""
    return all(a.dtype == np.uint16 for a in arrays) and available()


@intrinsic
def pair_product(typingctx, c, a, panels, accumulate):
    """c [m, n] (float32; n a multiple of 32) = a · B, or c += a · B with ``accumulate``; a
    [m, k/2] and panels [>= n / 16, k/2, 16] uint32 bfloat16 pairs (module docstring), each
    with unit stride along its last axis. Every sum starts from zero; with ``accumulate`` c's
    earlier value joins once. Nothing here checks shapes: the kernels pass what they packed."""
    if not (
        isinstance(c, types.Array)
        and c.dtype == types.float32
        and c.ndim == 2
        and isinstance(a, types.Array)
        and a.dtype == types.uint32
        and a.ndim == 2
        and isinstance(panels, types.Array)
        and panels.dtype == types.uint32
        and panels.ndim == 3
        and isinstance(accumulate, types.Boolean)
    ):
        return None

    def codegen(context, builder, signature, args):
        intp = context.get_value_type(types.intp)
        f32, i32 = ir.FloatType(), ir.IntType(32)
        vec = ir.VectorType(f32, PANEL)
        pairs = ir.VectorType(i32, PANEL)
        bf16s = ir.VectorType(_BFloatType(), 2 * PANEL)
        dot = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vec, [vec, bf16s, bf16s]), _INTRINSIC
        )
        c_arr, a_arr, p_arr = (
            context.make_array(ty)(context, builder, value)
            for ty, value in zip(signature.args[:3], args[:3], strict=True)
        )
        add_to_c = args[3]
        const = lambda value: ir.Constant(intp, value)  # noqa: E731
        four = const(4)
        m, n = cgutils.unpack_tuple(builder, c_arr.shape, 2)
        k_pairs = cgutils.unpack_tuple(builder, a_arr.shape, 2)[1]
        c_step = builder.sdiv(cgutils.unpack_tuple(builder, c_arr.strides, 2)[0], four)
        a_step = builder.sdiv(cgutils.unpack_tuple(builder, a_arr.strides, 2)[0], four)
        p_strides = cgutils.unpack_tuple(builder, p_arr.strides, 3)
        panel_step, row_step = (builder.sdiv(s, four) for s in p_strides[:2])
        lane0 = ir.Constant(i32, 0)
        splat = ir.Constant(pairs, [0] * PANEL)

        def block(first_row, rows, panel):
            """Rows first_row … first_row + rows - 1 of c against panels panel, panel + 1."""
            row_index = [builder.add(first_row, const(r)) for r in range(rows)]
            a_rows = [builder.gep(a_arr.data, [builder.mul(r, a_step)]) for r in row_index]
            bases = [builder.gep(p_arr.data, [builder.mul(panel, panel_step)])]
            bases.append(builder.gep(bases[0], [panel_step]))

            def step(t, sums):
                columns = []
                for base in bases:
                    ptr = builder.bitcast(
                        builder.gep(base, [builder.mul(t, row_step)]), pairs.as_pointer()
                    )
                    columns.append(builder.bitcast(builder.load(ptr, align=4), bf16s))
                new = []
                for row, a_row in zip(sums, a_rows, strict=True):
                    x = builder.insert_element(
                        ir.Constant(pairs, ir.Undefined),
                        builder.load(builder.gep(a_row, [t])),
                        lane0,
                    )
                    x = builder.bitcast(
                        builder.shuffle_vector(x, ir.Constant(pairs, ir.Undefined), splat), bf16s
                    )
                    new.append(
                        [
                            builder.call(dot, [s, x, col])
                            for s, col in zip(row, columns, strict=True)
                        ]
                    )
                return new

            totals = emit_sum_loop(builder, intp, vec, rows, 2, const(0), k_pairs, step)
            col0 = builder.mul(panel, const(PANEL))
            for r, row_totals in zip(row_index, totals, strict=True):
                c_row = builder.gep(c_arr.data, [builder.add(builder.mul(r, c_step), col0)])
                for h, total in enumerate(row_totals):
                    ptr = builder.bitcast(builder.gep(c_row, [const(h * PANEL)]), vec.as_pointer())
                    added = builder.fadd(builder.load(ptr, align=4), total)
                    builder.store(builder.select(add_to_c, added, total), ptr, align=4)

        emit_register_blocks(builder, const, m, builder.sdiv(n, const(BLOCK_COLUMNS)), 2, block)
        return context.get_dummy_value()

    return types.none(c, a, panels, accumulate), codegen


@njit(cache=True)
def bf16_pair(lo, hi):
    """Two bfloat16 bit patterns as one pair (uint32): ``lo`` in the low half."""
    return np.uint32(lo) | (np.uint32(hi) << np.uint32(16))


@njit(cache=True)
def row_pairs(row, out):
    """out[t] = the pair of row[2t], row[2t + 1] (bfloat16 bits; an odd last one with 0)."""
    d = row.shape[0]
    for t in range(d // 2):
        out[t] = bf16_pair(row[2 * t], row[2 * t + 1])
    if d % 2:
        out[d // 2] = bf16_pair(row[d - 1], 0)


@njit(cache=True)
def pack_key_pairs(rows, panels):
    """panels[p, t, c] = elements 2t, 2t + 1 of row 16p + c of ``rows`` (bfloat16 bits [keys,
    D]; zeros past the last row and element): Kᵀ for ``pair_product``, pairs along D."""
    keys, d = rows.shape
    half = d // 2
    for p in range(panels.shape[0]):
        for c in range(PANEL):
            j = p * PANEL + c
            if j < keys:
                for t in range(half):
                    panels[p, t, c] = bf16_pair(rows[j, 2 * t], rows[j, 2 * t + 1])
                if d % 2:
                    panels[p, half, c] = bf16_pair(rows[j, d - 1], 0)
            else:
                for t in range(panels.shape[1]):
                    panels[p, t, c] = 0


@njit(cache=True)
def pack_value_pairs(rows, panels, length):
    """panels[p, t, c] = element 16p + c of rows 2t and 2t + 1 of ``rows`` (bfloat16 bits
    [keys, Dv]; zeros past the last element, and for the rows from ``length`` on, the
    sequence's key length: a tile ending on an odd key pairs it with the next value, whose
    weight is 0, and 0 times whatever lies past a sequence's keys (uninitialised cache rows:
    inf, NaN) must not reach the output): V for ``pair_product``, pairs along the keys."""
    keys, dv = min(rows.shape[0], length), rows.shape[1]
    for p in range(panels.shape[0]):
        for t in range(panels.shape[1]):
            j = 2 * t
            for c in range(PANEL):
                e = p * PANEL + c
                lo = rows[j, e] if j < keys and e < dv else np.uint16(0)
                hi = rows[j + 1, e] if j + 1 < keys and e < dv else np.uint16(0)
                panels[p, t, c] = bf16_pair(lo, hi)


@njit(cache=True)
def row_tile_pairs(x, tile):
    """The rows of a ``RowTile`` of x (bfloat16 bits [B, Hq, Sq, D]: the queries, or the
    output's gradient) as pairs along D, [group · npos, ceil(D / 2)] uint32, as they are (the
    score scale multiplies the scores)."""
    b, hk, group, i0, npos = tile
    pairs = np.empty((group * npos, (x.shape[3] + 1) // 2), dtype=np.uint32)
    for g in range(group):
        for r in range(npos):
            row_pairs(x[b, hk * group + g, i0 + r], pairs[g * npos + r])
    return pairs


@njit(cache=True)
def row_tile_column_pairs(x, tile):
    """The rows of a ``RowTile`` of x (bfloat16 bits [B, Hq, Sq, D]) transposed, as pairs along
    the rows: out[e, t] = element e of tile rows 2t and 2t + 1 (a last odd row paired with 0),
    [D, ceil(rows / 2)] uint32: Qᵀ or dOᵀ as ``pair_product``'s left operand."""
    b, hk, group, i0, npos = tile
    rows, d = group * npos, x.shape[3]
    out = np.empty((d, (rows + 1) // 2), dtype=np.uint32)
    for t in range(out.shape[1]):
        lo_row, hi_row = 2 * t, min(2 * t + 1, rows - 1)
        lo = x[b, hk * group + lo_row // npos, i0 + lo_row % npos]
        hi = x[b, hk * group + hi_row // npos, i0 + hi_row % npos]
        has_hi = 2 * t + 1 < rows
        for e in range(d):
            out[e, t] = bf16_pair(lo[e], hi[e] if has_hi else np.uint16(0))
    return out


@njit(cache=True)
def round_weight_pairs(p, n, out):
    """out[r, t] = p[r, 2t], p[r, 2t + 1] rounded to bfloat16 (to nearest even), for the
    ceil(n / 2) pairs of keys 0 … n - 1 (a last odd key paired with 0)."""
    for r in range(p.shape[0]):
        for t in range(n // 2):
            out[r, t] = bf16_pair(_float32_to_bf16(p[r, 2 * t]), _float32_to_bf16(p[r, 2 * t + 1]))
        if n % 2:
            out[r, n // 2] = bf16_pair(_float32_to_bf16(p[r, n - 1]), 0)


@njit(cache=True)
def round_row_panels(p, n, out):
    """out[q, t, c] = p[2t, 16q + c], p[2t + 1, 16q + c] rounded to bfloat16 (to nearest
    even) for the columns below n, zeros from n to out's width (a last odd row paired with 0):
    P (or dS) as ``pair_product``'s panels, pairs along the rows. Rows are read and panels
    written in order, so the loops vectorise."""
    rows = p.shape[0]
    for t in range(out.shape[1]):
        lo, hi = 2 * t, 2 * t + 1
        for q in range(out.shape[0]):
            for c in range(PANEL):
                col = q * PANEL + c
                if col < n:
                    hi_bits = _float32_to_bf16(p[hi, col]) if hi < rows else np.uint16(0)
                    out[q, t, c] = bf16_pair(_float32_to_bf16(p[lo, col]), hi_bits)
                else:
                    out[q, t, c] = 0
