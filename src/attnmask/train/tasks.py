"""A training run's data: read, tokenize, split, and hand out batches.

Two kinds, chosen by ``TrainConfig.task``:

- :class:`TranslationCorpus`: aligned ``(source, target)`` pairs from two files (or from a
  built-in task of :mod:`attnmask.data.synthetic`), tokenized once, served as teacher-forcing batches
  (:func:`attnmask.data.make_translation_batch`) under a token budget with length bucketing
  (:class:`attnmask.data.batching.TokenBucketBatcher`).
- :class:`LMCorpus`: one token stream, served as random fixed-length blocks
  (:class:`attnmask.data.batching.LMStream`), evaluated on consecutive blocks of the validation stream.

Tokenizers are trained on the training split only (a resumed run loads the saved ones instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnmask.data import (
    DataError,
    TranslationBatch,
    make_translation_batch,
    read_parallel,
    read_text,
    translation_lengths,
)
from attnmask.data import synthetic as tasks
from attnmask.data.batching import LMStream, TokenBucketBatcher
from attnmask.data.tokenizer import Tokenizer

if TYPE_CHECKING:
    from attnmask.train.loop import TrainConfig

# Without validation files, the last pairs of the training data are held out: this share, capped.
HOLDOUT_FRACTION = 0.05
HOLDOUT_MAX = 1000


def build_tokenizer(kind: str, texts: list[str], vocab_size: int) -> Tokenizer:
    if kind == "char":
        return Tokenizer.train_chars(texts)
    if kind == "bpe":
        return Tokenizer.train_bpe(texts, vocab_size)
    raise ValueError(f"tokenizer={kind!r}; expected 'char' or 'bpe'")


@dataclass
class TranslationCorpus:
    """Tokenized train/valid pairs. ``*_src``/``*_tgt`` hold ids without specials."""

    tokenizer: Tokenizer  # target side
    src_tokenizer: Tokenizer  # the same object with a joint vocabulary
    train_src: list[list[int]]
    train_tgt: list[list[int]]
    valid_pairs: list[tuple[str, str]]  # raw text, references for BLEU/chrF/exact match
    valid_src: list[list[int]]
    valid_tgt: list[list[int]]
    notes: list[str]  # what happened to the data (skipped lines, dropped long pairs), for the log

    @property
    def task(self) -> str:
        return "translation"

    def train_lengths(self) -> list[tuple[int, int]]:
        return translation_lengths(self.train_src, self.train_tgt)

    def batch(self, indices: list[int], split: str = "train") -> TranslationBatch:
        src, tgt = (self.train_src, self.train_tgt) if split == "train" else (self.valid_src, self.valid_tgt)
        t = self.tokenizer
        return make_translation_batch(
            [src[i] for i in indices], [tgt[i] for i in indices], pad_id=t.pad_id, sos_id=t.sos_id, eos_id=t.eos_id
        )

    def sampler(self, cfg: TrainConfig, *, rank: int, world_size: int) -> TokenBucketBatcher:
        return TokenBucketBatcher(
            self.train_lengths(), cfg.batch_tokens, shuffle=True, seed=cfg.seed, rank=rank, world_size=world_size
        )

    def valid_batches(self, batch_tokens: int) -> list[list[int]]:
        """All validation examples, length-sorted into batches (every rank computes the same list)."""
        lengths = translation_lengths(self.valid_src, self.valid_tgt)
        return TokenBucketBatcher(lengths, batch_tokens, shuffle=False).batches_for_epoch(0)


@dataclass
class LMCorpus:
    """Token streams for a decoder-only language model."""

    tokenizer: Tokenizer
    train_ids: torch.Tensor  # (N,) long
    valid_ids: torch.Tensor  # (M,) long
    notes: list[str]

    @property
    def task(self) -> str:
        return "lm"

    @property
    def src_tokenizer(self) -> None:
        return None

    def sampler(self, cfg: TrainConfig, *, rank: int, world_size: int) -> LMStream:
        # Each rank draws its own blocks: a different generator seed per rank.
        return LMStream(self.train_ids, cfg.block_size, cfg.lm_batch_size, seed=cfg.seed + 1_000_003 * rank)


def _keep_short(src: list[list[int]], tgt: list[list[int]], limit: int) -> tuple[list[int], int]:
    """Indices of pairs whose padded tensors (ids + one special) fit in ``limit`` positions."""
    keep = [i for i, (s, t) in enumerate(zip(src, tgt)) if len(s) + 1 <= limit and len(t) + 1 <= limit]
    return keep, len(src) - len(keep)


def _translation_pairs(cfg: TrainConfig) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[str]]:
    notes = []
    if cfg.builtin_task:
        task = tasks.get_task(cfg.builtin_task)
        train = task.make_pairs(cfg.train_size, seed=cfg.seed, split="train")
        valid = task.make_pairs(cfg.valid_size, seed=cfg.seed, split="valid")
        notes.append(f"built-in task {task.name!r}: {task.description}")
        return train, valid, notes
    if not cfg.src or not cfg.tgt:
        raise ValueError("translation needs --src FILE and --tgt FILE (or a built-in task)")
    data = read_parallel(cfg.src, cfg.tgt)
    if data.skipped_empty:
        notes.append(f"skipped {data.skipped_empty} line pairs with an empty side in {cfg.src} / {cfg.tgt}")
    train = data.pairs
    if bool(cfg.valid_src) != bool(cfg.valid_tgt):
        raise ValueError("give both --valid-src and --valid-tgt, or neither")
    if cfg.valid_src:
        vdata = read_parallel(cfg.valid_src, cfg.valid_tgt)
        if vdata.skipped_empty:
            notes.append(f"skipped {vdata.skipped_empty} empty validation line pairs")
        valid = vdata.pairs
    else:
        n = min(HOLDOUT_MAX, int(len(train) * HOLDOUT_FRACTION))
        if n < 1 or len(train) - n < 1:
            raise DataError(
                f"{cfg.src}: {len(train)} pairs are too few to hold out a validation set; "
                f"expected at least {int(1 / HOLDOUT_FRACTION)} pairs or --valid-src/--valid-tgt"
            )
        train, valid = train[:-n], train[-n:]
        notes.append(f"no validation files: held out the last {n} training pairs")
    return train, valid, notes


def translation_corpus(cfg: TrainConfig, tokenizers: tuple[Tokenizer, Tokenizer] | None = None) -> TranslationCorpus:
    """Read, (train tokenizers,) tokenize and length-filter translation data.

    ``tokenizers``: ``(target, source)`` of a resumed run; None trains new ones on the training pairs.

    Raises:
        DataError: unreadable/misaligned/empty files (from :mod:`attnmask.data`), or no pair left
            after dropping those longer than ``max_len``.
    """
    train, valid, notes = _translation_pairs(cfg)
    if tokenizers is None:
        srcs, tgts = [s for s, _ in train], [t for _, t in train]
        if cfg.joint_vocab:
            tokenizer = build_tokenizer(cfg.tokenizer, srcs + tgts, cfg.vocab_size)
            src_tokenizer = tokenizer
        else:
            tokenizer = build_tokenizer(cfg.tokenizer, tgts, cfg.vocab_size)
            src_tokenizer = build_tokenizer(cfg.tokenizer, srcs, cfg.vocab_size)
    else:
        tokenizer, src_tokenizer = tokenizers
    train_src = src_tokenizer.encode_batch([s for s, _ in train])
    train_tgt = tokenizer.encode_batch([t for _, t in train])
    valid_src = src_tokenizer.encode_batch([s for s, _ in valid])
    valid_tgt = tokenizer.encode_batch([t for _, t in valid])
    limit = min(cfg.max_len, cfg.batch_tokens)
    keep, dropped = _keep_short(train_src, train_tgt, limit)
    if not keep:
        raise DataError(f"every training pair is longer than {limit} tokens; raise --max-len / --batch-tokens")
    if dropped:
        notes.append(f"dropped {dropped} training pairs longer than {limit} tokens")
    vkeep, vdropped = _keep_short(valid_src, valid_tgt, limit)
    if vdropped:
        notes.append(f"dropped {vdropped} validation pairs longer than {limit} tokens")
    if not vkeep:
        raise DataError(f"every validation pair is longer than {limit} tokens; raise --max-len / --batch-tokens")
    return TranslationCorpus(
        tokenizer=tokenizer,
        src_tokenizer=src_tokenizer,
        train_src=[train_src[i] for i in keep],
        train_tgt=[train_tgt[i] for i in keep],
        valid_pairs=[valid[i] for i in vkeep],
        valid_src=[valid_src[i] for i in vkeep],
        valid_tgt=[valid_tgt[i] for i in vkeep],
        notes=notes,
    )


def lm_corpus(cfg: TrainConfig, tokenizer: Tokenizer | None = None) -> LMCorpus:
    """Plain text as one token stream: ``--text`` (and ``--valid-text``, else its last 10%).

    Raises:
        DataError: unreadable or empty files, or a split shorter than one block.
    """
    if not cfg.text:
        raise ValueError("language modelling needs --text FILE")
    notes = []
    text = read_text(cfg.text)
    if cfg.valid_text:
        train_text, valid_text = text, read_text(cfg.valid_text)
    else:
        cut = int(len(text) * (1 - cfg.valid_fraction))
        train_text, valid_text = text[:cut], text[cut:]
        notes.append(f"validation = the last {cfg.valid_fraction:.0%} of {cfg.text} ({len(valid_text)} characters)")
    if tokenizer is None:
        # Train BPE on lines (the trainer wants many short texts); characters on the whole text.
        pieces = train_text.splitlines(keepends=True) if cfg.tokenizer == "bpe" else [train_text]
        tokenizer = build_tokenizer(cfg.tokenizer, pieces, cfg.vocab_size)
    train_ids = torch.tensor(tokenizer.encode(train_text), dtype=torch.long)  # (N,)
    valid_ids = torch.tensor(tokenizer.encode(valid_text), dtype=torch.long)  # (M,)
    for name, ids, path in (("training", train_ids, cfg.text), ("validation", valid_ids, cfg.valid_text or cfg.text)):
        if ids.numel() <= cfg.block_size:
            raise DataError(
                f"{path}: the {name} text has {ids.numel()} tokens; expected more than --block-size {cfg.block_size}"
            )
    return LMCorpus(tokenizer=tokenizer, train_ids=train_ids, valid_ids=valid_ids, notes=notes)
