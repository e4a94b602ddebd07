"""Hugging Face checkpoints imported into attnmask compute the same function as in transformers.

Each reference model is built locally from a tiny config with random weights (nothing is
downloaded); its ``state_dict`` is converted and both models see the same inputs.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

from attnmask import decode, masks
from attnmask.model import ModelConfig
from attnmask.pretrained.hf import (
    config_from_hf,
    load_hf_dir,
    state_dict_from_hf,
    transformer_from_hf,
    transformer_from_hf_model,
)

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

TOL = dict(atol=1e-5, rtol=1e-5)


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights everywhere, norms and biases included, so a swapped or missed tensor shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm_scale = name.endswith("weight") and p.dim() == 1  # RMSNorm/LayerNorm gains around 1
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if is_norm_scale else 0.0))
    return model.eval()


def _ids(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# Llama family
# ---------------------------------------------------------------------------------------------
def _llama(seed: int = 0, **kw):
    config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        **kw,
    )
    torch.manual_seed(seed)
    return _randomize(transformers.LlamaForCausalLM(config), seed)


@pytest.mark.parametrize(
    "kw",
    [
        dict(tie_word_embeddings=False),
        dict(tie_word_embeddings=True),
        dict(rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
        dict(rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}),
        dict(attention_bias=True, mlp_bias=True),
    ],
    ids=["untied", "tied", "theta", "llama3-rope", "linear-rope", "bias"],
)
def test_llama_logits_match(kw):
    hf = _llama(**kw)
    ours = transformer_from_hf_model(hf)
    ids = _ids(2, 40, 97, seed=1)  # long enough that llama3's scaled frequencies matter
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours.decode(ids)
    assert_close(got, expected, **TOL)


def test_llama_left_padding_matches_hf_attention_mask():
    hf = _llama(tie_word_embeddings=True)
    ours = transformer_from_hf_model(hf)
    ids = _ids(2, 12, 97, seed=2)
    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[1, :5] = False  # row 1 is left-padded by 5
    positions = (keep.long().cumsum(-1) - 1).clamp(min=0)  # (B, T): real tokens count from 0
    with torch.no_grad():
        expected = hf(ids, attention_mask=keep.long(), position_ids=positions).logits
        got = ours.decode(ids, mask=masks.causal() & masks.padding(keep=keep), positions=positions)
    assert_close(got[keep], expected[keep], **TOL)


def test_llama_bf16_close_to_hf_bf16():
    hf = _llama(tie_word_embeddings=False).to(torch.bfloat16)
    ours = transformer_from_hf_model(hf)
    assert ours.embed.weight.dtype == torch.bfloat16
    ids = _ids(1, 16, 97, seed=3)
    with torch.no_grad():
        expected = hf(ids).logits.float()
        got = ours.decode(ids).float()
    # same weights, different op order in bfloat16 (8 bits of mantissa)
    assert_close(got, expected, atol=0.15, rtol=0.05)


def test_llama_rejects_unsupported_options():
    c = _llama().config.to_dict()
    with pytest.raises(ValueError, match="mlp_bias"):
        config_from_hf({**c, "attention_bias": True, "mlp_bias": False})
    with pytest.raises(ValueError, match="yarn"):
        config_from_hf({**c, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}})
    with pytest.raises(ValueError, match="model_type 'bert'|type 'bert'"):
        config_from_hf({**c, "model_type": "bert"})


def test_missing_key_is_named():
    hf = _llama()
    sd = dict(hf.state_dict())
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        state_dict_from_hf(sd, hf.config)


def test_load_hf_dir_from_save_pretrained(tmp_path):
    hf = _llama(tie_word_embeddings=False)
    hf.save_pretrained(tmp_path)
    ours = load_hf_dir(tmp_path)
    ids = _ids(1, 10, 97, seed=4)
    with torch.no_grad():
        assert_close(ours.decode(ids), hf(ids).logits, **TOL)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"


# ---------------------------------------------------------------------------------------------
# GPT-2
# ---------------------------------------------------------------------------------------------
def _gpt2(seed: int = 0, **kw):
    config = transformers.GPT2Config(
        vocab_size=101, n_positions=48, n_embd=48, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0, **kw
    )
    torch.manual_seed(seed)
    return _randomize(transformers.GPT2LMHeadModel(config), seed)


@pytest.mark.parametrize("kw", [dict(), dict(n_inner=72, activation_function="gelu")], ids=["default", "n_inner-gelu"])
def test_gpt2_logits_match(kw):
    hf = _gpt2(**kw)
    ours = transformer_from_hf_model(hf)
    assert ours.config.pad_id is None  # id 0 is a real GPT-2 token, never masked as padding
    ids = _ids(2, 30, 101, seed=5)
    ids[0, 3] = 0
    with torch.no_grad():
        assert_close(ours.decode(ids), hf(ids).logits, **TOL)


def test_gpt2_decoding_steps_match_the_hf_forward():
    hf = _gpt2()
    ours = transformer_from_hf_model(hf)
    ids = _ids(2, 12, 101, seed=6)
    with torch.no_grad():
        expected = hf(ids).logits  # (B, 12, V)
    with torch.inference_mode():  # the packed step over the paged cache: 8 prompt tokens, then one a step
        state, first, _ = decode.start(ours, prompts=ids[:, :8], max_new_tokens=5)
        steps = [first] + [decode.decode_step(ours, state, ids[:, t]) for t in range(8, 12)]
    assert_close(torch.stack(steps, dim=1), expected[:, 7:], **TOL)


# ---------------------------------------------------------------------------------------------
# Marian (encoder-decoder)
# ---------------------------------------------------------------------------------------------
PAD = 60


def _marian(seed: int = 0, **kw):
    config = transformers.MarianConfig(
        vocab_size=61,
        decoder_vocab_size=kw.pop("decoder_vocab_size", 61),
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=40,
        pad_token_id=PAD,
        decoder_start_token_id=PAD,
        eos_token_id=0,
        forced_eos_token_id=0,
        scale_embedding=True,
        **kw,
    )
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # random weights, but the sinusoidal positions stay what Marian computes
        for name, p in model.named_parameters():
            if "embed_positions" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if "layer_norm.weight" in name else 0.0))
        model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=g))
    return model


def _marian_batch():
    src = _ids(3, 11, 60, seed=7)  # ids < PAD
    src_len = torch.tensor([11, 7, 4])
    src_keep = torch.arange(11)[None] < src_len[:, None]  # (B, S)
    src = src.masked_fill(~src_keep, PAD)
    tgt = _ids(3, 9, 60, seed=8)
    tgt[:, 0] = PAD  # Marian's decoder starts from its pad token
    return src, src_keep, tgt


@pytest.mark.parametrize("kw", [dict(), dict(activation_function="gelu")], ids=["swish", "gelu"])
def test_marian_logits_match_with_source_padding(kw):
    hf = _marian(**kw)
    ours = transformer_from_hf_model(hf)
    src, src_keep, tgt = _marian_batch()
    with torch.no_grad():
        expected = hf(input_ids=src, attention_mask=src_keep.long(), decoder_input_ids=tgt).logits
        memory = ours.encode(src)  # source padding from pad_id, as Marian's attention_mask
        got = ours.decode(tgt, memory, memory_mask=ours.source_mask(src), mask=masks.causal())
    assert_close(got, expected, **TOL)
    # the encoder alone, at real source positions
    with torch.no_grad():
        hf_memory = hf.get_encoder()(input_ids=src, attention_mask=src_keep.long()).last_hidden_state
    assert_close(memory[src_keep], hf_memory[src_keep], **TOL)


def test_marian_decoding_steps_match_the_full_hf_pass():
    hf = _marian()
    ours = transformer_from_hf_model(hf)
    src, src_keep, tgt = _marian_batch()
    with torch.no_grad():
        expected = hf(input_ids=src, attention_mask=src_keep.long(), decoder_input_ids=tgt).logits  # (B, 9, V)
    with torch.inference_mode():  # the packed step: the padded sources encoded once, then one token a step
        state, first, _ = decode.start(ours, src=src, max_new_tokens=10, sos_id=PAD)  # tgt[:, 0] is PAD
        steps = [first] + [decode.decode_step(ours, state, tgt[:, t]) for t in range(1, 9)]
    assert_close(torch.stack(steps, dim=1), expected, **TOL)


def test_marian_separate_vocabularies():
    hf = _marian(share_encoder_decoder_embeddings=False, decoder_vocab_size=71, tie_word_embeddings=False)
    cfg = config_from_hf(hf.config)
    assert (cfg.src_vocab_size, cfg.vocab_size) == (61, 71)
    ours = transformer_from_hf_model(hf)
    src, src_keep, tgt = _marian_batch()
    with torch.no_grad():
        expected = hf(input_ids=src, attention_mask=src_keep.long(), decoder_input_ids=tgt).logits
        got = ours.decode(tgt, ours.encode(src), memory_mask=ours.source_mask(src), mask=masks.causal())
    assert_close(got, expected, **TOL)


def test_config_from_plain_dict_equals_config_from_object():
    hf = _gpt2()
    assert config_from_hf(hf.config) == config_from_hf(hf.config.to_dict())
    assert isinstance(config_from_hf(hf.config, attn_backend="reference"), ModelConfig)


def test_transformer_from_hf_rejects_mismatched_state_dict():
    hf = _gpt2()
    sd = hf.state_dict()
    bigger = _gpt2(n_inner=96)
    with pytest.raises((ValueError, RuntimeError)):
        transformer_from_hf(sd, bigger.config)
