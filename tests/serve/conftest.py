"""A real server on 127.0.0.1 for the serve tests: uvicorn on a background thread, bound to a free port.

The model is a tiny random decoder over a character tokenizer (every printable ASCII character), so
every test drives the whole path (HTTP, the engine loop, the packed step) in milliseconds.
"""

from __future__ import annotations

import contextlib
import socket
import string
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from attnmask import ops
from attnmask.data.tokenizer import Tokenizer
from attnmask.engine import Engine
from attnmask.pretrained.chat import ChatTemplate
from attnmask.serve import EngineLoop, create_app
from tests.conftest import tiny_model

MODEL = "tiny-chars"
# A ChatML-like template over plain characters (the tokenizer has no special tokens for turns).
TEMPLATE = ChatTemplate(
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{% endif %}"
)
TIMEOUT = 30.0  # seconds, for any one client call


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer.train_chars([string.printable])


def tiny_lm(tokenizer: Tokenizer, *, max_seq_len: int = 512, seed: int = 0):
    """Random weights large enough (std 0.5) that greedy answers differ from prompt to prompt."""
    return tiny_model(vocab=tokenizer.vocab_size, std=0.5, max_seq_len=max_seq_len, seed=seed)


class PacedEngine(Engine):
    """An engine whose steps take at least ``pace`` seconds: a request is still running when a test
    acts on it (a disconnect, a shutdown), however fast the machine."""

    pace = 0.0

    def step(self):
        if self.pace:
            time.sleep(self.pace)
        return super().step()


@dataclass
class Served:
    url: str  # http://127.0.0.1:PORT
    loop: EngineLoop
    engine: Engine
    tokenizer: Tokenizer

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{name{labels}: value}`` (comments dropped)."""
        text = httpx.get(f"{self.url}/metrics", timeout=TIMEOUT).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Poll ``/metrics`` until no request runs or waits and no cache block is used; the metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["attnmask_requests_running"] == 0 and m["attnmask_requests_waiting"] == 0
            if idle and m["attnmask_cache_blocks_used"] == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not go idle in {timeout} s: {m}")
            time.sleep(0.02)


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # the kernel picks a free port; only the loopback address
    return sock


@contextlib.contextmanager
def serve(
    engine: Engine, tokenizer, chat_template=TEMPLATE, name: str = MODEL, api_key: str | None = None
) -> Iterator[Served]:
    """``engine`` behind a real uvicorn server on 127.0.0.1, for the duration of the block."""
    ops.available()  # the native kernels built (once per test session, ~60 s) before any request times it
    loop = EngineLoop(engine)
    app = create_app(loop, tokenizer, chat_template, name, api_key=api_key)
    sock = free_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield Served(f"http://127.0.0.1:{port}", loop, engine, tokenizer)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        loop.shutdown()
        sock.close()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return tiny_tokenizer()
