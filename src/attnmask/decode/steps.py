"""Autoregressive decoding over a paged KV cache (seed 000): greedy, sampled, streamed.

Greedy decoding starts from ``<sos>`` (encoder-decoder) or from a prompt (decoder-only), takes the
arg-max of the last position's logits, appends it, and repeats until ``<eos>`` or a length limit.
The logits of positions already decoded never change as the output grows (the look-ahead mask
hides later tokens), so their keys and values are kept in a :class:`~attnmask.model.cache.PagedKVCache`
and each step runs only the new token of each row through the decoder, and only through ``W_pred``.

Every forward here is the one packed step (:func:`attnmask.decode.step.packed_forward`), which the
serving engine runs too: the prompts of a batch packed in one row of tokens (no padding computed), then
one token per running row a step, each row a sequence with its own block table and its own offset.

The pieces, small and separate (gpt-fast style):

- :func:`start`: encode the sources once / prefill the prompts; returns a :class:`DecodeState` and
  the first logits;
- :func:`decode_step`: one token per row through the packed step -> logits ``(B, V)``;
- :func:`attnmask.decode.sampling.sample`: arg-max (temperature 0), or a draw with temperature, top-k,
  top-p and an explicit ``torch.Generator``;
- :func:`stream`: the loop, yielding each step's tokens ``(B,)`` as they come;
- :func:`greedy` / :func:`generate_ids`: the loop collected into id lists;
- :mod:`attnmask.decode.beam`: beam search on the same pieces (beams share their prefix's blocks);
- :func:`translate` / :func:`generate`: text in, text out.

Batches: every row stops on its own. A finished row emits ``<pad>`` in :func:`stream` and leaves the
batch (its blocks go back to the pool), so it costs nothing afterwards; results never contain it.

Ragged prompts: given as id lists, each row is its own sequence from position 0, packed without
padding; given as a ``(B, P)`` tensor, pads (``pad_id``) are dropped first (left padding: the last
column must be real). A row's tokens sit at the positions they would have alone, and a row's logits
are bitwise the same alone or in any batch (the packed step's batch invariance).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from attnmask.data.tokenizer import EOS_ID, SOS_ID
from attnmask.decode.grammar import mask_rows
from attnmask.decode.sampling import GREEDY, NO_PENALTIES, Penalties, Sampling, TokenHistory, penalize_rows, sample
from attnmask.decode.step import SourceMemory, fused_plan, packed_forward
from attnmask.errors import UserError
from attnmask.model.cache import BlockPool, PagedKVCache, Paging, layer_groups

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
# State: rows over a paged cache
# ---------------------------------------------------------------------------------------------
BLOCK_SIZE = 16  # positions per cache block while decoding
PREFILL_TOKENS = 512  # prompt tokens per packed step at most while prefilling (bounds the activations)


@dataclass(eq=False)
class DecodeState:
    """What one decoding run carries from step to step: one row per running sequence (or hypothesis).

    Row ``r`` owns block table ``tables[g][r]`` of each layer group ``g`` of ``cache`` (one group unless
    the model's layers have several windows); blocks may be held by several rows (the beams of a
    sentence share their prefix): a row about to write into a shared block gets a copy of it first. A
    window group's blocks that fall out of every later row's window go back to the pool as the row
    advances (:meth:`~attnmask.model.cache.Paging.forget`). ``next_pos (b,)``: the position each row
    feeds next; ``row_src (b,)``: the source of each row in ``memory`` (encoder-decoder models).
    """

    model: object
    cache: PagedKVCache
    tables: list[list[list[int]]]  # [group][row]: block ids
    next_pos: Tensor  # (b,)
    memory: SourceMemory | None = None
    row_src: Tensor | None = None  # (b,)
    plan: tuple | None = None  # fused_plan of the model, read once
    _table_tensors: list[Tensor] | None = None  # each group's tables as (b, W), rebuilt when they change

    @property
    def rows(self) -> int:
        return self.next_pos.shape[0]

    def row_tables(self, r: int) -> list[list[int]]:
        """Row ``r``'s table in each group (the lists themselves: changing them changes the state)."""
        return [group[r] for group in self.tables]

    def _tables(self) -> list[Tensor]:
        if self._table_tensors is None:
            out = []
            for group in self.tables:
                width = max(1, max(len(t) for t in group))
                padded = [t + [0] * (width - len(t)) for t in group]  # unused entries: the null block
                out.append(torch.tensor(padded, dtype=torch.long, device=self.cache.k[0].device))
            self._table_tensors = out
        return self._table_tensors

    def forget(self) -> None:
        """Free the window groups' blocks that no row reads again (rows read from ``next_pos`` on)."""
        paging = self.cache.paging
        positions = self.next_pos.tolist() if any(w > 0 for w in paging.windows) else []
        if sum(paging.forget(self.row_tables(r), p) for r, p in enumerate(positions)):
            self._table_tensors = None

    def grow(self, rows: list[int], first: list[int], last: list[int]) -> None:
        """Give row ``rows[i]`` blocks for its positions up to ``last[i]`` (it computes from ``first[i]``
        on: a window group's blocks below that window are freed first)."""
        paging = self.cache.paging
        changed = False
        for r, a, b in zip(rows, first, last):
            tables = self.row_tables(r)
            changed |= paging.forget(tables, a) > 0
            need = paging.missing(tables, b + 1, a)
            if need:
                if need > paging.pool.free:
                    raise MemoryError(f"decoding needs {need} more cache blocks, {paging.pool.free} free")
                paging.extend(tables, b + 1, a)
                changed = True
        if changed:
            self._table_tensors = None

    def _writable(self, positions: list[int]) -> None:
        """Make the block that each row writes next its own: a fresh block where the row enters a new one,
        a copy where its block is shared with another row (copy on write), in every group; first free the
        window groups' blocks that the rows no longer read."""
        pool, S = self.cache.pool, self.cache.block_size
        changed = False
        if any(w > 0 for w in self.cache.windows):
            paging = self.cache.paging
            changed = sum(paging.forget(self.row_tables(r), p) for r, p in enumerate(positions)) > 0
        fresh = sum(1 for group in self.tables for t, p in zip(group, positions) if p // S >= len(t))
        shared = [
            (group, r)
            for group in self.tables
            for r, (t, p) in enumerate(zip(group, positions))
            if p // S < len(t) and pool.refs(t[p // S]) > 1
        ]
        if fresh + len(shared) > pool.free:
            raise MemoryError(f"decoding needs {fresh + len(shared)} more cache blocks, {pool.free} free")
        src, dst = [], []
        for group, r in shared:
            j = positions[r] // S
            old, new = group[r][j], pool.allocate(1)[0]
            src.append(old)
            dst.append(new)
            pool.release([old])
            group[r][j] = new
        self.cache.copy_blocks(src, dst)
        for group in self.tables:
            for t, p in zip(group, positions):
                if p // S >= len(t):
                    t += pool.allocate(p // S + 1 - len(t))
        if changed or fresh or shared:
            self._table_tensors = None

    def select(self, index: Tensor, *, cross: bool = True) -> None:
        """Keep rows ``index`` (b',) in that order (drop finished rows; reorder or copy beams): row ``r``
        becomes a fork of old row ``index[r]``, holding the same blocks in every group (``cross``: kept
        for callers of the earlier cache; every row keeps its source either way)."""
        index_list = [int(i) for i in index.tolist()] if isinstance(index, Tensor) else [int(i) for i in index]
        rows = self.rows
        if any(not 0 <= i < rows for i in index_list):
            raise UserError(f"select index must hold rows in [0, {rows}), got {index_list}")
        pool = self.cache.pool
        old = self.tables
        self.tables = [[list(group[i]) for i in index_list] for group in old]
        for group in self.tables:
            for t in group:
                pool.share(t)
        for group in old:
            for t in group:
                pool.release(t)
        idx = torch.tensor(index_list, dtype=torch.long, device=self.next_pos.device)
        self.next_pos = self.next_pos.index_select(0, idx)
        if self.row_src is not None:
            self.row_src = self.row_src.index_select(0, idx)
        self._table_tensors = None

    def release(self) -> None:
        """Give every row's blocks back to the pool."""
        for group in self.tables:
            for t in group:
                self.cache.pool.release(t)
        self.tables = [[] for _ in self.tables]
        self._table_tensors = None

    def forward(
        self, rows: list[int], positions: list[int], tokens: Tensor, logit_rows: Tensor, argmax: bool = False
    ) -> Tensor:
        """One packed step: ``tokens (N,)`` of rows ``rows`` at ``positions`` -> the logits of ``logit_rows``
        (with ``argmax``: their arg-max tokens, :func:`~attnmask.decode.step.packed_forward`)."""
        device = self.cache.k[0].device
        row_seq = torch.tensor(rows, dtype=torch.long, device=device)  # (N,)
        row_pos = torch.tensor(positions, dtype=torch.long, device=device)  # (N,)
        row_src = None if self.row_src is None else self.row_src.index_select(0, row_seq)
        return packed_forward(
            self.model, self.cache, tokens, row_pos, row_seq, self._tables(), logit_rows, self.plan,
            memory=self.memory, row_src=row_src, argmax=argmax,
        )  # fmt: skip


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


def _real_rows(ids: Tensor, keep: Tensor | None) -> list[list[int]]:
    """Each row's real tokens, in order."""
    if keep is None:
        return ids.tolist()
    return [row[k].tolist() for row, k in zip(ids.cpu(), keep.cpu())]


@torch.inference_mode()
def start(
    model,
    *,
    src: Ids | None = None,
    prompts: Ids | None = None,
    max_new_tokens: int | Sequence[int] | None = None,
    beams: int = 1,
    sos_id: int = SOS_ID,
    argmax: bool = False,
) -> tuple[DecodeState, Tensor, Tensor]:
    """Encode the sources once (encoder-decoder) or prefill the prompts (decoder-only).

    Args:
        src: encoder-decoder sources, id lists or ``(B, S)`` ids (pads: ``pad_id``); the decoder
            starts from ``<sos>``.
        prompts: decoder-only prompts, id lists or ``(B, P)`` left-padded ids whose last column is
            real for every row.
        max_new_tokens: tokens to generate per row (an int or one per row); None = as many as the
            model's ``max_seq_len`` allows. Capped at what ``max_seq_len`` allows.
        beams: hypotheses per row the cache must have room for (beam search forks rows); 1: rows
            that never share a block (greedy, sampling), each row's blocks held once.

    Returns ``(state, logits (B, V), limits (B,))``; with ``argmax``, each row's arg-max token ``(B,)``
    in place of its logits (greedy decoding: see :func:`~attnmask.decode.step.packed_forward`).

    Raises ValueError for the wrong input kind, empty inputs, or inputs longer than the model's
    maximum.
    """
    cfg = model.config
    device = next(model.parameters()).device
    model_max = cfg.max_seq_len
    memory = None
    if model.is_encoder_decoder:
        if src is None or prompts is not None:
            raise UserError("an encoder-decoder model decodes from src=..., not prompts=")
        src_ids, src_keep = pad_batch(src, cfg.pad_id, side="right", device=device)  # (B, S)
        _check_length(src_ids.shape[1], "the source", model_max)
        memory = SourceMemory.encode(model, src_ids, src_keep)
        B = src_ids.shape[0]
        seqs = [[sos_id] for _ in range(B)]
        room = torch.full((B,), model_max, dtype=torch.long)  # fed positions 0 .. limit-1
    else:
        if prompts is None or src is not None:
            raise UserError("a decoder-only model decodes from prompts=..., not src=")
        ids, keep = pad_batch(prompts, cfg.pad_id, side="left", device=device)  # (B, P)
        if keep is not None and not bool(keep[:, -1].all()):
            raise UserError("prompts must be left-padded: the last column must be a real token in every row")
        seqs = _real_rows(ids, keep)
        B = len(seqs)
        lengths = torch.tensor([len(s) for s in seqs])  # (B,)
        _check_length(int(lengths.max()), "the prompt", model_max)
        room = model_max - lengths + 1  # the last generated token is never fed
    limits = _row_limits(max_new_tokens, B, room)  # (B,)

    S = BLOCK_SIZE
    windows = tuple(g.window for g in layer_groups(cfg, by_window=True))
    paging = Paging(BlockPool(2), S, windows)  # for its arithmetic only
    # a row's blocks at most (a window group's: those of its window and one prefill chunk) over the
    # positions it feeds: its prompt and all but the last of its n tokens
    per_row = [paging.peak(len(s) + int(n) - 1, PREFILL_TOKENS) for s, n in zip(seqs, limits.tolist())]
    if beams == 1:  # greedy, sampling: no row shares a block with another, so none is ever copied
        num_blocks = 1 + sum(per_row)  # and the null block
    else:  # beams fork rows: each hypothesis may come to hold all its blocks alone, and a step copies
        # at most one more each (a group) before the shared originals are released
        num_blocks = 1 + sum((beams + 1) * n for n in per_row) + beams * B * len(windows)
    cache = PagedKVCache.for_model(model, num_blocks=num_blocks, block_size=S, zeroed=False, by_window=True)
    state = DecodeState(
        model=model,
        cache=cache,
        tables=[[[] for _ in seqs] for _ in windows],
        next_pos=torch.tensor([len(s) for s in seqs], dtype=torch.long, device=device),
        memory=memory,
        row_src=None if memory is None else torch.arange(B, device=device),
        plan=fused_plan(model),
    )
    # the prompts packed, PREFILL_TOKENS tokens a step: each row's keys reach the cache before its
    # later tokens (or a later step) attend to them, and its last token gives its first logits
    flat = [(r, p, t) for r, s in enumerate(seqs) for p, t in enumerate(s)]
    logits = [None] * B
    for a in range(0, len(flat), PREFILL_TOKENS):
        chunk = flat[a : a + PREFILL_TOKENS]
        spans: dict[int, list[int]] = {}  # row -> [first, last] position in this chunk
        for r, p, _ in chunk:
            spans.setdefault(r, [p, p])[1] = p
        state.grow(list(spans), [f for f, _ in spans.values()], [b for _, b in spans.values()])
        last = [i for i, (r, p, _) in enumerate(chunk) if p == len(seqs[r]) - 1]
        tokens = torch.tensor([t for _, _, t in chunk], dtype=torch.long, device=device)
        out = state.forward([r for r, _, _ in chunk], [p for _, p, _ in chunk], tokens,
                            torch.tensor(last, dtype=torch.long, device=device), argmax)  # fmt: skip
        for i, row in zip(last, out):
            logits[chunk[i][0]] = row
    state.forget()
    return state, torch.stack(logits), limits.to(device)


@torch.inference_mode()
def decode_step(model, state: DecodeState, tokens: Tensor, argmax: bool = False) -> Tensor:
    """Feed one token per row ``(b,)``; returns the next logits ``(b, V)`` (``argmax``: the next greedy
    tokens ``(b,)``, found without the whole head where it can be, see
    :func:`~attnmask.decode.step.packed_forward`)."""
    positions = state.next_pos.tolist()
    state._writable(positions)
    b = len(positions)
    rows = torch.arange(b, device=tokens.device)
    logits = state.forward(list(range(b)), positions, tokens.reshape(b), rows, argmax)  # (b, V) or (b,)
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
    penalties: Penalties = NO_PENALTIES,
    matchers: list | None = None,
) -> Iterator[tuple[int, Tensor, Tensor]]:
    """The decoding loop: yields ``(B, rows (b,), tokens (b,))`` for the rows still running.

    Finished rows leave the batch (their blocks go back to the pool). ``penalties`` change each row's
    logits from its own prompt and generated tokens before the choice; ``matchers`` (one
    :class:`~attnmask.decode.grammar.Matcher` a row) hold each row to its grammar, and a row whose
    grammar is complete finishes.
    """
    stops = stop_set(eos_id)
    # greedy without penalties or grammars needs no logits, only each row's arg-max: the step finds it
    # without reading the whole head where it can, the same tokens as sample() on the logits
    argmax = sampling.greedy and not penalties.active and matchers is None
    with eval_mode(model):
        state, logits, limits = start(
            model, src=src, prompts=prompts, max_new_tokens=max_new_tokens, sos_id=sos_id, argmax=argmax
        )
        B = state.rows
        rows = torch.arange(B, device=limits.device)  # (b,) original row of each running row
        histories = _histories(prompts, B, model.config.pad_id) if penalties.active else None
        step = 0
        try:
            while True:
                if histories is not None:  # each row from its own history, in place
                    running = rows.tolist()
                    penalize_rows(logits, list(range(len(running))), [penalties] * len(running),
                                  [histories[r] for r in running])  # fmt: skip
                if matchers is not None:  # each row's disallowed tokens to -inf, from its own matcher
                    mask_rows(logits, list(range(len(rows))), [matchers[r] for r in rows.tolist()], restorable=False)
                tokens = logits if argmax else sample(logits, sampling)  # (b,)
                if histories is not None:
                    for r, t in zip(rows.tolist(), tokens.tolist()):
                        histories[r].add(t)
                complete = None
                if matchers is not None:
                    for r, t in zip(rows.tolist(), tokens.tolist()):
                        if not matchers[r].advance(t):
                            raise UserError(f"the grammar cannot go on with this tokenizer: {matchers[r].error}")
                    complete = torch.tensor([matchers[r].done for r in rows.tolist()], device=tokens.device)
                yield B, rows, tokens
                step += 1
                done = (limits[rows] <= step) | is_stop(tokens, stops)  # (b,)
                if complete is not None:
                    done |= complete
                if bool(done.any()):
                    running = (~done).nonzero().squeeze(1)  # (b',)
                    if running.numel() == 0:
                        return
                    # finished rows leave the batch: their blocks are freed, not computed on
                    state.select(running)
                    rows, tokens = rows[running], tokens[running]
                logits = decode_step(model, state, tokens, argmax)  # (b, V), or (b,) tokens
        finally:
            state.release()


def _histories(prompts: Ids | None, rows: int, pad_id: int | None) -> list[TokenHistory]:
    """A :class:`TokenHistory` a row, from its prompt's tokens (none for an encoder-decoder's rows)."""
    if prompts is None:
        return [TokenHistory(()) for _ in range(rows)]
    if isinstance(prompts, Tensor):  # (B, T), padded with pad_id
        keep = prompts != pad_id if pad_id is not None else torch.ones_like(prompts, dtype=torch.bool)
        return [TokenHistory(row[k].tolist()) for row, k in zip(prompts, keep)]
    return [TokenHistory(list(p)) for p in prompts]


def stream(
    model,
    *,
    src: Ids | None = None,
    prompts: Ids | None = None,
    max_new_tokens: int | Sequence[int] | None = None,
    sampling: Sampling | None = None,
    eos_id: StopIds = EOS_ID,
    sos_id: int = SOS_ID,
    penalties: Penalties | None = None,
    **sampling_keywords,
) -> Iterator[Tensor]:
    """Yield each step's tokens ``(B,)`` as they are chosen; finished rows get ``<pad>``.

    A row finishes after emitting ``eos_id`` (which is yielded; several ids may be given, None never
    stops) or at its length limit; the loop ends when every row has. ``sampling`` defaults to
    :data:`~attnmask.decode.sampling.GREEDY`; the keywords ``temperature``, ``top_k``, ``top_p``,
    ``generator`` are accepted instead. ``penalties``: presence, frequency and repetition penalties and a
    logit bias, each row's from its own tokens (:class:`~attnmask.decode.sampling.Penalties`). See
    :func:`start` for the inputs.
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
        penalties=penalties or NO_PENALTIES,
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
    penalties: Penalties | None = None,
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
        penalties=penalties or NO_PENALTIES,
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
    )
