"""Decoding speed: the KV cache against recomputation, translation against Hugging Face, framework work per token.

Three measurements (``--part cache``, ``--part translate``, ``--part framework``, or all):

1. **Cache vs recomputation.** A decoder-only model of realistic small size (C=512, 6 layers, 8 heads,
   FFN 2048, V=8192, random weights) greedily generates N = 16 / 64 / 256 / 1024 tokens after a
   16-token prompt, batch 1, never stopping early. "cached" is :func:`attnmask.decode.greedy`
   (the prompt prefilled, then one token a step, both through the packed step over a paged KV cache).
   "recompute" runs the whole sequence through ``model.decode(..., last_only=True)`` every step, seed
   000's loop with no cache. Both produce the same tokens (checked). tokens/s = N / wall time.

2. **Batch translation.** The 1000 German sentences of Multi30k's test set (test_2016_flickr) are
   translated with greedy decoding and beam 4 by attnmask and by Hugging Face ``generate`` on a
   ``MarianMTModel``, both holding the *same* weights: a Marian of the same dimensions (C=512, 6+6
   layers, 8 heads, FFN 2048, swish, post-norm, scaled embeddings) is initialized at random by
   Hugging Face and converted to attnmask with :func:`attnmask.pretrained.hf.transformer_from_hf`; the logits of both
   are compared first. The joint BPE vocabulary (8000) is trained on Multi30k's training set. Both
   decode the same length-sorted batches with the same limit (``--max-new`` tokens, no other
   constraint) and the generated tokens are counted (up to and including ``<eos>``). With random
   weights the outputs are not translations, and rows rarely stop before the limit. Batch invariance:
   the first batch's sentences are translated again one at a time (greedy, untimed) and compared
   token for token with their translation in the batch.

3. **Framework work per token** (``--part framework``). SmolLM2-135M's structure (30 layers, 9 query /
   3 key-value heads of 64, rotary, RMSNorm, SwiGLU, fused projections) at width 64, FFN 128 and a
   512-token vocabulary, random weights: the matrix products are negligible, so what a token costs is
   the framework (norms, rotary, cache writes, attention, sampling, the loop, Python). Rows: the
   packed step (:func:`attnmask.decode.step.packed_forward`) as one native call (``packed_step``,
   what Llama-style float32 and GGUF-block models run; encoder-decoders have ``seq2seq_step``), the
   same step operation by operation (what every other model runs: decoder-only models with post-norm,
   LayerNorm, or GELU without a gate), and one
   request through the serving :class:`attnmask.engine.Engine` (its scheduler and block tables around
   the one-call step). Reported as CPU time of the process per token (``time.process_time``; less
   sensitive to other jobs on a shared machine than wall time, which is given too), best of 3, 128
   tokens after a 5-token prompt minus 8 tokens. Both paths' tokens are compared.

Every part runs under :func:`attnmask.allocator.keep_freed_memory`, applied here because the script
owns its process (as the CLI's compute commands do; both peers alike; ``ATTNMASK_MALLOC=default``
leaves glibc's own policy), named in the header.

Run: ``python benchmarks/decode.py [--part cache|translate|framework|all] [--threads N]``.
Timings are wall clock on whatever machine runs it unless said otherwise; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import time
from pathlib import Path

import torch

from attnmask import allocator, decode, masks
from attnmask.decode import steps
from attnmask.decode.beam import beam_search
from attnmask.decode.step import fused_plan
from attnmask.model import ModelConfig, Transformer

REPO = Path(__file__).resolve().parents[1]


def data_dir() -> Path:
    return Path(os.environ.get("ATTNMASK_DATA", REPO.parent / "shared" / "data"))


# ---------------------------------------------------------------------------------------------
# 1. cache vs full recomputation
# ---------------------------------------------------------------------------------------------
@torch.inference_mode()
def recompute_greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """Seed 000's loop without a cache: the whole sequence through the decoder at every step."""
    ids = torch.tensor([prompt])  # (1, T)
    out = []
    for _ in range(n):
        logits = model.decode(ids, mask=masks.causal(), last_only=True)  # (1, 1, V)
        token = logits[:, -1].argmax(dim=-1, keepdim=True)  # (1, 1)
        out.append(int(token))
        ids = torch.cat([ids, token], dim=1)  # (1, T + 1)
    return out


def timed(fn, repeats: int):
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def bench_cache(lengths: list[int], recompute_max: int) -> list[str]:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=8192, arch="decoder", dim=512, n_layers=6, n_heads=8, ffn_dim=2048, max_seq_len=16 + max(lengths)
    )
    model = Transformer(cfg).eval()
    prompt = torch.randint(4, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    decode.greedy(model, prompts=[prompt], max_new_tokens=8, eos_id=None)  # warm-up
    rows = [
        f"decoder-only C={cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads, FFN {cfg.ffn_dim}, "
        f"V={cfg.vocab_size}, {model.num_parameters() / 1e6:.1f}M parameters; batch 1, 16-token prompt",
        "",
        "| new tokens | cached tok/s | recompute tok/s | speed-up | same tokens |",
        "|---:|---:|---:|---:|:---:|",
    ]
    print("\n".join(rows), flush=True)
    for n in lengths:
        t_cache, cached = timed(
            lambda n=n: decode.greedy(model, prompts=[prompt], max_new_tokens=n, eos_id=None)[0], 3 if n <= 256 else 1
        )
        if n <= recompute_max:
            t_full, full = timed(lambda n=n: recompute_greedy(model, prompt, n), 2 if n <= 64 else 1)
            row = f"| {n} | {n / t_cache:.1f} | {n / t_full:.1f} | {t_full / t_cache:.1f}x | {cached == full} |"
        else:
            row = f"| {n} | {n / t_cache:.1f} | (not run) | | |"
        print(row, flush=True)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# 2. batch translation: attnmask vs Hugging Face generate, same weights
# ---------------------------------------------------------------------------------------------
def build_models(vocab_size: int, max_len: int):
    from transformers import MarianConfig, MarianMTModel

    from attnmask.pretrained.hf import transformer_from_hf

    hf_cfg = MarianConfig(
        vocab_size=vocab_size,
        d_model=512,
        encoder_layers=6,
        decoder_layers=6,
        encoder_attention_heads=8,
        decoder_attention_heads=8,
        encoder_ffn_dim=2048,
        decoder_ffn_dim=2048,
        activation_function="swish",
        max_position_embeddings=max_len,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=1,  # attnmask's <sos>
        forced_eos_token_id=None,
    )
    torch.manual_seed(0)
    hf = MarianMTModel(hf_cfg).eval()
    ours = transformer_from_hf(hf.state_dict(), hf_cfg).eval()
    return hf, ours


@torch.inference_mode()
def check_same_function(hf, ours, src_ids: list[list[int]]) -> tuple[float, float]:
    """Max |logit difference| of the two models on teacher-forced inputs (padded sources), and the
    max |logit| for scale."""
    src, keep = decode.pad_batch(src_ids, 0, side="right")
    keep = torch.ones_like(src, dtype=torch.bool) if keep is None else keep
    tgt = torch.randint(4, hf.config.vocab_size, (src.shape[0], 12), generator=torch.Generator().manual_seed(2))
    tgt[:, 0] = 1
    theirs = hf(input_ids=src, attention_mask=keep.long(), decoder_input_ids=tgt).logits  # (B, T, V)
    memory = ours.encode(src, masks.padding(keep=keep))
    mine = ours.decode(tgt, memory, memory_mask=masks.padding(keep=keep), mask=masks.causal())  # (B, T, V)
    return float((theirs - mine).abs().max()), float(mine.abs().max())


def count_generated(rows: list[list[int]], limit: int, eos: int = 2) -> int:
    """Tokens produced: the kept ones plus the <eos> of rows that stopped before the limit."""
    return sum(len(r) + (1 if len(r) < limit else 0) for r in rows)


@torch.inference_mode()
def hf_translate(hf, batches, beam: int, max_new: int) -> list[list[int]]:
    out = []
    for src_ids in batches:
        src, keep = decode.pad_batch(src_ids, 0, side="right")
        keep = torch.ones_like(src, dtype=torch.bool) if keep is None else keep
        seqs = hf.generate(
            input_ids=src,
            attention_mask=keep.long(),
            num_beams=beam,
            do_sample=False,
            max_new_tokens=max_new,
            min_new_tokens=0,
            length_penalty=1.0,
            early_stopping=False,
            no_repeat_ngram_size=0,
            num_return_sequences=1,
            use_cache=True,
        )  # (b, 1 + steps): decoder start, tokens, <eos>, pads
        for row in seqs[:, 1:].tolist():
            out.append(row[: row.index(2)] if 2 in row else row)
    return out


@torch.inference_mode()
def ours_translate(model, batches, beam: int, max_new: int) -> list[list[int]]:
    out = []
    for src_ids in batches:
        if beam == 1:
            out += decode.greedy(model, src=src_ids, max_new_tokens=max_new)
        else:
            out += [r[0].tokens for r in beam_search(model, src=src_ids, beam_size=beam, max_new_tokens=max_new)]
    return out


def bench_translate(batch_size: int, max_new: int, n_sentences: int | None, beams: list[int]) -> list[str]:
    from attnmask.data import read_lines
    from attnmask.data.tokenizer import Tokenizer

    root = data_dir() / "multi30k"
    if not (root / "test_2016_flickr.de.gz").is_file():
        print(f"skipping translation: Multi30k not found under {root} (set ATTNMASK_DATA)")
        return []
    start = time.perf_counter()
    train = read_lines(root / "train.de.gz").lines + read_lines(root / "train.en.gz").lines
    tok = Tokenizer.train_bpe(train, vocab_size=8000)
    sentences = read_lines(root / "test_2016_flickr.de.gz").lines[:n_sentences]
    src_ids = decode.source_ids(tok, sentences)
    print(
        f"BPE {tok.vocab_size} trained in {time.perf_counter() - start:.0f} s; {len(sentences)} sentences", flush=True
    )
    hf, ours = build_models(tok.vocab_size, max_len=256)
    diff, scale = check_same_function(hf, ours, src_ids[:16])
    print(f"same weights: max |logits(HF) - logits(attnmask)| = {diff:.2e} (max |logit| {scale:.2f})", flush=True)
    order = sorted(range(len(src_ids)), key=lambda i: -len(src_ids[i]))
    batches = [[src_ids[i] for i in order[k : k + batch_size]] for k in range(0, len(order), batch_size)]
    n = len(src_ids)
    rows = [
        f"Marian-size encoder-decoder (C=512, 6+6 layers, 8 heads, FFN 2048, V={tok.vocab_size}, "
        f"{ours.num_parameters() / 1e6:.1f}M parameters), random weights shared by both (max |logit diff| "
        f"{diff:.1e}); {n} Multi30k test sentences (de), batches of {batch_size} sorted by length, at most "
        f"{max_new} new tokens",
        "",
        "| decoding | implementation | sentences/s | generated tokens/s | generated tokens | time (s) | "
        "same output as HF |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(rows), flush=True)
    solo = []
    for beam in beams:
        name = "greedy" if beam == 1 else f"beam {beam}"
        ours_translate(ours, batches[:1], beam, 4)  # warm-up
        hf_translate(hf, batches[:1], beam, 4)
        # interleaved batch by batch (alternating which goes first), so that the load of a shared
        # machine drifting over minutes falls on both alike
        results = {"attnmask": ([], 0.0), "HF generate": ([], 0.0)}
        for k, batch in enumerate(batches):
            impls = [("attnmask", ours_translate, ours), ("HF generate", hf_translate, hf)]
            for impl, fn, model in impls if k % 2 == 0 else impls[::-1]:
                t0 = time.perf_counter()
                out = fn(model, [batch], beam, max_new)
                dt = time.perf_counter() - t0
                results[impl] = (results[impl][0] + out, results[impl][1] + dt)
        same = sum(a == b for a, b in zip(results["attnmask"][0], results["HF generate"][0]))
        if beam == 1:  # batch invariance: the first batch's sentences translated alone, token for token
            alone = [ours_translate(ours, [[src]], 1, max_new)[0] for src in batches[0]]
            kept = sum(a == b for a, b in zip(alone, results["attnmask"][0]))
            solo.append(f"greedy: {kept}/{len(alone)} of the first batch's translations are the ones they get alone")
        t_hf = results["HF generate"][1]
        for impl, (out, dt) in results.items():
            tokens = count_generated(out, max_new)
            agree = f"{same}/{n}" if impl == "attnmask" else ""
            row = f"| {name} | {impl} | {n / dt:.1f} | {tokens / dt:.0f} | {tokens} | {dt:.1f} | {agree} |"
            print(row, flush=True)
            rows.append(row)
        rows.append(f"| {name} | speed-up | {t_hf / results['attnmask'][1]:.2f}x | | | | |")
        print(rows[-1], flush=True)
    for line in solo:
        print(line, flush=True)
    return rows + [""] + solo


# ---------------------------------------------------------------------------------------------
# 3. framework work per token
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def per_operation():
    """:func:`attnmask.decode.greedy` with the packed step taken operation by operation (the path of
    models the native ``packed_step`` does not make) instead of in one native call."""
    original = steps.fused_plan
    steps.fused_plan = lambda model: None
    try:
        yield
    finally:
        steps.fused_plan = original


def bench_framework() -> list[str]:
    from attnmask.engine import Engine, RequestParams
    from attnmask.model import fuse_projections_

    cfg = ModelConfig(
        vocab_size=512, arch="decoder", dim=64, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, ffn_dim=128,
        max_seq_len=2048, positions="rotary", norm="rmsnorm", activation="swiglu", bias=False, pad_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = fuse_projections_(Transformer(cfg).eval())
    prompt = [5, 6, 7, 8, 9]
    fused = fused_plan(model) is not None

    def greedy(n):
        decode.greedy(model, prompts=[prompt], max_new_tokens=n, eos_id=None)

    def greedy_per_operation(n):
        with per_operation():
            greedy(n)

    def engine(n):
        Engine(model, num_blocks=2 + (len(prompt) + n) // 16, block_size=16).generate(
            [prompt], RequestParams(max_tokens=n, ignore_eos=True)
        )

    variants = {
        "decode.greedy, the packed step in one native call (packed_step)": greedy,
        "decode.greedy, the packed step operation by operation": greedy_per_operation,
        "Engine, one request (scheduler, block tables, the packed step)": engine,
    }
    if not fused:
        print("# the native kernels are not built here: every row runs the packed step operation by operation")

    title = (
        "SmolLM2-135M's structure at width 64 (30 layers, 9/3 heads of 64, rotary, RMSNorm, SwiGLU, fused "
        "projections), batch 1, greedy; per token = (128 tokens - 8 tokens) / 120, best of 3"
    )
    rows = framework_table(title, variants)
    with per_operation():
        slow = decode.greedy(model, prompts=[prompt], max_new_tokens=32, eos_id=None)
    same = slow == decode.greedy(model, prompts=[prompt], max_new_tokens=32, eos_id=None)
    print(f"# the two paths give the same 32 tokens: {same}", flush=True)
    return rows + [""] + bench_framework_seq2seq()


def framework_table(title: str, variants: dict) -> list[str]:
    """Time each ``variants[name](n)`` (n new tokens): CPU and wall ms per token, as a table under ``title``."""

    def run(fn, n):
        c, w = time.process_time(), time.perf_counter()
        fn(n)
        return time.process_time() - c, time.perf_counter() - w

    rows = [title, "", "| step | CPU ms per token | wall ms per token |", "|---|---:|---:|"]
    print("\n".join(rows), flush=True)
    for name, fn in variants.items():
        run(fn, 128)  # warm-up
        best = min(tuple((a - b) / 120 * 1e3 for a, b in zip(run(fn, 128), run(fn, 8))) for _ in range(3))
        rows.append(f"| {name} | {best[0]:.2f} | {best[1]:.2f} |")
        print(rows[-1], flush=True)
    return rows


def bench_framework_seq2seq() -> list[str]:
    """The same for an encoder-decoder's decoder: ``seq2seq_step`` against its operations from Python."""
    cfg = ModelConfig(
        vocab_size=512, arch="encoder_decoder", dim=64, n_layers=6, n_encoder_layers=6, n_heads=8, head_dim=64,
        ffn_dim=128, max_seq_len=2048, positions="rotary", norm="rmsnorm", activation="swiglu", bias=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    source = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 2]]

    def greedy(n):
        decode.greedy(model, src=source, max_new_tokens=n, eos_id=None)

    def greedy_per_operation(n):
        with per_operation():
            greedy(n)

    title = (
        "attnmask's translation model's structure at width 64 (encoder-decoder, 6 + 6 layers, 8 heads of 64, "
        "rotary, RMSNorm, SwiGLU), one 12-token source, greedy; per token as above"
    )
    rows = framework_table(
        title,
        {
            "decode.greedy, the decoder's step in one native call (seq2seq_step)": greedy,
            "decode.greedy, the decoder's step operation by operation": greedy_per_operation,
        },
    )
    with per_operation():
        slow = decode.greedy(model, src=source, max_new_tokens=32, eos_id=None)
    same = slow == decode.greedy(model, src=source, max_new_tokens=32, eos_id=None)
    print(f"# the two paths give the same 32 tokens: {same}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("cache", "translate", "framework", "all"), default="all")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--lengths", default="16,64,256,1024", help="new tokens for the cache benchmark")
    p.add_argument("--recompute-max", type=int, default=1024, help="skip recomputation above this many tokens")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-new", type=int, default=32, help="translation: most new tokens per sentence")
    p.add_argument("--sentences", type=int, default=None, help="translation: only the first N test sentences")
    p.add_argument("--beams", default="1,4")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    memory = allocator.keep_freed_memory()  # this script owns the process, as the CLI does; both peers alike
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, python {sys.version.split()[0]}; memory: {memory}",
        flush=True,
    )
    if args.part in ("cache", "all"):
        bench_cache([int(x) for x in args.lengths.split(",")], args.recompute_max)
    if args.part in ("translate", "all"):
        bench_translate(args.batch_size, args.max_new, args.sentences, [int(b) for b in args.beams.split(",")])
    if args.part in ("framework", "all"):
        bench_framework()
    return 0


if __name__ == "__main__":
    sys.exit(main())
