"""The models :func:`~attnmask.audit.conform.runner.conform` checks, and what it checks them against.

- :func:`load_model`: a Hugging Face model from a tiny random config (:data:`TINY_CONFIGS`), a
  local checkpoint directory, or a GGUF file (a registered name such as ``smollm2`` or ``gemma3``, or
  a path), read by attnmask's own GGUF loader and handed to ``transformers.LlamaForCausalLM`` (or
  ``Gemma3ForCausalLM``). Never downloads.
- :func:`implementations`: the attention implementations transformers' ``AttentionInterface``
  knows (``eager`` plus every registered one, user-registered ones included) that the model
  accepts; the others with the reason.
- :func:`reference_model`: attnmask's float64 :class:`~attnmask.model.Transformer` with the same
  weights, where attnmask can build the architecture (Llama, Mistral as Llama with a sliding
  window, GPT-2, Marian, Gemma 3 with its per-layer windows); None and the reason otherwise.
- :func:`reach`: how far back a sliding-window model's output can depend on its input.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from attnmask.audit.layers import hf_layer_windows
from attnmask.errors import UserError

__all__ = ["TINY_CONFIGS", "load_model", "implementations", "set_implementation", "reference_model", "reach"]

# implementations the AttentionInterface lists that need something a forward pass cannot give them
_NOT_A_FORWARD = {"paged|eager": "needs a paged cache (continuous batching), not a plain forward"}
_WIDTH = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise UserError("conformance needs the transformers package: pip install 'attnmask[hf]'") from e
    return transformers


def _llama(tf):
    return tf.LlamaConfig(vocab_size=128, **_WIDTH, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)


def _mistral(tf):
    # window 4 over 2 layers: an output reaches 2 * (4 - 1) = 6 tokens back, inside the audited length
    return tf.MistralConfig(
        vocab_size=128, **_WIDTH, num_key_value_heads=2, max_position_embeddings=64, sliding_window=4, pad_token_id=0
    )


def _qwen2(tf):
    # layer 0 full attention, layer 1 a window of 4 (max_window_layers=1): a mixed stack
    return tf.Qwen2Config(
        vocab_size=128,
        **_WIDTH,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        pad_token_id=0,
    )


def _gemma3(tf):
    # sliding (window 4), full, sliding: the layer-reach scenario sees both layer types
    return tf.Gemma3TextConfig(
        vocab_size=128,
        **_WIDTH | {"num_hidden_layers": 3},
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=64,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        pad_token_id=0,
    )


def _gpt2(tf):
    return tf.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )


def _marian(tf):
    return tf.MarianConfig(
        vocab_size=128,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
        pad_token_id=0,
        decoder_start_token_id=0,
        eos_token_id=2,
    )


def _t5(tf):
    return tf.T5Config(
        vocab_size=128,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        pad_token_id=0,
        decoder_start_token_id=0,
        eos_token_id=2,
    )


# name -> builder of a transformers config (tiny: 2 layers, width 64, vocabulary 128)
TINY_CONFIGS: dict[str, Callable] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "gemma3_text": _gemma3,  # "gemma3" names the real 270M file
    "gpt2": _gpt2,
    "marian": _marian,
    "t5": _t5,
}


def load_model(spec: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, str]:
    """``(model, description)``: a Hugging Face model with an LM head, in eval mode, in ``dtype``.

    ``spec`` is a key of :data:`TINY_CONFIGS` (random weights from ``seed``), a local checkpoint
    directory (``config.json`` and weights), or a GGUF file: a registered name (``smollm2``) or a
    path ending in ``.gguf``.

    Raises:
        ValueError: an unknown name, a missing directory or file, or an architecture transformers
            has no LM head class for.
    """
    tf = _transformers()
    spec = str(spec)
    if spec in TINY_CONFIGS:
        torch.manual_seed(seed)
        cfg = TINY_CONFIGS[spec](tf)
        auto = tf.AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else tf.AutoModelForCausalLM
        model = auto.from_config(cfg)
        return model.to(dtype).eval(), f"tiny random {spec} (seed {seed})"
    from attnmask.pretrained.registry import MODELS

    if spec in MODELS or spec.endswith(".gguf"):
        return _from_gguf(tf, spec, dtype)
    path = Path(spec)
    if not path.is_dir() and ("/" in spec or "\\" in spec or path.exists()):
        raise UserError(f"{spec}: no such checkpoint directory (expected config.json and weights in it)")
    if not path.is_dir():
        raise UserError(
            f"model {spec!r} is not a tiny config ({', '.join(TINY_CONFIGS)}), a registered GGUF model "
            f"({', '.join(MODELS)}), a .gguf file or an existing checkpoint directory"
        )
    if not (path / "config.json").is_file():
        raise UserError(f"{path} holds no config.json: expected a Hugging Face checkpoint directory")
    try:
        cfg = tf.AutoConfig.from_pretrained(str(path), local_files_only=True)
        auto = tf.AutoModelForSeq2SeqLM if getattr(cfg, "is_encoder_decoder", False) else tf.AutoModelForCausalLM
        model = auto.from_pretrained(str(path), local_files_only=True, dtype=dtype)
    except Exception as err:  # transformers and safetensors raise ValueError, OSError, SafetensorError...
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(
            f"{path}: not a loadable Hugging Face checkpoint ({first}); expected the config.json of a model type "
            "transformers knows, and its weights"
        ) from err
    return model.eval(), f"{type(model).__name__} from {path}"


def _from_gguf(tf, spec: str, dtype: torch.dtype):
    """A ``LlamaForCausalLM`` holding a GGUF file's weights as attnmask dequantizes them."""
    from attnmask.pretrained.hf import llama_key_map
    from attnmask.pretrained.registry import load, locate

    path = locate(spec)
    ours, _, _ = load(spec, fuse=False, column_major=False)
    c = ours.config
    if c.qk_norm and c.post_norms:  # Gemma 3
        from attnmask.pretrained.gemma3 import hf_gemma3_from_attnmask

        model = hf_gemma3_from_attnmask(c, ours.state_dict())
        return model.to(dtype).eval(), f"{path.name} (GGUF, dequantized by attnmask) as Gemma3ForCausalLM"
    if c.positions != "rotary" or c.norm != "rmsnorm" or c.rope_scaling:
        raise UserError(f"{path}: only plain Llama GGUF files map onto transformers' LlamaForCausalLM")
    cfg = tf.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.dim,
        intermediate_size=c.ffn_dim,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_seq_len,
        rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_embeddings,
        attention_bias=c.bias,
        mlp_bias=c.bias,
    )
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    sd = ours.state_dict()
    theirs = {hf: sd[mine].contiguous() for mine, hf in llama_key_map(c).items()}
    model.load_state_dict(theirs, strict=False, assign=True)
    if c.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)  # its buffers were made on the meta device
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise UserError(f"{path}: weights left unset in the Hugging Face model: {left[:3]}")
    return model.to(dtype).eval(), f"{path.name} (GGUF, dequantized by attnmask) as LlamaForCausalLM"


# ---------------------------------------------------------------------------------------------
# Attention implementations
# ---------------------------------------------------------------------------------------------
def set_implementation(model, name: str) -> None:
    """Switch ``model`` to attention implementation ``name``; ValueError when it cannot run it."""
    try:
        model.set_attn_implementation(name)
    except (ImportError, ValueError, KeyError, RuntimeError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"attention implementation {name!r} is not available for {type(model).__name__}: {first}"
        ) from e
    if model.config._attn_implementation != name:
        raise UserError(
            f"attention implementation {name!r} is not available for {type(model).__name__}: it stays "
            f"{model.config._attn_implementation!r} (its attention does not dispatch through AttentionInterface)"
        )


def implementations(model, requested=None) -> tuple[list[str], dict[str, str]]:
    """``(usable, unavailable)``: the implementations to test and, for the others, why not.

    ``requested`` None means every one transformers' ``AttentionInterface`` knows (``eager``
    first, then the registered ones, user-registered included). A requested one that cannot run
    raises ValueError; a discovered one is listed in ``unavailable`` instead.
    """
    tf = _transformers()
    known = ["eager"] + [k for k in tf.AttentionInterface() if k != "eager"]
    original = model.config._attn_implementation
    usable, unavailable = [], {}
    try:
        if requested is not None:
            for name in requested:
                if name not in known:
                    raise UserError(f"unknown attention implementation {name!r}; transformers knows {', '.join(known)}")
                if name in _NOT_A_FORWARD:
                    raise UserError(f"attention implementation {name!r} {_NOT_A_FORWARD[name]}")
                set_implementation(model, name)
                usable.append(name)
            return list(dict.fromkeys(usable)), unavailable
        for name in known:
            if name in _NOT_A_FORWARD:
                unavailable[name] = _NOT_A_FORWARD[name]
                continue
            try:
                set_implementation(model, name)
                usable.append(name)
            except ValueError as e:
                unavailable[name] = str(e).split(": ", 1)[-1]
        return usable, unavailable
    finally:
        model.set_attn_implementation(original)


# ---------------------------------------------------------------------------------------------
# Sliding windows and the float64 reference
# ---------------------------------------------------------------------------------------------
layer_windows = hf_layer_windows  # each decoder layer's window (None: full), shared with the leak audit


def reach(config) -> int | None:
    """How many tokens back an output can depend on its input: the sum of ``W - 1`` over the
    layers (each layer widens the reach by its window); None when a layer attends to everything."""
    windows = layer_windows(config)
    if not windows or any(w is None for w in windows):
        return None
    return sum(w - 1 for w in windows)


def reference_model(model) -> tuple[object | None, str]:
    """``(attnmask Transformer in float64 or None, why not)`` computing the same function as ``model``."""
    from attnmask.pretrained.hf import SUPPORTED, transformer_from_hf

    cfg = model.config.to_dict()
    kind = cfg.get("model_type")
    windows = layer_windows(model.config)
    if kind == "mistral":
        cfg["model_type"] = "llama"  # Llama's weights and names, plus a window the reference gets as a mask
    elif kind not in SUPPORTED:
        return None, f"attnmask cannot build {kind!r} models (it imports {', '.join(SUPPORTED)} and mistral)"
    if len(set(windows)) > 1 and kind != "gemma3_text":  # Gemma 3's config carries its layers' windows
        return None, "attnmask's reference takes one window for every layer"
    try:
        ref = transformer_from_hf(model.state_dict(), cfg, dtype=torch.float64)
    except ValueError as e:
        return None, f"attnmask cannot import this {kind} model: {e}"
    return ref, ""
