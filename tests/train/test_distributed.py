"""Data-parallel training under torchrun: 2 CPU processes (gloo) against one process.

One process with ``grad_accum=2`` sees exactly the global batch of two ranks (rank r takes batch
``2s + r`` of the epoch's plan at step s; accumulation takes batches ``2s`` and ``2s + 1``), so
its losses and weights are what DDP must reproduce.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from attnmask.train import TrainConfig, distributed, train
from attnmask.train.rundir import load_run, read_metrics

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from attnmask.train import TrainConfig, train

    cfg = TrainConfig.of(**json.loads(sys.argv[1]))
    snapshots, rank = sys.argv[2], int(os.environ["RANK"])

    def snapshot(step, model, record):
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # (n_params,)
        torch.save(flat, os.path.join(snapshots, f"rank{rank}_step{step}.pt"))

    train(cfg, on_step=snapshot, log=lambda msg: None)
    """
)


pytestmark = pytest.mark.usefixtures("one_thread")


def settings(out: Path, **overrides) -> dict:
    """Constant learning rate, so extending max_steps on resume leaves the schedule unchanged;
    no dropout, so the random streams of two ranks and of one process need not match."""
    cfg = dict(
        out=str(out), builtin_task="dates", train_size=200, valid_size=24, tokenizer="char", model="tiny",
        dim=32, n_layers=1, n_heads=2, ffn_dim=64, batch_tokens=256, warmup=0, min_lr_ratio=1.0, lr=3e-3,
        dropout=0.0, eval_every=0, eval_sentences=24, log_every=1, progress=False, deterministic=True,
        precision="fp32",  # the tests' comparisons are float32's; auto would take bf16 on a CPU that has it
    )  # fmt: skip
    cfg.update(overrides)
    return cfg


def torchrun(cfg: dict, snapshots: Path) -> subprocess.CompletedProcess:
    script = snapshots / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), json.dumps(cfg), str(snapshots)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow  # torchrun with two processes
def test_two_processes_match_one_process_on_the_same_global_batch(tmp_path):
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    ddp_dir = tmp_path / "ddp"
    torchrun(settings(ddp_dir, max_steps=3), snapshots)  # then a multi-process resume to step 6:
    torchrun(settings(ddp_dir, max_steps=6, resume=True), snapshots)

    for step in range(1, 7):  # DDP keeps the replicas identical after every step
        rank0 = torch.load(snapshots / f"rank0_step{step}.pt")
        rank1 = torch.load(snapshots / f"rank1_step{step}.pt")
        assert_close(rank1, rank0, rtol=0, atol=0, msg=lambda m, s=step: f"step {s}: {m}")

    single_dir = tmp_path / "single"
    single = train(TrainConfig.of(**settings(single_dir, max_steps=6, grad_accum=2)), log=lambda msg: None)

    ddp_records = read_metrics(ddp_dir)
    ddp_losses = [r["loss"] for r in ddp_records if r["split"] == "train"]
    assert [r["step"] for r in ddp_records if r["split"] == "train"] == list(range(1, 7))
    assert_close(torch.tensor(ddp_losses), torch.tensor(single.losses), rtol=1e-5, atol=1e-6)

    ddp_model, single_model = load_run(ddp_dir).model, load_run(single_dir).model
    for (name, p), q in zip(single_model.named_parameters(), ddp_model.parameters()):
        assert_close(q, p, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")

    # evaluation is gathered over ranks: the same numbers as one process
    ddp_eval = [r for r in ddp_records if r["split"] == "valid"][-1]
    assert ddp_eval["tokens"] == single.eval["tokens"] and ddp_eval["sentences"] == single.eval["sentences"]
    assert ddp_eval["loss"] == pytest.approx(single.eval["loss"], rel=1e-4)
    assert ddp_eval["exact_match"] == pytest.approx(single.eval["exact_match"])
    # rank 0 alone wrote the run directory
    assert sorted(p.name for p in ddp_dir.iterdir()) == sorted(p.name for p in single_dir.iterdir())


# ---------------------------------------------------------------------------------------------
# More local ranks than GPUs (torchrun --nproc-per-node 2 on a one-GPU machine)
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def torchrun_rank(monkeypatch):
    """Pretend to be a torchrun rank on a machine with ``gpus`` GPUs, the process group already up."""

    def start(rank: int, gpus: int, local_ranks: int = 2):
        env = {"WORLD_SIZE": str(local_ranks), "RANK": str(rank), "LOCAL_RANK": str(rank)}
        for name, value in {**env, "LOCAL_WORLD_SIZE": str(local_ranks)}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        chosen = []

        def set_device(device):
            if torch.device(device).index >= gpus:
                raise RuntimeError("CUDA error: invalid device ordinal")
            chosen.append(torch.device(device))

        monkeypatch.setattr(torch.cuda, "set_device", set_device)
        monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
        return chosen

    return start


@pytest.mark.parametrize("rank", [0, 1])
def test_auto_with_more_local_ranks_than_gpus_runs_every_rank_on_the_cpu(torchrun_rank, capsys, rank):
    chosen = torchrun_rank(rank, gpus=1)
    ctx = distributed.setup("auto")
    assert ctx.device == torch.device("cpu") and ctx.world_size == 2 and chosen == []
    err = capsys.readouterr().err
    notice = "distributed: 2 local ranks (torchrun --nproc-per-node) but 1 GPU: every rank runs on the CPU (gloo)\n"
    assert err == (notice if rank == 0 else "")


def test_cuda_with_more_local_ranks_than_gpus_is_one_line_naming_the_numbers(torchrun_rank):
    torchrun_rank(1, gpus=1)
    with pytest.raises(ValueError, match=r"^--device cuda: 2 local ranks \(torchrun --nproc-per-node\) but 1 GPU; "):
        distributed.setup("cuda")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_gpu_for_every_local_rank_takes_cuda_local_rank(torchrun_rank, rank):
    chosen = torchrun_rank(rank, gpus=2)
    assert distributed.setup("auto").device == torch.device("cuda", rank) == chosen[0]
