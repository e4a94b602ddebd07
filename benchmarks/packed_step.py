"""The packed step's own cost on the CPU: one decoding step at 1 and 16 rows, and paged attention alone.

- ``step``: SmolLM2-135M-Instruct in GGUF blocks (``load("smollm2", quantized=True)``) in an
  :class:`attnmask.engine.Engine`; ``--rows`` requests of a 9-token prompt each, prefilled in one step,
  then greedy steps until each has ``--new-tokens`` tokens (EOS ignored): the mean time of a decoding
  step (every request in it), the best of ``--repeats`` runs after one warm-up run.
- ``attend``: ``torch.ops.attnmask.paged_attend`` alone on random pools: a decoding step (``N``
  sequences of one row at context ``ctx``) or a prefill chunk (``N`` consecutive rows of one sequence
  ending at ``ctx``), for SmolLM2's heads (9 over 3, D = 64) and Gemma 3 270M's (4 over 1, D = 256; a
  global layer, and a local one with its window of 512); the pools may stay in the last-level cache
  between calls here (Gemma's 16 MB at 8k in a 32 MB L3), unlike in a model's step, where the weights
  stream through it in between;
  the best of 5 timings of ~0.2 s.

For a before/after, run the same command in a checkout of each revision, each with its own
``ATTNMASK_CACHE`` (two builds sharing one cache evict each other). Run:
``python benchmarks/packed_step.py [--threads 2] [--rows 1 16] [--parts step attend]``. Nothing is
asserted; figures go to docs/benchmarks.md with the CPU named.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from attnmask.ops import native
from matmul import cpu_name  # benchmarks/, run as a script

# (name, N rows, context, heads, kv heads, head dim, prefill?, window)
ATTEND = [
    ("SmolLM2 decode, 16 sequences at 64", 16, 64, 9, 3, 64, False, 0),
    ("SmolLM2 prefill, 512 rows ending at 1024", 512, 1024, 9, 3, 64, True, 0),
    ("Gemma 3 decode, 1 sequence at 8192", 1, 8192, 4, 1, 256, False, 0),
    ("Gemma 3 prefill, 512 rows ending at 8192", 512, 8192, 4, 1, 256, True, 0),
    ("Gemma 3 local layer, the same, window 512", 512, 8192, 4, 1, 256, True, 512),
]


def best_of(fn, repeats: int = 5, span: float = 0.2) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < span:
            fn()
            calls += 1
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def step_times(rows_list: list[int], new_tokens: int, repeats: int, activations: str = "float32") -> None:
    from attnmask import pretrained

    model = pretrained.load("smollm2", quantized=True, activations=activations)[0]
    name = "blocks" if activations == "float32" else f"blocks, {activations} activations"
    for rows in rows_list:
        prompts = [[1, 504, 3575, 282, 4649, 314, 100 + i, 100 + i, 100 + i] for i in range(rows)]
        seconds_a_step(model, prompts, new_tokens)
        ms = min(seconds_a_step(model, prompts, new_tokens) for _ in range(repeats)) * 1e3
        print(f"step   SmolLM2 {name}, {rows:3d} rows: {ms:7.2f} ms a step, {rows / ms * 1e3:7.1f} tok/s", flush=True)


def seconds_a_step(model, prompts: list[list[int]], new_tokens: int) -> float:
    """The mean time of the decoding steps that follow the prompts' step, a fresh engine each call."""
    from attnmask.engine import Engine, RequestParams

    engine = Engine(model, kv_cache_mib=512, max_batch_tokens=256)
    for prompt in prompts:
        engine.add_request(prompt, RequestParams(max_tokens=new_tokens, ignore_eos=True))
    engine.step()  # the prompts
    start, steps = time.perf_counter(), 0
    while engine.has_work():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / steps


def attend_times() -> None:
    g = torch.Generator().manual_seed(0)
    for name, n, ctx, heads, kv_heads, dim, prefill, window in ATTEND:
        block = 16
        width = (ctx + block - 1) // block
        sequences = 1 if prefill else n
        k, v = (torch.randn(sequences * width + 1, block, kv_heads, dim, generator=g) for _ in range(2))
        tables = torch.arange(sequences * width).view(sequences, width) + 1  # block 0: the null block
        if prefill:
            row_seq, row_pos = torch.zeros(n, dtype=torch.long), ctx - n + torch.arange(n)
        else:
            row_seq, row_pos = torch.arange(n), torch.full((n,), ctx - 1)
        q = torch.randn(n, heads * dim, generator=g)
        args = (q, k, v, tables, row_seq, row_pos, window, heads, dim**-0.5)
        seconds = best_of(functools.partial(torch.ops.attnmask.paged_attend, *args))
        print(f"attend {name:42s} {seconds * 1e3:9.3f} ms", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--parts", nargs="+", choices=("step", "attend"), default=["step", "attend"])
    p.add_argument("--activations", choices=("float32", "int8"), default="float32", help="step: the activations")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not native.available():  # timing the PyTorch definitions instead would say nothing about the kernels
        raise SystemExit(f"the native kernels are not available: {native.status()}")
    print(f"# {cpu_name()}, {args.threads} threads, torch {torch.__version__}")
    if "step" in args.parts:
        step_times(args.rows, args.new_tokens, args.repeats, args.activations)
    if "attend" in args.parts:
        attend_times()


if __name__ == "__main__":
    main()
