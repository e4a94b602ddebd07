"""What the leak-audit tests share: the audited length, ways to read a report, a model with no attention."""

from __future__ import annotations

import torch

T = 10  # target length of most audits here
FUTURE = {(i, j) for i in range(T) for j in range(T) if j > i}  # every pair the look-ahead mask blocks
V = 11  # vocabulary of the callable models


def statuses(report) -> dict[str, str]:
    return {c.name: c.status for c in report.checks}


def pairs(report, check: str) -> set[tuple[int, int | None]]:
    return {(lk.i, lk.j) for lk in report.check(check).leaks}


def first(report) -> tuple:
    lk = report.first_leak
    return (lk.check, lk.i, lk.j, lk.context) if lk else None


def bag_of_words(reverse: bool = False):
    """A causal model with no attention at all: logits_i = W · (count of each id in 0..i)."""
    w = torch.randn(V, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def forward(ids, attention_mask=None):
        onehot = torch.nn.functional.one_hot(ids, V).double()  # (B, T, V)
        if attention_mask is not None:
            onehot = onehot * attention_mask[..., None]
        counts = onehot.flip(1).cumsum(1).flip(1) if reverse else onehot.cumsum(1)  # (B, T, V)
        return counts @ w  # (B, T, V)

    return forward
