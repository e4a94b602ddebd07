"""Gemma 3 (text) between Hugging Face's ``Gemma3ForCausalLM`` and attnmask's :class:`~attnmask.model.Transformer`.

Gemma 3 in attnmask's config: ``post_norms`` (each sublayer's output normed before the residual
add), ``qk_norm``, ``embed_scale`` (``sqrt(C)``), ``activation="geglu_tanh"``, sliding-window layers
(``layer_types``, ``sliding_window``) with their own rotary base (``rope_local_theta``).

One difference of spelling: Gemma's RMSNorm scales by ``1 + weight`` (its weights are stored
around 0), attnmask's :class:`~attnmask.model.RMSNorm` by ``weight``; the weights are shifted by 1
each way (llama.cpp's converter does the same, so a GGUF file holds attnmask's spelling).

- :func:`config_from_gemma3` / :func:`state_dict_from_gemma3`: a Hugging Face Gemma 3 into attnmask
  (what :mod:`attnmask.pretrained.hf` calls for ``model_type="gemma3_text"``);
- :func:`gemma3_hf_config` / :func:`hf_gemma3_from_attnmask`: the other way, e.g. to compare
  attnmask's Gemma 3 from a GGUF file with Hugging Face's code on the same weights.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from attnmask.errors import UserError
from attnmask.model import ModelConfig

__all__ = [
    "config_from_gemma3",
    "state_dict_from_gemma3",
    "gemma3_key_map",
    "gemma3_hf_config",
    "hf_gemma3_from_attnmask",
]

_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}
# attnmask norm -> Hugging Face norm, per layer; each scales by (1 + weight) in Hugging Face
_NORMS = {
    "self_norm": "input_layernorm",
    "post_self_norm": "post_attention_layernorm",
    "mlp_norm": "pre_feedforward_layernorm",
    "post_mlp_norm": "post_feedforward_layernorm",
    "self_attn.q_norm": "self_attn.q_norm",
    "self_attn.k_norm": "self_attn.k_norm",
}


def _rope_theta(c: dict, layer_type: str, default: float) -> tuple[float, dict | None]:
    params = dict((c.get("rope_parameters") or {}).get(layer_type) or {})
    theta = float(params.pop("rope_theta", default))
    kind = params.get("rope_type", "default")
    if kind == "default":
        return theta, None
    if kind != "linear" or layer_type != "full_attention":
        raise UserError(
            f"Gemma 3 rope {kind!r} on {layer_type} layers is not supported; expected 'default' "
            "(or 'linear' on full layers)"
        )
    return theta, {"rope_type": "linear", "factor": float(params["factor"])}


def config_from_gemma3(c: dict, **overrides) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face Gemma 3 text config (``config.to_dict()``).

    Raises:
        ValueError: softcapping, a query scale other than ``head_dim^-1/2``, bidirectional
            attention, or an activation other than tanh-GELU.
    """
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if c.get(key) is not None:
            raise UserError(f"Gemma 3 with {key}={c[key]} is not supported; expected None")
    if c.get("query_pre_attn_scalar", head_dim) != head_dim:
        raise UserError(
            f"Gemma 3 with query_pre_attn_scalar={c['query_pre_attn_scalar']} != head_dim={head_dim} is not supported "
            "(attnmask scales queries by head_dim^-1/2)"
        )
    if c.get("use_bidirectional_attention"):
        raise UserError("Gemma 3 with use_bidirectional_attention=True is not supported; expected False")
    if c.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_new"):
        raise UserError(f"Gemma 3 hidden_activation={c.get('hidden_activation')!r}; expected 'gelu_pytorch_tanh'")
    if c.get("attention_bias", False):
        raise UserError("Gemma 3 with attention_bias=True is not supported; expected False")
    n_layers = c["num_hidden_layers"]
    types = tuple(_LAYER_TYPES[t] for t in (c.get("layer_types") or ["full_attention"] * n_layers))
    theta, scaling = _rope_theta(c, "full_attention", 1_000_000.0)
    local_theta, _ = _rope_theta(c, "sliding_attention", 10_000.0)
    cfg = dict(
        arch="decoder",
        vocab_size=c["vocab_size"],
        dim=c["hidden_size"],
        n_layers=n_layers,
        n_heads=c["num_attention_heads"],
        n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        head_dim=head_dim,
        ffn_dim=c["intermediate_size"],
        max_seq_len=c.get("max_position_embeddings", 32768),
        positions="rotary",
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
        norm="rmsnorm",
        norm_eps=c.get("rms_norm_eps", 1e-6),
        norm_position="pre",
        post_norms=True,
        qk_norm=True,
        embed_scale=True,
        activation="geglu_tanh",
        bias=False,
        tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        pad_id=None,
        sliding_window=int(c.get("sliding_window") or 0) if "sliding" in types else 0,
        layer_types=types,
        extra={"source": "huggingface:gemma3_text"},
    )
    cfg.update(overrides)
    return ModelConfig(**cfg)


def gemma3_key_map(cfg: ModelConfig) -> dict[str, str]:
    """attnmask parameter name -> Hugging Face ``Gemma3ForCausalLM`` name."""
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"):
            names[f"{ours}{proj}.weight"] = f"{theirs}{proj}.weight"
        for proj in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            names[f"{ours}{proj}.weight"] = f"{theirs}{proj}.weight"
        for norm, hf in _NORMS.items():
            names[f"{ours}{norm}.weight"] = f"{theirs}{hf}.weight"
    return names


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def state_dict_from_gemma3(state_dict: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """A Hugging Face Gemma 3 ``state_dict`` in attnmask's names (norm weights shifted by +1)."""
    out = {}
    for ours, theirs in gemma3_key_map(cfg).items():
        if theirs not in state_dict:
            raise UserError(f"Gemma 3 state_dict lacks {theirs!r} (has {len(state_dict)} keys)")
        w = state_dict[theirs]
        out[ours] = w + 1 if _is_norm(ours) else w
    return out


def gemma3_hf_config(cfg: ModelConfig, **overrides):
    """A ``transformers.Gemma3TextConfig`` computing the same function as the Gemma 3 ``cfg``."""
    import transformers

    if not (cfg.post_norms and cfg.qk_norm and cfg.embed_scale and cfg.activation == "geglu_tanh"):
        raise UserError(f"not a Gemma 3 config (post_norms, qk_norm, embed_scale, activation='geglu_tanh'): {cfg}")
    types = cfg.layer_types or tuple("sliding" if cfg.sliding_window else "full" for _ in range(cfg.n_layers))
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        full = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        query_pre_attn_scalar=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        sliding_window=cfg.sliding_window or cfg.max_seq_len,
        layer_types=[f"{'sliding' if t == 'sliding' else 'full'}_attention" for t in types],
        rope_parameters={"full_attention": full, "sliding_attention": local},
        tie_word_embeddings=cfg.tie_embeddings,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    kwargs.update(overrides)
    return transformers.Gemma3TextConfig(**kwargs)


def hf_gemma3_from_attnmask(cfg: ModelConfig, state_dict: Mapping[str, Tensor], **config_overrides):
    """A ``transformers.Gemma3ForCausalLM`` holding attnmask Gemma 3 weights (``state_dict`` with unfused
    projections: ``load(..., fuse=False)`` or a GGUF checkpoint's), float32, in eval mode."""
    import torch
    import transformers

    hf_cfg = gemma3_hf_config(cfg, **config_overrides)
    with torch.device("meta"):
        model = transformers.Gemma3ForCausalLM(hf_cfg)
    weights = {}
    for ours, theirs in gemma3_key_map(cfg).items():
        if ours not in state_dict:
            raise UserError(f"attnmask Gemma 3 state_dict lacks {ours!r} (fused projections? load with fuse=False)")
        w = state_dict[ours].float()
        weights[theirs] = (w - 1 if _is_norm(ours) else w).contiguous()
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise UserError(f"weights do not fit Gemma3ForCausalLM: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if cfg.tie_embeddings:
        model.tie_weights()
    # buffers created on the meta device (rotary frequencies, the embedding scale) are computed again
    for module in model.modules():
        if type(module).__name__ == "Gemma3RotaryEmbedding":
            fresh = type(module)(hf_cfg, device="cpu")
            for buf, value in fresh.named_buffers(recurse=False):
                module.register_buffer(buf, value, persistent=False)
        elif type(module).__name__ == "Gemma3TextScaledWordEmbedding":
            module.register_buffer("embed_scale", torch.tensor(cfg.dim**0.5), persistent=False)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise UserError(f"Gemma3ForCausalLM tensors left uninitialised: {left[:5]}")
    return model.float().eval()
