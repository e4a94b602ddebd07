"""A trained decoder (a fine-tuned run, LoRA adapters merged) written for other tools.

- :func:`export_hf`: a Hugging Face Llama checkpoint directory (``config.json``,
  ``model.safetensors``, ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``,
  ``special_tokens_map.json``) that ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` load,
  and that ``attnmask train --init DIR`` starts from again;
- :func:`export_gguf`: one GGUF file (float32 tensors, query/key rows in llama.cpp's order, the
  tokenizer and chat template in its metadata) that :func:`attnmask.pretrained.load` and
  ``attnmask generate --model FILE.gguf`` read back (written with the ``gguf`` package).

Llama-family models (rotary positions, RMSNorm, SwiGLU, no biases) can be written in both formats;
Gemma 3 (q/k norms, post-sublayer norms, windows) as a Hugging Face ``Gemma3ForCausalLM`` directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from attnmask.errors import UserError
from attnmask.model import Transformer
from attnmask.pretrained.gguf_file import TOKEN_CONTROL, permute_qk
from attnmask.pretrained.hf import llama_key_map

__all__ = ["export_gguf", "export_hf", "gemma3_hf_config_dict", "llama_hf_config"]

_TOKEN_NORMAL = 1


def _check_llama(model: Transformer) -> None:
    c = model.config
    wanted = {"arch": "decoder", "positions": "rotary", "norm": "rmsnorm", "norm_position": "pre",
              "activation": "swiglu", "bias": False, "embed_scale": False, "lm_head_bias": False,
              "sliding_window": 0}  # fmt: skip
    # fields a newer ModelConfig may have (Gemma's) must keep their Llama values too
    wanted |= {k: v for k, v in (("qk_norm", False), ("post_norms", False), ("rope_local_theta", None))
               if hasattr(c, k)}  # fmt: skip
    differ = {k: getattr(c, k) for k, v in wanted.items() if getattr(c, k) != v}
    if differ or (c.rope_scaling is not None and c.rope_scaling.get("rope_type") != "linear"):
        raise UserError(
            f"only Llama-family models can be exported (Gemma 3 too, with --format hf); this one has "
            f"{differ or c.rope_scaling}, expected {wanted}"
        )
    _check_unfused(model)


def _check_unfused(model: Transformer) -> None:
    if any(getattr(m, "qkv_proj", None) is not None for m in model.modules()):
        raise UserError("the model's projections are fused; export the run's unfused model (load_run gives it)")


def _token(tokenizer, i: int | None) -> str | None:
    return None if i is None else tokenizer.id_to_token(i)


def llama_hf_config(model: Transformer, tokenizer) -> dict:
    """The ``config.json`` of a ``LlamaForCausalLM`` computing what ``model`` computes."""
    c = model.config
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        rope = {**c.rope_scaling, "rope_theta": c.rope_theta}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.dim,
        "intermediate_size": c.ffn_dim,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": rope,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": c.tie_embeddings,
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id,
        "torch_dtype": "float32",
    }


def _is_gemma3(model: Transformer) -> bool:
    c = model.config
    return bool(getattr(c, "post_norms", False) and getattr(c, "qk_norm", False)) and c.activation == "geglu_tanh"


def gemma3_hf_config_dict(model: Transformer, tokenizer) -> dict:
    """The ``config.json`` of a ``Gemma3ForCausalLM`` computing what the Gemma 3 ``model`` computes."""
    from attnmask.pretrained.gemma3 import gemma3_hf_config

    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    config = gemma3_hf_config(model.config, **ids).to_dict()
    config["architectures"] = ["Gemma3ForCausalLM"]
    config["torch_dtype"] = "float32"
    return config


def _hf_weights(model: Transformer) -> dict:
    """``model``'s tensors in Hugging Face's names (Gemma 3's norms in its ``1 + weight`` spelling)."""
    sd = model.state_dict()
    if _is_gemma3(model):
        from attnmask.pretrained.gemma3 import gemma3_key_map

        _check_unfused(model)
        return {
            theirs: (sd[ours].detach().float() - (1 if ours.endswith("norm.weight") else 0)).contiguous()
            for ours, theirs in gemma3_key_map(model.config).items()
        }
    _check_llama(model)
    return {theirs: sd[ours].detach().to(torch.float32).contiguous() for ours, theirs in
            llama_key_map(model.config).items()}  # fmt: skip


def _hf_tokenizer(tokenizer):
    """The ``tokenizers`` object to save: the tokenizer's own, and where the model expects ``<bos>``
    first (Gemma), a copy whose post-processor prepends it, so that transformers' ``AutoTokenizer``
    encodes as attnmask does (attnmask itself encodes without the post-processor and adds it)."""
    if not tokenizer.add_bos or tokenizer.bos_id is None:
        return tokenizer.hf
    from tokenizers import Tokenizer, processors

    copy = Tokenizer.from_str(tokenizer.hf.to_str())
    bos = tokenizer.hf.id_to_token(tokenizer.bos_id)
    first = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, tokenizer.bos_id)]
    )
    copy.post_processor = first if copy.post_processor is None else processors.Sequence([copy.post_processor, first])
    return copy


def export_hf(model: Transformer, tokenizer, chat_template, out: str | Path) -> Path:
    """Write ``model`` (a Llama-family or Gemma 3 decoder), its pretrained tokenizer and chat template
    to ``out``: a ``LlamaForCausalLM`` or ``Gemma3ForCausalLM`` checkpoint directory.

    Raises:
        ValueError: another kind of model, or ``out`` is a file.
    """
    weights = _hf_weights(model)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; expected a directory for --format hf")
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = gemma3_hf_config_dict(model, tokenizer) if _is_gemma3(model) else llama_hf_config(model, tokenizer)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    stops = list(tokenizer.stop_ids)
    generation = {"bos_token_id": tokenizer.bos_id, "eos_token_id": stops[0] if len(stops) == 1 else stops}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    _hf_tokenizer(tokenizer).save(str(out / "tokenizer.json"))
    specials = {
        f"{name}_token": _token(tokenizer, i)
        for name, i in (
            ("bos", tokenizer.bos_id),
            ("eos", tokenizer.eos_id),
            ("pad", tokenizer.pad_id),
            ("unk", tokenizer.unk_id),
        )  # fmt: skip
        if i is not None
    }
    config = {
        **specials,
        "add_bos_token": tokenizer.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model.config.max_seq_len,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template.source
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n", encoding="utf-8")
    return out


def _pre_tokenizer_name(spec: dict) -> str:
    """The GGUF ``tokenizer.ggml.pre`` name of a ``tokenizer.json`` pre-tokenizer attnmask reads back
    (:func:`attnmask.pretrained.gguf_file.build_tokenizer`)."""
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"]:
        return "gpt2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        return "llama-bpe"
    raise UserError(f"tokenizer pre-tokenizer {kinds} has no GGUF name attnmask knows; expected a byte-level BPE")


def export_gguf(model: Transformer, tokenizer, chat_template, out: str | Path, *, name: str = "attnmask") -> Path:
    """Write ``model`` as a float32 Llama GGUF file with its tokenizer and chat template.

    Raises:
        ValueError: not a Llama-family model, a tokenizer other than byte-level BPE, or no ``gguf``.
    """
    try:
        import gguf
    except ImportError as err:
        raise UserError("writing GGUF files needs the gguf package: pip install 'attnmask[hf]'") from err
    _check_llama(model)
    c = model.config
    out = Path(out)
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; expected a file name ending in .gguf for --format gguf")
    spec = json.loads(tokenizer.hf.to_str())
    if spec.get("model", {}).get("type") != "BPE":
        raise UserError("only byte-level BPE tokenizers can be written to GGUF here")
    vocab = tokenizer.hf.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise UserError("the tokenizer's ids are not contiguous; expected ids 0 .. vocab_size - 1")
    special = {t.content for t in tokenizer.hf.get_added_tokens_decoder().values() if t.special}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]

    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(name)
    writer.add_block_count(c.n_layers)
    writer.add_context_length(c.max_seq_len)
    writer.add_embedding_length(c.dim)
    writer.add_feed_forward_length(c.ffn_dim)
    writer.add_head_count(c.n_heads)
    writer.add_head_count_kv(c.n_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_rope_dimension_count(c.head_dim)
    if c.rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(c.rope_scaling["factor"]))
    writer.add_layer_norm_rms_eps(c.norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer_name(spec))
    writer.add_token_list(tokens)
    writer.add_token_types([TOKEN_CONTROL if t in special else _TOKEN_NORMAL for t in tokens])
    writer.add_token_merges(merges)
    ids = [
        (writer.add_bos_token_id, tokenizer.bos_id),
        (writer.add_eos_token_id, tokenizer.eos_id),
        (writer.add_pad_token_id, tokenizer.pad_id),
        (writer.add_unk_token_id, tokenizer.unk_id),
    ]
    for add, i in ids:
        if i is not None:
            add(i)
    writer.add_add_bos_token(tokenizer.add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template.source)
    sd = model.state_dict()
    names = {"embed": "token_embd", "norm": "output_norm", "lm_head": "output"}
    layer_names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down", "self_norm": "attn_norm", "mlp_norm": "ffn_norm"}  # fmt: skip
    for ours in llama_key_map(c):
        w = sd[ours].detach().to(torch.float32)
        stem = ours.removesuffix(".weight")
        if stem.startswith("layers."):
            _, i, rest = stem.split(".", 2)
            theirs = f"blk.{i}.{layer_names[rest]}.weight"
            if rest == "self_attn.q_proj":
                w = permute_qk(w, c.n_heads)
            elif rest == "self_attn.k_proj":
                w = permute_qk(w, c.n_kv_heads)
        else:
            theirs = f"{names[stem]}.weight"
        writer.add_tensor(theirs, w.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
