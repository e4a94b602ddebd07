"""What :func:`attnmask.audit.conform.conform` found: one result per scenario and implementation.

``ConformReport.to_dict()`` is exactly what ``attnmask conform --json`` prints::

    {"passed": bool, "model": str, "transformers": str, "dtype": str,
     "implementations": [str], "unavailable": {name: why},
     "results": [{"scenario", "implementation", "passed", "skipped", "detail",
                  "max_deviation", "tolerance", "first", "png"}]}

``first`` locates the first offense: ``{"query": i, "key": j}`` (output i depends on input j and
must not, or must and does not) or ``{"position": t}`` (logits at token t differ); ``png`` is the
picture of the measured dependency matrix beside the intended mask, once :meth:`save_pngs` drew it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from torch import Tensor

from attnmask.audit.findings import Finding, Report, json_number

__all__ = ["ConformResult", "ConformReport"]


@dataclass
class ConformResult(Finding):
    """One scenario under one attention implementation."""

    scenario: str
    implementation: str
    passed: bool
    detail: str = ""  # what was measured, or what went wrong, in one sentence
    max_deviation: float = 0.0  # the largest deviation that should have been zero (or within tolerance)
    tolerance: str = ""
    first: dict | None = None  # {"query", "key"} or {"position"}: the first offense
    skipped: str | None = None  # why the scenario does not apply
    png: str | None = None
    intended: Tensor | None = field(default=None, repr=False)  # (T, T) bool, True = may depend
    dependency: Tensor | None = field(default=None, repr=False)  # (T, T) measured max |Δ logits_i| per token j
    offending: list[tuple[int, int]] = field(default_factory=list, repr=False)  # pairs to outline in the picture
    error: bool = False  # the implementation raised instead of answering (detail names the error)

    def cell(self) -> str:
        if self.skipped:
            return "–"
        if self.error:
            return "✗ error"
        return f"{'✓' if self.passed else '✗'} {self.max_deviation:.1e}"

    def to_dict(self) -> dict:
        return {
            "scenario": self.scenario,
            "implementation": self.implementation,
            "passed": self.passed,
            "skipped": self.skipped,
            "detail": self.detail,
            "max_deviation": json_number(self.max_deviation),
            "tolerance": self.tolerance,
            "first": self.first,
            "png": self.png,
        }


@dataclass
class ConformReport(Report):
    """Every scenario under every implementation; ``passed`` is False as soon as one failed."""

    command: ClassVar[str] = "conform"

    model: str
    transformers: str
    dtype: str
    implementations: list[str]
    unavailable: dict[str, str]
    results: list[ConformResult]

    def findings(self) -> list[ConformResult]:
        return self.results

    def subtitle(self) -> str:
        return f"transformers {self.transformers}, {self.dtype}"

    @property
    def scenarios(self) -> list[str]:
        return list(dict.fromkeys(r.scenario for r in self.results))

    def result(self, scenario: str, implementation: str) -> ConformResult:
        for r in self.results:
            if r.scenario == scenario and r.implementation == implementation:
                return r
        raise KeyError(f"no result for scenario {scenario!r} under {implementation!r}")

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "model": self.model,
            "transformers": self.transformers,
            "dtype": self.dtype,
            "implementations": self.implementations,
            "unavailable": self.unavailable,
            "results": [r.to_dict() for r in self.results],
        }

    # -- people ----------------------------------------------------------------------------------
    def rows(self) -> list[list[str]]:
        """The table: a header row, then one row per scenario, one column per implementation."""
        table = [["scenario", *self.implementations]]
        for s in self.scenarios:
            row = [s]
            for impl in self.implementations:
                found = [r for r in self.results if r.scenario == s and r.implementation == impl]
                row.append(found[0].cell() if found else "")
            table.append(row)
        return table

    def _footer(self) -> list[str]:
        lines = []
        for r in self.failures:
            where = _where(r.first)
            png = f" [{r.png}]" if r.png else ""
            lines.append(f"✗ {r.scenario} / {r.implementation}: {r.detail}{where}{png}")
        for name, why in self.unavailable.items():
            lines.append(f"not tested: {name}: {why}")
        n = len(self.failures)
        lines.append("PASSED" if self.passed else f"FAILED: {n} scenario{'s' if n > 1 else ''}")
        return lines

    def to_text(self) -> str:
        """The table in plain text (✓/✗ and the largest deviation; – where a scenario does not apply)."""
        table = self.rows()
        widths = [max(len(row[k]) for row in table) for k in range(len(table[0]))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [fmt.format(*table[0]), "  ".join("─" * w for w in widths)]
        lines += [fmt.format(*row) for row in table[1:]]
        return "\n".join(self.heading() + lines + [""] + self._footer())

    def print_rich(self, console) -> None:
        """The same table through a ``rich.console.Console`` (colours, box drawing)."""
        from rich.table import Table

        table = Table(title=f"{self.title()} ({self.subtitle()})")
        for name in self.rows()[0]:
            table.add_column(name)
        for row in self.rows()[1:]:
            table.add_row(*[_colour(c) for c in row])
        console.print(table)
        for line in self._footer():
            console.print(line, style="red" if line.startswith(("✗", "FAILED")) else None, highlight=False)

    def save_pngs(self, folder: str | Path) -> list[Path]:
        """For each failure with a measured dependency matrix: a PNG of it beside the intended mask
        (offending pairs outlined), named ``<scenario>-<implementation>.png``; sets ``result.png``."""
        from attnmask.viz import save_dependency_png

        out = []
        for r in self.failures:
            if r.dependency is None or r.intended is None:
                continue
            name = re.sub(r"[^A-Za-z0-9]+", "-", f"{r.scenario}-{r.implementation}").strip("-")
            path = save_dependency_png(
                Path(folder) / f"{name}.png",
                r.intended,
                [(f"{r.implementation}: max |Δ logits_i| when token j changes", r.dependency)],
                leaks=r.offending[:200],
                title=f"{r.scenario} / {r.implementation}: FAILED{_where(r.first)}",
            )
            r.png = str(path)
            out.append(path)
        return out


def _where(first: dict | None) -> str:
    if not first:
        return ""
    if "key" in first:
        return f" (first offense: query {first['query']}, key {first['key']})"
    return f" (first offense: token {first['position']})"


def _colour(cell: str) -> str:
    if cell.startswith("✓"):
        return f"[green]{cell}[/green]"
    if cell.startswith("✗"):
        return f"[bold red]{cell}[/bold red]"
    return cell
