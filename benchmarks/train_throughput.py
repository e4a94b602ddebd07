"""Training throughput: attnmask's Transformer vs Hugging Face MarianMTModel, same function, same batches.

Both models are built from one ``MarianConfig`` (random init, nothing downloaded); attnmask's copy
is made with :func:`attnmask.pretrained.hf.transformer_from_hf_model`, so they hold the same weights and compute the
same function (checked: equal losses on the first batch). Each then trains with its own AdamW on
the same Multi30k de->en batches (joint BPE, token-bucketed as ``attnmask train`` does; fused AdamW,
as ``attnmask train`` runs it and Hugging Face's Trainer defaults to), in
alternating rounds so machine noise hits both alike. Throughput counts non-pad target tokens
(the loss's tokens) per second of forward + backward + optimizer step, in fp32 or under bf16
autocast (``--precision``; Hugging Face gets the same autocast).

A third row times the whole ``attnmask train`` loop (its own data pipeline, logging and
checkpointing at the default intervals; evaluation off) on the same files and dimensions, from
the step times its ``on_step`` hook sees after two warm-up steps.

    python benchmarks/train_throughput.py [--rounds 3] [--steps 10] [--threads 2] [--precision bf16]
                                          [--device cpu|cuda]

Both models run in one process under the same allocator policy, set here because the script owns
its process (:mod:`attnmask.allocator`: freed memory kept for reuse, as the ``attnmask train`` command
does; the library itself never sets it; ``ATTNMASK_MALLOC=default`` leaves glibc's own), named in
the header.

On CUDA every round ends with a synchronisation, so the times are the GPU's, and the header names
the GPU instead of the CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from attnmask import allocator
from attnmask.data import make_translation_batch, read_parallel, translation_lengths
from attnmask.data.samplers import TokenBucketBatcher
from attnmask.data.tokenizer import Tokenizer
from attnmask.model import head_loss
from attnmask.pretrained.hf import transformer_from_hf_model
from matmul import cpu_name  # benchmarks/, run as a script

DATA = Path(os.environ.get("ATTNMASK_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def multi30k_ids(vocab_size: int, pairs: int | None = None) -> tuple[Tokenizer, list[list[int]], list[list[int]]]:
    """A joint BPE trained on Multi30k de-en's training pairs (the first ``pairs``), and their ids."""
    m30k = DATA / "multi30k"
    if not (m30k / "train.de.gz").exists():
        raise SystemExit(f"Multi30k not found under {m30k} (set ATTNMASK_DATA)")
    found = read_parallel(m30k / "train.de.gz", m30k / "train.en.gz").pairs[:pairs]
    tok = Tokenizer.train_bpe([s for s, _ in found] + [t for _, t in found], vocab_size)
    return tok, tok.encode_batch([s for s, _ in found]), tok.encode_batch([t for _, t in found])


def marian(vocab: int, dim: int, layers: int, heads: int, ffn: int):
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=vocab, decoder_vocab_size=vocab, d_model=dim, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
        activation_function="gelu", dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        max_position_embeddings=256, pad_token_id=0, decoder_start_token_id=1, eos_token_id=2,
        scale_embedding=True, share_encoder_decoder_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return MarianMTModel(config)


def marian_step(model, b) -> torch.Tensor:
    out = model(
        input_ids=b.src, attention_mask=b.src != 0, decoder_input_ids=b.tgt_in,
        decoder_attention_mask=b.tgt_in != 0, labels=b.labels,
    )  # fmt: skip
    return out.loss


def ours_step(model, b) -> torch.Tensor:
    """The loss as ``attnmask train`` computes it: hidden states, then W_pred and the cross-entropy
    in chunks (:func:`attnmask.model.head_loss`), averaged over the real tokens."""
    hidden = model(b.tgt_in, b.src, return_hidden=True).hidden
    return head_loss(hidden, model.lm_head, b.labels) / max(b.num_tokens, 1)


def timed_round(model, step_fn, optimizer, batches, bf16: bool = False, device_type: str = "cpu") -> tuple[float, int]:
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    sync()
    tokens, t0 = 0, time.perf_counter()
    for b in batches:
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
            loss = step_fn(model, b)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += b.num_tokens
    sync()
    return time.perf_counter() - t0, tokens


def train_loop_rate(args) -> float:
    """Target tokens/s of ``attnmask train`` on Multi30k, steps 3..N as its step hook sees them."""
    import tempfile

    from attnmask.train import TrainConfig, train

    m30k = DATA / "multi30k"
    stamps: list[tuple[float, int]] = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig.of(
            src=str(m30k / "train.de.gz"), tgt=str(m30k / "train.en.gz"), valid_src=str(m30k / "val.de.gz"),
            valid_tgt=str(m30k / "val.en.gz"), vocab_size=args.vocab_size, dim=args.dim, n_layers=args.layers,
            n_heads=args.heads, ffn_dim=args.ffn, batch_tokens=args.batch_tokens, max_steps=args.steps + 2,
            eval_every=0, eval_sentences=0, eval_max_tokens=1, dropout=0.0, precision=args.precision,
            device=args.device, progress=False, out=str(Path(tmp) / "run"),
        )  # fmt: skip
        train(cfg, on_step=lambda step, model, rec: stamps.append((time.perf_counter(), rec["tokens"])),
              log=lambda msg: None)  # fmt: skip
    (t0, _), rest = stamps[1], stamps[2:]
    return sum(n for _, n in rest) / (rest[-1][0] - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10, help="training steps per model per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16 = bfloat16 autocast")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--no-loop", action="store_true", help="skip the `attnmask train` loop row")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    memory = allocator.keep_freed_memory()  # this script owns the process: both models, and the loop's row
    tok, src, tgt = multi30k_ids(args.vocab_size)
    sampler = TokenBucketBatcher(translation_lengths(src, tgt), args.batch_tokens, seed=0)
    plan = sampler.batches_for_epoch(0)[: args.steps + 2]
    batches = [
        make_translation_batch([src[i] for i in idx], [tgt[i] for i in idx], pad_id=0, sos_id=1, eos_id=2)
        for idx in plan
    ]
    device = torch.device(args.device)
    batches = [b.to(device) for b in batches]
    warm, timed = batches[:2], batches[2:]

    hf = marian(tok.vocab_size, args.dim, args.layers, args.heads, args.ffn)
    ours = transformer_from_hf_model(hf)  # same weights, same function
    hf.to(device).train()
    ours.to(device).train()
    with torch.no_grad():
        l_hf, l_ours = float(marian_step(hf, batches[0])), float(ours_step(ours, batches[0]))
    assert abs(l_hf - l_ours) < 1e-4 * abs(l_hf), f"not the same function: Marian loss {l_hf}, attnmask {l_ours}"

    runs = {"attnmask": (ours, ours_step), "HF Marian": (hf, marian_step)}
    # fused AdamW for both: what `attnmask train` runs, and Hugging Face Trainer's default (adamw_torch_fused)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for name, (m, _) in runs.items()}
    bf16 = args.precision == "bf16"
    for name, (m, fn) in runs.items():
        timed_round(m, fn, opts[name], warm, bf16, device.type)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (m, fn) in runs.items():
            seconds, tokens = timed_round(m, fn, opts[name], timed, bf16, device.type)
            rates[name].append(tokens / seconds)
    if not args.no_loop:
        rates["attnmask train loop"] = [train_loop_rate(args) for _ in range(args.rounds)]

    params = sum(p.numel() for p in ours.parameters())
    tokens_per_step = statistics.mean(b.num_tokens for b in timed)
    print(f"model: dim {args.dim}, {args.layers}+{args.layers} layers, {args.heads} heads, ffn {args.ffn}, "
          f"vocab {tok.vocab_size}, {params / 1e6:.1f}M parameters; {args.precision}, "
          f"{args.threads} threads")  # fmt: skip
    if device.type == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(device)}")
    else:
        print(f"CPU: {cpu_name()}; bf16 matrix units: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    print(f"memory: {memory}")
    print(f"batches: Multi30k de->en, {args.batch_tokens} padded tokens, {tokens_per_step:.0f} target tokens/step "
          f"on average; {args.steps} steps x {args.rounds} alternating rounds; initial losses "
          f"{l_ours:.4f} (attnmask) / {l_hf:.4f} (Marian)\n")  # fmt: skip
    print("| model | target tokens/s (median of rounds) | rounds | ratio |")
    print("|---|---:|---|---:|")
    base = statistics.median(rates["HF Marian"])
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"| {name} | {med:,.0f} | {', '.join(f'{x:,.0f}' for x in r)} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
