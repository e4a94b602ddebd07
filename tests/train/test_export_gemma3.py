"""``export_hf`` of a Gemma 3 model: a ``Gemma3ForCausalLM`` directory that transformers loads with the
same logits (windows included: the sequence is longer than the window), and that attnmask reads back."""

from __future__ import annotations

import json

import pytest
import torch

from attnmask.errors import UserError

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")


@pytest.fixture(scope="module")
def gemma_and_tokenizer(tmp_path_factory):
    """A tiny random Gemma 3 (two sliding layers of window 8, one global) in attnmask, and a pretrained
    tokenizer of the same vocabulary size (the tiny GGUF's)."""
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install -e '.[hf]')")
    from attnmask.pretrained.hf import transformer_from_hf_model
    from attnmask.train.init import load_init
    from tests.pretrained.test_pretrained import write_tiny_gguf

    root = tmp_path_factory.mktemp("gemma_export")
    write_tiny_gguf(root / "tiny.gguf", tied=True)
    tokenizer = load_init(str(root / "tiny.gguf")).tokenizer
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], max_position_embeddings=128,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
    )  # fmt: skip
    hf = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norm weights away from 0 (Gemma stores them as w, computing 1 + w)
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    return transformer_from_hf_model(hf).eval(), tokenizer, root


def test_gemma3_exports_to_a_checkpoint_transformers_and_attnmask_read_with_the_same_logits(gemma_and_tokenizer):
    from attnmask.pretrained.hf import load_hf_dir
    from attnmask.train.export import export_hf

    model, tokenizer, root = gemma_and_tokenizer
    out = export_hf(model, tokenizer, None, root / "hf")
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["sliding_window"] == 8
    ids = torch.randint(0, tokenizer.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids).logits
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        again = load_hf_dir(out).eval()(ids).logits
    assert type(transformers.AutoModelForCausalLM.from_pretrained(out)).__name__ == "Gemma3ForCausalLM"
    torch.testing.assert_close(theirs, ours, atol=1e-5 * ours.abs().max().item(), rtol=0)
    torch.testing.assert_close(again, ours, atol=1e-6 * ours.abs().max().item(), rtol=0)


def test_gemma3_refuses_gguf_export_in_one_message(gemma_and_tokenizer):
    from attnmask.train.export import export_gguf

    model, tokenizer, root = gemma_and_tokenizer
    with pytest.raises(UserError, match="Gemma 3 too, with --format hf"):
        export_gguf(model, tokenizer, None, root / "g.gguf")


def test_a_tokenizer_that_starts_with_bos_exports_one_transformers_encodes_alike(gemma_and_tokenizer):
    """Gemma's tokenizer puts ``<bos>`` first: transformers' ``AutoTokenizer`` on the exported directory
    encodes a text to attnmask's ids, ``<bos>`` once; attnmask reading the directory back does too."""
    from attnmask.pretrained.chat import PretrainedTokenizer
    from attnmask.train.export import export_hf
    from attnmask.train.init import load_init

    model, tokenizer, root = gemma_and_tokenizer
    bos = 1 if tokenizer.bos_id is None else tokenizer.bos_id
    ids = {"bos_id": bos, "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id, "unk_id": tokenizer.unk_id}
    with_bos = PretrainedTokenizer.from_special_ids(tokenizer.hf, ids, add_bos=True)
    out = export_hf(model, with_bos, None, root / "hf_bos")
    text = "hello world, 12 times"
    want = with_bos.encode(text)
    assert want[0] == bos and want.count(bos) == 1
    assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == want
    assert load_init(str(out)).tokenizer.encode(text) == want
