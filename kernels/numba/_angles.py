"""Basis tables for accurate sin/cos of p·ω at many positions (plain NumPy, not jitted).

The usual float32 recipe rounds p·ω to float32 before sin/cos: at p ~ 2^20 the argument is off
by ~0.06 rad, and even float64 loses p·2^-53 rad (1e-4 at p = 2^40). Here the few angles that
are evaluated directly go through an exact reduction modulo one turn (``sincos_of_integers``),
and every other position p = B + l is reached by angle addition from a block start B:

    sin(pω) = sin(Bω)·cos(lω) + cos(Bω)·sin(lω)
    cos(pω) = cos(Bω)·cos(lω) - sin(Bω)·sin(lω)

The bases are laid out in the *output's column order*, so that every column j of a PE row is

    PE[p, j] = hi_a[t, j]·lo_x[l, j] + hi_b[t, j]·lo_y[l, j]

— a sin column takes (a, b) = (sin Bω, cos Bω), a cos column (cos Bω, -sin Bω), and both take
(x, y) = (cos lω, sin lω) — one contiguous, branch-free loop that vectorises for either layout,
instead of two libm calls per pair. Errors are then ~1e-16 (float64 bases) at every position
below 2^64, however far.
"""

from __future__ import annotations

import functools
import hashlib
import math
import threading
from collections import OrderedDict

import numpy as np

_U32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


def _pi_scaled(bits: int) -> int:
    """floor(π·2^bits) in integers (Machin: π = 16·atan(1/5) - 4·atan(1/239)), so no
    float64 constant limits the reduction."""

    def atan_inv(x: int, scale: int) -> int:
        total, term, k, sign = 0, scale // x, 1, 1
        while term:
            total += sign * (term // k)
            term //= x * x
            k += 2
            sign = -sign
        return total

    guard = 32
    scale = 1 << (bits + guard)
    return (16 * atan_inv(5, scale) - 4 * atan_inv(239, scale)) >> guard


_FRAC_BITS = 128  # ω/2π is kept to 2^-128 turn: n·ω for n < 2^64 is then exact to < 2^-64 turn
_GUARD_BITS = 192
_TWO_PI_SCALED = 2 * _pi_scaled(_GUARD_BITS)


@functools.lru_cache(maxsize=64)
def _turn_limbs(omega_bytes: bytes) -> np.ndarray:
    """[4, F] uint64: the fraction of ω/2π as four 32-bit limbs (most significant first).
    The integer part of ω/2π is dropped: an integer multiple of it is a whole number of turns."""
    omega = np.frombuffer(omega_bytes, dtype=np.float64)
    limbs = np.zeros((4, omega.shape[0]), dtype=np.uint64)
    for i, w in enumerate(omega.tolist()):
        num, den = abs(w).as_integer_ratio()  # exact: den is a power of two
        frac = ((num << (_FRAC_BITS + _GUARD_BITS)) // (den * _TWO_PI_SCALED)) % (1 << _FRAC_BITS)
        if w < 0:
            frac = (-frac) % (1 << _FRAC_BITS)
        for k in range(4):
            limbs[k, i] = (frac >> (32 * (3 - k))) & 0xFFFFFFFF
    return limbs


def sincos_of_integers(n, omega: np.ndarray):
    """sin and cos of n·ω, [K, F] float64, for integers 0 <= n < 2^64 ([K]) and float64 ω [F]
    taken as exact: n·ω/2π is formed modulo 1 in 64-bit fixed point (wrap-around uint64
    arithmetic on 32-bit limbs), so the error is ~1 ulp whatever n is."""
    f1, f2, f3, f4 = _turn_limbs(np.ascontiguousarray(omega, dtype=np.float64).tobytes())
    n = np.asarray(n).astype(np.uint64)[:, None]
    n0, n1 = n & _U32, n >> _S32
    # turns·2^64 mod 2^64, one term per limb product of weight >= 2^-32 (n1·f1 is a whole turn)
    turns = (
        ((n0 * f1) << _S32)
        + n0 * f2
        + ((n0 * f3) >> _S32)
        + ((n1 * f2) << _S32)
        + n1 * f3
        + ((n1 * f4) >> _S32)
    )
    angle = turns.view(np.int64).astype(np.float64) * (2 * math.pi / 2.0**64)  # in [-π, π)
    return np.sin(angle), np.cos(angle)


def sincos_progression(start: int, step: int, count: int, omega: np.ndarray):
    """sin and cos of (start + k·step)·ω for k < count, each [count, F] in float64.

    Evaluated directly only for short progressions; longer ones are split k = u·K + c and
    combined by angle addition from two progressions of ~sqrt(count) rows, recursively, so
    about 4·count^(1/4) rows of exact evaluations serve any count. Each combination adds ~1e-16.
    """
    if count <= 16:
        n = np.uint64(start) + np.uint64(step) * np.arange(count, dtype=np.uint64)
        return sincos_of_integers(n, omega)
    inner = math.isqrt(count - 1) + 1
    outer = -(-count // inner)
    sin_in, cos_in = sincos_progression(0, step, inner, omega)
    sin_out, cos_out = sincos_progression(start, step * inner, outer, omega)
    sin = sin_out[:, None] * cos_in[None] + cos_out[:, None] * sin_in[None]
    cos = cos_out[:, None] * cos_in[None] - sin_out[:, None] * sin_in[None]
    width = omega.shape[0]
    return sin.reshape(-1, width)[:count], cos.reshape(-1, width)[:count]


def _columns(sin_part, cos_part, interleaved: bool, dtype):
    """Place per-frequency values at the sin and cos columns of the chosen layout."""
    if interleaved:
        both = np.stack([sin_part, cos_part], axis=-1).reshape(sin_part.shape[0], -1)
    else:
        both = np.concatenate([sin_part, cos_part], axis=-1)
    return np.ascontiguousarray(both, dtype=dtype)


class _BasisCache:
    """LRU of read-only basis tuples, bounded by the bytes it holds (not by entry count, which
    let a few huge position ranges pin a gigabyte). Thread-safe; ``info()`` is its accounting."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def _size(value) -> int:
        return sum(x.nbytes for x in value if isinstance(x, np.ndarray))

    def get(self, key):
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key, value):
        size = self._size(value)
        for x in value:
            if isinstance(x, np.ndarray):
                x.flags.writeable = False  # shared by every call that hits the cache
        if size > self.max_bytes:
            return value
        with self._lock:
            if key not in self._entries:
                self._entries[key] = value
                self._nbytes += size
            while self._nbytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._nbytes -= self._size(old)
        return value

    def info(self) -> dict:
        with self._lock:
            return {
                "entries": len(self._entries),
                "nbytes": self._nbytes,
                "max_bytes": self.max_bytes,
            }

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._nbytes = 0


BASIS_CACHE = _BasisCache(max_bytes=32 << 20)


def column_basis(p0: int, count: int, omega: np.ndarray, interleaved: bool, dtype=np.float64):
    """(L, hi_a, hi_b [T, D], lo_x, lo_y [L, D]) for positions p0 … p0+count-1, D = 2·len(ω);
    row p0 + t·L + l is served by hi row t and lo row l. L ~ sqrt(count) keeps the bases small.

    Cached (read-only arrays, ``BASIS_CACHE``): a model calls with the same positions range on
    every forward pass, and building the bases costs as much as a table of a few MB.

    ``dtype`` float32 serves float32 outputs: each basis value is the float64 value rounded
    once, so a PE entry is off by at most ~2.5e-7 at any position, and the kernel reads half the
    bytes at twice the SIMD width.
    """
    omega = np.ascontiguousarray(omega, dtype=np.float64)
    dtype = np.dtype(dtype).name
    key = ("range", int(p0), int(count), omega.tobytes(), bool(interleaved), dtype)
    cached = BASIS_CACHE.get(key)
    if cached is not None:
        return cached
    count = max(int(count), 1)
    block = max(16, math.isqrt(count - 1) + 1)
    n_hi = -(-count // block)
    sin_lo, cos_lo = sincos_progression(0, 1, block, omega)
    sin_hi, cos_hi = sincos_progression(int(p0), block, n_hi, omega)
    basis = (
        block,
        _columns(sin_hi, cos_hi, interleaved, dtype),
        _columns(cos_hi, -sin_hi, interleaved, dtype),
        _columns(cos_lo, cos_lo, interleaved, dtype),
        _columns(sin_lo, sin_lo, interleaved, dtype),
    )
    return BASIS_CACHE.put(key, basis)


def gather_basis(positions: np.ndarray, omega: np.ndarray, interleaved: bool, dtype=np.float64):
    """(L, p0, row [N], hi_a, hi_b [U, D], lo_x, lo_y [L, D]) for arbitrary positions [N]:
    position p is served by hi row ``row[i]`` (block start p0 + k·L) and lo row (p - p0) % L.

    Only the blocks that hold a position get a hi row, and L <= ~sqrt(N), so the cost follows
    the number of positions, not their span: [0, 2^40] costs two hi rows and a few lo rows.
    Cached like ``column_basis``, keyed by a digest of the positions (a model passes the same
    position ids on every forward pass).
    """
    omega = np.ascontiguousarray(omega, dtype=np.float64)
    positions = np.ascontiguousarray(positions, dtype=np.int64).reshape(-1)
    dtype = np.dtype(dtype).name
    digest = hashlib.blake2b(positions.data, digest_size=32).digest()
    key = ("gather", digest, positions.size, omega.tobytes(), bool(interleaved), dtype)
    cached = BASIS_CACHE.get(key)
    if cached is not None:
        return cached
    p0 = int(positions.min())
    span = int(positions.max()) - p0 + 1
    # sqrt(span) minimises hi + lo rows for contiguous positions; sqrt(N) caps the lo table
    block = max(16, min(math.isqrt(span - 1) + 1, math.isqrt(positions.size) + 1))
    offsets = (positions - p0).astype(np.uint64)
    blocks, row = np.unique(offsets // np.uint64(block), return_inverse=True)
    starts = np.uint64(p0) + blocks * np.uint64(block)
    sin_hi, cos_hi = sincos_of_integers(starts, omega)
    sin_lo, cos_lo = sincos_progression(0, 1, block, omega)
    basis = (
        block,
        p0,
        row.reshape(-1).astype(np.int64),
        _columns(sin_hi, cos_hi, interleaved, dtype),
        _columns(cos_hi, -sin_hi, interleaved, dtype),
        _columns(cos_lo, cos_lo, interleaved, dtype),
        _columns(sin_lo, sin_lo, interleaved, dtype),
    )
    return BASIS_CACHE.put(key, basis)
