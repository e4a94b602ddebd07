"""Conformance: every mask scenario under every attention implementation of a Hugging Face model.

:func:`conform` switches a model through the attention implementations transformers offers for it
(``eager``, ``sdpa``, ``flex_attention``, ``flash_attention_*`` when importable, and any the user
registered with ``AttentionInterface.register``) and runs the same scenarios under each:

``causality``
    The leak audit's perturbation check: output i must not move when a token j > i changes.
``sliding window``
    For models with a window on every layer: no token further back than the model's reach
    (``sum(W - 1)`` over layers) influences an output, and every token within it does.
``layer reach``
    For models with a window on some layer: each decoder layer measured alone inside the model's
    forward (:mod:`~attnmask.audit.conform.reach`): a sliding layer's last output does not move when
    keys W or more back change and does when the key W - 1 back changes; a full layer's moves with both.
``left padding`` / ``right padding``
    3 pads on one side: real outputs equal the unpadded sequence's, and no real output moves
    when the ids in the pads change.
``fully padded rows``
    A row that is all padding gives finite logits and leaves the other rows alone.
``packed (no mask)`` / ``packed (all-ones mask)``
    Three samples in one row, given as restarting ``position_ids``, with ``attention_mask=None``
    or all ones: no output moves when a token of another sample changes, and each sample's
    outputs equal those it gets alone.
``cache parity``
    Logits decoded token by token with ``past_key_values`` equal the full forward (no padding,
    and left padding).
``batched greedy``
    Greedy decoding of three prompts of different lengths, left-padded in one batch, gives the
    tokens (and logits) each prompt gets alone.
``implementations agree``
    Logits of a left-padded batch equal the first implementation's (``eager``).
``float64 reference``
    ... and equal attnmask's float64 Transformer holding the same weights, where attnmask can
    build the architecture (:func:`~attnmask.audit.conform.models.reference_model`).

Encoder-decoder models get ``causality`` and ``right padding`` of the decoder, ``source
padding``, ``fully padded rows``, and the two comparisons; the decoder-only scenarios are listed
as not applicable.

Tolerances (:mod:`attnmask.audit.tolerance`): a perturbation that must change nothing is judged
by the ``"unchanged"`` tolerance for the dtype, as in the leak audit; two computations that should
agree (padded vs not, cached vs not, batched vs alone, implementations against each other and
against the float64 reference) by the ``"agreement"`` one, :data:`AGREEMENT_TOLERANCE` (relative to
the largest logit of the row: float32 ``1e-4 + 1e-4 max``: SmolLM2's rounding through 30 layers, up
to 4.7e-4 with logits up to ~30, stays within it; a masking error moves logits by 1e-1 and more).
"""

from __future__ import annotations

from collections.abc import Sequence

from attnmask.audit.conform.models import implementations as discover
from attnmask.audit.conform.models import set_implementation
from attnmask.audit.conform.report import ConformReport, ConformResult
from attnmask.audit.conform.scenarios import SCENARIOS, Suite
from attnmask.audit.tolerance import AGREEMENT_TOLERANCE
from attnmask.errors import UserError, UserTypeError

__all__ = ["conform", "SCENARIOS", "AGREEMENT_TOLERANCE"]


def conform(
    model,
    implementations: Sequence[str] | None = None,
    *,
    scenarios: Sequence[str] | None = None,
    length: int = 12,
    seed: int = 0,
    png_dir=None,
    name: str | None = None,
) -> ConformReport:
    """Run the conformance suite (see the module docstring) on a Hugging Face model.

    Args:
        model: a loaded ``transformers`` ``PreTrainedModel`` with an LM head (decoder-only or
            encoder-decoder); put in eval mode; its attention implementation is restored after.
        implementations: names to test; None = every one ``AttentionInterface`` knows that the
            model accepts (the others are listed in ``report.unavailable``).
        scenarios: a subset of :data:`SCENARIOS` (default all).
        length: tokens per audited sequence (raised to cover a sliding window's reach).
        seed: seeds every random token.
        png_dir: where to draw one PNG per failure (dependency matrix beside the intended mask).

    Returns:
        a :class:`ConformReport`; ``report.passed`` / ``report.exit_code`` gate CI.

    Raises:
        TypeError: not a transformers model. ValueError: an unknown or unavailable implementation,
            an unknown scenario, a length below 8.
    """
    import transformers

    if not isinstance(model, transformers.PreTrainedModel):
        raise UserTypeError(f"conform needs a transformers PreTrainedModel, got {type(model).__name__}")
    wanted = list(SCENARIOS) if scenarios is None else list(scenarios)
    unknown = [s for s in wanted if s not in SCENARIOS]
    if unknown:
        raise UserError(f"unknown scenarios {unknown}; expected some of {list(SCENARIOS)}")
    if not isinstance(length, int) or length < 8:
        raise UserError(f"conform length must be an int >= 8, got {length!r}")
    model.eval()
    usable, unavailable = discover(model, implementations)
    if not usable:
        raise UserError(f"no attention implementation of {type(model).__name__} can run here: {unavailable}")
    suite = Suite(model, length=length, seed=seed)
    original = model.config._attn_implementation
    results: list[ConformResult] = []
    try:
        for impl in usable:
            set_implementation(model, impl)
            results += suite.run(impl, wanted)
    finally:
        model.set_attn_implementation(original)
    order = {s: k for k, s in enumerate(SCENARIOS)}
    results.sort(key=lambda r: (order[r.scenario], usable.index(r.implementation)))
    dtype = next(model.parameters()).dtype
    report = ConformReport(
        model=name or type(model).__name__,
        transformers=transformers.__version__,
        dtype=str(dtype).removeprefix("torch."),
        implementations=usable,
        unavailable=unavailable,
        results=results,
    )
    if png_dir is not None:
        report.save_pngs(png_dir)
    return report
