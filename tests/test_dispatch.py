"""Backend choice: registry, explicit choice, automatic choice, explain, and a light import."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import fastpe
from fastpe.api import OPS
from fastpe.backends import BACKEND_NAMES, REGISTRY
from fastpe.backends.base import Implementation


def test_every_backend_implements_every_op():
    for name in BACKEND_NAMES:
        for op in OPS:
            impl = REGISTRY[(name, op)]
            assert impl.backend == name and impl.op == op


def test_backends_reports_each_backend():
    status = fastpe.backends()
    assert set(status) == set(BACKEND_NAMES)
    assert status["numpy"] == "available"
    for value in status.values():
        assert value == "available" or value.startswith("unavailable: ")


def test_import_is_light():
    code = (
        "import sys, fastpe; print(fastpe.backends()); "
        "heavy = [m for m in ('numba', 'torch', 'triton') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_unknown_backend_names():
    with pytest.raises(ValueError, match="backend must be one of numpy, numba, triton"):
        fastpe.sinusoidal_table(2, 4, backend="cupy")
    with pytest.raises(ValueError, match="use_backend"):
        with fastpe.use_backend("jax"):
            pass


def test_env_var_and_precedence(monkeypatch):
    monkeypatch.setenv("FASTPE_BACKEND", "bogus")
    with pytest.raises(ValueError, match="\\$FASTPE_BACKEND must be one of"):
        fastpe.sinusoidal_table(2, 4)
    monkeypatch.setenv("FASTPE_BACKEND", "numpy")
    assert fastpe.explain("sinusoidal_table", 2, 4).chosen == "numpy"
    # use_backend beats the environment, backend= beats both
    with fastpe.use_backend("triton"):
        with pytest.raises(fastpe.BackendNotSupportedError, match="backend 'triton' cannot run"):
            fastpe.sinusoidal_table(2, 4)
        assert fastpe.explain("sinusoidal_table", 2, 4, backend="numpy").chosen == "numpy"


class _Broken(Implementation):
    backend, op = "numba", "sinusoidal_table"

    def not_supported_reasons(self, inputs):
        return []

    def run(self, inputs):
        raise ZeroDivisionError("kernel bug")


class _Refusing(_Broken):
    def not_supported_reasons(self, inputs):
        return ["needs a feature this test withholds"]


def test_explicit_backend_is_never_replaced(monkeypatch):
    monkeypatch.setitem(REGISTRY, ("numba", "sinusoidal_table"), _Refusing())
    with pytest.raises(fastpe.BackendNotSupportedError, match="withholds"):
        fastpe.sinusoidal_table(2, 4, backend="numba")
    # automatic choice falls through to the oracle on reasons alone
    np.testing.assert_array_equal(
        fastpe.sinusoidal_table(2, 4), fastpe.sinusoidal_table(2, 4, backend="numpy")
    )


def test_auto_never_hides_a_kernel_exception(monkeypatch):
    monkeypatch.setitem(REGISTRY, ("numba", "sinusoidal_table"), _Broken())
    with pytest.raises(ZeroDivisionError, match="kernel bug"):
        fastpe.sinusoidal_table(2, 4)


def test_no_candidate_lists_every_reason(monkeypatch):
    monkeypatch.setitem(REGISTRY, ("numba", "sinusoidal_table"), _Refusing())
    monkeypatch.setitem(REGISTRY, ("numpy", "sinusoidal_table"), _Refusing())
    with pytest.raises(fastpe.BackendNotSupportedError, match="numba: needs.*\\| numpy: needs"):
        fastpe.sinusoidal_table(2, 4)


def test_explain_reports_choice_and_reasons():
    q = np.zeros((1, 2, 3, 4), np.float32)
    report = fastpe.explain("attention", q, q[:, :1], q[:, :1], causal=True)
    text = str(report)
    assert text.startswith("attention on NumPy array, dtype float32, features: causal, gqa")
    assert report.chosen in ("numba", "numpy")
    for name in BACKEND_NAMES:
        assert f"   {name}" in text
    assert "triton" in text and "cannot run" in text
    # explain validates exactly like the call
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        fastpe.explain(fastpe.attention, q, q[:, :1].repeat(3, 1), q[:, :1].repeat(3, 1))
    with pytest.raises(ValueError, match="op must be one of"):
        fastpe.explain("conv2d", q)


def test_explicit_unavailable_backend_raises_with_reason():
    q = np.zeros((1, 1, 2, 4), np.float32)
    reasons = "; ".join(
        REGISTRY[("triton", "attention")].not_supported_reasons(
            fastpe.explain("attention", q, q, q).inputs
        )
    )
    assert reasons
    with pytest.raises(
        fastpe.BackendNotSupportedError, match="backend 'triton' cannot run attention"
    ) as err:
        fastpe.attention(q, q, q, backend="triton")
    assert reasons in str(err.value)


class _RecordsDevice(Implementation):
    """A stand-in kernel: notes the CUDA devices current around each of its runs."""

    backend, op = "triton", "merge_attention"

    def __init__(self, devices):
        self.devices, self.seen = devices, []

    def not_supported_reasons(self, inputs):
        return []

    def run(self, inputs):
        self.seen.append(list(self.devices.current))


@pytest.fixture
def cuda_devices(monkeypatch):
    """torch.cuda.device replaced by a recorder (no GPU here): ``entered`` lists every device
    entered, ``current`` those entered and not yet left."""
    import contextlib
    import types

    torch = pytest.importorskip("torch")
    devices = types.SimpleNamespace(entered=[], current=[])

    @contextlib.contextmanager
    def device(d):
        devices.entered.append(str(d))
        devices.current.append(str(d))
        yield
        devices.current.pop()

    monkeypatch.setattr(torch.cuda, "device", device)
    return devices


def test_ops_run_with_their_inputs_gpu_current(monkeypatch, cuda_devices):
    """A model spread over GPUs (device_map="auto") calls with tensors on a GPU that is not the
    current one: Triton launches on the current device, so the op must make theirs current."""
    from fastpe import dispatch
    from fastpe._arrays import Placement

    impl = _RecordsDevice(cuda_devices)
    monkeypatch.setitem(REGISTRY, ("triton", "merge_attention"), impl)

    class Record:
        op, dtype, placement = "merge_attention", "float16", Placement("torch", "cuda:1")

    dispatch.run(Record(), "triton")
    dispatch.run_group([Record(), Record()], "triton")
    assert impl.seen == [["cuda:1"]] * 3  # one run, then a group of two
    assert cuda_devices.current == []  # left on exit


def test_cpu_tensors_enter_no_cuda_guard(cuda_devices):
    import torch

    if fastpe.backends()["triton"] != "available":
        pytest.skip(fastpe.backends()["triton"])
    out, lse = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3)
    fastpe.merge_attention(out, lse, out, lse, backend="triton")
    fastpe.merge_attention(out, lse, out, lse, backend="numpy")
    assert cuda_devices.entered == []
