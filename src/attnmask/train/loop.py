"""Teacher-forced training of encoder-decoder translators and decoder-only language models.

One loop, :func:`train`, serves the CLI (``attnmask train``, ``attnmask demo``), the tests and
``torchrun``:

- AdamW (no weight decay on norms, biases and embeddings), linear warmup then cosine decay to
  ``min_lr_ratio * lr``, gradient clipping, optional bfloat16 autocast;
- the loss of a step is the cross-entropy summed over the real target tokens of the *global*
  batch (all micro-batches, all ranks) divided by their number: seed 000's eq. 11 over the batch,
  identical to a single process on the same examples;
- evaluation every ``eval_every`` steps (validation loss, then BLEU/chrF/exact match on greedy
  translations, or perplexity), logged to ``metrics.jsonl``, TensorBoard and a tqdm bar;
- checkpoints written atomically (:mod:`attnmask.train.checkpoint`); ``resume=True`` continues exactly
  where the run stopped (same batches, same random numbers, same losses in float32);
- SIGINT/SIGTERM finish the current step, save, and return; a second SIGINT aborts at once.

Data-parallel: launched by ``torchrun``, each rank draws its own shard of the batches, DDP
all-reduces gradients, rank 0 alone writes files, and evaluation is summed over ranks.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import signal
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
from torch import nn

from attnmask.data import IGNORE_INDEX
from attnmask.model import ModelConfig, Transformer, lm_loss
from attnmask.train import checkpoint, distributed, evaluate, rundir
from attnmask.train.rundir import TASKS
from attnmask.train.tasks import LMCorpus, TranslationCorpus, lm_corpus, translation_corpus

PRECISIONS = ("fp32", "bf16")

# Model sizes; every field can be overridden one by one (TrainConfig.dim, .layers, ...).
MODEL_PRESETS: dict[str, dict] = {
    "tiny": {"dim": 64, "layers": 2, "heads": 4, "ffn_dim": 256},
    "small": {"dim": 256, "layers": 3, "heads": 4, "ffn_dim": 1024},
    "base": {"dim": 512, "layers": 6, "heads": 8, "ffn_dim": 2048},  # the original Transformer base
}

# Settings a resumed run may change; any other difference from the saved config is refused,
# because it would silently change the data, the model or the optimisation.
RESUME_OVERRIDES = ("max_steps", "max_minutes", "device", "eval_every", "save_every", "log_every", "progress", "resume")


@dataclass
class TrainConfig:
    """Everything a training run needs; saved as ``config.json["train"]`` in the run directory."""

    # -- task and data ------------------------------------------------------------------------
    task: str = "translation"  # "translation" (encoder-decoder) or "lm" (decoder-only)
    out: str = "runs/train"  # run directory (created)
    src: str | None = None  # translation: source file, one sentence a line (.gz allowed)
    tgt: str | None = None  # translation: target file, line-aligned with src
    valid_src: str | None = None  # validation pairs; None = hold out the last 5% (max 1000) of src/tgt
    valid_tgt: str | None = None
    builtin_task: str | None = None  # a task of attnmask.data.synthetic instead of files (e.g. "dates")
    train_size: int = 20000  # built-in task: training pairs generated
    valid_size: int = 1000  # built-in task: validation pairs generated
    text: str | None = None  # lm: plain text file
    valid_text: str | None = None  # lm: validation text; None = the last valid_fraction of text
    valid_fraction: float = 0.1
    tokenizer: str = "bpe"  # "bpe" (byte-level, Hugging Face tokenizers) or "char"
    vocab_size: int = 8000  # BPE vocabulary size (specials included)
    joint_vocab: bool = True  # translation: one tokenizer (and embedding) for both sides
    max_len: int = 256  # longest sequence in tokens (specials included); longer training pairs are dropped
    # -- model: a preset, then per-field overrides (None = the preset's / ModelConfig's value) --
    model: str = "small"  # a key of MODEL_PRESETS
    dim: int | None = None
    layers: int | None = None  # decoder layers (and encoder layers unless encoder_layers is set)
    encoder_layers: int | None = None
    heads: int | None = None
    kv_heads: int | None = None  # < heads: grouped-query attention
    ffn_dim: int | None = None
    positions: str | None = None  # sinusoidal | learned | rotary
    norm: str | None = None  # layernorm | rmsnorm
    norm_position: str | None = None  # pre | post
    activation: str | None = None  # relu | gelu | swiglu | ...
    dropout: float = 0.1
    tie_embeddings: bool = True  # W_pred shares the target embedding matrix
    # -- batches ------------------------------------------------------------------------------
    batch_tokens: int = 4096  # translation: padded tokens per batch (per rank); lm: batch_size * block_size
    block_size: int = 128  # lm: tokens per training sequence
    grad_accum: int = 1  # micro-batches per optimizer step
    # -- optimisation -------------------------------------------------------------------------
    lr: float = 5e-4  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup: int = 200  # steps of linear warmup
    weight_decay: float = 0.01  # AdamW decay on weight matrices only
    beta1: float = 0.9
    beta2: float = 0.98
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    label_smoothing: float | None = None  # None = 0.1 for translation, 0 for lm
    # -- budget -------------------------------------------------------------------------------
    max_steps: int | None = 2000  # optimizer steps; also the length of the cosine schedule
    max_minutes: float | None = None  # wall-clock budget of the training loop; the schedule follows it
    # -- evaluation, logging, checkpoints -------------------------------------------------------
    eval_every: int = 500  # steps between evaluations (and at the end); 0 = only at the end
    eval_sentences: int = 500  # translation: validation sentences translated for BLEU/chrF/exact match
    eval_max_tokens: int | None = None  # lm: evaluate on the first N validation tokens (None = all)
    log_every: int = 10  # steps between metrics.jsonl / TensorBoard records
    save_every: int | None = None  # steps between checkpoints; None = eval_every (and at the end)
    # -- runtime ------------------------------------------------------------------------------
    seed: int = 0
    precision: str = "fp32"  # "fp32" or "bf16" (autocast)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    deterministic: bool = False  # torch.use_deterministic_algorithms for bit-identical resumes
    resume: bool = False  # continue the run in `out` from its checkpoint
    progress: bool = True  # show a progress bar

    def __post_init__(self):
        for name, val, allowed in (
            ("task", self.task, TASKS),
            ("precision", self.precision, PRECISIONS),
            ("tokenizer", self.tokenizer, ("bpe", "char")),
            ("model", self.model, tuple(MODEL_PRESETS)),
        ):
            if val not in allowed:
                raise ValueError(f"{name}={val!r}; expected one of {allowed}")
        for name in ("batch_tokens", "block_size", "grad_accum", "max_len", "train_size", "valid_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}; expected a positive int")
        for name in ("warmup", "eval_every", "eval_sentences", "log_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}; expected a non-negative int")
        if self.max_steps is None and self.max_minutes is None:
            raise ValueError("no budget: set max_steps, max_minutes, or both")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps}; expected a positive int")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError(f"max_minutes={self.max_minutes}; expected a positive number")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"lr={self.lr}, min_lr_ratio={self.min_lr_ratio}; expected lr > 0, 0 <= ratio <= 1")
        if self.task == "lm" and self.batch_tokens < self.block_size:
            raise ValueError(
                f"batch_tokens={self.batch_tokens} < block_size={self.block_size}; expected at least one block"
            )

    @property
    def lm_batch_size(self) -> int:
        return max(1, self.batch_tokens // self.block_size)

    @property
    def smoothing(self) -> float:
        if self.label_smoothing is not None:
            return self.label_smoothing
        return 0.1 if self.task == "translation" else 0.0

    @property
    def checkpoint_every(self) -> int:
        return self.eval_every if self.save_every is None else self.save_every

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown TrainConfig fields {sorted(unknown)}; expected some of {sorted(known)}")
        return cls(**d)


def model_config(cfg: TrainConfig, vocab_size: int, src_vocab_size: int | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of ``cfg``: its preset, then every non-None override."""
    preset = MODEL_PRESETS[cfg.model]
    pick = {key: getattr(cfg, key) if getattr(cfg, key) is not None else preset.get(key) for key in preset}
    kwargs = {
        "vocab_size": vocab_size,
        "arch": "encoder_decoder" if cfg.task == "translation" else "decoder",
        "src_vocab_size": src_vocab_size if cfg.task == "translation" else None,
        "dim": pick["dim"],
        "n_layers": pick["layers"],
        "n_encoder_layers": cfg.encoder_layers,
        "n_heads": pick["heads"],
        "n_kv_heads": cfg.kv_heads,
        "ffn_dim": pick["ffn_dim"],
        # translation: the longest kept pair; lm: room to generate past the training block
        "max_seq_len": min(cfg.max_len, cfg.batch_tokens)
        if cfg.task == "translation"
        else max(cfg.block_size, cfg.max_len),
        "dropout": cfg.dropout,
        "tie_embeddings": cfg.tie_embeddings,
    }
    for key in ("positions", "norm", "norm_position", "activation"):
        if getattr(cfg, key) is not None:
            kwargs[key] = getattr(cfg, key)
    return ModelConfig(**kwargs)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on weight matrices; none on norms, biases and embeddings.

    Embeddings are excluded by module type (a tied ``lm_head`` is the embedding, so it follows).
    """
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():  # parameters() yields shared tensors once
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if p.dim() < 2 or id(p) in embedding_ids else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def learning_rate(cfg: TrainConfig, step: int, elapsed_s: float) -> float:
    """Linear warmup over ``cfg.warmup`` steps, then cosine decay to ``lr * min_lr_ratio``.

    Progress through the decay is the further along of steps (of ``max_steps``) and time (of
    ``max_minutes``), so a time-budgeted run reaches the floor when its budget ends.
    """
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = 0.0
    if cfg.max_steps is not None:
        progress = (step - cfg.warmup) / max(1, cfg.max_steps - cfg.warmup)
    if cfg.max_minutes is not None:
        progress = max(progress, elapsed_s / (60.0 * cfg.max_minutes))
    progress = min(1.0, progress)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


@dataclass
class TrainResult:
    path: Path  # run directory
    step: int  # optimizer steps done in total
    stopped: str  # "max_steps", "time budget", or the signal's name
    losses: list[float] = field(default_factory=list)  # training loss of each step run by this call
    eval: dict = field(default_factory=dict)  # the last evaluation
    elapsed_s: float = 0.0  # training-loop wall time, over all resumes
    rank: int = 0  # this process's rank (0 alone wrote the run directory)


StepHook = Callable[[int, nn.Module, dict], None]


def train(
    cfg: TrainConfig, *, on_step: StepHook | None = None, log: Callable[[str], None] | None = None
) -> TrainResult:
    """Train (or resume, with ``cfg.resume``) the run in ``cfg.out``; see the module docstring.

    ``on_step(step, model, record)`` is called on every rank after each optimizer step with the
    unwrapped model and ``{"loss", "lr", "grad_norm", ...}``; an exception in it propagates
    (the tests use it to simulate crashes). ``log`` receives progress lines (rank 0 only).

    Raises:
        ValueError / DataError: bad settings or data (messages name the file and line), a run
            already in ``out`` without ``resume``, or a resume whose settings differ.
    """
    ctx = distributed.setup(cfg.device)
    try:
        return _Trainer(cfg, ctx, on_step, log).run()
    finally:
        distributed.teardown(ctx)


def resume_config(out: str | Path, **overrides) -> TrainConfig:
    """The saved TrainConfig of run ``out`` with ``resume=True`` and the allowed ``overrides``.

    Raises:
        ValueError: ``out`` is not a run directory, or an override is not in RESUME_OVERRIDES.
    """
    overrides.pop("resume", None)
    bad = sorted(set(overrides) - set(RESUME_OVERRIDES))
    if bad:
        raise ValueError(f"cannot change {bad} when resuming; expected only some of {list(RESUME_OVERRIDES)}")
    saved = TrainConfig.from_dict(rundir.read_config(out)["train"])
    return replace(saved, out=str(out), resume=True, **overrides)


class _Trainer:
    """State of one training invocation (kept in a class so that saving can see all of it)."""

    def __init__(self, cfg: TrainConfig, ctx: distributed.Dist, on_step: StepHook | None, log):
        self.cfg, self.ctx, self.on_step = cfg, ctx, on_step
        self.out = Path(cfg.out)
        self._log = log or _default_log
        self.step, self.elapsed = 0, 0.0
        self.signal_name: str | None = None
        saved_state = self._prepare_run_dir()
        self.corpus = self._build_corpus()
        if self.corpus.task == "translation":
            mcfg = model_config(cfg, self.corpus.tokenizer.vocab_size, self.corpus.src_tokenizer.vocab_size)
        else:
            mcfg = model_config(cfg, self.corpus.tokenizer.vocab_size)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.model = Transformer(mcfg).to(ctx.device)
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2)
        )
        self.sampler = self.corpus.sampler(cfg, rank=ctx.rank, world_size=ctx.world_size)
        self._batches = None
        if saved_state is not None:
            self._restore(saved_state)
        elif ctx.is_main and not cfg.resume:
            separate = cfg.task == "translation" and not cfg.joint_vocab
            rundir.write_config(self.out, task=cfg.task, model=mcfg, train=cfg.to_dict(), src_tokenizer=separate)
        distributed.barrier(ctx)
        self.ddp = self.model
        if ctx.enabled:
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = DistributedDataParallel(
                self.model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None
            )
        self.autocast = self._autocast()

    # -- setup --------------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        if self.ctx.is_main:
            self._log(msg)

    def _prepare_run_dir(self) -> dict | None:
        cfg = self.cfg
        if cfg.resume:
            config = rundir.read_config(self.out)
            saved = TrainConfig.from_dict(config["train"])
            differ = [
                f"{f.name}: saved {getattr(saved, f.name)!r}, now {getattr(cfg, f.name)!r}"
                for f in fields(TrainConfig)
                if f.name not in RESUME_OVERRIDES + ("out",) and getattr(saved, f.name) != getattr(cfg, f.name)
            ]
            if differ:
                raise ValueError(f"resume settings differ from the saved run in {self.out}: {'; '.join(differ)}")
            if self.ctx.is_main:
                checkpoint.remove_stale_temporaries(self.out)
            state_file = self.out / rundir.TRAINER_STATE
            if not state_file.is_file():  # stopped before its first checkpoint: start over, same settings
                self.log(f"{self.out} has no checkpoint yet ({rundir.TRAINER_STATE}); starting from step 0")
                if self.ctx.is_main:
                    rundir.truncate_metrics(self.out, 0)
                return None
            state = checkpoint.load_torch(state_file)
            if len(state["ranks"]) != self.ctx.world_size:
                raise ValueError(
                    f"{self.out} was saved by {len(state['ranks'])} processes, this resume has "
                    f"{self.ctx.world_size}; expected the same number (torchrun --nproc-per-node)"
                )
            return state
        if (self.out / rundir.CONFIG).exists():
            raise ValueError(f"{self.out} already holds a run; pass --resume to continue it, or choose another --out")
        if self.ctx.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        return None

    def _build_corpus(self) -> TranslationCorpus | LMCorpus:
        """Rank 0 trains the tokenizers and saves them; the other ranks load them, so all agree."""
        cfg, ctx = self.cfg, self.ctx
        separate = cfg.task == "translation" and not cfg.joint_vocab
        names = {"tgt": rundir.TOKENIZER, "src": rundir.SRC_TOKENIZER if separate else None}
        tokenizers = None
        if cfg.resume or not ctx.is_main:
            distributed.barrier(ctx)  # pairs with rank 0's barrier once the tokenizers are written
            tokenizers = rundir.load_tokenizers(self.out, {"task": cfg.task, "tokenizers": names})
        if cfg.task == "translation":
            corpus = translation_corpus(cfg, tokenizers)
        else:
            corpus = lm_corpus(cfg, None if tokenizers is None else tokenizers[0])
        if not cfg.resume and ctx.is_main:
            corpus.tokenizer.save(self.out / rundir.TOKENIZER)
            if separate:
                corpus.src_tokenizer.save(self.out / rundir.SRC_TOKENIZER)
            distributed.barrier(ctx)
        for note in corpus.notes:
            self.log(f"data: {note}")
        return corpus

    def _autocast(self):
        if self.cfg.precision != "bf16":
            return contextlib.nullcontext
        device_type = self.ctx.device.type
        if device_type == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            warnings.warn(
                "this CPU has no native bfloat16 (AVX512-BF16/AMX): bf16 is emulated and likely slower than fp32",
                stacklevel=3,
            )
        return lambda: torch.autocast(device_type=device_type, dtype=torch.bfloat16)

    # -- checkpoints --------------------------------------------------------------------------
    def _restore(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        mine = state["ranks"][self.ctx.rank]
        self.sampler.load_state_dict(mine["data"])
        checkpoint.set_rng_state(mine["rng"])
        self.step, self.elapsed = int(state["step"]), float(state["elapsed"])
        if self.ctx.is_main:
            rundir.truncate_metrics(self.out, self.step)  # the steps after the checkpoint run again
        self.log(f"resumed {self.out} at step {self.step}")

    def save(self) -> None:
        """Write both checkpoint files (rank 0), with every rank's RNG and data position."""
        mine = {"rng": checkpoint.rng_state(), "data": self.sampler.state_dict()}
        ranks = distributed.all_gather_objects(self.ctx, mine)
        if not self.ctx.is_main:
            return
        state = {
            "format": rundir.FORMAT_VERSION,
            "step": self.step,
            "elapsed": self.elapsed,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "ranks": ranks,
        }
        # trainer_state.pt first: it alone is read on resume, and it holds the weights too.
        checkpoint.save_torch(self.out / rundir.TRAINER_STATE, state)
        checkpoint.save_weights(self.out / rundir.WEIGHTS, self.model, {"step": str(self.step)})

    # -- one step -----------------------------------------------------------------------------
    def _next_batch(self):
        if self.corpus.task == "lm":
            x, y = self.sampler.next_batch()  # (B, T), (B, T)
            return x.to(self.ctx.device), None, y.to(self.ctx.device), 0.0
        while True:
            if self._batches is None:
                self._batches = iter(self.sampler)
            try:
                idx = next(self._batches)
                break
            except StopIteration:  # epoch done; the next iter() starts the following one
                self._batches = None
        b = self.corpus.batch(idx).to(self.ctx.device)
        return b.tgt_in, b.src, b.labels, b.padding_fraction

    def train_step(self) -> dict:
        cfg, ctx = self.cfg, self.ctx
        micro = [self._next_batch() for _ in range(cfg.grad_accum)]
        local_tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, _, labels, _ in micro)
        (global_tokens,) = distributed.all_reduce_sum(ctx, [local_tokens])
        lr = learning_rate(cfg, self.step, self.elapsed)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        for k, (inp, src, labels, _) in enumerate(micro):
            sync = k == len(micro) - 1 or not ctx.enabled
            with contextlib.nullcontext() if sync else self.ddp.no_sync(), self.autocast():
                logits = self.ddp(inp, src).logits  # (B, T, V)
            part, _ = lm_loss(logits, labels, label_smoothing=cfg.smoothing, reduction="sum")
            # DDP averages gradients over ranks: scaling by world_size / global tokens turns that
            # average into the mean over every real token of the global batch.
            (part * (ctx.world_size / max(global_tokens, 1))).backward()
            loss_sum += float(part.detach())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip or float("inf")))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        (loss_total,) = distributed.all_reduce_sum(ctx, [loss_sum])
        return {
            "loss": loss_total / max(global_tokens, 1),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": int(global_tokens),
            "padding_fraction": sum(m[3] for m in micro) / len(micro),
        }

    def evaluate(self) -> dict:
        cfg = self.cfg
        if self.corpus.task == "translation":
            return evaluate.evaluate_translation(
                self.model, self.corpus, self.ctx, batch_tokens=cfg.batch_tokens,
                max_sentences=cfg.eval_sentences, autocast=self.autocast,
            )  # fmt: skip
        return evaluate.evaluate_lm(
            self.model, self.corpus, self.ctx, block_size=cfg.block_size, batch_size=cfg.lm_batch_size,
            max_tokens=cfg.eval_max_tokens, autocast=self.autocast,
        )  # fmt: skip

    # -- the loop -----------------------------------------------------------------------------
    def _should_stop(self) -> str | None:
        """Agree across ranks: a signal on any rank, or rank 0's clock, stops everyone at the same step."""
        cfg = self.cfg
        steps_done = cfg.max_steps is not None and self.step >= cfg.max_steps
        time_up = cfg.max_minutes is not None and self.elapsed >= 60.0 * cfg.max_minutes and self.ctx.is_main
        sig, timed = distributed.all_reduce_sum(self.ctx, [float(self.signal_name is not None), float(time_up)])
        if sig:
            return self.signal_name or "signal (another rank)"
        if steps_done:
            return "max_steps"
        if timed:
            return "time budget"
        return None

    def _install_signals(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum, frame):
            if self.signal_name is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # second Ctrl-C: stop now, without saving
            self.signal_name = signal.Signals(signum).name

        return {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}

    def _describe(self) -> None:
        cfg, m = self.cfg, self.model.config
        n_params = self.model.num_parameters()
        what = (
            f"{m.arch} {cfg.model} (dim {m.dim}, {m.n_layers} layers, {m.n_heads} heads, "
            f"{m.positions}, {m.norm}, {m.activation})"
        )
        self.log(f"model: {what}, {n_params / 1e6:.2f}M parameters")
        if isinstance(self.corpus, TranslationCorpus):
            pf = self.sampler.padding_fraction()
            self.log(
                f"data: {len(self.corpus.train_src)} training pairs, {len(self.corpus.valid_src)} validation pairs, "
                f"vocabulary {self.corpus.tokenizer.vocab_size}, {len(self.sampler)} batches/epoch/rank, "
                f"padding {pf:.1%}"
            )
        else:
            self.log(
                f"data: {self.corpus.train_ids.numel()} training / {self.corpus.valid_ids.numel()} validation tokens, "
                f"vocabulary {self.corpus.tokenizer.vocab_size}, batches of {cfg.lm_batch_size} x {cfg.block_size}"
            )
        if self.ctx.enabled:
            self.log(f"distributed: {self.ctx.world_size} processes ({torch.distributed.get_backend()})")

    def run(self) -> TrainResult:
        cfg, ctx = self.cfg, self.ctx
        self._describe()
        self._writer = self._metrics = None
        bar = None
        old_handlers = self._install_signals()
        prev_det = torch.are_deterministic_algorithms_enabled()
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True)
        result = TrainResult(path=self.out, step=self.step, stopped="", rank=ctx.rank)
        try:
            if ctx.is_main:
                from torch.utils.tensorboard import SummaryWriter
                from tqdm.auto import tqdm

                purge = self.step if cfg.resume else None
                self._writer = SummaryWriter(str(self.out / rundir.TENSORBOARD), purge_step=purge)
                # closed in `finally` below; a context manager would not outlive the loop's helpers
                self._metrics = open(self.out / rundir.METRICS, "a", encoding="utf-8")  # noqa: SIM115
                bar = tqdm(total=cfg.max_steps, initial=self.step, unit="step", dynamic_ncols=True,
                           disable=not cfg.progress, desc="train")  # fmt: skip
            self._loop(result, bar)
            if bar is not None:
                bar.close()
            signalled = result.stopped not in ("max_steps", "time budget")
            if not signalled and (self._last_eval != self.step or not result.eval):
                result.eval = self.evaluate()
                self._record({"step": self.step, "split": "valid", **result.eval})
                self.log(f"step {self.step}: {_fmt(result.eval)}")
            if self._last_save != self.step or not (self.out / rundir.TRAINER_STATE).exists():
                self.save()
            if signalled:
                self.log(f"stopped by {result.stopped} at step {self.step}; checkpoint saved, continue with --resume")
            if ctx.is_main:
                self._metrics.close()
                rundir.plot_losses(self.out)
        finally:
            if bar is not None:
                bar.close()
            if self._writer is not None:
                self._writer.close()
            if self._metrics is not None:
                self._metrics.close()
            for s, h in old_handlers.items():
                signal.signal(s, h)
            torch.use_deterministic_algorithms(prev_det)
        result.step, result.elapsed_s = self.step, self.elapsed
        return result

    def _record(self, rec: dict) -> None:
        """One metrics.jsonl line and its TensorBoard scalars (rank 0)."""
        if not self.ctx.is_main:
            return
        self._metrics.write(json.dumps(rec) + "\n")
        self._metrics.flush()
        for key, val in rec.items():
            if key not in ("step", "split") and isinstance(val, (int, float)):
                self._writer.add_scalar(f"{rec['split']}/{key}", val, rec["step"])

    def _loop(self, result: TrainResult, bar) -> None:
        cfg = self.cfg
        window: list[dict] = []
        start_elapsed, loop_start = self.elapsed, time.perf_counter()
        window_start, paused = loop_start, 0.0  # paused: evaluation/saving time inside the window
        self._last_eval = self._last_save = self.step
        self.model.train()
        while True:
            self.elapsed = start_elapsed + time.perf_counter() - loop_start
            stop = self._should_stop()
            if stop:
                result.stopped = stop
                return
            rec = self.train_step()
            self.elapsed = start_elapsed + time.perf_counter() - loop_start  # as saved with this step
            result.losses.append(rec["loss"])
            window.append(rec)
            if self.on_step is not None:
                self.on_step(self.step, self.model, rec)
            if cfg.log_every and self.step % cfg.log_every == 0:
                now = time.perf_counter()
                entry = {
                    "step": self.step,
                    "split": "train",
                    "loss": sum(r["loss"] for r in window) / len(window),
                    "lr": rec["lr"],
                    "grad_norm": rec["grad_norm"],
                    "tokens_per_s": sum(r["tokens"] for r in window) / max(now - window_start - paused, 1e-9),
                    "padding_fraction": sum(r["padding_fraction"] for r in window) / len(window),
                    "elapsed_s": start_elapsed + now - loop_start,
                }
                self._record(entry)
                if bar is not None:
                    bar.set_postfix(loss=f"{entry['loss']:.3f}", tok_s=f"{entry['tokens_per_s']:.0f}", refresh=False)
                window, window_start, paused = [], now, 0.0
            if bar is not None:
                bar.update(1)
            t0 = time.perf_counter()
            if cfg.eval_every and self.step % cfg.eval_every == 0:
                result.eval = self.evaluate()
                self._last_eval = self.step
                self._record({"step": self.step, "split": "valid", **result.eval})
                self.log(f"step {self.step}: {_fmt(result.eval)}")
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                self.save()
                self._last_save = self.step
            paused += time.perf_counter() - t0  # evaluation and saving stay out of tokens/s


def _default_log(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(msg)  # keeps an active progress bar intact


def _fmt(metrics: dict) -> str:
    """``loss 1.234, bleu 30.12, exact_match 97.10%`` for a log line."""
    formats = {"loss": "{:.3f}", "ppl": "{:.2f}", "bleu": "{:.2f}", "chrf": "{:.2f}", "exact_match": "{:.2%}"}
    return ", ".join(f"{key} {fmt.format(metrics[key])}" for key, fmt in formats.items() if key in metrics)
