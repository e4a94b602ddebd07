"""Transformer models: encoder-decoder (translation) and decoder-only (language models).

One config, one implementation. Every mask comes from :mod:`attnmask.masks`:

- encoder self-attention: key padding over the source;
- decoder self-attention: look-ahead (causal) + key padding (seed 004's ``M_total``);
- cross-attention: key padding over the encoder's positions.

Packed batches (several sentences per row, no padding computed) replace the padding by
``document`` masks: each sentence attends within itself, each packed target sentence to its own
source only, and positions restart at every sentence (:meth:`Transformer.forward` with
``segments``).

The prediction head ``W_pred`` (``lm_head``) maps hidden states ``(B, T, C)`` to logits
``(B, T, V)``; :func:`lm_loss` averages cross-entropy over real tokens only (seed 000, eq. 11).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnmask import masks
from attnmask.attention import MultiHeadAttention, prepare_mask
from attnmask.data.collate import IGNORE_INDEX
from attnmask.errors import UserError
from attnmask.linear import Linear
from attnmask.model.config import ModelConfig
from attnmask.model.layers import MLP, Rotary, make_norm, sinusoidal_table
from attnmask.model.loss import head_loss


class TransformerLayer(nn.Module):
    """One Transformer layer: self-attention, optional cross-attention, feed-forward."""

    def __init__(self, cfg: ModelConfig, *, cross: bool):
        super().__init__()
        self.pre = cfg.norm_position == "pre"

        def mha():
            return MultiHeadAttention(
                dim=cfg.dim,
                num_heads=cfg.n_heads,
                num_kv_heads=cfg.n_kv_heads,
                head_dim=cfg.head_dim,
                bias=cfg.bias,
                dropout=cfg.dropout,
                backend=cfg.attn_backend,
            )

        self.self_attn = mha()
        if cfg.qk_norm:
            self.self_attn.q_norm = make_norm(cfg, cfg.head_dim)
            self.self_attn.k_norm = make_norm(cfg, cfg.head_dim)
        self.self_norm = make_norm(cfg)
        self.cross_attn = mha() if cross else None
        self.cross_norm = make_norm(cfg) if cross else None
        self.mlp = MLP(cfg)
        self.mlp_norm = make_norm(cfg)
        # norms of the self-attention and MLP outputs before their residual adds (ModelConfig.post_norms)
        self.post_self_norm = make_norm(cfg) if cfg.post_norms else None
        self.post_mlp_norm = make_norm(cfg) if cfg.post_norms else None
        self.dropout = nn.Dropout(cfg.dropout)

    def _sublayer(self, x: Tensor, norm: nn.Module, fn, post: nn.Module | None = None) -> Tensor:
        # dropout only when training: in eval it is an identity call, 3 per layer
        if self.pre:
            h = fn(norm(x))
            if post is not None:
                h = post(h)
            return x + (self.dropout(h) if self.training else h)
        h = fn(x)
        return norm(x + (self.dropout(h) if self.training else h))

    def forward(
        self,
        x: Tensor,
        self_mask,
        *,
        rope=None,
        memory: Tensor | None = None,
        cross_mask=None,
    ) -> Tensor:
        """``x (B, T, C)``; ``memory (B, S, C)``: the encoder output a decoder layer's cross-attention reads."""
        x = self._sublayer(
            x, self.self_norm, lambda h: self.self_attn(h, mask=self_mask, rope=rope), self.post_self_norm
        )
        if self.cross_attn is not None:
            x = self._sublayer(x, self.cross_norm, lambda h: self.cross_attn(h, context=memory, mask=cross_mask))
        return self._sublayer(x, self.mlp_norm, self.mlp, self.post_mlp_norm)


@dataclass
class ModelOutput:
    logits: Tensor | None  # (B, T, V), or (B, 1, V) with last_only; None with return_hidden
    loss: Tensor | None = None  # mean cross-entropy over real tokens
    num_tokens: int = 0  # real (non-ignored) label tokens
    hidden: Tensor | None = None  # (B, T, C) before W_pred, with return_hidden


def lm_loss(
    logits: Tensor, labels: Tensor, *, label_smoothing: float = 0.0, reduction: str = "mean"
) -> tuple[Tensor, int]:
    """Cross-entropy over real tokens only: labels equal to ``IGNORE_INDEX`` (-100) are skipped.

    ``reduction="mean"`` averages over the real tokens (seed 000, eq. 11); ``"sum"`` returns the
    sum, for averaging across batches or processes. Returns ``(loss, num_real_tokens)``.
    """
    if logits.shape[:-1] != labels.shape:
        raise UserError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree; expected (B, T, V) and (B, T)"
        )
    n = int((labels != IGNORE_INDEX).sum())
    total = F.cross_entropy(
        # half precision is upcast to float32; float64 (reference checks) stays float64
        logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32)),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
        label_smoothing=label_smoothing,
    )
    if reduction == "sum":
        return total, n
    return total / max(n, 1), n


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
class Transformer(nn.Module):
    """Encoder-decoder or decoder-only Transformer (see :class:`ModelConfig`).

    - ``encode(src_ids) -> memory (B, S, C)`` (encoder-decoder only), run once per source;
    - ``decode(ids, memory, ...) -> logits (B, T, V)``: the decoder over whole sequences (one token a
      step over a KV cache is :mod:`attnmask.decode`'s packed step);
    - ``forward(input_ids, src_ids=None, labels=None)`` for teacher forcing.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.is_encoder_decoder = cfg.arch == "encoder_decoder"
        if self.is_encoder_decoder:
            shared = cfg.src_vocab_size is None or cfg.src_vocab_size == cfg.vocab_size
            self.src_embed = self.embed if shared else nn.Embedding(cfg.src_vocab_size, cfg.dim)
            self.encoder_layers = nn.ModuleList(TransformerLayer(cfg, cross=False) for _ in range(cfg.n_encoder_layers))
            self.encoder_norm = make_norm(cfg) if cfg.final_norm else nn.Identity()
        self.layers = nn.ModuleList(TransformerLayer(cfg, cross=self.is_encoder_decoder) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg) if cfg.final_norm else nn.Identity()
        if cfg.positions == "learned":
            self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.dim)
            if self.is_encoder_decoder:
                self.src_pos_embed = nn.Embedding(cfg.max_seq_len, cfg.dim)
        elif cfg.positions == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(cfg.max_seq_len, cfg.dim), persistent=False)
        else:
            self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
            # the sliding-window layers' own base (ModelConfig.rope_local_theta), unscaled
            self.local_rotary = Rotary(cfg.head_dim, cfg.rope_local_theta) if cfg.rope_local_theta is not None else None
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.lm_head = Linear(cfg.dim, cfg.vocab_size, bias=cfg.lm_head_bias)  # W_pred
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def layer_rotary(self, i: int) -> Rotary | None:
        """The rotary positions of decoder layer ``i``: :attr:`local_rotary` on its sliding-window
        layers when the config sets ``rope_local_theta``, else :attr:`rotary` (None without rotary)."""
        if self.config.positions != "rotary":
            return None
        if self.local_rotary is not None and self.config.layer_window(i) > 0:
            return self.local_rotary
        return self.rotary

    def layer_masks(self, mask, B: int, Tq: int, Tk: int, device) -> list:
        """Each decoder layer's prepared self-attention mask: ``mask``, and ``mask & sliding_window(w)``
        on the layers whose :meth:`ModelConfig.layer_window` is ``w > 0`` (prepared once per window)."""
        H = self.config.n_heads
        prepared = {0: prepare_mask(mask, B, H, Tq, Tk, device=device)}
        out = []
        for i in range(self.config.n_layers):
            w = self.config.layer_window(i)
            if w not in prepared:
                base = masks.from_tensor(mask) if isinstance(mask, Tensor) else mask
                local = masks.causal() & masks.sliding_window(w) if base is None else base & masks.sliding_window(w)
                prepared[w] = prepare_mask(local, B, H, Tq, Tk, device=device)
            out.append(prepared[w])
        return out

    # -- masks (all from attnmask.masks) -----------------------------------------------------
    def source_mask(self, src_ids: Tensor) -> masks.KeyPadding | None:
        """Key padding over the source: encoder self-attention and cross-attention (None without pad_id)."""
        if self.config.pad_id is None:
            return None
        return masks.padding(token_ids=src_ids, pad_id=self.config.pad_id)

    def target_mask(self, ids: Tensor) -> masks.Mask:
        """Seed 004's ``M_total``: look-ahead & key padding over the decoder input (look-ahead alone
        when the config has no pad_id: pass padding explicitly as ``mask=``)."""
        if self.config.pad_id is None:
            return masks.causal()
        return masks.causal() & masks.padding(token_ids=ids, pad_id=self.config.pad_id)

    # -- embeddings ----------------------------------------------------------------------------
    def _embed(self, ids: Tensor, positions: Tensor, *, source: bool) -> Tensor:
        cfg = self.config
        table = self.src_embed if source else self.embed
        x = table(ids)  # (B, T, C)
        if cfg.embed_scale:
            x = x * math.sqrt(cfg.dim)
        if cfg.positions == "learned":
            x = x + (self.src_pos_embed if source else self.pos_embed)(positions)
        elif cfg.positions == "sinusoidal":
            x = x + self.pos_table[positions].to(x.dtype)
        return self.emb_dropout(x)

    def _positions(self, positions: Tensor | None, B: int, T: int, device) -> Tensor:
        """``positions (B, T)``, default ``arange(T)``, checked against a learned or sinusoidal table's
        ``max_seq_len`` without a device-to-host read off the CPU: the default's bound is known on the
        host, explicit positions on an accelerator are asserted on the device."""
        limit = self.config.max_seq_len
        table = self.config.positions != "rotary"
        if positions is None:
            if table and limit < T:
                raise UserError(f"position {T - 1} exceeds the model's max_seq_len={limit}")
            return torch.arange(T, device=device).expand(B, T)
        if not table or not positions.numel() or torch.compiler.is_compiling():  # compiled: the lookup bounds it
            return positions
        if positions.device.type != "cpu":
            torch._assert_async(positions.max() < limit, f"a position exceeds the model's max_seq_len={limit}")
        elif int(positions.max()) >= limit:
            raise UserError(f"position {int(positions.max())} exceeds the model's max_seq_len={limit}")
        return positions

    def _rope(self, positions: Tensor, rotary: Rotary | None = None):
        if self.config.positions != "rotary":
            return None
        cos, sin = (rotary or self.rotary).cos_sin(positions)  # (B, 1, T, D)
        signed = Rotary.signed_sin(sin)  # once per forward, shared by every layer

        def rope(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
            return Rotary.rotate_signed(q, cos, signed), Rotary.rotate_signed(k, cos, signed)

        return rope

    # -- encoder ------------------------------------------------------------------------------
    def encode(self, src_ids: Tensor, src_mask: masks.Mask | None = None, *, positions: Tensor | None = None) -> Tensor:
        """``src_ids (B, S)`` -> memory ``(B, S, C)``. Padding is masked as keys.
        ``positions (B, S)`` default to ``arange(S)`` (packed rows pass positions restarting per sentence)."""
        if not self.is_encoder_decoder:
            raise UserError("encode() needs an encoder-decoder model (ModelConfig.arch='encoder_decoder')")
        B, S = src_ids.shape
        positions = self._positions(positions, B, S, src_ids.device)  # (B, S)
        x = self._embed(src_ids, positions, source=True)
        src_mask = self.source_mask(src_ids) if src_mask is None else src_mask
        pm = prepare_mask(src_mask, B, self.config.n_heads, S, S, device=x.device)
        rope = self._rope(positions)
        for layer in self.encoder_layers:
            x = layer(x, pm, rope=rope)
        return self.encoder_norm(x)

    # -- decoder ------------------------------------------------------------------------------
    def decode(
        self,
        ids: Tensor,
        memory: Tensor | None = None,
        *,
        memory_mask: masks.Mask | None = None,
        mask: masks.Mask | None = None,
        positions: Tensor | None = None,
        last_only: bool = False,
        return_hidden: bool = False,
    ) -> Tensor:
        """Decoder stack and prediction head over whole sequences (teacher forcing; decoding one token
        at a time is :mod:`attnmask.decode`'s packed step over a paged cache).

        Args:
            ids: ``(B, T)`` decoder input.
            memory: encoder output ``(B, S, C)`` for encoder-decoder models.
            memory_mask: key padding over ``memory`` (``source_mask(src_ids)``).
            mask: self-attention mask over ``(T, T)``; default look-ahead & key padding from ``ids``.
            positions: ``(B, T)`` absolute positions; default ``arange(T)``.
            last_only: only the last position goes through ``W_pred``.
        Returns logits ``(B, T|1, V)`` (hidden states ``(B, T, C)`` with ``return_hidden``).
        """
        B, T = ids.shape
        if self.is_encoder_decoder and memory is None:
            raise UserError("an encoder-decoder model's decoder needs memory: the encoder output (B, S, C)")
        positions = self._positions(positions, B, T, ids.device)  # (B, T)
        if mask is None:
            mask = self.target_mask(ids)
        x = self._embed(ids, positions, source=False)
        layer_pm = self.layer_masks(mask, B, T, T, x.device)
        cross_pm = None
        if self.is_encoder_decoder:
            cross_pm = prepare_mask(memory_mask, B, self.config.n_heads, T, memory.shape[1], device=x.device)
        ropes = {}  # one cos/sin per rotary module, shared by its layers
        for i in range(self.config.n_layers):
            rotary = self.layer_rotary(i)
            if id(rotary) not in ropes:
                ropes[id(rotary)] = self._rope(positions, rotary)
        for i, layer in enumerate(self.layers):
            x = layer(x, layer_pm[i], rope=ropes[id(self.layer_rotary(i))], memory=memory, cross_mask=cross_pm)
        x = self.norm(x)
        if last_only:
            x = x[:, -1:]  # (B, 1, C)
        return x if return_hidden else self.lm_head(x)  # (B, T|1, V)

    def forward(
        self,
        input_ids: Tensor,
        src_ids: Tensor | None = None,
        *,
        labels: Tensor | None = None,
        label_smoothing: float = 0.0,
        segments: Tensor | None = None,
        src_segments: Tensor | None = None,
        return_hidden: bool = False,
    ) -> ModelOutput:
        """Teacher forcing: all positions in parallel. ``input_ids (B, T)`` is the decoder input
        (``<sos>`` + target), ``labels (B, T)`` the target + ``<eos>`` with -100 at pads.

        ``return_hidden``: stop before ``W_pred`` and return the hidden states (``hidden``, no
        logits); a loss from ``labels`` then goes through :func:`attnmask.model.loss.head_loss`,
        which never holds the ``(B, T, V)`` logits (training does this).

        Packed rows: ``segments (B, T)`` (and ``src_segments (B, S)`` for an encoder-decoder model)
        number the sentences of each row, in order, each sentence one contiguous run; target sentence
        ``k`` belongs to source sentence ``k``. Attention stays inside a sentence (and a pair),
        positions restart at each sentence, and padding needs no mask of its own: give the padded
        tail a segment id no sentence uses (e.g. -1), and ``IGNORE_INDEX`` labels.
        """
        if (segments is None) != (src_segments is None) and self.is_encoder_decoder:
            raise UserError("packed rows need both segments (B, T) and src_segments (B, S), or neither")
        if src_segments is not None and not self.is_encoder_decoder:
            raise UserError("src_segments is for encoder-decoder models; a decoder-only model takes segments only")
        memory = memory_mask = None
        if self.is_encoder_decoder:
            if src_ids is None:
                raise UserError("an encoder-decoder model needs src_ids (B, S)")
            if src_segments is None:
                memory_mask = self.source_mask(src_ids)
                memory = self.encode(src_ids, memory_mask)
            else:
                src_doc = masks.document(src_segments)
                memory = self.encode(src_ids, src_doc, positions=segment_positions(src_segments))
                memory_mask = masks.document(src_segments, query_segment_ids=segments)
        if segments is None:
            out = self.decode(input_ids, memory, memory_mask=memory_mask, return_hidden=return_hidden)
        else:
            mask = masks.causal() & masks.document(segments)
            out = self.decode(
                input_ids, memory, memory_mask=memory_mask, mask=mask, positions=segment_positions(segments),
                return_hidden=return_hidden,
            )  # fmt: skip
        if return_hidden:
            if labels is None:
                return ModelOutput(logits=None, hidden=out)
            n = int((labels != IGNORE_INDEX).sum())
            total = head_loss(out, self.lm_head, labels, label_smoothing=label_smoothing)
            return ModelOutput(logits=None, loss=total / max(n, 1), num_tokens=n, hidden=out)
        logits = out
        if labels is None:
            return ModelOutput(logits=logits)
        loss, n = lm_loss(logits, labels, label_smoothing=label_smoothing)
        return ModelOutput(logits=logits, loss=loss, num_tokens=n)


def segment_positions(segments: Tensor) -> Tensor:
    """Positions restarting at 0 where each segment begins: ``(B, T)`` segment ids -> ``(B, T)``.

    Segments are contiguous runs (``[[5, 5, 7, 7, 7]]`` -> ``[[0, 1, 0, 1, 2]]``). Computed on the
    device without reading values back, so it runs inside ``torch.compile`` and never stalls a GPU.
    """
    B, T = segments.shape
    idx = torch.arange(T, device=segments.device).expand(B, T)  # (B, T)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    start_of = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values  # (B, T)
    return idx - start_of


def _concat_linear(layers: list[nn.Module]) -> nn.Module | None:
    """One module computing ``cat([layer(x) ...], -1)``: a stacked :class:`attnmask.linear.Linear`, or the layers'
    own ``concat`` (:meth:`attnmask.pretrained.quantized.BlockLinear.concat`); None when they do not stack."""
    kinds = {type(layer) for layer in layers}
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    if issubclass(kind, nn.Linear):
        if len({(layer.in_features, layer.weight.dtype, layer.bias is None) for layer in layers}) != 1:
            return None
        with torch.no_grad():
            fused = Linear(layers[0].in_features, sum(layer.out_features for layer in layers), bias=False)
            fused.weight = nn.Parameter(torch.cat([layer.weight for layer in layers]), requires_grad=False)
            if layers[0].bias is not None:
                fused.bias = nn.Parameter(torch.cat([layer.bias for layer in layers]), requires_grad=False)
        return fused
    concat = getattr(kind, "concat", None)
    try:
        return concat(layers) if concat is not None else None
    except ValueError:  # e.g. block layers of different formats
        return None


def fuse_projections_(model: nn.Module) -> nn.Module:
    """For inference: every self-attention computes q, k and v in one product, every gated MLP
    (SwiGLU, Gemma's tanh-GeGLU) its gate and up projections in one, in place. Each fused product's
    rows are the stacked rows of the separate ones, so each output is the same sum of the same
    products (a wider product may add them in another order: equal up to float32 rounding); at one
    token a step this saves two of every seven matrix calls and their overhead.

    The separate projection modules are removed (``state_dict`` keys change: fuse after loading,
    do not train or save a fused model); a fused attention can no longer attend to a context.
    Layers whose projections cannot stack (different types, block formats or dtypes) are left as they are.
    """
    for block in model.modules():
        if not isinstance(block, TransformerLayer):
            continue
        attn = block.self_attn
        if attn.qkv_proj is None and attn.q_proj is not None:
            fused = _concat_linear([attn.q_proj, attn.k_proj, attn.v_proj])
            if fused is not None:
                attn.qkv_proj = fused
                attn.q_proj = attn.k_proj = attn.v_proj = None
        mlp = block.mlp
        if getattr(mlp, "gated", False) and mlp.gate_up_proj is None and mlp.gate_proj is not None:
            fused = _concat_linear([mlp.gate_proj, mlp.up_proj])
            if fused is not None:
                mlp.gate_up_proj = fused
                mlp.gate_proj = mlp.up_proj = None
    return model
