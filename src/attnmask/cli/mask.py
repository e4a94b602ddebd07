"""``attnmask mask``: draw attention masks the way the seeds do."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from attnmask import masks
from attnmask.cli.common import check_picture_path
from attnmask.errors import UserError
from attnmask.viz import MAX_TEXT_GRID_TOKENS, mask_grid, save_mask_png

KINDS = ("causal", "padding", "window", "prefix", "document", "bidirectional")
DEFAULT_SENTENCE = "Good morning <PAD>"
MAX_TOKENS = 4096  # a (B, T, T) bool mask per kind is built; beyond this it would not fit in memory


def add_parser(sub) -> None:
    p = sub.add_parser(
        "mask",
        help="draw a mask as a token-labelled grid of 0 / -∞ (and as a PNG)",
        description="Draw attention masks for given tokens, as in the seeds: rows are queries, "
        "columns are keys, 0 = may attend, -∞ = blocked. Several sentences form a batch and are "
        f"padded to the longest. Default: seed 004's combined mask for {DEFAULT_SENTENCE!r}.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("sentences", nargs="*", metavar="SENTENCE", help="whitespace-separated tokens")
    p.add_argument("--pad", default="<PAD>", help="the padding token")
    p.add_argument(
        "--kind",
        default="causal,padding",
        help=f"comma-separated mask kinds, combined with &: {', '.join(KINDS)}",
    )
    p.add_argument("--window", type=int, default=2, help="window size for --kind window")
    p.add_argument("--prefix", type=int, default=1, help="prefix length for --kind prefix")
    p.add_argument("--sep", default="<SEP>", help="segment separator token for --kind document")
    p.add_argument("--left-pad", action="store_true", help="pad shorter sentences on the left")
    p.add_argument("--style", choices=("values", "symbols"), default="values", help="0/-∞ or ■/·")
    p.add_argument(
        "--png",
        metavar="FILE",
        help="also write the grids as a picture (several sentences: FILE_1.png, FILE_2.png, ...); "
        f"needed past {MAX_TEXT_GRID_TOKENS} tokens, where a text grid is too wide to read",
    )
    p.set_defaults(func=run)


def _parse_kinds(spec: str) -> list[str]:
    kinds = [k.strip() for k in spec.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad:
        raise UserError(
            f"unknown mask kind {bad[0] if bad else spec!r}; expected a comma-separated list of {', '.join(KINDS)}"
        )
    return kinds


def _build(kind: str, toks: list[list[str]], args) -> tuple[str, masks.Mask]:
    keep = torch.tensor([[t != args.pad for t in row] for row in toks])  # (B, T)
    if kind == "causal":
        return "look-ahead M_look", masks.causal()
    if kind == "padding":
        return "padding M_pad", masks.padding(keep=keep)
    if kind == "window":
        return f"sliding window ({args.window})", masks.sliding_window(args.window)
    if kind == "prefix":
        return f"prefix LM ({args.prefix})", masks.prefix_lm(torch.full((len(toks),), args.prefix))
    if kind == "document":
        seg = torch.tensor([[sum(t == args.sep for t in row[:i]) for i in range(len(row))] for row in toks])
        return "document", masks.document(seg)
    return "bidirectional", masks.from_predicate(lambda b, h, q, kv: torch.ones((), dtype=torch.bool))


def _check(kinds: list[str], toks: list[list[str]], args) -> None:
    """Options that would silently draw something else than asked."""
    T = max(len(r) for r in toks)
    if T > MAX_TOKENS:
        raise UserError(f"a sentence has {T} tokens; expected at most {MAX_TOKENS}")
    if T > MAX_TEXT_GRID_TOKENS and not args.png:
        raise UserError(
            f"a sentence has {T} tokens, too many for a text grid (at most {MAX_TEXT_GRID_TOKENS}); "
            "add --png FILE for a picture"
        )
    if args.png:
        check_picture_path("--png", args.png)
    if "window" in kinds and args.window < 1:
        raise UserError(f"--window must be >= 1, got {args.window}")
    if "prefix" in kinds and not 0 <= args.prefix <= T:
        raise UserError(f"--prefix {args.prefix} does not fit a sentence of {T} tokens; expected 0 <= prefix <= {T}")
    if "document" in kinds and not any(args.sep in row for row in toks):
        raise UserError(
            f"--kind document: no sentence holds the separator {args.sep!r}; expected documents separated by it "
            "(e.g. 'a b <SEP> c d'; set it with --sep)"
        )


def _png_path(png: str, b: int, batch: int) -> Path:
    path = Path(png)
    return path if batch == 1 else path.with_name(f"{path.stem}_{b + 1}{path.suffix or '.png'}")


def run(args) -> int:
    kinds = _parse_kinds(args.kind)
    sentences = args.sentences or [DEFAULT_SENTENCE]
    toks = [s.split() for s in sentences]
    if any(not row for row in toks):
        raise UserError("a sentence is empty; expected at least one whitespace-separated token")
    _check(kinds, toks, args)
    T = max(len(r) for r in toks)
    toks = [([args.pad] * (T - len(r)) + r) if args.left_pad else (r + [args.pad] * (T - len(r))) for r in toks]
    built = [_build(k, toks, args) for k in kinds]
    combined = built[0][1]
    for _, m in built[1:]:
        combined = combined & m
    B = len(toks)
    for b, row in enumerate(toks):
        grids = [(name, m.to_bool(B, T, T)[b, 0]) for name, m in built]
        if len(built) > 1:
            grids.append(("combined M_total", combined.to_bool(B, T, T)[b, 0]))
        if B > 1:
            print(f"== sentence {b + 1}: {' '.join(row)}")
        if T <= MAX_TEXT_GRID_TOKENS:
            for name, g in grids:
                print(mask_grid(g, row, style=args.style, title=name))
                print()
        else:
            print(f"{T} tokens: no text grid (at most {MAX_TEXT_GRID_TOKENS}); see the picture")
        if args.png:
            path = save_mask_png(_png_path(args.png, b, B), grids, row)
            print(f"wrote {path}")
    return 0
