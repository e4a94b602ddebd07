"""``attnmask export``: write a trained run for other tools (Hugging Face directory or GGUF file)."""

from __future__ import annotations

import argparse

from attnmask.cli.common import check_args
from attnmask.errors import UserError

FORMATS = ("hf", "gguf")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a fine-tuned run as a Hugging Face checkpoint directory or a GGUF file",
        description="Export the model of a run directory (LoRA adapters merged into the weights) with its "
        "tokenizer and chat template: --format hf writes a directory that transformers' AutoModelForCausalLM and "
        "AutoTokenizer load (and `attnmask train --init DIR` starts from); --format gguf writes one float32 "
        "GGUF file (`attnmask generate --model FILE.gguf`). Llama-family models in both formats, Gemma 3 as hf.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--run", required=True, metavar="DIR", help="run directory written by `attnmask train --task chat`")
    p.add_argument("--format", required=True, choices=FORMATS, help="hf: a checkpoint directory; gguf: one file")
    p.add_argument("--out", required=True, metavar="PATH", help="directory (hf) or FILE.gguf (gguf) to write")
    p.set_defaults(func=run)


def run(args) -> int:
    from attnmask.train.export import export_gguf, export_hf
    from attnmask.train.rundir import load_run

    check_args(args)
    if args.format == "gguf" and not args.out.endswith(".gguf"):
        raise UserError(f"--out {args.out}: expected a file name ending in .gguf for --format gguf")
    loaded = load_run(args.run)
    if loaded.task != "chat":
        raise UserError(f"{args.run} is a {loaded.task!r} run; export writes fine-tuned pretrained models (task chat)")
    if args.format == "hf":
        path = export_hf(loaded.model, loaded.tokenizer, loaded.chat_template, args.out)
    else:
        path = export_gguf(loaded.model, loaded.tokenizer, loaded.chat_template, args.out, name=loaded.path.name)
    print(f"wrote {path} ({args.format}, step {loaded.step})")
    return 0
