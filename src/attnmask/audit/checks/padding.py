"""Padding invariance: the ``padding`` check (target) and ``source padding`` (encoder-decoder).

``padding``
    Real tokens padded on the left and/or right (the sides the model handles, ``Subject.pad_sides``):
    their logits must equal the unpadded ones (leak ``(i, None)``), and must not change when other
    ids are written in the pad positions (leak ``(i, j)``, j the pad position).
``source padding``
    The same for the source: every target output against the amount of source padding (on the
    sides in ``Subject.src_pad_sides``) and the ids in the source pads.

Both judge deviations by the dtype's ``"unchanged"`` tolerance and try each pad amount below the
length, left before right, fewer pads first: the order leaks are reported in.
"""

from __future__ import annotations

import torch

from attnmask.audit.checks.probe import Probe
from attnmask.audit.report import CheckResult, Leak

__all__ = ["check_padding", "check_source_padding"]


def check_padding(probe: Probe) -> CheckResult:
    T, N = probe.T, probe.N
    configs = [(side, p) for side in ("left", "right") if side in probe.subject.pad_sides for p in probe.pad_amounts]
    configs = [(side, p) for side, p in configs if p < T]
    if not configs:
        return CheckResult("padding", passed=True, skipped=f"no pad amount below the length {T}")
    run_src = probe.run_target
    leaks, details, worst = [], [], 0.0
    for order, (side, p) in enumerate(configs):
        context = f"{side} padding x{p}"
        real = probe.tgt[:, : T - p]  # (N, L)
        padded, mask, real_idx = probe.pad(real, p, side)  # (N, T), (N, T), (L,)
        pad_idx = [j for j in range(T) if j not in set(real_idx.tolist())]
        owner = torch.arange(N, device=probe.device)
        # 1. the amount of padding: padded vs unpadded, at the real positions
        ref = run_src(real, owner, probe.ones(N, real.shape[1]))  # (N, L, V)
        out = run_src(padded, owner, mask)[:, real_idx]  # (N, L, V)
        delta = torch.nan_to_num((out - ref).abs(), nan=float("inf"))
        dev_amount = delta.amax(dim=(0, 2))  # (L,)
        bad = probe.tol.ratio(delta, ref).amax(dim=(0, 2)) > 1  # (L,)
        leaks += [
            Leak("padding", int(real_idx[k]), None, float(dev_amount[k]), context, order)
            for k in bad.nonzero().flatten().tolist()
        ]
        # 2. the ids written in pad positions
        dev, ratio = probe.sensitivity(
            lambda rows, own, m=mask: run_src(rows, own, m[own]), padded, pad_idx, probe.allowed, probe.tol
        )  # (T, p)
        dev, ratio = dev[real_idx], ratio[real_idx]  # (L, p)
        leaks += [
            Leak("padding", int(real_idx[k]), pad_idx[c], float(dev[k, c]), context, order)
            for k, c in (ratio > 1).nonzero().tolist()
        ]
        worst = max(worst, float(dev_amount.max()), float(dev.max()))
        details.append(f"{context}: amount and {probe.K} other ids at each pad")
    return CheckResult(
        "padding", passed=not leaks, max_deviation=worst, tolerance=str(probe.tol), leaks=leaks, details=details
    )


def check_source_padding(probe: Probe) -> CheckResult:
    T, S, N = probe.T, probe.S, probe.N
    configs = [(side, p) for side in ("left", "right") for p in probe.pad_amounts if p < S]
    if not configs:
        return CheckResult("source padding", passed=True, skipped=f"no pad amount below the source length {S}")
    tgt_mask = probe.ones(N, T)
    leaks, details, worst = [], [], 0.0
    for order, (side, p) in enumerate(configs):
        context = f"source {side} padding x{p}"
        real = probe.src[:, : S - p]  # (N, Ls)
        padded, mask, real_idx = probe.pad(real, p, side)  # (N, S), (N, S), (Ls,)
        pad_idx = [j for j in range(S) if j not in set(real_idx.tolist())]
        if side in probe.subject.src_pad_sides:
            ref = probe.call(probe.tgt, tgt_mask, real, probe.ones(N, real.shape[1]))  # (N, T, V)
            out = probe.call(probe.tgt, tgt_mask, padded, mask)  # (N, T, V)
            delta = torch.nan_to_num((out - ref).abs(), nan=float("inf"))
            dev_amount = delta.amax(dim=(0, 2))  # (T,)
            bad = probe.tol.ratio(delta, ref).amax(dim=(0, 2)) > 1  # (T,)
            leaks += [
                Leak("source padding", i, None, float(dev_amount[i]), context, order)
                for i in bad.nonzero().flatten().tolist()
            ]
            worst = max(worst, float(dev_amount.max()))
            what = "amount and"
        else:
            what = "(amount not checked: the model numbers source positions from 0)"

        def run(rows, own, m=mask):
            return probe.call(probe.tgt[own], probe.ones(len(rows), T), rows, m[own])

        dev, ratio = probe.sensitivity(run, padded, pad_idx, probe.src_allowed, probe.tol)  # (T, p)
        leaks += [
            Leak("source padding", i, pad_idx[c], float(dev[i, c]), context, order)
            for i, c in (ratio > 1).nonzero().tolist()
        ]
        worst = max(worst, float(dev.max()))
        details.append(f"{context}: {what} {probe.K} other ids at each source pad")
    return CheckResult(
        "source padding",
        passed=not leaks,
        max_deviation=worst,
        tolerance=str(probe.tol),
        leaks=leaks,
        details=details,
    )
