"""Half precision in Numba kernels: bfloat16 travels as its uint16 bit pattern and float16 as its
int16 bit pattern (Numba has neither half type; the signedness is only a tag that picks the
conversion at compile time). ``_widen`` makes an element a number to compute with, exactly;
``_narrow`` rounds a result back to nearest-even, bit for bit as torch rounds.

The conversions are LLVM IR written here, without branches and in 32-bit integers, so that a
loop over contiguous elements vectorises (8 lanes with AVX2). The same steps written in Python
ran scalar: Numba widens uint32 arithmetic to 64 bits, and the branches of the float16 cases
stayed branches. float16 converts with LLVM's own half type where the CPU Numba compiles for has
F16C (x86 since 2012: one instruction for 8 elements each way; the integer steps remain for
other CPUs); the results are the same bits, except that widening quiets a signalling NaN, which
every later step (arithmetic or rounding back) quiets anyway.

Quantized KV caches are read through ``_widen`` too: float8_e4m3fn as its uint8 bits (the same
kind of integer steps), int8 as itself (converted to float32); their scales are applied by the
kernels."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

_I16, _I32, _F32 = ir.IntType(16), ir.IntType(32), ir.FloatType()


def _widen(value):
    """An element as a number to compute with: half bits -> float32, floats unchanged."""


def _narrow(array, value):
    """``value`` as an element of ``array``: float -> half bits for uint16/int16 arrays."""


def _u32(value):
    return ir.Constant(_I32, value)


def _has_f16c(context):
    """Whether the machine code is generated for a CPU with F16C (Numba targets the host unless
    NUMBA_CPU_NAME / NUMBA_CPU_FEATURES say otherwise; the disk cache keys on the features)."""
    features = getattr(context.codegen(), "_tm_features", "") or ""
    return "+f16c" in features.split(",")


@intrinsic
def _bf16_to_float32(typingctx, bits):
    """bfloat16 bits (uint16) -> float32, exactly: they are its top half."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], _I32), _u32(16))
        return builder.bitcast(wide, _F32)

    return types.float32(types.uint16), codegen


@intrinsic
def _float32_to_bf16(typingctx, value):
    """float32 -> bfloat16 bits (uint16), rounded to nearest even; a NaN stays a NaN, quieted,
    with its sign and top payload bits."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        bits = builder.bitcast(args[0], _I32)
        top = builder.lshr(bits, _u32(16))
        keep = builder.and_(top, _u32(1))  # ties go to the even bfloat16
        rounded = builder.lshr(builder.add(builder.add(bits, _u32(0x7FFF)), keep), _u32(16))
        nan = builder.fcmp_unordered("uno", args[0], args[0])
        result = builder.select(nan, builder.or_(top, _u32(0x40)), rounded)
        return builder.trunc(result, _I16)

    return types.uint16(types.float32), codegen


def _e4m3_integer_ir(builder, bits):
    """float8_e4m3fn bits (i8) -> float32, exactly, in 32-bit integer steps: bias 7, 3 mantissa
    bits, subnormals m · 2^-9 below 2^-6, S.1111.111 NaN (no infinities)."""
    b = builder.zext(bits, _I32)
    sign = builder.shl(builder.and_(b, _u32(0x80)), _u32(24))
    magnitude = builder.and_(b, _u32(0x7F))
    # exponent and mantissa in float32's places, the exponent rebiased 7 -> 127
    normal = builder.add(builder.shl(magnitude, _u32(20)), _u32(120 << 23))
    # exponent 0: mantissa · 2^-9, exact in float32
    tiny = builder.fmul(builder.sitofp(magnitude, _F32), ir.Constant(_F32, 2.0**-9))
    result = builder.select(
        builder.icmp_unsigned("==", magnitude, _u32(0x7F)),
        _u32(0x7FC00000),
        builder.select(
            builder.icmp_unsigned("<", magnitude, _u32(8)), builder.bitcast(tiny, _I32), normal
        ),
    )
    return builder.bitcast(builder.or_(result, sign), _F32)


def _e4m3_f16c_ir(builder, bits, nan_step, rescale=True):
    """float8_e4m3fn bits (i8) -> float32 through float16, for CPUs with F16C: the fp8 bits
    shifted into a half's places (S.0EEEE.MMM0000000) are the value · 2^-8 as a half, normals
    and subnormals alike (the half's subnormal step 2^-24 · 2^7 = 2^-17 = fp8's 2^-9 · 2^-8), so
    one 16-bit shift and mask, ``vcvtph2ps`` and a multiply by 2^8 widen exactly. The fp8 NaN
    S.1111.111 would land on ±1.875 · 2^8 = ±480: with ``nan_step`` it becomes a half NaN, with
    its sign, first (without, the caller has made sure no element is a NaN). In 16-bit lanes
    these are about half the instructions of the 32-bit integer steps (measured in L1: 0.15
    against 0.27 ns per element). Without ``rescale`` the multiply by 2^8 is left to the caller
    (the result is the value · 2^-8, exactly)."""
    i16 = lambda value: ir.Constant(_I16, value)  # noqa: E731
    shifted = builder.shl(builder.sext(bits, _I16), i16(7))  # S…S EEEE MMM 0000000
    half = builder.and_(shifted, i16(0xBF80))  # the sign, then 0 EEEE MMM 0000000
    if nan_step:
        nan = builder.icmp_unsigned("==", builder.and_(half, i16(0x3F80)), i16(0x3F80))
        half = builder.select(nan, builder.or_(half, i16(0x7E00)), half)
    wide = builder.fpext(builder.bitcast(half, ir.HalfType()), _F32)
    return builder.fmul(wide, ir.Constant(_F32, 256.0)) if rescale else wide


# The unit of ``_e4m3_finite_to_units``: its result times this is the fp8 value.
E4M3_UNIT = 256.0


def _e4m3_intrinsic(f16c_allowed, nan_step=True, rescale=True):
    """float8_e4m3fn bits (uint8) -> float32 intrinsic: through F16C where the target has it
    (and ``f16c_allowed``), else in 32-bit integer steps; the same values either way. Without
    ``nan_step`` the F16C steps leave NaN patterns out (they read as ±480): for loops over
    elements known to hold none. Without ``rescale`` the result is the value / E4M3_UNIT
    (exact: a power of two), which saves the F16C steps their one multiply; the caller folds
    the unit into a factor it multiplies by anyway (a dequantization scale)."""

    @intrinsic
    def widen(typingctx, bits):
        if bits != types.uint8:
            return None

        def codegen(context, builder, signature, args):
            if f16c_allowed and _has_f16c(context):
                return _e4m3_f16c_ir(builder, args[0], nan_step, rescale)
            value = _e4m3_integer_ir(builder, args[0])
            return value if rescale else builder.fmul(value, ir.Constant(_F32, 1 / E4M3_UNIT))

        return types.float32(types.uint8), codegen

    return widen


_e4m3_to_float32 = _e4m3_intrinsic(True)
# for elements known not to be NaN patterns (the decode loops check each run first), in units
# of E4M3_UNIT: the decode loops' widening is the F16C conversion and no multiply
_e4m3_finite_to_units = _e4m3_intrinsic(True, nan_step=False, rescale=False)
# the integer steps alone, whatever the CPU: the tests check them where F16C is used
_e4m3_to_float32_integer = _e4m3_intrinsic(False)


def _fp16_widen_ir(builder, bits):
    """float16 bits (i16) -> float32 in integer steps, exactly: subnormals, inf, NaN (payload
    kept)."""
    h = builder.zext(bits, _I32)
    sign = builder.shl(builder.and_(h, _u32(0x8000)), _u32(16))
    magnitude = builder.and_(h, _u32(0x7FFF))
    shifted = builder.shl(magnitude, _u32(13))  # exponent and mantissa in float32's places
    normal = builder.add(shifted, _u32(112 << 23))  # rebias the exponent 15 -> 127
    special = builder.add(shifted, _u32(224 << 23))  # exponent 31 -> 255: inf, NaN
    # zero or subnormal: mantissa · 2^-24, exact in float32
    tiny = builder.fmul(builder.sitofp(magnitude, _F32), ir.Constant(_F32, 2.0**-24))
    tiny = builder.bitcast(tiny, _I32)
    result = builder.select(
        builder.icmp_unsigned(">=", magnitude, _u32(0x7C00)),
        special,
        builder.select(builder.icmp_unsigned("<", magnitude, _u32(0x400)), tiny, normal),
    )
    return builder.bitcast(builder.or_(result, sign), _F32)


def _fp16_narrow_ir(builder, value):
    """float32 -> float16 bits (i16) in integer steps, rounded to nearest even: overflow to
    inf, subnormals, and a NaN quieted with its sign and top payload bits."""
    bits = builder.bitcast(value, _I32)
    sign = builder.and_(builder.lshr(bits, _u32(16)), _u32(0x8000))
    magnitude = builder.and_(bits, _u32(0x7FFFFFFF))
    nan = builder.or_(_u32(0x7E00), builder.and_(builder.lshr(magnitude, _u32(13)), _u32(0x3FF)))
    # a normal half: rebias the exponent 127 -> 15, round off 13 mantissa bits, ties to even
    rebiased = builder.sub(magnitude, _u32(0x38000000))
    keep = builder.and_(builder.lshr(rebiased, _u32(13)), _u32(1))
    normal = builder.lshr(builder.add(builder.add(rebiased, _u32(0xFFF)), keep), _u32(13))
    # below 2^-14, a subnormal half (or zero): adding 0.5 leaves the value in float32's units
    # of 2^-24, the half's subnormal step, rounded to nearest even by the FPU
    absolute = builder.bitcast(magnitude, _F32)
    units = builder.bitcast(builder.fadd(absolute, ir.Constant(_F32, 0.5)), _I32)
    subnormal = builder.sub(units, _u32(0x3F000000))
    result = builder.select(
        builder.icmp_unsigned(">", magnitude, _u32(0x7F800000)),
        nan,
        builder.select(
            builder.icmp_unsigned(">=", magnitude, _u32(0x477FF000)),  # >= 65520: inf
            _u32(0x7C00),
            builder.select(
                builder.icmp_unsigned(">=", magnitude, _u32(0x38800000)), normal, subnormal
            ),
        ),
    )
    return builder.trunc(builder.or_(result, sign), _I16)


def _fp16_intrinsics(f16c_allowed):
    """(widen, narrow) float16 intrinsics: with F16C where the target has it (and
    ``f16c_allowed``), else in integer steps."""

    @intrinsic
    def widen(typingctx, bits):
        if bits != types.int16:
            return None

        def codegen(context, builder, signature, args):
            if f16c_allowed and _has_f16c(context):  # vcvtph2ps
                return builder.fpext(builder.bitcast(args[0], ir.HalfType()), _F32)
            return _fp16_widen_ir(builder, args[0])

        return types.float32(types.int16), codegen

    @intrinsic
    def narrow(typingctx, value):
        if value != types.float32:
            return None

        def codegen(context, builder, signature, args):
            if f16c_allowed and _has_f16c(context):  # vcvtps2ph, MXCSR's rounding: to even
                return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), _I16)
            return _fp16_narrow_ir(builder, args[0])

        return types.int16(types.float32), codegen

    return widen, narrow


_fp16_to_float32, _float32_to_fp16 = _fp16_intrinsics(True)
# the integer steps alone, whatever the CPU: the tests check them where F16C is used
_fp16_to_float32_integer, _float32_to_fp16_integer = _fp16_intrinsics(False)


@overload(_widen, inline="always")
def _widen_impl(value):
    if value == types.uint8:
        return lambda value: _e4m3_to_float32(value)
    if value == types.int8:
        return lambda value: np.float32(value)
    if value == types.uint16:
        return lambda value: _bf16_to_float32(value)
    if value == types.int16:
        return lambda value: _fp16_to_float32(value)
    return lambda value: value


@overload(_narrow, inline="always")
def _narrow_impl(array, value):
    if array.dtype == types.uint16:
        return lambda array, value: _float32_to_bf16(np.float32(value))
    if array.dtype == types.int16:
        return lambda array, value: _float32_to_fp16(np.float32(value))
    return lambda array, value: value
