"""Scalar functions of flex_attention's generated tile steps (kernels/numba/flex_attention.py):
vectorisable float32-accurate forms on float32 tiles (libm's tanh and exp are scalar calls that
stop LLVM vectorising a tile loop), libm on float64 tiles. ``is_f32`` is a compile-time constant
of each specialisation (``_attention_common._is_f32``)."""

from __future__ import annotations

import math

import numpy as np
from fastpe.kernels.numba._attention_common import _FLAGS, LOG2E, _exp2, _tanh_ratio64
from fastpe.kernels.numba._runtime import njit


@njit(cache=True, fastmath=_FLAGS, error_model="numpy", inline="always")
def _tanh(x, is_f32):
    """tanh(x): the soft-cap's float64 rational (relative error 2e-8) for float32 tiles."""
    if not is_f32:
        return math.tanh(x)
    t = x * x
    t = t if t < 81.0 else 81.0
    inside = x * _tanh_ratio64(t)
    outside = 1.0 if x > 0.0 else -1.0
    value = inside if abs(x) <= 9.0 else outside
    return value if x == x else x


@njit(cache=True, fastmath=_FLAGS, error_model="numpy", inline="always")
def _exp2f(x, is_f32):
    """2**x: the attention kernels' polynomial exp2 (relative error 1e-7) for float32 tiles."""
    if not is_f32:
        return 2.0**x
    return np.float64(_exp2(np.float32(x)))


@njit(cache=True, fastmath=_FLAGS, error_model="numpy", inline="always")
def _exp(x, is_f32):
    if not is_f32:
        return math.exp(x)
    return np.float64(_exp2(np.float32(x * LOG2E)))


@njit(cache=True, fastmath=_FLAGS, error_model="numpy", inline="always")
def _sigmoid(x, is_f32):
    return 1.0 / (1.0 + _exp(-x, is_f32))


@njit(cache=True, inline="always")
def _sign(x):
    return (x > 0) - (x < 0)
