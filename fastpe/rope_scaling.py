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

from fastpe._validate import MAX_DIM, check_float, check_int

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")

# The keys each type accepts: those of transformers' ``_validate_<type>_rope_parameters``, plus
# ``max_position_embeddings``, which transformers reads from the model config (dynamic needs it;
# yarn and longrope derive ``factor`` from it when absent), and ``partial_rotary_factor``, which
# transformers accepts for every type.
_COMMON_KEYS = frozenset(
    {"rope_type", "type", "rope_theta", "partial_rotary_factor", "max_position_embeddings"}
)
TYPE_KEYS = {
    "default": _COMMON_KEYS,
    "linear": _COMMON_KEYS | {"factor"},
    "dynamic": _COMMON_KEYS | {"factor"},
    "yarn": _COMMON_KEYS
    | {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
    "longrope": _COMMON_KEYS
    | {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "short_factor",
        "long_factor",
    },
    "llama3": _COMMON_KEYS
    | {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
}
SCALING_KEYS = frozenset().union(*TYPE_KEYS.values())

DEFAULT_BASE = 10000.0


def _positive(name, value):
    return check_float(name, value, positive=True)


def _non_negative(name, value):
    value = check_float(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0; got {value}")
    return value


def _positive_int(name, value):
    return check_int(name, value, minimum=1)


def _truncate(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False; got {value!r} ({type(value).__name__})")
    return bool(value)


def _factor_list(name, value):
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__len__"):
        raise TypeError(
            f"{name} must be a list of rotary_dim/2 positive numbers; got {type(value).__name__}"
        )
    return [_positive(f"{name}[{i}]", v) for i, v in enumerate(value)]


# one checker per key: each raises TypeError/ValueError naming scaling['key'], the value and what
# is accepted, so no bad value reaches a log, a division or a silent NaN
_CHECKS = {
    "rope_theta": _positive,
    "factor": _positive,
    "attention_factor": _positive,
    "beta_fast": _positive,
    "beta_slow": _positive,
    "low_freq_factor": _positive,
    "high_freq_factor": _positive,
    "mscale": _non_negative,
    "mscale_all_dim": _non_negative,
    "max_position_embeddings": _positive_int,
    "original_max_position_embeddings": _positive_int,
    "truncate": _truncate,
    "short_factor": _factor_list,
    "long_factor": _factor_list,
}


def _checked(scaling: Mapping, rotary_dim: int) -> tuple[str, dict]:
    """``(rope_type, params)``: every key checked by name; a key set to None counts as absent
    (transformers reads optional keys with ``.get``)."""
    rope_type, legacy = scaling.get("rope_type"), scaling.get("type")
    if rope_type is not None and legacy is not None and rope_type != legacy:
        raise ValueError(
            f"scaling['rope_type']={rope_type!r} and scaling['type']={legacy!r} disagree; pass one"
        )
    rope_type = rope_type or legacy or "default"
    if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:
        raise ValueError(f"scaling['rope_type'] must be one of {ROPE_TYPES}; got {rope_type!r}")
    unknown = set(scaling) - TYPE_KEYS[rope_type]
    if unknown:
        raise ValueError(
            f"scaling has unknown keys {sorted(map(str, unknown))} for rope_type={rope_type!r}; "
            f"accepted keys: {sorted(TYPE_KEYS[rope_type])}"
        )
    params = {}
    for key, value in scaling.items():
        if value is None or key in ("rope_type", "type"):
            continue
        if key == "partial_rotary_factor":
            # transformers rotates int(head_dim * factor) dims; here rotary_dim is that number
            if check_float(f"scaling[{key!r}]", value) != 1.0:
                raise ValueError(
                    f"scaling['partial_rotary_factor'] must be 1.0 (or absent); got {value!r}: pass "
                    "rotary_dim = int(head_dim * partial_rotary_factor) instead"
                )
            continue
        params[key] = _CHECKS[key](f"scaling[{key!r}]", value)
    for key in ("short_factor", "long_factor"):
        if key in params and len(params[key]) != rotary_dim // 2:
            raise ValueError(
                f"scaling[{key!r}] must have rotary_dim/2 = {rotary_dim // 2} entries; "
                f"got {len(params[key])}"
            )
    if params.get("beta_fast", 32) < params.get("beta_slow", 1):
        raise ValueError(
            f"scaling['beta_fast'] must be >= scaling['beta_slow'] (defaults 32 and 1); got "
            f"beta_fast={params.get('beta_fast', 32)}, beta_slow={params.get('beta_slow', 1)}"
        )
    low, high = params.get("low_freq_factor"), params.get("high_freq_factor")
    if low is not None and high is not None and high <= low:
        raise ValueError(
            f"scaling['high_freq_factor'] must be > scaling['low_freq_factor']; got "
            f"high_freq_factor={high}, low_freq_factor={low}"
        )
    return rope_type, params


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
    return value


def _factor_or_ratio(params: Mapping, rope_type: str, original_max: float) -> float:
    """yarn/longrope: ``factor`` defaults to max_position_embeddings / original (Phi-3, DeepSeek)."""
    if params.get("factor") is not None:
        return params["factor"]
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
    beta_fast = params.get("beta_fast", 32)
    beta_slow = params.get("beta_slow", 1)

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
    exponent = np.arange(0, dim, 2, dtype=np.float64) / dim
    return 1.0 / (ext * base**exponent), float(attention_factor)


def _llama3(inv_freq, params):
    factor = _need(params, "factor", "llama3")
    low_freq_factor = _need(params, "low_freq_factor", "llama3")
    high_freq_factor = _need(params, "high_freq_factor", "llama3")
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

    Every key is checked by name against the keys its type accepts (``TYPE_KEYS``; a key set to
    None counts as absent) and every value by kind: factors, ``rope_theta``, ``attention_factor``,
    betas and frequency factors finite and > 0, ``mscale*`` finite and >= 0, lengths positive
    ints, ``truncate`` a bool, factor lists rotary_dim/2 positive numbers; NumPy scalars count as
    numbers. ``partial_rotary_factor`` must be 1.0: ``rotary_dim`` is already the rotated width.
    ``max_position_embeddings`` is accepted for every type (it is the model's context length)
    and used by dynamic, and by yarn/longrope/llama3 where their own keys are absent.
    """
    rotary_dim = check_int("rotary_dim", rotary_dim, minimum=2, maximum=MAX_DIM)
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even (pairs of elements rotate); got {rotary_dim}")
    base = check_float("base", base, positive=True)
    if seq_len is not None:
        seq_len = check_int("seq_len", seq_len, minimum=0)
    if scaling is not None and not isinstance(scaling, Mapping):
        raise TypeError(f"scaling must be None or a dict of rope parameters; got {type(scaling)}")
    rope_type, params = _checked(scaling or {}, rotary_dim)
    if "rope_theta" in params:
        theta = params["rope_theta"]
        if base not in (DEFAULT_BASE, theta):
            raise ValueError(f"base={base} conflicts with scaling['rope_theta']={theta}; pass one")
        base = theta

    dim = rotary_dim
    exponent = np.arange(0, dim, 2, dtype=np.float64) / dim
    inv_freq = 1.0 / base**exponent

    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / _need(params, "factor", rope_type), 1.0
    if rope_type == "dynamic":
        factor = _need(params, "factor", rope_type)
        mpe = _need(params, "max_position_embeddings", rope_type)
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
