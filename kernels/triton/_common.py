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


# 2π = TWO_PI_A + TWO_PI_B + TWO_PI_C (Cody-Waite): A and B carry 19 and 17 significant bits, so
# k·A and k·B are exact in fp64 for any turn count k < 2^34; C is the fp64 remainder (the sum is
# within 5e-28 of 2π).
TWO_PI_A = tl.constexpr(6.2831878662109375)
TWO_PI_B = tl.constexpr(-2.559041604399681e-06)
TWO_PI_C = tl.constexpr(1.0253376606378076e-11)


@triton.jit
def _reduce_turns(x):
    """x - k·2π, k = round(x / 2π): exact up to the last subtraction for |x| < 2^36
    (x - k·A is exact by Sterbenz: k·A lies within a factor 2 of x whenever k != 0)."""
    k = tl.floor(x * INV_TWO_PI + 0.5)
    return ((x - k * TWO_PI_A) - k * TWO_PI_B) - k * TWO_PI_C


@triton.jit
def sincos_of_product(position, omega, FP64: tl.constexpr = False):
    """sin and cos of position·ω (ω fp64, taken as exact), accurate at any position below 2^32:
    ~1 fp32 ulp in fp32, ~1e-15 in fp64; beyond 2^32 the error grows like position·2^-53.

    ω is split into three pieces of 21, 21 and 11 significant bits, so position·piece is exact
    in fp64 for position < 2^32; the first two products reduce exactly modulo 2π (Cody-Waite,
    for position·ω < 2^36, i.e. any ω < 16) and the third is below 2^-9. The fp32 sin/cos then
    see an argument in [-π, π], and the rounding of that argument to fp32 (up to 1.2e-7 rad) is
    put back to first order: sin(r32 + d) ≈ sin r32 + d·cos r32.
    """
    p = position.to(tl.float64)
    omega_hi = ((omega.to(tl.int64, bitcast=True) >> 32) << 32).to(tl.float64, bitcast=True)
    rest = omega - omega_hi
    omega_mid = ((rest.to(tl.int64, bitcast=True) >> 32) << 32).to(tl.float64, bitcast=True)
    reduced = _reduce_turns(
        _reduce_turns(p * omega_hi) + _reduce_turns(p * omega_mid) + p * (rest - omega_mid)
    )
    if FP64:
        return tl.sin(reduced), tl.cos(reduced)
    reduced32 = reduced.to(tl.float32)
    delta = (reduced - reduced32.to(tl.float64)).to(tl.float32)
    sin, cos = tl.sin(reduced32), tl.cos(reduced32)
    return sin + delta * cos, cos - delta * sin


@triton.jit
def position_sincos(
    out_ptr, freq_ptr, num_positions, offset, half, BLOCK_P: tl.constexpr, BLOCK_F: tl.constexpr
):
    """This program's block of a table of positions offset + row by frequencies (fp64
    ``freq_ptr`` [half]), for a table stored at ``out_ptr`` (fp64 tables get fp64 sin/cos):
    (rows, freqs, in-bounds mask, sin, cos) of position·frequency."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    freqs = tl.program_id(1).to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
    freq = tl.load(freq_ptr + freqs, mask=freqs < half, other=0.0)
    sin, cos = sincos_of_product(
        (rows + offset)[:, None], freq[None, :], out_ptr.dtype.element_ty == tl.float64
    )
    keep = (rows[:, None] < num_positions) & (freqs[None, :] < half)
    return rows, freqs, keep, sin, cos
