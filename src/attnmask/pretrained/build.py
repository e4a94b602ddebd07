"""A pretrained checkpoint into attnmask's :class:`~attnmask.model.Transformer`, without a random initialisation.

:func:`build` creates the parameters on the meta device and assigns the checkpoint's tensors (block
weights become :class:`~attnmask.pretrained.quantized.BlockLinear` layers); :func:`column_major_`
stores float32 linear weights column-major, a layout PyTorch's BLAS streams faster in one-token steps.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from attnmask.errors import UserError
from attnmask.model import Rotary, Transformer, sinusoidal_table
from attnmask.model.config import ModelConfig
from attnmask.pretrained.quantized import BlockLinear

__all__ = ["build", "column_major_"]


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
        if config.rope_local_theta is not None:
            model.local_rotary = Rotary(config.head_dim, config.rope_local_theta)
    elif config.positions == "sinusoidal":
        model.pos_table = sinusoidal_table(config.max_seq_len, config.dim)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"tensors left uninitialised: {left}"
    return model


def column_major_(model: nn.Module) -> nn.Module:
    """Store every float32 ``nn.Linear`` weight column-major, in place: same shapes, values and results.

    A one-token decoding step multiplies each weight matrix by one vector; PyTorch's CPU BLAS
    streams a float32 ``(out, in)`` weight faster when each input feature's weights are contiguous
    (``weight = W_t.t()`` with ``W_t`` of shape ``(in, out)``; measured with ``benchmarks/smollm2.py``,
    docs/benchmarks.md). bfloat16 is left alone: its matrix-vector product is *slower* column-major, so
    cast with ``load(dtype=...)``, not ``model.to(...)`` after loading. ``safetensors.save_file``
    refuses non-contiguous tensors: ``.contiguous()`` them before saving.
    """
    with torch.no_grad():
        for module in model.modules():
            w = module.weight if isinstance(module, nn.Linear) else None
            if w is not None and w.dtype == torch.float32 and w.is_contiguous():
                module.weight.data = w.data.t().contiguous().t()  # (out, in), strides (1, out)
    return model
