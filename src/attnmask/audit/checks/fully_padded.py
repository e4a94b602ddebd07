"""The ``fully padded rows`` check: a row that is all padding gives finite logits (no NaN, no inf)
and does not disturb the real row beside it in the batch.

Encoder-decoders try every combination of a real or all-pad source with a real or all-pad target.
The full forward is checked, and cached decoding too where the model offers it.
"""

from __future__ import annotations

import torch

from attnmask.audit.checks.probe import Probe, as_logits
from attnmask.audit.report import CheckResult

__all__ = ["check_fully_padded_rows"]


@torch.no_grad()
def check_fully_padded_rows(probe: Probe) -> CheckResult:
    subject, T = probe.subject, probe.T
    real_ids = probe.tgt[:1]  # (1, T)
    pad_ids = torch.full_like(real_ids, subject.pad_id)  # (1, T)
    ones, zeros = probe.ones(1, T), torch.zeros_like(real_ids)
    if subject.encoder_decoder:
        src = probe.src[:1]
        src_pad = torch.full_like(src, subject.pad_id)
        s_ones, s_zeros = probe.ones(1, probe.S), torch.zeros_like(src)
        rows = [  # (name, src, src_mask, tgt, tgt_mask)
            ("real source, real target", src, s_ones, real_ids, ones),
            ("real source, padded target", src, s_ones, pad_ids, zeros),
            ("padded source, real target", src_pad, s_zeros, real_ids, ones),
            ("padded source, padded target", src_pad, s_zeros, pad_ids, zeros),
        ]
    else:
        rows = [("real row", None, None, real_ids, ones), ("padded row", None, None, pad_ids, zeros)]
    names = [r[0] for r in rows]
    tgt, tgt_mask = torch.cat([r[3] for r in rows]), torch.cat([r[4] for r in rows])
    src = torch.cat([r[1] for r in rows]) if subject.encoder_decoder else None
    src_mask = torch.cat([r[2] for r in rows]) if subject.encoder_decoder else None
    problems = []
    out = probe.call(tgt, tgt_mask, src, src_mask)  # (R, T, V)
    outputs = [("forward", out)]
    if subject.cached_forward is not None:
        args = (src, src_mask, tgt, tgt_mask) if subject.encoder_decoder else (tgt, tgt_mask)
        outputs.append(("cached", as_logits(subject.cached_forward(*args), tgt.shape).double().cpu()))
    for how, logits in outputs:
        for k, name in enumerate(names):
            if not torch.isfinite(logits[k]).all():
                problems.append(f"{how}: {name}: non-finite logits (NaN/inf)")
    # the padded rows must not disturb the real one next to them. The reference is the real row in a
    # batch of the same shape filled with copies of it, so that only the other rows' contents differ:
    # a batch of one runs other kernels' blockings (oneDNN on an AVX-512 CPU: ~7e-5 on SmolLM2's
    # logits, batched against alone), rounding this check must not mistake for a leak
    R = len(rows)
    same = [torch.cat([x] * R) if x is not None else None for x in (rows[0][3], rows[0][4], rows[0][1], rows[0][2])]
    alone = probe.call(*same)[:1]  # (1, T, V)
    delta = torch.nan_to_num((out[:1] - alone).abs(), nan=float("inf"))
    if (probe.tol.ratio(delta, alone) > 1).any():
        problems.append(
            f"fully padded rows in the batch changed the real row's logits (max |Δ| {float(delta.max()):.3g})"
        )
    return CheckResult(
        "fully padded rows",
        passed=not problems,
        max_deviation=float(delta.max()),
        tolerance=str(probe.tol),
        problems=problems,
        details=[f"{how}: {', '.join(names)}" for how, _ in outputs],
    )
