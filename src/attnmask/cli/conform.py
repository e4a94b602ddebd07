"""``attnmask conform``: every mask scenario under every attention implementation of a Hugging Face model.

Exit codes: 0 every scenario passed under every implementation, 1 one failed, 2 a usage error.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from attnmask.errors import UserError

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_parser(sub) -> None:
    from attnmask.audit.conform import SCENARIOS
    from attnmask.audit.conform.models import TINY_CONFIGS

    p = sub.add_parser(
        "conform",
        help="every mask scenario under every attention implementation of a Hugging Face model (exit 1 on a failure)",
        description="Conformance of a Hugging Face model's attention implementations (eager, sdpa, flex_attention, "
        "flash_attention_* when importable, and any registered with AttentionInterface): causality, sliding-window "
        "reach, left/right padding, fully padded rows, packed sequences (restarting position_ids, with and without "
        "an all-ones attention_mask), cached vs uncached logits, batched left-padded greedy = one prompt at a time, "
        "implementations against each other and against attnmask's float64 reference. Prints a table (or JSON), "
        "draws a PNG per failure, exits 1 when any scenario fails.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help=f"a tiny random model ({', '.join(TINY_CONFIGS)}), a local Hugging Face checkpoint directory, "
        "a .gguf file, or a registered GGUF model name (smollm2)",
    )
    p.add_argument(
        "--impl",
        metavar="NAME,NAME",
        help="attention implementations to test (default: every one transformers' AttentionInterface offers)",
    )
    p.add_argument(
        "--scenarios",
        metavar="NAME,NAME",
        help=f"scenarios to run (default all): {', '.join(SCENARIOS)}",
    )
    p.add_argument("--skip", metavar="NAME,NAME", help="scenarios to leave out")
    p.add_argument("--length", type=int, default=12, metavar="T", help="tokens per audited sequence")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens (and of a tiny model's weights)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the model's dtype")
    p.add_argument("--json", action="store_true", help="print the report as JSON (report.to_dict())")
    p.add_argument(
        "--png-dir",
        default="conform-failures",
        metavar="DIR",
        help="where one PNG per failure goes (measured dependency matrix beside the intended mask)",
    )
    p.add_argument("--plain", action="store_true", help="a plain-text table even on a terminal")
    p.set_defaults(func=run)


def _names(spec: str | None, flag: str, known) -> list[str] | None:
    if spec is None:
        return None
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise UserError(f"{flag} {spec!r}: expected comma-separated names")
    if known is not None:
        bad = [n for n in names if n not in known]
        if bad:
            raise UserError(f"{flag}: unknown {bad}; expected some of {', '.join(known)}")
    return names


def run(args) -> int:
    from attnmask.audit.conform import SCENARIOS, conform
    from attnmask.audit.conform.models import load_model

    if args.length < 8:
        raise UserError(f"--length {args.length}: expected an int >= 8")
    wanted = _names(args.scenarios, "--scenarios", SCENARIOS) or list(SCENARIOS)
    skip = _names(args.skip, "--skip", SCENARIOS) or []
    wanted = [s for s in wanted if s not in skip]
    if not wanted:
        raise UserError("no scenario left to run after --skip")
    impls = _names(args.impl, "--impl", None)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        raise UserError("attnmask conform needs the transformers package: pip install 'attnmask[hf]'") from e
    hf_logging.set_verbosity_error()  # transformers' own notices would bury the verdict
    # and so would torch.compile's recompile warnings (FlexAttention compiles per mask and shape)
    torch._logging.set_logs(dynamo=logging.ERROR, inductor=logging.ERROR)
    model, description = load_model(args.model, seed=args.seed, dtype=DTYPES[args.dtype])
    report = conform(
        model, impls, scenarios=wanted, length=args.length, seed=args.seed, png_dir=args.png_dir, name=description
    )
    if args.json:
        print(report.to_json())
        return report.exit_code
    rich_console = None
    if not args.plain and sys.stdout.isatty():
        try:
            from rich.console import Console

            rich_console = Console()
        except ImportError:
            pass
    if rich_console is not None:
        report.print_rich(rich_console)
    else:
        print(report.to_text())
    return report.exit_code
