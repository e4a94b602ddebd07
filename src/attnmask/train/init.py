"""``--init MODEL``: the pretrained model a fine-tuning run starts from, with its tokenizer and chat template.

``MODEL`` is one of:

- a name of the pretrained registry (:data:`attnmask.pretrained.MODELS`, e.g. ``smollm2``) or a
  ``.gguf`` path: loaded by :func:`attnmask.pretrained.load` (unfused projections, float32);
- a Hugging Face Llama-family checkpoint directory (``config.json``, ``model.safetensors``,
  ``tokenizer.json``, ``tokenizer_config.json``): :func:`attnmask.pretrained.load_hf_dir`, with the
  tokenizer and chat template of ``tokenizer_config.json`` (what ``attnmask export --format hf``
  writes, too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from attnmask.errors import UserError
from attnmask.model import Transformer
from attnmask.pretrained import ChatTemplate, PretrainedTokenizer
from attnmask.pretrained.chat import chat_template_for

__all__ = ["Init", "hf_dir_tokenizer", "load_init"]


@dataclass
class Init:
    model: Transformer  # float32, train mode, every parameter trainable
    tokenizer: PretrainedTokenizer
    chat_template: ChatTemplate | None
    source: str  # what --init named


def _token_text(value) -> str | None:
    """tokenizer_config.json spells a token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def hf_dir_tokenizer(path: str | Path) -> tuple[PretrainedTokenizer, ChatTemplate | None]:
    """The tokenizer and chat template of a Hugging Face checkpoint directory.

    Raises:
        FileNotFoundError: no ``tokenizer.json``.
        ValueError: ``tokenizer_config.json`` names no end-of-sequence token the vocabulary has.
    """
    from tokenizers import Tokenizer as HFTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path / 'tokenizer.json'} not found: expected a Hugging Face tokenizer file")
    hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}

    def token_id(key):
        text = _token_text(config.get(key))
        return hf.token_to_id(text) if text is not None else None

    eos = token_id("eos_token")
    if eos is None:
        raise UserError(f"{config_file}: eos_token is missing or not in the vocabulary; expected the end token's text")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    ids = {"bos_id": token_id("bos_token"), "eos_id": eos, "pad_id": token_id("pad_token")}
    ids["unk_id"] = token_id("unk_token")
    tokenizer = PretrainedTokenizer.from_special_ids(hf, ids, add_bos=bool(config.get("add_bos_token", False)))
    chat = ChatTemplate.for_tokenizer(template, tokenizer) if isinstance(template, str) else None
    return tokenizer, chat


def load_init(name: str, chat_template: str | None = None) -> Init:
    """The model, tokenizer and chat template ``--init name`` stands for (module docstring).

    ``chat_template`` (``--chat-template``: a Jinja file or a built-in name,
    :func:`attnmask.pretrained.template_source`) replaces the model's own template, or gives one to
    a model that has none; the token ending its assistant turns joins the tokenizer's stop ids.

    Raises:
        ValueError: an unknown name (listing the registered ones), a missing package, an
            unsupported checkpoint, an unknown ``chat_template``.
        FileNotFoundError: a named file or directory lacks what it needs.
    """
    path = Path(name)
    if path.is_dir():
        from attnmask.pretrained import load_hf_dir

        model = load_hf_dir(path, dtype=torch.float32)
        tokenizer, chat = hf_dir_tokenizer(path)
    else:
        from attnmask.pretrained import load

        model, tokenizer, chat = load(name, fuse=False)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(
            f"--init {name}: the tokenizer has {tokenizer.vocab_size} tokens, the model's vocabulary "
            f"{model.config.vocab_size}; expected a tokenizer that fits the model"
        )
    if chat_template is not None:
        chat = chat_template_for(tokenizer, chat_template)
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    return Init(model=model, tokenizer=tokenizer, chat_template=chat, source=str(name))
