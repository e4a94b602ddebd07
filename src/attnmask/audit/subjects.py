"""What :mod:`attnmask.audit` audits: any model, seen as token ids (+ a 0/1 mask) -> logits.

A :class:`Subject` wraps a model in one calling convention, so every check is written once:

- decoder-only: ``forward(input_ids (B, T) long, attention_mask (B, T) long 0/1) -> logits (B, T, V)``;
- encoder-decoder: ``forward(src_ids (B, S), src_mask (B, S), tgt_ids (B, T), tgt_mask (B, T)) -> (B, T, V)``.

Masks follow Hugging Face's 2-D convention here (1 = real token, 0 = padding), because that is what
foreign models take; they never reach attention in this form (see :func:`attnmask.masks.from_hf`).

Positions are the adapter's business: the adapters below count a token's position from the first
real token of its row (``cumsum(mask) - 1``), as generation with left padding does, so a model's
outputs for real tokens can be compared with and without padding. A model that cannot do that (the
attnmask encoder always numbers source positions from 0) lists only the sides it supports in
``pad_sides`` / ``src_pad_sides``.

Optional extras turn on more checks: ``forward_with_embeds`` (same arguments, returns
``(logits, embeds)`` with ``embeds`` the decoder's input embeddings ``(B, T, C)`` as a leaf that
requires grad) for the gradient check, and ``cached_forward`` (same arguments, same logits computed
token by token with a KV cache, the way the model generates) for cache parity and for causality along
the generation path; ``layer_windows`` and ``layer_calls`` (same arguments, returns each decoder
layer alone, :class:`~attnmask.audit.layers.LayerCall`) for the per-layer reach check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from attnmask import masks
from attnmask.audit.layers import LayerCall, decoder_layers, hf_layer_windows, record_layer_calls
from attnmask.decode.step import SourceMemory, fused_plan, packed_forward
from attnmask.errors import UserError, UserTypeError
from attnmask.model.cache import PagedKVCache

__all__ = ["Subject", "as_subject", "from_callable", "from_transformer", "from_hf", "from_run", "positions_from_mask"]

SIDES = ("left", "right")


@dataclass
class Subject:
    """A model under audit (see the module docstring for the calling conventions)."""

    forward: Callable[..., Tensor]  # ids (+ 0/1 masks) -> logits (B, T, V)
    vocab_size: int  # decoder vocabulary V: random tokens are drawn from [0, V)
    name: str = "model"
    encoder_decoder: bool = False
    src_vocab_size: int | None = None  # encoder vocabulary; None = vocab_size
    pad_id: int = 0  # id written into pad positions (other ids are tried there too)
    special_ids: tuple[int, ...] = ()  # ids never drawn as random tokens (e.g. <pad>)
    pad_sides: tuple[str, ...] = SIDES  # target padding the model handles (positions from the first real token)
    src_pad_sides: tuple[str, ...] = SIDES  # source padding whose *amount* must not matter
    forward_with_embeds: Callable[..., tuple[Tensor, Tensor]] | None = None  # -> (logits, leaf embeds)
    cached_forward: Callable[..., Tensor] | None = None  # same logits, token by token with a KV cache
    # sequences (lists of ids) -> each one's logits (T_i, V), all run together through the serving
    # engine's packed step over a paged cache, ``chunk`` tokens of each a step
    packed_forward: Callable[..., list[Tensor]] | None = None
    # prompts, prefix caching on or off -> each prompt's greedy answer (tokens, log-probabilities) from one
    # serving engine that answers them in turn, and the prompt positions it found kept
    engine_answers: Callable[[list[list[int]], bool], tuple[list[tuple[list[int], list[float]]], int]] | None = None
    # each decoder layer's declared self-attention window (0: every earlier key; w: the last w keys)
    layer_windows: tuple[int, ...] | None = None
    # same arguments as forward -> each decoder layer alone, on what it received in that forward
    layer_calls: Callable[..., list[LayerCall]] | None = None
    max_len: int | None = None  # longest sequence the model takes
    dtype: torch.dtype | None = None  # dtype of the logits (picks the tolerance); None = as returned
    device: torch.device = torch.device("cpu")  # where the audit puts the ids it makes
    notes: list[str] = field(default_factory=list)  # what the adapter could not offer, for the report

    def __post_init__(self):
        if not callable(self.forward):
            raise UserTypeError(f"Subject.forward must be callable, got {type(self.forward).__name__}")
        if not isinstance(self.vocab_size, int) or self.vocab_size < 2:
            raise UserError(f"Subject.vocab_size must be an int >= 2, got {self.vocab_size!r}")
        for name in ("pad_sides", "src_pad_sides"):
            bad = [s for s in getattr(self, name) if s not in SIDES]
            if bad:
                raise UserError(f"Subject.{name} holds {bad}; expected a subset of {SIDES}")

    @property
    def source_vocab_size(self) -> int:
        return self.src_vocab_size or self.vocab_size


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """``(B, T)`` 0/1 -> positions ``(B, T)``: real tokens count from 0 at their row's first real
    token; pads before it get 0 (their outputs are never read)."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)  # (B, T)


def _keep(ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    if attention_mask is None:
        return torch.ones(ids.shape, dtype=torch.bool, device=ids.device)  # (B, T)
    if attention_mask.shape != ids.shape:
        raise UserError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {tuple(ids.shape)}")
    return attention_mask.bool()


def from_callable(
    fn: Callable[..., Tensor],
    *,
    vocab_size: int,
    encoder_decoder: bool = False,
    name: str | None = None,
    **extras,
) -> Subject:
    """Audit a plain callable (see the module docstring for its signature). ``extras`` are any other
    :class:`Subject` fields, e.g. ``forward_with_embeds=`` to enable the gradient check."""
    return Subject(
        forward=fn,
        vocab_size=vocab_size,
        encoder_decoder=encoder_decoder,
        name=name or getattr(fn, "__name__", type(fn).__name__),
        **extras,
    )


# ---------------------------------------------------------------------------------------------
# attnmask Transformers
# ---------------------------------------------------------------------------------------------
def from_transformer(model, *, name: str | None = None) -> Subject:
    """Audit an :class:`attnmask.model.Transformer` (put in eval mode), through its own masks.

    Self-attention masks come from ``model.target_mask`` and ``model.source_mask`` applied to the ids
    with ``pad_id`` written at masked positions, so a model that builds its masks wrongly is caught,
    while other ids written in pad positions still reach the embeddings (and must not leak). With no
    ``pad_id`` in the config, key padding from the 0/1 mask is added to ``model.target_mask``.
    Cached decoding (``cached_forward``) runs what generation runs: the packed step over a paged cache
    (:func:`attnmask.decode.step.packed_forward`), each row's real tokens a sequence of its own, the
    first half in one prefill chunk, then one token a step (encoder-decoders attend to each row's real
    source positions).
    """
    model.eval()
    cfg = model.config
    pad = cfg.pad_id
    enc_dec = bool(model.is_encoder_decoder)

    def self_mask(ids: Tensor, keep: Tensor) -> masks.Mask:
        if pad is None:
            return model.target_mask(ids) & masks.padding(keep=keep)
        return model.target_mask(ids.masked_fill(~keep, pad))

    def memory_of(src: Tensor, src_mask: Tensor | None) -> tuple[Tensor, masks.Mask]:
        keep = _keep(src, src_mask)
        # with a pad id, the model's own source mask over ids with <pad> written where masked
        smask = masks.padding(keep=keep) if pad is None else model.source_mask(src.masked_fill(~keep, pad))
        return model.encode(src, smask), smask

    def run(args, *, embeds_hook: bool = False, hidden: bool = False):
        if enc_dec:
            src, src_mask, ids, mask = args
            memory, memory_mask = memory_of(src, src_mask)
        else:
            (ids, mask), memory, memory_mask = args, None, None
        keep = _keep(ids, mask)
        captured: dict[str, Tensor] = {}
        handle = None
        if embeds_hook:
            # Replace the decoder's token embeddings by a leaf, so gradients can be taken w.r.t. it;
            # registered after encode() because src_embed may be the same module.
            def hook(_mod, _inp, out):
                captured["embeds"] = out.detach().requires_grad_(True)
                return captured["embeds"]

            handle = model.embed.register_forward_hook(hook)
        try:
            logits = model.decode(
                ids,
                memory,
                memory_mask=memory_mask,
                mask=self_mask(ids, keep),
                positions=positions_from_mask(keep),
                return_hidden=hidden,
            )  # (B, T, V), or (B, T, C) with hidden
        finally:
            if handle is not None:
                handle.remove()
        return (logits, captured["embeds"]) if embeds_hook else logits

    def cached(*args) -> Tensor:
        memory = None
        if enc_dec:
            src, src_mask, ids, mask = args
            src_keep = _keep(src, src_mask)
            encoded, _ = memory_of(src, src_mask)  # the encoder under the model's own source mask
            memory = SourceMemory.project(model, encoded, None if bool(src_keep.all()) else src_keep)
        else:
            ids, mask = args
        keep = _keep(ids, mask)
        B, T = ids.shape
        seqs = [row[k].tolist() for row, k in zip(ids.cpu(), keep.cpu())]
        # a prefill of the first half, then one token a step: both paths of a real decoder
        rows = packed(model, seqs, 1, first=[max(1, len(s) // 2) for s in seqs], memory=memory, fused=True)
        out = rows[0].new_zeros(B, T, rows[0].shape[-1])  # (B, T, V): padding positions stay 0
        for b, logits in enumerate(rows):
            out[b, keep[b].to(logits.device)] = logits
        return out  # (B, T, V)

    p = next(model.parameters())
    return Subject(
        forward=lambda *args: run(args),
        forward_with_embeds=lambda *args: run(args, embeds_hook=True),
        cached_forward=cached,
        packed_forward=None if enc_dec else lambda seqs, chunk=4: packed(model, seqs, chunk),
        engine_answers=None if enc_dec else lambda prompts, caching: engine_answers(model, prompts, caching),
        layer_windows=tuple(cfg.layer_window(i) for i in range(cfg.n_layers)),
        layer_calls=lambda *args: record_layer_calls(model.layers, lambda: run(args, hidden=True)),
        vocab_size=cfg.vocab_size,
        src_vocab_size=cfg.src_vocab_size,
        encoder_decoder=enc_dec,
        name=name or f"attnmask Transformer ({cfg.arch}, {cfg.positions} positions)",
        pad_id=0 if pad is None else pad,
        special_ids=() if pad is None else (pad,),
        pad_sides=SIDES,
        # the encoder numbers source positions from 0: left padding shifts them (by design)
        src_pad_sides=("right",) if cfg.positions != "rotary" else SIDES,
        max_len=cfg.max_seq_len,
        dtype=p.dtype,
        device=p.device,
    )


def packed(
    model,
    seqs: list[list[int]],
    chunk: int = 4,
    block_size: int = 4,
    *,
    first: list[int] | None = None,
    memory=None,
    fused: bool = False,
) -> list[Tensor]:
    """Every sequence's logits ``(T_i, V)`` at every position, all sequences run together through the
    packed step every decoding path runs (:func:`attnmask.decode.step.packed_forward`) over one paged
    cache: ``first[i]`` tokens of sequence ``i`` in the first step (default ``chunk``), then ``chunk``
    tokens of each a step, each at its own offset, until all are done. ``memory``: encoder-decoders,
    the :class:`~attnmask.decode.step.SourceMemory` of the sequences' sources (source ``i`` for
    sequence ``i``). ``fused``: the whole step in one native call where the model allows, as generation
    runs it (:func:`~attnmask.decode.step.fused_plan`); else operation by operation, each a Python call
    (the calls a test can watch)."""
    lengths = [len(s) for s in seqs]
    per_seq = [-(-n // block_size) for n in lengths]
    cache = PagedKVCache.for_model(model, num_blocks=1 + sum(per_seq), block_size=block_size)
    tables = torch.zeros(len(seqs), max(1, *per_seq), dtype=torch.long)
    for i, n in enumerate(per_seq):
        tables[i, :n] = torch.tensor(cache.pool.allocate(n))
    device = cache.k[0].device
    plan = fused_plan(model) if fused else None
    done = [0] * len(seqs)
    out: list[list[Tensor]] = [[] for _ in seqs]
    with torch.no_grad():
        while any(d < n for d, n in zip(done, lengths)):
            rows = []
            for i, n in enumerate(lengths):
                take = first[i] if first is not None and done[i] == 0 else chunk
                rows += [(i, t) for t in range(done[i], min(done[i] + take, n))]
                done[i] = min(done[i] + take, n)
            seq_ids = torch.tensor([i for i, _ in rows], device=device)
            positions = torch.tensor([t for _, t in rows], device=device)
            tokens = torch.tensor([int(seqs[i][t]) for i, t in rows], device=device)
            logits = packed_forward(
                model,
                cache,
                tokens,
                positions,
                seq_ids,
                tables.to(device),
                torch.arange(len(rows), device=device),
                plan,
                memory=memory,
                row_src=None if memory is None else seq_ids,
            )  # (N, V)
            for (i, _), row in zip(rows, logits):
                out[i].append(row)
    empty = cache.k[0].new_zeros(0, model.config.vocab_size)  # a sequence with no tokens: no logits
    return [torch.stack(rows) if rows else empty for rows in out]


def engine_answers(
    model, prompts: list[list[int]], caching: bool, *, max_tokens: int = 4, block_size: int = 2
) -> tuple[list[tuple[list[int], list[float]]], int]:
    """Each prompt's greedy answer (tokens, log-probabilities) from one serving engine
    (:class:`attnmask.engine.Engine`, blocks of ``block_size``) that answers them one after another, with
    prefix caching on or off, and the prompt positions it found kept (0 without caching)."""
    from attnmask.engine import Engine, RequestParams

    engine = Engine(model, num_blocks=2 + 2 * sum(-(-(len(p) + max_tokens) // block_size) for p in prompts),
                    block_size=block_size, prefix_caching=caching)  # fmt: skip
    params = RequestParams(max_tokens=max_tokens, logprobs=True)
    answers = [engine.generate([p], params)[0] for p in prompts]
    return [(a.tokens, a.logprobs) for a in answers], engine.stats().tokens_cached


def from_run(path: str | Path) -> Subject:
    """Audit the model of a run directory written by ``attnmask train``."""
    from attnmask.train.rundir import load_run

    run = load_run(path)
    return from_transformer(run.model, name=f"run {run.path} ({run.task}, {run.model.config.arch})")


# ---------------------------------------------------------------------------------------------
# Hugging Face models
# ---------------------------------------------------------------------------------------------
def from_hf(model, *, name: str | None = None) -> Subject:
    """Audit a Hugging Face ``transformers`` model with an LM head (decoder-only, e.g. Llama,
    GPT-2; or encoder-decoder, e.g. Marian, T5), put in eval mode. Decoder-only models get
    ``position_ids`` from the mask, cache parity through ``past_key_values``, and the gradient
    check through ``inputs_embeds``."""
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise UserTypeError(f"from_hf needs a transformers PreTrainedModel, got {type(model).__name__}")
    model.eval()
    cfg = model.config
    vocab = cfg.get_text_config().vocab_size if hasattr(cfg, "get_text_config") else cfg.vocab_size
    pad = getattr(cfg, "pad_token_id", None)
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    label = name or f"Hugging Face {type(model).__name__}"
    if getattr(cfg, "is_encoder_decoder", False):
        return _from_hf_seq2seq(model, vocab=vocab, pad=pad, dtype=dtype, device=device, name=label)

    def forward(ids: Tensor, mask: Tensor | None = None) -> Tensor:
        keep = _keep(ids, mask)
        return model(input_ids=ids, attention_mask=keep.long(), position_ids=positions_from_mask(keep)).logits

    def forward_with_embeds(ids: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        keep = _keep(ids, mask)
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)  # (B, T, C)
        out = model(inputs_embeds=embeds, attention_mask=keep.long(), position_ids=positions_from_mask(keep))
        return out.logits, embeds

    def cached(ids: Tensor, mask: Tensor | None = None) -> Tensor:
        keep = _keep(ids, mask)
        positions = positions_from_mask(keep)
        past, out = None, []
        for t in range(ids.shape[1]):
            res = model(
                input_ids=ids[:, t : t + 1],
                attention_mask=keep[:, : t + 1].long(),
                position_ids=positions[:, t : t + 1],
                past_key_values=past,
                use_cache=True,
            )
            past = res.past_key_values
            out.append(res.logits)  # (B, 1, V)
        return torch.cat(out, dim=1)  # (B, T, V)

    layers = decoder_layers(model)

    def layer_calls(ids: Tensor, mask: Tensor | None = None) -> list[LayerCall]:
        keep = _keep(ids, mask)
        base = model.base_model  # the stack without its LM head: hidden states, no (B, T, V) logits
        kwargs = {"attention_mask": keep.long(), "position_ids": positions_from_mask(keep), "use_cache": False}
        return record_layer_calls(layers, lambda: base(input_ids=ids, **kwargs))

    return Subject(
        forward=forward,
        forward_with_embeds=forward_with_embeds,
        cached_forward=cached,
        layer_windows=None if layers is None else tuple(w or 0 for w in hf_layer_windows(cfg)),
        layer_calls=None if layers is None else layer_calls,
        vocab_size=vocab,
        name=label,
        pad_id=0 if pad is None else pad,
        special_ids=() if pad is None else (pad,),
        max_len=getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None),
        dtype=dtype,
        device=device,
    )


def _from_hf_seq2seq(model, *, vocab: int, pad: int | None, dtype, device, name: str) -> Subject:
    def forward(src: Tensor, src_mask: Tensor | None, ids: Tensor, mask: Tensor | None) -> Tensor:
        return model(
            input_ids=src,
            attention_mask=_keep(src, src_mask).long(),
            decoder_input_ids=ids,
            decoder_attention_mask=_keep(ids, mask).long(),
        ).logits

    def forward_with_embeds(src, src_mask, ids, mask) -> tuple[Tensor, Tensor]:
        embeds = model.get_decoder().get_input_embeddings()(ids).detach().requires_grad_(True)  # (B, T, C)
        out = model(
            input_ids=src,
            attention_mask=_keep(src, src_mask).long(),
            decoder_inputs_embeds=embeds,
            decoder_attention_mask=_keep(ids, mask).long(),
        )
        return out.logits, embeds

    return Subject(
        forward=forward,
        forward_with_embeds=forward_with_embeds,
        vocab_size=vocab,
        encoder_decoder=True,
        name=name,
        pad_id=0 if pad is None else pad,
        special_ids=() if pad is None else (pad,),
        # Hugging Face seq2seq forward() numbers positions from 0 on both sides: right padding only
        pad_sides=("right",),
        src_pad_sides=("right",),
        dtype=dtype,
        device=device,
        notes=["cache parity not offered for Hugging Face encoder-decoder models"],
    )


def _is_hf_model(obj) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(obj).__mro__ if c.__name__ == "PreTrainedModel")


def as_subject(model, **kwargs) -> Subject:
    """A :class:`Subject` for ``model``: a Subject, an attnmask Transformer, a run directory, a
    Hugging Face model, or a callable (then ``vocab_size=`` is required; see :func:`from_callable`)."""
    from attnmask.model import Transformer

    if isinstance(model, Subject):
        return model
    if isinstance(model, Transformer):
        return from_transformer(model, **kwargs)
    if isinstance(model, (str, Path)):
        return from_run(model)
    if _is_hf_model(model):
        return from_hf(model, **kwargs)
    if callable(model):
        if "vocab_size" not in kwargs:
            raise UserError("auditing a plain callable needs vocab_size= (its logits' last dimension)")
        return from_callable(model, **kwargs)
    raise UserTypeError(
        f"cannot audit a {type(model).__name__}; expected an attnmask Transformer, a run directory, "
        "a Hugging Face model, a callable (ids, attention_mask) -> logits, or an audit Subject"
    )
