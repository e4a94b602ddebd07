"""Sharded training (``--fsdp``): FSDP2 on the CPU (gloo) against one unsharded process, and
checkpoints that resume on another number of processes.

One process with ``grad_accum=2`` sees the global batch of two ranks (rank r takes batch ``2s + r``
of the epoch's plan at step s; accumulation takes ``2s`` and ``2s + 1``), so its losses are what the
sharded runs must give, whether they run on two ranks, on one, or change between the two at a
resume. Not bit for bit: FSDP reduce-scatters each rank's gradients (a sum in another order than
one process accumulating them), so the losses agree to float32 rounding.

Two ranks run under ``torchrun`` in a subprocess (rank 1 a second late to look at the run directory,
as a loaded machine may make it: rank 0 must not create the run before every rank has looked); a
one-rank sharded run runs in this process, with torchrun's environment set (a gloo group of one).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.testing import assert_close

from attnmask import linear
from attnmask.cli import main
from attnmask.train import TrainConfig, train
from attnmask.train.checkpoint import load_torch
from attnmask.train.fsdp import SHARDED_DIR, accumulation, data_state
from attnmask.train.rundir import RunDir, load_run, read_metrics

WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    from attnmask.train import TrainConfig, loop, train

    if os.environ["RANK"] == "1":  # looks at the run directory late, as a loaded machine may make it
        look = loop.Trainer._check_run_dir
        loop.Trainer._check_run_dir = lambda self: time.sleep(1) or look(self)
    train(TrainConfig.of(**json.loads(sys.argv[1])), log=lambda msg: None)
    """
)

pytestmark = pytest.mark.usefixtures("one_thread")


def settings(out: Path, **overrides) -> dict:
    """A tiny translator on the built-in dates task; a constant learning rate (so extending
    max_steps on resume leaves the schedule unchanged) and no dropout (so the random streams of
    two ranks and of one process need not match)."""
    cfg = dict(
        out=str(out), builtin_task="dates", train_size=200, valid_size=24, tokenizer="char", model="tiny",
        dim=32, n_layers=1, n_heads=2, ffn_dim=64, batch_tokens=256, warmup=0, min_lr_ratio=1.0, lr=3e-3,
        dropout=0.0, eval_every=0, eval_sentences=8, log_every=1, progress=False, deterministic=True,
        precision="fp32",  # the tests' comparisons are float32's; auto would take bf16 on a CPU that has it
    )  # fmt: skip
    cfg.update(overrides)
    return cfg


def torchrun(cfg: dict, tmp: Path) -> None:
    """Two ranks of ``WORKER`` under torchrun. Each rank's output goes to its own log file, so a
    failure shows torchrun's summary (which rank ended how: an exit code, or a signal such as
    SIGABRT) and the end of what each rank wrote, with every thread's Python stack on a fatal
    signal (``PYTHONFAULTHANDLER``)."""
    script = tmp / "worker.py"
    script.write_text(WORKER)
    logs = tmp / "torchrun-logs"
    # torchrun sets each worker's rank and rendezvous; none of this process's (the one_rank fixture's)
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {**{k: v for k, v in os.environ.items() if k not in launcher}, "OMP_NUM_THREADS": "1",
           "PYTHONFAULTHANDLER": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--log-dir", str(logs), "--redirects", "3", str(script), json.dumps(cfg)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"torchrun still running after {err.timeout} s\n{rank_logs(logs)}")
    assert proc.returncode == 0, f"torchrun exited with {proc.returncode}:\n{proc.stderr[-2000:]}\n{rank_logs(logs)}"


def rank_logs(logs: Path, tail: int = 2000) -> str:
    """The end of each rank's stdout and stderr under torchrun's ``--log-dir`` (``.../attempt_N/RANK/``),
    those not empty."""
    parts = []
    for log in sorted(logs.glob("*/attempt_*/*/std*.log")):
        if text := log.read_text(errors="replace"):
            head = f"--- rank {log.parent.name}, {log.name} (last {tail} of {len(text)} characters):"
            parts.append(f"{head}\n{text[-tail:]}")
    return "\n".join(parts) or f"(every rank log under {logs} is empty)"


@pytest.fixture
def one_rank(monkeypatch):
    """torchrun's environment for one process: ``--fsdp`` then starts a gloo group of one here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One unsharded process, two micro-batches a step, six steps: (run directory, losses, evaluation)."""
    out = tmp_path_factory.mktemp("single") / "run"
    result = train(TrainConfig.of(**settings(out, max_steps=6, grad_accum=2)), log=lambda msg: None)
    return out, result.losses, result.eval


def train_losses(run: Path) -> list[float]:
    records = [r for r in read_metrics(run) if r["split"] == "train"]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    return [r["loss"] for r in records]


def assert_same_run(sharded: Path, reference) -> None:
    """Losses, final evaluation and weights of ``sharded`` match the unsharded reference run."""
    single_dir, single_losses, single_eval = reference
    assert_close(torch.tensor(train_losses(sharded)), torch.tensor(single_losses), rtol=1e-5, atol=1e-6)
    # evaluated on the weights gathered onto every rank: validation loss and greedy translations
    final = [r for r in read_metrics(sharded) if r["split"] == "valid"][-1]
    assert (final["step"], final["tokens"], final["sentences"]) == (6, single_eval["tokens"], 8)
    assert final["loss"] == pytest.approx(single_eval["loss"], rel=1e-4)
    assert final["chrf"] == pytest.approx(single_eval["chrf"], abs=1e-6)
    want, got = load_run(single_dir).model, load_run(sharded).model
    for (name, p), q in zip(want.named_parameters(), got.parameters()):
        assert_close(q, p, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow  # torchrun with two processes, then a resume on one
def test_two_ranks_match_one_process_and_resume_on_one_rank(tmp_path, reference, one_rank):
    out = tmp_path / "fsdp"
    torchrun(settings(out, max_steps=3, fsdp=True), tmp_path)
    state = load_torch(out / "trainer_state.pt")
    assert (state["step"], state["micro_batches"], len(state["ranks"])) == (3, 2, 2)
    shards = sorted(p.name for p in (out / state["sharded"]).iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file of shards per rank

    result = train(TrainConfig.of(**settings(out, max_steps=6, fsdp=True, resume=True)), log=lambda msg: None)
    assert result.step == 6
    assert_same_run(out, reference)
    # the new checkpoint replaced the old one, written by this single process
    assert sorted(p.name for p in (out / SHARDED_DIR).iterdir()) == ["step-00000006"]
    assert load_torch(out / "trainer_state.pt")["micro_batches"] == 2


@pytest.mark.slow  # a one-rank sharded run, then a resume on two under torchrun
def test_one_rank_resumes_on_two_ranks(tmp_path, reference, one_rank):
    out = tmp_path / "fsdp"
    first = train(TrainConfig.of(**settings(out, max_steps=3, grad_accum=2, fsdp=True)), log=lambda msg: None)
    assert first.step == 3
    assert load_torch(out / "trainer_state.pt")["micro_batches"] == 2
    torchrun(settings(out, max_steps=6, grad_accum=2, fsdp=True, resume=True), tmp_path)
    assert_same_run(out, reference)
    assert sorted(p.name for p in (out / SHARDED_DIR / "step-00000006").iterdir())[1:] == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]


@pytest.mark.slow  # two runs of a tiny translator in this process
def test_bf16_gathers_bfloat16_weights_and_keeps_float32_master_weights(tmp_path, one_rank):
    seen = []

    def watch(step, model, record):
        if step == 1:  # the weights a layer computes with, from the second step on
            model.layers[0].mlp.register_forward_pre_hook(lambda m, args: seen.append(next(m.parameters()).dtype))
        seen.append(("master", {p.dtype for p in model.parameters()}))

    cfg = settings(tmp_path / "bf16", max_steps=2, grad_accum=2, precision="bf16", fsdp=True)
    sharded = train(TrainConfig.of(**cfg), on_step=watch, log=lambda msg: None)
    assert torch.bfloat16 in seen and ("master", {torch.float32}) in seen
    assert all(s == torch.bfloat16 for s in seen if not isinstance(s, tuple))
    plain = train(TrainConfig.of(**settings(tmp_path / "plain", max_steps=2, grad_accum=2, precision="bf16")),
                  log=lambda msg: None)  # fmt: skip
    # bf16 weights against bf16 products of float32 weights: bfloat16's 8-bit mantissa, not float32's
    assert_close(torch.tensor(sharded.losses), torch.tensor(plain.losses), rtol=2e-2, atol=0)


@pytest.mark.filterwarnings("ignore:this CPU has no native bfloat16")
def test_a_sharded_auto_run_resumes_in_the_precision_it_began_in(tmp_path, one_rank, monkeypatch):
    # the shards are gathered in the run's precision: chosen before sharding, from the saved state on a resume
    monkeypatch.setattr(linear, "fast_bf16_products", lambda: True)  # a CPU with native bfloat16
    out = tmp_path / "run"
    lines: list[str] = []
    train(TrainConfig.of(**settings(out, max_steps=2, precision="auto", fsdp=True)), log=lines.append)
    assert any(line.startswith("precision: bf16 (auto: this CPU has native bfloat16") for line in lines)
    monkeypatch.setattr(linear, "fast_bf16_products", lambda: False)  # resumed where auto would take fp32
    lines.clear()
    resume = TrainConfig.of(**settings(out, max_steps=3, precision="auto", fsdp=True, resume=True))
    assert train(resume, log=lines.append).step == 3
    assert "precision: bf16 (auto: as the run began (this machine would take fp32))" in lines
    assert any("bfloat16 gathers" in line for line in lines)
    assert load_torch(out / "trainer_state.pt")["precision"] == "bf16"


@pytest.mark.slow  # LoRA fine-tuning of a tiny GGUF Llama, sharded and not
def test_lora_trains_and_saves_the_adapters_alone(tmp_path, one_rank):
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install -e '.[hf]')")
    from tests.pretrained.test_pretrained import write_tiny_gguf

    init = tmp_path / "tiny.gguf"
    write_tiny_gguf(init, tied=True)
    data = tmp_path / "chat.jsonl"
    rows = [{"prompt": f"{a} plus {b}?", "completion": f"{a + b}"} for a in range(6) for b in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    def cfg(out, **more):  # fp32: auto would take bf16 on a CPU that has it
        return TrainConfig.of(init=str(init), data=str(data), out=str(out), lora_rank=4, lr=1e-2, max_len=120,
                              batch_tokens=256, eval_every=0, log_every=1, progress=False,
                              precision="fp32", **more)  # fmt: skip

    plain = train(cfg(tmp_path / "plain", max_steps=3), log=lambda msg: None)
    out = tmp_path / "fsdp"
    train(cfg(out, max_steps=2, fsdp=True), log=lambda msg: None)
    resumed = train(cfg(out, max_steps=3, fsdp=True, resume=True), log=lambda msg: None)
    assert_close(torch.tensor(train_losses(out)), torch.tensor(plain.losses), rtol=1e-5, atol=1e-6)
    assert resumed.losses[0] < plain.losses[0]  # the adapters learned

    assert not (out / "model.safetensors").exists()
    with safe_open(str(out / "adapters.safetensors"), framework="pt") as f:
        names = sorted(f.keys())
    with safe_open(str(tmp_path / "plain" / "adapters.safetensors"), framework="pt") as f:
        assert names == sorted(f.keys()) and names
    assert all(n.endswith((".lora_a", ".lora_b")) for n in names)
    state = load_torch(out / "trainer_state.pt")
    shards = RunDir(out) / state["sharded"]
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(shards)).read_metadata().state_dict_metadata
    weights = sorted(k.removeprefix("model.model.") for k in saved if k.startswith("model."))
    assert weights == names  # the frozen base stays out of the checkpoint
    assert all(k.removeprefix("optimizer.state.model.").split(".")[-2] in ("lora_a", "lora_b")
               for k in saved if k.startswith("optimizer.state."))  # fmt: skip
    merged, plain_merged = load_run(out).model, load_run(tmp_path / "plain").model
    for (name, p), q in zip(plain_merged.named_parameters(), merged.parameters()):
        assert_close(q, p, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------------------------------
# Refusals and resharding arithmetic (no process group)
# ---------------------------------------------------------------------------------------------
def test_fsdp_without_torchrun_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "run"
    argv = ["train", "--builtin-task", "dates", "--model", "tiny", "--max-steps", "1", "--out", str(out), "--fsdp"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].endswith(
        "--fsdp shards the model over torchrun's processes, but RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not "
        "set; launch with torchrun --nproc-per-node N -m attnmask train ... --fsdp"
    )
    assert not out.exists()


def test_a_resume_whose_shards_are_gone_names_the_directory(tmp_path, one_rank):
    out = tmp_path / "run"
    train(TrainConfig.of(**settings(out, max_steps=1, fsdp=True, eval_sentences=0)), log=lambda msg: None)
    shards = out / load_torch(out / "trainer_state.pt")["sharded"]
    (shards / ".metadata").unlink()
    resume = TrainConfig.of(**settings(out, max_steps=2, fsdp=True, eval_sentences=0, resume=True))
    with pytest.raises(ValueError, match=r"step-00000001: missing or incomplete sharded checkpoint \(no \.metadata\)"):
        train(resume, log=lambda msg: None)


def gloo_threads() -> int:
    """This process's threads that gloo started (its process groups' workers and socket loops)."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            names.append((task / "comm").read_text())
    return sum(n.startswith(("pt_gloo", "gloo_")) for n in names)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads by name in /proc/self/task (Linux)")
def test_a_finished_run_joins_its_process_groups_threads(tmp_path, one_rank):
    """``train`` frees the process group it started before it returns, so gloo's threads are joined then,
    not left running into the interpreter's shutdown (where one that needs the GIL aborts the process).
    Fewer than before is fine: a group an earlier failed run left to the garbage collector goes too."""
    before = gloo_threads()
    train(TrainConfig.of(**settings(tmp_path / "run", max_steps=1, fsdp=True, eval_sentences=0)), log=lambda msg: None)
    assert gloo_threads() <= before


def test_fsdp_with_compile_is_refused():
    with pytest.raises(
        ValueError, match=r"^fsdp=True with compile=True: sharded training runs eagerly; drop --compile"
    ):
        TrainConfig.of(fsdp=True, compile=True)


def test_the_global_batch_is_kept_or_the_resume_refused():
    run = RunDir("runs/x")
    assert accumulation(4, 1, 2, run) == 4 and accumulation(4, 2, 1, run) == 2 and accumulation(4, 4, 2, run) == 1
    with pytest.raises(ValueError, match=r"saved by 2 processes with a global batch of 2 micro-batches; 4 processes"):
        accumulation(2, 4, 2, run)
    with pytest.raises(ValueError, match=r"3 processes cannot share it evenly; resume on a number of processes"):
        accumulation(4, 3, 1, run)


def test_a_batch_plan_position_moves_to_another_number_of_ranks():
    saved = [{"epoch": 1, "position": 3, "world_size": 2, "seed": 0}] * 2  # six batches of epoch 1 consumed
    assert data_state(saved, 0, 1) == ({"epoch": 1, "position": 6, "world_size": 1, "seed": 0}, None)
    assert data_state(saved, 2, 3) == ({"epoch": 1, "position": 2, "world_size": 3, "seed": 0}, None)
    state, note = data_state(saved, 1, 4)
    assert state["position"] == 1 and note.startswith("data: 6 batches of epoch 1 do not split over 4 ranks")
    assert data_state(saved, 1, 2) == (saved[1], None)  # the same number of ranks: its own position


def test_lm_streams_continue_on_the_ranks_that_existed():
    streams = [{"rng_state": torch.tensor([r]), "seed": r} for r in range(2)]
    assert data_state(streams, 1, 3) == (streams[1], None)
    state, note = data_state(streams, 2, 3)
    assert state is None and note == "data: rank 2 starts its own stream of blocks (the run was saved by 2 processes)"
