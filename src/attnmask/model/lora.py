"""LoRA: low-rank adapters on a model's linear layers (Hu et al., 2021).

:func:`add_lora` wraps each targeted ``nn.Linear`` (matched by its attribute name: ``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``, ``lm_head``) in a
:class:`LoRALinear`, which computes::

    y = base(x) + (x A^T) B^T * alpha / r        A: (r, in), B: (out, r)

``A`` starts random (Kaiming-uniform, as PEFT) and ``B`` at zero, so the wrapped model computes
exactly what the base model computes until ``B`` is trained. Every base parameter is frozen: only
``A`` and ``B`` get gradients. :func:`lora_state_dict` holds the adapters alone (what a LoRA run
saves), :func:`load_lora` puts them back into a model wrapped alike, and :func:`merge_lora`
folds them into plain linear layers (``W + B A * alpha / r``) for export or fast decoding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from attnmask.errors import UserError
from attnmask.linear import Linear, linear

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTER_KEYS = ("lora_a", "lora_b")


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (see the module docstring)."""

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float):
        super().__init__()
        if rank < 1:
            raise UserError(f"LoRA rank={rank}; expected a positive int")
        self.base = base
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        w = base.weight
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, dtype=w.dtype, device=w.device))  # (r, in)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=w.dtype, device=w.device))  # (out, r)
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        # x A^T B^T, through attnmask's products (bfloat16 through float32 where the CPU's bfloat16 is slow)
        update = linear(linear(x, self.lora_a), self.lora_b)  # (..., in) -> (..., r) -> (..., out)
        return self.base(x) + update * self.scale

    def merged(self) -> nn.Linear:
        """A plain linear layer computing the same function (``W + B A * alpha / r``)."""
        base = self.base
        out = Linear(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        with torch.no_grad():
            delta = (self.lora_b.to(torch.float64) @ self.lora_a.to(torch.float64)) * self.scale  # (out, in)
            merged = (base.weight.to(torch.float64) + delta).to(base.weight.dtype)
            out.weight = nn.Parameter(merged, requires_grad=base.weight.requires_grad)
            if base.bias is not None:
                out.bias = nn.Parameter(base.bias.detach().clone(), requires_grad=base.bias.requires_grad)
        return out

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}"


def parse_targets(targets: str | Iterable[str]) -> tuple[str, ...]:
    """``"q_proj,v_proj"`` (or a list, or ``"all"``) -> the module names; unknown names are refused."""
    names = [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets) if t.strip()]
    if names == ["all"]:
        return TARGETS[:-1]  # every projection; the (often tied) lm_head only when named
    unknown = [n for n in names if n not in TARGETS]
    if unknown or not names:
        raise UserError(f"LoRA targets {names}; expected a comma-separated subset of {', '.join(TARGETS)} or 'all'")
    return tuple(dict.fromkeys(names))


def add_lora(model: nn.Module, *, rank: int, alpha: float, targets: str | Iterable[str] = DEFAULT_TARGETS) -> list[str]:
    """Wrap the targeted linear layers of ``model`` in :class:`LoRALinear`, in place, and freeze
    everything else. Returns the wrapped modules' names.

    Raises:
        ValueError: an unknown target name, a target that matches nothing, a tied ``lm_head``
            (its weight is the embedding), or projections fused by ``fuse_projections_``.
    """
    names = parse_targets(targets)
    if any(getattr(m, "qkv_proj", None) is not None or getattr(m, "gate_up_proj", None) is not None
           for m in model.modules()):  # fmt: skip
        raise UserError("the model's projections are fused (fuse_projections_); load it with fuse=False for LoRA")
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for path, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            raise UserError(f"{path} already has a LoRA adapter")
        parent, _, child = path.rpartition(".")
        if child not in names or not isinstance(module, nn.Linear):
            continue
        embeddings = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
        if child == "lm_head" and any(module.weight is w for w in embeddings):
            raise UserError("lm_head is tied to the embedding; LoRA on it would change the embedding too")
        model.get_submodule(parent).register_module(child, LoRALinear(module, rank=rank, alpha=alpha))
        wrapped.append(path)
    if not wrapped:
        raise UserError(f"no linear layer named {list(names)} in the model; expected some of {', '.join(TARGETS)}")
    return wrapped


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapters alone: ``{"<module>.lora_a": (r, in), "<module>.lora_b": (out, r)}``."""
    modules = lora_modules(model).items()
    return {f"{name}.{key}": getattr(m, key).detach() for name, m in modules for key in ADAPTER_KEYS}


def load_lora(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy :func:`lora_state_dict` output into a model wrapped by :func:`add_lora` alike.

    Raises:
        ValueError: names or shapes differ.
    """
    mine = lora_state_dict(model)
    if set(mine) != set(state):
        missing, extra = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
        raise UserError(f"LoRA adapters do not fit the model: missing {missing[:4]}, unexpected {extra[:4]}")
    modules = lora_modules(model)
    with torch.no_grad():
        for key, value in state.items():
            name, _, attr = key.rpartition(".")
            target = getattr(modules[name], attr)
            if target.shape != value.shape:
                raise UserError(f"LoRA adapter {key} has shape {tuple(value.shape)}; expected {tuple(target.shape)}")
            target.copy_(value)


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every :class:`LoRALinear` by its merged linear layer, in place (its parameters keep
    the base layer's ``requires_grad``)."""
    for name, m in lora_modules(model).items():
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).register_module(child, m.merged())
    return model
