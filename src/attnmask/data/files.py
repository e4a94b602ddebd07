"""Reading text corpora.

UTF-8 files, ``.gz`` read transparently; problems are raised as :class:`DataError`
naming the file and line.
"""

from __future__ import annotations

import gzip
import zlib
from dataclasses import dataclass
from pathlib import Path

from attnmask.errors import UserError


class DataError(UserError):
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


def read_all_lines(path: str | Path) -> list[str]:
    """Every line of a UTF-8 (optionally gzipped) text file, empty ones included, without
    terminators or a leading byte order mark: line i of the result is line i + 1 of the file.

    Raises:
        FileNotFoundError: ``path`` does not exist (IsADirectoryError: it is a directory).
        DataError: a byte sequence is not UTF-8 (line number and byte offset are named), or a
            ``.gz`` file is not valid gzip.
    """
    return _read_all_lines(path)[1]


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
