"""Autoregressive decoding with a KV cache (seed 000).

Greedy decoding starts from ``<sos>`` (encoder-decoder) or from a prompt (decoder-only), takes the
arg-max of the last position's logits, appends it, and repeats until ``<eos>`` or a length limit.
The logits of positions already decoded never change as the output grows (the look-ahead mask
hides later tokens), so their keys and values are kept in an :class:`~attnmask.model.cache.KVCache` and
each step runs only the new token through the decoder, and only the last position through
``W_pred``.

The pieces, small and separate (gpt-fast style):

- :func:`start`: encode the source once / prefill the prompt; returns a :class:`DecodeState` and
  the first logits;
- :func:`decode_step`: one token per row through the decoder -> logits ``(B, V)``;
- :func:`attnmask.decode.sampling.sample`: arg-max (temperature 0), or a draw with temperature, top-k,
  top-p and an explicit ``torch.Generator``;
- :func:`stream`: the loop, yielding each step's tokens ``(B,)`` as they come;
- :func:`greedy` / :func:`generate_ids`: the loop collected into id lists;
- :mod:`attnmask.decode.beam`: beam search on the same pieces;
- :func:`translate` / :func:`generate`: text in, text out.

Batches: every row stops on its own. A finished row emits ``<pad>`` in :func:`stream` and is dropped
from the batch (its cache rows too), so it costs nothing afterwards; results never contain it.

Padding: prompts of different lengths are *left*-padded so that every row's last real token is in
the last column, where the next token's logits come from. Positions come from the padding
(``cumsum(keep) - 1``), so each row's tokens sit at the positions they would have alone. The
self-attention mask is ``masks.causal() & masks.padding(keep=...)`` over all cached keys
(bottom-right aligned: the new queries are the last keys); cross-attention masks source padding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from attnmask import masks
from attnmask.attention import PreparedMask, prepare_mask
from attnmask.data.tokenizer import EOS_ID, SOS_ID
from attnmask.decode.sampling import GREEDY, Sampling, sample
from attnmask.decode.static import CompiledStep, bucket, decode_one, zero_unwritten
from attnmask.errors import UserError
from attnmask.model.cache import KVCache

Ids = Sequence[Sequence[int]] | Tensor  # token ids: lists of rows, or a (B, T) tensor


# ---------------------------------------------------------------------------------------------
# Batches of token ids
# ---------------------------------------------------------------------------------------------
def pad_batch(seqs: Ids, pad_id: int | None, *, side: str, device=None) -> tuple[Tensor, Tensor | None]:
    """Id lists -> ``ids (B, T)`` padded on ``side`` and ``keep (B, T)`` (True = real token), or
    ``keep=None`` when no row is padded. A tensor is taken as padded already (pads = ``pad_id``).

    Raises ValueError for an empty batch or an empty sequence.
    """
    if isinstance(seqs, Tensor):
        if seqs.dim() != 2 or seqs.shape[0] == 0 or seqs.shape[1] == 0:
            raise UserError(f"expected token ids of shape (B, T) with B, T >= 1, got {tuple(seqs.shape)}")
        ids = seqs.to(device=device, dtype=torch.long)
        keep = ids != pad_id if pad_id is not None else torch.ones_like(ids, dtype=torch.bool)  # (B, T)
    else:
        seqs = [list(s) for s in seqs]
        if not seqs:
            raise UserError("empty batch: expected at least one sequence of token ids")
        for i, s in enumerate(seqs):
            if not s:
                raise UserError(f"sequence {i} is empty; expected at least one token id")
        T = max(len(s) for s in seqs)
        # pad_id None (pretrained LMs: every id is real): any filler will do, keep masks it
        ids = torch.full((len(seqs), T), 0 if pad_id is None else pad_id, dtype=torch.long)  # (B, T)
        keep = torch.zeros(len(seqs), T, dtype=torch.bool)  # (B, T)
        for b, s in enumerate(seqs):
            cols = slice(T - len(s), T) if side == "left" else slice(0, len(s))
            ids[b, cols] = torch.tensor(s, dtype=torch.long)
            keep[b, cols] = True
        ids, keep = ids.to(device), keep.to(device)
    if not bool(keep.any(dim=1).all()):
        raise UserError("a sequence holds only padding; expected at least one real token per row")
    return ids, (None if bool(keep.all()) else keep)


def source_ids(tokenizer, sentences: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
    """Encoder inputs as training built them (:func:`attnmask.data.make_translation_batch`): each
    sentence's tokens, then ``<eos>``. ``sentences`` are strings, or token id lists (already encoded,
    without specials). The one place decoding writes this convention.
    """
    sentences = list(sentences)
    eos = getattr(tokenizer, "eos_id", EOS_ID)
    if all(isinstance(s, str) for s in sentences):
        rows = (
            tokenizer.encode_batch(sentences)
            if hasattr(tokenizer, "encode_batch")
            else map(tokenizer.encode, sentences)
        )
    else:
        rows = [tokenizer.encode(s) if isinstance(s, str) else s for s in sentences]
    return [list(r) + [eos] for r in rows]


DEFAULT_NEW_TOKENS = 200  # decoder-only text: the default of generate() and `attnmask generate`


def default_max_new_tokens(src_len: int, model_max: int) -> int:
    """The one default length limit of a translation: ``1.5 * src_len + 10`` new tokens for a source
    of ``src_len`` tokens (``<eos>`` included), at most ``model_max`` (fairseq's ``max_len_a * src_len
    + max_len_b`` rule). ``model_max`` is right: the decoder feeds ``<sos>`` and all but the last
    generated token, ``model_max`` positions at most."""
    return min(int(1.5 * src_len) + 10, model_max)


default_max_len = default_max_new_tokens  # the earlier name


# ---------------------------------------------------------------------------------------------
# State and the two forward passes
# ---------------------------------------------------------------------------------------------
@dataclass
class DecodeState:
    """What one decoding run carries from step to step (one row per hypothesis).

    The key padding of one-token steps is built once, before the first step: a single query sits at
    the bottom-right of the score matrix, so its causal row allows every cached key and only key
    padding is left to mask.
    """

    cache: KVCache
    self_allowed: Tensor | None  # (B, 1, 1, Tmax) bool key padding; None = nothing padded
    next_pos: Tensor  # (B,) position of the next token each row feeds
    src_allowed: Tensor | None  # (B, 1, 1, S) bool source key padding; None = nothing padded
    n_heads: int

    @property
    def cross_mask(self) -> PreparedMask | None:
        """``src_allowed`` resolved for a one-token step of :meth:`Transformer.decode`."""
        return _cross_mask(self.src_allowed, self.n_heads)

    @property
    def rows(self) -> int:
        return self.next_pos.shape[0]

    def step_mask(self) -> PreparedMask:
        """Self-attention mask of the next one-token step over all ``pos + 1`` keys."""
        B, Tk = self.rows, self.cache.pos + 1
        allowed = None if self.self_allowed is None else self.self_allowed[..., :Tk]  # (B, 1, 1, Tk)
        return prepare_mask(allowed, B, self.n_heads, 1, Tk)

    def select(self, index: Tensor, *, cross: bool = True) -> None:
        """Keep rows ``index`` (B',) in that order (drop finished rows; reorder or copy beams).

        ``cross=False`` leaves the cached encoder keys/values alone: valid when every row keeps
        its own source (beams of one sentence reordered among themselves, same ``B``).
        """
        self.cache.reorder(index, cross=cross)
        if self.self_allowed is not None:
            self.self_allowed = self.self_allowed[index]  # (B', 1, 1, Tmax)
        self.next_pos = self.next_pos[index]  # (B',)
        if cross and self.src_allowed is not None:
            self.src_allowed = self.src_allowed[index]  # (B', 1, 1, S)


def _cross_mask(src_allowed: Tensor | None, n_heads: int) -> PreparedMask | None:
    if src_allowed is None:
        return None
    B, _, _, S = src_allowed.shape
    return prepare_mask(src_allowed, B, n_heads, 1, S)


StopIds = int | Sequence[int] | None


def stop_set(eos_id: StopIds) -> frozenset[int]:
    """The ids that end a row: ``eos_id`` may be one id, several (chat models), or None (never)."""
    if eos_id is None:
        return frozenset()
    return frozenset([int(eos_id)] if isinstance(eos_id, int) else (int(i) for i in eos_id))


def is_stop(tokens: Tensor, stops: frozenset[int]) -> Tensor:
    """Bool tensor shaped like ``tokens``: True where a token ends its row."""
    if not stops:
        return torch.zeros_like(tokens, dtype=torch.bool)
    return torch.isin(tokens, torch.tensor(sorted(stops), device=tokens.device))


def _check_length(n: int, what: str, model_max: int) -> None:
    if n > model_max:
        raise UserError(f"{what} has {n} tokens, longer than the model's maximum of {model_max} (max_seq_len)")


def _row_limits(max_new_tokens, B: int, room: Tensor) -> Tensor:
    """Per-row limits ``(B,)``: the requested ones, capped by the room left before max_seq_len."""
    if max_new_tokens is None:
        limits = room.clone()
    else:
        limits = torch.as_tensor(max_new_tokens, dtype=torch.long).expand(B).clone()  # (B,)
        if bool((limits < 1).any()):
            raise UserError(f"max_new_tokens must be >= 1, got {limits.tolist()}")
    return torch.minimum(limits, room)


@torch.inference_mode()
def start(
    model,
    *,
    src: Ids | None = None,
    prompts: Ids | None = None,
    max_new_tokens: int | Sequence[int] | None = None,
    beams: int = 1,
    sos_id: int = SOS_ID,
    all_logits: bool = False,
    whole_buckets: bool = False,
    min_capacity: int = 0,
) -> tuple[DecodeState, Tensor, Tensor]:
    """Encode the source once (encoder-decoder) or prefill the prompts (decoder-only).

    Args:
        src: encoder-decoder sources, id lists (right-padded here) or ``(B, S)`` ids; the decoder
            starts from ``<sos>``.
        prompts: decoder-only prompts, id lists (left-padded here) or ``(B, P)`` ids whose last
            column is real for every row.
        max_new_tokens: tokens to generate per row (an int or one per row); None = as many as the
            model's ``max_seq_len`` allows. Capped at what ``max_seq_len`` allows.
        beams: the cache has room for ``B * beams`` rows (beam search copies rows into it).
        all_logits: return logits for every prompt position ``(B, T, V)`` instead of the last.
        whole_buckets: round the cache's length up to a bucket of :class:`CompiledStep`, and to
            at least ``min_capacity`` (a compiled step keeps one cache length, so that the strides
            of the cache, which its graphs are specialized on, stay the same).

    Returns ``(state, logits (B, V), limits (B,))``.

    Raises ValueError for the wrong input kind, empty inputs, or inputs longer than the model's
    maximum.
    """
    cfg = model.config
    device = next(model.parameters()).device
    model_max = cfg.max_seq_len
    memory = src_keep = None
    if model.is_encoder_decoder:
        if src is None or prompts is not None:
            raise UserError("an encoder-decoder model decodes from src=..., not prompts=")
        src_ids, src_keep = pad_batch(src, cfg.pad_id, side="right", device=device)  # (B, S)
        _check_length(src_ids.shape[1], "the source", model_max)
        memory = model.encode(src_ids, None if src_keep is None else masks.padding(keep=src_keep))  # (B, S, C)
        B = src_ids.shape[0]
        ids = torch.full((B, 1), sos_id, dtype=torch.long, device=device)  # (B, 1)
        keep = None
        room = torch.full((B,), model_max, dtype=torch.long, device=device)  # fed positions 0 .. limit-1
    else:
        if prompts is None or src is not None:
            raise UserError("a decoder-only model decodes from prompts=..., not src=")
        ids, keep = pad_batch(prompts, cfg.pad_id, side="left", device=device)  # (B, P)
        if keep is not None and not bool(keep[:, -1].all()):
            raise UserError("prompts must be left-padded: the last column must be a real token in every row")
        B = ids.shape[0]
        lengths = keep.sum(1) if keep is not None else torch.full((B,), ids.shape[1], device=device)  # (B,)
        _check_length(int(lengths.max()), "the prompt", model_max)
        room = model_max - lengths + 1  # the last generated token is never fed
    limits = _row_limits(max_new_tokens, B, room.cpu()).to(device)  # (B,)

    T = ids.shape[1]
    capacity = T + int(limits.max())
    if whole_buckets:  # a compiled step attends over buckets of 64, 128, 256... cached columns
        capacity = max(bucket(capacity), min_capacity)
    cache = KVCache.for_model(model, batch_size=B * beams, max_len=capacity)
    self_allowed = None
    if keep is not None:
        keep_all = torch.ones(B, capacity, dtype=torch.bool, device=device)  # (B, Tmax): generated = real
        keep_all[:, :T] = keep
        self_allowed = masks.padding(keep=keep_all).to_bool(B, 1, capacity)  # (B, 1, 1, Tmax)
        positions = (keep.cumsum(1) - 1).clamp(min=0)  # (B, T): each row counts from its first real token
        mask = masks.causal() & masks.padding(keep=keep)
    else:
        positions = torch.arange(T, device=device).expand(B, T)  # (B, T)
        mask = masks.causal()
    src_allowed = None
    if src_keep is not None:
        src_allowed = masks.padding(keep=src_keep).to_bool(B, 1, src_keep.shape[1])  # (B, 1, 1, S)
    state = DecodeState(
        cache=cache,
        self_allowed=self_allowed,
        next_pos=positions[:, -1] + 1,
        src_allowed=src_allowed,
        n_heads=cfg.n_heads,
    )
    logits = model.decode(
        ids,
        memory,
        memory_mask=None if src_keep is None else masks.padding(keep=src_keep),
        mask=mask,
        positions=positions,
        cache=cache,
        last_only=not all_logits,
    )  # (B, T|1, V)
    return state, (logits if all_logits else logits[:, -1]), limits


@torch.inference_mode()
def decode_step(model, state: DecodeState, tokens: Tensor, step=None) -> Tensor:
    """Feed one token per row ``(B,)``; returns the next logits ``(B, V)``.

    Runs :func:`attnmask.decode.static.decode_one` (or ``step``, a
    :class:`~attnmask.decode.static.CompiledStep`) over the state's cache.
    """
    run = decode_one if step is None else (lambda m, *a: step(*a))
    logits = run(model, state.cache, tokens, state.next_pos, state.self_allowed, state.src_allowed)  # (B, V)
    state.next_pos += 1
    return logits


@contextlib.contextmanager
def eval_mode(model):
    """Decode without dropout; restore the model's mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------
@torch.inference_mode()  # on a generator function torch re-enters the mode around every step
def _steps(
    model,
    *,
    src,
    prompts,
    max_new_tokens,
    sampling: Sampling,
    eos_id,
    sos_id,
    compile: bool | CompiledStep = False,
) -> Iterator[tuple[int, Tensor, Tensor]]:
    """The decoding loop: yields ``(B, rows (b,), tokens (b,))`` for the rows still running.

    Eager: finished rows leave the batch (their cache rows too). Compiled (``compile`` True or a
    :class:`CompiledStep`): every row stays, so the step keeps its shapes; a finished row's
    token is ignored and it is not yielded.
    """
    stops = stop_set(eos_id)
    step_fn = _compiled_step(model, compile)
    with eval_mode(model):
        state, logits, limits = start(
            model,
            src=src,
            prompts=prompts,
            max_new_tokens=max_new_tokens,
            sos_id=sos_id,
            whole_buckets=step_fn is not None,
            min_capacity=0 if step_fn is None else step_fn.capacity,
        )
        if step_fn is not None:
            step_fn.capacity = max(step_fn.capacity, state.cache.max_len)
            zero_unwritten(state.cache)
        B = state.rows
        rows = torch.arange(B, device=limits.device)  # (b,) original row of each running row
        alive = torch.ones(B, dtype=torch.bool, device=limits.device)  # compiled: rows not finished yet
        step = 0
        while True:
            if step_fn is None:
                tokens = sample(logits, sampling)  # (b,)
                yield B, rows, tokens
            else:  # draw for the running rows only, as eager does: the same generator stream
                tokens = torch.zeros(B, dtype=torch.long, device=logits.device)  # (B,)
                tokens[alive] = sample(logits[alive], sampling)
                yield B, rows[alive], tokens[alive]
            step += 1
            done = (limits[rows] <= step) | is_stop(tokens, stops)  # (b,)
            if step_fn is not None:
                alive &= ~done
                if not bool(alive.any()):
                    return
            elif bool(done.any()):
                running = (~done).nonzero().squeeze(1)  # (b',)
                if running.numel() == 0:
                    return
                # finished rows leave the batch: their cache rows are dropped, not computed on
                state.select(running)
                rows, tokens = rows[running], tokens[running]
            logits = decode_step(model, state, tokens, step_fn)  # (b, V)


def _compiled_step(model, compile) -> CompiledStep | None:
    if isinstance(compile, CompiledStep):
        if compile.model is not model:
            raise UserError("compile=CompiledStep(...) was built for another model")
        return compile
    return CompiledStep(model) if compile else None


def stream(
    model,
    *,
    src: Ids | None = None,
    prompts: Ids | None = None,
    max_new_tokens: int | Sequence[int] | None = None,
    sampling: Sampling | None = None,
    eos_id: StopIds = EOS_ID,
    sos_id: int = SOS_ID,
    compile: bool | CompiledStep = False,
    **sampling_keywords,
) -> Iterator[Tensor]:
    """Yield each step's tokens ``(B,)`` as they are chosen; finished rows get ``<pad>``.

    A row finishes after emitting ``eos_id`` (which is yielded; several ids may be given, None never
    stops) or at its length limit; the loop ends when every row has. ``sampling`` defaults to
    :data:`~attnmask.decode.sampling.GREEDY`; the keywords ``temperature``, ``top_k``, ``top_p``,
    ``generator`` are accepted instead. See :func:`start` for the inputs.
    """
    pad_id = model.config.pad_id if model.config.pad_id is not None else 0
    for B, rows, tokens in _steps(
        model,
        src=src,
        prompts=prompts,
        max_new_tokens=max_new_tokens,
        sampling=Sampling.of(sampling, GREEDY, **sampling_keywords),
        eos_id=eos_id,
        sos_id=sos_id,
        compile=compile,
    ):
        out = torch.full((B,), pad_id, dtype=torch.long, device=tokens.device)  # (B,)
        out[rows] = tokens
        yield out


def generate_ids(
    model,
    *,
    src: Ids | None = None,
    prompts: Ids | None = None,
    max_new_tokens: int | Sequence[int] | None = None,
    sampling: Sampling | None = None,
    eos_id: StopIds = EOS_ID,
    sos_id: int = SOS_ID,
    compile: bool | CompiledStep = False,
    **sampling_keywords,
) -> list[list[int]]:
    """The generated ids of each row (what :func:`stream` yields), without the final ``<eos>``."""
    stops = stop_set(eos_id)
    out: list[list[int]] | None = None
    for B, rows, tokens in _steps(
        model,
        src=src,
        prompts=prompts,
        max_new_tokens=max_new_tokens,
        sampling=Sampling.of(sampling, GREEDY, **sampling_keywords),
        eos_id=eos_id,
        sos_id=sos_id,
        compile=compile,
    ):
        if out is None:
            out = [[] for _ in range(B)]
        for r, t in zip(rows.tolist(), tokens.tolist()):
            if t not in stops:
                out[r].append(t)
    return out


def greedy(
    model,
    *,
    src: Ids | None = None,
    prompts: Ids | None = None,
    max_new_tokens: int | Sequence[int] | None = None,
    eos_id: StopIds = EOS_ID,
    sos_id: int = SOS_ID,
    compile: bool | CompiledStep = False,
) -> list[list[int]]:
    """Seed 000's greedy decoding: from ``<sos>`` (or the prompt), arg-max, append, until ``<eos>``
    or ``max_new_tokens``. Returns the generated ids of each row, without ``<eos>``."""
    return generate_ids(
        model,
        src=src,
        prompts=prompts,
        max_new_tokens=max_new_tokens,
        sampling=GREEDY,
        eos_id=eos_id,
        sos_id=sos_id,
        compile=compile,
    )
