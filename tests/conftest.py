"""Fixtures shared by the tests (helpers to import live in _testkit.py)."""

from __future__ import annotations

import numpy as np
import pytest
from _testkit import FRAMEWORKS


@pytest.fixture(params=FRAMEWORKS)
def fw(request):
    """Framework of the arrays handed to fastpe: 'numpy' or 'torch' (CPU)."""
    return request.param


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
