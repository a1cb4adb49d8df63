"""Framework-neutral handling of the arrays users pass in: NumPy arrays and torch tensors.

torch is never imported here unless the caller already holds a tensor or asked for a torch
device: ``import fastpe`` must stay light, so a tensor is recognised through ``sys.modules``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
# NumPy has no bfloat16 and Numba neither half type: the low-precision types come in as torch tensors.
NUMPY_FLOAT_DTYPES = ("float32", "float64")


_tensor_class = None  # torch.Tensor once torch has been imported by someone


def is_tensor(x) -> bool:
    # called dozens of times per op: the class is looked up once, after torch has been imported
    global _tensor_class
    if _tensor_class is None:
        _tensor_class = getattr(sys.modules.get("torch"), "Tensor", None)
        if _tensor_class is None:
            return False
    return isinstance(x, _tensor_class)


@dataclass(frozen=True)
class Placement:
    """Where an op's arrays live and therefore where its result goes."""

    framework: str  # "numpy" | "torch"
    device: str = "cpu"  # torch device string ("cpu", "cuda:0"); always "cpu" for NumPy

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    def __str__(self) -> str:
        return "NumPy array" if self.framework == "numpy" else f"torch tensor on {self.device}"


NUMPY = Placement("numpy")


# torch.device / torch.dtype -> what fastpe calls them; a handful of entries per process, and
# building them (str() of a device or dtype) was a visible part of a one-token call's overhead
_placements: dict = {}
_dtype_names: dict = {}
_numpy_dtype_names: dict = {}  # np.dtype -> its name (np.dtype.name is computed on each access)


def placement_of(x) -> Placement:
    if is_tensor(x):
        device = x.device
        placement = _placements.get(device)
        if placement is None:
            placement = _placements[device] = Placement("torch", str(device))
        return placement
    return NUMPY


def dtype_name(x) -> str:
    """'float32', 'bfloat16', 'int64', 'bool', ... for an array or tensor."""
    if is_tensor(x):
        dtype = x.dtype
        name = _dtype_names.get(dtype)
        if name is None:
            name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
        return name
    if isinstance(x, np.ndarray):
        dtype = x.dtype
        name = _numpy_dtype_names.get(dtype)
        if name is None:
            name = _numpy_dtype_names[dtype] = dtype.name
        return name
    return np.asarray(x).dtype.name


def is_float_dtype(name: str) -> bool:
    return name in FLOAT_DTYPES


def is_int_dtype(name: str) -> bool:
    return name.startswith(("int", "uint"))


def on_gpu(x) -> bool:
    return is_tensor(x) and x.device.type != "cpu"


def max_value(x) -> float | None:
    """The largest element as a Python float (NaN if any element is NaN), None if empty.
    A reduction: no copy of ``x``."""
    if x.numel() == 0 if is_tensor(x) else x.size == 0:
        return None
    return float(x.max())


def strides(x) -> tuple[int, ...]:
    """Strides in elements (NumPy's are in bytes)."""
    if is_tensor(x):
        return tuple(x.stride())
    return tuple(s // x.itemsize for s in x.strides)


def may_overlap(x) -> bool:
    """True unless the elements of ``x`` provably occupy distinct memory (so writing one cannot
    change another): with the dims of size > 1 sorted by |stride|, each stride must exceed the
    span of the dims before it. Conservative, like torch's internal-overlap check."""
    dims = sorted((abs(st), n) for st, n in zip(strides(x), x.shape, strict=True) if n > 1)
    span = 0  # elements covered by the dims so far, minus one
    for stride, size in dims:
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def byte_bounds(x):
    """(memory space, first byte, one past the last byte) of the elements of an array or tensor,
    from its address and strides (nothing is read); None when it has no element or no memory
    (a Python int or list, which becomes a fresh array). Host arrays and CPU tensors share one
    space. Pure Python: called for a few arguments of every decode step."""
    if is_tensor(x):
        if x.numel() == 0:
            return None
        item, start = x.element_size(), x.data_ptr()
        space = "cpu" if x.device.type == "cpu" else str(x.device)
        if x.is_contiguous():  # the common case, without the loop below
            return (space, start, start + x.numel() * item)
        steps = [stride * item for stride in x.stride()]
    else:
        if not isinstance(x, np.ndarray) or x.size == 0:
            return None
        item, start, space = x.itemsize, x.__array_interface__["data"][0], "cpu"
        if x.flags.c_contiguous:
            return (space, start, start + x.nbytes)
        steps = x.strides
    low = high = start
    for size, step in zip(x.shape, steps, strict=True):
        if step < 0:
            low += step * (size - 1)
        else:
            high += step * (size - 1)
    return (space, low, high + item)


def bounds_overlap(a, b) -> bool:
    """Whether two ``byte_bounds`` intersect: writing one array could change the other (or, for
    interleaved views that share no element, could not: the cheap, conservative test)."""
    return a is not None and b is not None and a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


class _AddressRange:
    """The elements' addresses of a tensor as a NumPy array interface: NumPy's overlap test
    computes with addresses and strides only and never reads the memory, so this describes GPU
    memory too."""

    def __init__(self, x):
        itemsize = x.element_size()
        self.__array_interface__ = {
            "version": 3,
            "shape": tuple(x.shape),
            "typestr": f"|V{itemsize}",
            "data": (x.data_ptr(), False),
            "strides": tuple(s * itemsize for s in x.stride()),
        }


def shares_element(a, b) -> bool:
    """Whether ``a`` and ``b`` (NumPy arrays or tensors, any dtypes) have some element in common,
    exactly: halves of one buffer interleaved in memory share none. A problem too hard to decide
    counts as shared."""
    if not bounds_overlap(byte_bounds(a), byte_bounds(b)):
        return False
    va, vb = (np.asarray(_AddressRange(x) if is_tensor(x) else x) for x in (a, b))
    try:
        return bool(np.shares_memory(va, vb, max_work=100_000))
    except getattr(np, "exceptions", np).TooHardError:  # np.exceptions from NumPy 1.25
        return True


def private_copy(x):
    """A copy of ``x`` in its framework, dtype and device that shares no memory with anything."""
    if is_tensor(x):
        return x.detach().clone()
    return np.array(x, copy=True)


def min_max(x) -> tuple[int, int] | None:
    """(smallest, largest) element of an integer array as Python ints, None if empty. Reduced
    where the data lives (one pass for a tensor): no host copy, no NumPy round trip."""
    if is_tensor(x):
        count = x.numel()
        if count == 0:
            return None
        if count <= _FEW and x.device.type == "cpu":  # a decode step's positions or lengths
            values = x.tolist()  # one conversion instead of a torch reduction
            if x.dim() == 2:
                values = [v for row in values for v in row]
            elif x.dim() != 1:
                values = x.reshape(-1).tolist()
            return int(min(values)), int(max(values))
        low, high = sys.modules["torch"].aminmax(x)
        return int(low), int(high)
    if x.size == 0:
        return None
    if x.size <= _FEW:
        values = x.reshape(-1).tolist()
        return int(min(values)), int(max(values))
    return int(x.min()), int(x.max())


# arrays up to this many elements are reduced in Python: a torch or NumPy reduction costs
# microseconds of dispatch, a visible part of a one-token call
_FEW = 64


def as_array(x):
    """A tensor stays a tensor; anything else becomes a NumPy array (lists, scalars, ...)."""
    return x if is_tensor(x) else np.asarray(x)


def array_like(values, like):
    """A Python sequence as an array of the framework and device of ``like``."""
    if is_tensor(like):
        return sys.modules["torch"].as_tensor(values, device=like.device)
    return np.asarray(values)


def to_float64(x) -> np.ndarray:
    """Host float64 copy (or view when already float64 NumPy) for the oracle. Never written to."""
    if is_tensor(x):
        return x.detach().to(device="cpu", dtype=sys.modules["torch"].float64).numpy()
    return np.asarray(x, dtype=np.float64)


def to_int64(x) -> np.ndarray:
    if is_tensor(x):
        if x.device.type == "cpu":
            # a view when already int64 (integer tensors never require grad); a NumPy cast
            # otherwise, which costs a small array far less than torch's
            return np.asarray(x.numpy(), dtype=np.int64)
        return x.detach().to(device="cpu", dtype=sys.modules["torch"].int64).numpy()
    return np.asarray(x, dtype=np.int64)


def to_bool(x) -> np.ndarray:
    """Host bool array; a bool input (a broadcast view included) is never copied."""
    if is_tensor(x):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=bool)


def from_float64(result: np.ndarray, placement: Placement, dtype: str):
    """Cast the oracle's float64 result once, into the caller's framework, device and dtype."""
    if placement.framework == "numpy":
        return np.ascontiguousarray(result, dtype=dtype)
    torch = sys.modules["torch"]
    tensor = torch.from_numpy(np.ascontiguousarray(result))
    return tensor.to(device=placement.device, dtype=getattr(torch, dtype))


def resolve_device(device) -> Placement:
    """``device=None`` means NumPy output; anything else is a torch device ("cpu", "cuda:1", ...)."""
    if device is None:
        return NUMPY
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ValueError(
            f"device={device!r} asks for a torch tensor but torch is not installed; "
            "pass device=None for a NumPy array or `pip install torch`"
        ) from exc
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device must be None (NumPy) or a torch device such as 'cpu' or 'cuda:0'; got {device!r}"
        ) from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={device!r} asks for a CUDA tensor but torch sees no CUDA GPU here; "
                "pass device='cpu' or device=None (NumPy)"
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return Placement("torch", str(dev))


def normalize_dtype(dtype, placement: Placement) -> str:
    """Accept 'float32', np.float32, torch.float32, ...; return the canonical name."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
    elif type(dtype).__module__.startswith("torch"):
        name = str(dtype).removeprefix("torch.")
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = repr(dtype)
    allowed = NUMPY_FLOAT_DTYPES if placement.framework == "numpy" else FLOAT_DTYPES
    if name not in allowed:
        hint = "" if placement.framework == "torch" else " (float16/bfloat16 need a torch device=)"
        raise TypeError(f"dtype must be one of {', '.join(allowed)}{hint}; got {dtype!r}")
    return name


def broadcast_to(x, shape):
    """A read-only stride-0 view of ``x`` with ``shape`` (NumPy or torch); never a copy."""
    if is_tensor(x):
        return x.expand(shape)
    return np.broadcast_to(x, shape)


# ---------------------------------------------------------------------------------------------
# Host <-> kernel conversions for the CPU kernels (NumPy in, NumPy out). Half types: NumPy has no
# bfloat16 and Numba neither half type, so they arrive as torch tensors.


def compute_dtype(dtype: str):
    """The NumPy dtype a CPU kernel computes in for an op of ``dtype``."""
    return np.float64 if dtype == "float64" else np.float32


def to_host(x, dtype) -> np.ndarray:
    """A NumPy view (or, for half types and dtype changes, a copy) of an array or CPU tensor."""
    if is_tensor(x):
        x = x.detach()
        if dtype_name(x) in ("float16", "bfloat16"):
            x = x.float()
        x = x.numpy()
    if type(x) is np.ndarray and x.dtype == dtype:
        return x  # what np.asarray would return, minus its cost on a one-token call
    return np.asarray(x, dtype=dtype)


def to_host_bits(x, dtype) -> np.ndarray:
    """Like ``to_host``, but a half-precision tensor comes as a view of its bits (no copy):
    bfloat16 as uint16, float16 as int16 — the type tells the kernel which half it holds — for
    kernels that widen and round half types themselves (docs/dtypes-and-errors.md). Quantized
    KV caches come as their stored bits too: float8_e4m3fn as uint8, int8 as int8."""
    name = dtype_name(x)
    if name == "int8":
        return x.detach().numpy() if is_tensor(x) else x
    if name == "float8_e4m3fn":
        return x.detach().view(sys.modules["torch"].uint8).numpy()
    if is_tensor(x):
        if x.requires_grad:
            x = x.detach()
        if name == "bfloat16":
            return x.view(sys.modules["torch"].int16).numpy().view(np.uint16)
        if name == "float16":
            return x.view(sys.modules["torch"].int16).numpy()
        host = x.numpy()  # a view; the common case of a one-token call
        return host if host.dtype == dtype else host.astype(dtype)
    return to_host(x, dtype)


def from_host(result: np.ndarray, placement: Placement, dtype: str):
    """A CPU kernel's NumPy result -> the caller's framework and dtype (no copy when already
    right); uint16 / int16 results are bfloat16 / float16 bits and become a tensor of that type
    without a copy."""
    if result.dtype == np.uint16:
        torch = sys.modules["torch"]
        return torch.from_numpy(result.view(np.int16)).view(torch.bfloat16)
    if result.dtype == np.int16:
        torch = sys.modules["torch"]
        return torch.from_numpy(result).view(torch.float16)
    if placement.framework == "numpy":
        return result if result.dtype == dtype else result.astype(dtype)
    torch = sys.modules["torch"]
    tensor = torch.from_numpy(result)
    want = getattr(torch, dtype)
    return tensor if tensor.dtype is want else tensor.to(dtype=want)
