"""Shared fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a test module (``pytestmark = pytest.mark.usefixtures("one_thread")``).
    The tests' models are tiny: on a shared 2-core machine, two OpenMP threads spin-waiting for each
    other made steps 5-10x slower than one thread (measured), and intra-op threads gain nothing."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
