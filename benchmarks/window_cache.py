"""Memory of the paged KV cache on Gemma 3 270M (float32) at a long prompt: window groups against one table.

Gemma 3's 15 local layers read their last 512 positions; with the cache grouped by window
(:func:`attnmask.model.cache.layer_groups`, what the engine and ``decode`` use) their blocks go back to
the pool as the prompt is prefilled, and a block holds one group's 3 layers. Both modes prefill the
prompt ``--chunk`` tokens a step through the packed step (:func:`attnmask.decode.step.packed_forward`),
over a pool sized for this one prompt as the engine sizes it for a request
(:meth:`~attnmask.model.cache.Paging.peak`): ``--mode windowed`` over the grouped cache, the window
groups' blocks given back before each chunk; ``--mode full`` over one table for every layer (nothing
freed). Each mode in its own process (run them one after the other): it prints the pool
tensors' bytes (``PagedKVCache.nbytes``), the blocks in use at their most and after the prefill, the
process's resident memory before the cache was made (after one short forward, so that the weights are
resident, and ``malloc_trim``, so that the cache is not made in memory loading freed) and at the end
(VmRSS, VmHWM), the wall time, and
the first generated token with its logit (the two modes must agree: the packed step reads the same keys).
``--mode both``: the two caches in one process, chunk by chunk, each chunk timed (the same load for
both), and every chunk's last logits compared.

Run: ``python benchmarks/window_cache.py --mode windowed --tokens 8192`` then ``--mode full``.
Needs the Gemma 3 weights (see benchmarks/gemma3.py). Nothing is asserted; figures belong in
docs/benchmarks.md with the CPU named.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import torch

from attnmask.decode.step import fused_plan, packed_forward
from attnmask.model.cache import PagedKVCache, Paging, layer_groups
from attnmask.pretrained import load

TEXT = "The history of the printing press begins in East Asia, where movable type was first made of clay. "


def rss() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                name, value = line.split(":")
                out[name] = int(value.split()[0]) // 1024
    return out


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(TEXT)
    return ids[:n]


def interleaved(model, ids: list[int], chunk: int, S: int) -> dict:
    """Both caches in one process, chunk by chunk (the windowed cache's chunk, then the one table's), each
    timed: the two see the same load. Returns the seconds of each and whether every chunk's last logits
    are the same bits."""
    runs = {}
    for by_window in (True, False):
        windows = tuple(g.window for g in layer_groups(model.config, by_window=by_window))
        need = Paging(None, S, windows).peak(len(ids), chunk)
        cache = PagedKVCache.for_model(model, num_blocks=1 + need, block_size=S, by_window=by_window)
        runs[by_window] = (cache, cache.paging.new(), [0.0], [])
    with torch.inference_mode():
        for a in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - a)
            for cache, tables, seconds, outs in runs.values():
                t0 = time.perf_counter()
                cache.paging.forget(tables, a)
                cache.paging.extend(tables, a + n, a)
                width = max(len(t) for t in tables)
                tensors = [torch.tensor([t + [0] * (width - len(t))]) for t in tables]  # (1, W) each group
                outs.append(packed_forward(
                    model, cache, torch.tensor(ids[a : a + n]), torch.arange(a, a + n),
                    torch.zeros(n, dtype=torch.long), tensors, torch.tensor([n - 1]),
                ))  # fmt: skip
                seconds[0] += time.perf_counter() - t0
    same = all(torch.equal(x, y) for x, y in zip(runs[True][3], runs[False][3]))
    return dict(
        mode="both", tokens=len(ids), chunk=chunk, windowed_s=round(runs[True][2][0], 1),
        one_table_s=round(runs[False][2][0], 1), same_bits=same,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("windowed", "full", "both"), required=True)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=256, help="prompt tokens per packed step")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer, _ = load("gemma3")
    ids = prompt_ids(tokenizer, args.tokens)
    S, chunk = args.block_size, args.chunk
    if args.mode == "both":
        print(json.dumps(interleaved(model, ids, chunk, S)))
        return
    groups = layer_groups(model.config, by_window=args.mode == "windowed")
    windows = tuple(g.window for g in groups)
    need = Paging(None, S, windows).peak(len(ids), chunk)
    with torch.inference_mode():
        model.decode(torch.tensor([ids[:16]]))  # every weight read once: resident before the baseline
    plan = fused_plan(model)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what loading freed goes back: the cache is not made in it
    before = rss()
    cache = PagedKVCache.for_model(model, num_blocks=1 + need, block_size=S, by_window=args.mode == "windowed")
    paging = cache.paging
    tables = paging.new()
    most, logits = 0, None
    t0 = time.perf_counter()
    with torch.inference_mode():
        for a in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - a)
            paging.forget(tables, a)
            paging.extend(tables, a + n, a)
            most = max(most, cache.pool.used)
            width = max(len(t) for t in tables)
            tensors = [torch.tensor([t + [0] * (width - len(t))]) for t in tables]  # (1, W) each group
            logits = packed_forward(
                model, cache, torch.tensor(ids[a : a + n]), torch.arange(a, a + n), torch.zeros(n, dtype=torch.long),
                tensors, torch.tensor([n - 1]), plan,
            )[0]  # fmt: skip
    wall = time.perf_counter() - t0
    paging.forget(tables, len(ids))  # the next token's rows read from len(ids) on
    token = int(logits.argmax())
    print(
        json.dumps(
            dict(
                mode=args.mode,
                tokens=len(ids),
                chunk=chunk,
                block_size=S,
                groups=[(g.window, len(g.layers)) for g in groups],
                layers_per_block=len(groups[0].layers),
                blocks=cache.num_blocks,
                nbytes_mib=round(cache.nbytes() / 2**20, 1),
                most_used_blocks=most,
                used_after_prefill=cache.pool.used,
                used_after_prefill_mib=round(cache.nbytes() * cache.pool.used / cache.num_blocks / 2**20, 1),
                rss_mib_before_cache=before,
                rss_mib_end=rss(),
                prefill_s=round(wall, 1),
                token=token,
                logit=float(logits[token]),
            )  # fmt: skip
        )
    )


if __name__ == "__main__":
    main()
