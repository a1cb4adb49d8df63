"""Tile matrix products on keys and values packed in panels: ``panel_product(c, a, panels,
accumulate, sum_terms)`` computes ``c = a · B`` (or ``c += a · B``) where B [k, n] is held as
column panels of PANEL columns, ``panels[p, t, :] = B[t, p·PANEL : (p + 1)·PANEL]``.

The dense forward kernel packs K transposed (``panels[p, e, c]`` = key p·PANEL + c, dimension e:
S = Q·Kᵀ) and V as it is (``panels[p, j, c]`` = key j, value dimension p·PANEL + c: O += P·V)
once per call, and every query block of every head of a group reads them in place. BLAS instead
packs both operands on every call — once per query block and key tile — and so packs each key
tile again for every query block that reads it.

The product is a register-blocked loop written in LLVM IR: a block of up to six rows of c by
one panel (two vectors) stays in registers while the loop runs over k (or a part of it: see
``sum_terms``), each step loading one panel row and broadcasting one element of each row of a;
then the block is stored or added to c. The attention kernels' speed with it: bench/results/cpu-2core-avx2-panel-products.txt.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from numba.np.numpy_support import from_dtype

from ._half import _widen
from ._runtime import njit

# elements of a panel: two 256-bit vectors of float32 (16) or of float64 (8)
_LANES = {types.float32: 8, types.float64: 4}
WIDEST_PANEL = 2 * max(_LANES.values())
# rows of c held in registers at once: blocks of 6 (12 accumulator vectors of the 16 that AVX2
# has), then one each of 4, 2 and 1 for the rest
_ROW_BLOCKS = (6, 4, 2, 1)


def panel_width(array):
    """Columns per panel for ``array``'s dtype (a compile-time constant): 16 float32, 8 float64."""


@overload(panel_width, inline="always")
def _panel_width_impl(array):
    width = 2 * _LANES[array.dtype]
    return lambda array: width


def panel_columns(dtype) -> int:
    """``panel_width`` of a NumPy dtype, for the callers that allocate panels."""
    return 2 * _LANES[from_dtype(np.dtype(dtype))]


def _broadcast(builder, vec, x):
    i32 = ir.IntType(32)
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), x, ir.Constant(i32, 0))
    mask = ir.Constant(ir.VectorType(i32, vec.count), [0] * vec.count)
    return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined), mask)


def emit_sum_loop(builder, intp, vec, rows, columns, t_begin, t_end, step):
    """The inner loop of one register block: [rows][columns] vector sums carried in registers
    over t in t_begin … t_end - 1, each step's new sums ``step(t, sums)``; returns the final
    sums (zeros for an empty range)."""
    zeros = ir.Constant(vec, [0.0] * vec.count)
    entry = builder.block
    loop = builder.append_basic_block("sum_loop")
    done = builder.append_basic_block("sum_loop_done")
    builder.cbranch(builder.icmp_signed("<", t_begin, t_end), loop, done)
    builder.position_at_end(loop)
    t = builder.phi(intp)
    t.add_incoming(t_begin, entry)
    sums = [[builder.phi(vec) for _ in range(columns)] for _ in range(rows)]
    for row in sums:
        for phi in row:
            phi.add_incoming(zeros, entry)
    new = step(t, sums)
    t_next = builder.add(t, ir.Constant(intp, 1))
    loop_end = builder.block
    t.add_incoming(t_next, loop_end)
    for row, row_new in zip(sums, new, strict=True):
        for phi, value in zip(row, row_new, strict=True):
            phi.add_incoming(value, loop_end)
    builder.cbranch(builder.icmp_signed("<", t_next, t_end), loop, done)
    builder.position_at_end(done)
    result = []  # phis first in their block
    for row_new in new:
        row = []
        for value in row_new:
            phi = builder.phi(vec)
            phi.add_incoming(zeros, entry)
            phi.add_incoming(value, loop_end)
            row.append(phi)
        result.append(row)
    return result


def _k_loop(builder, intp, vec, a_rows, panel_row, t_begin, t_end):
    """The sums over t in t_begin … t_end - 1 of a[r, t] · panel[t, h·lanes:], as [r][h]
    vectors (``emit_sum_loop``)."""
    flags = ("contract",)  # fused multiply-add; no other fast-math: NaN and inf stay exact
    lanes = ir.Constant(intp, vec.count)

    def step(t, sums):
        base = panel_row(t)
        halves = [
            builder.load(builder.bitcast(ptr, vec.as_pointer()), align=4)
            for ptr in (base, builder.gep(base, [lanes]))
        ]
        new = []
        for row, a_row in zip(sums, a_rows, strict=True):
            x = _broadcast(builder, vec, builder.load(builder.gep(a_row, [t])))
            new.append(
                [builder.fadd(part, builder.fmul(x, half, flags=flags), flags=flags)
                 for part, half in zip(row, halves, strict=True)]
            )  # fmt: skip
        return new

    return emit_sum_loop(builder, intp, vec, len(a_rows), 2, t_begin, t_end, step)


def emit_register_blocks(builder, const, m, column_blocks, panels_per_block, block):
    """The loops of a register-blocked product: for each block of columns (``panels_per_block``
    panels), ``block(first_row, rows, panel)`` over the m rows of c in blocks of _ROW_BLOCKS[0]
    rows, then at most one block of each smaller size for the rest."""
    most = _ROW_BLOCKS[0]
    with cgutils.for_range(builder, column_blocks) as panels_loop:
        panel = builder.mul(panels_loop.index, const(panels_per_block))
        blocks = builder.sdiv(m, const(most))
        with cgutils.for_range(builder, blocks) as loop:
            block(builder.mul(loop.index, const(most)), most, panel)
        done = builder.mul(blocks, const(most))
        for rows in _ROW_BLOCKS[1:]:
            fits = builder.icmp_signed("<=", builder.add(done, const(rows)), m)
            with builder.if_then(fits):
                block(done, rows, panel)
            done = builder.select(fits, builder.add(done, const(rows)), done)


@intrinsic
def panel_product(typingctx, c, a, panels, accumulate, sum_terms):
    """c [m, n] = a [m, k] · B (accumulate false) or c += a · B (true), B [k, n] given as
    ``panels`` [>= n / PANEL, k, PANEL]. n must be a multiple of PANEL (the kernels pad their
    tiles: code for a partial panel made each kernel's first compile seconds longer). One
    float dtype throughout; c and a 2-D and panels 3-D, each with unit stride along its last
    axis (any other strides): the kernels pass the arrays they allocated and packed, and
    nothing here checks the shapes.

    ``sum_terms``: the sums over k are taken in parts of this many terms, each summed in
    registers from zero and then added to c. The float32 rounding error of one running sum
    grows with its length: attention's Q·Kᵀ over a head dim of 128 in one part had twice
    SDPA's error, in parts of 32 less than SDPA's (tests/attention/test_edges.py's grid).
    Every sum starts from zero (also when accumulating: c's earlier total joins once)."""
    arrays = (c, a, panels)
    if not all(isinstance(x, types.Array) for x in arrays):
        return None
    if len({x.dtype for x in arrays}) != 1 or c.dtype not in _LANES:
        return None
    if (c.ndim, a.ndim, panels.ndim) != (2, 2, 3) or not isinstance(accumulate, types.Boolean):
        return None
    if not isinstance(sum_terms, types.Integer):
        return None
    lanes = _LANES[c.dtype]
    width = 2 * lanes

    def codegen(context, builder, signature, args):
        intp = context.get_value_type(types.intp)
        element = context.get_value_type(signature.args[0].dtype)
        vec = ir.VectorType(element, lanes)
        c_arr, a_arr, p_arr = (
            context.make_array(ty)(context, builder, value)
            for ty, value in zip(signature.args[:3], args[:3], strict=True)
        )
        add_to_c = args[3]
        part = context.cast(builder, args[4], signature.args[4], types.intp)
        part = builder.select(  # at least one term per part
            builder.icmp_signed(">", part, ir.Constant(intp, 0)), part, ir.Constant(intp, 1)
        )
        const = lambda value: ir.Constant(intp, value)  # noqa: E731
        itemsize = const(context.get_abi_sizeof(element))
        m, n = cgutils.unpack_tuple(builder, c_arr.shape, 2)
        k_count = cgutils.unpack_tuple(builder, a_arr.shape, 2)[1]
        c_step = builder.sdiv(cgutils.unpack_tuple(builder, c_arr.strides, 2)[0], itemsize)
        a_step = builder.sdiv(cgutils.unpack_tuple(builder, a_arr.strides, 2)[0], itemsize)
        p_strides = cgutils.unpack_tuple(builder, p_arr.strides, 3)
        panel_step, row_step = (builder.sdiv(s, itemsize) for s in p_strides[:2])

        def block(first_row, rows, panel):
            """Rows first_row … first_row + rows - 1 of c against one panel."""
            row_index = [builder.add(first_row, const(r)) for r in range(rows)]
            a_rows = [builder.gep(a_arr.data, [builder.mul(r, a_step)]) for r in row_index]
            col0 = builder.mul(panel, const(width))
            c_rows = [
                builder.gep(c_arr.data, [builder.add(builder.mul(r, c_step), col0)])
                for r in row_index
            ]
            base = builder.gep(p_arr.data, [builder.mul(panel, panel_step)])
            panel_row = lambda t: builder.gep(base, [builder.mul(t, row_step)])  # noqa: E731
            k_parts = builder.sdiv(builder.add(k_count, builder.sub(part, const(1))), part)
            k_parts = builder.select(
                builder.icmp_signed(">", k_parts, const(0)), k_parts, const(1)
            )  # an empty k still writes c (zeros) when not accumulating
            flags = ("contract",)
            with cgutils.for_range(builder, k_parts) as k_loop:
                t_begin = builder.mul(k_loop.index, part)
                t_end = builder.add(t_begin, part)
                t_end = builder.select(builder.icmp_signed("<", t_end, k_count), t_end, k_count)
                sums = _k_loop(builder, intp, vec, a_rows, panel_row, t_begin, t_end)
                add = builder.or_(add_to_c, builder.icmp_signed(">", k_loop.index, const(0)))
                for c_row, row in zip(c_rows, sums, strict=True):
                    for h, value in enumerate(row):
                        ptr = builder.gep(c_row, [const(h * lanes)])
                        ptr = builder.bitcast(ptr, vec.as_pointer())
                        total = builder.fadd(builder.load(ptr, align=4), value, flags=flags)
                        builder.store(builder.select(add, total, value), ptr, align=4)

        emit_register_blocks(builder, const, m, builder.sdiv(n, const(width)), 1, block)
        return context.get_dummy_value()

    return types.none(c, a, panels, accumulate, sum_terms), codegen


# plain functions, not inlined overloads: an overload with inline="always" is typed twice (on
# its own, then again inside its caller), which was most of the packing's first compile
@njit(cache=True)
def pack_key_panels(k, b, hk, panels):
    """panels[p, e, c] = key p·W + c of head hk of sequence b, dimension e (widened; zeros past
    the last key): Kᵀ in panels of W = ``panel_width`` keys, the right operand of Q·Kᵀ."""
    keys, d = k.shape[2], k.shape[3]
    width = panels.shape[2]
    for p in range(panels.shape[0]):
        for c in range(width):
            j = p * width + c
            if j < keys:
                for e in range(d):
                    panels[p, e, c] = _widen(k[b, hk, j, e])
            else:
                for e in range(d):
                    panels[p, e, c] = 0.0


@njit(cache=True)
def pack_value_panels(v, b, hk, panels):
    """panels[p, j, c] = dimension p·W + c of value j of head hk of sequence b (widened; zeros
    past the last dimension): V in panels of W columns, the right operand of P·V."""
    keys, dv = v.shape[2], v.shape[3]
    width = panels.shape[2]
    whole = dv // width
    # row by row, whole panels without a bounds test in the loop (one kept the loop scalar,
    # several times slower than packing K)
    for j in range(keys):
        row = v[b, hk, j]
        for p in range(whole):
            target = panels[p, j]
            for c in range(width):
                target[c] = _widen(row[p * width + c])
        if whole < panels.shape[0]:
            target = panels[whole, j]
            for c in range(width):
                e = whole * width + c
                target[c] = _widen(row[e]) if e < dv else 0.0
