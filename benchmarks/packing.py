"""Packed against padded translation batches: padding computed and training speed, on one device.

The same model (attnmask's Transformer, same initial weights) trains on Multi30k de->en batches
built two ways from one joint BPE vocabulary and one token budget:

- ``pad``: length-bucketed padded batches (``TokenBucketBatcher``, what ``--batching pad`` uses);
- ``pack``: several pairs per row kept apart by ``document`` masks (``PackingBatcher``,
  ``--batching pack``), rows of ``--pack-length`` tokens per side.

It prints the padding share of each whole epoch plan, and the target tokens per second of forward
+ backward + AdamW over the first ``--steps`` batches of each plan, in alternating rounds so machine
noise hits both alike. This is the measurement behind ``--batching auto``.

    python benchmarks/packing.py [--device cpu|cuda] [--precision fp32|bf16] [--steps 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attnmask.data import (
    PackingBatcher,
    TokenBucketBatcher,
    make_packed_translation_batch,
    make_translation_batch,
    translation_lengths,
)
from attnmask.model import ModelConfig, Transformer, head_loss
from train_throughput import cpu_name, multi30k_ids


def step(model, b, packed: bool, device, bf16: bool) -> None:
    kwargs = {"segments": b.segments, "src_segments": b.src_segments} if packed else {}
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        hidden = model(b.tgt_in, b.src, return_hidden=True, **kwargs).hidden
        loss = head_loss(hidden, model.lm_head, b.labels) / max(b.num_tokens, 1)  # as `attnmask train` does
    loss.backward()


def timed_round(model, optimizer, batches, packed: bool, device, bf16: bool) -> tuple[float, int]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    tokens, t0 = 0, time.perf_counter()
    for b, n in batches:
        step(model, b, packed, device, bf16)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += n
    sync()
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--pack-length", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device, bf16 = torch.device(args.device), args.precision == "bf16"
    tok, src, tgt = multi30k_ids(args.vocab_size)
    lengths = translation_lengths(src, tgt)
    ids = {"pad_id": tok.pad_id, "sos_id": tok.sos_id, "eos_id": tok.eos_id}
    samplers = {
        "pad": TokenBucketBatcher(lengths, args.batch_tokens, seed=0),
        "pack": PackingBatcher(lengths, args.batch_tokens, row_tokens=args.pack_length, seed=0),
    }
    batches = {}
    for name, sampler in samplers.items():
        plan = sampler.batches_for_epoch(0)[: args.steps + 2]
        if name == "pad":
            made = [make_translation_batch([src[i] for i in b], [tgt[i] for i in b], **ids) for b in plan]
        else:
            made = [make_packed_translation_batch(b, src, tgt, **ids) for b in plan]
        batches[name] = [(b.to(device), b.num_tokens) for b in made]

    cfg = ModelConfig(
        vocab_size=tok.vocab_size, arch="encoder_decoder", dim=args.dim, n_layers=args.layers,
        n_heads=args.heads, ffn_dim=args.ffn, dropout=0.0, pad_id=tok.pad_id, max_seq_len=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for name in samplers:  # warm-up: two batches each
        timed_round(model, optimizer, batches[name][:2], name == "pack", device, bf16)
    rates: dict[str, list[float]] = {name: [] for name in samplers}
    for _ in range(args.rounds):
        for name in samplers:
            seconds, tokens = timed_round(model, optimizer, batches[name][2:], name == "pack", device, bf16)
            rates[name].append(tokens / seconds)

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU: {cpu_name()}"
    print(f"{where}; {args.threads} threads; {args.precision}")
    print(f"model: dim {args.dim}, {args.layers}+{args.layers} layers, {args.heads} heads, ffn {args.ffn}, "
          f"vocab {tok.vocab_size}; Multi30k de->en, {args.batch_tokens} tokens per batch, packed rows of "
          f"{args.pack_length}; {args.steps} steps x {args.rounds} alternating rounds\n")  # fmt: skip
    print("| batches | padding (epoch plan) | batches/epoch | target tokens/s (median) | rounds | ratio |")
    print("|---|---:|---:|---:|---|---:|")
    base = statistics.median(rates["pad"])
    for name, sampler in samplers.items():
        med = statistics.median(rates[name])
        print(f"| {name} | {sampler.padding_fraction():.1%} | {len(sampler)} | {med:,.0f} | "
              f"{', '.join(f'{x:,.0f}' for x in rates[name])} | {med / base:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
