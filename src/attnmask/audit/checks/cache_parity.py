"""The ``cache parity`` check: logits decoded token by token with a KV cache equal the full forward.

Compared at the real positions of each batch: unpadded, padded on each side the model handles,
and (encoder-decoder) with the source right-padded; and, for a model the serving engine runs, its
packed step over a paged cache (the sequences together, prompts in chunks of 3). Two computations
of the same logits, so the tolerance is the dtype's ``"unchanged"`` one (user overrides included) times
:data:`~attnmask.audit.tolerance.CACHE_TOLERANCE_FACTOR`. Skipped for a model that offers no cached
decoding (``Subject.cached_forward``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnmask.audit.checks.probe import Probe, as_logits
from attnmask.audit.report import CheckResult
from attnmask.audit.tolerance import CACHE_TOLERANCE_FACTOR

__all__ = ["check_cache_parity"]


def _variants(probe: Probe) -> list[tuple[str, Tensor, Tensor, Tensor | None, Tensor | None]]:
    """Batches ``(name, ids, mask, src, src_mask)``: unpadded, and padded on each supported side (and source right)."""
    T, S, N = probe.T, probe.S, probe.N
    enc_dec = probe.subject.encoder_decoder
    p = max([a for a in probe.pad_amounts if a < T], default=0)
    src, src_mask = (probe.src, probe.ones(N, S)) if enc_dec else (None, None)
    out = [("no padding", probe.tgt, probe.ones(N, T), src, src_mask)]
    for side in probe.subject.pad_sides if p else ():
        ids, mask, _ = probe.pad(probe.tgt[:, : T - p], p, side)
        out.append((f"{side} padding x{p}", ids, mask, src, src_mask))
    ps = max([a for a in probe.pad_amounts if a < S], default=0)
    if enc_dec and ps:
        padded, mask, _ = probe.pad(probe.src[:, : S - ps], ps, "right")
        out.append((f"source right padding x{ps}", probe.tgt, probe.ones(N, T), padded, mask))
    return out


@torch.no_grad()
def check_cache_parity(probe: Probe) -> CheckResult:
    subject = probe.subject
    if subject.cached_forward is None:
        return CheckResult("cache parity", passed=True, skipped="the model offers no KV-cache decoding")
    tol = probe.tol.scaled(CACHE_TOLERANCE_FACTOR)
    problems, details, worst = [], [], 0.0
    for name, ids, mask, src, src_mask in _variants(probe):
        full = probe.call(ids, mask, src, src_mask)  # (N, T, V)
        args = (src, src_mask, ids, mask) if subject.encoder_decoder else (ids, mask)
        cached = as_logits(subject.cached_forward(*args), ids.shape).double().cpu()  # (N, T, V)
        real = mask.bool().cpu()  # (N, T)
        delta = torch.nan_to_num((cached - full).abs(), nan=float("inf"))[real]  # (R, V)
        ratio = tol.ratio(delta, full[real]).amax(-1)  # (R,)
        positions = real.nonzero()[:, 1]  # (R,)
        worst = max(worst, float(delta.max()))
        if (ratio > 1).any():
            first = int(positions[(ratio > 1).nonzero()[0, 0]])
            problems.append(
                f"{name}: cached logits differ from the full forward at {int((ratio > 1).sum())} real positions "
                f"(first at position {first}, max |Δ| {float(delta.max()):.3g})"
            )
        details.append(name)
    if subject.packed_forward is not None:
        full = probe.call(probe.tgt, probe.ones(probe.N, probe.T), None, None)  # (N, T, V)
        packed = torch.stack(subject.packed_forward(probe.tgt.tolist(), 3)).double().cpu()  # (N, T, V)
        delta = torch.nan_to_num((packed - full).abs(), nan=float("inf"))
        ratio = tol.ratio(delta, full).amax(-1)  # (N, T)
        worst = max(worst, float(delta.max()))
        if (ratio > 1).any():
            first = int((ratio > 1).nonzero()[0, 1])
            problems.append(
                f"packed step (paged cache): logits differ from the full forward at {int((ratio > 1).sum())} "
                f"positions (first at position {first}, max |Δ| {float(delta.max()):.3g})"
            )
        details.append("packed step (paged cache, chunks of 3)")
    return CheckResult(
        "cache parity",
        passed=not problems,
        max_deviation=worst,
        tolerance=str(tol),
        problems=problems,
        details=details,
    )
