"""Conformance of a Gemma 3 (sliding and full layers): the per-layer reach scenario passes on the real
kernels, names a window one key too wide or too narrow, and attnmask's reference follows the layers."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from attnmask.audit import conform  # noqa: E402
from attnmask.audit.conform.models import layer_windows, load_model  # noqa: E402
from tests.audit.conform_fixtures import registered  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SCENARIOS = ["causality", "layer reach", "float64 reference"]


@pytest.fixture(scope="module")
def gemma3():
    return load_model("gemma3_text")[0]


def test_tiny_gemma3_has_both_layer_types(gemma3):
    assert layer_windows(gemma3.config) == [4, None, 4]


def test_tiny_gemma3_conforms_layer_by_layer(gemma3):
    report = conform(gemma3, ["eager", "sdpa"], scenarios=SCENARIOS)
    assert report.passed, [r.detail for r in report.failures]
    res = report.result("layer reach", "sdpa")
    assert "sliding layers [0, 2]: reach 3 back" in res.detail and "full layers [1]" in res.detail
    assert report.result("float64 reference", "sdpa").skipped is None  # attnmask builds Gemma 3 itself


@pytest.mark.parametrize("kernel, what", [("wide_window", "moves with keys 4 or more back"),
                                          ("narrow_window", "ignores the oldest key")])  # fmt: skip
def test_a_wrong_window_is_named_per_layer(gemma3, kernel, what):
    with registered(kernel):
        report = conform(gemma3, [kernel], scenarios=["layer reach"])
    res = report.result("layer reach", kernel)
    assert not res.passed and what in res.detail and "layer 0" in res.detail
    assert "layer 1" not in res.detail  # the full layer is right whatever the window
