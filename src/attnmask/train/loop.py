"""Teacher-forced training of encoder-decoder translators and decoder-only language models.

One loop, :func:`train`, serves the CLI (``attnmask train``, ``attnmask demo``), the tests and
``torchrun``:

- AdamW (fused; no weight decay on norms, biases and embeddings), linear warmup then cosine decay to
  ``min_lr_ratio * lr``, gradient clipping, optional bfloat16 autocast;
- the loss of a step is the cross-entropy summed over the real target tokens of the *global*
  batch (all micro-batches, all ranks) divided by their number: seed 000's eq. 11 over the batch,
  identical to a single process on the same examples;
- evaluation every ``eval_every`` steps (validation loss, then BLEU/chrF/exact match on greedy
  translations, or perplexity), logged to ``metrics.jsonl``, TensorBoard and a tqdm bar;
- checkpoints written atomically (:mod:`attnmask.train.checkpoint`); ``resume=True`` continues exactly
  where the run stopped (same batches, same random numbers, same losses in float32);
- SIGINT/SIGTERM finish the current step, save, and return; a second SIGINT aborts at once.
  A signal the process inherited as ignored (``nohup``, a background job's SIGINT) stays ignored,
  as Python itself leaves it; the handlers found are restored afterwards.
- ``max_minutes`` is the budget of *this* invocation's loop: a resume with ``--max-minutes 5``
  trains five more minutes. A time-budgeted schedule decays to its floor at the end of the budget.

The loop knows no task by name: a :class:`~attnmask.train.tasks.TrainingTask` builds batches
(one ahead, on a background thread: :class:`~attnmask.train.prefetch.Prefetcher`), evaluates and
describes itself; :class:`~attnmask.train.rundir.RunDir` owns the files and
:class:`~attnmask.train.logger.TrainLogger` every report.

Data-parallel: launched by ``torchrun``, each rank draws its own shard of the batches, DDP
all-reduces gradients, rank 0 alone writes files, and evaluation is summed over ranks. With
``--fsdp`` the model, gradients and optimizer state are sharded instead (:mod:`attnmask.train.fsdp`),
and the sharded checkpoints resume on any number of processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from attnmask import allocator, linear
from attnmask.data.collate import IGNORE_INDEX, PAD_SEGMENT
from attnmask.errors import UserError
from attnmask.model import Transformer
from attnmask.model.lora import add_lora, load_lora, lora_modules, lora_state_dict
from attnmask.model.loss import head_loss
from attnmask.train import checkpoint, distributed, fsdp, precision
from attnmask.train.chat import chat_task
from attnmask.train.config import RESUME_OVERRIDES, OptimConfig, TrainConfig, resume_changes
from attnmask.train.logger import TrainLogger
from attnmask.train.prefetch import Prefetcher
from attnmask.train.rundir import ADAPTERS, FORMAT_VERSION, TRAINER_STATE, WEIGHTS, RunDir
from attnmask.train.tasks import Batch, TrainingTask, build_task

COMPILE_ROUND_TO = 16  # --compile: batch lengths rounded up to a multiple of this, so few shapes compile
# Off the CPU, attention runs compiled FlexAttention, whose kernel and BlockMask builder specialize on the
# batch's length: lengths rounded up to its block size (128) leave one shape where packed rows of N tokens
# would otherwise give a new length (and a compile) almost every step.
ACCELERATOR_ROUND_TO = 128


def compile_failure(err: BaseException) -> str:
    """``"Type: first line"`` of the error under torch.compile's wrappers: what went wrong, in one line."""
    root = err
    while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
        root = inner
    lines = str(root).strip().splitlines()
    return f"{type(root).__name__}: {lines[0] if lines else ''}"


def length_multiple(device: torch.device, compiled: bool) -> int:
    """What a step's batch lengths are padded up to a multiple of (0: left as built): the block size
    of FlexAttention off the CPU, :data:`COMPILE_ROUND_TO` for a compiled step, else nothing."""
    return max(COMPILE_ROUND_TO if compiled else 0, ACCELERATOR_ROUND_TO if device.type != "cpu" else 0)


def round_lengths(b: Batch, multiple: int, pad_id: int | None, limit: int | None = None) -> Batch:
    """``b`` with its time dimensions padded up to a multiple of ``multiple``: pad ids (masked as
    padding by the model), ``IGNORE_INDEX`` labels, :data:`PAD_SEGMENT` segments. The loss is
    unchanged; a compiled step sees a handful of shapes instead of one per batch. ``limit``: never
    past this length (a model with a position table of ``max_seq_len`` entries numbers unsegmented
    padding too), so a batch near it grows to ``limit`` exactly, one more shape."""

    def grow(t: torch.Tensor | None, fill: int) -> torch.Tensor | None:
        if t is None or t.shape[-1] % multiple == 0:
            return t
        target = t.shape[-1] + multiple - t.shape[-1] % multiple
        if limit is not None:
            target = max(t.shape[-1], min(target, limit))
        return torch.nn.functional.pad(t, (0, target - t.shape[-1]), value=fill)

    pad = 0 if pad_id is None else pad_id
    return dataclasses.replace(
        b,
        inputs=grow(b.inputs, pad),
        src=grow(b.src, pad),
        labels=grow(b.labels, IGNORE_INDEX),
        segments=grow(b.segments, PAD_SEGMENT),
        src_segments=grow(b.src_segments, PAD_SEGMENT),
    )


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


def learning_rate(
    cfg: TrainConfig | OptimConfig, step: int, elapsed_s: float, time_end_s: float | None = None
) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to ``lr * min_lr_ratio``.

    Progress through the decay is the further along of steps (of ``max_steps``) and time
    (``elapsed_s`` of ``time_end_s``, by default ``max_minutes``), so a time-budgeted run
    reaches the floor when its budget ends.
    """
    opt = cfg.optim if isinstance(cfg, TrainConfig) else cfg
    if step < opt.warmup:
        return opt.lr * (step + 1) / opt.warmup
    progress = 0.0
    if opt.max_steps is not None:
        progress = (step - opt.warmup) / max(1, opt.max_steps - opt.warmup)
    if opt.max_minutes is not None:
        end = 60.0 * opt.max_minutes if time_end_s is None else time_end_s
        progress = max(progress, elapsed_s / max(end, 1e-9))
    progress = min(1.0, progress)
    floor = opt.lr * opt.min_lr_ratio
    return floor + 0.5 * (opt.lr - floor) * (1.0 + math.cos(math.pi * progress))


@dataclass
class TrainResult:
    path: Path  # run directory
    step: int  # optimizer steps done in total
    stopped: str  # "max_steps", "time budget", or the signal's name ("SIGINT", "SIGTERM")
    losses: list[float] = field(default_factory=list)  # training loss of each step run by this call
    eval: dict = field(default_factory=dict)  # the last evaluation
    elapsed_s: float = 0.0  # training-loop wall time, over all resumes
    rank: int = 0  # this process's rank (0 alone wrote the run directory)

    @property
    def signalled(self) -> bool:
        return self.stopped not in ("max_steps", "time budget")


StepHook = Callable[[int, nn.Module, dict], None]


def train(
    cfg: TrainConfig, *, on_step: StepHook | None = None, log: Callable[[str], None] | None = None
) -> TrainResult:
    """Train (or resume, with ``cfg.run.resume``) the run in ``cfg.run.out``; see the module docstring.

    ``on_step(step, model, record)`` is called on every rank after each optimizer step with the
    unwrapped model and ``{"loss", "lr", "grad_norm", ...}``; an exception in it propagates
    (the tests use it to simulate crashes). ``log`` receives progress lines (rank 0 only).

    Raises:
        ValueError / DataError: bad settings or data (messages name the file and line), a run
            already in ``out`` without ``resume``, a resume whose settings differ, or a damaged
            checkpoint. A run that fails before its first file is written leaves no directory.
    """
    ctx = distributed.setup(cfg.run.device, fsdp=cfg.run.fsdp)
    finished = False
    try:
        result = Trainer(cfg, ctx, on_step=on_step, log=log).run()
        finished = True
    finally:
        distributed.teardown(ctx, finished=finished)
    return result


class Trainer:
    """One training invocation: the model, optimizer and task, stepped until the budget ends."""

    def __init__(self, cfg: TrainConfig, ctx: distributed.Dist, *, on_step: StepHook | None = None, log=None):
        self.cfg, self.ctx, self.on_step = cfg, ctx, on_step
        self.dir = RunDir(cfg.run.out)
        self.logger = TrainLogger(self.dir.path, is_main=ctx.is_main, log=log)
        self.step, self.elapsed = 0, 0.0
        self.signal_name: str | None = None
        self._resumed_engine: str | None = None
        self.grad_accum = cfg.optim.grad_accum  # micro-batches of this rank a step (--fsdp resumes adapt it)
        self.sharded: fsdp.Sharded | None = None  # --fsdp: the sharded model's root unit
        self._precision: tuple[str, str] | None = None  # (precision, why): _choose_precision's, rank 0's
        created = False
        try:
            state = self._check_run_dir()
            distributed.barrier(ctx)  # every rank has looked at the directory before rank 0 writes into it
            # Rank 0 reads the data and trains the tokenizers; a resume, and the other ranks once
            # rank 0 has saved them, load the saved tokenizers, so every rank agrees.
            task = None
            if cfg.run.resume or ctx.is_main:
                task = self._build_task(from_dir=cfg.run.resume)
            if ctx.is_main and not cfg.run.resume:
                created = self.dir.create()
                self.dir.save_tokenizers(task.tokenizer, task.src_tokenizer if self._separate_source else None,
                                         getattr(task, "chat_template", None))  # fmt: skip
                config = task.model_config(cfg.model)  # checked before config.json is written
                self.dir.write_config(task=task.name, model=config, train=cfg.to_dict(),
                                      src_tokenizer=self._separate_source)  # fmt: skip
            distributed.barrier(ctx)
            self.task = task if task is not None else self._build_task(from_dir=True)
            self.model = self._build_model()
        except BaseException:
            if created and not self.dir.has_checkpoint:  # nothing of value in it: leave no trace
                shutil.rmtree(self.dir.path, ignore_errors=True)
            raise
        # The precision the run computes in, chosen once before anything depends on it (--fsdp shards the
        # weights in it), every rank taking rank 0's: the ranks' products, and FSDP's shards, must agree.
        self._precision = distributed.all_gather_objects(ctx, self._choose_precision(state))[0]
        if cfg.run.fsdp:
            self.sharded = fsdp.shard(self.model, ctx, bf16=self._precision[0] == "bf16")
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, cfg.optim.weight_decay),
            lr=cfg.optim.lr,
            betas=(cfg.optim.beta1, cfg.optim.beta2),
            # one kernel for every parameter instead of ~10 ops per tensor: 3.8 against 14.8 ms a step
            # for 7.8M parameters on a 2-core Zen 5 (docs/benchmarks.md)
            fused=ctx.device.type in ("cpu", "cuda") or None,
        )
        self.task.start(rank=ctx.rank, world_size=ctx.world_size, device=ctx.device)
        if state is not None:
            self._restore(state)
        self.batches = Prefetcher(self.task)  # the next batch is built while a step runs
        self.ddp = self.model
        if ctx.enabled and self.sharded is None:
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = DistributedDataParallel(
                self.model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None
            )
        self.autocast = self._autocast()
        # the model step, compiled with --compile (eager again, with one notice, if compiling fails)
        self.forward = torch.compile(self.ddp) if cfg.run.compile else self.ddp
        # batch lengths padded up to a multiple of this (0: as built), so that compiled code sees few
        # shapes, never past a position table's end
        mc = self.model.config
        self._round_to = length_multiple(ctx.device, cfg.run.compile)
        self._round_limit = None if mc.positions == "rotary" else mc.max_seq_len

    # -- setup --------------------------------------------------------------------------------
    @property
    def _separate_source(self) -> bool:
        return self.cfg.data.task == "translation" and not self.cfg.data.joint_vocab

    def _check_run_dir(self) -> dict | None:
        """The resume state to restore (None = start at step 0); refuses what cannot be resumed."""
        cfg, ctx = self.cfg, self.ctx
        if not cfg.run.resume:
            if self.dir.holds_run:
                raise UserError(
                    f"{self.dir} already holds a run; pass --resume to continue it, or choose another --out"
                )
            return None
        saved = TrainConfig.from_dict(self.dir.read_config()["train"])
        differ = resume_changes(saved, {k: v for k, v in cfg.flat().items() if k not in RESUME_OVERRIDES})
        if differ:
            raise UserError(f"resume settings differ from the saved run in {self.dir}: {'; '.join(differ)}")
        if ctx.is_main:
            self.dir.remove_stale_temporaries()
        if not self.dir.has_checkpoint:  # stopped before its first checkpoint: start over, same settings
            self.logger.line(f"{self.dir} has no checkpoint yet ({TRAINER_STATE}); starting from step 0")
            if ctx.is_main:
                self.dir.truncate_metrics(0)
            return None
        state = self.dir.load_trainer_state()
        if len(state["ranks"]) != ctx.world_size and not cfg.run.fsdp:  # sharded checkpoints reshard
            raise UserError(
                f"{self.dir} was saved by {len(state['ranks'])} processes, this resume has "
                f"{ctx.world_size}; expected the same number (torchrun --nproc-per-node)"
            )
        return state

    def _build_task(self, *, from_dir: bool) -> TrainingTask:
        if self.cfg.data.task == "chat":  # the tokenizer is --init's own, loaded with the model
            task = chat_task(self.cfg)
            for note in task.notes:
                self.logger.line(f"data: {note}")
            return task
        tokenizers = self.dir.load_tokenizers(self.cfg.data.task, self._separate_source) if from_dir else None
        task = build_task(self.cfg, tokenizers)
        for note in task.notes:
            self.logger.line(f"data: {note}")
        return task

    def _build_model(self) -> Transformer:
        cfg = self.cfg
        torch.manual_seed(cfg.run.seed)
        random.seed(cfg.run.seed)
        if cfg.model.init is None:
            return Transformer(self.task.model_config(cfg.model)).to(self.ctx.device)
        model = self.task.pretrained_model()
        if cfg.model.lora_rank:  # adapters drawn from the run's seed: every rank draws the same
            add_lora(model, rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha, targets=cfg.model.lora_targets)
        return model.to(self.ctx.device)

    def _weights_state(self) -> dict:
        """What a checkpoint keeps of the model: the LoRA adapters alone, or every weight."""
        return lora_state_dict(self.model) if lora_modules(self.model) else self.model.state_dict()

    def _choose_precision(self, state: dict | None) -> tuple[str, str]:
        """(precision, why): ``--precision`` as given, or ``auto``'s choice on this machine; a resumed
        ``auto`` run keeps the precision it began in (its trainer state says which), on whatever machine
        it resumes, sharded or not."""
        chosen, why = precision.choose(self.cfg.run.precision, self.ctx.device)
        began = state.get("precision") if state is not None else None  # absent in runs saved before it was kept
        if self.cfg.run.precision == "auto" and began in ("fp32", "bf16"):
            if began != chosen:
                why = f"auto: as the run began (this machine would take {chosen})"
            chosen = began
        return chosen, why

    def _autocast(self):
        self.precision, why = self._precision
        self.logger.line(f"precision: {self.precision} ({why})")
        if self.ctx.device.type == "cpu":
            # one library for every rank and for the whole run, resumes included: the same sums
            # in the same order, so a resumed run reproduces the uninterrupted one
            if self._resumed_engine is not None:
                chosen = linear.set_engine(self._resumed_engine)
                why = "as the run began" if chosen == self._resumed_engine else linear.engine_reason()
            else:
                chosen, why = distributed.all_gather_objects(self.ctx, linear.engine())[0], linear.engine_reason()
                if chosen != linear.engine():
                    linear.set_engine(chosen)
                    why = "rank 0's choice"
            self.logger.line(f"float32 products: {linear.LIBRARIES[chosen]} ({why})")
            # what the process's owner chose (the CLI: ATTNMASK_MALLOC); a library never sets it
            self.logger.line(f"memory: {allocator.current_policy()}")
        if self.precision != "bf16":
            return contextlib.nullcontext
        device_type = self.ctx.device.type
        if device_type == "cpu" and not linear.fast_bf16_products():
            warnings.warn(
                "this CPU has no native bfloat16 (AVX512-BF16/AMX): bf16 products run as float32 ones on bf16-rounded "
                "operands, no faster than fp32",
                stacklevel=3,
            )
        return lambda: torch.autocast(device_type=device_type, dtype=torch.bfloat16)

    # -- checkpoints --------------------------------------------------------------------------
    def _restore(self, state: dict) -> None:
        if self.sharded is not None:
            mine = self._restore_sharded(state)
        else:
            if lora_modules(self.model):
                load_lora(self.model, state["model"])
            else:
                self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            mine = state["ranks"][self.ctx.rank]
        if mine["data"] is not None:
            self.task.load_state_dict(mine["data"])
        checkpoint.set_rng_state(mine["rng"])
        self.step, self.elapsed = int(state["step"]), float(state["elapsed"])
        self._resumed_engine = state.get("matmul_engine")  # absent in runs saved before it was kept
        if self.ctx.is_main:
            self.dir.truncate_metrics(self.step)  # the steps after the checkpoint run again
        name = ADAPTERS if lora_modules(self.model) else WEIGHTS
        if self.sharded is not None and not self.dir.weights_readable(name):  # every rank gathers
            fsdp.save_weights(self.sharded, self.dir, int(state["step"]), self.ctx)
            self.logger.line(f"{self.dir / name} was damaged; rewrote it from the sharded checkpoint")
        elif self.ctx.is_main and self.sharded is None and not self.dir.weights_readable(name):
            # e.g. cut short by a full disk after trainer_state.pt
            self.dir.save_weights(self.model, self.step)
            self.logger.line(f"{self.dir / name} was damaged; rewrote it from {TRAINER_STATE} (step {self.step})")
        self.logger.line(f"resumed {self.dir} at step {self.step}")

    def _restore_sharded(self, state: dict) -> dict:
        """Model and optimizer shards for this number of processes; this rank's data position and
        random state; the accumulation that keeps the run's global batch."""
        ctx, saved = self.ctx, len(state["ranks"])
        fsdp.load(self.sharded, self.optimizer, self.dir / state["sharded"])
        self.grad_accum = fsdp.accumulation(state["micro_batches"], ctx.world_size, saved, self.dir)
        data, note = fsdp.data_state([r["data"] for r in state["ranks"]], ctx.rank, ctx.world_size)
        if saved != ctx.world_size:
            each = f"{self.grad_accum} micro-batch{'es' if self.grad_accum != 1 else ''}"
            self.logger.line(
                f"resuming on {ctx.world_size} process{'es' if ctx.world_size != 1 else ''} a run saved by {saved}: "
                f"{each} a process and step ({state['micro_batches']} in all, as before)"
            )
        for line in distributed.all_gather_objects(ctx, note):
            if line:
                self.logger.line(line)
        return {"data": data, "rng": state["ranks"][ctx.rank % saved]["rng"]}

    def save(self) -> None:
        """Write both checkpoint files (rank 0), with every rank's RNG and data position."""
        mine = {"rng": checkpoint.rng_state(), "data": self.batches.state_dict()}
        ranks = distributed.all_gather_objects(self.ctx, mine)
        if self.sharded is not None:
            state = {
                "format": FORMAT_VERSION, "step": self.step, "elapsed": self.elapsed, "ranks": ranks,
                "micro_batches": self.ctx.world_size * self.grad_accum, "matmul_engine": linear.engine(),
                "precision": self.precision,
            }  # fmt: skip
            fsdp.save(self.sharded, self.optimizer, self.dir, state, self.ctx)
            return
        if not self.ctx.is_main:
            return
        state = {
            "format": FORMAT_VERSION,
            "step": self.step,
            "elapsed": self.elapsed,
            "model": self._weights_state(),
            "optimizer": self.optimizer.state_dict(),
            "ranks": ranks,
            "matmul_engine": linear.engine(),
            "precision": self.precision,
        }
        self.dir.save_checkpoint(state, self.model)

    # -- one step -----------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One optimizer step. Reads nothing back from the device: the loss and gradient norm
        stay tensors until :meth:`_settle` reads a window of them at once."""
        cfg, ctx = self.cfg, self.ctx
        micro: list[Batch] = [self.batches.next_batch() for _ in range(self.grad_accum)]
        (global_tokens,) = distributed.all_reduce_sum(ctx, [sum(b.tokens for b in micro)])
        lr = learning_rate(cfg.optim, self.step, self.elapsed, self._time_end)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = None
        for k, b in enumerate(micro):
            sync = k == len(micro) - 1 or not ctx.enabled
            if self._round_to:
                b = round_lengths(b, self._round_to, self.model.config.pad_id, self._round_limit)
            if self.sharded is not None:  # FSDP reduce-scatters every micro-batch's gradients
                with self.autocast():
                    part = self.sharded.root(b.inputs, b.src, b.labels, b.segments, b.src_segments,
                                             label_smoothing=cfg.label_smoothing)  # fmt: skip
            else:
                with contextlib.nullcontext() if sync else self.ddp.no_sync(), self.autocast():
                    hidden = self._hidden(b)  # (B, T, C)
                    # W_pred and the summed cross-entropy in chunks, never the (B, T, V) logits
                    part = head_loss(hidden, self.model.lm_head, b.labels, label_smoothing=cfg.label_smoothing)
            # DDP (and FSDP) averages gradients over ranks: scaling by world_size / global tokens turns that
            # average into the mean over every real token of the global batch.
            (part * (ctx.world_size / max(global_tokens, 1))).backward()
            loss_sum = part.detach().float() if loss_sum is None else loss_sum + part.detach().float()
        clip = cfg.optim.grad_clip or float("inf")
        grad_norm = fsdp.full_norm(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {
            "loss_sum": loss_sum,  # this rank's summed loss (a device scalar until settled)
            "lr": lr,
            "grad_norm": grad_norm.detach(),
            "tokens": int(global_tokens),
            "padding_fraction": sum(b.padding_fraction for b in micro) / len(micro),
        }

    def _hidden(self, b: Batch) -> torch.Tensor:
        kwargs = {"segments": b.segments, "src_segments": b.src_segments, "return_hidden": True}
        if self.forward is not self.ddp:
            try:
                return self.forward(b.inputs, b.src, **kwargs).hidden
            except Exception as err:  # no C++ compiler, no triton, an unsupported op: train eagerly
                why = compile_failure(err)
                self.logger.line(f"attnmask: torch.compile unavailable, training without it ({why})")
                self.forward = self.ddp
        return self.ddp(b.inputs, b.src, **kwargs).hidden

    def _settle(self, pending: list[dict], result: TrainResult) -> None:
        """Turn the records of unsettled steps into numbers: one device read and (with several
        processes) one collective for the whole window, at log, evaluation and save points."""
        if not pending:
            return
        local = torch.stack([r.pop("loss_sum") for r in pending]).tolist()
        norms = torch.stack([r["grad_norm"].float() for r in pending]).tolist()
        totals = distributed.all_reduce_sum(self.ctx, local)
        for rec, total, norm in zip(pending, totals, norms):
            rec["loss"], rec["grad_norm"] = total / max(rec["tokens"], 1), norm
            result.losses.append(rec["loss"])
        pending.clear()

    def evaluate(self) -> dict:
        if self.sharded is None:
            return self.task.evaluate(self.model, self.ctx, self.autocast)
        with self.sharded.gathered() as model:  # the full weights on every rank, for this evaluation
            return self.task.evaluate(model, self.ctx, self.autocast)

    # -- the loop -----------------------------------------------------------------------------
    def _should_stop(self, invocation_s: float) -> str | None:
        """Agree across ranks: a signal on any rank, or rank 0's clock, stops everyone at the same step."""
        opt = self.cfg.optim
        steps_done = opt.max_steps is not None and self.step >= opt.max_steps
        time_up = opt.max_minutes is not None and invocation_s >= 60.0 * opt.max_minutes and self.ctx.is_main
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

        found = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        # an inherited SIG_IGN (nohup, `cmd &`) is the caller's choice: leave it, as Python does
        return {s: signal.signal(s, handler) for s, old in found.items() if old is not signal.SIG_IGN}

    def _describe(self) -> None:
        cfg, m = self.cfg, self.model.config
        name = f"--init {cfg.model.init}" if cfg.model.init else cfg.model.preset
        what = (
            f"{m.arch} {name} (dim {m.dim}, {m.n_layers} layers, {m.n_heads} heads, "
            f"{m.positions}, {m.norm}, {m.activation})"
        )
        trainable = sum(p.numel() for p in {id(p): p for p in self.model.parameters() if p.requires_grad}.values())
        total = self.model.num_parameters()
        self.logger.line(f"model: {what}, {total / 1e6:.2f}M parameters, {trainable / 1e6:.2f}M trained")
        if cfg.model.lora_rank:
            self.logger.line(
                f"LoRA: rank {cfg.model.lora_rank}, alpha {cfg.model.lora_alpha}, "
                f"on {len(lora_modules(self.model))} layers ({cfg.model.lora_targets})"
            )
        o = cfg.optim
        self.logger.line(f"optimizer: lr {o.lr:g}, warmup {o.warmup}, cosine to {o.min_lr_ratio:g} x lr, "
                         f"weight decay {o.weight_decay:g}")  # fmt: skip
        self.logger.line(f"data: {self.task.describe()}")
        if self.sharded is not None:
            how = "bfloat16 gathers, float32 reductions" if self._precision[0] == "bf16" else "float32"
            n = self.ctx.world_size
            self.logger.line(f"distributed: FSDP over {n} process{'es' if n != 1 else ''} "
                             f"({torch.distributed.get_backend()}, {how})")  # fmt: skip
        elif self.ctx.enabled:
            self.logger.line(f"distributed: {self.ctx.world_size} processes ({torch.distributed.get_backend()})")

    def run(self) -> TrainResult:
        cfg, ctx = self.cfg, self.ctx
        self._describe()
        old_handlers = self._install_signals()
        prev_det = torch.are_deterministic_algorithms_enabled()
        if cfg.run.deterministic:
            torch.use_deterministic_algorithms(True)
        result = TrainResult(path=self.dir.path, step=self.step, stopped="", rank=ctx.rank)
        first_step = self.step
        try:
            self.logger.open(step=self.step, total=cfg.optim.max_steps, resume=cfg.run.resume,
                             progress=cfg.run.progress)  # fmt: skip
            self._loop(result)
            self.logger.end_progress()
            if not result.signalled and (self._last_eval != self.step or not result.eval):
                result.eval = self.evaluate()
                self.logger.evaluation(self.step, result.eval, elapsed_s=self.elapsed)
            if self._last_save != self.step or not self.dir.has_checkpoint:
                self.save()
            if result.signalled:
                self.logger.line(
                    f"stopped by {result.stopped} at step {self.step}; checkpoint saved, continue with --resume"
                )
            if self.step == first_step and result.stopped == "time budget":
                self.logger.line(
                    f"warning: 0 steps trained: --max-minutes {cfg.optim.max_minutes} ended before the first step"
                )
            self.logger.close()
            if ctx.is_main:
                self.dir.plot_losses()
        finally:
            self.batches.close()
            self.logger.close()
            for s, h in old_handlers.items():
                signal.signal(s, h)
            torch.use_deterministic_algorithms(prev_det)
        result.step, result.elapsed_s = self.step, self.elapsed
        return result

    def _loop(self, result: TrainResult) -> None:
        cfg = self.cfg
        window: list[dict] = []  # steps since the last metrics record
        pending: list[dict] = []  # steps whose loss is still on the device
        start_elapsed, loop_start = self.elapsed, time.perf_counter()
        # a time budget counts this invocation only; the schedule ends where this budget does
        self._time_end = None if cfg.optim.max_minutes is None else start_elapsed + 60.0 * cfg.optim.max_minutes
        window_start, paused = loop_start, 0.0  # paused: evaluation/saving time inside the window
        self._last_eval = self._last_save = self.step
        self.model.train()
        try:
            while True:
                now = time.perf_counter()
                self.elapsed = start_elapsed + now - loop_start
                stop = self._should_stop(now - loop_start)
                if stop:
                    result.stopped = stop
                    return
                rec = self.train_step()
                self.elapsed = start_elapsed + time.perf_counter() - loop_start  # as saved with this step
                window.append(rec)
                pending.append(rec)
                log_now = cfg.run.log_every and self.step % cfg.run.log_every == 0
                eval_now = cfg.run.eval_every and self.step % cfg.run.eval_every == 0
                save_now = cfg.run.checkpoint_every and self.step % cfg.run.checkpoint_every == 0
                if self.on_step is not None or log_now or eval_now or save_now:
                    self._settle(pending, result)
                if self.on_step is not None:
                    self.on_step(self.step, self.model, rec)
                postfix = None
                if log_now:
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
                    self.logger.record(entry)
                    postfix = {"loss": f"{entry['loss']:.3f}", "tok_s": f"{entry['tokens_per_s']:.0f}"}
                    window, window_start, paused = [], now, 0.0
                self.logger.advance(postfix)
                t0 = time.perf_counter()
                if eval_now:
                    result.eval = self.evaluate()
                    self._last_eval = self.step
                    self.logger.evaluation(self.step, result.eval, elapsed_s=self.elapsed)
                if save_now:
                    self.save()
                    self._last_save = self.step
                paused += time.perf_counter() - t0  # evaluation and saving stay out of tokens/s
        finally:
            self._settle(pending, result)
