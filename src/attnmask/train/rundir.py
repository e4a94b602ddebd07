"""The run directory: what ``attnmask train`` writes, and :func:`load_run` to read it back.

Layout of a run directory::

    config.json          {"format": 1,
                          "task": "translation" | "lm",
                          "model": ModelConfig.to_dict(),
                          "train": TrainConfig as a dict (attnmask.train),
                          "tokenizers": {"tgt": "tokenizer.json",
                                         "src": "src_tokenizer.json" | null}}
                         "tgt" is the target (translation) or only (LM) tokenizer; "src" is null
                         when the source shares it (joint vocabulary) or for language models.
    tokenizer.json       Hugging Face tokenizers file (attnmask.data.tokenizer.Tokenizer.save; for a chat
                         run, the pretrained model's own tokenizer)
    chat.json            chat runs only: the tokenizer's special ids and the chat template
    src_tokenizer.json   only with separate source/target vocabularies
    model.safetensors    weights (tied tensors stored once); metadata {"step": "<n>"}
    adapters.safetensors LoRA runs instead of model.safetensors: the adapters alone (the base model is
                         --init's, loaded again; attnmask.model.lora)
    trainer_state.pt     resume state: step, weights, optimizer, RNG states of every rank, data
                         position of every rank, elapsed time (attnmask.train.checkpoint); in --fsdp
                         runs without weights and optimizer, naming the checkpoint/ step directory
    checkpoint/          --fsdp runs only: step-NNNNNNNN/, the model and optimizer shards of the
                         last checkpoint, written by every rank (torch.distributed.checkpoint;
                         attnmask.train.fsdp)
    metrics.jsonl        one JSON object a line: {"step", "split": "train"|"valid"|"test", ...}
    tb/                  TensorBoard event files (the same scalars)
    loss.png             loss curves, written at the end of training

``config.json`` and the tokenizers are written once when a run starts; the two checkpoint files
are replaced atomically at every save (an --fsdp run's older step directory is removed once
``trainer_state.pt`` names the new one).
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from safetensors import safe_open

from attnmask.data.tokenizer import Tokenizer
from attnmask.errors import UserError
from attnmask.model import ModelConfig, Transformer
from attnmask.model.lora import add_lora, load_lora, lora_modules, lora_state_dict, merge_lora
from attnmask.train import checkpoint
from attnmask.train.checkpoint import atomic_write_text, load_weights

FORMAT_VERSION = 1
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
SRC_TOKENIZER = "src_tokenizer.json"
WEIGHTS = "model.safetensors"
ADAPTERS = "adapters.safetensors"
CHAT = "chat.json"
TRAINER_STATE = "trainer_state.pt"
METRICS = "metrics.jsonl"
TENSORBOARD = "tb"
LOSS_PLOT = "loss.png"
TASKS = ("translation", "lm", "chat")


@dataclass
class Run:
    """A trained run, ready for inference.

    Attributes:
        path: the run directory.
        model: the Transformer in eval mode, on the requested device.
        tokenizer: the target tokenizer (translation) or the only one (LM).
        src_tokenizer: the source tokenizer; the same object as ``tokenizer`` with a joint
            vocabulary; None for language models.
        config: the parsed ``config.json``.
        task: ``"translation"``, ``"lm"`` or ``"chat"``.
        step: the training step of the saved weights (None if the file does not record it).
        chat_template: a chat run's template (its model's own), else None.
    """

    path: Path
    model: Transformer
    tokenizer: Tokenizer
    src_tokenizer: Tokenizer | None
    config: dict
    task: str
    step: int | None = None
    chat_template: object | None = None  # attnmask.pretrained.ChatTemplate

    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    @property
    def train_config(self) -> dict:
        return self.config.get("train", {})


def write_config(path: str | Path, *, task: str, model: ModelConfig, train: dict, src_tokenizer: bool) -> Path:
    """Write ``config.json`` (atomically) for a run directory."""
    if task not in TASKS:
        raise UserError(f"task={task!r}; expected one of {TASKS}")
    config = {
        "format": FORMAT_VERSION,
        "task": task,
        "model": model.to_dict(),
        "train": train,
        "tokenizers": {"tgt": TOKENIZER, "src": SRC_TOKENIZER if src_tokenizer else None},
    }
    return atomic_write_text(Path(path) / CONFIG, json.dumps(config, indent=2) + "\n")


def read_config(path: str | Path) -> dict:
    """The parsed ``config.json`` of run directory ``path``.

    Raises:
        ValueError: ``path`` is not a directory, has no ``config.json``, or it is not valid.
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: not a run directory (no such directory)")
    file = path / CONFIG
    if not file.is_file():
        raise UserError(f"{path}: not a run directory (missing {CONFIG}); expected the --out of `attnmask train`")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{file}: not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise UserError(f"{file}: holds a JSON {type(config).__name__}; expected an object written by `attnmask train`")
    missing = [k for k in ("task", "model", "tokenizers") if k not in config]
    if missing:
        raise UserError(f"{file}: missing keys {missing}; expected a config written by `attnmask train`")
    if config["task"] not in TASKS:
        raise UserError(f"{file}: task={config['task']!r}; expected one of {TASKS}")
    _check_model_section(file, config["model"])
    names = config["tokenizers"]
    if (
        not isinstance(names, dict)
        or not isinstance(names.get("tgt"), str)
        or not isinstance(names.get("src"), str | None)
    ):
        raise UserError(
            f'{file}: tokenizers={names!r}; expected {{"tgt": FILE, "src": FILE or null}} (file names in the run)'
        )
    if not isinstance(config.get("train", {}), dict):
        raise UserError(f"{file}: train={config['train']!r}; expected an object of training settings")
    return config


# JSON value types each ModelConfig annotation accepts (an int is a float; a bool is no int)
_JSON_TYPES = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "bool": (bool,),
    "dict": (dict,),
    "None": (type(None),),
}


def _check_model_section(file: Path, model) -> None:
    """``config.json``'s ``model`` is an object of :class:`ModelConfig` fields of the right JSON types,
    so that a hand-edited or damaged file is named here rather than failing inside the model."""
    if not isinstance(model, dict):
        raise UserError(f"{file}: model={model!r}; expected an object of ModelConfig fields")
    declared = {f.name: f for f in fields(ModelConfig)}
    required = [n for n, f in declared.items() if f.default is MISSING and f.default_factory is MISSING]
    missing = [n for n in required if n not in model]
    if missing:
        raise UserError(f"{file}: model lacks {missing}; expected a config written by `attnmask train`")
    for key, value in model.items():
        f = declared.get(key)
        if f is None or not isinstance(f.type, str):
            continue  # unknown names: ModelConfig.from_dict lists them
        parts = [part.strip() for part in f.type.split("|")]
        if any(part not in _JSON_TYPES for part in parts):
            continue
        allowed = tuple(t for part in parts for t in _JSON_TYPES[part])
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise UserError(f"{file}: model.{key}={value!r}; expected {f.type}")


def save_chat_tokenizer(path: str | Path, tokenizer, chat_template) -> None:
    """A pretrained tokenizer (``tokenizer.json``) and its special ids and template (``chat.json``)."""
    path = Path(path)
    tokenizer.hf.save(str(path / TOKENIZER))
    spec = {
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.pad_id,
        "unk_id": tokenizer.unk_id,
        "add_bos": tokenizer.add_bos,
        "stop_ids": list(tokenizer.stop_ids),
        "chat_template": None if chat_template is None else chat_template.source,
    }
    atomic_write_text(path / CHAT, json.dumps(spec, indent=2) + "\n")


def load_chat_tokenizer(path: str | Path):
    """``(PretrainedTokenizer, ChatTemplate | None)`` saved by :func:`save_chat_tokenizer`."""
    from tokenizers import Tokenizer as HFTokenizer

    from attnmask.pretrained import ChatTemplate, PretrainedTokenizer

    path = Path(path)
    missing = [f for f in (TOKENIZER, CHAT) if not (path / f).is_file()]
    if missing:
        raise UserError(f"{path}: chat run directory is missing {', '.join(missing)}")
    try:
        spec = json.loads((path / CHAT).read_text(encoding="utf-8"))
        tokenizer = PretrainedTokenizer(
            HFTokenizer.from_file(str(path / TOKENIZER)),
            bos_id=spec["bos_id"], eos_id=spec["eos_id"], pad_id=spec["pad_id"], unk_id=spec["unk_id"],
            add_bos=spec["add_bos"], stop_ids=spec["stop_ids"],
        )  # fmt: skip
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise UserError(f"{path / CHAT}: not a chat tokenizer description ({err!r})") from err
    template = spec.get("chat_template")
    return tokenizer, ChatTemplate.for_tokenizer(template, tokenizer) if template else None


def load_tokenizers(path: str | Path, config: dict) -> tuple[Tokenizer, Tokenizer | None]:
    """``(tokenizer, src_tokenizer)`` of a run; see :class:`Run` for the sharing rule."""
    path = Path(path)
    if config["task"] == "chat":
        return load_chat_tokenizer(path)[0], None
    names = config["tokenizers"]
    files = [names["tgt"]] + ([names["src"]] if names.get("src") else [])
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        raise UserError(f"{path}: run directory is missing {', '.join(missing)}")
    tokenizer = Tokenizer.load(path / names["tgt"])
    if config["task"] == "lm":
        return tokenizer, None
    src = Tokenizer.load(path / names["src"]) if names.get("src") else tokenizer
    return tokenizer, src


def load_run(path: str | Path, *, device: str = "cpu") -> Run:
    """Load the model (eval mode) and tokenizers of a run directory written by ``attnmask train``.

    Raises:
        ValueError: ``path`` is not a run directory, or a file is missing or unreadable (the
            message names the directory and the missing files).
    """
    path = Path(path)
    config = read_config(path)
    if config["task"] == "chat":
        return _load_chat_run(path, config, device)
    if not (path / WEIGHTS).is_file():
        raise UserError(f"{path}: run directory is missing {WEIGHTS} (training has not saved a checkpoint yet)")
    tokenizer, src_tokenizer = load_tokenizers(path, config)
    try:
        model_config = ModelConfig.from_dict(config["model"])
    except UserError as err:
        raise UserError(f"{path / CONFIG}: {err}") from err
    # a token id past the embedding table would fail deep inside the model (an IndexError)
    pairs = [("tokenizer", tokenizer, model_config.vocab_size)]
    if src_tokenizer is not None and src_tokenizer is not tokenizer:
        pairs.append(("source tokenizer", src_tokenizer, model_config.src_vocab_size or model_config.vocab_size))
    for name, tok, vocab in pairs:
        if tok.vocab_size > vocab:
            raise UserError(
                f"{path}: the {name} has {tok.vocab_size} tokens but the model's vocabulary has {vocab}; "
                "expected the tokenizer the run was trained with"
            )
    model = Transformer(model_config)
    load_weights(path / WEIGHTS, model)
    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        step = (f.metadata() or {}).get("step")
    if step is not None and not step.isdigit():
        raise UserError(f"{path / WEIGHTS}: metadata step={step!r}; expected a step number")
    model.to(device).eval()
    return Run(
        path=path,
        model=model,
        tokenizer=tokenizer,
        src_tokenizer=src_tokenizer,
        config=config,
        task=config["task"],
        step=int(step) if step is not None else None,
    )


def _step_of(file: Path) -> int | None:
    with safe_open(str(file), framework="pt") as f:
        step = (f.metadata() or {}).get("step")
    if step is not None and not step.isdigit():
        raise UserError(f"{file}: metadata step={step!r}; expected a step number")
    return int(step) if step is not None else None


def _load_chat_run(path: Path, config: dict, device: str) -> Run:
    """A fine-tuned model: its full weights, or --init's model with the saved LoRA adapters merged in."""
    tokenizer, template = load_chat_tokenizer(path)
    settings = config.get("train", {}).get("model", {})
    if (path / ADAPTERS).is_file():
        from safetensors.torch import load_file

        from attnmask.train.init import load_init

        if not settings.get("init") or not settings.get("lora_rank"):
            raise UserError(f"{path / CONFIG}: {ADAPTERS} needs train.model.init and lora_rank; expected a LoRA run")
        model = load_init(settings["init"]).model
        add_lora(model, rank=settings["lora_rank"], alpha=settings["lora_alpha"], targets=settings["lora_targets"])
        load_lora(model, load_file(path / ADAPTERS))
        merge_lora(model)
        file = path / ADAPTERS
    elif (path / WEIGHTS).is_file():
        try:
            model = Transformer(ModelConfig.from_dict(config["model"]))
        except UserError as err:
            raise UserError(f"{path / CONFIG}: {err}") from err
        load_weights(path / WEIGHTS, model)
        file = path / WEIGHTS
    else:
        raise UserError(f"{path}: run directory has neither {WEIGHTS} nor {ADAPTERS} (no checkpoint saved yet)")
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens, the model {model.config.vocab_size}")
    model.requires_grad_(False)
    model.to(device).eval()
    return Run(path=path, model=model, tokenizer=tokenizer, src_tokenizer=None, config=config, task="chat",
               step=_step_of(file), chat_template=template)  # fmt: skip


class RunDir:
    """The layout of one run directory, and every read and write of it the trainer makes.

    Files are named by the constants of this module; checkpoints are written atomically
    (:mod:`attnmask.train.checkpoint`) and verified after writing.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def __str__(self) -> str:
        return str(self.path)

    @property
    def holds_run(self) -> bool:
        return (self.path / CONFIG).exists()

    @property
    def has_checkpoint(self) -> bool:
        return (self.path / TRAINER_STATE).is_file()

    def create(self) -> bool:
        """Make the directory; True when it did not exist before (so a failed start can remove it)."""
        existed = self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        return not existed

    def read_config(self) -> dict:
        return read_config(self.path)

    def write_config(self, *, task: str, model: ModelConfig, train: dict, src_tokenizer: bool) -> Path:
        return write_config(self.path, task=task, model=model, train=train, src_tokenizer=src_tokenizer)

    def tokenizer_names(self, task: str, separate_source: bool) -> dict:
        return {"task": task, "tokenizers": {"tgt": TOKENIZER, "src": SRC_TOKENIZER if separate_source else None}}

    def save_tokenizers(self, tokenizer: Tokenizer, src_tokenizer: Tokenizer | None, chat_template=None) -> None:
        if not isinstance(tokenizer, Tokenizer):  # a pretrained model's own (chat runs)
            save_chat_tokenizer(self.path, tokenizer, chat_template)
            return
        tokenizer.save(self.path / TOKENIZER)
        if src_tokenizer is not None and src_tokenizer is not tokenizer:
            src_tokenizer.save(self.path / SRC_TOKENIZER)

    def load_tokenizers(self, task: str, separate_source: bool) -> tuple[Tokenizer, Tokenizer | None]:
        return load_tokenizers(self.path, self.tokenizer_names(task, separate_source))

    def remove_stale_temporaries(self) -> None:
        checkpoint.remove_stale_temporaries(self.path)

    def load_trainer_state(self) -> dict:
        """The resume state; ValueError naming the file when it cannot be read."""
        return checkpoint.load_torch(self.path / TRAINER_STATE)

    def weights_readable(self, name: str = WEIGHTS) -> bool:
        """Whether ``model.safetensors`` (or ``name``) opens and lists its tensors (a truncated file does not)."""
        try:
            with safe_open(str(self.path / name), framework="pt") as f:
                f.keys()
        except Exception:  # safetensors raises its own error types for every kind of damage
            return False
        return True

    def save_checkpoint(self, state: dict, model: Transformer) -> None:
        """Write ``trainer_state.pt`` then ``model.safetensors``; ValueError if either does not read back.

        ``trainer_state.pt`` goes first: it alone is read on resume, and it holds the weights too.
        """
        checkpoint.save_torch(self.path / TRAINER_STATE, state)
        name = self.save_weights(model, state["step"])
        if not self.weights_readable(name):
            raise UserError(f"{self.path / name}: written but does not read back; the disk may be full")

    def save_weights(self, model: Transformer, step: int) -> str:
        """``model.safetensors``, or for a model with LoRA adapters ``adapters.safetensors`` alone;
        returns the file's name."""
        metadata = {"step": str(step)}
        if lora_modules(model):
            from safetensors.torch import save_file

            adapters = {k: v.contiguous() for k, v in lora_state_dict(model).items()}
            checkpoint.atomic_write(self.path / ADAPTERS, lambda tmp: save_file(adapters, str(tmp), metadata=metadata))
            return ADAPTERS
        checkpoint.save_weights(self.path / WEIGHTS, model, metadata)
        return WEIGHTS

    def truncate_metrics(self, step: int) -> None:
        truncate_metrics(self.path, step)

    def plot_losses(self) -> Path | None:
        return plot_losses(self.path)


# --- metrics -----------------------------------------------------------------------------------


def read_metrics(path: str | Path) -> list[dict]:
    """Records of ``metrics.jsonl`` (a run directory or the file). A last line cut short by a
    crash is skipped; a missing file gives ``[]``."""
    path = Path(path)
    file = path / METRICS if path.is_dir() else path
    if not file.is_file():
        return []
    records = []
    for line in file.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def truncate_metrics(path: str | Path, step: int) -> None:
    """Keep only records up to ``step``: a resumed run re-logs the steps after its checkpoint."""
    file = Path(path) / METRICS
    if file.is_file():
        kept = [r for r in read_metrics(file) if r.get("step", 0) <= step]
        atomic_write_text(file, "".join(json.dumps(r) + "\n" for r in kept))


def plot_losses(path: str | Path) -> Path | None:
    """Draw train and validation loss against step into ``<run>/loss.png``; None without records."""
    path = Path(path)
    records = read_metrics(path)
    train = [(r["step"], r["loss"]) for r in records if r.get("split") == "train" and "loss" in r]
    valid = [(r["step"], r["loss"]) for r in records if r.get("split") == "valid" and "loss" in r]
    if not train and not valid:
        return None
    from matplotlib.figure import Figure  # no pyplot: no backend chosen for the user's process

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train), label="train", color="#2b6cb0", linewidth=1)
    if valid:
        ax.plot(*zip(*valid), label="validation", color="#dd6b20", marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    losses = [v for _, v in train + valid if math.isfinite(v)]
    if losses and max(losses) / max(min(losses), 1e-6) > 20:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    ax.set_title(f"{path.name}: loss")
    fig.tight_layout()
    out = path / LOSS_PLOT
    fig.savefig(out, dpi=110)
    return out
