"""The weight cache: a GGUF file's checkpoint converted once, kept as one safetensors file.

Dequantizing a GGUF file takes seconds (mostly parsing its metadata), so the float32 weights (or
the block weights, for ``quantized=True``), config, tokenizer and chat template are cached as one
safetensors file named by the GGUF file's SHA-256 and :data:`CACHE_VERSION`, in :func:`cache_dir`
(``$ATTNMASK_CACHE``, else ``$XDG_CACHE_HOME/attnmask``, else ``~/.cache/attnmask``; compiled
kernels live there too). Files are written atomically; an unreadable one is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from torch import Tensor

from attnmask.model import ModelConfig
from attnmask.ops.build import cache_dir

__all__ = ["CACHE_VERSION", "Checkpoint", "cache_dir", "cache_file", "read", "write_cache"]

CACHE_VERSION = 1  # bump when the cached layout or the loader's output changes
_BLOCKS = "blocks."  # prefix of the quantized blocks' tensors in a cache file


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def cache_file(gguf_path: Path, folder: str | os.PathLike | None = None, *, quantized: bool = False) -> Path:
    """Where the cached weights of ``gguf_path`` live: named by the file's SHA-256 (its first 16
    hex digits) and :data:`CACHE_VERSION`, in ``folder`` (default :func:`cache_dir`); the
    quantized checkpoint (blocks kept) has a file of its own."""
    folder = cache_dir() if folder is None else Path(folder)
    kind = "-blocks" if quantized else ""
    return folder / f"{gguf_path.stem}-{_digest(gguf_path)}{kind}-v{CACHE_VERSION}.safetensors"


def write_cache(file: Path, ckpt) -> None:
    """Store a :class:`~attnmask.pretrained.gguf_file.GGUFCheckpoint` as one safetensors file (weights, and
    config/tokenizer/template as metadata; quantized blocks as ``blocks.<name>`` uint8 tensors)."""
    from safetensors.torch import save_file

    meta = {
        "config": json.dumps(ckpt.config.to_dict()),
        "tokenizer": ckpt.tokenizer.to_str(),
        "special_ids": json.dumps(ckpt.special_ids),
        "add_bos": json.dumps(ckpt.add_bos),
        "chat_template": json.dumps(ckpt.chat_template),
        "blocks": json.dumps({name: kind for name, (kind, _) in ckpt.blocks.items()}),
    }
    tensors = {**ckpt.state_dict, **{f"{_BLOCKS}{name}": raw.contiguous() for name, (_, raw) in ckpt.blocks.items()}}
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, file)  # atomic: a concurrent reader sees the whole file or none


@dataclass
class Checkpoint:
    """What a GGUF file holds for :func:`attnmask.pretrained.load`, from the file or the cache."""

    config: ModelConfig
    state_dict: dict[str, Tensor]
    tokenizer: object
    special_ids: dict
    add_bos: bool
    chat_template: str | None
    blocks: dict = field(default_factory=dict)


def _read_cache(file: Path) -> Checkpoint:
    from safetensors import safe_open
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(file))
    kinds = json.loads(meta.get("blocks", "{}"))
    return Checkpoint(
        config=ModelConfig.from_dict(json.loads(meta["config"])),
        state_dict={k: v for k, v in tensors.items() if not k.startswith(_BLOCKS)},
        tokenizer=Tokenizer.from_str(meta["tokenizer"]),
        special_ids=json.loads(meta["special_ids"]),
        add_bos=json.loads(meta["add_bos"]),
        chat_template=json.loads(meta["chat_template"]),
        blocks={name: (kind, tensors[f"{_BLOCKS}{name}"]) for name, kind in kinds.items()},
    )


def read(path: Path, cache: bool | str | os.PathLike, quantized: bool = False) -> Checkpoint:
    """The checkpoint of a GGUF file, from the cache when it has it (parsing a file's metadata alone
    takes seconds); ``quantized`` keeps the linear layers' blocks (a cache file of its own)."""
    from attnmask.pretrained.gguf_file import read_gguf

    file = None
    if cache:
        file = cache_file(path, None if cache is True else cache, quantized=quantized)
        if file.is_file():
            try:
                return _read_cache(file)
            except Exception as err:  # a truncated or foreign file: rebuild it
                warnings.warn(f"ignoring unreadable cache {file}: {err}", stacklevel=3)
    ckpt = read_gguf(path, keep_blocks=quantized)
    if file is not None:
        try:
            write_cache(file, ckpt)
        except OSError as err:  # a read-only home must not stop the model from loading
            warnings.warn(f"could not write the weight cache {file}: {err}", stacklevel=3)
    fields = (ckpt.config, ckpt.state_dict, ckpt.tokenizer, ckpt.special_ids, ckpt.add_bos, ckpt.chat_template)
    return Checkpoint(*fields, blocks=ckpt.blocks)
