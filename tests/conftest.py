"""Shared fixtures, tiny-model factories, and where the development data lives.

The tests mirror the package: ``tests/masks`` tests ``attnmask.masks``, ``tests/train`` tests
``attnmask.train``, and so on. ``pytest -m "not slow"`` skips the long end-to-end tests
(kill -9 loops, torchrun, the demo, SmolLM2) for a fast inner loop; CI runs everything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from attnmask.data.tokenizer import EOS_ID
from attnmask.model import ModelConfig, Transformer

REPO = Path(__file__).resolve().parent.parent

# Development data (Multi30k, Tiny Shakespeare): $ATTNMASK_DATA, else ../shared/data beside the
# repository. Tests that need it skip, naming the path, when it is absent.
DATA = Path(os.environ.get("ATTNMASK_DATA") or REPO.parent / "shared" / "data")
MULTI30K = DATA / "multi30k"

# CI (CI=true) runs every property test on the same examples, so a red run is reproducible.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev")


# ---------------------------------------------------------------------------------------------
# $ATTNMASK_CACHE: one temporary folder for the whole test run
# ---------------------------------------------------------------------------------------------
# Set when pytest starts (before any test module is imported) and removed when it ends, so that no
# test writes to the developer's cache (~/.cache/attnmask) or is helped by what is in it. One folder
# per session, not per test: the native kernels build once (about 40 s on 2 cores) and SmolLM2's
# GGUF file is converted once (about 10 s and 515 MB), by the first test that loads it by name. A
# test that needs a fresh build sets its own (monkeypatch.setenv("ATTNMASK_CACHE", str(tmp_path))).
# $ATTNMASK_TEST_CACHE names a folder to use instead, kept between runs (e.g. a CI cache).
_CACHE_KEY = pytest.StashKey[tuple]()


def pytest_configure(config):
    kept = os.environ.get("ATTNMASK_TEST_CACHE")
    folder = Path(kept) if kept else Path(tempfile.mkdtemp(prefix="attnmask-test-cache-"))
    config.stash[_CACHE_KEY] = (folder, not kept, os.environ.get("ATTNMASK_CACHE"))
    os.environ["ATTNMASK_CACHE"] = str(folder)  # subprocesses (run_python, torchrun) inherit it


def pytest_unconfigure(config):
    folder, remove, before = config.stash.get(_CACHE_KEY, (None, False, None))
    if folder is None:
        return
    if before is None:
        os.environ.pop("ATTNMASK_CACHE", None)
    else:
        os.environ["ATTNMASK_CACHE"] = before
    if remove:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def attnmask_cache(pytestconfig) -> Path:
    """The test run's ``$ATTNMASK_CACHE`` folder."""
    return pytestconfig.stash[_CACHE_KEY][0]


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a test module (``pytestmark = pytest.mark.usefixtures("one_thread")``).
    The tests' models are tiny: on a shared 2-core machine, two OpenMP threads spin-waiting for each
    other made steps 5-10x slower than one thread (measured), and intra-op threads gain nothing."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# Tiny models
# ---------------------------------------------------------------------------------------------
TINY = {"dim": 32, "n_layers": 2, "n_heads": 4}


def tiny_config(arch: str = "decoder", *, vocab: int = 24, **overrides) -> ModelConfig:
    """A two-layer, width-32 :class:`ModelConfig`; ``overrides`` are ModelConfig fields."""
    return ModelConfig(vocab_size=vocab, arch=arch, **{**TINY, **overrides})


def tiny_model(
    arch: str = "decoder",
    *,
    vocab: int = 24,
    seed: int = 0,
    std: float | None = None,
    eos_bias: float | None = None,
    **overrides,
) -> Transformer:
    """A seeded tiny :class:`Transformer` in eval mode.

    ``std``: redraw every weight matrix from N(0, std²), so logits are O(1) and a wrong mask shows
    far above float32 noise. ``eos_bias``: add this bias to ``<eos>`` (needs ``lm_head_bias=True``)
    so that rows of a batch end at different steps.
    """
    torch.manual_seed(seed)
    model = Transformer(tiny_config(arch, vocab=vocab, **overrides)).eval()
    with torch.no_grad():
        if std is not None:
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, std)
        if eos_bias is not None:
            model.lm_head.bias[EOS_ID] = eos_bias
    return model


def run_python(code: str, timeout: int = 300, **env: str) -> list[str]:
    """``python -c code`` in a fresh process (what a loaded operator library cannot be unloaded from), with
    ``env`` added to the environment, from the repository root; its stdout lines. Fails on a non-zero exit."""
    root = Path(__file__).resolve().parents[1]
    command, env = [sys.executable, "-c", code], {**os.environ, **env}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=root, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout.splitlines()
