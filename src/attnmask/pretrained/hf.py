"""Import Hugging Face checkpoints into attnmask's own :class:`~attnmask.model.Transformer`.

Four families, each a config translation plus a rename of ``state_dict`` keys (no fork of the
model code):

- **Llama** (``model_type="llama"``: Llama 1-3, SmolLM, TinyLlama, ...): rotary positions, RMSNorm,
  SwiGLU, grouped-query attention, optionally tied embeddings and Llama 3.1 rope scaling;
- **GPT-2**: learned positions, pre-LayerNorm, tanh-GELU; its ``Conv1D`` weights are stored
  transposed (``(in, out)``) and the query/key/value projections fused in one ``c_attn``;
- **Marian** (encoder-decoder, the OPUS-MT translation models): sinusoidal positions, post-norm,
  embeddings scaled by ``sqrt(C)``, a bias on the logits (``final_logits_bias``);
- **Gemma 3** text (``model_type="gemma3_text"``, :mod:`attnmask.pretrained.gemma3`): sliding-window
  and full layers, q/k norms, pre- and post-norms, tanh-GeGLU.

``hf_config`` may be a ``transformers`` config object or the plain dict of a ``config.json``, so
importing needs no ``transformers`` install; :func:`load_hf_dir` reads a checkpoint directory.

Masks. Llama and GPT-2 have no padding token (every id is a real token), so their configs get
``pad_id=None``: pass padding to ``decode(..., mask=...)`` explicitly. Marian's decoder starts from
its pad token, so teacher-forced calls on a converted Marian model should pass
``mask=masks.causal()`` (plus explicit target padding) rather than rely on ``target_mask(ids)``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from attnmask.errors import UserError, UserTypeError
from attnmask.model import ModelConfig, Transformer, sinusoidal_table
from attnmask.pretrained.gemma3 import config_from_gemma3, state_dict_from_gemma3

__all__ = [
    "SUPPORTED",
    "config_from_hf",
    "state_dict_from_hf",
    "transformer_from_hf",
    "transformer_from_hf_model",
    "load_hf_dir",
    "llama_key_map",
]

SUPPORTED = ("llama", "gpt2", "marian", "gemma3_text")

# Hugging Face activation names -> ModelConfig.activation (gated MLPs map to "swiglu" separately)
_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


def _as_dict(hf_config) -> dict:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise UserTypeError(
        f"hf_config must be a transformers config or a config.json dict, got {type(hf_config).__name__}"
    )


def _model_type(c: dict) -> str:
    kind = c.get("model_type")
    if kind not in SUPPORTED:
        raise UserError(f"cannot import a Hugging Face model of type {kind!r}; expected one of {SUPPORTED}")
    return kind


def _activation(name: str, model: str) -> str:
    if name not in _ACTIVATIONS:
        raise UserError(f"{model} activation {name!r} is not supported; expected one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _rope(c: dict) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` from transformers 5's ``rope_parameters`` or the older keys."""
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = params.pop("rope_theta", c.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind not in ("linear", "llama3"):
        raise UserError(f"Llama rope scaling {kind!r} is not supported; expected 'default', 'linear' or 'llama3'")
    params["rope_type"] = kind
    params.pop("type", None)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UserError(f"partial rotary embeddings are not supported (partial_rotary_factor={params})")
    return float(theta), params


def config_from_hf(hf_config, **overrides) -> ModelConfig:
    """The :class:`ModelConfig` computing the same function as a Hugging Face Llama/GPT-2/Marian config.

    ``overrides`` replace fields afterwards (e.g. ``attn_backend``, ``max_seq_len``).

    Raises:
        ValueError: an unsupported model type or option (naming it and what is supported).
    """
    c = _as_dict(hf_config)
    kind = _model_type(c)
    if kind == "gemma3_text":
        return config_from_gemma3(c, **overrides)
    if kind == "llama":
        if c.get("attention_bias", False) != c.get("mlp_bias", False):
            raise UserError(
                f"Llama with attention_bias={c.get('attention_bias')} but mlp_bias={c.get('mlp_bias')}: attnmask has "
                "one bias switch for all linear layers; expected both equal"
            )
        if c.get("hidden_act", "silu") != "silu":
            raise UserError(f"Llama hidden_act={c.get('hidden_act')!r} is not supported; expected 'silu' (SwiGLU)")
        theta, scaling = _rope(c)
        cfg = dict(
            arch="decoder",
            vocab_size=c["vocab_size"],
            dim=c["hidden_size"],
            n_layers=c["num_hidden_layers"],
            n_heads=c["num_attention_heads"],
            n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            head_dim=c.get("head_dim"),
            ffn_dim=c["intermediate_size"],
            max_seq_len=c.get("max_position_embeddings", 2048),
            positions="rotary",
            rope_theta=theta,
            rope_scaling=scaling,
            norm="rmsnorm",
            norm_eps=c.get("rms_norm_eps", 1e-6),
            norm_position="pre",
            activation="swiglu",
            bias=bool(c.get("attention_bias", False)),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            pad_id=None,
        )
    elif kind == "gpt2":
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if c.get(flag):
                raise UserError(f"GPT-2 with {flag}=True is not supported; expected False")
        if c.get("scale_attn_weights", True) is False:
            raise UserError("GPT-2 with scale_attn_weights=False is not supported; expected True (1/sqrt(D))")
        cfg = dict(
            arch="decoder",
            vocab_size=c["vocab_size"],
            dim=c["n_embd"],
            n_layers=c["n_layer"],
            n_heads=c["n_head"],
            ffn_dim=c.get("n_inner") or 4 * c["n_embd"],
            max_seq_len=c["n_positions"],
            positions="learned",
            norm="layernorm",
            norm_eps=c.get("layer_norm_epsilon", 1e-5),
            norm_position="pre",
            activation=_activation(c.get("activation_function", "gelu_new"), "GPT-2"),
            bias=True,
            tie_embeddings=bool(c.get("tie_word_embeddings", True)),
            pad_id=None,
        )
    else:  # marian
        for enc, dec in (
            ("encoder_attention_heads", "decoder_attention_heads"),
            ("encoder_ffn_dim", "decoder_ffn_dim"),
        ):
            if c[enc] != c[dec]:
                raise UserError(f"Marian with {enc}={c[enc]} != {dec}={c[dec]}: attnmask expects them equal")
        shared = c.get("share_encoder_decoder_embeddings", True)
        dec_vocab = c.get("decoder_vocab_size") or c["vocab_size"]
        if not shared and dec_vocab == c["vocab_size"]:
            raise UserError(
                "Marian with separate source/target embeddings of equal size is not supported: attnmask shares "
                "equal-size vocabularies; expected share_encoder_decoder_embeddings=True or different sizes"
            )
        cfg = dict(
            arch="encoder_decoder",
            vocab_size=dec_vocab,
            src_vocab_size=None if shared else c["vocab_size"],
            dim=c["d_model"],
            n_layers=c["decoder_layers"],
            n_encoder_layers=c["encoder_layers"],
            n_heads=c["encoder_attention_heads"],
            ffn_dim=c["encoder_ffn_dim"],
            max_seq_len=c["max_position_embeddings"],
            positions="sinusoidal",
            norm="layernorm",
            norm_eps=1e-5,  # Marian's nn.LayerNorm default
            norm_position="post",
            final_norm=False,
            activation=_activation(c.get("activation_function", "swish"), "Marian"),
            bias=True,
            tie_embeddings=bool(c.get("tie_word_embeddings", True)),
            embed_scale=bool(c.get("scale_embedding", False)),
            lm_head_bias=True,
            pad_id=c["pad_token_id"],
        )
    cfg["extra"] = {"source": f"huggingface:{kind}"}
    cfg.update(overrides)
    return ModelConfig(**cfg)


# ---------------------------------------------------------------------------------------------
# state_dict renaming
# ---------------------------------------------------------------------------------------------
def llama_key_map(cfg: ModelConfig) -> dict[str, str]:
    """attnmask parameter name -> Hugging Face ``LlamaForCausalLM`` name, for a Llama ``cfg``
    (exporting weights the other way is ``{theirs: sd[ours] for ours, theirs in map.items()}``)."""
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    params = ("weight", "bias") if cfg.bias else ("weight",)
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            for p in params:
                names[f"{ours}self_attn.{proj}.{p}"] = f"{theirs}self_attn.{proj}.{p}"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for p in params:
                names[f"{ours}mlp.{proj}.{p}"] = f"{theirs}mlp.{proj}.{p}"
        names[f"{ours}self_norm.weight"] = f"{theirs}input_layernorm.weight"
        names[f"{ours}mlp_norm.weight"] = f"{theirs}post_attention_layernorm.weight"
    return names


def _take(sd: Mapping[str, Tensor], key: str, model: str) -> Tensor:
    if key not in sd:
        raise UserError(f"{model} state_dict lacks {key!r} (has {len(sd)} keys, e.g. {sorted(sd)[:3]})")
    return sd[key]


def _convert_gpt2(sd: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    # GPT2LMHeadModel keys start with "transformer."; a bare GPT2Model's do not
    pre = "transformer." if any(k.startswith("transformer.") for k in sd) else ""
    C = cfg.dim
    out = {
        "embed.weight": _take(sd, f"{pre}wte.weight", "GPT-2"),
        "pos_embed.weight": _take(sd, f"{pre}wpe.weight", "GPT-2"),
        "norm.weight": _take(sd, f"{pre}ln_f.weight", "GPT-2"),
        "norm.bias": _take(sd, f"{pre}ln_f.bias", "GPT-2"),
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = _take(sd, "lm_head.weight", "GPT-2")
    for i in range(cfg.n_layers):
        h, ours = f"{pre}h.{i}.", f"layers.{i}."
        # Conv1D stores (in, out): transpose to nn.Linear's (out, in); c_attn is [q | k | v] on out
        qkv_w = _take(sd, f"{h}attn.c_attn.weight", "GPT-2").t()  # (3C, C)
        qkv_b = _take(sd, f"{h}attn.c_attn.bias", "GPT-2")  # (3C,)
        for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{ours}self_attn.{proj}.weight"] = qkv_w[j * C : (j + 1) * C]  # (C, C)
            out[f"{ours}self_attn.{proj}.bias"] = qkv_b[j * C : (j + 1) * C]  # (C,)
        out[f"{ours}self_attn.o_proj.weight"] = _take(sd, f"{h}attn.c_proj.weight", "GPT-2").t()  # (C, C)
        out[f"{ours}self_attn.o_proj.bias"] = _take(sd, f"{h}attn.c_proj.bias", "GPT-2")
        out[f"{ours}mlp.up_proj.weight"] = _take(sd, f"{h}mlp.c_fc.weight", "GPT-2").t()  # (F, C)
        out[f"{ours}mlp.up_proj.bias"] = _take(sd, f"{h}mlp.c_fc.bias", "GPT-2")
        out[f"{ours}mlp.down_proj.weight"] = _take(sd, f"{h}mlp.c_proj.weight", "GPT-2").t()  # (C, F)
        out[f"{ours}mlp.down_proj.bias"] = _take(sd, f"{h}mlp.c_proj.bias", "GPT-2")
        for norm, theirs in (("self_norm", "ln_1"), ("mlp_norm", "ln_2")):
            for p in ("weight", "bias"):
                out[f"{ours}{norm}.{p}"] = _take(sd, f"{h}{theirs}.{p}", "GPT-2")
    return out


def _convert_marian(sd: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    def attn(ours: str, theirs: str) -> dict[str, Tensor]:
        d = {}
        for proj, hf in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("o_proj", "out_proj")):
            for p in ("weight", "bias"):
                d[f"{ours}.{proj}.{p}"] = _take(sd, f"{theirs}.{hf}.{p}", "Marian")
        return d

    def norm(ours: str, theirs: str) -> dict[str, Tensor]:
        return {f"{ours}.{p}": _take(sd, f"{theirs}.{p}", "Marian") for p in ("weight", "bias")}

    def mlp(ours: str, theirs: str) -> dict[str, Tensor]:
        d = {}
        for proj, hf in (("up_proj", "fc1"), ("down_proj", "fc2")):
            for p in ("weight", "bias"):
                d[f"{ours}.{proj}.{p}"] = _take(sd, f"{theirs}.{hf}.{p}", "Marian")
        return d

    out = {"embed.weight": _take(sd, "model.decoder.embed_tokens.weight", "Marian")}
    if cfg.src_vocab_size is not None:
        out["src_embed.weight"] = _take(sd, "model.encoder.embed_tokens.weight", "Marian")
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = _take(sd, "lm_head.weight", "Marian")
    out["lm_head.bias"] = _take(sd, "final_logits_bias", "Marian").reshape(-1)  # (1, V) -> (V,)
    for i in range(cfg.n_encoder_layers):
        ours, theirs = f"encoder_layers.{i}", f"model.encoder.layers.{i}"
        out |= attn(f"{ours}.self_attn", f"{theirs}.self_attn")
        out |= norm(f"{ours}.self_norm", f"{theirs}.self_attn_layer_norm")
        out |= mlp(f"{ours}.mlp", theirs)
        out |= norm(f"{ours}.mlp_norm", f"{theirs}.final_layer_norm")
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"model.decoder.layers.{i}"
        out |= attn(f"{ours}.self_attn", f"{theirs}.self_attn")
        out |= norm(f"{ours}.self_norm", f"{theirs}.self_attn_layer_norm")
        out |= attn(f"{ours}.cross_attn", f"{theirs}.encoder_attn")
        out |= norm(f"{ours}.cross_norm", f"{theirs}.encoder_attn_layer_norm")
        out |= mlp(f"{ours}.mlp", theirs)
        out |= norm(f"{ours}.mlp_norm", f"{theirs}.final_layer_norm")
    # Marian's positions are a fixed sinusoid: check it is the one attnmask computes
    for side in ("encoder", "decoder"):
        key = f"model.{side}.embed_positions.weight"
        if key in sd:
            ours_table = sinusoidal_table(cfg.max_seq_len, cfg.dim)  # (max_seq_len, C)
            if sd[key].shape != ours_table.shape or not torch.allclose(sd[key].float(), ours_table, atol=1e-5):
                raise UserError(f"Marian {key} is not the sinusoidal table attnmask computes (sin | cos halves)")
    return out


def state_dict_from_hf(state_dict: Mapping[str, Tensor], hf_config) -> dict[str, Tensor]:
    """Rename (and for GPT-2 transpose/split) a Hugging Face ``state_dict`` to attnmask's names.

    Raises:
        ValueError: a key the architecture needs is missing, or the model type is unsupported.
    """
    cfg = config_from_hf(hf_config)
    kind = _model_type(_as_dict(hf_config))
    if kind == "llama":
        return {ours: _take(state_dict, theirs, "Llama") for ours, theirs in llama_key_map(cfg).items()}
    if kind == "gpt2":
        return _convert_gpt2(state_dict, cfg)
    if kind == "gemma3_text":
        return state_dict_from_gemma3(state_dict, cfg)
    return _convert_marian(state_dict, cfg)


def transformer_from_hf(
    state_dict: Mapping[str, Tensor], hf_config, *, dtype: torch.dtype | None = None, **overrides
) -> Transformer:
    """An attnmask :class:`Transformer` holding a Hugging Face checkpoint's weights, in eval mode.

    ``state_dict`` is what ``hf_model.state_dict()`` returns (or a loaded safetensors file);
    ``hf_config`` a transformers config or a ``config.json`` dict; ``overrides`` go to
    :func:`config_from_hf`. ``dtype`` defaults to the checkpoint's.
    """
    cfg = config_from_hf(hf_config, **overrides)
    weights = state_dict_from_hf(state_dict, hf_config)
    model = Transformer(cfg)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # tied weights appear under both names in our state_dict but are given once
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if cfg.arch == "encoder_decoder" and cfg.src_vocab_size is None:
        missing = [k for k in missing if k != "src_embed.weight"]
    if missing or unexpected:
        raise UserError(f"converted state_dict does not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if dtype is None:  # keep the checkpoint's precision (float32 parameters hold bfloat16 values exactly)
        dtype = next((t.dtype for t in weights.values() if t.is_floating_point()), torch.float32)
    return model.to(dtype).eval()


def transformer_from_hf_model(hf_model, **kwargs) -> Transformer:
    """:func:`transformer_from_hf` of a loaded ``transformers`` model (``GPT2LMHeadModel``, ``LlamaForCausalLM``,
    ``MarianMTModel``)."""
    return transformer_from_hf(hf_model.state_dict(), hf_model.config, **kwargs)


def load_hf_dir(path: str | Path, **kwargs) -> Transformer:
    """:func:`transformer_from_hf` of a checkpoint directory: ``config.json`` and ``model.safetensors`` (possibly
    sharded with ``model.safetensors.index.json``) or ``pytorch_model.bin``. Needs no ``transformers``.

    Raises:
        FileNotFoundError: ``config.json`` or the weights are missing.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: expected a Hugging Face checkpoint directory")
    hf_config = json.loads(config_file.read_text(encoding="utf-8"))
    return transformer_from_hf(_read_weights(path), hf_config, **kwargs)


def _read_weights(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    if (path / "model.safetensors").is_file():
        return load_file(path / "model.safetensors")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        sd: dict[str, Tensor] = {}
        for shard in shards:
            sd |= load_file(path / shard)
        return sd
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(
        f"no weights in {path}: expected model.safetensors, model.safetensors.index.json or pytorch_model.bin"
    )
