"""What every audit report shares: findings that pass, fail or were skipped, one verdict, JSON and text.

Two reports build on it, each a dataclass:

- :class:`~attnmask.audit.report.AuditReport`, the leak audit: one
  :class:`~attnmask.audit.report.CheckResult` per check;
- :class:`~attnmask.audit.conform.report.ConformReport`, conformance: one
  :class:`~attnmask.audit.conform.report.ConformResult` per scenario and attention implementation.

The verdict is the same for both: passed when every finding passed (a skipped one passes), exit
code 0 or 1 for CI. JSON is ``json.dumps(report.to_dict())``, UTF-8 as printed (``Δ``, not
``\\u0394``), with infinite or NaN deviations written as strings (JSON has no such numbers).
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from typing import ClassVar

__all__ = ["Finding", "Report", "json_number"]


def json_number(x: float) -> float | str:
    """``x``, or ``"inf"`` / ``"nan"`` as a string where JSON has no number for it."""
    return x if math.isfinite(x) else str(x)


class Finding:
    """One row of a report. Subclasses are dataclasses holding these fields (and their own)."""

    passed: bool
    max_deviation: float  # the largest deviation that should have been zero (or within tolerance)
    tolerance: str  # how deviations were judged, in words
    skipped: str | None  # why it did not run (it then counts as passed)

    @property
    def status(self) -> str:
        return "SKIP" if self.skipped else ("PASS" if self.passed else "FAIL")


class Report(ABC):
    """Findings about one model and the verdict on them. Subclasses are dataclasses with a ``model``
    field (what was audited, in words)."""

    command: ClassVar[str]  # the attnmask subcommand that prints it
    model: str

    @abstractmethod
    def findings(self) -> list[Finding]:
        """Every finding, in the order it is reported."""

    @abstractmethod
    def subtitle(self) -> str:
        """The line under the title: what was audited, and how."""

    @abstractmethod
    def to_dict(self) -> dict:
        """What ``--json`` prints."""

    @property
    def passed(self) -> bool:
        return all(f.passed for f in self.findings())

    @property
    def exit_code(self) -> int:
        """0 when every finding passed, 1 otherwise (for CI gates)."""
        return 0 if self.passed else 1

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings() if not f.passed]

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)

    def title(self) -> str:
        return f"attnmask {self.command}: {self.model}"

    def heading(self) -> list[str]:
        """The first lines of the text report: title, subtitle, a blank line."""
        return [self.title(), f"  {self.subtitle()}", ""]
