"""``attnmask serve``: flags checked in one line before anything loads, a real server in a subprocess that
answers and exits 0 on SIGTERM / SIGINT, and (slow) SmolLM2 served and chatted with."""

from __future__ import annotations

import contextlib
import queue
import re
import signal
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from attnmask import ops
from attnmask.cli import main
from tests.cli.test_decode_commands import make_run
from tests.conftest import REPO
from tests.serve.conftest import TIMEOUT, free_socket

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("lm"), "lm")


@pytest.fixture(scope="module")
def mt_run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("mt"), "translation")


def run_serve(capsys, argv: list[str]) -> tuple[int, str]:
    """``attnmask serve ARGV``'s exit code and stderr."""
    code = main(["serve", *argv])
    return code, capsys.readouterr().err


def is_one_line(err: str, match: str) -> bool:
    return err.count("\n") == 1 and err.startswith("attnmask serve: error: ") and re.search(match, err) is not None


@pytest.mark.parametrize(
    "argv, match",
    [
        ([], "--model NAME"),
        (["--model", "no-such-model"], "unknown pretrained model 'no-such-model'"),
        (["--run", "/no/such/dir"], "not a run directory"),
        (["--run", "{lm}", "--quantized"], "--quantized applies to --model"),
        (["--run", "{lm}", "--port", "70000"], "--port must be in 0..65535"),
        (["--run", "{lm}", "--kv-cache-mib", "0"], "--kv-cache-mib must be > 0"),
        (["--run", "{lm}", "--kv-cache-mib", "inf"], "--kv-cache-mib must be > 0"),
        (["--run", "{lm}", "--max-seqs", "0"], "--max-seqs must be >= 1"),
        (["--run", "{lm}", "--max-batch-tokens", "-3"], "--max-batch-tokens must be >= 1"),
        (["--run", "{lm}", "--block-size", "0"], "--block-size must be >= 1"),
        (["--run", "{lm}", "--threads", "0"], "--threads must be >= 1"),
        (["--run", "{lm}", "--speculative-tokens", "-1"], "--speculative-tokens must be >= 0"),
        (["--run", "{lm}", "--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0"),
        (["--run", "{mt}"], "serve needs a decoder-only language model"),
        (["--run", "{lm}", "--kv-cache-mib", "0.0001"], "holds 0 blocks"),
        (["--run", "{lm}", "--device", "banana"], "--device 'banana' is not a device name"),
        (["--model", "smollm2", "--quantized", "--dtype", "bfloat16"], "--quantized runs on the CPU in float32"),
        (["--run", "{lm}", "--api-key", " "], "--api-key .* is empty"),
        (["--run", "{lm}", "--chat-template", "nosuch"], "--chat-template nosuch: no such file or template name"),
    ],
)
def test_mistakes_are_one_line(capsys, lm_run, mt_run, argv, match):
    code, err = run_serve(capsys, [a.format(lm=lm_run, mt=mt_run) for a in argv])
    assert code == 2 and is_one_line(err, match), err


def test_the_api_key_comes_from_the_environment_and_help_does_not_print_it(capsys, lm_run, monkeypatch):
    monkeypatch.setenv("ATTNMASK_API_KEY", "")
    code, err = run_serve(capsys, ["--run", str(lm_run)])
    assert code == 2 and is_one_line(err, r"\$ATTNMASK_API_KEY\) is empty"), err
    monkeypatch.setenv("ATTNMASK_API_KEY", "sk-secret-123")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "sk-secret-123" not in capsys.readouterr().out


def test_a_busy_port_is_one_line(capsys, lm_run):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code, err = run_serve(capsys, ["--run", str(lm_run), "--port", str(busy.getsockname()[1])])
    assert code == 2 and is_one_line(err, "cannot listen on"), err


class Server:
    """``attnmask serve`` in a subprocess; its stderr lines on a queue."""

    def __init__(self, *argv: str):
        ops.available()  # built in this session's cache, which the subprocess inherits (no second build)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "attnmask", "serve", *argv], stderr=subprocess.PIPE, text=True, cwd=REPO
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.url = None
        while self.url is None:
            line = self.lines.get(timeout=120)
            if found := re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line):
                self.url, self.banner = found.group(1), line
            assert self.proc.poll() is None, line

    def _read(self):
        for line in self.proc.stderr:
            self.lines.put(line)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.reader.join(timeout=10)
        self.proc.stderr.close()


def a_free_port() -> int:
    with free_socket() as sock:
        return sock.getsockname()[1]


# A short template (the run's context is 48 characters) in a file, as --chat-template takes one.
SHORT = (
    "{% for m in messages %}{{ m.role[0] }}:{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
)


@pytest.mark.parametrize(
    "sig, port, template", [(signal.SIGTERM, "free", SHORT), (signal.SIGINT, "0", None)], ids=["SIGTERM", "SIGINT"]
)
def test_serves_and_exits_0_on_a_signal(lm_run, sig, port, template, tmp_path):
    port = str(a_free_port()) if port == "free" else port  # 0: the kernel picks one, the server says which
    if template:
        (tmp_path / "chat.jinja").write_text(template)
        template = str(tmp_path / "chat.jinja")
    server = Server(
        "--run", str(lm_run), "--port", port, "--threads", "1", "--kv-cache-mib", "1", "--shutdown-timeout", "5",
        *(["--chat-template", template] if template else []),
    )  # fmt: skip
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", timeout=TIMEOUT, max_retries=0)
    try:
        assert port == "0" or server.url == f"http://127.0.0.1:{port}"  # only 127.0.0.1 unless --host says
        assert httpx.get(f"{server.url}/health", timeout=TIMEOUT).json() == {"status": "ok"}
        assert "prefix caching on" in server.banner  # the default for a model without sliding windows
        name = lm_run.name
        assert [m.id for m in client.models.list()] == [name]
        r = client.completions.create(model=name, prompt="a man", max_tokens=5, temperature=0)
        assert r.usage.prompt_tokens == 5 and 1 <= r.usage.completion_tokens <= 5
        ask = [{"role": "user", "content": "a man"}]
        if template:  # the file's turns, as characters to this run's tokenizer
            r = client.chat.completions.create(model=name, messages=ask, max_tokens=3, temperature=0)
            assert r.usage.prompt_tokens == len("u:a man\na:")
        else:
            with pytest.raises(openai.BadRequestError, match="no chat template"):
                client.chat.completions.create(model=name, messages=ask, max_tokens=3)
        stream = client.completions.create(model=name, prompt="a", max_tokens=40, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        next(iter(stream))
        server.proc.send_signal(sig)  # mid-stream: the answer still ends properly
        reasons = [chunk.choices[0].finish_reason for chunk in stream]
        assert reasons[-1] in ("length", "cancelled")
        assert server.proc.wait(timeout=30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health", timeout=5)
    finally:
        client.close()
        server.close()


@pytest.mark.slow
def test_smollm2_chat():
    """The real model, quantized, behind the in-process server: a chat answer, streamed and whole."""
    from attnmask.engine import Engine
    from attnmask.errors import UserError
    from attnmask.pretrained import MODELS, load, locate

    try:
        locate("smollm2")
    except UserError:
        pytest.skip(f"SmolLM2 weights not installed ({MODELS['smollm2'].install})")
    from tests.serve.conftest import serve

    model, tok, template = load("smollm2", quantized=True)
    engine = Engine(model, kv_cache_mib=64, eos_ids=tok.stop_ids, detokenize=tok.decode)
    with contextlib.ExitStack() as stack:
        s = stack.enter_context(serve(engine, tok, template, name="smollm2"))
        client = stack.enter_context(openai.OpenAI(base_url=s.base_url, api_key="-", timeout=300, max_retries=0))
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
        text = whole.choices[0].message.content
        assert "paris" in text.lower() and whole.choices[0].finish_reason in ("stop", "length")
        chunks = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0,
                                                stream=True)  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
        s.wait_idle()
