"""Argument checks shared by every op. Each error names the argument, what was given and what
is accepted. (Never ``assert``: it vanishes under ``python -O``.)"""

from __future__ import annotations

import math
import numbers
import os
import sys

import numpy as np

from fastpe import _arrays


def is_int_scalar(value) -> bool:
    """An integer given as one number: a Python or NumPy int, or a 0-dim integer array or tensor
    (FlashAttention's own tests pass ``window_size=(torch.tensor(3), torch.tensor(-1))``).
    Bools are not integers here."""
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, numbers.Integral):
        return True
    if (_arrays.is_tensor(value) or isinstance(value, np.ndarray)) and value.ndim == 0:
        return _arrays.is_int_dtype(_arrays.dtype_name(value))
    return False


def check_int(name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int (see ``is_int_scalar``) in [minimum, maximum]. Python ints are
    unbounded, so every comparison here is exact: no value can overflow into another."""
    if not is_int_scalar(value):
        raise TypeError(f"{name} must be an integer; got {value!r} ({type(value).__name__})")
    value = int(value.item() if hasattr(value, "ndim") else value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}; got {value}")
    return value


# The widest feature dimension (``dim``, ``rotary_dim``) accepted: far beyond any model, and
# small enough that no size computed from it overflows the kernels' integer arithmetic.
MAX_DIM = 2**31 - 1


def check_float(name: str, value, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number; got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite{' and > 0' if positive else ''}; got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0; got {value}")
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False; got {value!r}")
    return bool(value)


def check_choice(name: str, value, choices) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_float_array(name: str, x, *, ndim: int | None = None):
    """A float array or tensor (NumPy: float32/float64; torch: also float16/bfloat16)."""
    x = _arrays.as_array(x)
    dtype = _arrays.dtype_name(x)
    allowed = _arrays.FLOAT_DTYPES if _arrays.is_tensor(x) else _arrays.NUMPY_FLOAT_DTYPES
    if dtype not in allowed:
        hint = "" if _arrays.is_tensor(x) else " (float16/bfloat16 are accepted as torch tensors)"
        raise TypeError(f"{name} must have a float dtype in {allowed}{hint}; got {dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions; got shape {tuple(x.shape)}")
    return x


_INT64_MAX = 2**63 - 1


def check_int_array(name: str, x, *, ndim: int | tuple[int, ...] | None = None):
    """An integer array or tensor whose values all fit int64 (every later check and kernel reads
    them as int64: a uint64 value >= 2**63 would wrap to a negative number)."""
    x = _arrays.as_array(x)
    dtype = _arrays.dtype_name(x)
    if not _arrays.is_int_dtype(dtype):
        raise TypeError(f"{name} must have an integer dtype; got {dtype}")
    if _arrays.is_tensor(x) and dtype in ("uint16", "uint32", "uint64"):
        # torch has no reductions for these dtypes, so their values cannot be checked
        raise TypeError(
            f"{name} must be an int8/int16/int32/int64 or uint8 tensor; got {dtype} "
            "(NumPy arrays of any integer dtype are accepted)"
        )
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if dims is not None and x.ndim not in dims:
        want = " or ".join(map(str, dims))
        raise ValueError(f"{name} must have {want} dimensions; got shape {tuple(x.shape)}")
    if dtype == "uint64" and x.size and int(x.max()) > _INT64_MAX:
        where = tuple(int(i) for i in np.argwhere(x > _INT64_MAX)[0])
        raise ValueError(
            f"{name} contains {int(x[where])} at index {list(where)}; integer entries must be "
            f"<= 2**63 - 1 = {_INT64_MAX}"
        )
    return x


def check_range(name: str, x, low: int, high: int, *, what: str = "") -> None:
    """Every entry of integer array ``x`` lies in [low, high); else IndexError naming the value.
    A GPU tensor is checked on its device (``check_on_device``), without a host sync."""
    if _skip_device_values(x):
        check_on_device(
            ((x >= low) & (x < high)).all(),
            f"{name} has an entry outside [{low}, {high})" + (f" {what}" if what else ""),
        )
        return
    bounds = _arrays.min_max(x)  # the common case costs one reduction, not a host int64 copy
    if bounds is None or (bounds[0] >= low and bounds[1] < high):
        return
    values = _arrays.to_int64(x)
    bad = (values < low) | (values >= high)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        value = int(values[where])
    raise IndexError(
        f"{name} contains {value} at index {list(where)}, outside [{low}, {high})"
        + (f" {what}" if what else "")
    )


def check_device_data() -> bool:
    """Whether value checks that only guard the result, not memory (finite ALiBi slopes and T5
    tables, positions below 2^32), also read GPU tensors: each costs a host sync per call, so on
    CUDA they run only with ``FASTPE_CHECK_DEVICE_DATA=1`` (docs/dtypes-and-errors.md)."""
    return os.environ.get("FASTPE_CHECK_DEVICE_DATA", "0") not in ("", "0")


def _skip_device_values(x) -> bool:
    return _arrays.on_gpu(x) and not check_device_data()


def check_on_device(ok, message: str) -> None:
    """``ok`` (a bool tensor of one element, on the GPU) asserted where it lives: the host does
    not wait for it. A failure is a device-side assert raised, with ``message`` in the error,
    at a later synchronizing call, and it stops every later kernel of the process, so that no
    kernel reads out of bounds (docs/dtypes-and-errors.md#errors)."""
    sys.modules["torch"]._assert_async(ok, message)


def check_finite(name: str, x) -> None:
    if _skip_device_values(x):
        return
    if _arrays.is_tensor(x):
        finite = bool(sys.modules["torch"].isfinite(x).all())  # reduced in place: no copy
    else:
        finite = bool(np.isfinite(np.asarray(x, dtype=np.float64)).all())
    if not finite:
        raise ValueError(f"{name} must be finite (no NaN or inf)")


def check_same_placement(named_arrays: dict) -> _arrays.Placement:
    """All arrays in one framework on one device; returns that placement."""
    placements = {
        name: _arrays.placement_of(x) for name, x in named_arrays.items() if x is not None
    }
    distinct = set(placements.values())
    if len(distinct) > 1:
        listing = ", ".join(f"{name}: {p}" for name, p in placements.items())
        raise TypeError(
            f"all arrays must be NumPy arrays or all torch tensors on one device; got {listing}"
        )
    return distinct.pop()


# Positions (offsets, position ids) are supported in [0, MAX_POSITION). Within it every backend
# gives sin/cos of p·ω within 2.5e-7 in float32 (measured <= 1.2e-7) and 1e-14 in float64; the
# bound is set by the Triton kernels, whose fp64 reduction is exact only for p < 2^32 (the NumPy
# oracle and the Numba kernels reduce exactly at any int64 position). Larger integers used to
# wrap (int64) or overflow in the kernels.
MAX_POSITION = 2**32


def check_position(name: str, value, *, count: int = 1) -> None:
    """``value`` (an int, or an int array/tensor of positions) lies in [0, MAX_POSITION); for an
    int offset, ``count`` positions value … value + count - 1 must. Else ValueError naming
    ``name``, the offending value and the supported range."""
    supported = f"the supported range [0, 2**32 = {MAX_POSITION})"
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        first, last = int(value), int(value) + max(int(count), 1) - 1
        if first < 0 or last >= MAX_POSITION:
            shown = (
                first
                if first < 0 or count <= 1
                else f"{first} with {count} positions reaches {last}"
            )
            raise ValueError(f"{name} = {shown}, outside {supported}")
        return
    x = _arrays.as_array(value)
    if not _arrays.is_int_dtype(_arrays.dtype_name(x)):
        raise TypeError(f"{name} must be an int or an integer array; got {_arrays.dtype_name(x)}")
    if _skip_device_values(x):  # out-of-range rows are caught by check_range; this is accuracy
        return
    bounds = _arrays.min_max(x)  # reduced where the data lives: no host copy
    if bounds is None or (bounds[0] >= 0 and bounds[1] < MAX_POSITION):
        return
    values = x.detach().cpu().numpy() if _arrays.is_tensor(x) else np.asarray(x)
    where = tuple(int(i) for i in np.argwhere((values < 0) | (values >= MAX_POSITION))[0])
    raise ValueError(
        f"{name} contains {int(values[where])} at index {list(where)}, outside {supported}"
    )
