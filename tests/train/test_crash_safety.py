"""Crash safety of `attnmask train`: kill -9 at random moments, SIGTERM, SIGINT.

The reference is one uninterrupted run of the same settings (float32, deterministic, one thread);
every interrupted-and-resumed run must reproduce its losses bit for bit.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from attnmask.cli import build_parser
from attnmask.cli.train import config_from_args
from attnmask.train import TrainConfig, checkpoint, resume_config, train
from attnmask.train.rundir import load_run, read_metrics

MAX_STEPS = 60
FLAGS = {
    "--builtin-task": "dates", "--train-size": 300, "--valid-size": 8, "--tokenizer": "char", "--model": "tiny",
    "--dim": 32, "--layers": 1, "--heads": 2, "--ffn-dim": 64, "--batch-tokens": 256, "--max-steps": MAX_STEPS,
    "--warmup": 5, "--lr": 3e-3, "--eval-every": 0, "--eval-sentences": 0, "--log-every": 1, "--dropout": 0.1,
}  # fmt: skip


def config(out: Path, **overrides) -> TrainConfig:
    """FLAGS as the command line turns them into a TrainConfig."""
    argv = ["train", *(x for k, v in FLAGS.items() for x in (k, str(v))), "--out", str(out), "--deterministic"]
    return config_from_args(build_parser().parse_args([*argv, "--no-progress"])).replace(**overrides)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    torch.set_num_threads(1)
    result = train(config(tmp_path_factory.mktemp("ref") / "run"), log=lambda msg: None)
    assert len(result.losses) == MAX_STEPS
    return result.losses


def start(out: Path, *extra: str, resume: bool = False) -> subprocess.Popen:
    args = ["--out", str(out), "--resume"] if resume else [x for k, v in FLAGS.items() for x in (k, str(v))]
    if not resume:
        args += ["--out", str(out), "--deterministic"]
    cmd = [sys.executable, "-m", "attnmask", "train", *args, "--no-progress", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            return  # finished (or failed) before the moment came
        assert time.monotonic() < deadline, "training did not get going in time"
        time.sleep(0.02)


def saved_step(run: Path) -> int:
    return int(checkpoint.load_torch(run / "trainer_state.pt")["step"])


def logged_losses(run: Path) -> tuple[list[int], list[float]]:
    records = [r for r in read_metrics(run) if r["split"] == "train"]
    return [r["step"] for r in records], [r["loss"] for r in records]


def assert_checkpoint_intact(run: Path) -> int:
    """Both checkpoint files load completely; returns the trainer state's step."""
    step = saved_step(run)  # raises on a torn file
    weights = load_run(run)  # strict: every tensor present and of the right shape
    assert weights.step is not None and weights.step <= step
    return step


@pytest.mark.slow  # kill -9 loop: a subprocess per kill
def test_sigterm_then_sigkills_at_random_moments_and_resume_reproduces_the_run(tmp_path, reference):
    """One run, interrupted again and again: SIGTERM first (a clean stop that must save the step it
    was on, between the periodic checkpoints every 5 steps), then kill -9 at random moments, each
    followed by --resume. No checkpoint may ever be unreadable, and the losses of the whole
    patched-together run must be those of the uninterrupted one."""
    run = tmp_path / "run"
    proc = start(run, "--save-every", "5")
    wait_for(lambda: len(logged_losses(run)[0]) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]  # 128 + SIGTERM, after saving
    last = saved_step(run)
    assert 3 <= last < MAX_STEPS
    assert f"stopped by SIGTERM at step {last}; checkpoint saved, continue with --resume" in out
    assert load_run(run).step == last == logged_losses(run)[0][-1]

    rng = random.Random(1234)
    for kill in range(3):
        proc = start(run, resume=True)
        # wait for a checkpoint newer than the last one, then kill at a random moment after it
        wait_for(lambda last=last: saved_step(run) > last, proc)
        time.sleep(rng.uniform(0.0, 0.3))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        else:  # it ended by itself: it must have finished, not failed
            assert proc.wait() == 0, proc.stderr.read()[-2000:]
        step = assert_checkpoint_intact(run)
        assert step >= last, f"kill {kill}: the checkpoint went back from step {last} to {step}"
        last = step
        if step >= MAX_STEPS:
            break

    proc = start(run, resume=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert saved_step(run) == MAX_STEPS
    assert not list(run.glob(".*.tmp-*")), "temporary files of killed writes were left behind"
    steps, losses = logged_losses(run)
    assert steps == list(range(1, MAX_STEPS + 1))  # every step logged once: replays replaced their records
    assert_close(torch.tensor(losses), torch.tensor(reference), rtol=0, atol=0)


def test_sigint_stops_after_the_current_step_and_saves(tmp_path, reference):
    def interrupt(step, model, record):
        if step == 7:
            os.kill(os.getpid(), signal.SIGINT)

    cfg = config(tmp_path / "run")
    # Python's own handler, whatever the test run inherited (`pytest &` starts with SIGINT ignored)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        result = train(cfg, on_step=interrupt, log=lambda msg: None)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler found is restored
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert result.stopped == "SIGINT" and result.step == 7
    assert saved_step(tmp_path / "run") == 7
    resumed = train(resume_config(cfg.run.out), log=lambda msg: None)
    assert_close(torch.tensor(result.losses + resumed.losses), torch.tensor(reference), rtol=0, atol=0)


def test_an_inherited_ignored_sigint_stays_ignored(tmp_path):
    """Started with SIGINT ignored (``nohup``, ``cmd &``), the trainer leaves it so, as Python does:
    a SIGINT neither stops the run nor changes the disposition the caller chose."""

    def interrupt(step, model, record):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        result = train(config(tmp_path / "run", max_steps=4), on_step=interrupt, log=lambda msg: None)
        assert result.stopped == "max_steps" and result.step == 4
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
