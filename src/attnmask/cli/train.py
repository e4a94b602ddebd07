"""``attnmask train``: train a translator (encoder-decoder) or a language model (decoder-only).

Every flag maps to one field of a :class:`attnmask.train.TrainConfig` section (by its flat name,
:data:`attnmask.train.config.FLAT`), whose defaults are the only ones (flags default to None =
"not given"). ``--resume --out DIR`` continues a saved run with its saved settings: flags equal
to the saved values are accepted, so the same command works with ``--resume`` added; only the
budget and logging flags may change.

Exit status: 0 when the budget ended, 130 after SIGINT and 143 after SIGTERM (the checkpoint is
saved first), 2 for a user mistake (one line on stderr, from rank 0 alone under torchrun), 70 for an
internal error (a bug: its traceback, from every rank).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from dataclasses import MISSING, fields

from attnmask.cli.common import is_user_mistake
from attnmask.errors import UserError
from attnmask.model import ACTIVATIONS, NORM_POSITIONS, NORMS, POSITIONS

# (flag, TrainConfig field, type / action, help); the default is appended from TrainConfig.
_FLAGS = (
    ("Data", None, None, None),
    (
        "--task",
        "task",
        ("translation", "lm", "chat"),
        "translation (--src/--tgt), language model (--text) or chat fine-tuning (--init MODEL --data FILE.jsonl; "
        "the default with --init)",
    ),
    ("--data", "data", str, '--task chat: JSONL, one {"messages": [...]} or {"prompt", "completion"} a line'),
    ("--valid-data", "valid_data", str, "--task chat: validation conversations (default: the last 5%%, at most 200)"),
    (
        "--chat-template",
        "chat_template",
        str,
        "--task chat: a Jinja chat template file, or a built-in name (chatml, gemma), for a model whose files carry "
        "none (a base model such as gemma3) or to replace its own",
    ),
    ("--src", "src", str, "source-language file, one sentence a line (.gz allowed)"),
    ("--tgt", "tgt", str, "target-language file, line i translates line i of --src"),
    ("--valid-src", "valid_src", str, "validation sources (default: hold out the last 5%%, at most 1000, of --src)"),
    ("--valid-tgt", "valid_tgt", str, "validation targets, aligned with --valid-src"),
    ("--builtin-task", "builtin_task", str, "a generated task instead of files (see `attnmask demo`): dates"),
    ("--train-size", "train_size", int, "--builtin-task: training pairs generated"),
    ("--valid-size", "valid_size", int, "--builtin-task: validation pairs generated"),
    ("--text", "text", str, "--task lm: a plain text file"),
    ("--valid-text", "valid_text", str, "--task lm: validation text (default: the last 10%% of --text)"),
    ("--tokenizer", "tokenizer", ("bpe", "char"), "byte-level BPE or characters"),
    ("--vocab-size", "vocab_size", int, "BPE vocabulary size, specials included"),
    ("--separate-vocab", "joint_vocab", "store_false", "separate source and target vocabularies"),
    ("--max-len", "max_len", int, "longest sequence in tokens; longer training pairs are dropped"),
    ("Model", None, None, None),
    ("--model", "model", ("tiny", "small", "base"), "size preset; the flags below override it"),
    (
        "--init",
        "init",
        str,
        "fine-tune a pretrained model: a registered name (attnmask.pretrained.MODELS, e.g. smollm2), a .gguf file "
        "or a Hugging Face Llama checkpoint directory; sets fine-tuning defaults (--task chat, --lr 2e-5, or 2e-4 "
        "with LoRA, --warmup 20, --weight-decay 0, --max-len 1024)",
    ),
    ("--lora-rank", "lora_rank", int, "with --init: train LoRA adapters of this rank (0 = every weight)"),
    ("--lora-alpha", "lora_alpha", float, "LoRA scale alpha / rank"),
    (
        "--lora-targets",
        "lora_targets",
        str,
        "comma-separated projections given adapters (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,"
        "lm_head) or all",
    ),
    ("--dim", "dim", int, "model width"),
    ("--layers", "n_layers", int, "decoder layers (and encoder layers unless --encoder-layers)"),
    ("--encoder-layers", "n_encoder_layers", int, "encoder layers"),
    ("--heads", "n_heads", int, "attention heads"),
    ("--kv-heads", "n_kv_heads", int, "key/value heads (fewer than --heads: grouped-query attention)"),
    ("--ffn-dim", "ffn_dim", int, "feed-forward width"),
    ("--positions", "positions", POSITIONS, "position encoding"),
    ("--norm", "norm", NORMS, "normalisation"),
    ("--norm-position", "norm_position", NORM_POSITIONS, "pre-norm or post-norm residual blocks"),
    ("--activation", "activation", ACTIVATIONS, "feed-forward activation"),
    ("--dropout", "dropout", float, "dropout probability"),
    ("--no-tie-embeddings", "tie_embeddings", "store_false", "give W_pred its own matrix"),
    ("Batches and optimisation", None, None, None),
    ("--batch-tokens", "batch_tokens", int, "padded tokens per batch and process (lm: batch size x block size)"),
    ("--block-size", "block_size", int, "--task lm: tokens per training sequence"),
    (
        "--batching",
        "batching",
        ("auto", "pad", "pack"),
        "translation batches: pad (length buckets), pack (several pairs per row kept apart by document masks, "
        "no padding computed), auto (pack only where it measured faster; so far pad everywhere: on the CPU "
        "packing is a wash, on a GPU not yet measured)",
    ),
    ("--pack-length", "pack_length", int, "--batching pack: tokens per packed row"),
    ("--grad-accum", "grad_accum", int, "micro-batches per optimizer step"),
    ("--lr", "lr", float, "peak learning rate (AdamW)"),
    ("--min-lr-ratio", "min_lr_ratio", float, "cosine decay ends at lr x this"),
    ("--warmup", "warmup", int, "linear warmup steps"),
    ("--weight-decay", "weight_decay", float, "AdamW weight decay (weight matrices only)"),
    ("--grad-clip", "grad_clip", float, "max gradient norm (0 = off)"),
    ("--label-smoothing", "label_smoothing", float, "label smoothing (default 0.1 translation, 0 lm)"),
    ("Budget, evaluation, checkpoints", None, None, None),
    ("--max-steps", "max_steps", int, "optimizer steps, the length of the LR schedule (0 = no step limit)"),
    (
        "--max-minutes",
        "max_minutes",
        float,
        "wall-clock budget of this invocation's training loop, in minutes "
        "(a --resume gets a new budget; the LR schedule ends with it)",
    ),
    ("--eval-every", "eval_every", int, "steps between evaluations (0 = only at the end)"),
    ("--eval-sentences", "eval_sentences", int, "validation sentences translated for BLEU/chrF/exact match"),
    ("--log-every", "log_every", int, "steps between metrics.jsonl / TensorBoard records"),
    ("--save-every", "save_every", int, "steps between checkpoints (default: --eval-every)"),
    ("Runtime", None, None, None),
    ("--out", "out", str, "run directory"),
    ("--resume", "resume", "store_true", "continue the run in --out from its last checkpoint"),
    ("--seed", "seed", int, "random seed"),
    (
        "--precision",
        "precision",
        ("auto", "fp32", "bf16"),
        "auto: bfloat16 autocast on a GPU that has bf16 and on a CPU with native bf16 products (AVX512-BF16, "
        "AMX; read from the hardware, never timed), else fp32; or fp32, or bf16 (autocast)",
    ),
    ("--device", "device", str, "auto, cpu, cuda or cuda:N"),
    ("--deterministic", "deterministic", "store_true", "deterministic algorithms (bit-identical resumes)"),
    (
        "--compile",
        "compile",
        "store_true",
        "torch.compile the model step, batch lengths rounded to multiples of 16 (off by default: on a 2-core CPU "
        "~10%% faster per step, but compiling takes minutes; worth it for long runs)",
    ),
    (
        "--fsdp",
        "fsdp",
        "store_true",
        "under torchrun: shard parameters, gradients and optimizer state over the processes (FSDP2); "
        "checkpoints are shards that a --resume on another number of processes reads",
    ),
    ("--no-progress", "progress", "store_false", "no progress bar"),
)


def _defaults() -> dict:
    """Each flat setting's default, read from its config section."""
    from attnmask.train.config import FLAT, SECTIONS

    out = {}
    for name, (section, key) in FLAT.items():
        f = next(f for f in fields(SECTIONS[section]) if f.name == key)
        if f.default is not MISSING:
            out[name] = f.default
    return out


def add_parser(sub) -> None:
    defaults = _defaults()
    p = sub.add_parser(
        "train",
        help="train a translator or a language model on your text, or fine-tune a pretrained chat model",
        description="Train an encoder-decoder translator (--task translation --src F --tgt F) or a decoder-only "
        "language model (--task lm --text F) with teacher forcing. The run directory gets the config, tokenizer, "
        "weights (safetensors), resumable trainer state, metrics.jsonl, TensorBoard scalars (tb/) and loss.png. "
        "Several processes: torchrun --nproc-per-node N -m attnmask train ... (--fsdp to shard the model) "
        "Exit status: 0 done, 130 after Ctrl-C and 143 after SIGTERM (checkpoint saved; continue with --resume).",
    )
    group = p
    for flag, name, kind, help_text in _FLAGS:
        if name is None:
            group = p.add_argument_group(flag)
            continue
        default = defaults.get(name)
        if kind in ("store_true", "store_false"):
            group.add_argument(flag, dest=name, action=kind, default=None, help=help_text)
            continue
        shown = f" (default: {default})" if default is not None and "default" not in help_text else ""
        if isinstance(kind, tuple):
            group.add_argument(flag, dest=name, choices=kind, default=None, help=help_text + shown)
        else:
            files = ("src", "tgt", "valid_src", "valid_tgt", "text", "valid_text", "data", "valid_data")
            metavar = "FILE" if name in files else None
            metavar = "DIR" if name == "out" else metavar
            metavar = "FILE|NAME" if name == "chat_template" else metavar
            group.add_argument(flag, dest=name, type=kind, default=None, metavar=metavar, help=help_text + shown)
    p.set_defaults(func=run)


def given_settings(args: argparse.Namespace) -> dict:
    """The TrainConfig fields set on the command line (flags default to None = not given).

    Raises:
        ValueError: a number flag given ``nan`` or ``inf`` (argparse's ``float`` accepts both).
    """
    names = [name for _, name, _, _ in _FLAGS if name is not None]
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    for flag, name, kind, _ in _FLAGS:
        if kind is float and name in given and not math.isfinite(given[name]):
            raise UserError(f"{flag} {given[name]}: expected a finite number")
    if given.get("max_steps") == 0:
        given["max_steps"] = None
    return given


def config_from_args(args: argparse.Namespace):
    from attnmask.train import RESUME_OVERRIDES, TrainConfig, read_config, resume_config

    given = given_settings(args)
    if given.pop("resume", False):
        if "out" not in given:
            raise UserError("--resume needs --out DIR, the run to continue")
        out = given.pop("out")
        saved = TrainConfig.from_dict(read_config(out)["train"]).flat()
        changed = sorted(k for k, v in given.items() if k not in RESUME_OVERRIDES and saved.get(k) != v)
        if changed:
            flags = ", ".join(f"--{_flag(k)} (saved {saved.get(k)!r}, given {given[k]!r})" for k in changed)
            raise UserError(f"{flags} cannot change on --resume (the run keeps its saved settings); drop them")
        return resume_config(out, **given)
    return TrainConfig.of(**given)


def _flag(name: str) -> str:
    return next(flag for flag, key, _, _ in _FLAGS if key == name)[2:]


def run(args: argparse.Namespace) -> int:
    from attnmask.train import train

    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = config_from_args(args)
        result = train(cfg)
    except Exception as err:
        if rank != 0 and is_user_mistake(err):  # under torchrun every rank fails alike; rank 0 alone says why
            sys.exit(2)
        raise
    if result.rank != 0:
        return _status(result.stopped)
    if result.signalled:
        return _status(result.stopped)  # train() reported where it stopped and that it saved
    print(
        f"done: {result.step} steps in {result.elapsed_s / 60:.1f} min ({result.stopped}); run saved in {result.path}"
    )
    print(f"load it with: attnmask.load_run({str(result.path)!r})")
    return 0


def _status(stopped: str) -> int:
    """The shell's convention after a signal: 128 + its number (130 SIGINT, 143 SIGTERM)."""
    try:
        return 128 + signal.Signals[stopped].value
    except KeyError:
        return 0 if stopped in ("max_steps", "time budget") else 1
