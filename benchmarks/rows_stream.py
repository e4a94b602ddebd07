"""The float32 rows product of the decoding step (``linear_panels``, ``csrc/rows.cpp``) on SmolLM2-135M's
shapes and the translation model's (``benchmarks/decode.py --part translate``).

For each shape ``W (N, K)`` and row count ``M``: the best of ``--repeats`` timings (each the mean of enough
calls to take ~50 ms) of :func:`attnmask.ops.decoding.linear_panels` on the weight packed once (as the step
holds it) and of ``torch.nn.functional.linear`` on the row-major weight, then GB/s of weight read (``N * K *
4`` bytes a call), GMAC/s and the ratio. Each weight is a fresh tensor per shape, several of them taking turns
so that the weight comes from memory, not from the caches, as it does when decoding a 540 MB model.
``--decode``: also the end-to-end figure, greedy decoding of ``--new-tokens`` tokens at batch 1 with
SmolLM2-135M in float32 (``attnmask.pretrained.load("smollm2")``; needs its weights), best of ``--repeats``.

Run: ``python benchmarks/rows_stream.py [--threads 1,2] [--rows 1,16,64] [--repeats 5] [--decode]``.
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from attnmask.ops import native
from attnmask.ops.decoding import linear_panels, pack_panels

# (name, N, K): SmolLM2-135M's products, q/k/v and gate/up fused as load() fuses them; the Marian-size
# translation decoder's (t_*: each attention projection, the two MLP products, the head of an 8,000 BPE)
SHAPES = [
    ("qkv", 960, 576),
    ("o", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("head", 49152, 576),
    ("t_proj", 512, 512),
    ("t_fc1", 2048, 512),
    ("t_fc2", 512, 2048),
    ("t_head", 8000, 512),
]
COPIES_BYTES = 160 << 20  # weights taking turns: more than the L3 cache holds


def best_seconds(fn, repeats: int) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.02:
        fn()
        calls += 1
    calls = max(1, calls * 2)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def cycling(fn, xs, ws, *extra):
    state = {"i": 0}

    def call():
        i = state["i"] = (state["i"] + 1) % len(ws)
        return fn(xs, ws[i], None, *extra)

    return call


def kernels(args) -> None:
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, N, K in SHAPES:
            copies = max(1, min(64, COPIES_BYTES // (N * K * 4)))
            ws = [torch.randn(N, K) for _ in range(copies)]
            panels = [pack_panels(w) for w in ws]
            for M in args.rows:
                x = torch.randn(M, K)
                ours = best_seconds(cycling(linear_panels, x, panels, N), args.repeats)
                gb = N * K * 4 / 1e9
                line = f"threads {threads}  {name:8s} N={N:5d} K={K:4d} M={M:3d}  "
                line += f"panels {ours * 1e6:8.1f} us {gb / ours:6.1f} GB/s {M * N * K / ours / 1e9:6.1f} GMAC/s"
                if not args.no_torch:
                    theirs = best_seconds(cycling(F.linear, x, ws), args.repeats)
                    rate = M * N * K / theirs / 1e9
                    line += f"   F.linear {theirs * 1e6:8.1f} us {rate:6.1f} GMAC/s   ratio {theirs / ours:5.2f}"
                print(line, flush=True)


def end_to_end(args) -> None:
    from attnmask import decode
    from attnmask.pretrained import load

    model = load("smollm2")[0]
    ids = [1, 504, 3458, 282, 4649, 314]
    for threads in args.threads:
        torch.set_num_threads(threads)
        decode.greedy(model, prompts=[ids], max_new_tokens=4, eos_id=None)
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            decode.greedy(model, prompts=[ids], max_new_tokens=args.new_tokens, eos_id=None)
            best = min(best, time.perf_counter() - start)
        rate = args.new_tokens / best
        print(f"threads {threads}  batch-1 float32 decoding: {rate:6.1f} tokens/s (best of {args.repeats})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--rows", default="1,16,64", help="comma-separated row counts M")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    parser.add_argument("--no-torch", action="store_true", help="skip torch.nn.functional.linear")
    parser.add_argument("--decode", action="store_true", help="also time batch-1 decoding end to end")
    parser.add_argument("--only-decode", action="store_true", help="only the end-to-end figure")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    args.threads = [int(t) for t in args.threads.split(",")]
    args.rows = [int(m) for m in args.rows.split(",")]
    if args.shapes:
        wanted = set(args.shapes.split(","))
        SHAPES[:] = [s for s in SHAPES if s[0] in wanted]
    print(f"load {os.getloadavg()[0]:.2f}", flush=True)
    if not native.available():
        raise SystemExit("the native kernels are not available: linear_panels would be F.linear")
    if not args.only_decode:
        kernels(args)
    if args.decode or args.only_decode:
        end_to_end(args)
    print(f"load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
