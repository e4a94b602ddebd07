"""Deliberately broken Transformers: the leaks :mod:`attnmask.audit` exists to catch.

Each fault is the bug as it shows up in real code, in a subclass that changes one method. Use
:func:`inject` to get a broken copy of a model (the original is untouched):

``bidirectional``
    The decoder's self-attention mask lets every position see every other (an encoder mask
    reused in the decoder). First causality leak: output 0 depends on token 1.
``off_by_one``
    The look-ahead mask is written ``j <= i + 1`` instead of ``j <= i``: every position sees the
    next token. First causality leak: (0, 1).
``padding``
    The decoder mask drops its key-padding factor (``causal()`` alone). Right pads stay hidden
    behind the look-ahead mask, but left pads are seen by every real token after them. First
    padding leak: with one pad on the left, output 1 (the first real token) depends on pad 0.
``cumsum``
    A "running summary" of the embeddings computed with a cumulative sum over the *reversed* time
    axis, so position i sums tokens i..T-1 instead of 0..i. First causality leak: (0, 1).
``source_padding`` (encoder-decoder)
    The source mask forgets padding: encoder and cross-attention see source pads. First source
    padding leak: with one pad on the left of the source, output 0 depends on source pad 0.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from attnmask import masks
from attnmask.errors import UserError, UserTypeError
from attnmask.model import ModelConfig, Transformer

__all__ = ["FAULTS", "inject", "tiny_model"]


def _key_padding(model: Transformer, ids: Tensor) -> masks.Mask | None:
    pad = model.config.pad_id
    return None if pad is None else masks.padding(token_ids=ids, pad_id=pad)


def _with_padding(mask: masks.Mask, model: Transformer, ids: Tensor) -> masks.Mask:
    kp = _key_padding(model, ids)
    return mask if kp is None else mask & kp


class BidirectionalDecoder(Transformer):
    def target_mask(self, ids: Tensor) -> masks.Mask:
        everything = masks.from_predicate(lambda b, h, q, kv: torch.ones((), dtype=torch.bool))
        return _with_padding(everything, self, ids)


class OffByOneDecoder(Transformer):
    def target_mask(self, ids: Tensor) -> masks.Mask:
        sees_next = masks.from_predicate(lambda b, h, q, kv: kv <= q + 1, align="bottom_right")
        return _with_padding(sees_next, self, ids)


class PaddingLeakDecoder(Transformer):
    def target_mask(self, ids: Tensor) -> masks.Mask:
        return masks.causal()


class ReversedCumsumDecoder(Transformer):
    def _embed(self, ids: Tensor, positions: Tensor, *, source: bool) -> Tensor:
        x = super()._embed(ids, positions, source=source)  # (B, T, C)
        if source:
            return x
        summary = x.flip(1).cumsum(1).flip(1)  # (B, T, C): position i sums i..T-1, the future
        return x + summary / x.shape[1]


class SourcePaddingLeak(Transformer):
    def source_mask(self, src_ids: Tensor) -> masks.Mask:
        return masks.padding(keep=torch.ones(src_ids.shape, dtype=torch.bool, device=src_ids.device))


FAULTS: dict[str, type[Transformer]] = {
    "bidirectional": BidirectionalDecoder,
    "off_by_one": OffByOneDecoder,
    "padding": PaddingLeakDecoder,
    "cumsum": ReversedCumsumDecoder,
    "source_padding": SourcePaddingLeak,
}
ENCODER_DECODER_ONLY = ("source_padding",)


def inject(model: Transformer, fault: str) -> Transformer:
    """A copy of ``model`` (same weights) with ``fault`` (a key of :data:`FAULTS`)."""
    if fault not in FAULTS:
        raise UserError(f"unknown fault {fault!r}; expected one of {sorted(FAULTS)}")
    if not isinstance(model, Transformer):
        raise UserTypeError(f"inject needs an attnmask Transformer, got {type(model).__name__}")
    if fault in ENCODER_DECODER_ONLY and not model.is_encoder_decoder:
        raise UserError(f"fault {fault!r} breaks the source side; expected an encoder-decoder model")
    broken = copy.deepcopy(model)
    broken.__class__ = FAULTS[fault]
    return broken


def tiny_model(
    arch: str = "decoder", *, positions: str = "sinusoidal", vocab_size: int = 48, seed: int = 0
) -> Transformer:
    """A small random Transformer (2 layers, width 32) to audit, in eval mode.

    Token embeddings are drawn with std 1 instead of the training init's 0.02, as trained
    embeddings are: with std 0.02 the tokens are nearly invisible next to the positions, and a
    leak moves the logits by only ~1e-5, too close to float32 noise to make a good demonstration.
    """
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=vocab_size, arch=arch, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=64, positions=positions
    )
    model = Transformer(cfg)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.Embedding):
                nn.init.normal_(mod.weight, std=1.0)
    return model.eval()
