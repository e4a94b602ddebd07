"""Multi30k de->en: train under a CPU time budget, then BLEU on test_2016_flickr.

Trains with ``attnmask.train`` (joint byte-level BPE, token-bucketed batches, evaluation on the
official validation split), loads the run with ``attnmask.load_run``, translates the 1,000
test_2016_flickr sentences greedily (and with beam search when ``attnmask.decode`` offers it), and
scores the detokenized output against the raw references with sacreBLEU's defaults (13a).

    python benchmarks/train_multi30k.py --minutes 25 [--png bleu.png]

It also prints validation BLEU (greedy, the official ``val`` split) against the training loop's wall
clock at every evaluation, and with ``--png`` draws that curve. ``--at 10,30`` also keeps the weights at
those CPU minutes of the training loop (the process's CPU time, saving excluded) and scores each the
same way once the run ends: the from-scratch curve that ``benchmarks/finetune.py bleu`` is compared
with, at equal CPU minutes::

    python benchmarks/train_multi30k.py --minutes 60 --threads 1 --eval-every 0 --at 10,30 \
        --set batch_tokens=8192 --set 'precision="bf16"'
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import sacrebleu
import torch

from attnmask.data import read_parallel
from attnmask.train import TrainConfig, distributed
from attnmask.train.loop import Trainer
from attnmask.train.rundir import load_run, read_metrics

DATA = Path(os.environ.get("ATTNMASK_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))

RECIPE = dict(
    model="small", dim=256, n_layers=3, n_heads=4, ffn_dim=1024, positions="rotary", norm="rmsnorm",
    activation="swiglu", tokenizer="bpe", vocab_size=8000, batch_tokens=4096, lr=1e-3, warmup=400,
    min_lr_ratio=0.05, dropout=0.2, label_smoothing=0.1, weight_decay=0.01, max_steps=None,
)  # fmt: skip


def translate_all(run, sentences: list[str], beam: int) -> list[str]:
    try:
        from attnmask.decode import translate
    except ImportError:
        if beam > 1:
            raise
        from attnmask.train.evaluate import translate_ids

        ids = translate_ids(run.model, run.src_tokenizer.encode_batch(sentences), run.tokenizer, run.src_tokenizer)
        return run.tokenizer.decode_batch(ids)
    return translate(run.model, run.src_tokenizer, run.tokenizer, sentences, beam=beam)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=25.0, help="wall-clock budget of the training loop")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default="runs/bench_multi30k")
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--beam", type=int, default=4, help="also score beam search of this size (1 = greedy only)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=JSON", help="override a recipe field")
    ap.add_argument("--at", default="", help="also keep and score the weights at these CPU minutes of training")
    ap.add_argument("--png", default=None, help="draw validation BLEU against training minutes into this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    m30k = DATA / "multi30k"
    if not (m30k / "train.de.gz").exists():
        raise SystemExit(f"Multi30k not found under {m30k} (set ATTNMASK_DATA)")
    recipe = dict(RECIPE)
    for item in args.set:
        key, value = item.split("=", 1)
        recipe[key] = json.loads(value)
    shutil.rmtree(args.out, ignore_errors=True)
    cfg = TrainConfig.of(
        task="translation", src=str(m30k / "train.de.gz"), tgt=str(m30k / "train.en.gz"),
        valid_src=str(m30k / "val.de.gz"), valid_tgt=str(m30k / "val.en.gz"), out=args.out,
        max_minutes=args.minutes, eval_every=args.eval_every, eval_sentences=1014, log_every=50, progress=False,
        **recipe,
    )  # fmt: skip
    marks = sorted(float(m) for m in args.at.split(",") if m)
    kept: list[tuple[float, float, int, Path]] = []  # (CPU minutes, wall minutes, step, weights)
    clock = {"cpu0": 0.0, "spent": 0.0, "wall0": 0.0}  # set when the training loop starts

    def cpu_minutes() -> float:
        return (time.process_time() - clock["cpu0"] - clock["spent"]) / 60

    def keep(step: int, model, rec) -> None:
        clock["last"] = cpu_minutes()
        if marks and clock["last"] >= marks[0]:
            t = time.process_time()
            path = Path(args.out) / f"snapshot-{marks.pop(0):g}cpumin.pt"
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path)
            kept.append((clock["last"], (time.perf_counter() - clock["wall0"]) / 60, step, path))
            print(f"kept step {step} at {kept[-1][0]:.2f} CPU min: {path}", flush=True)
            clock["spent"] += time.process_time() - t

    # the clocks start with the training loop, as in ``benchmarks/finetune.py bleu``: the tokenizer and
    # the batches are prepared before, outside the CPU minutes that the kept weights are compared at
    t0 = time.perf_counter()
    ctx = distributed.setup(cfg.run.device)
    trainer = Trainer(cfg, ctx, on_step=keep if marks else None)
    clock.update(cpu0=time.process_time(), wall0=time.perf_counter())
    result = trainer.run()
    trainer = None
    train_wall = time.perf_counter() - t0
    if result.stopped not in ("max_steps", "time budget"):
        raise SystemExit(f"interrupted ({result.stopped}); no score")

    run = load_run(args.out)
    test = read_parallel(m30k / "test_2016_flickr.de.gz", m30k / "test_2016_flickr.en.gz")
    if kept:
        # the kept weights, then the end of the run, greedy: the curve at equal CPU minutes
        final = {k: v.clone() for k, v in run.model.state_dict().items()}
        points = []
        for cpu, wall, step, path in kept:
            run.model.load_state_dict(torch.load(path, weights_only=True))
            hyps = translate_all(run, test.sources, 1)
            points.append((cpu, wall, step, sacrebleu.BLEU().corpus_score(hyps, [test.targets]).score,
                           sacrebleu.corpus_chrf(hyps, [test.targets]).score))  # fmt: skip
        run.model.load_state_dict(final)
    rows = []
    for beam in sorted({1, args.beam}):
        t1 = time.perf_counter()
        hyps = translate_all(run, test.sources, beam)
        seconds = time.perf_counter() - t1
        bleu_metric = sacrebleu.BLEU()
        bleu = bleu_metric.corpus_score(hyps, [test.targets])
        chrf = sacrebleu.corpus_chrf(hyps, [test.targets])
        rows.append((beam, bleu, chrf, seconds))
    print(f"\nrecipe: {json.dumps(recipe)}; threads {args.threads}; budget {args.minutes} min")
    print(f"trained {result.step} steps in {result.elapsed_s / 60:.1f} min of training loop "
          f"({train_wall / 60:.1f} min with data preparation and the final evaluation); "
          f"validation loss {result.eval.get('loss', float('nan')):.3f}, "
          f"BLEU {result.eval.get('bleu', 0):.2f}")  # fmt: skip
    print("| decoding | BLEU (test_2016_flickr) | chrF | translate time |")
    print("|---|---:|---:|---:|")
    for beam, bleu, chrf, seconds in rows:
        name = "greedy" if beam == 1 else f"beam {beam}"
        print(f"| {name} | {bleu.score:.2f} | {chrf.score:.2f} | {seconds:.0f} s |")
    print(f"sacreBLEU signature: {bleu_metric.get_signature()}")  # the metric of the last decoding
    if kept:
        print("\n| training CPU minutes | wall minutes | step | BLEU (test_2016_flickr, greedy) | chrF |")
        print("|---:|---:|---:|---:|---:|")
        for cpu, wall, step, bleu, chrf in points:
            print(f"| {cpu:.1f} | {wall:.1f} | {step} | {bleu:.2f} | {chrf:.2f} |")
        print(f"| {clock.get('last', 0.0):.1f} (end) | {result.elapsed_s / 60:.1f} | {result.step} | "
              f"{rows[0][1].score:.2f} | {rows[0][2].score:.2f} |")  # fmt: skip
    curve = [(r["elapsed_s"] / 60, r["step"], r["bleu"]) for r in read_metrics(args.out)
             if r["split"] == "valid" and "elapsed_s" in r and "bleu" in r]  # fmt: skip
    print("\n| training minutes | step | validation BLEU (greedy) |")
    print("|---:|---:|---:|")
    for minutes, step, bleu in curve:
        print(f"| {minutes:.1f} | {step} | {bleu:.2f} |")
    if args.png and curve:
        draw_curve(curve, rows, args.png)


def draw_curve(curve: list[tuple[float, int, float]], rows, path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    ax.plot([m for m, _, _ in curve], [b for _, _, b in curve], marker="o", label="validation (greedy)")
    for beam, bleu, _, _ in rows:
        name = "test_2016_flickr, greedy" if beam == 1 else f"test_2016_flickr, beam {beam}"
        ax.scatter([curve[-1][0]], [bleu.score], marker="*" if beam > 1 else "s", s=80, label=name, zorder=3)
    ax.set_xlabel("training minutes (wall clock, evaluations included)")
    ax.set_ylabel("BLEU (sacreBLEU)")
    ax.set_title("Multi30k de→en on the CPU")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"curve: {path}")


if __name__ == "__main__":
    main()
