"""Gemma 3's per-layer masks on CUDA through FlexAttention: attnmask's logits against Hugging Face's.

A Gemma 3 text model with random weights (a 270M-like layer pattern shrunk: 6 layers, five sliding of
window ``W`` and one full, grouped-query heads, q/k norms, post norms, two RoPE bases) is built in
``transformers``, converted to attnmask (:func:`attnmask.pretrained.hf.transformer_from_hf_model`) and
both run on the GPU on prompts longer than the window, in float32 and bfloat16. attnmask runs its
``flex`` backend (a ``BlockMask`` per layer type from ``causal() & sliding_window(W)`` / ``causal()``)
and its ``auto`` route; Hugging Face runs SDPA (its default). Printed: the largest relative
difference of the logits per setting. Run on a CUDA machine: ``python benchmarks/gpu_gemma3_flex.py``.
Nothing here is asserted.
"""

from __future__ import annotations

import torch

from attnmask.pretrained.hf import transformer_from_hf_model


def main() -> None:
    import transformers as tf

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.manual_seed(0)
    W = 64
    cfg = tf.Gemma3TextConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64, max_position_embeddings=2048,
        sliding_window=W, layer_types=["sliding_attention"] * 5 + ["full_attention"], pad_token_id=0,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
    )  # fmt: skip
    hf = tf.Gemma3ForCausalLM(cfg).eval()
    ours = transformer_from_hf_model(hf, dtype=torch.float32).eval()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {tf.__version__}")
    print(f"# windows per layer: {[ours.config.layer_window(i) for i in range(ours.config.n_layers)]}")
    hf32 = hf.to("cuda")
    refs = {}
    for T in (200, 700):
        ids = torch.randint(1, cfg.vocab_size, (2, T), device="cuda", generator=torch.Generator("cuda").manual_seed(T))
        with torch.no_grad():
            refs[T] = ids, hf32(ids).logits.float()
    for dtype in (torch.float32, torch.bfloat16):
        hf_d = tf.Gemma3ForCausalLM(cfg).eval()
        hf_d.load_state_dict(hf32.state_dict())
        hf_d = hf_d.to("cuda", dtype)
        ours_d = ours.to("cuda", dtype)
        for T, (ids, ref) in refs.items():
            with torch.no_grad():
                theirs = hf_d(ids).logits.float()
                rel = ((theirs - ref).abs().max() / ref.abs().max()).item()
                print(f"{str(dtype):15} T={T:4} Hugging Face sdpa: max |diff| / max |float32 HF| = {rel:.2e}")
                for backend in ("flex", "auto"):
                    for m in ours_d.modules():
                        if hasattr(m, "backend"):
                            m.backend = backend
                    got = ours_d(ids).logits.float()
                    rel = ((got - ref).abs().max() / ref.abs().max()).item()
                    same = (got.argmax(-1) == theirs.argmax(-1)).float().mean().item()
                    print(
                        f"{str(dtype):15} T={T:4} attnmask {backend:5}: max |diff| / max |float32 HF| = {rel:.2e}, "
                        f"argmax = Hugging Face's at {same:.1%} of positions"
                    )


if __name__ == "__main__":
    main()
