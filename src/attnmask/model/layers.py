"""Building blocks: norms, the MLP, sinusoidal and rotary positions."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnmask.linear import Linear
from attnmask.model.config import GATED_ACTIVATIONS, ModelConfig


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # normalize in at least float32 for bfloat16 stability, then scale in x's dtype (as Llama
        # does); F.rms_norm computes x * rsqrt(mean(x^2) + eps)
        wide = x.float() if x.element_size() < 4 else x  # float64 stays float64
        normed = F.rms_norm(wide, (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """The config's norm over ``dim`` features (default the model width)."""
    dim = cfg.dim if dim is None else dim
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)


class MLP(nn.Module):
    """Position-wise feed-forward: ``down(act(up(x)))``, or gated ``down(act(gate(x)) * up(x))`` for
    SwiGLU (``act`` = silu) and tanh-GeGLU (``act`` = tanh-approximated gelu)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.activation = cfg.activation
        self.gated = cfg.activation in GATED_ACTIVATIONS
        if self.gated:
            self.gate_proj = Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias)
        self.up_proj = Linear(cfg.dim, cfg.ffn_dim, bias=cfg.bias)
        self.down_proj = Linear(cfg.ffn_dim, cfg.dim, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.gate_up_proj: nn.Module | None = None  # set by fuse_projections_: gate and up in one product

    def act(self, h: Tensor) -> Tensor:
        """The activation alone: of ``up(x)``, or of ``gate(x)`` in a gated MLP."""
        if self.activation in ("swiglu", "silu"):
            return F.silu(h)
        if self.activation in ("geglu_tanh", "gelu_tanh"):
            return F.gelu(h, approximate="tanh")
        if self.activation == "relu":
            return F.relu(h)
        return F.gelu(h)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            h = self.act(gate) * up
        elif self.gated:
            h = self.act(self.gate_proj(x)) * self.up_proj(x)
        else:
            h = self.act(self.up_proj(x))
        return self.down_proj(self.dropout(h) if self.training else h)


def sinusoidal_table(n_pos: int, dim: int) -> Tensor:
    """``(n_pos, dim)``: sines in the first half, cosines in the second (Marian's layout)."""
    half = (dim + 1) // 2
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))  # (ceil(C/2),)
    ang = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv_freq[None]  # (n_pos, ceil(C/2))
    table = torch.zeros(n_pos, dim, dtype=torch.float64)
    table[:, :half] = ang.sin()
    table[:, half:] = ang[:, : dim - half].cos()
    return table.float()


def scale_rope_frequencies(inv_freq: Tensor, scaling: dict) -> Tensor:
    """Long-context frequency scaling, as Hugging Face's ``modeling_rope_utils`` computes it."""
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend in between
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, blended, scaled)


class Rotary(nn.Module):
    """Rotary position embedding, Hugging Face Llama's "rotate half" layout."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # (D/2,)
        if scaling is not None:
            inv_freq = scale_rope_frequencies(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions ``(B, T)`` -> cos, sin ``(B, 1, T, D)``."""
        ang = positions.float()[..., None] * self.inv_freq  # (B, T, D/2)
        emb = torch.cat([ang, ang], dim=-1)[:, None]  # (B, 1, T, D)
        return emb.cos(), emb.sin()

    @staticmethod
    def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        return (x * cos + rotated * sin).to(x.dtype)

    @staticmethod
    def signed_sin(sin: Tensor) -> Tensor:
        """``sin`` with its first half negated, so that ``rotate_half(x) * sin == x.roll(D/2) * signed``."""
        half = sin.shape[-1] // 2
        return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # (B, 1, T, D)

    @staticmethod
    def rotate_signed(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
        """:meth:`rotate` in 3 ops instead of 7 (it runs twice per layer per decoded token); the same
        products and sum, so bitwise the same result."""
        out = x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
        return out if out.dtype == x.dtype else out.to(x.dtype)
