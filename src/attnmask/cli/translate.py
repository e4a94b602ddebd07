"""``attnmask translate``: translate sentences with a trained run (greedy or beam search)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from attnmask.cli.common import check_args
from attnmask.data.files import read_all_lines
from attnmask.decode import translate
from attnmask.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "translate",
        help="translate sentences with a trained translation run",
        description="Translate SENTENCE arguments, or the lines of --input FILE, or stdin (one sentence a "
        "line; blank lines stay blank) with the cached decoder: greedy by default, beam search with --beam.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("sentences", nargs="*", metavar="SENTENCE", help="sentences to translate")
    p.add_argument("--run", required=True, metavar="DIR", help="run directory written by `attnmask train`")
    p.add_argument("--input", metavar="FILE", help="read sentences from FILE, one a line")
    p.add_argument("--output", metavar="FILE", help="write translations to FILE instead of stdout")
    p.add_argument("--beam", type=int, default=1, help="beam size (1 = greedy)")
    p.add_argument("--length-penalty", type=float, default=1.0, help="beam search: score / length ** this")
    p.add_argument("--batch-size", type=int, default=64, help="sentences decoded at once")
    p.add_argument("--max-len", type=int, default=None, help="most tokens per translation (default 1.5 x source + 10)")
    p.add_argument("--device", default="cpu", help="torch device")
    p.set_defaults(func=run)


def read_sentences(sentences: list[str], input_path: str | None) -> list[str]:
    """Sentences from the arguments, else ``input_path``, else stdin; ValueError when there are none."""
    if sentences and input_path:
        raise UserError("give sentences as arguments or --input FILE, not both")
    if sentences:
        lines = list(sentences)
    elif input_path:
        lines = read_all_lines(input_path)  # DataError naming the line that is not UTF-8
    else:
        try:
            lines = sys.stdin.read().splitlines()
        except UnicodeDecodeError as err:
            raise UserError(f"stdin is not UTF-8 text ({err}); expected one UTF-8 sentence a line") from err
    if not any(line.strip() for line in lines):
        where = f"{input_path} has no text" if input_path else "no sentences given"
        raise UserError(f"empty input: {where}; expected SENTENCE arguments, --input FILE or lines on stdin")
    return lines


def check_options(args) -> None:
    for name in ("beam", "batch_size"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_len is not None and args.max_len < 1:
        raise UserError(f"--max-len must be >= 1, got {args.max_len}")
    if not math.isfinite(args.length_penalty):
        raise UserError(f"--length-penalty {args.length_penalty}: expected a finite number")


def load_translation_run(path: str, device: str, beam: int = 1):
    """The translation run in ``path``; a :class:`UserError` for a language model, or for a ``beam``
    wider than its vocabulary (the beams could not differ; each holds a KV cache)."""
    from attnmask.train.rundir import load_run

    run = load_run(path, device=device)
    if run.task != "translation":
        raise UserError(f"{path} is a {run.task!r} run; translation needs a run trained with task 'translation'")
    vocab = run.model.config.vocab_size
    if beam > vocab:
        raise UserError(f"--beam {beam} is wider than the run's vocabulary of {vocab} tokens; expected 1..{vocab}")
    return run


def translate_lines(run, lines: list[str], args) -> list[str]:
    """Translations of the non-blank ``lines``; blank lines map to blank lines."""
    todo = [i for i, line in enumerate(lines) if line.strip()]
    hyps = translate(
        run.model,
        run.src_tokenizer,
        run.tokenizer,
        [lines[i] for i in todo],
        beam=args.beam,
        max_len=args.max_len,
        batch_size=args.batch_size,
        length_penalty=args.length_penalty,
        progress=sys.stderr.isatty() and len(todo) > args.batch_size,
    )
    out = [""] * len(lines)
    for i, h in zip(todo, hyps):
        out[i] = h
    return out


def run(args) -> int:
    check_args(args)  # --device and --run, before anything loads
    check_options(args)
    lines = read_sentences(args.sentences, args.input)
    model_run = load_translation_run(args.run, args.device, args.beam)
    out = translate_lines(model_run, lines, args)
    text = "".join(line + "\n" for line in out)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0
