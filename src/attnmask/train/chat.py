"""The chat fine-tuning task: conversations from a JSONL file, a pretrained model's template and tokenizer.

``--task chat --data FILE.jsonl --init MODEL`` (see :mod:`attnmask.data.chat` for the format):
each conversation is rendered with the model's own chat template and tokenized with its own
tokenizer; the loss is taken on the assistant's tokens only (and their end-of-turn token).
Training batches are packed rows (:class:`attnmask.data.samplers.PackingBatcher`, first-fit
decreasing): several conversations a row, kept apart by ``document`` masks with positions
restarting per conversation, so almost nothing is padding. Evaluation is the loss on held-out
conversations (``--valid-data``, else the last 5% of the file, at most 200; none below 20
conversations, then the training loss alone is reported).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attnmask.data.chat import ChatExample, ChatRows, read_chat_jsonl, tokenize_rows
from attnmask.data.packing import PackedLMBatch, example_length, make_packed_lm_batch
from attnmask.data.samplers import PackingBatcher
from attnmask.errors import UserError
from attnmask.model import ModelConfig, Transformer, lm_loss
from attnmask.pretrained import ChatTemplate, PretrainedTokenizer
from attnmask.train import distributed
from attnmask.train.config import DataConfig, ModelSettings, TrainConfig
from attnmask.train.evaluate import eval_mode
from attnmask.train.init import Init, load_init
from attnmask.train.tasks import Batch

HOLDOUT_FRACTION = 0.05
HOLDOUT_MAX = 200
HOLDOUT_MIN_CONVERSATIONS = 20  # fewer: every conversation trains, no validation split


@dataclass
class ChatTask:
    """Tokenized training and validation conversations and the pretrained model they go to."""

    init: Init
    train_examples: list[ChatExample]
    valid_examples: list[ChatExample]
    notes: list[str]
    data: DataConfig = field(default_factory=lambda: DataConfig(task="chat"))
    seed: int = 0
    name: str = "chat"
    src_tokenizer: None = None

    def __post_init__(self):
        self._sampler: PackingBatcher | None = None
        self._epoch = None
        self._device = torch.device("cpu")

    @property
    def tokenizer(self) -> PretrainedTokenizer:
        return self.init.tokenizer

    @property
    def chat_template(self) -> ChatTemplate:
        return self.init.chat_template

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    def model_config(self, settings: ModelSettings) -> ModelConfig:
        return self.init.model.config

    def pretrained_model(self) -> Transformer:
        """The model the run starts from (handed over once: the task keeps no reference)."""
        model, self.init.model = self.init.model, None
        if model is None:
            raise UserError("the pretrained model was already handed to a trainer; load the task again")
        return model

    @property
    def row_tokens(self) -> int:
        return min(self.data.pack_length, self.data.batch_tokens)

    def start(self, *, rank: int, world_size: int, device: torch.device) -> None:
        self._device = device
        lengths = [example_length(ex.ids) for ex in self.train_examples]
        self._sampler = PackingBatcher(
            lengths, self.data.batch_tokens, row_tokens=self.row_tokens, shuffle=True, seed=self.seed,
            rank=rank, world_size=world_size, remainder="repeat",
        )  # fmt: skip

    def _packed(self, rows: list[list[int]], examples: list[ChatExample]) -> PackedLMBatch:
        return make_packed_lm_batch(rows, examples, pad_id=self.pad_id)

    def next_batch(self) -> Batch:
        while True:
            if self._epoch is None:
                self._epoch = iter(self._sampler)
            try:
                rows = next(self._epoch)
                break
            except StopIteration:
                self._epoch = None
        p = self._packed(rows, self.train_examples)
        tokens, padding = p.num_tokens, p.padding_fraction
        p = p.to_device(self._device)
        return Batch(p.inputs, None, p.labels, padding, tokens, segments=p.segments)

    def evaluate(self, model: Transformer, ctx: distributed.Dist, autocast: Callable = contextlib.nullcontext) -> dict:
        """Mean loss over the assistant tokens of the held-out conversations (empty without any)."""
        if not self.valid_examples:
            return {}
        lengths = [example_length(ex.ids) for ex in self.valid_examples]
        plan = PackingBatcher(
            lengths, self.data.batch_tokens, row_tokens=self.row_tokens, shuffle=False
        ).batches_for_epoch(0)
        total = count = 0.0
        with eval_mode(model), torch.no_grad():
            for k, rows in enumerate(plan):
                if k % ctx.world_size != ctx.rank:
                    continue
                p = self._packed(rows, self.valid_examples).to(ctx.device)
                with autocast():
                    logits = model(p.inputs, segments=p.segments).logits  # (B, T, V)
                loss_sum, n = lm_loss(logits, p.labels, reduction="sum")
                total, count = total + float(loss_sum), count + n
        total, count = distributed.all_reduce_sum(ctx, [total, count])
        loss = total / max(count, 1)
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": int(count)}

    def describe(self) -> str:
        batches = ""
        if self._sampler is not None:
            s = self._sampler
            batches = (
                f", {len(s)} batches/epoch/rank (packed rows of {s.row_tokens} tokens), "
                f"padding {s.padding_fraction():.1%}"
            )
        targets = sum(sum(ex.targets[1:]) for ex in self.train_examples)
        total = sum(example_length(ex.ids) for ex in self.train_examples)
        return (
            f"{len(self.train_examples)} training conversations ({total} tokens, {targets} assistant targets), "
            f"{len(self.valid_examples)} validation conversations, init {self.init.source}{batches}"
        )

    def state_dict(self) -> dict:
        return self._sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._sampler.load_state_dict(state)
        self._epoch = None


def _tokenize(rows: ChatRows, init: Init, cfg: DataConfig) -> list[ChatExample]:
    tok, template = init.tokenizer, init.chat_template

    def encode(text: str) -> list[int]:
        return tok.hf.encode(text, add_special_tokens=False).ids

    return tokenize_rows(
        rows,
        render=template,
        encode=encode,
        max_len=cfg.max_len,
        end_ids=set(tok.stop_ids),
        bos_id=tok.bos_id if tok.add_bos else None,
    )


def chat_task(cfg: TrainConfig, init: Init | None = None) -> ChatTask:
    """Read, check and tokenize ``--data`` (and ``--valid-data``) for the model of ``--init``.

    Raises:
        ValueError / DataError: no ``--data`` or ``--init``, a model without a chat template and no
            ``--chat-template``, or no usable conversation (the bad rows are listed in the notes first).
    """
    d = cfg.data
    if not d.data:
        raise UserError("--task chat needs --data FILE.jsonl (one conversation a line)")
    if not cfg.model.init:
        raise UserError("--task chat fine-tunes a pretrained model; give --init MODEL (e.g. smollm2)")
    init = load_init(cfg.model.init, d.chat_template) if init is None else init
    if init.chat_template is None:
        from attnmask.pretrained.chat import TEMPLATES

        raise UserError(
            f"--init {cfg.model.init}: the model's files carry no chat template; give one with --chat-template "
            f"FILE.jinja or a built-in name ({', '.join(TEMPLATES)})"
        )
    if d.max_len > init.model.config.max_seq_len:
        raise UserError(
            f"--max-len {d.max_len} exceeds the model's context of {init.model.config.max_seq_len} tokens; lower it"
        )
    notes: list[str] = []
    rows = read_chat_jsonl(d.data)
    try:
        train = _tokenize(rows, init, d)
    finally:
        notes += rows.report()
    valid: list[ChatExample] = []
    if d.valid_data:
        vrows = read_chat_jsonl(d.valid_data)
        try:
            valid = _tokenize(vrows, init, d)
        finally:
            notes += vrows.report()
    elif len(train) >= HOLDOUT_MIN_CONVERSATIONS:
        n = min(HOLDOUT_MAX, max(1, int(len(train) * HOLDOUT_FRACTION)))
        train, valid = train[:-n], train[-n:]
        notes.append(f"no --valid-data: held out the last {n} conversations")
    else:
        notes.append(f"no --valid-data and only {len(train)} conversations: no validation split")
    return ChatTask(init=init, train_examples=train, valid_examples=valid, notes=notes, data=d, seed=cfg.run.seed)
