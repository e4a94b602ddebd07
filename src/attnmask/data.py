"""Reading text corpora and turning token ids into padded training batches.

Conventions:
- Files are UTF-8; a ``.gz`` suffix means gzip and is read transparently. Problems a user can fix
  (empty file, bad bytes, misaligned parallel files) raise :class:`DataError` naming the file.
- Padding is on the right. Inputs are padded with ``pad_id``; labels are padded with
  :data:`IGNORE_INDEX` (-100, what ``torch.nn.functional.cross_entropy`` ignores by default).
- Lengths tensors count real (non-pad) positions of each row; masks are built from them elsewhere
  (:mod:`attnmask.masks`), never from comparing ids with ``pad_id``.

Samplers that decide *which* examples form a batch live in :mod:`attnmask.batching`.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import torch

IGNORE_INDEX = -100


class DataError(ValueError):
    """Input data is unusable; the message names the file (and line) and what was expected."""


# --- reading files ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LinesResult:
    """Non-empty lines of a file (line terminators removed) and how many empty ones were skipped."""

    lines: list[str]
    skipped_empty: int
    path: Path


@dataclass(frozen=True)
class ParallelResult:
    """Aligned ``(src, tgt)`` pairs; behaves as a sequence of pairs.

    ``skipped_empty`` counts line pairs dropped because either side was empty.
    """

    pairs: list[tuple[str, str]]
    skipped_empty: int
    src_path: Path
    tgt_path: Path

    def __len__(self) -> int:
        return len(self.pairs)

    def __iter__(self):
        return iter(self.pairs)

    def __getitem__(self, index):
        return self.pairs[index]

    @property
    def sources(self) -> list[str]:
        return [src for src, _ in self.pairs]

    @property
    def targets(self) -> list[str]:
        return [tgt for _, tgt in self.pairs]


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _utf8_error(path: Path, line: int, offset: int, byte: int) -> DataError:
    where = " of the decompressed data" if path.suffix == ".gz" else ""
    return DataError(
        f"{path}: invalid UTF-8 at line {line}, byte offset {offset}{where} (byte 0x{byte:02x}); expected UTF-8 text"
    )


_GZIP_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)


def _gzip_error(path: Path, err: Exception) -> DataError:
    return DataError(f"{path}: not a valid gzip file ({err}); expected gzip-compressed text")


def _read_all_lines(path: str | Path) -> tuple[Path, list[str]]:
    """Every line of ``path`` (empty ones included), without terminators.

    Raises FileNotFoundError, or DataError for invalid UTF-8 or a broken gzip stream.
    """
    path = Path(path)
    lines: list[str] = []
    offset = 0  # byte offset of the current line's start (in the decompressed stream for .gz)
    try:
        with _open_binary(path) as f:
            for number, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise _utf8_error(path, number, offset + err.start, raw[err.start]) from err
                if number == 1:
                    line = line.removeprefix("\ufeff")  # a UTF-8 byte order mark is not text
                lines.append(line.rstrip("\r\n"))
                offset += len(raw)
    except _GZIP_ERRORS as err:
        raise _gzip_error(path, err) from err
    return path, lines


def read_lines(path: str | Path) -> LinesResult:
    """Read a UTF-8 (optionally gzipped) text file as a list of non-empty lines.

    A line holding only whitespace counts as empty. Other lines are kept as they are, minus the
    ``\\n``/``\\r\\n`` terminator and a leading byte order mark.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DataError: the file has no non-empty line; a byte sequence is not UTF-8 (the message gives
            the 1-based line number and byte offset); a ``.gz`` file is not valid gzip.
    """
    path, all_lines = _read_all_lines(path)
    lines = [line for line in all_lines if line.strip()]
    if not lines:
        raise DataError(
            f"{path}: no text found ({len(all_lines)} lines, all empty); expected at least one non-empty line"
        )
    return LinesResult(lines=lines, skipped_empty=len(all_lines) - len(lines), path=path)


def read_text(path: str | Path) -> str:
    """The whole of a UTF-8 (optionally gzipped) file as one string, exactly as stored.

    Meant for language modelling on a character stream. A leading byte order mark is dropped.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DataError: the file holds only whitespace, is not UTF-8 (line number and byte offset are
            named), or a ``.gz`` file is not valid gzip.
    """
    path = Path(path)
    try:
        with _open_binary(path) as f:
            data = f.read()
    except _GZIP_ERRORS as err:
        raise _gzip_error(path, err) from err
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise _utf8_error(path, line, err.start, data[err.start]) from err
    text = text.removeprefix("\ufeff")
    if not text.strip():
        raise DataError(f"{path}: no text found; expected a non-empty UTF-8 file")
    return text


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> ParallelResult:
    """Read two line-aligned files (line i of ``src_path`` translates line i of ``tgt_path``).

    A pair is skipped (and counted in ``skipped_empty``) when either side is empty.

    Raises:
        FileNotFoundError: a file does not exist.
        DataError: the files have different line counts (both files and counts are named), no
            pair is left, or a file is not valid UTF-8 / gzip.
    """
    src_path, src_lines = _read_all_lines(src_path)
    tgt_path, tgt_lines = _read_all_lines(tgt_path)
    if len(src_lines) != len(tgt_lines):
        raise DataError(
            f"parallel files differ in length: {src_path} has {len(src_lines)} lines but "
            f"{tgt_path} has {len(tgt_lines)}; expected the same number (line i translates line i)"
        )
    pairs = [(s, t) for s, t in zip(src_lines, tgt_lines) if s.strip() and t.strip()]
    if not pairs:
        raise DataError(
            f"{src_path} and {tgt_path}: no pair with text on both sides "
            f"({len(src_lines)} line pairs); expected at least one"
        )
    return ParallelResult(
        pairs=pairs,
        skipped_empty=len(src_lines) - len(pairs),
        src_path=src_path,
        tgt_path=tgt_path,
    )


# --- batches ----------------------------------------------------------------------------------


class _BatchMixin:
    """``.to(device)`` for dataclasses whose fields are all tensors."""

    def to(self, device: torch.device | str, non_blocking: bool = False):
        """A copy with every tensor moved to ``device``."""
        return type(self)(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)})


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
    def num_tokens(self) -> int:
        """Target tokens the loss is computed over (``labels != IGNORE_INDEX``)."""
        return int((self.labels != IGNORE_INDEX).sum())

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

    @property
    def num_tokens(self) -> int:
        """Positions the loss is computed over (``labels != IGNORE_INDEX``)."""
        return int((self.labels != IGNORE_INDEX).sum())


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
        raise ValueError(f"got {len(src_ids)} source and {len(tgt_ids)} target sequences; expected equal numbers")
    if not src_ids:
        raise ValueError("cannot build an empty batch; expected at least one sequence pair")
    src, src_lengths = _pad_rows([list(s) + [eos_id] for s in src_ids], pad_id)  # (B, S), (B,)
    tgt_in, tgt_lengths = _pad_rows([[sos_id] + list(t) for t in tgt_ids], pad_id)  # (B, T), (B,)
    labels, _ = _pad_rows([list(t) + [eos_id] for t in tgt_ids], IGNORE_INDEX)  # (B, T)
    return TranslationBatch(src=src, src_lengths=src_lengths, tgt_in=tgt_in, tgt_lengths=tgt_lengths, labels=labels)


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
        raise ValueError("cannot build an empty batch; expected at least one sequence")
    for i, seq in enumerate(seqs):
        if len(seq) < 2:
            raise ValueError(f"sequence {i} has {len(seq)} tokens; expected at least 2 (one input, one label)")
    input_ids, lengths = _pad_rows([list(s[:-1]) for s in seqs], pad_id)  # (B, T), (B,)
    labels, _ = _pad_rows([list(s[1:]) for s in seqs], IGNORE_INDEX)  # (B, T)
    return LMBatch(input_ids=input_ids, lengths=lengths, labels=labels)
