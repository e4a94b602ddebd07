"""attnmask.train, attnmask.train.rundir and `attnmask train`: teacher forcing, checkpoints, resume, bad data."""

from __future__ import annotations

import ctypes
import gzip
import io
import json
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from attnmask import allocator, linear
from attnmask.cli import main
from attnmask.train import TrainConfig, checkpoint, learning_rate, param_groups, resume_config, train
from attnmask.train.logger import TrainLogger
from attnmask.train.rundir import load_run, read_metrics
from attnmask.train.tasks import build_task

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(out: Path, **overrides) -> TrainConfig:
    """A seconds-long run on the built-in dates task; dropout on, so resuming must restore the RNG."""
    settings = dict(
        out=str(out), builtin_task="dates", train_size=200, valid_size=16, tokenizer="char", model="tiny",
        dim=32, n_layers=1, n_heads=2, ffn_dim=64, batch_tokens=384, max_steps=10, warmup=2, lr=3e-3,
        eval_every=0, eval_sentences=8, log_every=1, dropout=0.1, deterministic=True, progress=False,
        precision="fp32",  # the tests' comparisons are float32's; auto would take bf16 on a CPU that has it
    )  # fmt: skip
    settings.update(overrides)
    return TrainConfig.of(**settings)


def quiet(msg: str) -> None:
    pass


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if r["split"] == "train"]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# --- teacher forcing ---------------------------------------------------------------------------


def test_training_batches_shift_the_target_by_one(tmp_path):
    src = write_lines(tmp_path / "src.txt", ["xy"] * 30)
    tgt = write_lines(tmp_path / "tgt.txt", ["ab"] * 30)
    corpus = build_task(tiny(tmp_path / "run", src=str(src), tgt=str(tgt), builtin_task=None))
    tok = corpus.tokenizer
    a, b = tok.encode("a") + tok.encode("b")
    batch = corpus.batch([0, 1])
    assert batch.tgt_in.tolist() == [[tok.sos_id, a, b]] * 2  # decoder input = <sos> + target
    assert batch.labels.tolist() == [[a, b, tok.eos_id]] * 2  # labels = target + <eos>
    x, y = corpus.src_tokenizer.encode("x") + corpus.src_tokenizer.encode("y")
    assert batch.src.tolist() == [[x, y, tok.eos_id]] * 2


def test_a_tiny_model_overfits_a_tiny_dataset_and_decodes_it_back(tmp_path):
    """Low loss alone could hide an off-by-one shift; greedy decoding reproducing every target
    exactly shows training and decoding agree on it."""
    pairs = [("one two", "1 2"), ("three", "3"), ("two one three", "2 1 3"), ("three three", "3 3")]
    src = write_lines(tmp_path / "src.txt", [s for s, _ in pairs])
    tgt = write_lines(tmp_path / "tgt.txt", [t for _, t in pairs])
    cfg = tiny(tmp_path / "run", builtin_task=None, src=str(src), tgt=str(tgt), valid_src=str(src),
               valid_tgt=str(tgt), dropout=0.0, label_smoothing=0.0, max_steps=150, warmup=10,
               lr=1e-2, log_every=10, dim=48, n_heads=4)  # fmt: skip
    result = train(cfg, log=quiet)
    assert result.losses[-1] < 0.05
    assert result.eval["exact_match"] == 1.0  # decoded by attnmask.decode when present

    # the saved run, loaded back, translates every pair (targets of different lengths, one batch)
    from attnmask.train.evaluate import translate_ids

    loaded = load_run(tmp_path / "run")
    ids = loaded.src_tokenizer.encode_batch([s for s, _ in pairs])
    hyps = translate_ids(loaded.model, ids, loaded.tokenizer, loaded.src_tokenizer)
    assert loaded.tokenizer.decode_batch(hyps) == [t for _, t in pairs]


# --- resume and checkpoints --------------------------------------------------------------------


class Crash(Exception):
    pass


def crash_at(step_to_crash: int):
    def hook(step, model, record):
        if step == step_to_crash:
            raise Crash(f"simulated crash after step {step}")

    return hook


def test_resuming_after_a_crash_equals_the_uninterrupted_run(tmp_path):
    ref = train(tiny(tmp_path / "ref"), log=quiet)
    cfg = tiny(tmp_path / "run", save_every=3)
    with pytest.raises(Crash):
        train(cfg, on_step=crash_at(8), log=quiet)  # checkpoints at steps 3 and 6, dies in step 8
    resumed = train(resume_config(cfg.run.out), log=quiet)
    assert resumed.step == 10
    # steps 7..10 again, bit for bit (float32, deterministic); the epoch boundary is crossed too
    assert_close(torch.tensor(resumed.losses), torch.tensor(ref.losses[6:]), rtol=0, atol=0)
    assert_close(torch.tensor(train_losses(tmp_path / "run")), torch.tensor(train_losses(tmp_path / "ref")),
                 rtol=0, atol=0)  # fmt: skip
    a, b = load_run(tmp_path / "ref").model.state_dict(), load_run(tmp_path / "run").model.state_dict()
    for name in a:
        assert_close(b[name], a[name], rtol=0, atol=0)


def test_resuming_a_run_that_died_before_its_first_checkpoint_starts_it_over(tmp_path):
    cfg = tiny(tmp_path / "run", max_steps=4, save_every=100)
    with pytest.raises(Crash):
        train(cfg, on_step=crash_at(2), log=quiet)
    assert not (tmp_path / "run" / "trainer_state.pt").exists()
    result = train(resume_config(cfg.run.out), log=quiet)
    assert result.step == 4 and len(result.losses) == 4
    assert [r["step"] for r in read_metrics(tmp_path / "run") if r["split"] == "train"] == [1, 2, 3, 4]


def test_resume_refuses_changed_settings_and_a_finished_run_stays_finished(tmp_path):
    cfg = tiny(tmp_path / "run", max_steps=3)
    train(cfg, log=quiet)
    with pytest.raises(ValueError, match=r"resume settings differ .* lr: saved 0.003, now 0.1"):
        train(cfg.replace(lr=0.1, resume=True), log=quiet)
    again = train(resume_config(cfg.run.out), log=quiet)
    assert again.step == 3 and again.losses == []
    with pytest.raises(ValueError, match="already holds a run; pass --resume"):
        train(cfg, log=quiet)


def _cut_short(real_write):
    """A writer that writes half of the file, then fails as a full disk would."""

    def write(tmp: Path) -> None:
        real_write(tmp)
        data = tmp.read_bytes()
        tmp.write_bytes(data[: len(data) // 2])
        raise OSError(28, "No space left on device (simulated)")

    return write


@pytest.mark.parametrize("failing", ["trainer_state", "weights"])
def test_a_crash_while_writing_a_checkpoint_leaves_the_previous_one_loadable(tmp_path, monkeypatch, failing):
    cfg = tiny(tmp_path / "run", max_steps=6, save_every=3)
    real_atomic_write = checkpoint.atomic_write

    def broken_atomic_write(path, write):
        if Path(path).name == ("trainer_state.pt" if failing == "trainer_state" else "model.safetensors"):
            write = _cut_short(write)
        return real_atomic_write(path, write)

    def break_after_first_save(step, model, record):
        if step == 4:
            monkeypatch.setattr(checkpoint, "atomic_write", broken_atomic_write)

    with pytest.raises(OSError, match="simulated"):
        train(cfg, on_step=break_after_first_save, log=quiet)
    monkeypatch.setattr(checkpoint, "atomic_write", real_atomic_write)
    run_dir = tmp_path / "run"
    assert not list(run_dir.glob(".*.tmp-*")), "the half-written temporary file was not removed"
    state = checkpoint.load_torch(run_dir / "trainer_state.pt")
    weights = load_run(run_dir)  # the weights file is complete: the old one or the new one
    if failing == "trainer_state":
        assert state["step"] == 3 and weights.step == 3
    else:  # trainer_state.pt (written first) is new; the weights stayed at the previous save
        assert state["step"] == 6 and weights.step == 3
    resumed = train(resume_config(cfg.run.out), log=quiet)
    assert resumed.step == 6


def test_load_run_names_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match=r"nope: not a run directory \(no such directory\)"):
        load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty: not a run directory \(missing config.json\)"):
        load_run(tmp_path / "empty")
    train(tiny(tmp_path / "run", max_steps=2), log=quiet)
    loaded = load_run(tmp_path / "run")
    assert loaded.task == "translation" and loaded.step == 2 and not loaded.model.training
    assert loaded.src_tokenizer is loaded.tokenizer  # joint vocabulary
    (tmp_path / "run" / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"run: run directory is missing tokenizer.json"):
        load_run(tmp_path / "run")
    (tmp_path / "run" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"run directory is missing model.safetensors"):
        load_run(tmp_path / "run")


def test_metrics_and_tensorboard_are_written(tmp_path):
    result = train(tiny(tmp_path / "run", max_steps=4, eval_every=2, log_every=2), log=quiet)
    records = read_metrics(tmp_path / "run")
    assert [(r["step"], r["split"]) for r in records] == [(2, "train"), (2, "valid"), (4, "train"), (4, "valid")]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "padding_fraction"} <= records[0].keys()
    assert {"loss", "bleu", "chrf", "exact_match"} <= records[1].keys()
    assert records[-1]["loss"] == result.eval["loss"]
    assert list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "run" / "loss.png").stat().st_size > 0


@pytest.mark.filterwarnings("ignore:this CPU has no native bfloat16")
def test_bf16_autocast_trains(tmp_path):
    result = train(tiny(tmp_path / "run", max_steps=3, precision="bf16", eval_sentences=2), log=quiet)
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert load_run(tmp_path / "run").model.embed.weight.dtype == torch.float32  # weights stay fp32


# --- optimisation details ----------------------------------------------------------------------


def test_the_optimizer_is_fused_adamw_on_the_cpu(tmp_path):
    train(tiny(tmp_path / "run", max_steps=2, save_every=2), log=quiet)
    groups = checkpoint.load_torch(tmp_path / "run" / "trainer_state.pt")["optimizer"]["param_groups"]
    assert groups and all(g["fused"] is True for g in groups)


# --- the process belongs to its owner -----------------------------------------------------------


def test_training_through_the_library_leaves_the_allocator_alone(tmp_path, monkeypatch):
    def keep_freed_memory():
        raise AssertionError("library training changed the process's allocator (mallopt)")

    real_cdll = ctypes.CDLL

    def cdll(name, *args, **kwargs):  # native kernels may load; the C library itself must not be opened
        if name is None or "libc." in str(name):
            raise AssertionError(f"library training opened the C library ({name!r}): mallopt")
        return real_cdll(name, *args, **kwargs)

    monkeypatch.setattr(allocator, "keep_freed_memory", keep_freed_memory)
    monkeypatch.setattr(ctypes, "CDLL", cdll)
    lines: list[str] = []
    train(tiny(tmp_path / "run", max_steps=2), log=lines.append)
    assert f"memory: {allocator.current_policy()}" in lines  # what the process runs under, only said


def test_a_run_records_its_matmul_engine_and_a_resume_keeps_it(tmp_path, monkeypatch):
    # the same sums in the same order after a resume, whatever the resuming process would choose
    monkeypatch.setattr(linear, "_engine", None)
    monkeypatch.setattr(linear, "_reason", "")
    monkeypatch.setenv("ATTNMASK_MATMUL", "blas")
    cfg = tiny(tmp_path / "run", max_steps=2, save_every=2)
    lines: list[str] = []
    train(cfg, log=lines.append)
    assert "float32 products: the BLAS (as requested)" in lines
    assert checkpoint.load_torch(tmp_path / "run" / "trainer_state.pt")["matmul_engine"] == "blas"
    monkeypatch.setattr(linear, "_engine", "onednn")  # this process would choose otherwise
    lines.clear()
    assert train(resume_config(cfg.run.out).replace(max_steps=3), log=lines.append).step == 3
    assert "float32 products: the BLAS (as the run began)" in lines
    assert linear.engine() == "blas"


@pytest.mark.filterwarnings("ignore:this CPU has no native bfloat16")
def test_auto_precision_is_recorded_and_a_resume_keeps_it(tmp_path, monkeypatch):
    # --precision auto decides from the machine; a run resumed elsewhere must not switch mid-run
    monkeypatch.setattr(linear, "fast_bf16_products", lambda: True)  # a CPU with native bfloat16
    cfg = tiny(tmp_path / "run", max_steps=2, save_every=2, precision="auto", eval_sentences=2)
    lines: list[str] = []
    train(cfg, log=lines.append)
    assert any(line.startswith("precision: bf16 (auto: this CPU has native bfloat16") for line in lines)
    assert checkpoint.load_torch(tmp_path / "run" / "trainer_state.pt")["precision"] == "bf16"
    monkeypatch.setattr(linear, "fast_bf16_products", lambda: False)  # resumed where auto would take fp32
    lines.clear()
    assert train(resume_config(cfg.run.out).replace(max_steps=3), log=lines.append).step == 3
    assert "precision: bf16 (auto: as the run began (this machine would take fp32))" in lines
    assert checkpoint.load_torch(tmp_path / "run" / "trainer_state.pt")["precision"] == "bf16"


def test_the_progress_bar_stays_off_a_redirected_stderr(tmp_path, capsys, monkeypatch):
    def run(out: Path) -> None:
        logger = TrainLogger(out, is_main=True)
        logger.open(step=0, total=40, resume=False, progress=True)
        logger.line("step 20: loss 1.000")
        for i in range(40):
            logger.advance({"loss": f"{i:.3f}"})
        logger.close()

    run(tmp_path / "redirected")  # capsys: stderr is not a terminal
    out, err = capsys.readouterr()
    assert "\r" not in err + out
    assert out == "step 20: loss 1.000\n"  # the log lines stay, as plain lines

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    run(tmp_path / "terminal")
    assert terminal.getvalue().count("\r") >= 2 and "40/40" in terminal.getvalue()  # a terminal gets the bar


def test_no_weight_decay_on_norms_biases_and_embeddings():
    from attnmask.model import ModelConfig, Transformer

    model = Transformer(ModelConfig(vocab_size=11, arch="encoder_decoder", dim=16, n_layers=1, n_heads=2,
                                    positions="learned", tie_embeddings=False))  # fmt: skip
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert "layers.0.self_attn.q_proj.weight" in decayed and "lm_head.weight" in decayed
    assert not {n for n in decayed if "norm" in n or n.endswith("bias") or "embed" in n}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_learning_rate_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig.of(lr=1.0, warmup=4, max_steps=14, min_lr_ratio=0.1)
    assert [learning_rate(cfg, s, 0.0) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert learning_rate(cfg, 4, 0.0) == pytest.approx(1.0)
    assert learning_rate(cfg, 9, 0.0) == pytest.approx(0.55)  # half way: the cosine's midpoint
    assert learning_rate(cfg, 14, 0.0) == pytest.approx(0.1)
    timed = TrainConfig.of(lr=1.0, warmup=0, max_steps=None, max_minutes=1.0, min_lr_ratio=0.0)
    assert learning_rate(timed, 5, 30.0) == pytest.approx(0.5)  # half the time budget
    assert learning_rate(timed, 5, 60.0) == pytest.approx(0.0)


# --- the command line --------------------------------------------------------------------------


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["train", *map(str, argv), "--no-progress"])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_trains_a_character_language_model(tmp_path, capsys):
    text = write_lines(tmp_path / "text.txt", ["to be or not to be, that is the question"] * 20)
    rc, out, err = run_cli(capsys, "--task", "lm", "--text", text, "--tokenizer", "char", "--model", "tiny",
                           "--block-size", 16, "--batch-tokens", 64, "--max-steps", 3,
                           "--out", tmp_path / "lm")  # fmt: skip
    assert rc == 0, err
    assert "done: 3 steps" in out
    loaded = load_run(tmp_path / "lm")
    assert loaded.task == "lm" and loaded.src_tokenizer is None and loaded.model.config.arch == "decoder"
    last = read_metrics(tmp_path / "lm")[-1]
    assert last["split"] == "valid" and last["ppl"] > 1


def test_cli_trains_a_bpe_translator_with_separate_vocabularies(tmp_path, capsys):
    src = write_lines(tmp_path / "de.txt", [f"ein haus nummer {i}" for i in range(40)])
    tgt = write_lines(tmp_path / "en.txt", [f"a house number {i}" for i in range(40)])
    rc, out, err = run_cli(capsys, "--src", src, "--tgt", tgt, "--tokenizer", "bpe", "--vocab-size", 300,
                           "--separate-vocab", "--model", "tiny", "--max-steps", 2, "--batch-tokens", 256,
                           "--eval-sentences", 4, "--out", tmp_path / "mt")  # fmt: skip
    assert rc == 0, err
    assert "held out the last 2 training pairs" in out
    loaded = load_run(tmp_path / "mt")
    assert loaded.src_tokenizer is not loaded.tokenizer
    assert json.loads((tmp_path / "mt" / "config.json").read_text())["tokenizers"]["src"] == "src_tokenizer.json"


def test_cli_resume_accepts_the_same_command_and_refuses_changed_settings(tmp_path, capsys):
    text = write_lines(tmp_path / "text.txt", ["to be or not to be, that is the question"] * 20)
    flags = ["--task", "lm", "--text", text, "--tokenizer", "char", "--model", "tiny", "--block-size", 16,
             "--batch-tokens", 64, "--lr", 0.003, "--out", tmp_path / "lm"]  # fmt: skip
    rc, _, err = run_cli(capsys, *flags, "--max-steps", 2)
    assert rc == 0, err
    rc, out, err = run_cli(capsys, *flags, "--max-steps", 4, "--resume")  # the same command, --resume added
    assert rc == 0, err
    assert "done: 4 steps" in out
    rc, _, err = run_cli(capsys, *flags[:-4], "--lr", 0.1, "--out", tmp_path / "lm", "--resume")
    assert rc == 2
    assert err.strip() == ("attnmask train: error: --lr (saved 0.003, given 0.1) cannot change on --resume "
                           "(the run keeps its saved settings); drop them")  # fmt: skip
    rc, _, err = run_cli(capsys, "--resume", "--out", tmp_path / "absent")
    assert rc == 2 and err.count("\n") == 1 and "not a run directory" in err


def _bad_utf8(tmp_path: Path) -> tuple[Path, Path]:
    src = tmp_path / "src.txt"
    src.write_bytes(b"good line\n\xff\xfe broken\n")
    return src, write_lines(tmp_path / "tgt.txt", ["a", "b"])


def _misaligned(tmp_path: Path) -> tuple[Path, Path]:
    return write_lines(tmp_path / "src.txt", ["a", "b", "c"]), write_lines(tmp_path / "tgt.txt", ["x", "y"])


def _empty(tmp_path: Path) -> tuple[Path, Path]:
    return write_lines(tmp_path / "src.txt", ["", ""]), write_lines(tmp_path / "tgt.txt", ["", ""])


def _missing(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "absent.txt", write_lines(tmp_path / "tgt.txt", ["x"])


def _bad_gzip(tmp_path: Path) -> tuple[Path, Path]:
    src = tmp_path / "src.txt.gz"
    src.write_bytes(gzip.compress(b"a\nb\n")[:-12])  # truncated stream
    return src, write_lines(tmp_path / "tgt.txt", ["x", "y"])


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_misaligned, r"parallel files differ in length: \S*src.txt has 3 lines but \S*tgt.txt has 2"),
        (_bad_utf8, r"\S*src.txt: invalid UTF-8 at line 2, byte offset 10 \(byte 0xff\); expected UTF-8 text"),
        (_empty, r"\S*src.txt and \S*tgt.txt: no pair with text on both sides \(2 line pairs\)"),
        (_missing, r"No such file or directory: '\S*absent.txt'"),
        (_bad_gzip, r"\S*src.txt.gz: not a valid gzip file"),
    ],
)
def test_cli_reports_bad_parallel_data_in_one_line(tmp_path, capsys, make, message):
    src, tgt = make(tmp_path)
    rc, _, err = run_cli(capsys, "--src", src, "--tgt", tgt, "--out", tmp_path / "run", "--model", "tiny")
    assert rc == 2
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("attnmask train: error: ")
    assert __import__("re").search(message, err), err
    assert not (tmp_path / "run").exists()  # a failed start leaves no empty run directory behind


def test_cli_reports_an_empty_text_file(tmp_path, capsys):
    text = write_lines(tmp_path / "empty.txt", ["", "   "])
    rc, _, err = run_cli(capsys, "--task", "lm", "--text", text, "--out", tmp_path / "run")
    assert rc == 2
    assert "empty.txt: no text found; expected a non-empty UTF-8 file" in err
    assert not (tmp_path / "run").exists()


def test_a_failed_start_keeps_a_directory_the_user_made(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    rc, _, _ = run_cli(capsys, "--task", "lm", "--text", tmp_path / "absent.txt", "--out", tmp_path / "mine")
    assert rc == 2 and (tmp_path / "mine").is_dir()


def test_resume_repairs_truncated_weights_from_the_trainer_state(tmp_path):
    cfg = tiny(tmp_path / "run", max_steps=4)
    train(cfg, log=quiet)
    weights = tmp_path / "run" / "model.safetensors"
    good = load_run(tmp_path / "run").model.state_dict()
    weights.write_bytes(weights.read_bytes()[:100])  # cut short, e.g. by a full disk
    lines = []
    result = train(resume_config(cfg.run.out), log=lines.append)
    assert result.step == 4 and any("was damaged; rewrote it" in line for line in lines), lines
    repaired = load_run(tmp_path / "run").model.state_dict()
    assert all(torch.equal(good[k], repaired[k]) for k in good)


def test_resume_stops_in_one_line_on_a_damaged_trainer_state(tmp_path):
    cfg = tiny(tmp_path / "run", max_steps=2)
    train(cfg, log=quiet)
    state = tmp_path / "run" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"trainer_state.pt: not a readable trainer checkpoint"):
        train(resume_config(cfg.run.out, max_steps=4), log=quiet)


def test_max_minutes_is_a_budget_per_invocation(tmp_path):
    cfg = tiny(tmp_path / "run", max_steps=None, max_minutes=0.002)  # 0.12 s
    first = train(cfg, log=quiet)
    assert first.stopped == "time budget" and first.step >= 1
    second = train(resume_config(cfg.run.out), log=quiet)  # a new 0.12 s, not the total so far
    assert second.step > first.step and second.losses


def test_zero_steps_in_a_time_budget_is_reported(tmp_path, monkeypatch):
    from attnmask.train import loop

    cfg = tiny(tmp_path / "run", max_steps=None, max_minutes=0.001)
    ticks = iter(range(0, 10_000, 60))  # every clock read is a minute later
    monkeypatch.setattr(loop.time, "perf_counter", lambda: float(next(ticks)))
    lines = []
    result = train(cfg, log=lines.append)
    assert result.step == 0 and any(line.startswith("warning: 0 steps trained") for line in lines), lines


def test_cli_skips_and_counts_empty_lines(tmp_path, capsys):
    src = write_lines(tmp_path / "src.txt", ["a b", "", "c d", "e"] * 10)
    tgt = write_lines(tmp_path / "tgt.txt", ["x y", "z", "", "w"] * 10)
    rc, out, err = run_cli(capsys, "--src", src, "--tgt", tgt, "--tokenizer", "char", "--model", "tiny",
                           "--max-steps", 1, "--eval-sentences", 0, "--out", tmp_path / "run")  # fmt: skip
    assert rc == 0, err
    assert "skipped 20 line pairs with an empty side" in out
