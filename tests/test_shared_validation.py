"""The data-dependent checks every op's validation shares (fastpe/_validate.py): integer ranges,
positions and finite values, on torch tensors reduced where the data lives (not copied to the
host)."""

from __future__ import annotations

import pytest
from _testkit import torch


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_range_checks_reduce_tensors_in_place(monkeypatch):
    """Valid ids/lengths never leave the device (here: never become NumPy); narrow int dtypes
    are compared without wrapping; a bad one is still named with its index."""
    from fastpe._validate import check_position, check_range

    def no_host_copy(self, *args, **kwargs):
        raise AssertionError("a valid tensor was copied to the host")

    monkeypatch.setattr(torch.Tensor, "numpy", no_host_copy)
    check_range("ids", torch.tensor([[0, 4], [3, 1]], dtype=torch.int32), 0, 5)
    check_range("ids", torch.tensor([7], dtype=torch.int32), 0, 2**32)
    check_position("positions", torch.tensor([0, 2**32 - 1]))
    monkeypatch.undo()  # the error path may copy: it locates the bad entry
    with pytest.raises(IndexError, match=r"ids contains 5 at index \[1, 0\], outside \[0, 5\)"):
        check_range("ids", torch.tensor([[0, 4], [5, 1]], dtype=torch.uint8), 0, 5)
    with pytest.raises(ValueError, match=r"positions contains 4294967296 at index \[1\]"):
        check_position("positions", torch.tensor([3, 2**32]))


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_value_checks_skip_device_tensors_unless_asked(monkeypatch):
    """Checks that guard only the result (finite ALiBi/T5 tables, positions < 2^32) do not read
    accelerator tensors (a host sync per call) unless FASTPE_CHECK_DEVICE_DATA=1, and index
    checks run on the device (an asynchronous assert) unless it is set. A meta tensor stands in
    for a CUDA one: it has a device but no data, so any read of it raises."""
    from fastpe._validate import check_finite, check_position, check_range

    slopes = torch.empty(8, device="meta")
    positions = torch.empty(16, dtype=torch.int64, device="meta")
    monkeypatch.delenv("FASTPE_CHECK_DEVICE_DATA", raising=False)
    check_finite("alibi_slopes", slopes)
    check_position("positions", positions)
    check_range("ids", positions, 0, 10)  # asserted on the device: nothing read back
    monkeypatch.setenv("FASTPE_CHECK_DEVICE_DATA", "1")
    with pytest.raises((RuntimeError, NotImplementedError)):
        check_finite("alibi_slopes", slopes)
    with pytest.raises((RuntimeError, NotImplementedError)):
        check_position("positions", positions)
    with pytest.raises((RuntimeError, NotImplementedError)):  # the host check, naming the index
        check_range("ids", positions, 0, 10)
    # on the CPU the checks always run
    monkeypatch.delenv("FASTPE_CHECK_DEVICE_DATA")
    with pytest.raises(ValueError, match="alibi_slopes must be finite"):
        check_finite("alibi_slopes", torch.tensor([1.0, float("inf")]))
