"""Continuous batching on a GPU: attnmask's ``Engine`` against transformers' ``generate_batch``, same weights.

``python benchmarks/serve.py --device cuda`` runs this (the CPU comparison against llama-server goes
over HTTP; on a GPU the peer is transformers' own continuous batching, a library call, so both engines
are driven in-process here). SmolLM2-135M-Instruct's weights (the GGUF file dequantized, or
``--gguf PATH``) in bfloat16 on the GPU, exported once to a Hugging Face Llama checkpoint
(:func:`attnmask.train.export.export_hf`) for transformers.

attnmask runs its packed step: paged KV cache, self-attention through FlexAttention with a
``BlockMask`` per step built from the mask algebra (``document & causal`` at each sequence's own
offset over the cache blocks, :func:`attnmask.decode.step.paged_mask`), greedy. transformers runs
``model.generate_batch`` (paged cache, its default attention for continuous batching, CUDA graphs
as it decides), greedy, end-of-sequence disabled so that both produce ``max_tokens`` for every
request.

For each level, ``level`` requests (the fixed prompts of benchmarks/serve.py, cycled) are submitted
at once; the wall time from submission to the last token gives output tokens per second. Each
level runs once untimed first, on each engine (compilation of its shapes, CUDA graph capture).
Printed per level and engine: tokens/s, and two agreements: the fraction of requests whose tokens
equal the other engine's, and the fraction equal to the same engine's answer for that prompt alone
(level 1), i.e. whether an answer depends on who else is in the batch. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import inspect
import tempfile
import time
from pathlib import Path

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompts_ids(tokenizer, prompts: list[str], n: int) -> list[list[int]]:
    ids = [tokenizer.encode(p) for p in prompts]
    return [list(ids[i % len(ids)]) for i in range(n)]


def attnmask_engine(model, level: int, args):
    from attnmask.engine import Engine

    return Engine(model, kv_cache_mib=args.kv_cache_mib, max_seqs=level, max_batch_tokens=args.max_batch_tokens)


def run_attnmask(model, prompts: list[list[int]], args) -> tuple[float, list[list[int]]]:
    from attnmask.engine import RequestParams

    engine = attnmask_engine(model, len(prompts), args)
    params = RequestParams(max_tokens=args.max_tokens, ignore_eos=True)
    sync()
    start = time.perf_counter()
    done = engine.generate(prompts, params)
    sync()
    return time.perf_counter() - start, [c.tokens for c in done]


def run_hf(hf, prompts: list[list[int]], args) -> tuple[float, list[list[int]]]:
    import transformers as tf

    config = tf.GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    kwargs = {}
    if "warmup" in inspect.signature(hf.generate_batch).parameters:
        kwargs["warmup"] = False  # warmed up by the untimed level before
    sync()
    start = time.perf_counter()
    out = hf.generate_batch(inputs=prompts, generation_config=config, **kwargs)
    sync()
    wall = time.perf_counter() - start
    by_id = sorted(out.items(), key=lambda kv: int(kv[0].split("_")[-1]))  # req_0, req_1, ... in order
    return wall, [list(v.generated_tokens) for _, v in by_id]


def main_cuda(args) -> None:
    import transformers as tf

    from attnmask.model import fuse_projections_
    from attnmask.pretrained import load
    from attnmask.train.export import export_hf
    from serve import PROMPTS  # benchmarks/, run as a script

    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    model, tokenizer, chat = load(args.gguf or "smollm2", fuse=False)
    hf_dir = Path(tempfile.mkdtemp()) / "hf"
    export_hf(model, tokenizer, chat, hf_dir)
    hf = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to("cuda").eval()
    # as `attnmask serve` loads it: q/k/v and gate/up fused, 5 products a layer instead of 7 (the
    # export above needs them apart; the figures of 2026-11-25 were measured with them apart)
    model = fuse_projections_(model.to("cuda", dtype).eval())
    levels = sorted({int(x) for x in args.levels.split(",")} | {1})
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {tf.__version__}")
    attn = hf.config._attn_implementation
    print(f"# SmolLM2-135M-Instruct ({args.gguf or 'smollm2'} dequantized), {args.dtype}, greedy, {args.max_tokens} "
          f"new tokens a request, end-of-sequence off; attention: attnmask FlexAttention BlockMask over the paged "
          f"cache, transformers {attn} in generate_batch")  # fmt: skip
    solo = {}
    width = min(args.solo, len(PROMPTS))
    for name, run, engine_model in (("attnmask", run_attnmask, model), ("transformers", run_hf, hf)):
        run(engine_model, prompts_ids(tokenizer, PROMPTS, 4), args)  # warm-up: compile, graphs
        singles = []
        for p in prompts_ids(tokenizer, PROMPTS, width):  # each distinct prompt alone: the solo answers
            singles.append(run(engine_model, [p], args)[1][0])
        solo[name] = singles
    results = {}
    for level in levels:
        prompts = prompts_ids(tokenizer, PROMPTS, level)
        for name, run, engine_model in (("attnmask", run_attnmask, model), ("transformers", run_hf, hf)):
            run(engine_model, prompts, args)  # untimed: this level's shapes compiled, graphs captured
            wall, tokens = run(engine_model, prompts, args)
            results[level, name] = tokens
            produced = sum(len(t) for t in tokens)
            seen = [(i, t) for i, t in enumerate(tokens) if i % len(PROMPTS) < width]
            same_solo = sum(t == solo[name][i % len(PROMPTS)] for i, t in seen) / len(seen)
            print(f"{name:<13} requests={level:<4} {produced / wall:9.1f} tok/s  wall {wall:7.2f} s  "
                  f"same as its solo answer {same_solo:6.1%}", flush=True)  # fmt: skip
        ours, theirs = results[level, "attnmask"], results[level, "transformers"]
        agree = sum(a == b for a, b in zip(ours, theirs)) / len(ours)
        print(f"{'':13} requests={level:<4} attnmask = transformers token for token: {agree:6.1%}", flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="--device cuda: weights' dtype")
    parser.add_argument("--gguf", default=None, help="--device cuda: a GGUF file (default: the smollm2 package's)")
    parser.add_argument("--solo", type=int, default=30, help="--device cuda: prompts also run alone (invariance)")
