"""The packed step on CUDA (FlexAttention ``BlockMask`` over the paged cache) against Hugging Face.

Two random models built in ``transformers`` and converted to attnmask
(:func:`attnmask.pretrained.hf.transformer_from_hf_model`): a Llama (grouped-query heads) and a
Gemma 3 text model (five sliding-window layers of window 32, one global, q/k norms, two RoPE bases).
On the GPU, in float32:

1. logits: ragged prompts (longer than the window) packed in one step of
   :func:`attnmask.decode.step.packed_forward`, then continued in chunks of 7 tokens over a second
   cache, against Hugging Face's forward of each prompt alone (max |diff| / max |logit|);
2. greedy continuations through :class:`attnmask.engine.Engine` (continuous batching, all prompts at
   once) against ``transformers``' ``generate`` of each prompt alone;
3. batch invariance of the step as it runs on the GPU: each prompt's greedy tokens and last logits
   alone against the same prompt's in the batch (bitwise). On CUDA the products are cuBLAS's, whose
   reduction order may depend on the number of rows: the figure says what this path gives.

Run on a CUDA machine: ``python benchmarks/gpu_packed_step.py``. Nothing here is asserted.
"""

from __future__ import annotations

import torch

from attnmask.engine import Engine, PagedKVCache, RequestParams, packed_forward
from attnmask.pretrained.hf import transformer_from_hf_model


def models(device: str):
    import transformers as tf

    torch.manual_seed(0)
    llama = tf.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    gemma = tf.Gemma3TextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=1024,
        sliding_window=32, layer_types=["sliding_attention"] * 5 + ["full_attention"], pad_token_id=0,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
    )  # fmt: skip
    out = []
    for name, cfg, cls in (("llama", llama, tf.LlamaForCausalLM), ("gemma3", gemma, tf.Gemma3ForCausalLM)):
        hf = cls(cfg).eval()
        ours = transformer_from_hf_model(hf, dtype=torch.float32).eval()
        out.append((name, hf.to(device), ours.to(device)))
    return out


def packed_logits(model, prompts: list[torch.Tensor], chunk: int | None, device: str) -> list[torch.Tensor]:
    """Every position's logits of each prompt through the packed step: all prompts in one step (chunk
    None), else step after step of ``chunk`` tokens a prompt."""
    S = 16
    need = [-(-len(p) // S) for p in prompts]
    cache = PagedKVCache.for_model(model, num_blocks=1 + sum(need) + 2, block_size=S, by_window=False)
    tables = torch.zeros(len(prompts), max(need), dtype=torch.long)
    order = (torch.randperm(sum(need), generator=torch.Generator().manual_seed(1)) + 1).tolist()
    for s, n in enumerate(need):
        tables[s, :n] = torch.tensor(order[:n])
        order = order[n:]
    tables = tables.to(device)
    got = [[] for _ in prompts]
    step = chunk or max(len(p) for p in prompts)
    for start in range(0, max(len(p) for p in prompts), step):
        parts = [(s, range(start, min(start + step, len(p)))) for s, p in enumerate(prompts) if start < len(p)]
        tokens = torch.cat([prompts[s][list(r)] for s, r in parts])
        positions = torch.cat([torch.tensor(list(r)) for _, r in parts]).to(device)
        row_seq = torch.cat([torch.full((len(r),), s) for s, r in parts]).to(device)
        with torch.inference_mode():
            logits = packed_forward(
                model, cache, tokens, positions, row_seq, tables, torch.arange(len(tokens), device=device)
            )
        at = 0
        for s, r in parts:
            got[s].append(logits[at : at + len(r)])
            at += len(r)
    return [torch.cat(g) for g in got]


def main() -> None:
    import transformers as tf

    device = "cuda" if torch.cuda.is_available() else "cpu"
    name_of = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"# {name_of}, torch {torch.__version__}, transformers {tf.__version__}; float32")
    g = torch.Generator().manual_seed(0)
    lengths = [5, 40, 77, 120, 13, 64, 99, 31]
    for name, hf, ours in models(device):
        prompts = [torch.randint(1, 512, (n,), generator=g).to(device) for n in lengths]
        with torch.no_grad():
            want = [hf(p[None]).logits[0].float() for p in prompts]
        scale = max(w.abs().max() for w in want)
        for chunk in (None, 7):
            got = packed_logits(ours, prompts, chunk, device)
            diff = max((a - b).abs().max() for a, b in zip(got, want)) / scale
            how = "one step" if chunk is None else f"chunks of {chunk}"
            print(f"{name:7} packed step ({how:12}) logits vs HF forward: max |diff| / max |logit| = {diff:.2e}")
        new = 24
        with torch.no_grad():
            theirs = [hf.generate(p[None], max_new_tokens=new, do_sample=False)[0, len(p) :].tolist() for p in prompts]
        params = RequestParams(max_tokens=new, ignore_eos=True)
        batch = Engine(ours, kv_cache_mib=16, max_batch_tokens=64).generate([p.tolist() for p in prompts], params)
        alone = [Engine(ours, kv_cache_mib=16, max_batch_tokens=64).generate([p.tolist()], params)[0] for p in prompts]
        same_hf = sum(c.tokens == t for c, t in zip(batch, theirs))
        same_alone = sum(a.tokens == b.tokens for a, b in zip(alone, batch))
        print(f"{name:7} engine greedy ({len(prompts)} prompts at once, {new} tokens): = HF generate {same_hf}/"
              f"{len(prompts)}; = the prompt alone {same_alone}/{len(prompts)}")  # fmt: skip
        params = RequestParams(max_tokens=new, ignore_eos=True, logprobs=True)
        batch = Engine(ours, kv_cache_mib=16, max_batch_tokens=64).generate([p.tolist() for p in prompts], params)
        alone = [Engine(ours, kv_cache_mib=16, max_batch_tokens=64).generate([p.tolist()], params)[0] for p in prompts]
        bitwise = sum(a.logprobs == b.logprobs for a, b in zip(alone, batch))
        print(f"{name:7} engine log-probabilities alone = in the batch, bit for bit: {bitwise}/{len(prompts)}")


if __name__ == "__main__":
    main()
