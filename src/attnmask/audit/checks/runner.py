""":func:`audit`: run the checks on one model, in order, and gather what they found in one report."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from attnmask import masks
from attnmask.audit.checks.cache_parity import check_cache_parity
from attnmask.audit.checks.causality import check_causality
from attnmask.audit.checks.cross_request import check_cross_request
from attnmask.audit.checks.fully_padded import check_fully_padded_rows
from attnmask.audit.checks.gradient import check_gradient
from attnmask.audit.checks.layer_reach import check_layer_reach
from attnmask.audit.checks.padding import check_padding, check_source_padding
from attnmask.audit.checks.probe import Probe
from attnmask.audit.report import AuditReport, CheckResult
from attnmask.audit.subjects import as_subject
from attnmask.errors import UserError

__all__ = ["audit", "CHECKS"]

# every check, in the order it runs and reports
_CHECKS: dict[str, Callable[[Probe], CheckResult]] = {
    "causality": check_causality,
    "gradient": check_gradient,
    "padding": check_padding,
    "source padding": check_source_padding,  # encoder-decoders only
    "cache parity": check_cache_parity,
    "fully padded rows": check_fully_padded_rows,
    "cross-request": check_cross_request,  # decoder-only attnmask models: the serving engine's packed step
    "layer reach": check_layer_reach,  # decoder-only: each decoder layer alone against its own window
}
CHECKS = tuple(_CHECKS)


def audit(
    model,
    *,
    length: int = 12,
    src_length: int = 10,
    seed: int = 0,
    n_sequences: int = 2,
    n_replacements: int = 3,
    pad_amounts: Sequence[int] = (1, 3),
    intended: masks.Mask | Tensor | None = None,
    checks: Sequence[str] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    chunk_size: int = 64,
    **subject_kwargs,
) -> AuditReport:
    """Audit ``model`` for leaks (see :mod:`attnmask.audit.checks` for the checks).

    Args:
        model: an attnmask Transformer, a run directory, a Hugging Face model, a
            :class:`~attnmask.audit.subjects.Subject`, or a callable ``(input_ids, attention_mask)
            -> logits`` (then pass ``vocab_size=``, and ``encoder_decoder=True`` for a callable
            ``(src_ids, src_mask, tgt_ids, tgt_mask) -> logits``).
        length: target length T of the audited sequences; src_length: source length S.
        seed: seeds every random token; the same seed gives the same report.
        n_sequences: random base sequences; n_replacements: random tokens tried per position.
        pad_amounts: numbers of pad tokens tried on each side (each < T, resp. < S).
        intended: the decoder self-attention the model is meant to have, as a mask (True = may
            depend) or a ``(T, T)`` bool tensor; default the look-ahead mask ``masks.causal()``.
        checks: a subset of :data:`CHECKS` to run (default all that apply).
        rtol, atol: override the dtype's tolerance.
        chunk_size: most rows per forward call.
        subject_kwargs: passed to :func:`~attnmask.audit.subjects.as_subject`.

    Returns:
        an :class:`AuditReport`; ``report.passed`` / ``report.exit_code`` gate CI.

    Raises:
        ValueError: sizes the model cannot take, or an unknown check name.
    """
    subject = as_subject(model, **subject_kwargs)
    probe = Probe(
        subject,
        length=length,
        src_length=src_length,
        seed=seed,
        n_sequences=n_sequences,
        n_replacements=n_replacements,
        pad_amounts=pad_amounts,
        intended=intended,
        rtol=rtol,
        atol=atol,
        chunk_size=chunk_size,
    )
    if checks is not None:
        unknown = [c for c in checks if c not in CHECKS]
        if unknown:
            raise UserError(f"unknown audit checks {unknown}; expected some of {list(CHECKS)}")
    wanted = [c for c in CHECKS if checks is None or c in checks]
    if not subject.encoder_decoder and "source padding" in wanted:
        wanted.remove("source padding")
    results = [_CHECKS[name](probe) for name in wanted]
    return AuditReport(
        model=subject.name,
        encoder_decoder=subject.encoder_decoder,
        dtype=str(probe.dtype).removeprefix("torch."),
        length=probe.T,
        src_length=probe.S if subject.encoder_decoder else None,
        seed=probe.seed,
        checks=results,
        intended=probe.intended,
        dependency=probe.dependency,
        gradient=probe.gradient,
        layer_reach=probe.layer_reach,
        notes=probe.notes,
    )
