"""Training tasks: read, tokenize and split the data, hand out batches, evaluate, describe.

The training loop knows one protocol, :class:`TrainingTask`, and no task by name. Two
implementations, chosen by ``TrainConfig.data.task``:

- :class:`TranslationTask`: aligned ``(source, target)`` pairs from two files (or from a
  built-in task of :mod:`attnmask.data.synthetic`), tokenized once, served as teacher-forcing batches
  (:func:`attnmask.data.make_translation_batch`) under a token budget with length bucketing
  (:class:`attnmask.data.samplers.TokenBucketBatcher`), or packed several pairs to a row with no
  padding computed (:class:`attnmask.data.samplers.PackingBatcher`, ``--batching pack``);
  evaluated by validation loss and BLEU / chrF / exact match of greedy translations.
- :class:`LMTask`: one token stream, served as random fixed-length blocks
  (:class:`attnmask.data.samplers.LMStream`), evaluated on consecutive blocks of the validation stream.

Tokenizers are trained on the training split only (a resumed run loads the saved ones instead).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from attnmask.data import (
    IGNORE_INDEX,
    DataError,
    TranslationBatch,
    make_packed_translation_batch,
    make_translation_batch,
    read_parallel,
    read_text,
    synthetic,
    translation_lengths,
)
from attnmask.data.samplers import LMStream, PackingBatcher, TokenBucketBatcher
from attnmask.data.tokenizer import Tokenizer
from attnmask.errors import UserError
from attnmask.model import ModelConfig, Transformer
from attnmask.train import distributed, evaluate
from attnmask.train.config import DataConfig, ModelSettings, TrainConfig

# Without validation files, the last pairs of the training data are held out: this share, capped.
HOLDOUT_FRACTION = 0.05
HOLDOUT_MAX = 1000


def build_tokenizer(kind: str, texts: list[str], vocab_size: int) -> Tokenizer:
    if kind == "char":
        return Tokenizer.train_chars(texts)
    if kind == "bpe":
        return Tokenizer.train_bpe(texts, vocab_size)
    raise UserError(f"tokenizer={kind!r}; expected 'char' or 'bpe'")


@dataclass
class Batch:
    """One micro-batch on the training device."""

    inputs: Tensor  # (B, T) decoder input ids
    src: Tensor | None  # (B, S) encoder input ids; None for a decoder-only model
    labels: Tensor  # (B, T) next tokens, IGNORE_INDEX where no loss is taken
    padding_fraction: float  # share of padded positions in the batch (0 for packed LM blocks)
    tokens: int  # labels that count in the loss, counted on the host before the batch moved
    segments: Tensor | None = None  # packed rows: (B, T) sentence index of each target position
    src_segments: Tensor | None = None  # packed rows: (B, S) sentence index of each source position


# Devices on which packed rows measured faster than padded buckets (benchmarks/packing.py,
# docs/benchmarks.md). CPU: a wash (0.99-1.03x with 9.6% -> 5.2% padding; a packed row's masked
# attention costs what the padding saved). CUDA: not measured yet, so not listed.
PACK_BY_DEFAULT_ON: tuple[str, ...] = ()


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    """Through pinned memory with an asynchronous copy on CUDA (see ``TranslationBatch.to_device``)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def packs_on(batching: str, device: torch.device) -> bool:
    """Whether translation batches are packed: ``pack``, ``pad``, or for ``auto`` packing only on
    the device types where it measured faster (:data:`PACK_BY_DEFAULT_ON`)."""
    if batching == "auto":
        return device.type in PACK_BY_DEFAULT_ON
    return batching == "pack"


class TrainingTask(Protocol):
    """What the training loop needs from a task."""

    name: str  # "translation" or "lm", as saved in config.json
    tokenizer: Tokenizer  # target (or only) tokenizer
    src_tokenizer: Tokenizer | None  # source tokenizer; the same object with a joint vocabulary
    notes: list[str]  # what happened to the data (skipped lines, dropped pairs), for the log

    def model_config(self, settings: ModelSettings) -> ModelConfig: ...

    def start(self, *, rank: int, world_size: int, device: torch.device) -> None:
        """Set up this rank's batch order; called once before :meth:`next_batch`."""

    def next_batch(self) -> Batch: ...

    def evaluate(self, model: Transformer, ctx: distributed.Dist, autocast: Callable) -> dict: ...

    def describe(self) -> str: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class TranslationTask:
    """Tokenized train/valid pairs. ``*_src``/``*_tgt`` hold ids without specials."""

    tokenizer: Tokenizer  # target side
    src_tokenizer: Tokenizer  # the same object with a joint vocabulary
    train_src: list[list[int]]
    train_tgt: list[list[int]]
    valid_pairs: list[tuple[str, str]]  # raw text, references for BLEU/chrF/exact match
    valid_src: list[list[int]]
    valid_tgt: list[list[int]]
    notes: list[str]
    data: DataConfig = field(default_factory=DataConfig)
    seed: int = 0
    eval_sentences: int = 500
    name: str = "translation"

    def __post_init__(self):
        self._sampler: TokenBucketBatcher | None = None
        self._epoch = None
        self._device = torch.device("cpu")

    def model_config(self, settings: ModelSettings) -> ModelConfig:
        return settings.model_config(
            arch="encoder_decoder",
            vocab_size=self.tokenizer.vocab_size,
            src_vocab_size=self.src_tokenizer.vocab_size,
            max_seq_len=min(self.data.max_len, self.data.batch_tokens),  # the longest kept pair
        )

    def train_lengths(self) -> list[tuple[int, int]]:
        return translation_lengths(self.train_src, self.train_tgt)

    def batch(self, indices: list[int], split: str = "train") -> TranslationBatch:
        src, tgt = (self.train_src, self.train_tgt) if split == "train" else (self.valid_src, self.valid_tgt)
        t = self.tokenizer
        return make_translation_batch(
            [src[i] for i in indices], [tgt[i] for i in indices], pad_id=t.pad_id, sos_id=t.sos_id, eos_id=t.eos_id
        )

    def start(self, *, rank: int, world_size: int, device: torch.device) -> None:
        self._device = device
        lengths = self.train_lengths()
        shard = {"shuffle": True, "seed": self.seed, "rank": rank, "world_size": world_size}
        if packs_on(self.data.batching, device):
            # a row holds at least the longest pair; pack_length is the usual row
            row = min(max(self.data.pack_length, *(max(p) for p in lengths)), self.data.batch_tokens)
            self._sampler = PackingBatcher(lengths, self.data.batch_tokens, row_tokens=row, **shard)
        else:
            self._sampler = TokenBucketBatcher(lengths, self.data.batch_tokens, **shard)

    @property
    def packed(self) -> bool:
        return isinstance(self._sampler, PackingBatcher)

    def next_batch(self) -> Batch:
        while True:
            if self._epoch is None:
                self._epoch = iter(self._sampler)
            try:
                idx = next(self._epoch)
                break
            except StopIteration:  # epoch done; the next iter() starts the following one
                self._epoch = None
        if self.packed:
            t = self.tokenizer
            p = make_packed_translation_batch(
                idx, self.train_src, self.train_tgt, pad_id=t.pad_id, sos_id=t.sos_id, eos_id=t.eos_id
            )
            tokens, padding = p.num_tokens, p.padding_fraction
            p = p.to_device(self._device)
            return Batch(p.tgt_in, p.src, p.labels, padding, tokens, segments=p.segments, src_segments=p.src_segments)
        b = self.batch(idx)
        tokens = int((b.labels != IGNORE_INDEX).sum())
        padding = b.padding_fraction
        b = b.to_device(self._device)
        return Batch(b.tgt_in, b.src, b.labels, padding, tokens)

    def valid_batches(self, batch_tokens: int) -> list[list[int]]:
        """All validation examples, length-sorted into batches (every rank computes the same list)."""
        lengths = translation_lengths(self.valid_src, self.valid_tgt)
        return TokenBucketBatcher(lengths, batch_tokens, shuffle=False).batches_for_epoch(0)

    def evaluate(self, model: Transformer, ctx: distributed.Dist, autocast: Callable = contextlib.nullcontext) -> dict:
        return evaluate.evaluate_translation(
            model, self, ctx, batch_tokens=self.data.batch_tokens, max_sentences=self.eval_sentences, autocast=autocast
        )

    def describe(self) -> str:
        sampler = self._sampler
        batches = ""
        if sampler:
            how = f"packed rows of {sampler.row_tokens} tokens" if self.packed else "length-bucketed"
            batches = f", {len(sampler)} batches/epoch/rank ({how}), padding {sampler.padding_fraction():.1%}"
        return (
            f"{len(self.train_src)} training pairs, {len(self.valid_src)} validation pairs, "
            f"vocabulary {self.tokenizer.vocab_size}{batches}"
        )

    def state_dict(self) -> dict:
        return self._sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._sampler.load_state_dict(state)
        self._epoch = None


@dataclass
class LMTask:
    """Token streams for a decoder-only language model."""

    tokenizer: Tokenizer
    train_ids: torch.Tensor  # (N,) long
    valid_ids: torch.Tensor  # (M,) long
    notes: list[str]
    data: DataConfig = field(default_factory=lambda: DataConfig(task="lm"))
    seed: int = 0
    eval_max_tokens: int | None = None
    name: str = "lm"
    src_tokenizer: None = None

    def __post_init__(self):
        self._stream: LMStream | None = None
        self._device = torch.device("cpu")

    def model_config(self, settings: ModelSettings) -> ModelConfig:
        return settings.model_config(
            arch="decoder",
            vocab_size=self.tokenizer.vocab_size,
            src_vocab_size=None,
            max_seq_len=max(self.data.block_size, self.data.max_len),  # room to generate past a block
        )

    def start(self, *, rank: int, world_size: int, device: torch.device) -> None:
        # Each rank draws its own blocks: a different generator seed per rank.
        self._device = device
        d = self.data
        self._stream = LMStream(self.train_ids, d.block_size, d.lm_batch_size, seed=self.seed + 1_000_003 * rank)

    def next_batch(self) -> Batch:
        x, y = self._stream.next_batch()  # (B, T), (B, T)
        tokens = int((y != IGNORE_INDEX).sum())
        return Batch(_to_device(x, self._device), None, _to_device(y, self._device), 0.0, tokens)

    def evaluate(self, model: Transformer, ctx: distributed.Dist, autocast: Callable = contextlib.nullcontext) -> dict:
        d = self.data
        return evaluate.evaluate_lm(
            model, self, ctx, block_size=d.block_size, batch_size=d.lm_batch_size, max_tokens=self.eval_max_tokens,
            autocast=autocast,
        )  # fmt: skip

    def describe(self) -> str:
        d = self.data
        return (
            f"{self.train_ids.numel()} training / {self.valid_ids.numel()} validation tokens, "
            f"vocabulary {self.tokenizer.vocab_size}, batches of {d.lm_batch_size} x {d.block_size}"
        )

    def state_dict(self) -> dict:
        return self._stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._stream.load_state_dict(state)


def build_task(cfg: TrainConfig, tokenizers: tuple[Tokenizer, Tokenizer | None] | None = None) -> TrainingTask:
    """The task of ``cfg``: its data read and tokenized (with ``tokenizers`` of a resumed run, or
    new ones trained on the training split)."""
    if cfg.data.task == "translation":
        task = translation_task(cfg.data, tokenizers, seed=cfg.run.seed)
        task.eval_sentences = cfg.run.eval_sentences
        return task
    task = lm_task(cfg.data, None if tokenizers is None else tokenizers[0])
    task.seed, task.eval_max_tokens = cfg.run.seed, cfg.run.eval_max_tokens
    return task


def _keep_short(src: list[list[int]], tgt: list[list[int]], limit: int) -> tuple[list[int], int]:
    """Indices of pairs whose padded tensors (ids + one special) fit in ``limit`` positions."""
    keep = [i for i, (s, t) in enumerate(zip(src, tgt)) if len(s) + 1 <= limit and len(t) + 1 <= limit]
    return keep, len(src) - len(keep)


def _translation_pairs(cfg: DataConfig, seed: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[str]]:
    notes = []
    if cfg.builtin_task:
        task = synthetic.get_task(cfg.builtin_task)
        train = task.make_pairs(cfg.train_size, seed=seed, split="train")
        valid = task.make_pairs(cfg.valid_size, seed=seed, split="valid")
        notes.append(f"built-in task {task.name!r}: {task.description}")
        return train, valid, notes
    if not cfg.src or not cfg.tgt:
        raise UserError("translation needs --src FILE and --tgt FILE (or a built-in task)")
    data = read_parallel(cfg.src, cfg.tgt)
    if data.skipped_empty:
        notes.append(f"skipped {data.skipped_empty} line pairs with an empty side in {cfg.src} / {cfg.tgt}")
    train = data.pairs
    if bool(cfg.valid_src) != bool(cfg.valid_tgt):
        raise UserError("give both --valid-src and --valid-tgt, or neither")
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


def translation_task(
    cfg: DataConfig, tokenizers: tuple[Tokenizer, Tokenizer] | None = None, *, seed: int = 0
) -> TranslationTask:
    """Read, (train tokenizers,) tokenize and length-filter translation data.

    ``tokenizers``: ``(target, source)`` of a resumed run; None trains new ones on the training pairs.

    Raises:
        DataError: unreadable/misaligned/empty files (from :mod:`attnmask.data`), or no pair left
            after dropping those longer than ``max_len``.
    """
    train, valid, notes = _translation_pairs(cfg, seed)
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
    return TranslationTask(
        tokenizer=tokenizer,
        src_tokenizer=src_tokenizer,
        train_src=[train_src[i] for i in keep],
        train_tgt=[train_tgt[i] for i in keep],
        valid_pairs=[valid[i] for i in vkeep],
        valid_src=[valid_src[i] for i in vkeep],
        valid_tgt=[valid_tgt[i] for i in vkeep],
        notes=notes,
        data=cfg,
        seed=seed,
    )


def lm_task(cfg: DataConfig, tokenizer: Tokenizer | None = None) -> LMTask:
    """Plain text as one token stream: ``--text`` (and ``--valid-text``, else its last 10%).

    Raises:
        DataError: unreadable or empty files, or a split shorter than one block.
    """
    if not cfg.text:
        raise UserError("language modelling needs --text FILE")
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
    return LMTask(tokenizer=tokenizer, train_ids=train_ids, valid_ids=valid_ids, notes=notes, data=cfg)
