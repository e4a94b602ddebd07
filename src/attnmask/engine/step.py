"""The engine's step: :func:`attnmask.decode.step.packed_forward`, the one forward step over a packed batch
that every decoding path runs (each scheduled sequence a prefill chunk or one decode token at its own
cache offset, ``document & causal`` with per-sequence offsets lowered to the native ``paged_attend``,
the whole step one native ``packed_step`` call where :func:`fused_plan` allows). See
:mod:`attnmask.decode.step` for the step and its batch invariance."""

from attnmask.decode.step import (
    SourceMemory,
    check_servable,
    fused_plan,
    packed_forward,
    packed_mask,
    prepare_screen,
    screened_head,
    slots_of,
)

__all__ = [
    "SourceMemory",
    "check_servable",
    "fused_plan",
    "packed_forward",
    "packed_mask",
    "prepare_screen",
    "screened_head",
    "slots_of",
]
