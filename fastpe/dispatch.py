"""Backend choice (after xformers' fmha dispatcher).

Each (backend, op) pair is an ``Implementation`` with a capability table; its
``not_supported_reasons(inputs)`` is the only thing that decides whether it can run a call.
Automatic choice walks a priority list by device and takes the first implementation with no
reasons. An explicit choice (``backend=``, ``use_backend``, ``FASTPE_BACKEND``) is checked and
fails loudly with its reasons; it is never silently replaced. Exceptions raised by a kernel
propagate: they are bugs or bad states, not reasons to fall back.

Nothing here imports numba, triton or torch: availability is read with ``importlib.util.find_spec``.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os
import sys
from typing import ClassVar

BACKEND_NAMES = ("numpy", "numba", "triton")
ENV_VAR = "FASTPE_BACKEND"
# CUDA tensors go to Triton, CPU arrays and tensors to Numba; NumPy (the oracle) runs anything.
AUTO_PRIORITY = {"cuda": ("triton", "numpy"), "cpu": ("numba", "numpy")}


class BackendNotSupportedError(RuntimeError):
    """The requested backend (or every automatic candidate) cannot run this call."""


def check_backend_name(name: str, source: str = "backend") -> str:
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"{source} must be one of {', '.join(BACKEND_NAMES)} (or None); got {name!r}"
        )
    return name


# ---------------------------------------------------------------------------------------------
# Library-level availability of a backend, independent of any call.


def _triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _cuda_present() -> bool:
    """A GPU driver is on this machine. Asks torch only if the caller already imported it."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return bool(torch.cuda.is_available())
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


def backend_unavailable_reason(name: str) -> str | None:
    """Why a backend cannot run at all here, or None. Never imports the backend's packages."""
    if name == "numpy":
        return None
    if name == "numba":
        if importlib.util.find_spec("numba") is None:
            return "numba is not installed (pip install numba)"
        return None
    # triton
    for module in ("torch", "triton"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install 'fastpe[triton]')"
    if not _triton_interpreted() and not _cuda_present():
        return "no CUDA GPU found (TRITON_INTERPRET=1 runs the kernels on CPU torch tensors)"
    return None


# ---------------------------------------------------------------------------------------------
class Implementation:
    """One backend's implementation of one op, described by a capability table."""

    backend: ClassVar[str]
    op: ClassVar[str]
    frameworks: ClassVar[frozenset[str]] = frozenset({"numpy", "torch"})
    device_types: ClassVar[frozenset[str]] = frozenset({"cpu"})
    dtypes: ClassVar[frozenset[str]] = frozenset({"float32", "float64"})
    unsupported_features: ClassVar[frozenset[str]] = frozenset()

    def not_supported_reasons(self, inputs) -> list[str]:
        unavailable = backend_unavailable_reason(self.backend)
        if unavailable:
            return [unavailable]
        reasons = []
        where = inputs.placement
        if where.framework not in self.frameworks:
            reasons.append(f"takes {' or '.join(sorted(self.frameworks))} inputs, not {where}")
        elif where.device_type not in self.device_types:
            reasons.append(
                f"runs on {'/'.join(sorted(self.device_types))} devices, not {where.device_type}"
            )
        if inputs.dtype not in self.dtypes:
            reasons.append(f"supports dtypes {sorted(self.dtypes)}, not {inputs.dtype}")
        for feature in sorted(inputs.features & self.unsupported_features):
            reasons.append(f"does not support {feature}")
        return reasons + self.extra_reasons(inputs)

    def extra_reasons(self, inputs) -> list[str]:
        """Op-specific limits beyond the table (head dims, sizes)."""
        return []

    def run(self, inputs):
        raise NotImplementedError

    def run_group(self, group) -> tuple:
        """Several records of this op; kernels that can take them in one launch override this."""
        return tuple(self.run(inputs) for inputs in group)


REGISTRY: dict[tuple[str, str], Implementation] = {}


def register(cls: type[Implementation]) -> type[Implementation]:
    REGISTRY[(cls.backend, cls.op)] = cls()
    return cls


# ---------------------------------------------------------------------------------------------
_selected: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "fastpe_backend", default=None
)
_explaining: contextvars.ContextVar[bool] = contextvars.ContextVar("fastpe_explain", default=False)


@contextlib.contextmanager
def use_backend(name: str | None):
    """Run every fastpe op inside the ``with`` block on backend ``name`` (None: automatic)."""
    if name is not None:
        check_backend_name(name, "use_backend(name)")
    token = _selected.set(name)
    try:
        yield
    finally:
        _selected.reset(token)


def requested_backend(backend: str | None) -> str | None:
    """The explicit choice in force: ``backend=``, then ``use_backend``, then $FASTPE_BACKEND."""
    if backend is not None:
        return check_backend_name(backend)
    if _selected.get() is not None:
        return _selected.get()
    env = os.environ.get(ENV_VAR, "").strip()
    return check_backend_name(env, f"${ENV_VAR}") if env else None


def candidates(inputs) -> tuple[str, ...]:
    return AUTO_PRIORITY["cuda" if inputs.placement.device_type == "cuda" else "cpu"]


def select(inputs, backend: str | None = None) -> Implementation:
    op = inputs.op
    explicit = requested_backend(backend)
    if explicit is not None:
        impl = REGISTRY[(explicit, op)]
        reasons = impl.not_supported_reasons(inputs)
        if reasons:
            raise BackendNotSupportedError(
                f"backend {explicit!r} cannot run {op} on these inputs: {'; '.join(reasons)}"
            )
        return impl
    tried = []
    for name in candidates(inputs):
        impl = REGISTRY[(name, op)]
        reasons = impl.not_supported_reasons(inputs)
        if not reasons:
            return impl
        tried.append(f"{name}: {'; '.join(reasons)}")
    raise BackendNotSupportedError(
        f"no backend can run {op} on these inputs — " + " | ".join(tried)
    )


def run_group(group, backend: str | None = None):
    """Run one op on several inputs records with one backend, chosen from the first and checked
    against every record; the implementation may process the group at once (``run_group``)."""
    if _explaining.get():
        return Explanation(group[0], backend)
    impl = select(group[0], backend)
    for inputs in group[1:]:
        reasons = impl.not_supported_reasons(inputs)
        if reasons:
            raise BackendNotSupportedError(
                f"backend {impl.backend!r} cannot run {inputs.op} on every array of the group: {'; '.join(reasons)}"
            )
    return impl.run_group(group)


def run(inputs, backend: str | None = None):
    """Run ``inputs.op`` on the chosen backend (or, inside ``explain``, describe the choice)."""
    if _explaining.get():
        return Explanation(inputs, backend)
    return select(inputs, backend).run(inputs)


class Explanation(str):
    """What ``explain`` returns: a readable report (a str) with the chosen backend attached."""

    chosen: str | None  # the backend that would run, or None if the call would raise
    inputs: object  # the validated inputs record

    def __new__(cls, inputs, backend):
        lines = [f"{inputs.op} on {inputs.placement}, dtype {inputs.dtype}"]
        if inputs.features:
            lines[0] += f", features: {', '.join(sorted(inputs.features))}"
        chosen = None
        try:
            explicit = requested_backend(backend)
            chosen = select(inputs, backend).backend
            how = "explicitly requested" if explicit else "automatic choice"
            lines.append(f"-> runs on {chosen!r} ({how})")
        except BackendNotSupportedError as exc:
            lines.append(f"-> would raise: {exc}")
        auto = candidates(inputs)
        for name in BACKEND_NAMES:
            reasons = REGISTRY[(name, inputs.op)].not_supported_reasons(inputs)
            rank = f"auto priority {auto.index(name) + 1}" if name in auto else "not in auto order"
            state = "can run" if not reasons else "cannot run: " + "; ".join(reasons)
            lines.append(f"   {name:7s} [{rank}] {state}")
        self = super().__new__(cls, "\n".join(lines))
        self.chosen, self.inputs = chosen, inputs
        return self


def explain(op, *args, **kwargs) -> Explanation:
    """Which backend ``fastpe.<op>(*args, **kwargs)`` would run on and why the others would not.

    Validates the arguments exactly as the call would (bad input raises the same error) but runs
    no kernel. ``op`` is a name such as ``"attention"`` or the function itself.
    """
    import fastpe

    name = op if isinstance(op, str) else getattr(op, "__name__", repr(op))
    if name not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}; got {op!r}")
    token = _explaining.set(True)
    try:
        return getattr(fastpe, name)(*args, **kwargs)
    finally:
        _explaining.reset(token)


OPS = ("sinusoidal_table", "rope_table", "apply_rope", "embed", "attention", "merge_attention")


def backends() -> dict[str, str]:
    """{name: "available" | "unavailable: <reason>"} for every backend, without importing any."""
    status = {}
    for name in BACKEND_NAMES:
        reason = backend_unavailable_reason(name)
        status[name] = "available" if reason is None else f"unavailable: {reason}"
    return status
