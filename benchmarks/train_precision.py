"""fp32 against bf16 autocast on this CPU: the same run (data, model, seed, steps) twice, timed, with
the validation loss of both after a fixed number of steps, and both curves in one picture.

    python benchmarks/train_precision.py [--task dates|shakespeare] [--steps 300] [--threads 2] [--png FILE]

``dates`` is the built-in task of ``attnmask demo`` (nothing to download); ``shakespeare`` reads
Tiny Shakespeare from ``$ATTNMASK_DATA`` (default ``../shared/data``), character level.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from attnmask.train import TrainConfig, read_metrics, train
from attnmask.train.precision import matmul_speedup
from matmul import cpu_name  # benchmarks/, run as a script

DATA = Path(os.environ.get("ATTNMASK_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def settings(task: str, steps: int) -> dict:
    every = max(1, steps // 6)
    common = dict(max_steps=steps, eval_every=every, log_every=10, seed=0, device="cpu", progress=False)
    if task == "dates":
        return dict(
            builtin_task="dates", tokenizer="char", model="small", dim=128, n_layers=2, n_heads=4, ffn_dim=512,
            train_size=20000, valid_size=300, warmup=50, lr=2e-3, batch_tokens=2048, eval_sentences=100,
            dropout=0.0, label_smoothing=0.0, positions="rotary", norm="rmsnorm", activation="swiglu", **common,
        )  # fmt: skip
    text = DATA / "tinyshakespeare" / "input.txt"
    if not text.exists():
        raise SystemExit(f"Tiny Shakespeare not found at {text} (set ATTNMASK_DATA)")
    return dict(
        task="lm", text=str(text), tokenizer="char", model="tiny", dim=128, n_layers=4, n_heads=4, ffn_dim=512,
        block_size=64, batch_tokens=768, warmup=50, lr=2e-3, dropout=0.1, eval_max_tokens=20000, **common,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=("dates", "shakespeare"), default="dates")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--png", default=None, help="draw both validation curves into this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_name()}, {args.threads} threads; native bf16: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}; "
          f"768x768 product bf16 speed-up {matmul_speedup():.1f}x")  # fmt: skip
    curves, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for precision in ("fp32", "bf16"):
            cfg = TrainConfig.of(**settings(args.task, args.steps), precision=precision, out=f"{tmp}/{precision}")
            t0 = time.perf_counter()
            result = train(cfg, log=lambda msg: None)
            seconds = time.perf_counter() - t0
            records = read_metrics(cfg.run.out)
            valid = [(r["step"], r["loss"]) for r in records if r["split"] == "valid"]
            rates = [r["tokens_per_s"] for r in records if r["split"] == "train"][1:]  # first window: warm-up
            curves[precision] = valid
            rows.append((precision, sum(rates) / max(len(rates), 1), seconds, result.eval))
    print(f"\ntask {args.task}, {args.steps} steps, same seed and batches\n")
    print("| precision | train tokens/s | wall s | validation loss | exact match |")
    print("|---|---:|---:|---:|---:|")
    for precision, rate, seconds, ev in rows:
        em = f"{ev['exact_match']:.1%}" if "exact_match" in ev else "—"
        print(f"| {precision} | {rate:,.0f} | {seconds:.0f} | {ev['loss']:.4f} | {em} |")
    print(f"\nbf16 / fp32 tokens/s: {rows[1][1] / rows[0][1]:.2f}x")
    if args.png:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6, 3.5))
        ax = fig.subplots()
        for precision, points in curves.items():
            ax.plot(*zip(*points), marker="o", markersize=3, label=precision)
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats / token)")
        ax.set_title(f"{args.task}: fp32 vs bf16 autocast ({cpu_name()})", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"curves: {args.png}")


if __name__ == "__main__":
    main()
