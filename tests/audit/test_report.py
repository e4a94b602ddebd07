"""The reports: the audit's text, JSON and picture, and what it shares with conformance's report."""

import json

import pytest

from attnmask.audit import AuditReport, ConformReport, ConformResult, Finding, Report, audit
from attnmask.audit.faults import inject, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_report_outputs(tmp_path):
    report = audit(inject(tiny_model(), "off_by_one"), length=6)
    text = report.to_text()
    assert "first leak: [causality] (i=0, j=1): output 0 changes when token 1 is replaced" in text
    assert "FAIL  causality" in text and text.rstrip().endswith("FAILED")
    data = json.loads(report.to_json())
    assert data["passed"] is False
    assert (data["first_leak"]["i"], data["first_leak"]["j"]) == (0, 1)
    assert data["intended"][0] == [1, 0, 0, 0, 0, 0]
    assert data["checks"][0]["name"] == "causality" and data["checks"][0]["status"] == "FAIL"
    png = report.save_png(tmp_path / "dep.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    grid = report.dependency_grid().splitlines()
    assert grid[2].split("│")[1].split() == ["■", "✗", "✗", "·", "·", "·"]


def test_audit_report_heading_verdict_and_failures():
    report = audit(inject(tiny_model(), "off_by_one"), length=6, checks=["causality", "padding"])
    assert isinstance(report, Report) and all(isinstance(c, Finding) for c in report.checks)
    lines = report.to_text().splitlines()
    assert lines[:3] == [
        "attnmask audit: attnmask Transformer (decoder, sinusoidal positions)",
        "  decoder-only, float32, T=6, seed 0",
        "",
    ]
    assert [c.name for c in report.failures] == ["causality"]
    assert (report.passed, report.exit_code) == (False, 1)
    assert "Δ" in report.to_json()  # UTF-8 as printed, as conformance's JSON


def conform_report(*results: ConformResult) -> ConformReport:
    return ConformReport(
        model="m", transformers="5.0", dtype="float32", implementations=["eager"], unavailable={}, results=list(results)
    )


def test_conform_report_shares_the_verdict():
    ok = ConformResult("causality", "eager", True, max_deviation=0.0)
    skipped = ConformResult("sliding window", "eager", True, skipped="no sliding window")
    crashed = ConformResult("left padding", "eager", False, detail="raised", max_deviation=float("inf"), error=True)
    good = conform_report(ok, skipped)
    assert (good.passed, good.exit_code, good.failures) == (True, 0, [])
    assert [r.status for r in good.results] == ["PASS", "SKIP"]
    bad = conform_report(ok, skipped, crashed)
    assert (bad.passed, bad.exit_code, bad.failures) == (False, 1, [crashed])
    assert bad.to_text().splitlines()[:3] == ["attnmask conform: m", "  transformers 5.0, float32", ""]
    assert bad.to_text().splitlines()[-1] == "FAILED: 1 scenario"
    data = json.loads(bad.to_json())
    assert data["results"][2]["max_deviation"] == "inf"  # JSON has no infinity
    assert [r["passed"] for r in data["results"]] == [True, True, False]


def test_a_report_without_findings_passes():
    report = conform_report()
    assert report.passed and report.exit_code == 0
    assert isinstance(report, Report) and not isinstance(report, AuditReport)
