"""Tool calls under load: ``attnmask serve`` against llama.cpp's ``llama-server --jinja``, same GGUF file.

SmolLM2's chat template knows nothing of tools. attnmask gives such templates one generic form: the
tools described in the system turn, the answer held by an llguidance grammar to
``{"tool_calls": [...]}`` or ``{"response": ...}``. llama-server (the llama.cpp vendored in
llama-cpp-python 0.3.36) reads the template with its automatic parser, renders it without the tools and
answers in text, whatever ``tool_choice`` says; older llama.cpp servers used a generic form like
attnmask's. Each server gets the same chat requests through the official ``openai`` client, not
streamed (a call is known when its JSON is complete): 16 questions, some that a tool answers and some
that none does, with three tools offered, at each concurrency level, for each ``--tool-choice``.

Reported per server, level and choice: output tokens/s (the servers' own ``usage`` counts / wall time),
requests/s, request latency p50 / p99, the fraction of answers that are valid calls (every call names an
offered tool, its arguments are JSON that follows the tool's parameters; for ``auto`` a text answer is
valid too), and the fraction identical to the same server's answer alone (concurrency 1).

Run: ``python benchmarks/tool_calls.py [--levels 1,16] [--tool-choice required,auto] [--max-tokens 96]
[--threads 2] [--quantized] [--[no-]prefix-caching] [--llama-server PATH]``; llama-server built as
``benchmarks/serve.py`` says. Needs ``pip install -e ".[serve]" openai`` and the SmolLM2 weights.
Nothing here is asserted; figures go to docs/benchmarks.md with the CPU named.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from matmul import cpu_name  # benchmarks/, run as a script
from serve import percentile, running, start_attnmask

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "The sum of two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
]  # fmt: skip

QUESTIONS = [
    "What is the weather in Paris?",
    "How warm is it in Tokyo right now, in fahrenheit?",
    "What is 17 plus 25?",
    "Add 1200 and 34 for me.",
    "Find recent news about the Mars rover.",
    "Search for a recipe for pancakes.",
    "Is it raining in London?",
    "What is 9 plus 10?",
    "Who wrote Hamlet?",
    "Tell me a joke.",
    "What's the weather like in New York in celsius?",
    "Look up the population of Canada.",
    "What is the sum of 345 and 655?",
    "Hello! How are you today?",
    "Search the web for the best hiking trails in Colorado.",
    "Will I need an umbrella in Berlin?",
]


def valid(answer: dict, choice: str) -> bool:
    """Every call names an offered tool, with JSON arguments holding exactly its parameters, of their types;
    ``auto`` may answer in text instead."""
    if not answer["calls"]:
        return choice == "auto" and answer["finish"] == "stop" and bool(answer["content"])
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for name, arguments in answer["calls"]:
        try:
            args = json.loads(arguments)
        except ValueError:
            return False
        schema = params.get(name)
        if schema is None or not isinstance(args, dict) or set(args) != set(schema["properties"]):
            return False
        for key, spec in schema["properties"].items():
            kind = {"string": str, "integer": int}[spec["type"]]
            if (
                not isinstance(args[key], kind)
                or isinstance(args[key], bool)
                or args[key] not in spec.get("enum", [args[key]])
            ):
                return False
    return True


def ask(client, question: str, choice: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": question}], tools=TOOLS, tool_choice=choice,
        max_tokens=max_tokens, temperature=0,
    )  # fmt: skip
    message = r.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
    return {"calls": calls, "content": message.content, "finish": r.choices[0].finish_reason,
            "tokens": r.usage.completion_tokens, "latency": time.perf_counter() - start}  # fmt: skip


def run_level(url: str, concurrency: int, choice: str, max_tokens: int) -> tuple[dict, list[dict]]:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
    questions = (QUESTIONS * (1 + concurrency // len(QUESTIONS)))[: max(concurrency, len(QUESTIONS))]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda q: ask(client, q, choice, max_tokens), questions))
    wall = time.perf_counter() - start
    latency = [a["latency"] for a in answers]
    stats = {
        "tok_s": sum(a["tokens"] for a in answers) / wall,
        "req_s": len(answers) / wall,
        "lat_p50": percentile(latency, 50),
        "lat_p99": percentile(latency, 99),
        "valid": sum(valid(a, choice) for a in answers) / len(answers),
        "calls": sum(bool(a["calls"]) for a in answers) / len(answers),
    }
    return stats, answers


def start_llama(args, port: int, concurrency: int) -> subprocess.Popen:
    from attnmask.pretrained import locate

    ctx = concurrency * (1024 + args.max_tokens)
    command = [args.llama_server, "-m", str(locate("smollm2")), "--port", str(port), "--host", "127.0.0.1", "--jinja"]
    command += ["-t", str(args.threads), "-tb", str(args.threads), "-np", str(concurrency), "-c", str(ctx)]
    command += ["--cont-batching", "--no-webui", "-ngl", "0"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def bench(name: str, starter, args, levels: list[int], choice: str) -> None:
    solo = None
    for level in levels:
        with running(starter, args, level) as url:
            run_level(url, 1, choice, 8)  # warm-up
            stats, answers = run_level(url, level, choice, args.max_tokens)
        key = lambda a: (a["calls"], a["content"], a["finish"])  # noqa: E731
        if level == 1:
            solo = [key(a) for a in answers]
        same = sum(key(a) == s for a, s in zip(answers, solo * level)) / len(answers) if solo else float("nan")
        print(
            f"{name:<24} {choice:<9} c={level:<3} {stats['tok_s']:7.1f} tok/s  {stats['req_s']:5.2f} req/s  "
            f"latency p50 {stats['lat_p50']:6.2f} p99 {stats['lat_p99']:6.2f} s  valid {stats['valid']:4.0%}  "
            f"calls {stats['calls']:4.0%}  same as solo {same:4.0%}",
            flush=True,
        )
        if args.show and level == 1:
            for q, a in zip(QUESTIONS, answers):
                print(f"    {q!r}: {a['calls'] or a['content']!r} ({a['finish']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,16", help="concurrency levels (1 first: the solo answers)")
    parser.add_argument("--tool-choice", default="required,auto", help="comma-separated: required, auto")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantized", action="store_true", help="attnmask keeps the GGUF blocks (as llama.cpp)")
    parser.add_argument("--max-batch-tokens", type=int, default=256)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--llama-server", default=shutil.which("llama-server"), help="path of llama-server")
    parser.add_argument("--skip-attnmask", action="store_true")
    parser.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="attnmask reuses the blocks of the prompts' shared start (the tools' system turn), as llama-server "
        "reuses a slot's cached prompt (none given: the server's default, on)",
    )
    parser.add_argument("--show", action="store_true", help="print each server's solo answers")
    args = parser.parse_args()
    args.activation = "float32"  # start_attnmask's: the exact products
    levels = sorted({int(x) for x in args.levels.split(",")} | {1})
    print(f"# {cpu_name()}, {os.cpu_count()} CPUs, {args.threads} threads; SmolLM2-135M-Instruct Q4_1 GGUF")
    print(f"# greedy chat requests with {len(TOOLS)} tools, max_tokens {args.max_tokens}, {len(QUESTIONS)} questions")
    for choice in args.tool_choice.split(","):
        if not args.skip_attnmask:
            name = (
                "attnmask"
                + (" blocks" if args.quantized else "")
                + {True: " +prefix", False: " no prefix", None: ""}[args.prefix_caching]
            )
            bench(name, start_attnmask, args, levels, choice)
        if args.llama_server:
            bench("llama-server", start_llama, args, levels, choice)
    if not args.llama_server:
        print("# llama-server: not found (--llama-server PATH)")


if __name__ == "__main__":
    threading.excepthook = lambda a: None
    main()
    sys.exit(0)
