"""The ``causality`` check: no output moves when a token the intended mask blocks is replaced.

For random sequences of length T, every token j is replaced by several random tokens in turn;
``D[i, j] = max |Δ logits_i|``. A pair the intended mask blocks (``j > i`` for the look-ahead mask)
with a deviation beyond the dtype's ``"unchanged"`` tolerance is a leak. ``D`` is kept for the
report (its grid and picture); allowed pairs with no dependence at all are noted, not failed.

Measured through the full forward and, where the model offers one (``Subject.cached_forward``),
through the path it generates with, token by token over its cache (for an attnmask Transformer: the
packed step that :mod:`attnmask.decode` and the serving engine run): a blocked pair that moves on
either path is a leak. ``D`` (the grid, the notes) is the full forward's.
"""

from __future__ import annotations

import torch

from attnmask.audit.checks.probe import Probe
from attnmask.audit.report import CheckResult, Leak

__all__ = ["check_causality"]


def check_causality(probe: Probe) -> CheckResult:
    T = probe.T

    def run(rows, owner, cached=False):
        return probe.run_target(rows, owner, probe.ones(len(rows), T), cached=cached)

    dev, ratio = probe.sensitivity(run, probe.tgt, range(T), probe.allowed, probe.tol)  # (T, T)
    probe.dependency = dev.float()
    paths = "the full forward"
    worst = dev
    if probe.subject.cached_forward is not None:
        run_cached = lambda rows, owner: run(rows, owner, cached=True)  # noqa: E731
        dev_c, ratio_c = probe.sensitivity(run_cached, probe.tgt, range(T), probe.allowed, probe.tol)  # (T, T)
        worst, ratio = torch.maximum(dev, dev_c), torch.maximum(ratio, ratio_c)
        paths += " and token by token over the cache (the generation path)"
    blocked = ~probe.intended
    leaks = [Leak("causality", i, j, float(worst[i, j])) for i, j in ((ratio > 1) & blocked).nonzero().tolist()]
    unused = int((probe.intended & (dev == 0)).sum())
    if unused:
        probe.notes.append(
            f"{unused} allowed (i, j) pairs showed no dependence at all: the model may mask more than "
            "intended (e.g. a token that cannot see itself)"
        )
    n_rows = probe.N * T * probe.K
    return CheckResult(
        "causality",
        passed=not leaks,
        max_deviation=float(worst[blocked].max()) if blocked.any() else 0.0,
        tolerance=str(probe.tol),
        leaks=leaks,
        details=[
            f"{probe.N} sequences x {T} positions x {probe.K} replacement tokens = {n_rows} perturbed rows",
            f"measured through {paths}",
        ],
    )
