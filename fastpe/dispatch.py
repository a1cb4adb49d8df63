"""Backend choice (after xformers' fmha dispatcher).

Each (backend, op) pair is an ``Implementation`` in ``fastpe.backends.REGISTRY`` with a
capability table; its ``not_supported_reasons(inputs)`` is the only thing that decides whether
it can run a call. Automatic choice walks ``fastpe.backends.auto_order`` for the inputs' device
and takes the first implementation with no reasons. An explicit choice (``backend=``,
``use_backend``, ``FASTPE_BACKEND``) is checked and fails loudly with its reasons; it is never
silently replaced. Exceptions raised by a kernel propagate: they are bugs or bad states, not
reasons to fall back.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

from fastpe.backends import BACKEND_NAMES, REGISTRY, auto_order
from fastpe.backends.base import Implementation

ENV_VAR = "FASTPE_BACKEND"


class BackendNotSupportedError(RuntimeError):
    """The requested backend (or every automatic candidate) cannot run this call."""


def check_backend_name(name: str, source: str = "backend") -> str:
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"{source} must be one of {', '.join(BACKEND_NAMES)} (or None); got {name!r}"
        )
    return name


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


@contextlib.contextmanager
def explaining():
    """Inside the block, ``run``/``run_group`` return an ``Explanation`` instead of running."""
    token = _explaining.set(True)
    try:
        yield
    finally:
        _explaining.reset(token)


def requested_backend(backend: str | None) -> str | None:
    """The explicit choice in force: ``backend=``, then ``use_backend``, then $FASTPE_BACKEND."""
    if backend is not None:
        return check_backend_name(backend)
    if _selected.get() is not None:
        return _selected.get()
    env = os.environ.get(ENV_VAR, "").strip()
    return check_backend_name(env, f"${ENV_VAR}") if env else None


def candidates(inputs) -> tuple[str, ...]:
    return auto_order("cuda" if inputs.placement.device_type == "cuda" else "cpu")


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
    with on_device(group[0].placement):
        return impl.run_group(group)


def run(inputs, backend: str | None = None):
    """Run ``inputs.op`` on the chosen backend (or, inside ``explaining``, describe the choice)."""
    if _explaining.get():
        return Explanation(inputs, backend)
    impl = select(inputs, backend)
    with on_device(inputs.placement):
        return impl.run(inputs)


def on_device(placement):
    """The block runs with the inputs' GPU as the current CUDA device (nothing to do off CUDA).
    Triton launches a kernel on the current device and its stream, whatever device the
    tensors are on: those of a model spread over GPUs (``device_map="auto"``) would otherwise
    be read from the wrong one. Every op runs through here, so no launcher sets it itself."""
    if placement.device_type != "cuda":
        return contextlib.nullcontext()
    import torch

    return torch.cuda.device(placement.device)


class Explanation(str):
    """What ``fastpe.explain`` returns: a readable report (a str) with the choice attached."""

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
