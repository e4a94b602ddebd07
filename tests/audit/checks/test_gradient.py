"""The gradient check: a structural leak is caught however weak, through every layer it crosses."""

import pytest

from attnmask.audit import GRADIENT_EPS_FACTOR, audit
from attnmask.audit.faults import inject, tiny_model
from tests.audit.helpers import T, bag_of_words, first, pairs, statuses

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_off_by_one_look_ahead(arch):
    report = audit(inject(tiny_model(arch), "off_by_one"), length=T, src_length=8)
    assert first(report) == ("causality", 0, 1, "")
    # j <= i + 1 in each of the 2 layers: output i reaches token i + 2 through token i + 1
    reach = {(i, j) for i in range(T) for j in range(i + 1, min(i + 3, T))}
    assert pairs(report, "gradient") == reach
    causal_pairs = pairs(report, "causality")
    assert {(i, i + 1) for i in range(T - 1)} <= causal_pairs <= reach
    assert not report.passed


def test_gradient_of_a_clean_model_is_exactly_zero_where_blocked():
    report = audit(tiny_model("decoder"), length=6, checks=["gradient"])
    check = report.check("gradient")
    assert check.status == "PASS" and check.max_deviation == 0.0
    assert check.tolerance.startswith(f"‖∂‖ <= {GRADIENT_EPS_FACTOR:g}·eps·max = ")


def test_gradient_is_skipped_without_input_embeddings():
    report = audit(bag_of_words(), vocab_size=11, length=6, checks=["gradient"])
    assert statuses(report) == {"gradient": "SKIP"}
    assert report.check("gradient").skipped == "the model offers no input embeddings to differentiate"
    assert report.passed
