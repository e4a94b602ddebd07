"""``--precision auto``: a rule on what the device can do, never a timing (so the same command takes
the same precision whatever the machine's load)."""

from __future__ import annotations

import pytest
import torch

from attnmask import linear
from attnmask.train import precision


def test_auto_on_the_cpu_follows_native_bf16_and_times_nothing(monkeypatch):
    def timing(*args, **kwargs):
        raise AssertionError("auto must not time anything")

    monkeypatch.setattr(precision, "matmul_speedup", timing)
    cpu = torch.device("cpu")
    for native, want in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(linear, "fast_bf16_products", lambda native=native: native)
        chosen, why = precision.choose("auto", cpu)
        assert chosen == want and why.startswith("auto: ")
        assert "AVX512-BF16/AMX" in why


@pytest.mark.parametrize("asked", ["fp32", "bf16"])
def test_an_explicit_precision_is_kept(asked):
    assert precision.choose(asked, torch.device("cpu")) == (asked, "as requested")
