"""Half precision in Numba kernels: bfloat16 travels as its uint16 bit pattern and float16 as its
int16 bit pattern (Numba has neither half type; the signedness is only a tag that picks the
conversion at compile time). ``_widen`` makes an element a number to compute with, exactly;
``_narrow`` rounds a result back to nearest-even, bit for bit as torch rounds.

Quantized KV caches are read through ``_widen`` too: float8_e4m3fn as its uint8 bits (a
256-entry table), int8 as itself (converted to float32); their scales are applied by the
kernels."""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload, register_jitable


def _widen(value):
    """An element as a number to compute with: half bits -> float32, floats unchanged."""


def _narrow(array, value):
    """``value`` as an element of ``array``: float -> half bits for uint16/int16 arrays."""


@register_jitable
def _fp16_to_float32(value):
    """float16 bits (int16) -> float32, exactly. A plain jitted function rather than an inline
    overload body: Numba's inliner mishandles its branches (NumbaIRAssumptionWarning)."""
    h = np.uint32(np.uint16(value))
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exp = (h >> np.uint32(10)) & np.uint32(0x1F)
    mant = h & np.uint32(0x3FF)
    if exp == np.uint32(0):  # zero or subnormal: mant · 2^-24, exact in float32
        result = np.float32(mant) * np.float32(5.9604644775390625e-08)
        if sign:
            result = -result
    else:
        if exp == np.uint32(0x1F):  # inf, NaN (payload kept)
            bits = sign | np.uint32(0x7F800000) | (mant << np.uint32(13))
        else:  # normal: rebias the exponent 15 -> 127
            bits = sign | ((exp + np.uint32(112)) << np.uint32(23)) | (mant << np.uint32(13))
        result = np.uint32(bits).view(np.float32)
    return result


@register_jitable
def _float32_to_fp16(value):
    """float32 -> float16 bits (int16), rounded to nearest even. A plain jitted function for the
    reason given at ``_fp16_to_float32``."""
    bits = np.float32(value).view(np.uint32)
    sign = (bits >> np.uint32(16)) & np.uint32(0x8000)
    mag = bits & np.uint32(0x7FFFFFFF)
    if mag > np.uint32(0x7F800000):  # NaN stays a quiet NaN
        half = sign | np.uint32(0x7E00) | ((mag >> np.uint32(13)) & np.uint32(0x3FF))
    elif mag >= np.uint32(0x477FF000):  # >= 65520 rounds past 65504: inf
        half = sign | np.uint32(0x7C00)
    elif mag >= np.uint32(0x38800000):  # a normal half: rebias 127 -> 15, round 13 bits
        mag = mag - np.uint32(0x38000000)
        keep = (mag >> np.uint32(13)) & np.uint32(1)  # ties go to the even half
        half = sign | ((mag + np.uint32(0xFFF) + keep) >> np.uint32(13))
    else:  # a subnormal half (or zero): count units of 2^-24, round to nearest even
        exp = mag >> np.uint32(23)
        shift = np.uint32(126) - exp  # >= 14 here
        if shift > np.uint32(25) or exp == np.uint32(0):
            half = sign  # below half the smallest subnormal (2^-25 itself ties to 0)
        else:
            full = (mag & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
            units = full >> shift
            rest = full & ((np.uint32(1) << shift) - np.uint32(1))
            middle = np.uint32(1) << (shift - np.uint32(1))
            if rest > middle or (rest == middle and (units & np.uint32(1)) != 0):
                units += np.uint32(1)  # may carry into the smallest normal: still right
            half = sign | units
    return np.int16(np.uint16(half))


def _e4m3_table() -> np.ndarray:
    """float32 [256]: the value of each float8_e4m3fn bit pattern (bias 7, 3 mantissa bits,
    subnormals m · 2^-9 below 2^-6, S.1111.111 NaN, no infinities)."""
    bits = np.arange(256)
    exponent, mantissa = (bits >> 3) & 0xF, (bits & 7).astype(np.float64)
    magnitude = np.where(
        exponent == 0, mantissa * 2.0**-9, (8.0 + mantissa) * np.exp2(exponent - 10.0)
    )
    magnitude[(bits & 0x7F) == 0x7F] = np.nan
    return np.where(bits & 0x80, -magnitude, magnitude).astype(np.float32)


# One element at a time, a table lookup is the cheapest exact decoding (branch-free bit
# arithmetic on scalars ran 1.9x slower in the decode loops); runs of many elements are decoded
# by vectorised arithmetic instead (attention_paged._head_rows)
_E4M3 = _e4m3_table()


@overload(_widen, inline="always")
def _widen_impl(value):
    if value == types.uint8:
        return lambda value: _E4M3[value]
    if value == types.int8:
        return lambda value: np.float32(value)
    if value == types.uint16:
        return lambda value: np.uint32(np.uint32(value) << np.uint32(16)).view(np.float32)
    if value == types.int16:
        return lambda value: _fp16_to_float32(value)
    return lambda value: value


@overload(_narrow, inline="always")
def _narrow_impl(array, value):
    if array.dtype == types.uint16:

        def to_bf16(array, value):
            bits = np.float32(value).view(np.uint32)
            if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN stays a quiet NaN
                return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
            keep = (bits >> np.uint32(16)) & np.uint32(1)  # ties go to the even bf16
            return np.uint16((bits + np.uint32(0x7FFF) + keep) >> np.uint32(16))

        return to_bf16
    if array.dtype == types.int16:
        return lambda array, value: _float32_to_fp16(value)
    return lambda array, value: value
