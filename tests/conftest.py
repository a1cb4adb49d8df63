"""Fixtures shared by the tests (helpers to import live in _testkit.py)."""

from __future__ import annotations

import os
import shutil

# Without a GPU, the Triton kernels run through Triton's interpreter on CPU torch tensors. It must
# be switched on before any kernel module is imported (fastpe imports them lazily).
if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
from _testkit import FRAMEWORKS

from fastpe.backends import BACKEND_NAMES, unavailable_reason


@pytest.fixture(params=FRAMEWORKS)
def fw(request):
    """Framework of the arrays handed to fastpe: 'numpy' or 'torch' (CPU)."""
    return request.param


@pytest.fixture(scope="module", params=BACKEND_NAMES)
def backend(request):
    """Every registered backend, the float64 oracle included, for the closed-form and
    independent-implementation tests (each op folder's test_oracle.py); unavailable ones skip.
    Module-scoped, since Hypothesis rejects function-scoped fixtures. A test parametrised over
    ``backend`` itself (e.g. over _testkit.KERNEL_BACKENDS) overrides this."""
    name = request.param
    why = unavailable_reason(name)
    if why:
        pytest.skip(f"{name}: {why}")
    return name


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test parametrised over backends skips (with the reasons) where its backend refuses the
    call — the registry's capability tables decide, as in the dispatcher. Other errors fail."""
    import fastpe

    try:
        return (yield)
    except fastpe.BackendNotSupportedError as exc:
        if "backend" not in pyfuncitem.fixturenames:
            raise
        pytest.skip(str(exc))


def pytest_collection_modifyitems(config, items):
    """Under Triton's interpreter, a triton case marked ``grid_only`` (a shape-grid value that
    _testkit.grid() leaves to numba and numpy) is deselected: the interpreter covers each
    feature combination on the representative shapes; see _testkit.grid()."""
    from _testkit import TRITON_INTERPRETED

    if not TRITON_INTERPRETED:
        return
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("backend") == "triton" and item.get_closest_marker("grid_only"):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
