"""Read a llama.cpp GGUF file (Llama or Gemma 3 architecture) into attnmask's config, weights and tokenizer.

What llama.cpp changed, undone here:

- **Quantization**: weights are stored in blocks (Q4_1: 32 weights share a float16 scale and
  minimum); :func:`gguf.dequantize` turns each tensor back into float32. The result is the
  model's function *as quantized*: it is exactly what the file holds, not the original
  bfloat16 checkpoint.
- **Query/key row order**: llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` in
  every head from Hugging Face's "rotate half" layout (pairs ``(i, i + D/2)``) to interleaved
  pairs ``(2i, 2i + 1)``, which its rotary kernel expects. :func:`unpermute_qk` inverts it,
  because :class:`attnmask.model.Rotary` uses the rotate-half layout.
  Gemma 3's converter leaves the rows alone (llama.cpp rotates its heads in the rotate-half layout).
- **Tokenizer**: the vocabulary, merges and special-token ids are metadata arrays; they are
  rebuilt into a Hugging Face ``tokenizers`` byte-level BPE with the pre-tokenizer that
  ``tokenizer.ggml.pre`` names, or, for a SentencePiece vocabulary (``tokenizer.ggml.model`` =
  ``"llama"``: Gemma), by :mod:`attnmask.pretrained.sentencepiece`.
- **Gemma 3** (:func:`gemma3_config`): what the file does not say is llama.cpp's fixed rule for the
  architecture: every sixth layer attends to all earlier positions, the others to the last
  ``gemma3.attention.sliding_window`` (their rotary base 10,000); the norms' weights are stored
  with Gemma's ``1 +`` already added, so they are plain RMSNorm weights here.

Tensor names (GGUF -> attnmask): ``token_embd`` -> ``embed``, ``blk.i.attn_{q,k,v,output}`` ->
``layers.i.self_attn.{q,k,v,o}_proj``, ``blk.i.ffn_{gate,up,down}`` -> ``layers.i.mlp.*_proj``,
``blk.i.attn_norm`` / ``ffn_norm`` -> ``self_norm`` / ``mlp_norm``, ``output_norm`` -> ``norm``,
``output`` -> ``lm_head`` (absent when the embeddings are tied); Gemma 3's
``blk.i.attn_{q,k}_norm`` -> ``self_attn.{q,k}_norm``, ``post_attention_norm`` / ``post_ffw_norm`` ->
``post_self_norm`` / ``post_mlp_norm``.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from attnmask.errors import UserError
from attnmask.model import ModelConfig
from attnmask.pretrained.quantized import BLOCK_BYTES
from attnmask.pretrained.sentencepiece import build_sentencepiece_tokenizer

__all__ = [
    "GGUFCheckpoint",
    "read_gguf",
    "config_from_metadata",
    "gemma3_config",
    "unpermute_qk",
    "permute_qk",
    "build_tokenizer",
]

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "self_norm",
    "ffn_norm": "mlp_norm",
    "attn_q_norm": "self_attn.q_norm",  # Gemma 3
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_self_norm",
    "post_ffw_norm": "post_mlp_norm",
}
GEMMA3_FULL_EVERY = 6  # llama.cpp's rule for gemma3: layers 5, 11, 17, ... attend to every earlier position
GEMMA3_LOCAL_THETA = 10000.0  # the sliding layers' rotary base (llama.cpp: rope_freq_base_train_swa)
_GLOBAL_NAMES = {"token_embd": "embed", "output_norm": "norm", "output": "lm_head"}

# llama.cpp's Llama 3 split pattern (its "llama-bpe" pre-tokenizer), as in Llama 3's tokenizer.json
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass
class GGUFCheckpoint:
    """Everything attnmask needs from a GGUF file."""

    config: ModelConfig
    state_dict: dict[str, Tensor]  # attnmask names, float32; ``lm_head.weight`` absent when tied
    tokenizer: Any  # a tokenizers.Tokenizer
    special_ids: dict[str, int | None]  # bos / eos / pad / unk ids from the metadata
    add_bos: bool  # whether the model expects <bos> before a prompt
    chat_template: str | None  # Jinja source from tokenizer.chat_template
    metadata: dict[str, Any] = field(default_factory=dict)  # scalar metadata (general.*, llama.*)
    # read_gguf(keep_blocks=True): linear weights kept as the file's quantized blocks, attnmask
    # name -> (format, uint8 rows); those names are absent from state_dict (W_pred of a tied
    # embedding is "lm_head.weight" here while "embed.weight" stays, dequantized, in state_dict)
    blocks: dict[str, tuple[str, Tensor]] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# The query/key permutation
# ---------------------------------------------------------------------------------------------
def permute_qk(w: Tensor, n_heads: int) -> Tensor:
    """llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``): rows of each head
    from rotate-half order ``[x_0 .. x_{D/2-1}, y_0 .. y_{D/2-1}]`` to interleaved ``[x_0, y_0, x_1, ...]``.
    ``w`` is ``(n_heads * D, C)``."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_qk(w: Tensor, n_heads: int) -> Tensor:
    """Inverse of :func:`permute_qk`: interleaved rows back to Hugging Face's rotate-half order."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise UserError(f"query/key weight has {rows} rows, expected a multiple of 2 * n_heads = {2 * n_heads}")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------
def _fields(reader) -> dict[str, Any]:
    """Metadata as Python values; arrays of strings become lists of str."""
    return {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def config_from_metadata(meta: dict[str, Any], *, tied: bool) -> ModelConfig:
    """The :class:`ModelConfig` of a GGUF file's ``llama.*`` metadata.

    Raises:
        ValueError: another architecture, partial rotary dims, or an unsupported rope scaling.
    """
    arch = meta.get("general.architecture")
    if arch == "gemma3":
        return gemma3_config(meta, tied=tied)
    if arch != "llama":
        raise UserError(f"GGUF architecture {arch!r} is not supported; expected 'llama' or 'gemma3'")

    def get(key: str, default=None):
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise UserError(f"GGUF metadata lacks llama.{key}")
        return value

    dim, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length", dim // n_heads))
    rope_dims = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise UserError(f"partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    scaling = None
    kind = meta.get("llama.rope.scaling.type", "none")
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif kind != "none":
        raise UserError(f"GGUF rope scaling {kind!r} is not supported; expected 'none' or 'linear'")
    vocab = meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return ModelConfig(
        arch="decoder",
        vocab_size=int(vocab),
        dim=dim,
        n_layers=int(get("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(meta.get("llama.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(get("feed_forward_length")),
        max_seq_len=int(get("context_length", 2048)),
        positions="rotary",
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        norm="rmsnorm",
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        norm_position="pre",
        activation="swiglu",
        bias=False,
        tie_embeddings=tied,
        pad_id=None,  # every id is a real token (SmolLM2's pad id is <|im_end|>, which chat prompts contain)
        extra={"source": f"gguf:{meta.get('general.name', '?')}"},
    )


def gemma3_config(meta: dict[str, Any], *, tied: bool) -> ModelConfig:
    """The :class:`ModelConfig` of a GGUF file's ``gemma3.*`` metadata: pre- and post-norms around
    each sublayer, RMSNorm on each head of q and k, embeddings times sqrt(C), a tanh-GeGLU MLP, and
    sliding-window layers with a rotary base of their own (five of six).

    Raises:
        ValueError: missing keys, partial rotary dims, an unsupported rope scaling, or Gemma 3 27B
            (its queries are scaled by ``(C / H)^-1/2``, not ``head_dim^-1/2``).
    """

    def get(key: str, default=None):
        value = meta.get(f"gemma3.{key}", default)
        if value is None:
            raise UserError(f"GGUF metadata lacks gemma3.{key}")
        return value

    dim, n_heads, n_layers = int(get("embedding_length")), int(get("attention.head_count")), int(get("block_count"))
    head_dim = int(get("attention.key_length", 256))
    if n_layers == 62:  # llama.cpp: f_attention_scale = 1 / sqrt(n_embd / n_head) for 27B only
        raise UserError("Gemma 3 27B scales its queries by (C / H)^-1/2, not head_dim^-1/2; expected a smaller Gemma 3")
    rope_dims = int(meta.get("gemma3.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise UserError(f"partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    scaling = None
    kind = meta.get("gemma3.rope.scaling.type", "none")
    if kind == "linear":  # the full layers only (Gemma 3 4B and larger)
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif kind != "none":
        raise UserError(f"GGUF rope scaling {kind!r} is not supported; expected 'none' or 'linear'")
    vocab = meta.get("gemma3.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    window = int(get("attention.sliding_window"))
    types = tuple("full" if (i + 1) % GEMMA3_FULL_EVERY == 0 else "sliding" for i in range(n_layers))
    return ModelConfig(
        arch="decoder",
        vocab_size=int(vocab),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(meta.get("gemma3.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(get("feed_forward_length")),
        max_seq_len=int(get("context_length", 32768)),
        positions="rotary",
        rope_theta=float(get("rope.freq_base", 1000000.0)),
        rope_scaling=scaling,
        rope_local_theta=GEMMA3_LOCAL_THETA,
        norm="rmsnorm",
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        norm_position="pre",
        post_norms=True,
        qk_norm=True,
        embed_scale=True,
        activation="geglu_tanh",
        bias=False,
        tie_embeddings=tied,
        pad_id=None,  # every id is a real token; padding is masked by the caller
        sliding_window=window,
        layer_types=types,
        extra={"source": f"gguf:{meta.get('general.name', '?')}", "permuted_qk": False},
    )


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
def _pre_tokenizer(kind: str):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind in ("default", "gpt2"):
        return byte_level
    if kind in ("smollm", "starcoder", "refact"):
        # digits are split one by one before the GPT-2 regex (SmolLM2's tokenizer.json)
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if kind in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise UserError(
        f"GGUF pre-tokenizer {kind!r} is not supported; expected one of default, gpt2, smollm, starcoder, refact, "
        "llama-bpe"
    )


def build_tokenizer(meta: dict[str, Any]):
    """A Hugging Face ``tokenizers.Tokenizer`` from ``tokenizer.ggml.*`` metadata (byte-level BPE, or
    SentencePiece: :func:`attnmask.pretrained.sentencepiece.build_sentencepiece_tokenizer`).

    Control and user-defined tokens (``<|im_start|>`` ...) become special added tokens, so text
    spelling them (a rendered chat template) encodes to their ids.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models

    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        return build_sentencepiece_tokenizer(meta)
    if kind != "gpt2":
        raise UserError(
            f"GGUF tokenizer model {kind!r} is not supported; expected 'gpt2' (byte-level BPE) or 'llama' "
            "(SentencePiece)"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = meta.get("tokenizer.ggml.pre", "default")
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=pre in ("llama-bpe", "llama3"),
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type", []))
    specials = [
        AddedToken(t, special=(kind_ == TOKEN_CONTROL), normalized=False)
        for t, kind_ in zip(tokens, types)
        if kind_ in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
    ]
    tok.add_special_tokens(specials)
    return tok


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------
def _attnmask_name(gguf_name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
    m = re.fullmatch(r"(\w+)\.weight", gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.weight"
    return None


def read_gguf(source, *, keep_blocks: bool = False) -> GGUFCheckpoint:
    """Dequantize a Llama-architecture GGUF file into float32 attnmask weights, config and tokenizer.

    ``source`` is a path or an open ``gguf.GGUFReader`` (parsing a file's metadata takes seconds:
    a reader can be shared with other code reading the same file). With ``keep_blocks``, the
    weights of linear layers stored in a format :class:`attnmask.pretrained.quantized.BlockLinear` runs
    (Q4_1, Q8_0) are returned undecoded in :attr:`GGUFCheckpoint.blocks` instead (rows of the
    query/key weights still put back in Hugging Face order).

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: not a GGUF file, or an architecture/tensor/tokenizer attnmask cannot represent,
            or the ``gguf`` package is missing.
    """
    try:
        from gguf import GGUFReader, dequantize
    except ImportError as err:
        raise UserError("reading GGUF files needs the gguf package: pip install 'attnmask[hf]'") from err

    if isinstance(source, GGUFReader):
        reader, path = source, Path(getattr(source.data, "filename", None) or "<GGUFReader>")
    else:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} not found")
        try:
            reader = GGUFReader(path)
        except (ValueError, OSError) as err:
            raise UserError(f"{path} is not a readable GGUF file: {err}") from err
    meta = _fields(reader)
    names = {t.name for t in reader.tensors}
    config = config_from_metadata(meta, tied="output.weight" not in names)
    unknown = sorted(n for n in names if _attnmask_name(n) is None)
    if unknown:
        raise UserError(f"{path}: tensors attnmask cannot place: {unknown[:5]} (e.g. rope_freqs of Llama 3.1)")
    state_dict, blocks, decoded = {}, {}, {}
    for t in reader.tensors:
        name = _attnmask_name(t.name)
        kind = t.tensor_type.name
        linear = (name.startswith("layers.") and name.endswith("_proj.weight")) or name == "lm_head.weight"
        if keep_blocks and kind not in BLOCK_BYTES and kind not in ("F32", "F16", "BF16") and linear:
            decoded[kind] = decoded.get(kind, 0) + 1
        if keep_blocks and kind in BLOCK_BYTES and (linear or (name == "embed.weight" and config.tie_embeddings)):
            raw = torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True))  # (out, in / 32 * block bytes)
            blocks["lm_head.weight" if name == "embed.weight" else name] = (kind, _unpermuted(t.name, raw, config))
            if not linear:  # the tied embedding: W_pred keeps the blocks, the lookup table is float32
                state_dict[name] = torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
            continue
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)  # (out, in)
        if not w.flags.writeable:  # float32 tensors come back as views of the read-only file map
            w = w.copy()
        state_dict[name] = _unpermuted(t.name, torch.from_numpy(w), config)
    if decoded:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(decoded.items()))
        warnings.warn(
            f"{path.name}: no block kernel for {counts} linear weights here; they are dequantized to float32 "
            f"(block formats run as stored: {', '.join(sorted(BLOCK_BYTES))})",
            stacklevel=2,
        )
    ids = {
        "bos_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_id": meta.get("tokenizer.ggml.padding_token_id"),
        "unk_id": meta.get("tokenizer.ggml.unknown_token_id"),
    }
    scalars = {
        k: v for k, v in meta.items() if isinstance(v, (int, float, str, bool)) and k != "tokenizer.chat_template"
    }
    return GGUFCheckpoint(
        config=config,
        state_dict=state_dict,
        tokenizer=build_tokenizer(meta),
        special_ids={k: (int(v) if v is not None else None) for k, v in ids.items()},
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        metadata=scalars,
        blocks=blocks,
    )


def _unpermuted(gguf_name: str, w: Tensor, config: ModelConfig) -> Tensor:
    """Rows of query/key weights back in Hugging Face order (``w`` float or block rows alike); Llama
    files only (llama.cpp's converter permutes no other architecture's rows)."""
    if not config.extra.get("permuted_qk", True):
        return w
    if gguf_name.endswith("attn_q.weight"):
        return unpermute_qk(w, config.n_heads)
    if gguf_name.endswith("attn_k.weight"):
        return unpermute_qk(w, config.n_kv_heads)
    return w
