"""The audit's findings: per-check results, every leak, the first one, as text, JSON and a picture.

Leak coordinates
----------------
A :class:`Leak` ``(i, j)`` says: the output at position ``i`` changed when the input at position
``j`` changed, and it should not have. Both are indices into the sequence the check fed the model:

- ``causality`` / ``gradient``: an unpadded target sequence of the audit's length; ``j > i`` (or,
  with a custom intended mask, any ``(i, j)`` it blocks).
- ``padding``: a padded target sequence; ``i`` is a real token, ``j`` a pad position whose id was
  changed, or ``None`` when the *amount* of padding (pads added vs none) changed output ``i``.
- ``source padding``: ``i`` is a target position, ``j`` a source pad position (or ``None``).

Order: within a check, leaks are sorted by the configuration that found them, in the order the
check tried them (left padding before right, fewer pads first; causality and gradient have one),
then by ``i``, then by ``j`` (``None`` after every position). So the first causality leak is the
lowest ``i`` with the lowest ``j``. :attr:`AuditReport.first_leak` is the first leak of the first
check that found any, checks taken in the order they ran: causality, gradient, padding, source
padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from attnmask.audit.findings import Finding, Report, json_number
from attnmask.errors import UserError

__all__ = ["Leak", "CheckResult", "AuditReport", "LayerReach"]


@dataclass(frozen=True)
class Leak:
    """Output position ``i`` depends on input position ``j`` (``None``: on the padding as a whole)."""

    check: str  # the check that found it
    i: int
    j: int | None
    deviation: float  # max |Δ logits| (or gradient norm) measured
    context: str = ""  # which configuration, e.g. "left padding x3"
    order: int = 0  # index of that configuration within the check (for sorting)

    def sort_key(self) -> tuple:
        return (self.order, self.i, self.j is None, self.j or 0)

    def describe(self) -> str:
        where = f" ({self.context})" if self.context else ""
        if self.check == "causality":
            return f"output {self.i} changes when token {self.j} is replaced{where}: max |Δ| {self.deviation:.3g}"
        if self.check == "gradient":
            return f"output {self.i} has a gradient w.r.t. the embedding of token {self.j}{where}: {self.deviation:.3g}"
        if self.j is None:
            return f"output {self.i} changes with the amount of padding{where}: max |Δ| {self.deviation:.3g}"
        side = "source pad" if self.check == "source padding" else "pad"
        return f"output {self.i} changes with the id written at {side} position {self.j}{where}: {self.deviation:.3g}"

    def to_dict(self) -> dict:
        return {"check": self.check, "i": self.i, "j": self.j, "deviation": self.deviation, "context": self.context}


@dataclass
class CheckResult(Finding):
    """One check: passed, skipped (with the reason), or failed with its leaks and/or problems."""

    name: str
    passed: bool
    max_deviation: float = 0.0  # the largest deviation that should have been zero
    tolerance: str = ""  # how deviations were judged, in words
    leaks: list[Leak] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # failures that are not (i, j) pairs
    details: list[str] = field(default_factory=list)  # what was tried
    skipped: str | None = None  # why the check did not run

    def __post_init__(self):
        self.leaks.sort(key=Leak.sort_key)

    @property
    def first_leak(self) -> Leak | None:
        return self.leaks[0] if self.leaks else None

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "status": self.status,
            "passed": self.passed,
            "max_deviation": json_number(self.max_deviation),
            "tolerance": self.tolerance,
            "n_leaks": len(self.leaks),
            "first_leak": self.first_leak.to_dict() if self.first_leak else None,
            "leaks": [lk.to_dict() for lk in self.leaks],
            "problems": self.problems,
            "details": self.details,
            "skipped": self.skipped,
        }


@dataclass
class LayerReach:
    """How far back one decoder layer, alone, reaches from the last position (the ``layer reach`` check)."""

    layer: int  # index in the decoder stack
    window: int  # declared: 0 = every earlier key, w = the last w keys (the query's own included)
    allowed: int  # how far back the declared mask lets the last position see
    reach: int  # how far back it has a gradient (the farthest earlier key that moves its output)
    beyond: float | None  # max |Δ output| when every key beyond the window is perturbed; None: no such key
    edge: float  # |Δ output| / tolerance when only the oldest allowed key is perturbed
    passed: bool  # reaches exactly as far as it may, and keys beyond its window leave it unchanged
    gradient: Tensor  # (T,) ‖∂(r·output_q)/∂input_j‖ for every key j

    def to_dict(self) -> dict:
        return {
            "layer": self.layer,
            "window": self.window,
            "allowed": self.allowed,
            "reach": self.reach,
            "beyond_deviation": None if self.beyond is None else json_number(self.beyond),
            "edge_ratio": json_number(self.edge),
            "passed": self.passed,
        }


@dataclass
class AuditReport(Report):
    """Everything one audit found. ``passed`` is False as soon as one check failed."""

    command: ClassVar[str] = "audit"

    model: str
    encoder_decoder: bool
    dtype: str
    length: int  # target sequence length T of the causality checks
    src_length: int | None
    seed: int
    checks: list[CheckResult]
    intended: Tensor  # (T, T) bool: the mask the decoder is meant to have (True = may depend)
    dependency: Tensor | None = None  # (T, T) max |Δ logits_i| when token j is replaced
    gradient: Tensor | None = None  # (T, T) max ‖∂(r·logits_i)/∂embeds_j‖
    layer_reach: list[LayerReach] | None = None  # the layer reach check's measurement, one per decoder layer
    notes: list[str] = field(default_factory=list)

    def findings(self) -> list[CheckResult]:
        return self.checks

    def subtitle(self) -> str:
        arch = "encoder-decoder" if self.encoder_decoder else "decoder-only"
        src = f", S={self.src_length}" if self.encoder_decoder else ""
        return f"{arch}, {self.dtype}, T={self.length}{src}, seed {self.seed}"

    @property
    def leaks(self) -> list[Leak]:
        return [lk for c in self.checks for lk in c.leaks]

    @property
    def first_leak(self) -> Leak | None:
        return next((c.first_leak for c in self.checks if c.first_leak is not None), None)

    def check(self, name: str) -> CheckResult:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}; checks are {[c.name for c in self.checks]}")

    # -- machines --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        first = self.first_leak
        return {
            "model": self.model,
            "encoder_decoder": self.encoder_decoder,
            "dtype": self.dtype,
            "length": self.length,
            "src_length": self.src_length,
            "seed": self.seed,
            "passed": self.passed,
            "first_leak": first.to_dict() if first else None,
            "n_leaks": len(self.leaks),
            "checks": [c.to_dict() for c in self.checks],
            "intended": self.intended.int().tolist(),
            "dependency": None if self.dependency is None else _matrix(self.dependency),
            "gradient": None if self.gradient is None else _matrix(self.gradient),
            "layer_reach": None if self.layer_reach is None else [r.to_dict() for r in self.layer_reach],
            "notes": self.notes,
        }

    # -- people ----------------------------------------------------------------------------------
    def to_text(self, max_leaks: int = 10) -> str:
        lines = self.heading()
        width = max(len(c.name) for c in self.checks)
        for c in self.checks:
            if c.skipped:
                summary = f"skipped: {c.skipped}"
            else:
                summary = f"max deviation {c.max_deviation:.3g}"
                if c.tolerance:
                    summary += f" ({c.tolerance})"
                if c.leaks:
                    summary += f"; {len(c.leaks)} leak{'s' if len(c.leaks) > 1 else ''}"
            lines.append(f"  {c.status}  {c.name.ljust(width)}  {summary}")
            for p in c.problems[:max_leaks]:
                lines.append(f"          - {p}")
        lines.append("")
        first = self.first_leak
        if first is not None:
            lines.append(f"first leak: [{first.check}] (i={first.i}, j={first.j}): {first.describe()}")
        for c in self.checks:
            groups: dict[str, list[Leak]] = {}
            for lk in c.leaks:
                groups.setdefault(lk.context, []).append(lk)
            for context, group in groups.items():
                shown = ", ".join(f"({lk.i},{'*' if lk.j is None else lk.j})" for lk in group[:max_leaks])
                more = f" ... and {len(group) - max_leaks} more" if len(group) > max_leaks else ""
                where = f" [{context}]" if context else ""
                lines.append(f"{c.name} leaks (i, j){where}: {shown}{more}")
        if any(lk.j is None for lk in self.leaks):
            lines.append("(i,*): output i changed with the amount of padding itself")
        if self.dependency is not None:
            lines += ["", "measured dependency of output i (rows) on token j (columns):", self.dependency_grid()]
        if self.layer_reach:
            lines += ["", self.reach_table()]
        for note in self.notes:
            lines.append(f"note: {note}")
        lines.append("")
        lines.append("PASSED: no leak found" if self.passed else "FAILED")
        return "\n".join(lines)

    def dependency_grid(self) -> str:
        """``■`` allowed and used, ``·`` blocked and unused, ``✗`` a leak, ``○`` allowed but unused."""
        leaks = {(lk.i, lk.j) for c in self.checks if c.name in ("causality", "gradient") for lk in c.leaks}
        T = self.intended.shape[0]
        width = len(str(T - 1))
        header = " " * width + " │ " + " ".join(str(j).rjust(width) for j in range(T))
        rows = [header, "─" * width + "─┼─" + "─" * ((width + 1) * T - 1)]
        used = self.dependency > 0
        for i in range(T):
            cells = []
            for j in range(T):
                if (i, j) in leaks:
                    c = "✗"
                elif self.intended[i, j]:
                    c = "■" if used[i, j] else "○"
                else:
                    c = "·"
                cells.append(c.rjust(width))
            rows.append(str(i).rjust(width) + " │ " + " ".join(cells))
        rows.append("■ depends (allowed)  ○ allowed, no dependence  · blocked  ✗ LEAK")
        return "\n".join(rows)

    def reach_table(self) -> str:
        """The ``layer reach`` check's table: per decoder layer, its window, how far back it may and does reach."""
        T = len(self.layer_reach[0].gradient)
        header = ["layer", "window", "may reach", "reaches", "|Δ| beyond window", "oldest key moves"]
        body = []
        for r in self.layer_reach:
            verdict = "ok" if r.passed else "✗ FAIL"
            body.append([
                str(r.layer),
                str(r.window) if r.window else "full",
                f"{r.allowed} back",
                f"{r.reach} back",
                "-" if r.beyond is None else f"{r.beyond:.3g}",
                f"{r.edge:.3g}x tol",
                verdict,
            ])  # fmt: skip
        widths = [max(len(row[k]) for row in [header + [""], *body]) for k in range(len(header) + 1)]
        fmt = lambda row: "  " + "  ".join(c.rjust(wd) for c, wd in zip(row, widths)).rstrip()  # noqa: E731
        lines = [f"layer reach: each decoder layer alone, its output at position {T - 1} of T={T}:"]
        lines += [fmt(header + [""]), *(fmt(row) for row in body)]
        return "\n".join(lines)

    def save_reach_png(self, path: str | Path) -> Path:
        """The layer reach check's measurement: a row per decoder layer, its gradient on every key."""
        if not self.layer_reach:
            raise UserError("no layer reach was measured: run the audit with the layer reach check")
        verdict = "PASSED" if self.check("layer reach").passed else "FAILED"
        return _save_reach_png(path, self.layer_reach, f"{self.model}: layer reach {verdict}")

    def save_png(self, path: str | Path) -> Path:
        """The intended mask next to the measured dependency matrices (leaks outlined)."""
        from attnmask.viz import save_dependency_png

        measured = []
        if self.dependency is not None:
            measured.append(("perturbation: max |Δ logits_i|", self.dependency))
        if self.gradient is not None:
            measured.append(("gradient: ‖∂ logits_i / ∂ embed_j‖", self.gradient))
        leaks = [(lk.i, lk.j) for c in self.checks if c.name in ("causality", "gradient") for lk in c.leaks]
        verdict = "PASSED" if self.passed else f"FAILED ({len(self.leaks)} leaks)"
        return save_dependency_png(path, self.intended, measured, leaks=leaks, title=f"{self.model}: {verdict}")


def _save_reach_png(path: str | Path, rows: list[LayerReach], title: str) -> Path:
    """Each decoder layer's gradient on every key (a row per layer, log scale, zeros blank), the first
    key its window lets it see marked, keys beyond its window that it reaches outlined in red."""
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    from attnmask.viz import _save

    grad = torch.stack([r.gradient for r in rows]).double()  # (L, T)
    L, T = grad.shape
    q = T - 1
    fig = Figure(figsize=(min(16.0, 4.0 + T / 40), 1.5 + 0.3 * L))
    ax = fig.subplots()
    values = grad.numpy().copy()
    positive = values[values > 0]
    values[values <= 0] = float("nan")  # exact independence: blank
    if positive.size:
        norm = LogNorm(vmin=max(positive.min(), positive.max() * 1e-12), vmax=positive.max())
        img = ax.imshow(values, cmap="viridis", norm=norm, aspect="auto", interpolation="nearest")
        fig.colorbar(img, ax=ax, fraction=0.03, pad=0.02, label="‖∂ output_q / ∂ input_j‖")
    for y, r in enumerate(rows):
        first = q - r.allowed  # the oldest key the declared mask lets q see
        if r.window:
            ax.plot([first - 0.5, first - 0.5], [y - 0.5, y + 0.5], color="black", lw=2)
        if r.reach > r.allowed:  # reached keys beyond the window
            far = q - r.reach
            ax.add_patch(Rectangle((far - 0.5, y - 0.5), first - far, 1, fill=False, edgecolor="red", lw=1.5))
    ax.set_yticks(range(L), [f"{r.layer} ({r.window if r.window else 'full'})" for r in rows], fontsize=7)
    ax.set_ylabel("decoder layer (window)")
    ax.set_xlabel(f"input key j (output at q = {q}; black bar: the oldest key a window allows)")
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def _matrix(t: Tensor) -> list[list[float]]:
    return [[float(f"{v:.4g}") for v in row] for row in t.to(torch.float64).tolist()]
