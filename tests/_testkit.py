"""Test helpers imported by the test modules (conftest.py holds only fixtures)."""

from __future__ import annotations

import numpy as np
import pytest

import fastpe
from fastpe import dispatch

try:
    import torch
except ImportError:  # torch is optional; torch cases skip without it
    torch = None

FRAMEWORKS = [
    "numpy",
    pytest.param("torch", marks=pytest.mark.skipif(torch is None, reason="torch not installed")),
]


def to_fw(x, fw, dtype=None):
    """NumPy array -> the framework's array (keeps dtype unless given)."""
    if x is None:
        return None
    x = np.asarray(x)
    if dtype is not None:
        x = x.astype(dtype)
    if fw == "numpy":
        return x
    return torch.from_numpy(np.ascontiguousarray(x))


def to_np(x):
    if torch is not None and isinstance(x, torch.Tensor):
        return (
            x.detach().cpu().to(torch.float64).numpy() if x.is_floating_point() else x.cpu().numpy()
        )
    return np.asarray(x)


def _kernel_backends():
    """Non-oracle backends, each skipped with its reason when it cannot run here at all; what
    a backend cannot run for a particular call is skipped later, by ``run_or_skip``."""
    params = []
    for name in dispatch.BACKEND_NAMES:
        if name == "numpy":
            continue  # the oracle is never tested against itself
        why = dispatch.backend_unavailable_reason(name)
        params.append(
            pytest.param(name, marks=pytest.mark.skipif(why is not None, reason=f"{name}: {why}"))
        )
    return params


KERNEL_BACKENDS = _kernel_backends()


def run_or_skip(fn, backend, *args, **kwargs):
    """Call a fastpe op on ``backend``; skip (with the reasons) if that backend cannot run it."""
    report = fastpe.explain(fn.__name__, *args, backend=backend, **kwargs)
    if report.chosen is None:
        pytest.skip(str(report).splitlines()[1])
    return fn(*args, backend=backend, **kwargs)
