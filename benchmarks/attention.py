"""Causal + padding attention: the seeds' formula vs SDPA vs ``attnmask.attention(backend="auto")``.

Times one attention call, forward and forward+backward, in float32 and bfloat16, for
``T`` in {64, ..., 2048} with 0%, 25% and 50% of the key positions padding (right padding, the
decoder-training case: seed 004's ``M_total`` = look-ahead + key padding). Contenders:

    (a) formula   the seeds' formula in plain torch with a materialized additive 0/-inf mask:
                  softmax(q @ kᵀ / √D + M) @ v
    (b) sdpa+mask F.scaled_dot_product_attention with a materialized bool mask (B, 1, T, T)
    (c) is_causal F.scaled_dot_product_attention(is_causal=True): only correct without padding,
                  so "n/a" when there is padding
    (d) auto      attnmask.attention(q, k, v, masks.causal() & masks.padding(lengths=...),
                  backend="auto"): includes linting and planning the mask on every call

The masks of (a) and (b) are built once, outside the timed region (a model builds them once per
forward and shares them across layers); (d) gets the structured Mask and pays for everything.
Every contender's output is checked against (a)'s (same inputs and dtype, the dtype's tolerance),
so that the table never reports the time of a wrong answer.

Times are the minimum over at least ``--repeats`` runs after one warm-up run, more for fast cells
(until 0.5 s or 30 runs), the contenders taking turns so that they share the machine's load; the
minimum is the least noisy estimate of what the code costs on a shared machine. A run longer than
2 s is timed once. On a 2-core machine shared with other jobs, ``--threads 1`` gives far steadier
numbers than two threads waiting on each other. Speed-up = t(a) / t(x).

    python benchmarks/attention.py                 # full table (about 8 minutes on 2 cores)
    python benchmarks/attention.py --quick         # smoke run
    python benchmarks/attention.py --threads 1 --repeats 5 --write-docs docs/benchmarks.md

``--write-docs`` rewrites the whole ``## Attention`` section (header, machine, command, table) and
leaves the other sections alone; the notes under the table are written by hand, so a rerun drops
them rather than leave stale claims under new numbers.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnmask import masks
from attnmask.attention import attention

H, D = 8, 64
SECTION = "## Attention"
SLOW_S = 2.0  # a run longer than this is timed once, its warm-up being negligible
BUDGET_S, MAX_REPEATS = 0.5, 30  # fast cells repeat (beyond --repeats) until 0.5 s or 30 runs


@dataclass
class Case:
    dtype: torch.dtype
    backward: bool
    T: int
    B: int
    pad: float  # mean fraction of padded key positions


def batch_for(T: int) -> int:
    """B=4 up to T=512, then fewer rows so that the quadratic formula (a) finishes in seconds."""
    return max(1, 4 * 512 // max(T, 512))


def lengths_for(B: int, T: int, pad: float) -> list[int]:
    """Real lengths with mean padding ``pad``: row b is padded by ``pad * 2(b+1)/(B+1)`` of T."""
    return [max(1, round(T * (1 - pad * 2 * (b + 1) / (B + 1)))) for b in range(B)]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads, "
        f"{torch.backends.cpu.get_cpu_capability()}), Python {platform.python_version()}"
    )


def contenders(case: Case, q, k, v, lengths: list[int]):
    """The four attention calls of one case, as zero-argument functions returning ``(B, H, T, D)``."""
    B, T = case.B, case.T
    keep = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T)
    allowed = (
        torch.ones(T, T, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
    ).contiguous()  # (B, 1, T, T)
    additive = torch.zeros(B, 1, T, T, dtype=case.dtype).masked_fill_(~allowed, float("-inf"))  # (B, 1, T, T)
    mask = masks.causal() & masks.padding(lengths=lengths)
    padded = any(L < T for L in lengths)

    def formula():
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D) + additive, dim=-1) @ v  # (B, H, T, D)

    def sdpa_mask():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

    def sdpa_causal():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def auto():
        return attention(q, k, v, mask, backend="auto")

    return {"formula": formula, "sdpa+mask": sdpa_mask, "is_causal": None if padded else sdpa_causal, "auto": auto}


def run_case(case: Case, repeats: int) -> dict[str, float | None]:
    """Best wall time in ms of each contender: one warm-up run each, then rounds that run every
    contender once in turn (so that all of them see the same load on a shared machine), at least
    ``repeats`` rounds and more for fast cells. A contender whose warm-up took over ``SLOW_S`` is
    timed by that run alone (the formula in bfloat16 takes seconds at T >= 512 on this CPU)."""
    g = torch.Generator().manual_seed(case.T)
    q, k, v = (
        torch.randn(case.B, H, case.T, D, generator=g).to(case.dtype).requires_grad_(case.backward) for _ in range(3)
    )  # (B, H, T, D)
    grad = torch.randn(case.B, H, case.T, D, generator=g).to(case.dtype)  # (B, H, T, D)
    fns = contenders(case, q, k, v, lengths_for(case.B, case.T, case.pad))

    def once(fn) -> tuple[float, torch.Tensor]:
        for t in (q, k, v):
            t.grad = None
        start = time.perf_counter()
        out = fn()
        if case.backward:
            out.backward(grad)
        return time.perf_counter() - start, out.detach()

    best, outs = {}, {}
    for name, fn in fns.items():
        if fn is not None:
            best[name], outs[name] = once(fn)
    fast = [name for name, t in best.items() if t <= SLOW_S]
    rounds, spent = 0, 0.0
    while fast and (rounds < repeats or (spent < BUDGET_S and rounds < MAX_REPEATS)):
        for name in fast:
            t, _ = once(fns[name])
            best[name] = t if rounds == 0 else min(best[name], t)  # the warm-up run does not count
            spent += t
        rounds += 1
    # never report the time of a wrong answer: every contender must agree with the formula (a)
    tol = 2e-2 if case.dtype == torch.bfloat16 else 1e-4
    for name, out in outs.items():
        torch.testing.assert_close(out, outs["formula"], rtol=tol, atol=tol, msg=lambda m, n=name: f"{n} is wrong: {m}")
    return {name: None if fn is None else best[name] * 1e3 for name, fn in fns.items()}


def table(rows: list[tuple[Case, dict]]) -> str:
    names = ["formula", "sdpa+mask", "is_causal", "auto"]
    head = (
        "| dtype | pass | T | B | pad | (a) formula ms | (b) sdpa+mask ms | (c) is_causal ms | (d) auto ms "
        "| (b) × | (c) × | (d) × |"
    )
    lines = [head, "|" + "---|" * 12]
    for case, t in rows:
        ms = [("n/a" if t[n] is None else f"{t[n]:.2f}") for n in names]
        speed = [("n/a" if t[n] is None else f"{t['formula'] / t[n]:.2f}") for n in names[1:]]
        dtype = str(case.dtype).removeprefix("torch.")
        pas = "fwd+bwd" if case.backward else "fwd"
        lines.append(f"| {dtype} | {pas} | {case.T} | {case.B} | {case.pad:.0%} | " + " | ".join(ms + speed) + " |")
    return "\n".join(lines)


def write_docs(path: str, body: str) -> None:
    """Replace (or append) the ``## Attention`` section of ``path``, leaving other sections alone."""
    text = "# Benchmarks\n"
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == SECTION), None)
    section = body.strip().splitlines()
    if start is None:
        lines = [*lines, "", *section]
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines = [*lines[:start], *section, "", *lines[end:]]
    with open(path, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="T in {64, 256}, 0%% and 50%% padding, 2 repeats")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per cell (default 3, --quick 2)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated torch dtypes")
    p.add_argument("--T", default=None, help="comma-separated sequence lengths (default 64..2048)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--write-docs", metavar="FILE", help="write the table into FILE's '## Attention' section")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    Ts = (
        [int(t) for t in args.T.split(",")]
        if args.T
        else ([64, 256] if args.quick else [64, 128, 256, 512, 1024, 2048])
    )
    pads = [0.0, 0.5] if args.quick else [0.0, 0.25, 0.5]
    repeats = args.repeats or (2 if args.quick else 3)
    dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",")]
    cases = [Case(dt, bw, T, batch_for(T), pad) for dt in dtypes for bw in (False, True) for T in Ts for pad in pads]
    print(machine())
    print(f"B x H x T x D = B x {H} x T x {D}; causal + right key padding; min of {repeats} runs; × = t(a) / t(x)")
    rows = []
    for case in cases:
        t = run_case(case, repeats)
        rows.append((case, t))
        cells = "  ".join(f"{n}={'n/a' if v is None else f'{v:.2f}ms'}" for n, v in t.items())
        print(f"{case.dtype} {'fwd+bwd' if case.backward else 'fwd'} T={case.T} B={case.B} pad={case.pad:.0%}: {cells}")
        sys.stdout.flush()
    out = table(rows)
    print()
    print(out)
    if args.write_docs:
        cmd = "python benchmarks/attention.py " + " ".join(argv if argv is not None else sys.argv[1:])
        body = "\n".join(
            [
                SECTION,
                "",
                "Causal + right key padding (seed 004's `M_total`), one attention call, "
                f"H={H}, D={D}, B shrinking with T (B=4 up to T=512, 2 at 1024, 1 at 2048); `pad` = mean "
                "fraction of padded keys. (a) the seeds' formula with a materialized additive mask, "
                "(b) SDPA with a materialized bool mask, (c) SDPA `is_causal=True` (correct only without "
                'padding), (d) `attnmask.attention(..., backend="auto")` given the structured mask '
                "(its time includes linting and planning the mask). Times: min of "
                f"{repeats} or more runs (fast cells: until {BUDGET_S:g} s or {MAX_REPEATS} runs) after a warm-up, "
                f"the contenders taking turns; runs over {SLOW_S:g} s timed once; in ms; × = speed-up over "
                "(a), t(a) / t(x). Every contender's output is checked against (a)'s.",
                "",
                f"Machine: {machine()}.",
                "",
                f"Reproduce: `{cmd.replace(' --write-docs ' + args.write_docs, '').strip()}`",
                "",
                out,
            ]
        )
        write_docs(args.write_docs, body)
        print(f"\nwrote the {SECTION!r} section of {args.write_docs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
