"""Priority scheduling: how long an urgent request waits behind a queue, first come first served or by priority.

SmolLM2-135M-Instruct in GGUF blocks (exact) in an :class:`attnmask.engine.Engine` with room for
``--max-seqs`` sequences at once. ``--background`` requests (prompts of ``benchmarks/serve.py``'s corpus,
``--max-tokens`` tokens each, priority 0) are queued; after ``--after`` steps one more request arrives
with priority -1. Reported for ``scheduling="fcfs"`` and ``"priority"``: the urgent request's time to
first token and to its last token (steps and milliseconds), the background requests' total time, and
whether every answer (the urgent one's and the background ones') is the same bit for bit under both
policies.

Run: ``python benchmarks/priority.py [--threads 2] [--max-seqs 4] [--background 16] [--max-tokens 48]
[--after 10]``. Nothing is asserted; figures go to docs/benchmarks.md with the CPU named.
"""

from __future__ import annotations

import argparse
import time

import torch

from matmul import cpu_name  # benchmarks/, run as a script
from serve import PROMPTS


def run(model, tokenizer, args, policy: str) -> dict:
    from attnmask.engine import Engine, RequestParams

    engine = Engine(model, kv_cache_mib=256, max_seqs=args.max_seqs, eos_ids=[], scheduling=policy)
    params = RequestParams(max_tokens=args.max_tokens, logprobs=True)
    for i in range(args.background):
        engine.add_request(tokenizer.encode(PROMPTS[i % len(PROMPTS)]), params, request_id=f"bg{i}")
    answers: dict[str, list] = {}
    steps, first, last, start = 0, None, None, time.perf_counter()
    arrived = None
    while engine.has_work() or arrived is None:
        if steps == args.after:
            urgent = RequestParams(max_tokens=args.max_tokens, logprobs=True, priority=-1 if policy != "fcfs" else 0)
            engine.add_request(
                tokenizer.encode("An urgent question: what is two plus two?"), urgent, request_id="urgent"
            )
            arrived = (steps, time.perf_counter())
        for event in engine.step():
            answers.setdefault(event.request_id, []).append((event.token, event.logprob))
            if event.request_id == "urgent" and event.token is not None:
                now = (steps + 1, time.perf_counter())
                first = first or now
                last = now
        steps += 1
    total = time.perf_counter() - start
    return {
        "ttft_steps": first[0] - arrived[0], "ttft_ms": (first[1] - arrived[1]) * 1e3,
        "done_steps": last[0] - arrived[0], "done_ms": (last[1] - arrived[1]) * 1e3,
        "total_s": total, "steps": steps, "answers": answers,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-seqs", type=int, default=4)
    p.add_argument("--background", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--after", type=int, default=10, help="steps before the urgent request arrives")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from attnmask import pretrained

    model, tokenizer = pretrained.load("smollm2", quantized=True)[:2]
    print(f"# {cpu_name()}, {args.threads} threads, torch {torch.__version__}")
    print(f"# SmolLM2-135M-Instruct, GGUF blocks (exact); {args.background} background requests of "
          f"{args.max_tokens} tokens, {args.max_seqs} at once; an urgent one after {args.after} steps")  # fmt: skip
    run(model, tokenizer, args, "fcfs")  # warm-up
    rows = {policy: run(model, tokenizer, args, policy) for policy in ("fcfs", "priority")}
    print("| scheduling | urgent: first token (steps, ms) | urgent: last token (steps, ms) | all requests | steps |")
    print("|---|---:|---:|---:|---:|")
    for policy, r in rows.items():
        print(f"| {policy} | {r['ttft_steps']}, {r['ttft_ms']:.0f} | {r['done_steps']}, {r['done_ms']:.0f} | "
              f"{r['total_s']:.2f} s | {r['steps']} |")  # fmt: skip
    same = rows["fcfs"]["answers"] == rows["priority"]["answers"]
    print(f"every answer the same bit for bit under both policies: {same}")


if __name__ == "__main__":
    main()
