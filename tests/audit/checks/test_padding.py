"""The padding checks: real outputs ignore the amount of padding and the ids in the pads, on the
target and (encoder-decoders) on the source."""

import pytest
import torch

from attnmask.audit import audit
from attnmask.audit.faults import inject, tiny_model
from tests.audit.helpers import T, V, first, statuses

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_padding_that_leaks_into_real_tokens(arch):
    report = audit(inject(tiny_model(arch), "padding"), length=T, src_length=8)
    # look-ahead intact; the first real token after one left pad sees it
    assert statuses(report)["causality"] == "PASS" and statuses(report)["gradient"] == "PASS"
    assert first(report) == ("padding", 1, 0, "left padding x1")
    leaks = report.check("padding").leaks
    # right pads hide behind the look-ahead mask; every leak is a real token seeing an earlier pad
    assert all(lk.context.startswith("left") for lk in leaks)
    assert all(lk.j is None or lk.j < lk.i for lk in leaks)
    x3 = {(lk.i, lk.j) for lk in leaks if lk.context == "left padding x3"}
    assert {(i, j) for i in range(3, T) for j in range(3)} <= x3


def test_source_padding_amount_is_checked_on_the_sides_the_encoder_supports():
    learned = audit(
        tiny_model("encoder_decoder", positions="learned"), length=6, src_length=6, checks=["source padding"]
    )
    details = " ".join(learned.check("source padding").details)
    assert "source left padding x1: (amount not checked" in details
    assert "source right padding x1: amount and" in details
    rotary = audit(tiny_model("encoder_decoder", positions="rotary"), length=6, src_length=6, checks=["source padding"])
    assert "not checked" not in " ".join(rotary.check("source padding").details)


def test_source_padding_leak():
    report = audit(inject(tiny_model("encoder_decoder"), "source_padding"), length=T, src_length=8)
    # generation attends to each source's real positions only, so it disagrees with the leaky forward
    assert [c.name for c in report.checks if not c.passed] == ["source padding", "cache parity"]
    assert first(report) == ("source padding", 0, 0, "source left padding x1")
    right = {(lk.i, lk.j) for lk in report.check("source padding").leaks if lk.context == "source right padding x1"}
    assert {(i, 7) for i in range(T)} | {(i, None) for i in range(T)} == right


def test_callable_encoder_decoder_source_mask_ignored():
    w = torch.randn(V, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def make(honour_src_mask: bool):
        def forward(src, src_mask, tgt, tgt_mask):
            s = torch.nn.functional.one_hot(src, V).double()  # (B, S, V)
            if honour_src_mask:
                s = s * src_mask[..., None]
            t = torch.nn.functional.one_hot(tgt, V).double() * tgt_mask[..., None]  # (B, T, V)
            return (t.cumsum(1) + s.sum(1, keepdim=True)) @ w  # (B, T, V)

        return forward

    good = audit(make(True), vocab_size=V, encoder_decoder=True, length=6, src_length=5, pad_amounts=(2,))
    assert good.passed, good.to_text()
    bad = audit(make(False), vocab_size=V, encoder_decoder=True, length=6, src_length=5, pad_amounts=(2,))
    assert [c.name for c in bad.checks if not c.passed] == ["source padding"]
    # pads written with pad_id 0 still count as tokens: the amount of padding changes every output
    assert first(bad) == ("source padding", 0, 0, "source left padding x2")


def test_padding_is_skipped_when_no_pad_amount_fits():
    report = audit(tiny_model("decoder"), length=3, pad_amounts=(3, 5), checks=["padding"])
    assert report.check("padding").skipped == "no pad amount below the length 3"
    assert report.passed
