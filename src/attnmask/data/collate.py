"""Reading text corpora and turning token ids into padded training batches.

Conventions:
- Files are UTF-8; a ``.gz`` suffix means gzip and is read transparently. Problems a user can fix
  (empty file, bad bytes, misaligned parallel files) raise :class:`DataError` naming the file.
- Padding is on the right. Inputs are padded with ``pad_id``; labels are padded with
  :data:`IGNORE_INDEX` (-100, what ``torch.nn.functional.cross_entropy`` ignores by default).
- Lengths tensors count real (non-pad) positions of each row; masks are built from them elsewhere
  (:mod:`attnmask.masks`), never from comparing ids with ``pad_id``.

Samplers that decide *which* examples form a batch live in :mod:`attnmask.data.samplers`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from attnmask.errors import UserError

IGNORE_INDEX = -100  # label of a position the loss skips (what F.cross_entropy ignores by default)


class _BatchMixin:
    """``.to(device)`` and the loss's token count for dataclasses of tensors with ``labels``."""

    labels: torch.Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False):
        """A copy with every tensor moved to ``device``."""
        return type(self)(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)})

    def to_device(self, device: torch.device):
        """A copy on ``device``; for CUDA through pinned memory with an asynchronous copy, so that a
        batch built on a background thread overlaps the step running on the GPU."""
        if device.type != "cuda":
            return self.to(device)
        pinned = type(self)(**{f.name: getattr(self, f.name).pin_memory() for f in fields(self)})
        return pinned.to(device, non_blocking=True)

    @property
    def num_tokens(self) -> int:
        """Positions the loss is computed over (``labels != IGNORE_INDEX``)."""
        return int((self.labels != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class TranslationBatch(_BatchMixin):
    """A teacher-forcing batch for an encoder-decoder model (all tensors long, right padded).

    Attributes:
        src: (B, S) source ids followed by ``<eos>``, padded with ``pad_id``.
        src_lengths: (B,) real length of each ``src`` row (``<eos>`` included).
        tgt_in: (B, T) decoder input: ``<sos>`` then the target, padded with ``pad_id``.
        tgt_lengths: (B,) real length of each ``tgt_in`` row (= target length + 1).
        labels: (B, T) what each decoder position must predict: the target then ``<eos>``,
            padded with ``IGNORE_INDEX``. ``labels[:, t]`` is the token after ``tgt_in[:, t]``.
    """

    src: torch.Tensor
    src_lengths: torch.Tensor
    tgt_in: torch.Tensor
    tgt_lengths: torch.Tensor
    labels: torch.Tensor

    @property
    def padding_fraction(self) -> float:
        """Fraction of ``src`` and ``tgt_in`` slots that are padding (0 = no wasted compute)."""
        slots = self.src.numel() + self.tgt_in.numel()
        real = int(self.src_lengths.sum()) + int(self.tgt_lengths.sum())
        return 1.0 - real / slots


@dataclass(frozen=True)
class LMBatch(_BatchMixin):
    """A next-token-prediction batch for a decoder-only model (all tensors long, right padded).

    Attributes:
        input_ids: (B, T) ``seq[:-1]`` of each sequence, padded with ``pad_id``.
        lengths: (B,) real length of each ``input_ids`` row.
        labels: (B, T) ``seq[1:]``, padded with ``IGNORE_INDEX``.
    """

    input_ids: torch.Tensor
    lengths: torch.Tensor
    labels: torch.Tensor


def _pad_rows(rows: Sequence[Sequence[int]], fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``rows`` with ``fill``: returns ids (B, max_len) and lengths (B,)."""
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.long)  # (B,)
    out = torch.full((len(rows), int(lengths.max())), fill, dtype=torch.long)  # (B, max_len)
    for b, row in enumerate(rows):
        out[b, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out, lengths


def make_translation_batch(
    src_ids: Sequence[Sequence[int]],
    tgt_ids: Sequence[Sequence[int]],
    *,
    pad_id: int,
    sos_id: int,
    eos_id: int,
) -> TranslationBatch:
    """The one place that builds teacher-forcing batches; see :class:`TranslationBatch`.

    For a target ``y1 y2``: ``tgt_in = <sos> y1 y2`` and ``labels = y1 y2 <eos>``.

    Every source gets ``<eos>`` appended: the encoder then sees an explicit end marker (as in
    fairseq and the original Transformer setup), and an empty source still has one position to
    attend to, so no attention row is fully masked. Ids must not include specials already.

    Raises:
        ValueError: ``src_ids`` and ``tgt_ids`` differ in length, or the batch is empty.
    """
    if len(src_ids) != len(tgt_ids):
        raise UserError(f"got {len(src_ids)} source and {len(tgt_ids)} target sequences; expected equal numbers")
    if not src_ids:
        raise UserError("cannot build an empty batch; expected at least one sequence pair")
    src, src_lengths = _pad_rows([list(s) + [eos_id] for s in src_ids], pad_id)  # (B, S), (B,)
    tgt_in, tgt_lengths = _pad_rows([[sos_id] + list(t) for t in tgt_ids], pad_id)  # (B, T), (B,)
    labels, _ = _pad_rows([list(t) + [eos_id] for t in tgt_ids], IGNORE_INDEX)  # (B, T)
    return TranslationBatch(src=src, src_lengths=src_lengths, tgt_in=tgt_in, tgt_lengths=tgt_lengths, labels=labels)


PAD_SEGMENT = -1  # segment id of a packed row's padded tail: no sentence uses it


@dataclass(frozen=True)
class PackedTranslationBatch(_BatchMixin):
    """A teacher-forcing batch with several sentence pairs per row and (almost) no padding.

    Row ``b`` holds pairs ``0..n_b-1`` back to back: the sources in ``src`` and the targets in
    ``tgt_in``/``labels``, pair ``k`` numbered ``k`` in ``src_segments`` and ``segments``. Only the
    tail of a row shorter than the longest one is padding (``pad_id``, segment :data:`PAD_SEGMENT`,
    label ``IGNORE_INDEX``). The model keeps pairs apart with ``document`` masks and restarts
    positions at every sentence (:meth:`attnmask.model.Transformer.forward` with ``segments``).

    Attributes:
        src: (B, S) sources, each followed by ``<eos>``.
        src_segments: (B, S) pair index of every source position.
        tgt_in: (B, T) ``<sos>`` + target of each pair.
        segments: (B, T) pair index of every target position.
        labels: (B, T) target + ``<eos>`` of each pair.
    """

    src: torch.Tensor
    src_segments: torch.Tensor
    tgt_in: torch.Tensor
    segments: torch.Tensor
    labels: torch.Tensor

    @property
    def padding_fraction(self) -> float:
        """Fraction of ``src`` and ``tgt_in`` slots in a padded tail (0 = no wasted compute)."""
        slots = self.src.numel() + self.tgt_in.numel()
        pad = int((self.src_segments == PAD_SEGMENT).sum()) + int((self.segments == PAD_SEGMENT).sum())
        return pad / slots


def make_packed_translation_batch(
    rows: Sequence[Sequence[int]],
    src_ids: Sequence[Sequence[int]],
    tgt_ids: Sequence[Sequence[int]],
    *,
    pad_id: int,
    sos_id: int,
    eos_id: int,
) -> PackedTranslationBatch:
    """Pack the pairs ``rows[b]`` (indices into ``src_ids``/``tgt_ids``) into row ``b``.

    Each pair is laid out exactly as :func:`make_translation_batch` lays it out in a row of its
    own (source + ``<eos>``; ``<sos>`` + target; target + ``<eos>``), so a packed batch and a padded
    batch of the same pairs give the same loss and gradients.

    Raises:
        ValueError: a row is empty, the batch is empty, or an index is out of range.
    """
    if not rows:
        raise UserError("cannot build an empty batch; expected at least one row of pairs")
    srcs, seg_s, tins, seg_t, labs = [], [], [], [], []
    for b, row in enumerate(rows):
        if not row:
            raise UserError(f"row {b} of the packed batch is empty; expected at least one pair per row")
        s_row, ss, t_row, ts, l_row = [], [], [], [], []
        for k, i in enumerate(row):
            if not 0 <= i < len(src_ids):
                raise UserError(f"pair index {i} out of range for {len(src_ids)} pairs")
            src = list(src_ids[i]) + [eos_id]
            tgt = list(tgt_ids[i])
            s_row += src
            ss += [k] * len(src)
            t_row += [sos_id] + tgt
            ts += [k] * (len(tgt) + 1)
            l_row += tgt + [eos_id]
        srcs.append(s_row)
        seg_s.append(ss)
        tins.append(t_row)
        seg_t.append(ts)
        labs.append(l_row)
    src, _ = _pad_rows(srcs, pad_id)  # (B, S)
    src_segments, _ = _pad_rows(seg_s, PAD_SEGMENT)  # (B, S)
    tgt_in, _ = _pad_rows(tins, pad_id)  # (B, T)
    segments, _ = _pad_rows(seg_t, PAD_SEGMENT)  # (B, T)
    labels, _ = _pad_rows(labs, IGNORE_INDEX)  # (B, T)
    return PackedTranslationBatch(src=src, src_segments=src_segments, tgt_in=tgt_in, segments=segments, labels=labels)


def translation_lengths(src_ids: Sequence[Sequence[int]], tgt_ids: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Padded-tensor lengths ``(len(src) + 1, len(tgt) + 1)`` that :func:`make_translation_batch`
    will produce: the +1 is the added ``<eos>`` / ``<sos>``. Feed these to the token batcher."""
    return [(len(s) + 1, len(t) + 1) for s, t in zip(src_ids, tgt_ids, strict=True)]


def make_lm_batch(seqs: Sequence[Sequence[int]], *, pad_id: int) -> LMBatch:
    """Next-token batch from whole sequences: ``input_ids = seq[:-1]``, ``labels = seq[1:]``.

    Add ``<sos>``/``<eos>`` to ``seqs`` beforehand if the model should learn to start/stop.

    Raises:
        ValueError: the batch is empty, or a sequence has fewer than 2 tokens.
    """
    if not seqs:
        raise UserError("cannot build an empty batch; expected at least one sequence")
    for i, seq in enumerate(seqs):
        if len(seq) < 2:
            raise UserError(f"sequence {i} has {len(seq)} tokens; expected at least 2 (one input, one label)")
    input_ids, lengths = _pad_rows([list(s[:-1]) for s in seqs], pad_id)  # (B, T), (B,)
    labels, _ = _pad_rows([list(s[1:]) for s in seqs], IGNORE_INDEX)  # (B, T)
    return LMBatch(input_ids=input_ids, lengths=lengths, labels=labels)
