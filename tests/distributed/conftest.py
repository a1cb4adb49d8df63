"""One spawned run of 4 processes for every test of this folder: starting a process costs
seconds (torch, torch._dynamo, Numba's kernels), so the cases of both test files run as phases
of one run, each phase on its own group of some of the processes (_spawn.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spawned(tmp_path_factory):
    """Per rank of the run: case name -> ("ok", *outputs) or ("error", type name, message)."""
    pytest.importorskip("torch")
    import _spawn
    import test_distributed
    import test_distributed_errors

    phases = test_distributed.PHASES + test_distributed_errors.PHASES
    return _spawn.spawn_group(4, phases, tmp_path_factory.mktemp("spawned"))
