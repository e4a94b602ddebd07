"""The fully padded rows check: an all-pad row gives finite logits and leaves its neighbour alone."""

import pytest
import torch

from attnmask.audit import audit
from attnmask.audit.faults import tiny_model
from tests.audit.helpers import T, V, bag_of_words

pytestmark = pytest.mark.usefixtures("one_thread")

W = torch.randn(V, V, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def mean_of_words(ids, attention_mask):
    """logits_i = W · (mean one-hot of the real ids in 0..i): 0 / 0 = NaN in an all-pad row."""
    onehot = torch.nn.functional.one_hot(ids, V).double() * attention_mask[..., None]  # (B, T, V)
    counts = attention_mask.double().cumsum(1)[..., None]  # (B, T, 1)
    return (onehot.cumsum(1) / counts) @ W  # (B, T, V)


def batch_centred(ids, attention_mask):
    """bag_of_words minus the batch mean: each row depends on the others."""
    out = bag_of_words()(ids, attention_mask)  # (B, T, V)
    return out - out.mean(0, keepdim=True)


def test_clean_models_pass():
    for model, kwargs in ((tiny_model("decoder"), {}), (bag_of_words(), {"vocab_size": V})):
        report = audit(model, length=T, checks=["fully padded rows"], **kwargs)
        assert report.passed, report.to_text()
    enc_dec = audit(tiny_model("encoder_decoder"), length=6, src_length=5, checks=["fully padded rows"])
    assert enc_dec.check("fully padded rows").details == [
        "forward: real source, real target, real source, padded target, padded source, real target, "
        "padded source, padded target",
        "cached: real source, real target, real source, padded target, padded source, real target, "
        "padded source, padded target",
    ]


def test_nan_in_an_all_pad_row_is_caught():
    report = audit(mean_of_words, vocab_size=V, length=T, checks=["fully padded rows"])
    check = report.check("fully padded rows")
    assert not report.passed
    assert check.problems == ["forward: padded row: non-finite logits (NaN/inf)"]


def test_a_pad_row_that_disturbs_its_neighbour_is_caught():
    report = audit(batch_centred, vocab_size=V, length=T, checks=["fully padded rows"])
    problems = report.check("fully padded rows").problems
    assert not report.passed
    assert len(problems) == 1 and problems[0].startswith("fully padded rows in the batch changed the real row's logits")
