"""fp32 against bf16 autocast on this CPU: the same run (data, model, seed, steps) in both precisions,
timed, with the validation loss of each after a fixed number of steps, over one or more seeds, and
the curves in one picture.

    python benchmarks/train_precision.py [--task dates|shakespeare|multi30k|finetune] [--steps 300]
        [--seeds 0,1] [--threads 2] [--jobs 1] [--png FILE]

``dates`` is the built-in task of ``attnmask demo`` (nothing to download); ``shakespeare`` reads
Tiny Shakespeare from ``$ATTNMASK_DATA`` (default ``../shared/data``), character level;
``multi30k`` is the Multi30k de->en encoder-decoder of ``benchmarks/train_multi30k.py`` (its recipe,
4,096 tokens a step); ``finetune`` fine-tunes SmolLM2-135M-Instruct on Multi30k's pairs as chat
conversations, as ``benchmarks/finetune.py`` does (every weight, packed rows of 256 tokens).

"Within noise" needs the noise: with several seeds (``--seeds 0,1``: the initialisation, the data
order and dropout change) the report sets the bf16 - fp32 gap of each seed beside the spread of each
precision's validation loss over the seeds. ``--jobs 2`` runs two of the runs at once, each in its
own process with ``--threads`` threads (on 2 cores: ``--threads 1 --jobs 2``); their tokens/s are then
those of a shared machine, the losses are what they would be alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from attnmask.linear import fast_bf16_products
from attnmask.train import TrainConfig, read_metrics, train
from attnmask.train.precision import matmul_speedup
from matmul import cpu_name  # benchmarks/, run as a script

DATA = Path(os.environ.get("ATTNMASK_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def settings(task: str, steps: int, data_dir: Path) -> dict:
    every = max(1, steps // 6)
    common = dict(max_steps=steps, eval_every=every, log_every=10, seed=0, device="cpu", progress=False)
    if task == "dates":
        return dict(
            builtin_task="dates", tokenizer="char", model="small", dim=128, n_layers=2, n_heads=4, ffn_dim=512,
            train_size=20000, valid_size=300, warmup=50, lr=2e-3, batch_tokens=2048, eval_sentences=100,
            dropout=0.0, label_smoothing=0.0, positions="rotary", norm="rmsnorm", activation="swiglu", **common,
        )  # fmt: skip
    if task == "multi30k":
        from train_multi30k import RECIPE

        m30k = DATA / "multi30k"
        if not (m30k / "train.de.gz").exists():
            raise SystemExit(f"Multi30k not found under {m30k} (set ATTNMASK_DATA)")
        recipe = {**RECIPE, "batch_tokens": 4096, "warmup": min(RECIPE["warmup"], steps // 3), **common}
        return dict(
            task="translation", src=str(m30k / "train.de.gz"), tgt=str(m30k / "train.en.gz"),
            valid_src=str(m30k / "val.de.gz"), valid_tgt=str(m30k / "val.en.gz"), eval_sentences=100,
            **recipe,
        )  # fmt: skip
    if task == "finetune":
        from finetune import RECIPE, multi30k, write_chat

        train_file = data_dir / "train.jsonl"
        if not train_file.exists():
            write_chat(train_file, *(part[:4000] for part in multi30k("train")))
            write_chat(data_dir / "valid.jsonl", *(part[:200] for part in multi30k("val")))
        recipe = {**RECIPE, "warmup": min(RECIPE["warmup"], max(1, steps // 5))}
        return dict(
            init="smollm2", task="chat", data=str(train_file), valid_data=str(data_dir / "valid.jsonl"),
            **recipe, **common,
        )  # fmt: skip
    text = DATA / "tinyshakespeare" / "input.txt"
    if not text.exists():
        raise SystemExit(f"Tiny Shakespeare not found at {text} (set ATTNMASK_DATA)")
    return dict(
        task="lm", text=str(text), tokenizer="char", model="tiny", dim=128, n_layers=4, n_heads=4, ffn_dim=512,
        block_size=64, batch_tokens=768, warmup=50, lr=2e-3, dropout=0.1, eval_max_tokens=20000, **common,
    )  # fmt: skip


def one_run(task: str, steps: int, precision: str, seed: int, out: Path) -> dict:
    """One training run in this process: its validation curve, rate and final evaluation."""
    cfg = TrainConfig.of(**{**settings(task, steps, out.parent / "data"), "seed": seed}, precision=precision,
                         out=str(out))  # fmt: skip
    t0 = time.perf_counter()
    result = train(cfg, log=lambda msg: None)
    seconds = time.perf_counter() - t0
    records = read_metrics(cfg.run.out)
    rates = [r["tokens_per_s"] for r in records if r["split"] == "train"]
    rates = rates[1:] or rates  # the first window is the warm-up, unless it is the only one
    return {
        "precision": precision, "seed": seed, "wall_s": seconds, "tokens_per_s": sum(rates) / max(len(rates), 1),
        "curve": [(r["step"], r["loss"]) for r in records if r["split"] == "valid"],
        "valid_loss": result.eval["loss"], "exact_match": result.eval.get("exact_match"),
    }  # fmt: skip


def run_all(args, runs: list[tuple[str, int]], tmp: Path) -> list[dict]:
    """Every (precision, seed) run, ``args.jobs`` at a time, each in a process of its own."""
    if args.jobs == 1:
        return [one_run(args.task, args.steps, p, s, tmp / f"{p}-{s}") for p, s in runs]
    (tmp / "data").mkdir(parents=True, exist_ok=True)
    settings(args.task, args.steps, tmp / "data")  # the data files once, before the processes start
    results, pending, running = [], list(runs), []
    while pending or running:
        while pending and len(running) < args.jobs:
            precision, seed = pending.pop(0)
            out = tmp / f"{precision}-{seed}"
            cmd = [sys.executable, __file__, "--task", args.task, "--steps", str(args.steps),
                   "--threads", str(args.threads), "--one", f"{precision},{seed}", "--out", str(out)]  # fmt: skip
            running.append((subprocess.Popen(cmd), out))
        time.sleep(1)
        for proc, out in list(running):
            if proc.poll() is not None:
                running.remove((proc, out))
                if proc.returncode:
                    raise SystemExit(f"run {out.name} failed (exit {proc.returncode})")
                results.append(json.loads((out / "precision_run.json").read_text()))
    return sorted(results, key=lambda r: runs.index((r["precision"], r["seed"])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=("dates", "shakespeare", "multi30k", "finetune"), default="dates")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0", help="comma-separated seeds; each runs in both precisions")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own process")
    ap.add_argument("--png", default=None, help="draw the validation curves into this file")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # PRECISION,SEED: one run (a --jobs worker)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        precision, seed = args.one.split(",")
        result = one_run(args.task, args.steps, precision, int(seed), Path(args.out))
        (Path(args.out) / "precision_run.json").write_text(json.dumps(result))
        return
    native = fast_bf16_products()
    print(f"CPU: {cpu_name()}, {args.threads} threads a run, {args.jobs} run(s) at once; native bf16: {native}; "
          f"768x768 product bf16 speed-up {matmul_speedup():.1f}x")  # fmt: skip
    seeds = [int(x) for x in args.seeds.split(",")]
    runs = [(precision, seed) for seed in seeds for precision in ("fp32", "bf16")]
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_all(args, runs, Path(tmp))
    print(f"\ntask {args.task}, {args.steps} steps; within a seed both precisions see the same batches\n")
    print("| precision | seed | train tokens/s | wall s | validation loss | exact match |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        em = f"{r['exact_match']:.1%}" if r["exact_match"] is not None else "—"
        cells = [r["precision"], r["seed"], f"{r['tokens_per_s']:,.0f}", f"{r['wall_s']:.0f}", f"{r['valid_loss']:.4f}"]
        cells.append(em)
        print("| " + " | ".join(map(str, cells)) + " |")
    loss = {(r["precision"], r["seed"]): r["valid_loss"] for r in rows}
    rate = {p: sum(r["tokens_per_s"] for r in rows if r["precision"] == p) / len(seeds) for p in ("fp32", "bf16")}
    print(f"\nbf16 / fp32 tokens/s: {rate['bf16'] / rate['fp32']:.2f}x")
    gaps = [loss["bf16", s] - loss["fp32", s] for s in seeds]
    print("bf16 - fp32 validation loss, by seed: " + ", ".join(f"{g:+.4f}" for g in gaps))
    if len(seeds) > 1:
        for p in ("fp32", "bf16"):
            values = [loss[p, s] for s in seeds]
            low, high = min(values), max(values)
            print(f"{p} over the seeds: {low:.4f} .. {high:.4f} (spread {high - low:.4f})")
    if args.png:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6, 3.5))
        ax = fig.subplots()
        for r in rows:
            ax.plot(*zip(*r["curve"]), marker="o", markersize=3, label=f"{r['precision']}, seed {r['seed']}",
                    linestyle="-" if r["precision"] == "fp32" else "--")  # fmt: skip
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats / token)")
        ax.set_title(f"{args.task}: fp32 vs bf16 autocast ({cpu_name()})", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"curves: {args.png}")


if __name__ == "__main__":
    main()
