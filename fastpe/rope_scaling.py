"""RoPE inverse frequencies with the Hugging Face scaling variants, in float64.

The formulas follow transformers' ``modeling_rope_utils.py`` (``ROPE_INIT_FUNCTIONS``):
linear, dynamic (NTK), yarn, longrope and llama3, each returning ``(inv_freq, attention_factor)``.
transformers evaluates them in float32; fastpe evaluates them in float64 so that the float32
tables built from them are limited only by the final rounding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from fastpe._validate import check_float, check_int

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")

# Keys a transformers ``rope_parameters`` / ``rope_scaling`` dict may hold, plus
# ``max_position_embeddings``, which transformers reads from the model config.
SCALING_KEYS = frozenset(
    {
        "rope_type",
        "type",
        "rope_theta",
        "partial_rotary_factor",
        "factor",
        "max_position_embeddings",
        "original_max_position_embeddings",
        "low_freq_factor",
        "high_freq_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
        "short_factor",
        "long_factor",
    }
)

DEFAULT_BASE = 10000.0


def _need(params: Mapping, key: str, rope_type: str):
    if params.get(key) is None:
        raise ValueError(f"scaling[{key!r}] is required for rope_type={rope_type!r}")
    return params[key]


def _original_max(params: Mapping, rope_type: str) -> float:
    # transformers fills original_max_position_embeddings from max_position_embeddings when absent.
    value = params.get("original_max_position_embeddings") or params.get("max_position_embeddings")
    if value is None:
        raise ValueError(
            f"scaling needs 'original_max_position_embeddings' (or 'max_position_embeddings') "
            f"for rope_type={rope_type!r}"
        )
    return check_int("scaling['original_max_position_embeddings']", value, minimum=1)


def _factor_or_ratio(params: Mapping, rope_type: str, original_max: float) -> float:
    """yarn/longrope: ``factor`` defaults to max_position_embeddings / original (Phi-3, DeepSeek)."""
    if params.get("factor") is not None:
        return check_float("scaling['factor']", params["factor"], positive=True)
    mpe = params.get("max_position_embeddings")
    if mpe is None:
        raise ValueError(
            f"scaling needs 'factor' (or 'max_position_embeddings') for rope_type={rope_type!r}"
        )
    return mpe / original_max


def _yarn(inv_freq, dim, base, params):
    original_max = _original_max(params, "yarn")
    factor = _factor_or_ratio(params, "yarn", original_max)

    def mscale_of(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = mscale_of(factor, mscale) / mscale_of(factor, mscale_all_dim)
        else:
            attention_factor = mscale_of(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations):
        # the dimension whose wavelength fits num_rotations times into the original context
        return dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp  # 1 keeps the original frequency, 0 interpolates by `factor`
    inv_freq = (inv_freq / factor) * (1.0 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(attention_factor)


def _longrope(dim, base, params, seq_len):
    original_max = _original_max(params, "longrope")
    factor = _factor_or_ratio(params, "longrope", original_max)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
        )
    key = "long_factor" if seq_len and seq_len > original_max else "short_factor"
    ext = np.asarray(_need(params, key, "longrope"), dtype=np.float64)
    if ext.shape != (dim // 2,):
        raise ValueError(
            f"scaling[{key!r}] must have rotary_dim/2 = {dim // 2} entries; got shape {ext.shape}"
        )
    exponent = np.arange(0, dim, 2, dtype=np.float64) / dim
    return 1.0 / (ext * base**exponent), float(attention_factor)


def _llama3(inv_freq, params):
    factor = check_float("scaling['factor']", _need(params, "factor", "llama3"), positive=True)
    low_freq_factor = float(_need(params, "low_freq_factor", "llama3"))
    high_freq_factor = float(_need(params, "high_freq_factor", "llama3"))
    if high_freq_factor == low_freq_factor:
        raise ValueError("scaling['high_freq_factor'] must differ from scaling['low_freq_factor']")
    old_context = _original_max(params, "llama3")
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the band between interpolated
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled), 1.0


def rope_inv_freq(rotary_dim, *, base=DEFAULT_BASE, scaling=None, seq_len=None):
    """RoPE inverse frequencies and attention factor.

    Returns ``(inv_freq, attention_factor)``: ``inv_freq`` is a float64 NumPy array of shape
    [rotary_dim/2] with ``inv_freq[i] = base ** (-2i / rotary_dim)``, rescaled by ``scaling``.

    ``scaling`` is a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict (``rope_type`` in
    default, linear, dynamic, yarn, longrope, llama3) with transformers' keys, plus
    ``max_position_embeddings`` from the model config where the type needs it. A ``rope_theta``
    in the dict is used as the base when ``base`` is left at its default (and must agree with it
    otherwise). ``seq_len`` selects the dynamic-NTK base and the longrope factor set exactly as
    transformers does. The formulas are those of transformers' ``ROPE_INIT_FUNCTIONS``, in float64.
    """
    rotary_dim = check_int("rotary_dim", rotary_dim, minimum=2)
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even (pairs of elements rotate); got {rotary_dim}")
    base = check_float("base", base, positive=True)
    if seq_len is not None:
        seq_len = check_int("seq_len", seq_len, minimum=0)
    params: Mapping = {} if scaling is None else scaling
    if not isinstance(params, Mapping):
        raise TypeError(f"scaling must be None or a dict of rope parameters; got {type(scaling)}")
    unknown = set(params) - SCALING_KEYS
    if unknown:
        raise ValueError(
            f"scaling has unknown keys {sorted(unknown)}; accepted keys: {sorted(SCALING_KEYS)}"
        )
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"scaling['rope_type'] must be one of {ROPE_TYPES}; got {rope_type!r}")
    if params.get("rope_theta") is not None:
        theta = check_float("scaling['rope_theta']", params["rope_theta"], positive=True)
        if base not in (DEFAULT_BASE, theta):
            raise ValueError(f"base={base} conflicts with scaling['rope_theta']={theta}; pass one")
        base = theta

    dim = rotary_dim
    exponent = np.arange(0, dim, 2, dtype=np.float64) / dim
    inv_freq = 1.0 / base**exponent

    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        factor = check_float("scaling['factor']", _need(params, "factor", rope_type), positive=True)
        return inv_freq / factor, 1.0
    if rope_type == "dynamic":
        factor = check_float("scaling['factor']", _need(params, "factor", rope_type), positive=True)
        mpe = check_int(
            "scaling['max_position_embeddings']",
            _need(params, "max_position_embeddings", rope_type),
            minimum=1,
        )
        if dim <= 2:
            raise ValueError("rope_type='dynamic' needs rotary_dim > 2")
        length = mpe if seq_len is None else max(seq_len, mpe)
        dynamic_base = base * ((factor * length / mpe) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / dynamic_base**exponent, 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, dim, base, params)
    if rope_type == "longrope":
        return _longrope(dim, base, params, seq_len)
    return _llama3(inv_freq, params)
