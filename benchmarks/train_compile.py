"""The model step compiled against eager, compile time included: is ``attnmask train --compile`` worth it here?

One model (encoder-decoder, dim 256, 3+3 layers, rotary, RMSNorm, SwiGLU 1024, dropout 0.1) trains
``--steps`` steps on the same Multi30k de->en batches (the first ``--pairs`` pairs, joint BPE,
4,096-token length buckets, lengths rounded up to multiples of 16 as ``--compile`` does) twice:
eagerly, then through ``torch.compile``. Prints the total time of each (compilation included) and
the steady-state target tokens/s after the first 10 steps.

    python benchmarks/train_compile.py [--steps 30] [--pairs 8000] [--threads 2] [--precision fp32|bf16]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from attnmask.data import TokenBucketBatcher, make_translation_batch, translation_lengths
from attnmask.model import ModelConfig, Transformer, lm_loss
from attnmask.train.loop import COMPILE_ROUND_TO
from train_throughput import cpu_name, multi30k_ids


def rounded(t: torch.Tensor, fill: int) -> torch.Tensor:
    return F.pad(t, (0, -t.shape[1] % COMPILE_ROUND_TO), value=fill)


def run(model, forward, batches, bf16: bool) -> tuple[float, float, float]:
    """Total seconds, steady-state tokens/s (steps 11..), first step's seconds."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, t0 = [], time.perf_counter()
    for src, tgt_in, labels, n in batches:
        a = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = lm_loss(forward(tgt_in, src).logits, labels)[0]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append((time.perf_counter() - a, n))
    rest = times[10:]
    return time.perf_counter() - t0, sum(n for _, n in rest) / sum(s for s, _ in rest), times[0][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--pairs", type=int, default=8000)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args()
    if args.steps < 12:
        raise SystemExit("--steps must be at least 12 (10 warm-up steps, then the steady state)")
    torch.set_num_threads(args.threads)
    bf16 = args.precision == "bf16"
    tok, src, tgt = multi30k_ids(8000, args.pairs)
    plan = TokenBucketBatcher(translation_lengths(src, tgt), 4096, seed=0).batches_for_epoch(0)[: args.steps]
    if len(plan) < args.steps:
        raise SystemExit(f"--pairs {args.pairs} make only {len(plan)} batches; raise --pairs for {args.steps} steps")
    batches = []
    for idx in plan:
        b = make_translation_batch([src[i] for i in idx], [tgt[i] for i in idx], pad_id=tok.pad_id,
                                   sos_id=tok.sos_id, eos_id=tok.eos_id)  # fmt: skip
        batches.append((rounded(b.src, tok.pad_id), rounded(b.tgt_in, tok.pad_id), rounded(b.labels, -100),
                        b.num_tokens))  # fmt: skip
    shapes = len({(s.shape, t.shape) for s, t, _, _ in batches})
    cfg = ModelConfig(
        vocab_size=tok.vocab_size, arch="encoder_decoder", dim=256, n_layers=3, n_heads=4, ffn_dim=1024,
        dropout=0.1, pad_id=tok.pad_id, max_seq_len=256, positions="rotary", norm="rmsnorm", activation="swiglu",
    )  # fmt: skip
    results = {}
    for name in ("eager", "compiled"):
        torch.manual_seed(0)
        model = Transformer(cfg).train()
        results[name] = run(model, torch.compile(model) if name == "compiled" else model, batches, bf16)
    print(f"CPU: {cpu_name()}; {args.threads} threads; {args.precision}; {args.steps} steps, {shapes} batch shapes\n")
    print("| step | total (compile included) | first step | steady target tok/s | ratio |")
    print("|---|---:|---:|---:|---:|")
    for name, (total, rate, first) in results.items():
        print(f"| {name} | {total:.1f} s | {first:.1f} s | {rate:,.0f} | {rate / results['eager'][1]:.2f}x |")


if __name__ == "__main__":
    main()
