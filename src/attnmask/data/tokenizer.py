"""Tokenizers: byte-level BPE and character-level, both stored as one Hugging Face ``tokenizer.json``.

Conventions:
- Four special tokens with fixed ids in every tokenizer this module builds or accepts:
  ``<pad>`` = 0, ``<sos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3. Models, batches and decoding rely on
  these ids, so :meth:`Tokenizer.from_hf` and :meth:`Tokenizer.load` refuse tokenizers without them.
- :meth:`Tokenizer.encode` never adds specials; batch builders in :mod:`attnmask.data` add
  ``<sos>``/``<eos>`` in one place.
- Text that happens to contain ``"<pad>"`` (or another special's spelling) is encoded as ordinary
  characters, never as the special id, so ``decode(encode(s)) == s`` holds for any text the
  vocabulary covers (all text for BPE, which is byte-level; characters seen in training for the
  character-level tokenizer; unseen characters become ``<unk>``, and :meth:`Tokenizer.encode` /
  :meth:`Tokenizer.encode_batch` say so with one :class:`UnknownCharactersWarning` per call naming
  them, since a model then reads something else than was typed).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from attnmask.errors import UserError, UserTypeError

PAD, SOS, EOS, UNK = "<pad>", "<sos>", "<eos>", "<unk>"
PAD_ID, SOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = (PAD, SOS, EOS, UNK)  # position in this tuple == id

# A byte-level BPE always holds the 256 byte symbols besides the specials.
_BYTE_ALPHABET_SIZE = 256
MIN_BPE_VOCAB_SIZE = len(SPECIAL_TOKENS) + _BYTE_ALPHABET_SIZE

TOKENIZER_FILENAME = "tokenizer.json"
_MAX_NAMED = 10  # unknown characters named in a warning


class UnknownCharactersWarning(UserWarning):
    """Text held characters outside the vocabulary; they were encoded as ``<unk>``."""


class TokenizerBase:
    """What every attnmask tokenizer shares: a wrapped Hugging Face ``tokenizers.Tokenizer``, the
    vocabulary lookups, batch decoding and id checks. Subclasses define the special ids,
    :meth:`encode` and :meth:`decode` (the protocol decoding and training rely on:
    ``pad_id``, ``sos_id``, ``eos_id``, ``vocab_size``, ``encode``, ``encode_batch``, ``decode``,
    ``decode_batch``). :class:`Tokenizer` is attnmask's own; pretrained models bring theirs
    (:class:`attnmask.pretrained.registry.PretrainedTokenizer`)."""

    _hf: HFTokenizer

    @property
    def vocab_size(self) -> int:
        """Number of ids, specials included; valid ids are ``0 .. vocab_size - 1``."""
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def hf(self) -> HFTokenizer:
        """The wrapped Hugging Face tokenizer."""
        return self._hf

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int] | torch.Tensor, skip_special: bool = True) -> str:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` for many texts."""
        return [self.encode(text) for text in texts]

    def decode_batch(self, batch: Iterable[Iterable[int]] | torch.Tensor, skip_special: bool = True) -> list[str]:
        """:meth:`decode` for each row of a list of id lists or of a 2-D tensor."""
        if isinstance(batch, torch.Tensor):
            if batch.dim() != 2:
                raise UserError(f"expected a 2-D tensor of ids (B, T), got shape {tuple(batch.shape)}")
            batch = batch.tolist()
        return [self.decode(row, skip_special=skip_special) for row in batch]

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry for ``token_id`` (byte-level BPE entries use GPT-2's byte symbols).

        Raises:
            ValueError: ``token_id`` is outside ``[0, vocab_size)``.
        """
        token = self._hf.id_to_token(token_id)
        if token is None:
            raise UserError(f"token id {token_id} is out of range, expected 0 <= id < {self.vocab_size}")
        return token

    def token_to_id(self, token: str) -> int | None:
        """The id of vocabulary entry ``token``, or ``None`` if it is not in the vocabulary."""
        return self._hf.token_to_id(token)

    def _check_ids(self, ids: Iterable[int] | torch.Tensor) -> list[int]:
        """``ids`` as a list of ints; ValueError for a tensor that is not 1-D or an id out of range."""
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1:
                raise UserError(f"expected a 1-D tensor of ids, got shape {tuple(ids.shape)}")
            ids = ids.tolist()
        ids = [int(i) for i in ids]
        vocab_size = self.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise UserError(f"token ids {bad[:5]} are out of range, expected 0 <= id < {vocab_size}")
        return ids


class Tokenizer(TokenizerBase):
    """A Hugging Face ``tokenizers.Tokenizer`` with the fixed special ids above.

    Build one with :meth:`train_bpe`, :meth:`train_chars`, :meth:`from_hf` or :meth:`load`.
    """

    def __init__(self, hf_tokenizer: HFTokenizer) -> None:
        """Wrap ``hf_tokenizer`` (prefer :meth:`from_hf`, which copies it first).

        Raises:
            TypeError: ``hf_tokenizer`` is not a ``tokenizers.Tokenizer``.
            ValueError: a special token is missing or has another id than the fixed one.
        """
        if not isinstance(hf_tokenizer, HFTokenizer):
            raise UserTypeError(f"expected a tokenizers.Tokenizer, got {type(hf_tokenizer).__name__}")
        for expected_id, token in enumerate(SPECIAL_TOKENS):
            actual_id = hf_tokenizer.token_to_id(token)
            if actual_id != expected_id:
                raise UserError(
                    f"special token {token!r} has id {actual_id}, expected {expected_id} "
                    f"(attnmask needs {dict(zip(SPECIAL_TOKENS, range(4)))})"
                )
        # Not stored in tokenizer.json, so set on every wrap: text spelling "<pad>" must encode as
        # characters, or decode(encode(s)) would lose it (decode drops specials).
        hf_tokenizer.encode_special_tokens = True
        self._hf = hf_tokenizer

    # --- constructors -------------------------------------------------------------------------

    @classmethod
    def train_bpe(cls, texts: Iterable[str], vocab_size: int) -> Tokenizer:
        """Train a byte-level BPE (GPT-2 style: no normalisation, spaces kept as byte symbols).

        Every string round-trips exactly, and no text ever maps to ``<unk>``. The vocabulary has
        at most ``vocab_size`` entries; a small corpus can yield fewer (no more merges to learn).

        Raises:
            ValueError: ``vocab_size`` < 260 (4 specials + 256 bytes), or no non-empty text.
            TypeError: an element of ``texts`` is not a ``str``.
        """
        if vocab_size < MIN_BPE_VOCAB_SIZE:
            raise UserError(
                f"vocab_size={vocab_size} is too small for a byte-level BPE: expected at least "
                f"{MIN_BPE_VOCAB_SIZE} ({len(SPECIAL_TOKENS)} specials + {_BYTE_ALPHABET_SIZE} bytes)"
            )
        hf = HFTokenizer(models.BPE())
        # add_prefix_space=False keeps the round trip exact (no invented leading space).
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),  # the trainer gives them ids 0..3 in this order
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        counter = _NonEmptyCounter(texts)
        hf.train_from_iterator(counter, trainer=trainer)
        if counter.non_empty == 0:
            raise UserError("cannot train a BPE tokenizer: expected at least one non-empty text")
        return cls(hf)

    @classmethod
    def train_chars(cls, texts: Iterable[str]) -> Tokenizer:
        """Build a character-level tokenizer: each distinct code point in ``texts`` is one token.

        Ids after the specials follow sorted code point order, so the result does not depend on
        text order. Characters not seen here encode as ``<unk>``.

        Raises:
            ValueError: ``texts`` holds no characters.
            TypeError: an element of ``texts`` is not a ``str``.
        """
        chars: set[str] = set()
        for text in texts:
            _check_str(text)
            chars.update(text)
        if not chars:
            raise UserError("cannot build a character tokenizer: expected at least one non-empty text")
        vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
        for char in sorted(chars):
            vocab.setdefault(char, len(vocab))
        hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
        # [\s\S] matches one code point including newlines ("." would skip them).
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        hf.decoder = decoders.Fuse()  # join characters without the default separating space
        hf.add_special_tokens(list(SPECIAL_TOKENS))
        return cls(hf)

    @classmethod
    def from_hf(cls, hf_tokenizer: HFTokenizer) -> Tokenizer:
        """Wrap a copy of an existing Hugging Face tokenizer (the argument is left unchanged).

        Raises:
            TypeError: not a ``tokenizers.Tokenizer``.
            ValueError: the fixed special tokens (``<pad>``=0 ... ``<unk>``=3) are missing.
        """
        if not isinstance(hf_tokenizer, HFTokenizer):
            raise UserTypeError(f"expected a tokenizers.Tokenizer, got {type(hf_tokenizer).__name__}")
        return cls(HFTokenizer.from_str(hf_tokenizer.to_str()))

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Load a ``tokenizer.json`` written by :meth:`save` (``path`` may be its directory).

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ValueError: the file is not a Hugging Face tokenizer, or lacks the fixed specials.
        """
        path = _resolve(path)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise UserError(f"{path} is not a tokenizer.json file: not UTF-8 text ({err})") from err
        try:
            hf = HFTokenizer.from_str(text)
        except Exception as err:  # tokenizers raises a bare Exception for malformed JSON
            raise UserError(f"{path} is not a tokenizer.json file: {err}") from err
        try:
            return cls(hf)
        except ValueError as err:
            raise UserError(f"{path}: {err}") from err

    # --- properties ---------------------------------------------------------------------------

    @property
    def pad_id(self) -> int:
        return PAD_ID

    @property
    def sos_id(self) -> int:
        return SOS_ID

    @property
    def eos_id(self) -> int:
        return EOS_ID

    @property
    def unk_id(self) -> int:
        return UNK_ID

    # --- encoding and decoding ----------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without ``<sos>``/``<eos>``. Raises TypeError for non-``str``."""
        _check_str(text)
        encoding = self._hf.encode(text, add_special_tokens=False)
        _warn_unknown([text], [encoding])
        return encoding.ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` for many texts at once (parallel in Rust)."""
        texts = list(texts)
        for text in texts:
            _check_str(text)
        encodings = self._hf.encode_batch(texts, add_special_tokens=False)
        _warn_unknown(texts, encodings)
        return [enc.ids for enc in encodings]

    def decode(self, ids: Iterable[int] | torch.Tensor, skip_special: bool = True) -> str:
        """Text of ``ids`` (a list or a 1-D tensor); with ``skip_special`` the four specials are dropped.

        Raises:
            ValueError: an id is outside ``[0, vocab_size)``, or a tensor is not 1-D.
        """
        ids = self._check_ids(ids)
        if skip_special:
            # Filter by id ourselves: a wrapped tokenizer may not flag these tokens as special.
            ids = [i for i in ids if i >= len(SPECIAL_TOKENS)]
        return self._hf.decode(ids, skip_special_tokens=False)

    # --- persistence --------------------------------------------------------------------------

    def to_json(self) -> str:
        """The ``tokenizer.json`` content; two tokenizers are interchangeable iff these are equal."""
        return self._hf.to_str()

    def save(self, path: str | Path) -> Path:
        """Write a single ``tokenizer.json`` to ``path`` (or into it, if it is a directory).

        Parent directories are created. Returns the path of the written file.

        Raises:
            OSError: the file cannot be written (no space left, no permission, ...).
        """
        path = _resolve(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._hf.save(str(path))
        except Exception as err:  # tokenizers raises a bare Exception, e.g. on a full disk
            raise OSError(f"cannot write {path}: {err}") from err
        return path

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tokenizer):
            return NotImplemented
        return json.loads(self.to_json()) == json.loads(other.to_json())

    __hash__ = None  # mutable wrapper, compared by content

    def __repr__(self) -> str:
        kind = type(self._hf.model).__name__
        return f"Tokenizer(model={kind}, vocab_size={self.vocab_size})"


class _NonEmptyCounter:
    """Passes texts through to the trainer while counting non-empty ones and type-checking."""

    def __init__(self, texts: Iterable[str]) -> None:
        self._texts = texts
        self.non_empty = 0

    def __iter__(self) -> Iterator[str]:
        for text in self._texts:
            _check_str(text)
            if text:
                self.non_empty += 1
                yield text


def _warn_unknown(texts: Sequence[str], encodings) -> None:
    """One warning naming the characters of ``texts`` that were encoded as ``<unk>``."""
    unknown: dict[str, None] = {}  # in order of appearance
    count = 0
    for text, encoding in zip(texts, encodings):
        if UNK_ID not in encoding.ids:
            continue
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
            if token_id == UNK_ID:
                unknown.setdefault(text[start:end], None)
                count += 1
    if count:
        named = ", ".join(repr(c) for c in list(unknown)[:_MAX_NAMED])
        more = f" and {len(unknown) - _MAX_NAMED} more" if len(unknown) > _MAX_NAMED else ""
        warnings.warn(
            f"{count} character(s) outside the tokenizer's vocabulary were read as <unk>: {named}{more}",
            UnknownCharactersWarning,
            stacklevel=3,
        )


def _check_str(text: object) -> None:
    if not isinstance(text, str):
        raise UserTypeError(f"expected text as str, got {type(text).__name__}: {text!r:.60}")


def _resolve(path: str | Path) -> Path:
    path = Path(path)
    return path / TOKENIZER_FILENAME if path.is_dir() else path
