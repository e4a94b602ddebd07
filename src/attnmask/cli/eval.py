"""``attnmask eval``: translate a test set with a run and score it with sacreBLEU (BLEU, chrF)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import sacrebleu

from attnmask.cli.common import check_args
from attnmask.cli.translate import check_options, load_translation_run, translate_lines
from attnmask.data import read_lines
from attnmask.errors import UserError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="BLEU and chrF of a translation run on a test set",
        description="Translate --src FILE with the run (cached decoder; greedy or --beam N) and score the "
        "output against --ref FILE with sacreBLEU (detokenized, default 13a tokenization). Files are UTF-8, "
        "optionally .gz, one sentence a line, aligned.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--run", required=True, metavar="DIR", help="run directory written by `attnmask train`")
    p.add_argument("--src", required=True, metavar="FILE", help="source sentences")
    p.add_argument("--ref", required=True, metavar="FILE", help="reference translations, aligned with --src")
    p.add_argument("--beam", type=int, default=1, help="beam size (1 = greedy)")
    p.add_argument("--length-penalty", type=float, default=1.0, help="beam search: score / length ** this")
    p.add_argument("--batch-size", type=int, default=64, help="sentences decoded at once")
    p.add_argument("--max-len", type=int, default=None, help="most tokens per translation (default 1.5 x source + 10)")
    p.add_argument("--output", metavar="FILE", help="also write the translations to FILE")
    p.add_argument("--device", default="cpu", help="torch device")
    p.set_defaults(func=run)


def run(args) -> int:
    check_args(args)
    check_options(args)
    src = read_lines(args.src)
    ref = read_lines(args.ref)
    if len(src.lines) != len(ref.lines):
        raise UserError(
            f"{args.src} has {len(src.lines)} non-empty lines but {args.ref} has {len(ref.lines)}; "
            "expected aligned files (line i of --ref translates line i of --src)"
        )
    model_run = load_translation_run(args.run, args.device, args.beam)
    start = time.perf_counter()
    hyps = translate_lines(model_run, src.lines, args)
    seconds = time.perf_counter() - start
    bleu = sacrebleu.corpus_bleu(hyps, [ref.lines])
    chrf = sacrebleu.corpus_chrf(hyps, [ref.lines])
    if args.output:
        Path(args.output).write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    decoding = "greedy" if args.beam == 1 else f"beam {args.beam}"
    print(f"{len(hyps)} sentences, {decoding}, {seconds:.1f} s ({len(hyps) / max(seconds, 1e-9):.1f} sentences/s)")
    print(bleu)
    print(chrf)
    return 0
