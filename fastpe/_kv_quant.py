"""Quantized KV caches (docs/math.md#quantized-kv-caches): validation of the caches' dtypes and
their scales, the append's quantization and the oracle's dequantization.

Two kinds, value = stored × scale:

- ``"fp8"``: ``torch.float8_e4m3fn`` caches with one float32 scale per kv head — a float, a
  tensor [Hkv] or, as FlashAttention 3's ``k_descale``, [B, Hkv] (one per sequence and kv head).
  New tokens are stored as ``clamp(x / scale, ±448)`` rounded to nearest even. NumPy has no fp8
  dtype: fp8 caches are torch tensors only.
- ``"int8"``: int8 caches (NumPy or torch) with one float32 scale per token and kv head, shaped
  like the cache without its last dim ([num_blocks, block_size, Hkv] paged, [B, S, Hkv]
  contiguous). New tokens get scale ``max|x| / 127`` over the head dim (1 for an all-zero row),
  written into the scale tensors in place, and values ``round(x / scale)`` (half to even).

The kernels read every scale through one [B, R, Hkv] view (``scale_rows``): the scale of key row
r of sequence b and kv head h is ``view[b, r, h]`` — zero strides over the dims a kind does not
vary with, so no scale is ever copied or broadcast in memory.
"""

from __future__ import annotations

import math
import sys
from typing import Any, NamedTuple

import numpy as np

from fastpe import _arrays
from fastpe._validate import check_device_data, check_on_device

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INT8_MAX = 127
_QUANTIZED = {"float8_e4m3fn": "fp8", "int8": "int8"}
_Q_DTYPES = ("float32", "bfloat16", "float16")


class KVQuant(NamedTuple):
    """The quantization of a call's caches: ``kind`` "fp8" or "int8"; fp8 scales as float32
    [B, Hkv] (a broadcast view of what was passed), int8 scales the caller's [blocks, width,
    Hkv] arrays (written in place by an append)."""

    kind: str
    k_scale: Any
    v_scale: Any

    def arrays(self) -> dict:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def _e4m3_values() -> np.ndarray:
    """float64 [256]: the value of every float8_e4m3fn bit pattern (sign, 4 exponent bits with
    bias 7, 3 mantissa bits; no infinities, S.1111.111 is NaN)."""
    bits = np.arange(256)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = mantissa / 8.0 * 2.0**-6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(bits & 0x7F) == 0x7F] = np.nan
    return values


E4M3_VALUES = _e4m3_values()


def check_cache(name: str, cache):
    """A cache of a float dtype (as before) or of a quantized one; returns it as an array."""
    from fastpe._validate import check_float_array

    x = _arrays.as_array(cache)
    dtype = _arrays.dtype_name(x)
    if dtype in _QUANTIZED and (_arrays.is_tensor(x) or dtype == "int8"):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions; got shape {tuple(x.shape)}")
        return x
    if not _arrays.is_tensor(x) and dtype == "uint8":
        raise TypeError(
            f"{name} is a uint8 NumPy array; fp8 caches are torch.float8_e4m3fn tensors (NumPy "
            "has no fp8 dtype) and NumPy quantized caches are int8 with per-token scales"
        )
    return check_float_array(name, x, ndim=4)


def kind_of(cache) -> str | None:
    return _QUANTIZED.get(_arrays.dtype_name(cache))


def check(q, k_cache, v_cache, k_scale, v_scale, *, batch: int, per_block: int, appending: bool):
    """The caches' quantization (None for float caches), validated: both caches of one kind,
    q of a dtype it is read with, scales of the kind's shape, float32 (tensors) on the caches'
    device, finite and > 0. ``per_block``: the caches' block stride in positions, which int8
    scales must share (one page table addresses both)."""
    kinds = kind_of(k_cache), kind_of(v_cache)
    if kinds[0] != kinds[1]:
        raise TypeError(
            f"k_cache and v_cache must be quantized alike; got {_arrays.dtype_name(k_cache)} "
            f"and {_arrays.dtype_name(v_cache)}"
        )
    kind = kinds[0]
    if kind is None:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None:
                raise ValueError(
                    f"{name} is for quantized caches (float8_e4m3fn or int8); k_cache is "
                    f"{_arrays.dtype_name(k_cache)}: pass {name}=None"
                )
        return None
    q_dtype = _arrays.dtype_name(q)
    if q_dtype not in _Q_DTYPES:
        raise TypeError(
            f"a {_arrays.dtype_name(k_cache)} cache is read in float32: q must be one of "
            f"{', '.join(_Q_DTYPES)}; got {q_dtype}"
        )
    hkv = k_cache.shape[2]
    scales = []
    for name, scale, cache in (("k_scale", k_scale, k_cache), ("v_scale", v_scale, v_cache)):
        if scale is None:
            raise ValueError(
                f"a {_arrays.dtype_name(cache)} cache needs {name} (value = stored × scale): "
                + (
                    f"a float or float32 [Hkv] = [{hkv}] (or [B, Hkv])"
                    if kind == "fp8"
                    else f"float32 [{', '.join(str(n) for n in cache.shape[:3])}], one per "
                    "token and kv head"
                )
            )
        if kind == "fp8":
            scales.append(_fp8_scale(name, scale, cache, batch, hkv))
        else:
            scales.append(_int8_scale(name, scale, cache, per_block, appending))
    return KVQuant(kind, *scales)


def _float32_array(name, scale, cache):
    scale = _arrays.as_array(scale)
    if _arrays.dtype_name(scale) != "float32":
        raise TypeError(f"{name} must be float32; got {_arrays.dtype_name(scale)}")
    if _arrays.is_tensor(scale) != _arrays.is_tensor(cache) or (
        _arrays.is_tensor(scale) and scale.device != cache.device
    ):
        where = cache.device if _arrays.is_tensor(cache) else "NumPy"
        raise ValueError(f"{name} must be on the caches' device ({where})")
    return scale


def _check_positive(name, scale):
    """Finite and > 0: read on the host, but asserted on the device for a GPU tensor (no host
    sync; FASTPE_CHECK_DEVICE_DATA=1 reads it back, to name the bad entry)."""
    if _arrays.on_gpu(scale) and not check_device_data():
        ok = (scale.isfinite() & (scale > 0)).all()
        check_on_device(ok, f"{name} must be finite and > 0")
        return
    if _arrays.is_tensor(scale):
        bad = ~(scale.isfinite() & (scale > 0))
        if bool(bad.any()):
            index = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name} must be finite and > 0; got {float(scale[index])} at index {index}"
            )
    else:
        bad = ~(np.isfinite(scale) & (scale > 0))
        if bad.any():
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"{name} must be finite and > 0; got {float(scale[index])} at index {index}"
            )


def _fp8_scale(name, scale, cache, batch, hkv):
    """float32 [B, Hkv] (a view with zero strides where a float or [Hkv] was passed)."""
    torch = sys.modules["torch"]
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{name} must be finite and > 0; got {scale!r}")
        scale = torch.full((hkv,), float(scale), dtype=torch.float32, device=cache.device)
    scale = _float32_array(name, scale, cache)
    if tuple(scale.shape) not in ((), (hkv,), (batch, hkv)):
        raise ValueError(
            f"{name} of a float8_e4m3fn cache must be a float, float32 [Hkv] = [{hkv}] (one per "
            f"kv head) or [B, Hkv] = [{batch}, {hkv}]; got shape {tuple(scale.shape)}"
        )
    _check_positive(name, scale)
    return scale.expand(batch, hkv)


def _int8_scale(name, scale, cache, per_block, appending):
    """The caller's float32 [blocks, width, Hkv], checked to be addressable with the caches'
    page table (and writable when appending)."""
    from fastpe.backends._serving import rows_per_block

    if isinstance(scale, (int, float)):
        raise TypeError(
            f"{name} of an int8 cache must be a float32 array shaped like the cache without "
            f"its last dim, {list(cache.shape[:3])} (one scale per token and kv head)"
        )
    scale = _float32_array(name, scale, cache)
    if tuple(scale.shape) != tuple(cache.shape[:3]):
        raise ValueError(
            f"{name} of an int8 cache must be float32 {list(cache.shape[:3])} (the cache's shape "
            f"without its last dim: one scale per token and kv head); got {list(scale.shape)}"
        )
    if rows_per_block(name, scale[..., None]) != per_block:
        raise ValueError(
            f"{name} (strides {_arrays.strides(scale)}) must place its blocks as many positions "
            f"apart as the caches ({per_block}) to be read with their page table; pass a "
            f"contiguous {name} with contiguous caches"
        )
    if appending:
        if not _arrays.is_tensor(scale) and not scale.flags.writeable:
            raise ValueError(f"appending k/v writes into {name}; got a read-only array")
        if _arrays.may_overlap(scale):
            raise ValueError(f"appending k/v writes into {name}, whose elements share memory")
    # not checked for values: slots past the cached tokens may hold anything (an empty
    # allocation), and reading only the cached ones would cost a gather (and a GPU sync) per call
    return scale


def scale_rows(quant: KVQuant, per_block: int, rows: int, host: bool):
    """(k, v) scale views [B, R, Hkv] for the kernels (``rows`` R: the caches' row views'). On
    the host (``host``) as NumPy views of the same memory, else as given."""
    views = []
    for scale in quant.arrays().values():
        if host and _arrays.is_tensor(scale):
            scale = scale.detach().numpy()
        strides = _arrays.strides(scale)
        if quant.kind == "fp8":  # [B, Hkv]: the same for every row
            batch, hkv = scale.shape
            shape, steps = (batch, rows, hkv), (strides[0], 0, strides[1])
        else:  # [blocks, width, Hkv]: row r is block r // per_block, position r % per_block
            width, hkv = scale.shape[1], scale.shape[2]
            row_stride = strides[0] if width == 1 else strides[1]
            shape, steps = (1, rows, hkv), (0, row_stride, strides[2])
        views.append(_as_strided(scale, shape, steps))
    return tuple(views)


def _as_strided(x, shape, steps):
    if _arrays.is_tensor(x):
        return x.as_strided(shape, steps)
    from numpy.lib.stride_tricks import as_strided

    return as_strided(x, shape, tuple(s * x.itemsize for s in steps), writeable=False)


# ---------------------------------------------------------------------------------------------
# The append: new rows quantized in float32 and stored with their scales


def encode_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> float8_e4m3fn bits (uint8), rounded to nearest even, saturating at ±448 (the
    caller clamps first) and NaN kept. Each magnitude is rounded to a multiple of its binade's
    step (2^(e-3) for normals, 2^-9 below 2^-6) and its bits found in the sorted table."""
    x = np.asarray(x, np.float64)  # float32 values: exact, and so is every step below
    mag = np.abs(x)
    _, exponent = np.frexp(mag)  # mag = f · 2^exponent, f in [0.5, 1)
    step = np.exp2(np.maximum(exponent, -5) - 4.0)
    rounded = np.minimum(np.rint(mag / step) * step, FP8_MAX)
    positive = E4M3_VALUES[:0x7F]  # 0 … 448, increasing
    bits = np.searchsorted(positive, np.nan_to_num(rounded)).astype(np.uint8)
    bits[np.isnan(x)] = 0x7F
    return bits | np.where(np.signbit(x), np.uint8(0x80), np.uint8(0))


def _quantize_numpy(kind, x, scale):
    """x float32 [n, H, D]; fp8: scale [n, H] -> bits; int8: -> (values, scales [n, H])."""
    x = np.asarray(x, np.float32)
    if kind == "fp8":
        return encode_e4m3(np.clip(x / scale[..., None], -FP8_MAX, FP8_MAX)), None
    amax = np.abs(x).max(axis=-1, initial=np.float32(0))
    scale = np.where(amax > 0, amax / np.float32(INT8_MAX), np.float32(1)).astype(np.float32)
    values = np.clip(np.rint(x / scale[..., None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return values, scale


def _quantize_torch(kind, x, scale):
    torch = sys.modules["torch"]
    x = x.to(torch.float32)
    if kind == "fp8":
        return (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), None
    amax = x.abs().amax(dim=-1) if x.shape[-1] else x.new_zeros(x.shape[:-1])
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    values = torch.round(x / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return values, scale


def append(inp, k_cache, v_cache, k_new, v_new) -> None:
    """Store the new rows (float, [B, Sn, Hkv, D]) quantized into the caches at the record's
    written rows, int8 scales with them. The caches are the caller's or host views of their
    memory (the Numba backend's: fp8 as its uint8 bits)."""
    quant = inp.quant
    block, offset = inp.written_rows()  # [B, Sn]
    batch, new = block.shape
    seq = np.repeat(np.arange(batch), new)
    flat = (block.reshape(-1), offset.reshape(-1))
    for cache, rows, scale in ((k_cache, k_new, quant.k_scale), (v_cache, v_new, quant.v_scale)):
        if _arrays.is_tensor(cache):
            torch = sys.modules["torch"]
            if not _arrays.is_tensor(rows):
                rows = torch.from_numpy(np.asarray(rows, np.float32))
            rows = rows.to(cache.device)  # [B, Sn, Hkv, D]
            # the plan's device copies of the written rows: no upload per call
            index = tuple(inp.plan.on_device(i, cache.device) for i in (block, offset))
            row_scale = scale[:, None] if quant.kind == "fp8" else 0  # [B, 1, Hkv]
            values, scales = _quantize_torch(quant.kind, rows, row_scale)
            if quant.kind == "fp8":  # index_put_ has no fp8 kernel on every device: as bytes
                cache.view(torch.uint8)[index] = values.view(torch.uint8)
            else:
                cache[index] = values
                scale[index] = scales
        else:
            rows = np.asarray(rows, np.float32).reshape(batch * new, *rows.shape[2:])
            if _arrays.is_tensor(scale):  # the Numba backend's host view of a CPU tensor
                scale = scale.detach().numpy()
            row_scale = np.asarray(scale)[seq] if quant.kind == "fp8" else None
            values, scales = _quantize_numpy(quant.kind, rows, row_scale)
            cache[flat] = values
            if scales is not None:
                scale[flat] = scales


# ---------------------------------------------------------------------------------------------
# The oracle's read: float64 of the dequantized rows


def dequantize(stored, scale) -> np.ndarray:
    """float64 stored × scale for stored cache rows [n, H, D] (torch fp8/int8 or NumPy int8)
    and their scales [n, H]."""
    if _arrays.is_tensor(stored):
        torch = sys.modules["torch"]
        if stored.dtype == torch.float8_e4m3fn:
            values = E4M3_VALUES[stored.detach().view(torch.uint8).cpu().numpy()]
        else:
            values = stored.detach().cpu().numpy().astype(np.float64)
    else:
        values = stored.astype(np.float64)
    return values * _arrays.to_float64(scale)[..., None]
