"""The causality check: each look-ahead leak is caught, and the first leaking pair named exactly."""

import pytest
import torch

from attnmask import masks
from attnmask.audit import audit
from attnmask.audit.faults import inject, tiny_model
from tests.audit.helpers import FUTURE, T, first, pairs, statuses

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_bidirectional_decoder(arch):
    report = audit(inject(tiny_model(arch), "bidirectional"), length=T, src_length=8)
    assert first(report) == ("causality", 0, 1, "")
    assert pairs(report, "causality") == FUTURE  # every future pair, nothing else
    assert pairs(report, "gradient") == FUTURE
    assert statuses(report)["padding"] == "PASS"  # its key padding is intact
    assert statuses(report)["cache parity"] == "FAIL"  # training and cached decoding disagree
    assert report.exit_code == 1


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_cumulative_sum_over_the_future(arch):
    report = audit(inject(tiny_model(arch), "cumsum"), length=T, src_length=8)
    assert first(report) == ("causality", 0, 1, "")
    assert pairs(report, "gradient") == FUTURE  # a suffix sum reaches every later token
    assert pairs(report, "causality") == FUTURE
    # it also sums the right pads into the real tokens before them
    assert (0, T - 1) in pairs(report, "padding")


def test_intended_mask_other_than_causal():
    # a causal model audited against a sliding window of 3: it uses tokens the window blocks
    report = audit(tiny_model("decoder"), length=8, intended=masks.sliding_window(3), checks=["causality", "gradient"])
    expected = {(i, j) for i in range(8) for j in range(i - 2)}
    assert pairs(report, "causality") == expected
    assert pairs(report, "gradient") == expected
    assert first(report) == ("causality", 3, 0, "")


def test_over_masking_is_noted_but_not_a_leak():
    class OnlyItself(type(tiny_model())):
        def target_mask(self, ids):  # a window of 1: nothing leaks, but no context is used either
            return masks.sliding_window(1) & masks.padding(token_ids=ids, pad_id=0)

    model = tiny_model()
    model.__class__ = OnlyItself
    report = audit(model, length=6, checks=["causality"])
    assert report.passed
    assert any("15 allowed (i, j) pairs showed no dependence" in n for n in report.notes)
    assert report.dependency_grid().splitlines()[3].split("│")[1].split() == ["○", "■", "·", "·", "·", "·"]


def test_the_measured_dependency_is_the_look_ahead_mask_of_a_clean_model():
    report = audit(tiny_model("decoder"), length=T, checks=["causality"])
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    details = report.check("causality").details
    assert details == [
        "2 sequences x 10 positions x 3 replacement tokens = 60 perturbed rows",
        "measured through the full forward and token by token over the cache (the generation path)",
    ]
    assert bool((report.dependency[causal] > 0).all())
    torch.testing.assert_close(report.dependency[~causal], torch.zeros(int((~causal).sum())))
    assert report.gradient is None  # the gradient check did not run
