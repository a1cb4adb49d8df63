"""Test helpers imported by the test modules (conftest.py holds only fixtures)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import fastpe
from fastpe.backends import kernel_backends, unavailable_reason

try:
    import torch
except ImportError:  # torch is optional; torch cases skip without it
    torch = None

# The shared shape grid [B, H, S, D] of the per-backend tests: odd, prime, tile edges
SHAPES = [(1, 1, 1, 2), (3, 7, 5, 12), (2, 4, 33, 64), (1, 2, 130, 40)]

# Without a GPU the Triton kernels run in Triton's interpreter (conftest.py switches it on), at
# 0.2-4 s a call where Numba takes milliseconds. The interpreter checks the kernel's *logic*:
# each constexpr/feature combination once, on small shapes. The shape grids (odd sizes, tile
# edges, long keys) run in full on numba and numpy, and on a real GPU on triton too.
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def grid(values, interpreter, *, unpack=False):
    """Parametrisation values of a shape grid: all of ``values``; under Triton's interpreter the
    triton case runs only for ``values[i] for i in interpreter``. The other triton cases are
    deselected by conftest.py (counted in pytest's "deselected"), so every feature combination of the test still runs on triton, on the shapes
    named here. Say at the call why those shapes represent the others. ``unpack``: the values
    are tuples for several argument names ("n,dim,offset")."""
    out = []
    for i, v in enumerate(values):
        if i in interpreter:
            out.append(v)
        else:
            args = v if unpack else (v,)
            out.append(pytest.param(*args, marks=pytest.mark.grid_only))
    return out


# SHAPES for the per-backend grids: on Triton's interpreter the first two (full rotary at D=2;
# partial rotary, odd B/H/S and D=12 off a power of two, so every masked lane) — the larger two
# add only more rows and wider heads of the same kernel, and run on numba.
SHAPES_GRID = grid(SHAPES, interpreter=[0, 1])

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


needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")


def to_np(x):
    if torch is not None and isinstance(x, torch.Tensor):
        return (
            x.detach().cpu().to(torch.float64).numpy() if x.is_floating_point() else x.cpu().numpy()
        )
    return np.asarray(x)


def _kernel_backends():
    """Non-oracle backends, each skipped with its reason when it cannot run here at all; what
    a backend cannot run for a particular call is skipped by the hook in conftest.py."""
    params = []
    for name in kernel_backends():  # the oracle is never tested against itself
        why = unavailable_reason(name)
        params.append(
            pytest.param(name, marks=pytest.mark.skipif(why is not None, reason=f"{name}: {why}"))
        )
    return params


KERNEL_BACKENDS = _kernel_backends()
# numba alone, for the tests of its half-precision bit handling and its small-call paths
NUMBA = [p for p in KERNEL_BACKENDS if p.values[0] == "numba"]


def loose(backend, oracle_tol, kernel_tol):
    """The oracle keeps its closed-form tolerance; a float64 kernel may differ by a few ulp."""
    return oracle_tol if backend == "numpy" else kernel_tol


def check_close(got, want, tol, what=""):
    """``got`` has ``want``'s shape, no NaN, and is within ``tol · max(1, max|want|)`` of it."""
    got, want = to_np(got).astype(np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert not np.isnan(got).any(), f"NaN in {what}"
    err = np.max(np.abs(got - want), initial=0.0)
    assert err <= tol * max(1.0, np.max(np.abs(want), initial=0.0)), (
        f"{what}: max error {err:.3g} > {tol}"
    )


def same_bits(got, want):
    """Equal bit patterns of two torch tensors, except that any NaN matches any NaN."""
    nan = torch.isnan(want)
    assert torch.isnan(got[nan]).all()
    assert torch.equal(got[~nan], want[~nan]), (got[~nan] != want[~nan]).sum().item()


def raises(exc, match, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` raises ``exc`` with a message matching ``match``."""
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


def require(backend, op, *args, **kwargs):
    """Skip now, with the reasons, if ``backend`` cannot run ``fastpe.<op>(*args, **kwargs)``.

    A refused call is normally skipped by the hook in conftest.py; Hypothesis tests call this
    first so that they skip before Hypothesis starts shrinking a refusal."""
    report = fastpe.explain(op, *args, backend=backend, **kwargs)
    if report.chosen is None:
        pytest.skip(str(report).splitlines()[1])


def schema_options(**public) -> dict:
    """The attention options as the torch ops' schema arguments, by name, for ``opcheck`` calls
    (which take the schema's arguments; their order is the op's own business)."""
    from fastpe._options import AttentionOptions

    values = AttentionOptions.flatten("cpu", **public)
    return dict(zip(AttentionOptions.SCHEMA_NAMES, values, strict=True))
