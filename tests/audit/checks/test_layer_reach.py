"""The layer reach check: each decoder layer alone reaches exactly its own window back, and a layer
whose mask is one key wider (or narrower) than it declares is named: attnmask models (a layer's
mask rebuilt) and Hugging Face models (a kernel with the window off by one)."""

from __future__ import annotations

import pytest
import torch

from attnmask import masks
from attnmask.attention import prepare_mask
from attnmask.audit import audit
from attnmask.audit.checks.layer_reach import REACH_MARGIN
from attnmask.audit.faults import tiny_model
from attnmask.model import ModelConfig, Transformer
from tests.audit.helpers import bag_of_words, statuses

pytestmark = pytest.mark.usefixtures("one_thread")

W = 4  # the sliding layers' window


def windowed_model(seed: int = 0) -> Transformer:
    """Three layers, the middle one full, the others a window of W (Gemma 3's pattern, shrunk)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=48, arch="decoder", dim=32, n_layers=3, n_heads=4, ffn_dim=64, max_seq_len=64,
        positions="rotary", sliding_window=W, layer_types=("sliding", "full", "sliding"),
    )  # fmt: skip
    return Transformer(cfg).eval()


def with_window(monkeypatch, model: Transformer, layer: int, window: int) -> None:
    """Build ``layer``'s mask with ``window`` while the config still declares its own."""
    built = model.layer_masks

    def layer_masks(mask, B, Tq, Tk, device):
        out = built(mask, B, Tq, Tk, device)
        local = masks.causal() & masks.sliding_window(window)
        out[layer] = prepare_mask(local, B, model.config.n_heads, Tq, Tk, device=device)
        return out

    monkeypatch.setattr(model, "layer_masks", layer_masks)


def reaches(report) -> list[tuple[int, int, int]]:
    return [(r.window, r.allowed, r.reach) for r in report.layer_reach]


def test_sliding_and_full_layers_reach_what_they_declare():
    report = audit(windowed_model(), length=8, checks=["layer reach"])
    T = W + REACH_MARGIN
    assert statuses(report) == {"layer reach": "PASS"}
    assert reaches(report) == [(W, W - 1, W - 1), (0, T - 1, T - 1), (W, W - 1, W - 1)]
    assert [r.beyond for r in report.layer_reach] == [0.0, None, 0.0]
    assert report.check("layer reach").details[0].endswith(f"output at position {T - 1} of T={T}")
    text = report.to_text()
    assert f"its output at position {T - 1} of T={T}" in text and "full" in text


def test_a_layer_one_key_wider_than_declared_is_named(monkeypatch):
    model = windowed_model()
    with_window(monkeypatch, model, 2, W + 1)
    report = audit(model, length=8, checks=["layer reach"])
    check = report.check("layer reach")
    assert check.status == "FAIL" and not report.passed and report.exit_code == 1
    assert len(check.problems) == 1 and check.problems[0].startswith(f"layer 2 (window {W}) reaches {W} back")
    assert check.max_deviation > 0
    assert reaches(report)[2] == (W, W - 1, W) and [r.passed for r in report.layer_reach] == [True, True, False]


def test_a_layer_one_key_narrower_than_declared_is_named(monkeypatch):
    model = windowed_model()
    with_window(monkeypatch, model, 0, W - 1)
    report = audit(model, length=8, checks=["layer reach"])
    problems = report.check("layer reach").problems
    assert len(problems) == 1
    assert problems[0].startswith(f"layer 0 declares window {W} (reach {W - 1} back)")
    assert f"only {W - 2} back" in problems[0]


def test_a_full_layer_given_a_window_is_named(monkeypatch):
    model = windowed_model()
    with_window(monkeypatch, model, 1, W)
    problems = audit(model, length=8, checks=["layer reach"]).check("layer reach").problems
    q = W + REACH_MARGIN - 1
    assert len(problems) == 1 and problems[0].startswith(f"layer 1 is full (reach {q} back)")


def test_layers_without_windows_reach_every_earlier_key():
    report = audit(tiny_model("decoder"), length=6, checks=["layer reach"])
    assert statuses(report) == {"layer reach": "PASS"}
    assert reaches(report) == [(0, 5, 5), (0, 5, 5)]  # no window: the audit's own length
    assert report.to_dict()["layer_reach"][0] == {
        "layer": 0, "window": 0, "allowed": 5, "reach": 5, "beyond_deviation": None,
        "edge_ratio": report.layer_reach[0].edge, "passed": True,
    }  # fmt: skip


def test_encoder_decoders_are_measured_on_their_decoder_layers():
    report = audit(tiny_model("encoder_decoder"), length=6, src_length=5, checks=["layer reach"])
    assert statuses(report) == {"layer reach": "PASS"}
    assert reaches(report) == [(0, 5, 5), (0, 5, 5)]


def test_skipped_without_access_to_decoder_layers():
    report = audit(bag_of_words(), vocab_size=11, length=6, checks=["layer reach"])
    assert report.check("layer reach").skipped == "the model offers no access to its decoder layers"
    assert report.passed and report.layer_reach is None


@pytest.mark.parametrize("kernel, problem", [("wide_window", "reaches 4 back"), ("narrow_window", "only 2 back")])
def test_a_hugging_face_kernel_with_a_wrong_window_is_named_per_layer(kernel, problem):
    pytest.importorskip("transformers")
    from attnmask.audit.conform.models import load_model, set_implementation
    from tests.audit.conform_fixtures import registered

    model = load_model("gemma3_text")[0]  # layers 0 and 2: a window of 4; layer 1: full
    with registered(kernel):
        set_implementation(model, kernel)
        problems = audit(model, length=6, checks=["layer reach"]).check("layer reach").problems
    assert [p.split(" ")[1] for p in problems] == ["0", "2"]
    assert all(problem in p for p in problems)
