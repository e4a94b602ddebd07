"""The cache parity check: cached logits must equal the full forward at every real position, with
and without padding, within the tolerance in effect times CACHE_TOLERANCE_FACTOR."""

import pytest
import torch

from attnmask.audit import CACHE_TOLERANCE_FACTOR, Tolerance, audit, from_callable
from tests.audit.helpers import T, V, bag_of_words, statuses

pytestmark = pytest.mark.usefixtures("one_thread")


def with_cache(offset: float, at: int = 3):
    """bag_of_words, and a "cached" forward that adds ``offset`` to every logit at position ``at``."""
    forward = bag_of_words()

    def cached(ids, attention_mask):
        out = forward(ids, attention_mask).clone()  # (B, T, V)
        out[:, at] += offset
        return out

    return from_callable(forward, vocab_size=V, cached_forward=cached)


def test_a_cache_that_agrees_passes_in_every_padding():
    report = audit(with_cache(0.0), length=T, checks=["cache parity"])
    check = report.check("cache parity")
    assert statuses(report) == {"cache parity": "PASS"} and check.max_deviation == 0.0
    assert check.details == ["no padding", "left padding x3", "right padding x3"]
    assert check.tolerance == str(Tolerance.for_dtype(torch.float64).scaled(CACHE_TOLERANCE_FACTOR))


def test_a_cache_that_differs_is_caught_at_its_first_position():
    report = audit(with_cache(1.0), length=T, checks=["cache parity"])
    check = report.check("cache parity")
    assert not report.passed and report.exit_code == 1
    assert check.leaks == []  # not an (i, j) pair: a problem
    assert check.problems[0].startswith(
        "no padding: cached logits differ from the full forward at 2 real positions (first at position 3"
    )
    assert check.max_deviation == pytest.approx(1.0)


def test_rounding_within_the_scaled_tolerance_passes():
    # float64 logits: 1e-7 (rtol) x 10, relative to the row's largest logit, absorbs 1e-9
    assert audit(with_cache(1e-9), length=T, checks=["cache parity"]).passed
    assert not audit(with_cache(1e-3), length=T, checks=["cache parity"]).passed


def test_cache_parity_is_skipped_without_a_cache():
    report = audit(bag_of_words(), vocab_size=V, length=T, checks=["cache parity"])
    assert report.check("cache parity").skipped == "the model offers no KV-cache decoding"
