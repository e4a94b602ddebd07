"""Gemma 3 270M with a long prompt: prefill time, decode speed and KV-cache memory, attnmask against llama.cpp.

One prompt of ``--tokens`` tokens (8,192 by default; a text repeated), then ``--new-tokens`` greedy tokens,
never stopping early, batch 1, the same GGUF file on both sides:

- attnmask: the serving engine (:class:`attnmask.engine.Engine`: the packed step over the paged cache,
  whose local layers keep their blocks for the last 512 positions only), prefilling ``--chunk`` prompt
  tokens a step; ``blocks`` (``load("gemma3", quantized=True)``), ``blocks-int8`` (the same blocks with
  ``activations="int8"``: each input row rounded to 8 bits per block of 32, llama.cpp's own arithmetic)
  and/or ``float32``.
  Cache memory = the most blocks in use at once (over the whole run) x the bytes of a block
  (:meth:`PagedKVCache.nbytes` / blocks), beside what one table for every layer would hold for the
  same positions (a full cache, same dtype).
- llama.cpp (``llama-cpp-python``, importable, not a dependency of attnmask): ``n_batch`` = ``--chunk``,
  its KV cache as small as it makes it (``swa_full=False``: local layers keep their window's cells;
  float16 keys and values, its default); its cache size is the ``llama_kv_cache: size = ...`` lines it
  logs when the context is made.

prefill s = from the request to its first token (the whole prompt, and that token's step);
decode tok/s = the other new tokens / the time from the first token to the last. The median of
``--repeats`` runs, contenders taking turns, after one warm-up run each. The first new tokens of
each side are printed (llama.cpp's int8 activations may part ways with attnmask's float32 ones).

Run: ``python benchmarks/gemma3_context.py [--tokens 8192] [--threads 2] [--variants blocks blocks-int8]``.
Needs the Gemma 3 weights (see benchmarks/gemma3.py). Nothing is asserted; figures belong in
docs/benchmarks.md with the CPU named.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import time

import torch

from attnmask.engine import Engine, RequestParams
from attnmask.model.cache import layer_groups
from attnmask.pretrained import load
from attnmask.pretrained.registry import locate
from matmul import cpu_name  # benchmarks/, run as a script

TEXT = (
    "The history of the printing press begins in East Asia, where movable type was first made of clay, "
    "then of wood and metal; in Europe, Gutenberg's press of about 1450 spread through trade cities. "
)


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(TEXT)
    return ids[:n]


def attnmask_runner(model, ids: list[int], n: int, chunk: int, block_size: int):
    """A function running the request once on a fresh engine: (prefill s, decode s, tokens, peak bytes)."""

    def run():
        engine = Engine(model, kv_cache_mib=512, block_size=block_size, max_batch_tokens=chunk, max_seqs=1)
        per_block = engine.cache.nbytes() / engine.cache.pool.num_blocks
        t0 = time.perf_counter()
        engine.add_request(ids, RequestParams(max_tokens=n, ignore_eos=True))
        tokens, first, most = [], None, 0
        while engine.has_work():
            events = engine.step()
            most = max(most, engine.stats().blocks_used)
            for event in events:
                tokens.append(event.token)
                if first is None:
                    first = time.perf_counter()
        end = time.perf_counter()
        return first - t0, end - first, tokens, int(most * per_block)

    return run


def full_cache_bytes(model, positions: int) -> int:
    """Keys and values of every layer for ``positions`` positions, in the model's dtype: one table."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    size = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4
    return 2 * cfg.n_layers * positions * cfg.n_kv_heads * cfg.head_dim * size


LLAMA_CHILD = r"""
import json, sys, time
from llama_cpp import Llama
ids, n, threads, chunk, repeats = json.loads(sys.argv[1])
llm = Llama(model_path=sys.argv[2], n_ctx=len(ids) + n + 16, n_batch=chunk, n_ubatch=chunk, n_threads=threads,
            n_threads_batch=threads, swa_full=False, verbose=True)
runs = []
for _ in range(repeats + 1):
    llm.reset()  # from position 0: without it, generate reuses the cached prompt and skips its prefill
    t0 = time.perf_counter(); first = None; got = []
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
        if first is None:
            first = time.perf_counter()
        got.append(token)
        if len(got) == n:
            break
    end = time.perf_counter()
    runs.append((first - t0, end - first, got))
print("RESULT " + json.dumps(runs[1:]), flush=True)
"""


def llama_cpp_runs(ids: list[int], n: int, threads: int, chunk: int, repeats: int):
    """llama.cpp in a child process (its log, which names its cache size, goes to the child's stderr):
    ([(prefill s, decode s, tokens)] of ``repeats`` runs after a warm-up, cache MiB)."""
    import json

    proc = subprocess.run(
        [sys.executable, "-c", LLAMA_CHILD, json.dumps([ids, n, threads, chunk, repeats]), str(locate("gemma3"))],
        capture_output=True, text=True, env=os.environ, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"llama.cpp run failed: {proc.stderr.strip().splitlines()[-1:]}")
    runs = json.loads(proc.stdout.split("RESULT ", 1)[1])
    mib = sum(float(m) for m in re.findall(r"llama_kv_cache: size =\s*([\d.]+) MiB", proc.stderr))
    return runs, mib


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=33)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk", type=int, default=512, help="prompt tokens a step (llama.cpp: n_batch)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variants", nargs="+", choices=("blocks", "blocks-int8", "float32"), default=["blocks"])
    p.add_argument("--no-llama-cpp", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    n = args.new_tokens
    print(f"# {cpu_name()}, {os.cpu_count()} CPUs, {args.threads} threads, torch {torch.__version__}; "
          f"prompt {args.tokens} tokens, {n} new, chunk {args.chunk}")  # fmt: skip
    rows = []
    for variant in args.variants:
        activations = "int8" if variant == "blocks-int8" else "float32"
        model, tokenizer, _ = load("gemma3", quantized=variant != "float32", activations=activations)
        ids = prompt_ids(tokenizer, args.tokens)
        run = attnmask_runner(model, ids, n, args.chunk, args.block_size)
        run()  # warm-up: kernels built, memory touched
        got = [run() for _ in range(args.repeats)]
        prefill = statistics.median(g[0] for g in got)
        decode_s = statistics.median(g[1] for g in got)
        full = full_cache_bytes(model, len(ids) + n)
        windows = sorted({g.window for g in layer_groups(model.config, by_window=True)})
        rows.append((f"attnmask {variant}", prefill, (n - 1) / decode_s, got[0][3] / 2**20, full / 2**20, got[0][2]))
        print(f"attnmask {variant}: windows {windows}; full cache would be {full / 2**20:.1f} MiB", flush=True)
    if not args.no_llama_cpp and importlib.util.find_spec("llama_cpp") is not None:
        ids = prompt_ids(load("gemma3", quantized=True)[1], args.tokens) if not rows else ids
        runs, mib = llama_cpp_runs(ids, n, args.threads, args.chunk, args.repeats)
        prefill = statistics.median(r[0] for r in runs)
        decode_s = statistics.median(r[1] for r in runs)
        full = 2 * 18 * (len(ids) + n) * 256 * 2  # float16, every layer
        rows.append(("llama.cpp", prefill, (n - 1) / decode_s, mib, full / 2**20, runs[0][2]))
    print()
    print(
        "| implementation | prefill s | prefill tok/s | decode tok/s | KV cache MiB | full cache MiB | cache / full |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, prefill, tps, mib, full, _ in rows:
        print(f"| {name} | {prefill:.2f} | {args.tokens / prefill:.0f} | {tps:.1f} | {mib:.1f} | {full:.1f} | "
              f"{mib / full:.3f} |")  # fmt: skip
    for name, *_, tokens in rows:
        print(f"{name}: first tokens {tokens[:12]}")


if __name__ == "__main__":
    main()
