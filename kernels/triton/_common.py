"""Pieces shared by the Triton kernels: the accurate sin/cos of p·ω, launch helpers, and the
interpreter switches (TRITON_INTERPRET=1 runs these kernels on CPU torch tensors in CI)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# constexpr: Triton kernels may only read globals declared so
TWO_PI = tl.constexpr(6.283185307179586)
INV_TWO_PI = tl.constexpr(0.15915494309189535)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def low_precision_via_fp32(dtype: torch.dtype) -> bool:
    """Under the interpreter (Triton 3.x), bf16 `tl.dot` returns wrong values and fp32 -> bf16
    stores truncate instead of rounding to nearest even; on a GPU both are native and correct.
    The launchers then compute in fp32 and let torch round the result."""
    return interpreted() and dtype == torch.bfloat16


def next_pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, triton.next_power_of_2(max(int(n), 1)))


@triton.jit
def sincos_of_product(position, omega, FP64: tl.constexpr = False):
    """sin and cos of position·ω, accurate at any position up to ~2^31 (fp32, or fp64 if FP64).

    The product and its reduction modulo 2π are done in fp64 (exact to ~1e-16 relative), so the
    fp32 sin/cos only ever see an argument in [-π, π]: no fast approximation on a large argument.
    """
    angle = position.to(tl.float64) * omega
    turns = tl.floor(angle * INV_TWO_PI + 0.5)
    reduced = angle - turns * TWO_PI
    if FP64:
        return tl.sin(reduced), tl.cos(reduced)
    reduced32 = reduced.to(tl.float32)
    return tl.sin(reduced32), tl.cos(reduced32)
