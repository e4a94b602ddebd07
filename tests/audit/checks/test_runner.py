"""audit(): every check runs in order on clean models and passes; the same seed gives the same
report; arguments it cannot use are refused with what was expected."""

import pytest
import torch

from attnmask.audit import CHECKS, audit
from attnmask.audit.faults import inject, tiny_model
from tests.audit.helpers import T, bag_of_words, statuses

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    "arch, positions",
    [("decoder", "sinusoidal"), ("decoder", "rotary"), ("encoder_decoder", "learned"), ("encoder_decoder", "rotary")],
)
def test_clean_attnmask_models_pass_every_check(arch, positions):
    report = audit(tiny_model(arch, positions=positions), length=T, src_length=8)
    expected = [c for c in CHECKS if arch == "encoder_decoder" or c != "source padding"]
    assert [c.name for c in report.checks] == expected
    # an encoder-decoder is not served by the engine's packed step: its cross-request check is skipped
    skipped = {"cross-request": "SKIP"} if arch == "encoder_decoder" else {}
    assert statuses(report) == dict.fromkeys(expected, "PASS") | skipped
    assert report.passed and report.exit_code == 0
    assert report.leaks == [] and report.first_leak is None
    # the measured dependency matrix *is* the look-ahead mask: every allowed pair used, no other
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    assert bool((report.dependency[causal] > 0).all())
    torch.testing.assert_close(report.dependency[~causal], torch.zeros(int((~causal).sum())))
    torch.testing.assert_close(report.gradient[~causal], torch.zeros(int((~causal).sum())))


def test_checks_run_in_their_order_whatever_order_they_are_asked_in():
    report = audit(tiny_model("decoder"), length=6, checks=["fully padded rows", "causality", "source padding"])
    assert [c.name for c in report.checks] == ["causality", "fully padded rows"]  # no source: no source padding


def test_same_seed_same_report():
    a = audit(inject(tiny_model(), "cumsum"), length=6, seed=3).to_dict()
    b = audit(inject(tiny_model(), "cumsum"), length=6, seed=3).to_dict()
    assert a == b


def test_usage_errors():
    with pytest.raises(ValueError, match="vocab_size="):
        audit(bag_of_words())
    with pytest.raises(ValueError, match="unknown audit checks"):
        audit(tiny_model(), checks=["causality", "speed"])
    with pytest.raises(ValueError, match="exceeds the model's longest sequence 64"):
        audit(tiny_model(), length=65)
    with pytest.raises(TypeError, match="cannot audit a int"):
        audit(3)
    with pytest.raises(ValueError, match=r"the model returned \(1, 4\), expected logits \(B=1, T=4, V\)"):
        audit(lambda ids, m=None: ids.float(), vocab_size=5, length=4)
