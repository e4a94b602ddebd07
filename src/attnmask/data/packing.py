"""Next-token batches of whole conversations: padded (one a row) or packed (several a row, no padding).

Each example is ``ids`` with a per-token ``targets`` flag (:class:`attnmask.data.chat.ChatExample`):
the model reads ``ids[:-1]`` and is scored on ``ids[1:]`` where the predicted token is a target
(``IGNORE_INDEX`` elsewhere). A packed row lays examples back to back, numbered in ``segments``
(0, 1, ... in order; :data:`PAD_SEGMENT` on the padded tail), so that a decoder-only model keeps
them apart with ``causal() & document(segments)`` and positions restarting per example
(:meth:`attnmask.model.Transformer.forward` with ``segments``): the same loss and gradients as the
padded batch of the same examples, without computing the padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attnmask.data.collate import IGNORE_INDEX, PAD_SEGMENT, _BatchMixin, _pad_rows
from attnmask.errors import UserError


@dataclass(frozen=True)
class PackedLMBatch(_BatchMixin):
    """Next-token batch of several examples per row.

    Attributes:
        inputs: (B, T) ids the model reads.
        segments: (B, T) example index of every position within its row; PAD_SEGMENT on the tail.
        labels: (B, T) next token where it is a target, IGNORE_INDEX elsewhere.
    """

    inputs: torch.Tensor
    segments: torch.Tensor
    labels: torch.Tensor

    @property
    def padding_fraction(self) -> float:
        """Share of positions in a padded tail (0 = no wasted compute)."""
        return int((self.segments == PAD_SEGMENT).sum()) / max(self.segments.numel(), 1)


def _inputs_and_labels(ids: Sequence[int], targets: Sequence[bool]) -> tuple[list[int], list[int]]:
    if len(ids) < 2 or len(targets) != len(ids):
        raise UserError(f"an example has {len(ids)} ids and {len(targets)} target flags; expected >= 2 of each, equal")
    labels = [t if keep else IGNORE_INDEX for t, keep in zip(ids[1:], targets[1:])]
    return list(ids[:-1]), labels


def example_length(ids: Sequence[int]) -> int:
    """Positions an example takes in a batch row (its ids but the last)."""
    return len(ids) - 1


def make_packed_lm_batch(rows: Sequence[Sequence[int]], examples: Sequence, *, pad_id: int) -> PackedLMBatch:
    """Pack ``examples[i]`` for ``i`` in ``rows[b]`` into row ``b`` (each with ``.ids`` and ``.targets``).

    Raises:
        ValueError: the batch or a row is empty, an index is out of range, or an example is too short.
    """
    if not rows or not all(rows):
        raise UserError("cannot build a packed batch with no rows or an empty row; expected examples in every row")
    inputs, segs, labs = [], [], []
    for row in rows:
        x_row, s_row, y_row = [], [], []
        for k, i in enumerate(row):
            if not 0 <= i < len(examples):
                raise UserError(f"example index {i} out of range for {len(examples)} examples")
            x, y = _inputs_and_labels(examples[i].ids, examples[i].targets)
            x_row += x
            y_row += y
            s_row += [k] * len(x)
        inputs.append(x_row)
        segs.append(s_row)
        labs.append(y_row)
    x, _ = _pad_rows(inputs, pad_id)  # (B, T)
    s, _ = _pad_rows(segs, PAD_SEGMENT)  # (B, T)
    y, _ = _pad_rows(labs, IGNORE_INDEX)  # (B, T)
    return PackedLMBatch(inputs=x, segments=s, labels=y)


def make_padded_lm_batch(examples: Sequence, *, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One example a row, right-padded: ``(inputs (B, T), labels (B, T), lengths (B,))``; the
    reference the packed batch is checked against, and a plain batch for evaluation."""
    if not examples:
        raise UserError("cannot build an empty batch; expected at least one example")
    pairs = [_inputs_and_labels(ex.ids, ex.targets) for ex in examples]
    x, lengths = _pad_rows([p[0] for p in pairs], pad_id)  # (B, T), (B,)
    y, _ = _pad_rows([p[1] for p in pairs], IGNORE_INDEX)  # (B, T)
    return x, y, lengths
