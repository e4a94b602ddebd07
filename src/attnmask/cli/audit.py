"""``attnmask audit``: prove that no token peeks, for a run directory or any model; a CI gate.

Exit codes: 0 every check passed, 1 a check failed (a leak), 2 a usage error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from attnmask.cli.common import check_args, check_picture_path
from attnmask.errors import UserError

HF_PRESETS = ("gpt2", "llama")
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def add_parser(sub) -> None:
    from attnmask.audit.checks import CHECKS
    from attnmask.audit.faults import FAULTS

    p = sub.add_parser(
        "audit",
        help="check a model for leaks: future tokens, padding, KV cache, NaN (exit 1 on a leak)",
        description="Audit a model for attention leaks: perturbing a token may only change the outputs the "
        "look-ahead mask lets it reach (and the gradient agrees), padding (amount and ids) never changes real "
        "outputs, KV-cache decoding matches the full forward, fully padded rows give no NaN, each decoder layer alone "
        "reaches exactly as far back as its own window (Gemma 3's sliding layers) or every earlier key. Prints a "
        "report (or JSON) and exits 1 when any check fails, so it can gate CI.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--run", metavar="DIR", help="a run directory written by `attnmask train`")
    what.add_argument(
        "--hf-config",
        metavar="NAME|PATH",
        help=f"a Hugging Face decoder built locally with random weights (no download): {' or '.join(HF_PRESETS)} "
        "(tiny presets), or a local config.json / directory holding one",
    )
    what.add_argument(
        "--model",
        metavar="NAME",
        help="a pretrained model known to attnmask.pretrained (e.g. gemma3, smollm2), as attnmask runs it",
    )
    what.add_argument(
        "--tiny",
        choices=("decoder", "encoder_decoder"),
        help="a small random attnmask Transformer (for trying the audit out)",
    )
    p.add_argument(
        "--inject",
        choices=sorted(FAULTS),
        help="break the attnmask model first with a known leak, to see the audit catch it",
    )
    p.add_argument(
        "--checks",
        metavar="NAME,NAME",
        help=f"comma-separated checks to run, default every one that applies: {', '.join(CHECKS)}",
    )
    p.add_argument("--length", type=int, default=12, metavar="T", help="target length audited")
    p.add_argument("--src-length", type=int, default=10, metavar="S", help="source length (encoder-decoder)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens (and of random weights)")
    p.add_argument("--sequences", type=int, default=2, help="random base sequences")
    p.add_argument("--replacements", type=int, default=3, help="random tokens tried at each perturbed position")
    p.add_argument(
        "--pad",
        default="1,3",
        metavar="N,N",
        help="comma-separated numbers of pad tokens tried on each side",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="run the model in this dtype (float64 makes the checks most sensitive); default: as loaded, "
        "but float64 for --model (a pretrained model's float32 products round differently by batch row, by "
        "more than the checks' float32 tolerance on logits that large)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    p.add_argument("--png", metavar="FILE", help="also draw the measured dependency matrix next to the intended mask")
    p.add_argument(
        "--reach-png",
        metavar="FILE",
        help="also draw the layer reach check's measurement: each decoder layer's gradient on every key, its window",
    )
    p.set_defaults(func=run)


def _pad_amounts(spec: str) -> list[int]:
    try:
        amounts = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        amounts = []
    if not amounts or any(a < 1 for a in amounts):
        raise UserError(f"--pad {spec!r}: expected comma-separated ints >= 1, e.g. 1,3")
    return amounts


def hf_model(spec: str, *, seed: int = 0):
    """A Hugging Face causal LM with random weights from a preset name or a local config (never downloads)."""
    try:
        import transformers
    except ImportError as e:
        raise UserError("--hf-config needs the transformers package: pip install 'attnmask[hf]'") from e
    torch.manual_seed(seed)
    if spec == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2
        )
    elif spec == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
    else:
        path = Path(spec)
        if not path.exists():
            raise UserError(f"--hf-config {spec!r}: expected {' or '.join(HF_PRESETS)}, or a local config.json / dir")
        if path.is_dir() and not (path / "config.json").is_file():
            raise UserError(f"--hf-config {spec}: the directory holds no config.json; expected a Hugging Face config")
        try:  # transformers says what is wrong with the file with a ValueError or an OSError
            cfg = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
        except (ValueError, OSError) as e:
            raise UserError(f"--hf-config {spec}: not a usable Hugging Face config: {_first_line(e)}") from e
    try:
        return transformers.AutoModelForCausalLM.from_config(cfg).eval()
    except ValueError as e:  # a config of no causal LM (an encoder-decoder, a vision model)
        raise UserError(f"--hf-config {spec}: {_first_line(e)}; expected a decoder-only (causal LM) config") from e


def _checks(spec: str | None) -> list[str] | None:
    from attnmask.audit.checks import CHECKS

    if spec is None:
        return None
    names = [x.strip() for x in spec.split(",") if x.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if not names or unknown:
        raise UserError(f"--checks {spec!r}: expected comma-separated names among: {', '.join(CHECKS)}")
    return names


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def build_subject(args):
    from attnmask.audit import subjects as audit_subjects
    from attnmask.audit.faults import inject, tiny_model

    if args.inject and args.hf_config:
        raise UserError("--inject breaks attnmask models only; use it with --run, --model or --tiny")
    if args.hf_config:
        model = hf_model(args.hf_config, seed=args.seed)
        if args.dtype:
            model = model.to(DTYPES[args.dtype])
        return audit_subjects.from_hf(model, name=f"Hugging Face {type(model).__name__} ({args.hf_config}, random)")
    if args.model:
        from attnmask.pretrained import load

        model, name = load(args.model)[0], f"pretrained {args.model}"
        if not args.dtype:
            # float32 here moves logits of ~20-30 by up to 5e-4 between two rows of one batch that
            # differ only in a blocked token (the products' blocking, not a leak: float64 measures
            # exactly 0), which the "unchanged" tolerance would report as leaks
            model = model.to(torch.float64)
    elif args.run:
        from attnmask.train.rundir import load_run

        run = load_run(args.run)
        model, name = run.model, f"run {run.path} ({run.task}, {run.model.config.arch})"
    else:
        model, name = tiny_model(args.tiny, seed=args.seed), f"tiny random {args.tiny}"
    if args.inject:
        model, name = inject(model, args.inject), f"{name} with fault {args.inject!r}"
    if args.dtype:
        model = model.to(DTYPES[args.dtype])
    return audit_subjects.from_transformer(model, name=name)


def run(args) -> int:
    from attnmask.audit import audit

    check_args(args)
    for flag, path in (("--png", args.png), ("--reach-png", args.reach_png)):
        if path:
            check_picture_path(flag, path)
    checks = _checks(args.checks)
    if args.reach_png and checks is not None and "layer reach" not in checks:
        raise UserError("--reach-png draws the layer reach check: add 'layer reach' to --checks")

    report = audit(
        build_subject(args),
        length=args.length,
        src_length=args.src_length,
        seed=args.seed,
        n_sequences=args.sequences,
        n_replacements=args.replacements,
        pad_amounts=_pad_amounts(args.pad),
        checks=checks,
    )
    if args.reach_png and report.layer_reach is None:
        raise UserError("--reach-png: the layer reach check did not run or was skipped; nothing to draw")
    wrote = [report.save_png(args.png)] if args.png else []
    if args.reach_png:
        wrote.append(report.save_reach_png(args.reach_png))
    if wrote and not args.json:  # one line, beside the report on stdout
        print(f"wrote {' and '.join(str(path) for path in wrote)}", file=sys.stderr)
    print(report.to_json() if args.json else report.to_text())
    return report.exit_code
