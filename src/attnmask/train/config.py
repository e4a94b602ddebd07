"""What a training run needs, split by concern: data, model, optimisation, run.

:class:`TrainConfig` holds four sections::

    TrainConfig(data=DataConfig(...), model=ModelSettings(...), optim=OptimConfig(...), run=RunConfig(...))

Every field has one name, used by the section, by :meth:`TrainConfig.of` (flat keyword
arguments, as the CLI and the tests pass them) and by the ``attnmask train`` flags, which are
generated from :data:`FLAGS` below. ``config.json["train"]`` stores the sections as nested dicts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from attnmask.errors import UserError
from attnmask.model import ACTIVATIONS, NORM_POSITIONS, NORMS, POSITIONS, ModelConfig
from attnmask.train.rundir import TASKS, read_config

TOKENIZERS = ("bpe", "char")
PRECISIONS = ("auto", "fp32", "bf16")
BATCHINGS = ("auto", "pad", "pack")

# Model sizes; every field can be overridden one by one (--dim, --layers, ...).
MODEL_PRESETS: dict[str, dict] = {
    "tiny": {"dim": 64, "n_layers": 2, "n_heads": 4, "ffn_dim": 256},
    "small": {"dim": 256, "n_layers": 3, "n_heads": 4, "ffn_dim": 1024},
    "base": {"dim": 512, "n_layers": 6, "n_heads": 8, "ffn_dim": 2048},  # the original Transformer base
}

# Settings a resumed run may change; any other difference from the saved config is refused,
# because it would silently change the data, the model or the optimisation.
# `--init MODEL` (fine-tuning a pretrained model) changes the defaults of the settings not given:
# a chat task, a learning rate for weights that are already good (full fine-tuning; LoRA's adapters
# start at zero and take a larger one), a short warmup, no weight decay, conversations up to 1024
# tokens packed into rows of that length.
FINE_TUNING_DEFAULTS: dict = {
    "task": "chat",
    "lr": 2e-5,
    "warmup": 20,
    "min_lr_ratio": 0.1,
    "weight_decay": 0.0,
    "max_len": 1024,
    "pack_length": 1024,
}
LORA_LR = 2e-4  # --lora-rank > 0 with --init and no --lr

RESUME_OVERRIDES = (
    "max_steps", "max_minutes", "device", "eval_every", "save_every", "log_every", "progress", "resume", "compile",
)  # fmt: skip


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise UserError(f"{name}={value!r}; expected one of {tuple(allowed)}")


def _positive(section, names, *, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(section, name)
        if value is not None and (value < 0 if allow_zero else value < 1):
            kind = "non-negative" if allow_zero else "positive"
            raise UserError(f"{name}={value}; expected a {kind} int")


@dataclass
class DataConfig:
    """Where the examples come from, how they are tokenized and batched."""

    task: str = "translation"  # "translation" (encoder-decoder), "lm" (decoder-only) or "chat" (fine-tuning)
    src: str | None = None  # translation: source file, one sentence a line (.gz allowed)
    tgt: str | None = None  # translation: target file, line-aligned with src
    valid_src: str | None = None  # validation pairs; None = hold out the last 5% (max 1000) of src/tgt
    valid_tgt: str | None = None
    builtin_task: str | None = None  # a task of attnmask.data.synthetic instead of files (e.g. "dates")
    train_size: int = 20000  # built-in task: training pairs generated
    valid_size: int = 1000  # built-in task: validation pairs generated
    data: str | None = None  # chat: JSONL file, one conversation a line (attnmask.data.chat)
    valid_data: str | None = None  # chat: validation conversations; None = hold out the last 5% (at most 200)
    chat_template: str | None = None  # chat: a Jinja file or built-in name (pretrained.TEMPLATES); None = the model's
    text: str | None = None  # lm: plain text file
    valid_text: str | None = None  # lm: validation text; None = the last valid_fraction of text
    valid_fraction: float = 0.1
    tokenizer: str = "bpe"  # "bpe" (byte-level, Hugging Face tokenizers) or "char"
    vocab_size: int = 8000  # BPE vocabulary size (specials included)
    joint_vocab: bool = True  # translation: one tokenizer (and embedding) for both sides
    max_len: int = 256  # longest sequence in tokens (specials included); longer training pairs are dropped
    batch_tokens: int = 4096  # translation: padded tokens per batch (per rank); lm: batch_size * block_size
    block_size: int = 128  # lm: tokens per training sequence
    # translation: "pad" (length-bucketed padded batches), "pack" (several pairs per row, document
    # masks, no padding computed) or "auto" (pack only where it measured faster: train/tasks.py)
    batching: str = "auto"
    pack_length: int = 128  # translation with packing: tokens per packed row (each side); chat: per row

    def __post_init__(self):
        _choice("task", self.task, TASKS)
        _choice("tokenizer", self.tokenizer, TOKENIZERS)
        _choice("batching", self.batching, BATCHINGS)
        sizes = ("batch_tokens", "block_size", "max_len", "train_size", "valid_size", "vocab_size", "pack_length")
        _positive(self, sizes)
        if not 0.0 < self.valid_fraction < 1.0:
            raise UserError(f"valid_fraction={self.valid_fraction}; expected a number in (0, 1)")
        if self.chat_template is not None and self.task != "chat":
            raise UserError(f"chat_template={self.chat_template!r} applies to task 'chat', not {self.task!r}")
        if self.task == "chat" and self.batch_tokens < self.max_len:
            raise UserError(
                f"batch_tokens={self.batch_tokens} < max_len={self.max_len}; expected room for the longest conversation"
            )
        if self.task == "lm" and self.batch_tokens < self.block_size:
            raise UserError(
                f"batch_tokens={self.batch_tokens} < block_size={self.block_size}; expected at least one block"
            )

    @property
    def lm_batch_size(self) -> int:
        return max(1, self.batch_tokens // self.block_size)


# ModelSettings fields that are no ModelConfig field (what the model starts from, how it is adapted)
_NOT_MODEL_CONFIG = ("preset", "init", "lora_rank", "lora_alpha", "lora_targets")


@dataclass
class ModelSettings:
    """A size preset, then per-field overrides (None = the preset's, or ModelConfig's, value).

    Field names are :class:`~attnmask.model.ModelConfig`'s; :meth:`model_config` fills in what
    only the data knows (vocabulary sizes, architecture, longest sequence).
    """

    preset: str = "small"  # a key of MODEL_PRESETS
    # fine-tuning: a pretrained model (registry name, .gguf file or Hugging Face directory) instead of
    # a new one; the preset and the size fields below are then unused (attnmask.train.init)
    init: str | None = None
    lora_rank: int = 0  # > 0: train LoRA adapters of this rank, base weights frozen (attnmask.model.lora)
    lora_alpha: float = 16.0  # LoRA scale = lora_alpha / lora_rank
    lora_targets: str = "all"  # comma-separated projection names (q_proj,...,down_proj, lm_head) or "all"
    dim: int | None = None
    n_layers: int | None = None  # decoder layers (and encoder layers unless n_encoder_layers is set)
    n_encoder_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None  # < n_heads: grouped-query attention
    ffn_dim: int | None = None
    positions: str | None = None  # sinusoidal | learned | rotary
    norm: str | None = None  # layernorm | rmsnorm
    norm_position: str | None = None  # pre | post
    activation: str | None = None  # relu | gelu | swiglu | ...
    dropout: float = 0.1
    tie_embeddings: bool = True  # W_pred shares the target embedding matrix

    def __post_init__(self):
        _choice("model", self.preset, MODEL_PRESETS)
        for name, allowed in (
            ("positions", POSITIONS),
            ("norm", NORMS),
            ("norm_position", NORM_POSITIONS),
            ("activation", ACTIVATIONS),
        ):
            if getattr(self, name) is not None:
                _choice(name, getattr(self, name), allowed)
        _positive(self, ("dim", "n_layers", "n_encoder_layers", "n_heads", "n_kv_heads", "ffn_dim"))
        _positive(self, ("lora_rank",), allow_zero=True)
        if self.lora_rank and not self.init:
            raise UserError(f"lora_rank={self.lora_rank} without init; LoRA adapts a pretrained model (--init MODEL)")
        if not 0 < self.lora_alpha < math.inf:
            raise UserError(f"lora_alpha={self.lora_alpha}; expected a positive finite number")
        if self.lora_rank:
            from attnmask.model.lora import parse_targets

            parse_targets(self.lora_targets)

    def model_config(self, *, arch: str, vocab_size: int, src_vocab_size: int | None, max_seq_len: int) -> ModelConfig:
        """The :class:`ModelConfig`: the preset, then every non-None override."""
        kwargs = dict(MODEL_PRESETS[self.preset])
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in _NOT_MODEL_CONFIG and value is not None:
                kwargs[f.name] = value
        return ModelConfig(
            vocab_size=vocab_size, arch=arch, src_vocab_size=src_vocab_size, max_seq_len=max_seq_len, **kwargs
        )


@dataclass
class OptimConfig:
    """AdamW, its schedule, and the budget the schedule follows."""

    lr: float = 5e-4  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup: int = 200  # steps of linear warmup
    weight_decay: float = 0.01  # AdamW decay on weight matrices only
    beta1: float = 0.9
    beta2: float = 0.98
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    label_smoothing: float | None = None  # None = 0.1 for translation, 0 for lm
    grad_accum: int = 1  # micro-batches per optimizer step
    max_steps: int | None = 2000  # optimizer steps in total; also the length of the cosine schedule
    max_minutes: float | None = None  # wall-clock budget of this invocation's training loop

    def __post_init__(self):
        _positive(self, ("grad_accum", "max_steps"))
        _positive(self, ("warmup",), allow_zero=True)
        if self.max_steps is None and self.max_minutes is None:
            raise UserError("no budget: set max_steps, max_minutes, or both")
        if self.max_minutes is not None and not 0 < self.max_minutes < math.inf:  # NaN fails both
            raise UserError(f"max_minutes={self.max_minutes}; expected a positive finite number")
        if not 0 < self.lr < math.inf or not 0 <= self.min_lr_ratio <= 1:
            raise UserError(f"lr={self.lr}, min_lr_ratio={self.min_lr_ratio}; expected 0 < lr < inf, 0 <= ratio <= 1")
        for name in ("weight_decay", "grad_clip"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise UserError(f"{name}={value}; expected a finite number >= 0")
        if self.label_smoothing is not None and not 0.0 <= self.label_smoothing < 1.0:
            raise UserError(f"label_smoothing={self.label_smoothing}; expected a number in [0, 1)")


@dataclass
class RunConfig:
    """Where the run lives, how often it evaluates, logs and saves, and on what it runs."""

    out: str = "runs/train"  # run directory (created)
    resume: bool = False  # continue the run in `out` from its checkpoint
    eval_every: int = 500  # steps between evaluations (and at the end); 0 = only at the end
    eval_sentences: int = 500  # translation: validation sentences translated for BLEU/chrF/exact match
    eval_max_tokens: int | None = None  # lm: evaluate on the first N validation tokens (None = all)
    log_every: int = 10  # steps between metrics.jsonl / TensorBoard records
    save_every: int | None = None  # steps between checkpoints; None = eval_every (and at the end)
    seed: int = 0
    precision: str = "auto"  # "auto" (bf16 where the hardware has it: train/precision.py), "fp32" or "bf16" (autocast)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    deterministic: bool = False  # torch.use_deterministic_algorithms for bit-identical resumes
    progress: bool = True  # show a progress bar
    # torch.compile the model step, batch lengths rounded up to multiples of COMPILE_ROUND_TO. Off by
    # default: on a 2-core CPU it measured 7-10% more tokens/s per step, but compiling the ~20 batch
    # shapes of Multi30k took ~155 s with a cold inductor cache (~10 s warm), more than the 2-minute
    # demo gains (docs/benchmarks.md); not measured on a GPU
    compile: bool = False
    # shard parameters, gradients and optimizer state over torchrun's processes (FSDP2); checkpoints
    # as torch.distributed.checkpoint shards, which a resume on another number of processes reads
    # (attnmask.train.fsdp)
    fsdp: bool = False

    def __post_init__(self):
        _choice("precision", self.precision, PRECISIONS)
        if self.fsdp and self.compile:
            raise UserError("fsdp=True with compile=True: sharded training runs eagerly; drop --compile")
        _positive(self, ("eval_every", "eval_sentences", "log_every", "save_every"), allow_zero=True)
        _positive(self, ("eval_max_tokens",))

    @property
    def checkpoint_every(self) -> int:
        return self.eval_every if self.save_every is None else self.save_every


SECTIONS = {"data": DataConfig, "model": ModelSettings, "optim": OptimConfig, "run": RunConfig}
# flat name (CLI flag dest, TrainConfig.of keyword) -> (section, field); the preset's flag is --model
FLAT: dict[str, tuple[str, str]] = {
    ("model" if (section, f.name) == ("model", "preset") else f.name): (section, f.name)
    for section, cls in SECTIONS.items()
    for f in fields(cls)
}


@dataclass
class TrainConfig:
    """Everything a training run needs; saved as ``config.json["train"]`` in the run directory."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelSettings = field(default_factory=ModelSettings)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @classmethod
    def of(cls, **settings) -> TrainConfig:
        """A config from flat settings: ``TrainConfig.of(task="lm", text="a.txt", lr=1e-3)``.

        Raises:
            ValueError: an unknown name (the message lists the known ones) or a bad value.
        """
        unknown = sorted(set(settings) - set(FLAT))
        if unknown:
            raise UserError(f"unknown training settings {unknown}; expected some of {sorted(FLAT)}")
        if settings.get("init"):
            given = settings
            lora = {"lr": LORA_LR} if settings.get("lora_rank") else {}
            settings = {**FINE_TUNING_DEFAULTS, **lora, **settings}
            steps = settings.get("max_steps", OptimConfig.max_steps)
            if "warmup" not in given and steps:  # a short run still reaches its peak learning rate
                settings["warmup"] = min(settings["warmup"], max(1, steps // 10))
            if settings["task"] != "chat":
                raise UserError(f"--init fine-tunes with --task chat, not --task {settings['task']}")
            settings["pack_length"] = max(settings["pack_length"], settings["max_len"])  # a row holds any conversation
        parts: dict[str, dict] = {section: {} for section in SECTIONS}
        for name, value in settings.items():
            section, key = FLAT[name]
            parts[section][key] = value
        return cls(**{section: SECTIONS[section](**kw) for section, kw in parts.items()})

    def flat(self) -> dict:
        """The settings by flat name (the inverse of :meth:`of`)."""
        return {name: getattr(getattr(self, section), key) for name, (section, key) in FLAT.items()}

    def replace(self, **settings) -> TrainConfig:
        """A copy with some flat settings changed (checked again)."""
        return TrainConfig.of(**{**self.flat(), **settings})

    @property
    def task(self) -> str:
        return self.data.task

    @property
    def label_smoothing(self) -> float:
        if self.optim.label_smoothing is not None:
            return self.optim.label_smoothing
        return 0.1 if self.data.task == "translation" else 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """Read :meth:`to_dict`'s nested form, or the flat form older runs saved."""
        if set(d) <= set(SECTIONS) and all(isinstance(v, dict) for v in d.values()):
            for section, values in d.items():
                known = {f.name for f in fields(SECTIONS[section])}
                unknown = sorted(set(values) - known)
                if unknown:
                    raise UserError(f"unknown {section} settings {unknown}; expected some of {sorted(known)}")
            return cls(**{section: SECTIONS[section](**d.get(section, {})) for section in SECTIONS})
        legacy = {
            "layers": "n_layers",
            "encoder_layers": "n_encoder_layers",
            "heads": "n_heads",
            "kv_heads": "n_kv_heads",
        }
        return cls.of(**{legacy.get(k, k): v for k, v in d.items()})


def resume_changes(saved: TrainConfig, given: dict) -> list[str]:
    """The flat settings in ``given`` whose values differ from ``saved`` and may not change on resume."""
    current = saved.flat()
    return [
        f"{name}: saved {current[name]!r}, now {value!r}"
        for name, value in given.items()
        if name not in RESUME_OVERRIDES + ("out",) and current.get(name) != value
    ]


def resume_config(out: str | Path, **given) -> TrainConfig:
    """The saved config of run ``out``, with ``resume=True`` and the changes a resume allows.

    Settings in ``given`` equal to the saved ones are accepted (the same command line works with
    ``--resume`` added); changed ones outside :data:`RESUME_OVERRIDES` are refused.

    Raises:
        ValueError: ``out`` is not a run directory, or names every setting that would change,
            with its saved and new value.
    """
    given.pop("resume", None)
    given.pop("out", None)
    saved = TrainConfig.from_dict(read_config(out)["train"])
    differ = resume_changes(saved, given)
    if differ:
        raise UserError(f"resume settings differ from the saved run in {out}: {'; '.join(differ)}")
    allowed = {k: v for k, v in given.items() if k in RESUME_OVERRIDES}
    return saved.replace(**{**allowed, "out": str(out), "resume": True})


__all__ = [
    "FLAT",
    "MODEL_PRESETS",
    "PRECISIONS",
    "RESUME_OVERRIDES",
    "SECTIONS",
    "TASKS",
    "FINE_TUNING_DEFAULTS",
    "LORA_LR",
    "DataConfig",
    "ModelSettings",
    "OptimConfig",
    "RunConfig",
    "TrainConfig",
    "resume_changes",
    "resume_config",
]
