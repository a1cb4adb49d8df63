"""Decode products on 8-bit KV caches in pairs, on CPUs that multiply pairs of 16-bit values
into 32-bit lanes: twice the multiply-adds per instruction of float32 FMAs, and a cache row
widened to 16 bits in one or a few instructions (to float32: two or more per 16 elements).

- int8 caches, bfloat16 or float16 queries, AVX512-VNNI (``vpdpwssd``: two int16 products
  per int32 lane): the query rows, scaled (score scale, log2 units), and the weights of each key
  tile (softmax weights times each value row's dequantization scale) are rounded to int16 with
  one scale per row (``quantize_rows``: max |x| onto ``int16_limit``) and their products with
  the int8 values summed exactly in int32;
- fp8 (e4m3) caches, bfloat16 queries, AVX512-BF16 (``vdpbf16ps``: two bfloat16 products per
  float32 lane): the cache bytes become bfloat16 exactly through a 128-entry table
  (``vpermt2w``, NaN patterns included), the queries are multiplied as they are and the weights
  rounded to bfloat16 (``round_rows``), as FlashAttention rounds P for half inputs; sums in
  float32.

The decode kernel (``attention_paged``) takes these paths for C-contiguous caches whose head
dims are multiples of CHUNK (``decode_pairs``); other calls keep its float32 loops.

The error the int16 rounding adds (docs/dtypes-and-errors.md): each query and weight element is
off by at most half its row's step, max |row| / 65534: below bfloat16's rounding (2⁻⁹ of the
element) for every element within 1/128 of its row's largest, and never more than 2⁻¹⁶ of that
largest.

Both loops are written in LLVM IR (the vectoriser does not find these instructions in plain
loops: it multiplies in 32-bit lanes). Q·K (``pair_scores``) keeps a block of 4 query rows by 4
keys in 16 registers over D and then sums the 16 registers into one by a tree of lane shuffles
(45 instructions for 16 sums, where one register at a time takes 9 each); P·V
(``pair_add_values``) pairs each two value rows' elements along D (the instruction's pairs run
along the summed axis: the keys) and keeps a block of 4 rows by 32 columns in 8 registers over a
run's keys.
"""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from fastpe._kv_quant import E4M3_VALUES

from ._half import E4M3_UNIT, _float32_to_bf16
from ._pair_products import _BFloatType
from ._runtime import njit

CHUNK = 32  # cache elements per product step: one 512-bit register of 16-bit values
ROWS = 4  # query rows per register block; the kernel pads its row buffers to a multiple
_KEYS = 4  # keys per Q·K register block


@functools.cache
def _features() -> set:
    """The CPU features Numba compiles for (the host's, or those NUMBA_CPU_NAME /
    NUMBA_CPU_FEATURES name)."""
    from numba.core.registry import cpu_target

    features = getattr(cpu_target.target_context.codegen(), "_tm_features", "") or ""
    return set(features.split(","))


def int8_available() -> bool:
    """True when the CPU has AVX512-VNNI: int8 caches decode in int16 products."""
    return "+avx512vnni" in _features()


def fp8_available() -> bool:
    """True when the CPU has AVX512-BF16 (and AVX512-BW's word permutes): fp8 caches decode in
    bfloat16 pairs."""
    return {"+avx512bf16", "+avx512bw"} <= _features()


def decode_pairs(q, k, v) -> str | None:
    """ "int8" or "fp8" when the decode kernel multiplies in pairs (module docstring), else
    None. q, k, v as the kernel takes them: half q as its bits (bfloat16 uint16, float16 int16),
    fp8 caches as uint8."""
    if not (k.dtype == v.dtype and k.flags.c_contiguous and v.flags.c_contiguous):
        return None
    if not (k.shape[-1] % CHUNK == 0 < k.shape[-1] and v.shape[-1] % CHUNK == 0 < v.shape[-1]):
        return None
    if k.dtype == np.int8 and q.dtype in (np.uint16, np.int16) and int8_available():
        return "int8"
    if k.dtype == np.uint8 and q.dtype == np.uint16 and fp8_available():
        return "fp8"
    return None


@njit(cache=True)
def int16_limit(d):
    """The largest int16 magnitude a row of ``quantize_rows`` reaches for sums over d terms of
    int8 values: d · 128 · limit stays below 2³¹, so no int32 sum wraps."""
    return min(32767, (2**31 - 1) // (max(d, 1) * 128))


@intrinsic
def _magnitude_bits(typingctx, value):
    """The bits of |value| (float32) as uint32: ordered as the magnitudes are, with every NaN
    above the infinity's 0x7F800000, so one integer max over a row finds its largest magnitude
    and whether it holds a NaN or an infinity (a max that vectorises; float max does not)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        bits = builder.bitcast(args[0], ir.IntType(32))
        return builder.and_(bits, ir.Constant(ir.IntType(32), 0x7FFFFFFF))

    return types.uint32(value), codegen


@intrinsic
def _float_of_bits(typingctx, bits):
    """float32 of the bits ``bits`` (uint32)."""
    if bits != types.uint32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(bits), codegen


_NOT_FINITE = np.uint32(0x7F800000)  # magnitude bits of infinity; NaNs lie above


@njit(cache=True)
def quantize_rows(x, factors, n, limit, out, scales):
    """out[r, c] = round(x[r, c] · factors[c] / scales[r]) for c < n, with scales[r] = max_c
    |x[r, c] · factors[c]| / limit (1 for a row of zeros; NaN for a row holding a NaN or an
    infinity, whose products then come out NaN, as the float products would), to nearest even;
    rows of out past x's are zeros (scale 1). x, factors float32."""
    for r in range(out.shape[0]):
        top = np.uint32(0)
        if r < x.shape[0]:
            for c in range(n):
                top = max(top, _magnitude_bits(x[r, c] * factors[c]))
        if top >= _NOT_FINITE or top == 0:
            scales[r] = np.nan if top >= _NOT_FINITE else 1.0
            for c in range(n):
                out[r, c] = 0
            continue
        scale = _float_of_bits(top) / np.float32(limit)
        scales[r] = scale
        inverse = np.float32(1.0) / scale
        for c in range(n):
            out[r, c] = np.int16(np.rint(x[r, c] * factors[c] * inverse))


@njit(cache=True)
def round_rows(x, n, out):
    """out[r, c] = x[r, c] rounded to bfloat16 (bits, to nearest even) for c < n; rows of out
    past x's are zeros. x float32."""
    for r in range(out.shape[0]):
        if r < x.shape[0]:
            for c in range(n):
                out[r, c] = _float32_to_bf16(x[r, c])
        else:
            for c in range(n):
                out[r, c] = 0


def _e4m3_table():
    """bfloat16 bits of every e4m3 magnitude 0 … 127 (``E4M3_VALUES``) in the decode loops' unit
    (the value / E4M3_UNIT, as ``attention_paged``'s float loops read fp8; exact: bfloat16 holds
    every such value as a normal number), the NaN pattern 0x7F as NaN."""
    bits = (E4M3_VALUES[:128] / E4M3_UNIT).astype(np.float32).view(np.uint32)
    assert not (bits & 0xFFFF).any()  # each value is a bfloat16 exactly
    return (bits >> 16).tolist()


_E4M3_TABLE = _e4m3_table()


def _i32(value):
    return ir.Constant(ir.IntType(32), value)


def _i16s(values):
    return ir.Constant(ir.VectorType(ir.IntType(16), len(values)), values)


class _Int8:
    """int8 caches: int16 products summed in int32 (``vpdpwssd``)."""

    acc = ir.VectorType(ir.IntType(32), 16)
    zero = ir.Constant(acc, [0] * 16)

    @staticmethod
    def widen(builder, ptr):
        """32 int8 at ptr (any alignment) sign-extended to <32 x i16>."""
        i8s = ir.VectorType(ir.IntType(8), CHUNK)
        raw = builder.load(builder.bitcast(ptr, i8s.as_pointer()), align=1)
        return builder.sext(raw, ir.VectorType(ir.IntType(16), CHUNK))

    @classmethod
    def dot(cls, builder, acc, a, b):
        i16s = ir.VectorType(ir.IntType(16), CHUNK)
        fn = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(cls.acc, [cls.acc, i16s, i16s]),
            "llvm.x86.avx512.vpdpwssd.512",
        )
        return builder.call(fn, [acc, a, b])

    @staticmethod
    def add(builder, a, b):
        return builder.add(a, b)

    @staticmethod
    def to_float(builder, x):
        return builder.sitofp(x, ir.VectorType(ir.FloatType(), 16))


class _Fp8:
    """fp8 caches: bfloat16 products summed in float32 (``vdpbf16ps``)."""

    acc = ir.VectorType(ir.FloatType(), 16)
    zero = ir.Constant(acc, [0.0] * 16)

    @staticmethod
    def widen(builder, ptr):
        """32 e4m3 bytes at ptr to their bfloat16 bits, <32 x i16>: the magnitude's entry of
        the table (two 64-entry word permutes, chosen by bit 6), then the sign."""
        i8s = ir.VectorType(ir.IntType(8), CHUNK)
        i16s = ir.VectorType(ir.IntType(16), CHUNK)
        raw = builder.load(builder.bitcast(ptr, i8s.as_pointer()), align=1)
        bits = builder.zext(raw, i16s)
        permute = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(i16s, [i16s, i16s, i16s]),
            "llvm.x86.avx512.vpermi2var.hi.512",
        )
        quarters = [_i16s(_E4M3_TABLE[i : i + CHUNK]) for i in range(0, 128, CHUNK)]
        low = builder.call(permute, [quarters[0], bits, quarters[1]])  # indices' bits 0-5
        high = builder.call(permute, [quarters[2], bits, quarters[3]])
        upper = builder.icmp_unsigned(
            "!=", builder.and_(bits, _i16s([0x40] * CHUNK)), _i16s([0] * CHUNK)
        )
        magnitude = builder.select(upper, high, low)
        sign = builder.and_(builder.shl(bits, _i16s([8] * CHUNK)), _i16s([0x8000] * CHUNK))
        return builder.or_(magnitude, sign)

    @classmethod
    def dot(cls, builder, acc, a, b):
        bf16s = ir.VectorType(_BFloatType(), CHUNK)
        fn = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(cls.acc, [cls.acc, bf16s, bf16s]),
            "llvm.x86.avx512bf16.dpbf16ps.512",
        )
        return builder.call(fn, [acc, builder.bitcast(a, bf16s), builder.bitcast(b, bf16s)])

    @staticmethod
    def add(builder, a, b):
        return builder.fadd(a, b)

    @staticmethod
    def to_float(builder, x):
        return x


def _kind(rows):
    """The products for a cache's Numba array type (None for other dtypes)."""
    return {types.int8: _Int8, types.uint8: _Fp8}.get(rows.dtype)


def _shuffle(builder, a, b, mask):
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), len(mask)), mask))


def _tree_sum(builder, vectors, add):
    """One vector of 16 lanes whose lane i holds the sum of all lanes of vectors[i] (16 vectors): at
    each level, two vectors of groups of w lanes become one of groups of w / 2 lanes by adding
    each group's halves (two shuffles and an add), 15 adds in all. The lanes come out in a known
    order, put right by a last shuffle."""
    work = [(vec, [i] * 16) for i, vec in enumerate(vectors)]  # (vector, input of each lane)
    width = 16
    while len(work) > 1:
        half = width // 2
        low = [
            side + g * width + i
            for side in (0, 16)
            for g in range(16 // width)
            for i in range(half)
        ]
        high = [x + half for x in low]
        merged = []
        for (a, a_origin), (b, b_origin) in zip(work[0::2], work[1::2], strict=True):
            both = a_origin + b_origin
            total = add(builder, _shuffle(builder, a, b, low), _shuffle(builder, a, b, high))
            merged.append((total, [both[x] for x in low]))
        work, width = merged, half
    total, origin = work[0]
    return _shuffle(builder, total, total, [origin.index(i) for i in range(16)])


def _element_step(builder, array, ndim, axis, itemsize):
    strides = cgutils.unpack_tuple(builder, array.strides, ndim)
    return builder.sdiv(strides[axis], itemsize)


def _shapes_fit(arrays, ndims, integers):
    """True when each of ``arrays`` is a Numba array of its ndim and each of ``integers`` an
    integer type: the intrinsics' shared typing rule (each adds its dtypes)."""
    if not all(isinstance(x, types.Array) for x in arrays):
        return False
    return tuple(x.ndim for x in arrays) == ndims and all(
        isinstance(i, types.Integer) for i in integers
    )


@intrinsic
def pair_scores(typingctx, s, col, q16, q_scales, rows, hk, k_scales):
    """s[r, col + c] = (q16[r] · rows[c, hk]) · q_scales[r] · k_scales[c] for r < s.shape[0]
    and c < n = rows.shape[0]. rows [n, H, D] C-contiguous with D a multiple of CHUNK: int8
    (q16 int16) or fp8 bits (uint8; q16 bfloat16 bits, uint16); q16 [>= s rows, rounded up to
    ROWS; D] C-contiguous (rows past s's are read, not written), q_scales float32 [same rows],
    k_scales float32 [n] at any stride, s float32 2-D with unit last stride. Nothing here
    checks shapes: the kernel passes what it sized."""
    if not _shapes_fit((s, q16, q_scales, rows, k_scales), (2, 2, 1, 3, 1), (col, hk)):
        return None
    kind = _kind(rows)
    if kind is None or q16.dtype not in (types.int16, types.uint16):
        return None
    if (s.dtype, q_scales.dtype, k_scales.dtype) != (types.float32,) * 3:
        return None

    def codegen(context, builder, signature, args):
        intp = context.get_value_type(types.intp)
        const = lambda value: ir.Constant(intp, value)  # noqa: E731
        f32 = ir.FloatType()
        s_arr, q_arr, qs_arr, k_arr, ks_arr = (
            context.make_array(signature.args[i])(context, builder, args[i])
            for i in (0, 2, 3, 4, 6)
        )
        col_ = context.cast(builder, args[1], signature.args[1], types.intp)
        hk_ = context.cast(builder, args[5], signature.args[5], types.intp)
        m = cgutils.unpack_tuple(builder, s_arr.shape, 2)[0]
        s_step = _element_step(builder, s_arr, 2, 0, const(4))
        q_rows, d = cgutils.unpack_tuple(builder, q_arr.shape, 2)
        q_step = _element_step(builder, q_arr, 2, 0, const(2))
        n = cgutils.unpack_tuple(builder, k_arr.shape, 3)[0]
        k_strides = cgutils.unpack_tuple(builder, k_arr.strides, 3)
        head = builder.gep(k_arr.data, [builder.mul(hk_, k_strides[1])])
        ks_step = _element_step(builder, ks_arr, 1, 0, const(4))
        chunks = builder.sdiv(d, const(CHUNK))
        last_key = builder.sub(n, const(1))

        with cgutils.for_range(builder, builder.sdiv(q_rows, const(ROWS))) as row_loop:
            r0 = builder.mul(row_loop.index, const(ROWS))
            q_ptrs = [
                builder.gep(q_arr.data, [builder.mul(builder.add(r0, const(r)), q_step)])
                for r in range(ROWS)
            ]
            # lane 4r + j of a block's sums: row r, key j; the rows' scales spread so once
            q_scale = ir.Constant(ir.VectorType(f32, ROWS), ir.Undefined)
            for r in range(ROWS):
                value = builder.load(builder.gep(qs_arr.data, [builder.add(r0, const(r))]))
                q_scale = builder.insert_element(q_scale, value, _i32(r))
            q_scales = _shuffle(
                builder, q_scale, q_scale, [r for r in range(ROWS) for _ in range(_KEYS)]
            )
            key_blocks = builder.sdiv(builder.add(n, const(_KEYS - 1)), const(_KEYS))
            with cgutils.for_range(builder, key_blocks) as key_loop:
                c0 = builder.mul(key_loop.index, const(_KEYS))
                # keys past n re-read the last key (valid memory); their sums are not stored
                keys = []
                for j in range(_KEYS):
                    c = builder.add(c0, const(j))
                    keys.append(builder.select(builder.icmp_signed("<", c, n), c, last_key))
                k_ptrs = [builder.gep(head, [builder.mul(c, k_strides[0])]) for c in keys]
                entry = builder.block
                loop = builder.append_basic_block("chunk_loop")
                done = builder.append_basic_block("chunk_done")
                builder.branch(loop)
                builder.position_at_end(loop)
                t = builder.phi(intp)
                t.add_incoming(const(0), entry)
                sums = [[builder.phi(kind.acc) for _ in range(_KEYS)] for _ in range(ROWS)]
                for row in sums:
                    for phi in row:
                        phi.add_incoming(kind.zero, entry)
                offset = builder.mul(t, const(CHUNK))
                k_chunks = [kind.widen(builder, builder.gep(p, [offset])) for p in k_ptrs]
                new = []
                for r, row in enumerate(sums):
                    q_ptr = builder.gep(q_ptrs[r], [offset])
                    i16s = ir.VectorType(ir.IntType(16), CHUNK)
                    q_chunk = builder.load(builder.bitcast(q_ptr, i16s.as_pointer()), align=2)
                    new.append(
                        [
                            kind.dot(builder, acc, q_chunk, kc)
                            for acc, kc in zip(row, k_chunks, strict=True)
                        ]
                    )
                t_next = builder.add(t, const(1))
                t.add_incoming(t_next, builder.block)
                for row, row_new in zip(sums, new, strict=True):
                    for phi, value in zip(row, row_new, strict=True):
                        phi.add_incoming(value, builder.block)
                builder.cbranch(builder.icmp_signed("<", t_next, chunks), loop, done)
                builder.position_at_end(done)
                totals = _tree_sum(builder, [x for row in new for x in row], kind.add)
                scores = kind.to_float(builder, totals)
                k_scale = ir.Constant(ir.VectorType(f32, _KEYS), ir.Undefined)
                for j, c in enumerate(keys):
                    value = builder.load(builder.gep(ks_arr.data, [builder.mul(c, ks_step)]))
                    k_scale = builder.insert_element(k_scale, value, _i32(j))
                k_scales = _shuffle(builder, k_scale, k_scale, list(range(_KEYS)) * ROWS)
                factors = builder.fmul(q_scales, k_scales)
                scores = builder.fmul(scores, factors)
                whole = builder.icmp_signed("<=", builder.add(c0, const(_KEYS)), n)
                for r in range(ROWS):
                    row_index = builder.add(r0, const(r))
                    with builder.if_then(builder.icmp_signed("<", row_index, m)):
                        base = builder.add(builder.mul(row_index, s_step), builder.add(col_, c0))
                        ptr = builder.gep(s_arr.data, [base])
                        with builder.if_else(whole) as (full, part):
                            with full:
                                four = ir.VectorType(f32, _KEYS)
                                part_scores = _shuffle(
                                    builder, scores, scores, [_KEYS * r + j for j in range(_KEYS)]
                                )
                                builder.store(
                                    part_scores, builder.bitcast(ptr, four.as_pointer()), align=4
                                )
                            with part:
                                for j in range(_KEYS):
                                    inside = builder.icmp_signed("<", builder.add(c0, const(j)), n)
                                    with builder.if_then(inside):
                                        value = builder.extract_element(scores, _i32(_KEYS * r + j))
                                        builder.store(value, builder.gep(ptr, [const(j)]))
        return context.get_dummy_value()

    return types.none(s, col, q16, q_scales, rows, hk, k_scales), codegen


def _merge_blocks(builder, vec, *incoming):
    """Phis (at the current block's start) joining [row][column] grids of values that reach it
    from several blocks: ``incoming`` = (grid, block) pairs."""
    first = incoming[0][0]
    merged = [[builder.phi(vec) for _ in row] for row in first]
    for grid, block in incoming:
        for phi_row, row in zip(merged, grid, strict=True):
            for phi, value in zip(phi_row, row, strict=True):
                phi.add_incoming(value, block)
    return merged


@intrinsic
def pair_add_values(typingctx, acc, w16, col, rows, hk):
    """acc[r, e] += Σ_c w16[r, col + c] · rows[c, hk, e], for c < n = rows.shape[0] and every
    row r of acc: int8 rows with int16 weights into int32 acc, or fp8 bits (uint8) with bfloat16
    weights (uint16 bits) into float32 acc. acc [rows, a multiple of ROWS; Dv] C-contiguous, w16
    [same rows, >= col + n + 1] C-contiguous (a run of odd length reads one weight past its
    last, which must be finite, and multiplies it by 0), rows [n, H, Dv] C-contiguous with Dv a
    multiple of CHUNK. Nothing here checks shapes: the kernel passes what it sized."""
    if not _shapes_fit((acc, w16, rows), (2, 2, 3), (col, hk)):
        return None
    kind = _kind(rows)
    if kind is None or (acc.dtype, w16.dtype) not in (
        (types.int32, types.int16),
        (types.float32, types.uint16),
    ):
        return None
    if (acc.dtype == types.int32) != (kind is _Int8):
        return None

    def codegen(context, builder, signature, args):
        intp = context.get_value_type(types.intp)
        const = lambda value: ir.Constant(intp, value)  # noqa: E731
        i32 = ir.IntType(32)
        i32s = ir.VectorType(i32, 16)
        i16s = ir.VectorType(ir.IntType(16), CHUNK)
        a_arr, w_arr, v_arr = (
            context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 3)
        )
        col_ = context.cast(builder, args[2], signature.args[2], types.intp)
        hk_ = context.cast(builder, args[4], signature.args[4], types.intp)
        m, dv = cgutils.unpack_tuple(builder, a_arr.shape, 2)
        a_step = _element_step(builder, a_arr, 2, 0, const(4))
        w_step = _element_step(builder, w_arr, 2, 0, const(2))
        n = cgutils.unpack_tuple(builder, v_arr.shape, 3)[0]
        v_strides = cgutils.unpack_tuple(builder, v_arr.strides, 3)
        head = builder.gep(v_arr.data, [builder.mul(hk_, v_strides[1])])
        low = [x for i in range(16) for x in (i, CHUNK + i)]
        high = [x for i in range(16, CHUNK) for x in (i, CHUNK + i)]
        zero_chunk = ir.Constant(i16s, [0] * CHUNK)

        def weight_pair(w_row, c):
            """w16[row, col + c], w16[row, col + c + 1] as one int32 in all 16 lanes."""
            ptr = builder.gep(w_row, [builder.add(col_, c)])
            pair = builder.load(builder.bitcast(ptr, i32.as_pointer()), align=2)
            one = builder.insert_element(ir.Constant(i32s, ir.Undefined), pair, _i32(0))
            splat = _shuffle(builder, one, one, [0] * 16)
            return builder.bitcast(splat, i16s)

        def step(c, sums, second):
            """sums after keys c and c + 1 (``second`` false: key c alone)."""
            a = kind.widen(builder, builder.gep(v_ptr(c), [offset]))
            b = (
                kind.widen(builder, builder.gep(v_ptr(builder.add(c, const(1))), [offset]))
                if second
                else zero_chunk
            )
            halves = [_shuffle(builder, a, b, low), _shuffle(builder, a, b, high)]
            new = []
            for w_row, row in zip(w_rows, sums, strict=True):
                w = weight_pair(w_row, c)
                new.append([kind.dot(builder, x, w, h) for x, h in zip(row, halves, strict=True)])
            return new

        v_ptr = lambda c: builder.gep(head, [builder.mul(c, v_strides[0])])  # noqa: E731
        with cgutils.for_range(builder, builder.sdiv(dv, const(CHUNK))) as chunk_loop:
            offset = builder.mul(chunk_loop.index, const(CHUNK))
            with cgutils.for_range(builder, builder.sdiv(m, const(ROWS))) as row_loop:
                r0 = builder.mul(row_loop.index, const(ROWS))
                rows_ = [builder.add(r0, const(r)) for r in range(ROWS)]
                w_rows = [builder.gep(w_arr.data, [builder.mul(r, w_step)]) for r in rows_]
                a_ptrs = [
                    [
                        builder.bitcast(
                            builder.gep(
                                a_arr.data,
                                [
                                    builder.add(
                                        builder.mul(r, a_step), builder.add(offset, const(h))
                                    )
                                ],
                            ),
                            kind.acc.as_pointer(),
                        )
                        for h in (0, 16)
                    ]
                    for r in rows_
                ]
                start = [[builder.load(p, align=4) for p in row] for row in a_ptrs]
                pairs = builder.sdiv(n, const(2))
                entry = builder.block
                loop = builder.append_basic_block("pair_loop")
                done = builder.append_basic_block("pair_done")
                builder.cbranch(builder.icmp_signed(">", pairs, const(0)), loop, done)
                builder.position_at_end(loop)
                t = builder.phi(intp)
                t.add_incoming(const(0), entry)
                sums = [[builder.phi(kind.acc) for _ in range(2)] for _ in range(ROWS)]
                for phi_row, first in zip(sums, start, strict=True):
                    for phi, value in zip(phi_row, first, strict=True):
                        phi.add_incoming(value, entry)
                new = step(builder.mul(t, const(2)), sums, True)
                t_next = builder.add(t, const(1))
                t.add_incoming(t_next, builder.block)
                for phi_row, row_new in zip(sums, new, strict=True):
                    for phi, value in zip(phi_row, row_new, strict=True):
                        phi.add_incoming(value, builder.block)
                loop_end = builder.block
                builder.cbranch(builder.icmp_signed("<", t_next, pairs), loop, done)
                builder.position_at_end(done)
                totals = _merge_blocks(builder, kind.acc, (start, entry), (new, loop_end))
                odd = builder.icmp_signed("!=", builder.srem(n, const(2)), const(0))
                before_odd = builder.block
                with builder.if_then(odd):
                    last = step(builder.sub(n, const(1)), totals, False)
                    odd_block = builder.block
                final = _merge_blocks(builder, kind.acc, (totals, before_odd), (last, odd_block))
                for row, ptrs in zip(final, a_ptrs, strict=True):
                    for value, ptr in zip(row, ptrs, strict=True):
                        builder.store(value, ptr, align=4)
        return context.get_dummy_value()

    return types.none(acc, w16, col, rows, hk), codegen
