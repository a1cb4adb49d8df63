"""The backend registry, filled explicitly from one module per backend.

Each backend module declares:

- ``NAME``: what users pass as ``backend=`` / ``use_backend`` / ``$FASTPE_BACKEND``;
- ``unavailable_reason()``: why it cannot run at all here, or None (never imports the backend's
  packages: ``import fastpe`` stays light);
- ``AUTO_DEVICES``: the device types for which automatic choice considers it;
- ``IS_ORACLE``: True for the float64 reference, which runs everything and is tried last;
- its ``Implementation`` subclass for every op (``base.py``): each class the module defines
  (or makes, as ``_serving.implementations`` does) that names an ``op`` is registered.

Adding a backend means adding its module to ``MODULES`` below (see docs/extending.md).

``fastpe.backends()`` (public) calls this package: it reports every backend's status.
"""

from __future__ import annotations

import functools
import sys
import types

from fastpe.backends import numba, numpy, triton
from fastpe.backends.base import Implementation

# Listing order is the order users see (errors, explain, fastpe info).
MODULES = (numpy, numba, triton)
BACKEND_NAMES: tuple[str, ...] = tuple(module.NAME for module in MODULES)


def _implementations(module) -> dict[tuple[str, str], Implementation]:
    """{(backend, op): implementation} of the ``Implementation`` subclasses ``module`` defines
    with an ``op`` (its bases have none; imported classes belong to their own module)."""
    found = {}
    for cls in vars(module).values():
        if not (isinstance(cls, type) and issubclass(cls, Implementation)):
            continue
        if cls.__module__ != module.__name__ or getattr(cls, "op", None) is None:
            continue
        if (module.NAME, cls.op) in found:
            raise RuntimeError(f"{module.__name__} defines two implementations of {cls.op}")
        found[(module.NAME, cls.op)] = cls()
    return found


REGISTRY: dict[tuple[str, str], Implementation] = {
    key: impl for module in MODULES for key, impl in _implementations(module).items()
}


def module(name: str):
    return next(m for m in MODULES if m.NAME == name)


def unavailable_reason(name: str) -> str | None:
    """Why backend ``name`` cannot run at all here, or None."""
    return module(name).unavailable_reason()


@functools.cache  # MODULES never change; this runs on every call, one-token calls included
def auto_order(device_type: str) -> tuple[str, ...]:
    """Automatic candidates for inputs on ``device_type``: the kernel backends that serve it,
    then the oracle (which runs anything)."""
    serving = [m for m in MODULES if device_type in m.AUTO_DEVICES]
    return tuple(m.NAME for m in sorted(serving, key=lambda m: m.IS_ORACLE))


def kernel_backends(device_type: str | None = None) -> tuple[str, ...]:
    """The non-oracle backends (those serving ``device_type`` automatically, if given)."""
    return tuple(
        m.NAME
        for m in MODULES
        if not m.IS_ORACLE and (device_type is None or device_type in m.AUTO_DEVICES)
    )


def status() -> dict[str, str]:
    """{name: "available" | "unavailable: <reason>"} for every backend, without importing any."""
    report = {}
    for name in BACKEND_NAMES:
        reason = unavailable_reason(name)
        report[name] = "available" if reason is None else f"unavailable: {reason}"
    return report


class _CallablePackage(types.ModuleType):
    """``fastpe.backends()`` is public API older than this package; calling the package keeps it
    working without a second name for the same thing."""

    def __call__(self) -> dict[str, str]:
        return status()


sys.modules[__name__].__class__ = _CallablePackage
