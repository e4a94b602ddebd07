"""``attnmask demo``: the built-in main job. No download, no data file.

Teaches a small encoder-decoder Transformer to rewrite dates written in many human formats as
ISO 8601 (``"Sunday, the 22nd of November 2026"`` → ``"2026-11-22"``, :mod:`attnmask.data.synthetic`), a
task that needs real attention over the source: the answer's digits come from words, ordinals and
reordered fields. Then it scores held-out examples (exact match, recorded in ``metrics.jsonl``),
shows a few translations, prints the masks one example was trained with, and points to the
loss-curve picture.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from attnmask.errors import UserError
from attnmask.train import rundir

DEFAULT_OUT = "runs/demo"
TEST_SIZE = 1000  # held-out pairs scored at the end
SHOW = 8  # held-out examples printed
# everyday forms always printed (the rest of EVERYDAY_DATES is scored, and printed when wrong)
EVERYDAY_SHOWN = ("1 Feb 2000", "2 Feb 2002", "1/2/2000", "Feb 2 2002", "25/12/2020", "2024-2-29", "1st January 2000")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="train a Transformer to read dates (about 4 minutes on 2 CPU cores), then show what it learned",
        description="The built-in main job: generate a dates -> ISO 8601 translation task, train a small "
        "encoder-decoder Transformer on it, score held-out examples (exact match) and 50 everyday forms, print a "
        "few translations and the attention masks of one example, and draw the loss curve. Dates written in "
        "numbers only are read day first, as in most of the world: 1/2/2000 is 1 February 2000 (2000-02-01); "
        "with the four-digit year first, year-month-day. Nothing is downloaded.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help="run directory (a previous demo run is replaced)")
    p.add_argument("--seed", type=int, default=0, help="random seed (data and model)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run (tiny model; low accuracy)")
    p.set_defaults(func=run)


def demo_config(out: str, *, seed: int = 0, device: str = "auto", quick: bool = False):
    """The demo's :class:`~attnmask.train.TrainConfig` (``quick``: a tiny end-to-end run for tests)."""
    from attnmask.train import TrainConfig

    common = dict(
        task="translation",
        out=out,
        builtin_task="dates",
        tokenizer="char",
        seed=seed,
        device=device,
        dropout=0.0,  # fresh generated data: nothing to regularise against
        label_smoothing=0.0,  # exact answers wanted: sharp distributions decode greedily best
        positions="rotary",
        norm="rmsnorm",
        activation="swiglu",
        # the recipe's margins below were established in float32 on every seed tried; `auto` would
        # take bf16 on a CPU with native bf16 and change them there
        precision="fp32",
    )
    if quick:
        return TrainConfig.of(
            **common, model="tiny", train_size=1500, valid_size=100, max_steps=40, warmup=10, lr=3e-3,
            batch_tokens=1024, eval_every=0, eval_sentences=50, log_every=5,
        )  # fmt: skip
    # Bounded by steps, never by time: the same command and seed give the same model on a busy machine.
    # 2,000 steps: >= 99% held-out and 50/50 everyday forms with either float32 library (oneDNN or
    # the BLAS), every seed tried; 700 and 1,400 fell short (docs/benchmarks.md, "2026-11-25 — Ops").
    return TrainConfig.of(
        **common, model="small", dim=128, n_layers=2, n_heads=4, ffn_dim=512, train_size=60000, valid_size=500,
        max_steps=2000, warmup=100, lr=2e-3, batch_tokens=2048, eval_every=1000, eval_sentences=500, log_every=25,
    )  # fmt: skip


def _clear_previous_demo(out: Path) -> None:
    """Remove a previous demo run in ``out`` (only the files a run writes); refuse anything else."""
    if not (out / rundir.CONFIG).exists():
        return
    config = json.loads((out / rundir.CONFIG).read_text(encoding="utf-8"))
    train = config.get("train", {})
    if train.get("data", train).get("builtin_task") != "dates":  # nested sections; flat in older runs
        raise UserError(f"{out} holds another run (not a demo); choose another --out")
    print(f"replacing the previous demo run in {out}")
    for name in (rundir.CONFIG, rundir.TOKENIZER, rundir.SRC_TOKENIZER, rundir.WEIGHTS, rundir.TRAINER_STATE,
                 rundir.METRICS, rundir.LOSS_PLOT):  # fmt: skip
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / rundir.TENSORBOARD, ignore_errors=True)


_SHORT = {" ": "␣", "<sos>": "<s>", "<eos>": "</s>", "<pad>": "pad"}  # keeps grid columns narrow


def _label(token: str) -> str:
    return _SHORT.get(token, token)


def _show_masks(loaded, src_text: str, tgt_text: str, longer_src: str) -> None:
    """Print the decoder's M_total and the cross-attention padding mask for one example, batched
    with a longer source so that padding shows."""
    from attnmask.data import make_translation_batch
    from attnmask.viz import mask_grid

    tok, stok, model = loaded.tokenizer, loaded.src_tokenizer, loaded.model
    batch = make_translation_batch(
        stok.encode_batch([src_text, longer_src]), tok.encode_batch([tgt_text, tgt_text]),
        pad_id=tok.pad_id, sos_id=tok.sos_id, eos_id=tok.eos_id,
    )  # fmt: skip
    T, S = batch.tgt_in.shape[1], batch.src.shape[1]
    q_labels = [_label(tok.id_to_token(i)) for i in batch.tgt_in[0].tolist()]
    k_labels = [_label(stok.id_to_token(i)) for i in batch.src[0].tolist()]
    self_mask = model.target_mask(batch.tgt_in).to_bool(2, T, T)[0, 0]  # (T, T)
    cross_mask = model.source_mask(batch.src).to_bool(2, T, S)[0, 0]  # (T, S)
    print(f'\nthe masks this example is decoded with:  "{src_text}" -> "{tgt_text}"\n')
    print("■ = may attend, · = blocked;  <s> = <sos>, </s> = <eos>, pad = <pad>, ␣ = space\n")
    print(mask_grid(self_mask, q_labels, style="symbols",
                    title="decoder self-attention, look-ahead & padding (seed 004's M_total):"))  # fmt: skip
    print()
    print(mask_grid(cross_mask, q_labels, k_labels, style="symbols",
                    title=f"cross-attention, target queries x source keys (padded to the batch's {S}):"))  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import torch

    from attnmask.data.synthetic import EVERYDAY_DATES, get_task
    from attnmask.train import train
    from attnmask.train.evaluate import translate_ids

    out = Path(args.out)
    _clear_previous_demo(out)
    cfg = demo_config(str(out), seed=args.seed, device=args.device, quick=args.quick)
    task = get_task("dates")
    example_src, example_tgt = task.example
    print("attnmask demo: teach a Transformer to read dates")
    print(f'  task   {task.description}\n         e.g. "{example_src}" -> "{example_tgt}"')
    print('         numbers are read day first: "1/2/2000" -> "2000-02-01" (1 February)')
    print(f"  data   {cfg.data.train_size:,} generated training pairs, {cfg.data.valid_size:,} validation, "
          f"{TEST_SIZE if not args.quick else 100:,} held-out test (sources never seen in training)")  # fmt: skip
    started = time.perf_counter()
    result = train(cfg)
    if not result.stopped.startswith(("max_steps", "time")):
        return 0  # interrupted: train() saved a checkpoint and said so
    minutes, seconds = divmod(int(time.perf_counter() - started), 60)

    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.run.device == "auto" else cfg.run.device
    loaded = rundir.load_run(out, device=device)
    n_test = 100 if args.quick else TEST_SIZE
    pairs = task.make_pairs(n_test, seed=cfg.run.seed, split="test")
    everyday = list(EVERYDAY_DATES)
    src_ids = loaded.src_tokenizer.encode_batch([s for s, _ in pairs] + [s for s, _ in everyday])
    with torch.no_grad():
        hyp_ids = translate_ids(loaded.model, src_ids, loaded.tokenizer, loaded.src_tokenizer, batch_size=250)
    hyps = loaded.tokenizer.decode_batch(hyp_ids)
    hyps, everyday_hyps = hyps[: len(pairs)], hyps[len(pairs) :]
    right = [h == t for h, (_, t) in zip(hyps, pairs)]
    exact = sum(right) / len(right)
    everyday_right = [h == t for h, (_, t) in zip(everyday_hyps, everyday)]
    scores = [("test", exact, len(pairs)), ("everyday", sum(everyday_right) / len(everyday), len(everyday))]
    with open(out / rundir.METRICS, "a", encoding="utf-8") as f:
        for split, score, n in scores:
            f.write(json.dumps({"step": result.step, "split": split, "exact_match": score, "sentences": n}) + "\n")

    print(f"\ntrained {result.step} steps in {minutes}m{seconds:02d}s; held-out test exact match: "
          f"{exact:.1%} ({sum(right)}/{len(right)})")  # fmt: skip
    print(f"everyday forms (never trained on): {sum(everyday_right)}/{len(everyday)} right\n")
    shown = list(zip(pairs[:SHOW], hyps, right))
    shown += [
        (p, h, ok) for p, h, ok in zip(everyday, everyday_hyps, everyday_right) if p[0] in EVERYDAY_SHOWN or not ok
    ]
    width = max(len(s) for (s, _), _, _ in shown) + 2
    for i, ((src, tgt), hyp, ok) in enumerate(shown):
        if i == SHOW:
            print("  everyday forms:")
        mark = "✓" if ok else "✗"
        extra = "" if ok else f"   (expected {tgt})"
        print(f"  {mark} {('“' + src + '”').ljust(width)} → {hyp}{extra}")
    # The shortest shown source (translated right, if any is), batched with a longer one: a few
    # padded key columns.
    by_length = sorted(pairs[:SHOW], key=lambda p: len(p[0]))
    correct = [p for p, ok in zip(pairs[:SHOW], right) if ok]
    shortest = min(correct, key=lambda p: len(p[0])) if correct else by_length[0]
    partner = next((p for p in by_length if len(p[0]) >= len(shortest[0]) + 3), by_length[-1])
    _show_masks(loaded, shortest[0], shortest[1], partner[0])
    print(f"\nloss curve: {out / rundir.LOSS_PLOT}\nmetrics:    {out / rundir.METRICS}  (TensorBoard: {out / 'tb'})")
    return 0
