"""Samplers: which examples (or which stretch of a token stream) form each batch.

- :class:`TokenBucketBatcher` groups variable-length examples into batches under a token budget,
  with length bucketing, per-epoch shuffling and disjoint shards for data-parallel ranks.
- :class:`PackingBatcher` packs several examples into each row instead (padding-free batches);
- :class:`LMStream` draws random fixed-length blocks from one long token stream (nanoGPT style);
  :func:`iter_eval_blocks` walks the stream deterministically for evaluation.

Both samplers are resumable: ``state_dict()`` / ``load_state_dict()`` restore the exact next batch.
Turning indices into padded tensors is :mod:`attnmask.data`'s job.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Literal

import torch

from attnmask.data.files import DataError
from attnmask.errors import UserError

Lengths = Sequence[int] | Sequence[tuple[int, int]]


def _seed_for(seed: int, epoch: int) -> int:
    """A 63-bit generator seed mixing ``seed`` and ``epoch`` (seed + epoch would collide)."""
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _normalise_lengths(lengths: Lengths) -> list[tuple[int, int]]:
    """``(src, tgt)`` per example; a single length ``n`` becomes ``(n, 0)``."""
    out = []
    for i, item in enumerate(lengths):
        pair = tuple(int(x) for x in item) if isinstance(item, (tuple, list)) else (int(item), 0)
        if len(pair) != 2 or min(pair) < 0 or max(pair) < 1:
            raise DataError(
                f"example {i} has length {item!r}; expected a positive int or a (src, tgt) pair of non-negative ints"
            )
        out.append(pair)
    return out


def padding_fraction(batches: Sequence[Sequence[int]], lengths: Lengths) -> float:
    """Token-weighted share of padding when ``batches`` (lists of indices) are padded.

    With ``(src, tgt)`` lengths the source and target tensors are padded separately and both
    count. Returns total pad slots / total slots, so large batches weigh more than small ones.
    """
    pairs = _normalise_lengths(lengths)
    slots = real = 0
    for batch in batches:
        src = [pairs[i][0] for i in batch]
        tgt = [pairs[i][1] for i in batch]
        slots += len(batch) * (max(src) + max(tgt))
        real += sum(src) + sum(tgt)
    return 1.0 - real / slots if slots else 0.0


class TokenBucketBatcher:
    """Batches of example indices whose padded size stays within ``max_tokens``.

    Each epoch: the examples are shuffled (from ``(seed, epoch)`` only, so every rank and every
    resumed run computes the same plan), cut into chunks of ``chunk_size``, sorted by length inside
    each chunk (bucketing: similar lengths share a batch, so little padding), greedily packed so
    that ``batch_size * max_len <= max_tokens``, and the batch order is shuffled. With
    ``shuffle=False`` all examples are sorted by length in one chunk and batches stay in that
    order (good for evaluation).

    For ``(src, tgt)`` lengths an example costs ``max(src, tgt)``, so both padded tensors
    (B, S) and (B, T) stay within ``max_tokens``. Pass the lengths of the tensors that will be built
    (see :func:`attnmask.data.translation_lengths`, which counts the added ``<sos>``/``<eos>``).

    Data-parallel ranks get batches ``rank, rank + world_size, ...`` of the epoch's plan, so the
    shards are disjoint. Every rank must see the same number of batches or DDP deadlocks, so when
    the batch count is not a multiple of ``world_size``, ``remainder="drop"`` (default) leaves out
    the last ``count % world_size`` batches of the shuffled plan (different examples each epoch;
    none seen twice), and ``remainder="repeat"`` reuses the first batches of the plan to fill up
    (every example seen, a few twice; use it for evaluation).

    Iterating continues from the saved position; once an epoch is exhausted, the next iteration
    starts the following epoch. ``state_dict()`` is ``(epoch, position)`` plus checks; position
    counts batches already *handed out*, so save it for the batch the training loop has consumed
    (a DataLoader with workers prefetches ahead of that).

    Raises:
        DataError: an example is longer than ``max_tokens`` (its index and length are named), or
            a length is not positive.
        ValueError: bad ``max_tokens``, ``rank``/``world_size``, ``chunk_size`` or ``remainder``.
    """

    def __init__(
        self,
        lengths: Lengths,
        max_tokens: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        chunk_size: int = 4096,
        max_sentences: int | None = None,
        remainder: Literal["drop", "repeat"] = "drop",
    ) -> None:
        if max_tokens < 1:
            raise UserError(f"max_tokens={max_tokens}; expected a positive token budget")
        if world_size < 1 or not 0 <= rank < world_size:
            raise UserError(f"rank={rank}, world_size={world_size}; expected 0 <= rank < world_size")
        if chunk_size < 1:
            raise UserError(f"chunk_size={chunk_size}; expected a positive number of examples")
        if max_sentences is not None and max_sentences < 1:
            raise UserError(f"max_sentences={max_sentences}; expected None or a positive int")
        if remainder not in ("drop", "repeat"):
            raise UserError(f"remainder={remainder!r}; expected 'drop' or 'repeat'")
        self._pairs = _normalise_lengths(lengths)
        if not self._pairs:
            raise DataError("no examples to batch; expected at least one length")
        self._cost = [max(p) for p in self._pairs]
        for i, cost in enumerate(self._cost):
            if cost > max_tokens:
                raise DataError(
                    f"example {i} has length {cost}, longer than max_tokens={max_tokens}; "
                    f"raise max_tokens or filter out long examples"
                )
        self.lengths = lengths
        self.max_tokens = max_tokens
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.chunk_size = chunk_size
        self.max_sentences = max_sentences
        self.remainder = remainder
        self.epoch = 0
        self.position = 0  # batches of the current epoch already handed out on this rank
        self._plan_cache: tuple[int, list[list[int]]] | None = None
        lengths_bytes = ",".join(f"{s}:{t}" for s, t in self._pairs).encode()
        self._digest = hashlib.blake2b(lengths_bytes, digest_size=8).hexdigest()

    # --- planning -----------------------------------------------------------------------------

    def _global_plan(self, epoch: int) -> list[list[int]]:
        """All batches of ``epoch`` before sharding; a pure function of settings and epoch."""
        n = len(self._pairs)
        if self.shuffle:
            gen = torch.Generator().manual_seed(_seed_for(self.seed, epoch))
            order = torch.randperm(n, generator=gen).tolist()
            chunk_size = self.chunk_size
        else:
            gen = None
            order = list(range(n))
            chunk_size = n
        batches: list[list[int]] = []
        for start in range(0, n, chunk_size):
            # Ties broken by (src, tgt, index) so the plan does not depend on sort stability.
            chunk = sorted(order[start : start + chunk_size], key=lambda i: (self._cost[i], self._pairs[i], i))
            batches.extend(self._pack(chunk))
        if gen is not None:
            batches = [batches[j] for j in torch.randperm(len(batches), generator=gen).tolist()]
        return batches

    def _pack(self, chunk: list[int]) -> list[list[int]]:
        """Greedy packing of length-sorted indices; since lengths ascend, the newest is the max."""
        batches, batch = [], []
        for i in chunk:
            size = len(batch) + 1
            too_many = self.max_sentences is not None and size > self.max_sentences
            if batch and (too_many or size * self._cost[i] > self.max_tokens):
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch:
            batches.append(batch)
        return batches

    def batches_for_epoch(self, epoch: int) -> list[list[int]]:
        """This rank's batches (lists of example indices) for ``epoch``, without consuming them.

        Raises:
            DataError: ``remainder="drop"`` and there are fewer batches than ranks.
        """
        if self._plan_cache is not None and self._plan_cache[0] == epoch:
            return self._plan_cache[1]
        plan = self._global_plan(epoch)
        extra = len(plan) % self.world_size
        if extra and self.remainder == "drop":
            if len(plan) < self.world_size:
                raise DataError(
                    f"only {len(plan)} batches for world_size={self.world_size} ranks; expected at "
                    f"least one per rank (lower max_tokens or use remainder='repeat')"
                )
            plan = plan[: len(plan) - extra]
        elif extra:
            fill = self.world_size - extra
            plan = plan + [plan[j % len(plan)] for j in range(fill)]
        mine = plan[self.rank :: self.world_size]
        self._plan_cache = (epoch, mine)
        return mine

    # --- iteration and state ------------------------------------------------------------------

    def __len__(self) -> int:
        """Number of batches this rank gets in the current epoch."""
        return len(self.batches_for_epoch(self.epoch))

    def __iter__(self) -> Iterator[list[int]]:
        if self.position >= len(self.batches_for_epoch(self.epoch)):
            self.epoch, self.position = self.epoch + 1, 0
        batches = self.batches_for_epoch(self.epoch)
        while self.position < len(batches):
            batch = batches[self.position]
            self.position += 1
            yield list(batch)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch, unless it is already the current epoch.

        Keeping the position for the current epoch lets a resumed loop call ``set_epoch`` for the
        epoch it was interrupted in and still continue with the next unseen batch.
        """
        if epoch < 0:
            raise UserError(f"epoch={epoch}; expected a non-negative int")
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def state_dict(self) -> dict:
        """``epoch`` and ``position`` plus the settings a resume must match."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "world_size": self.world_size,
            "num_examples": len(self._pairs),
            "lengths_digest": self._digest,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue at ``state``'s epoch and position.

        Raises:
            ValueError: the state was saved with other data or settings (which would silently
                change the batch plan), naming the differing keys.
        """
        mine = self.state_dict()
        differing = {
            key: (state.get(key), mine[key])
            for key in ("seed", "max_tokens", "world_size", "num_examples", "lengths_digest")
            if state.get(key) != mine[key]
        }
        if differing:
            details = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in differing.items())
            raise UserError(f"batcher state does not match this batcher ({details}); expected equal")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def padding_fraction(self, epoch: int | None = None) -> float:
        """Token-weighted padding share of this rank's batches in ``epoch`` (default: current)."""
        epoch = self.epoch if epoch is None else epoch
        return padding_fraction(self.batches_for_epoch(epoch), self._pairs)


class PackingBatcher(TokenBucketBatcher):
    """Batches of packed rows: several examples per row, so almost no position is padding.

    A batch is a list of rows, each row a list of example indices laid out back to back (see
    :func:`attnmask.data.collate.make_packed_translation_batch`). Each epoch's chunks are sorted by
    length as in :class:`TokenBucketBatcher`; rows are filled first-fit decreasing (each example, longest
    first, into the first row with room for it), so that the sources and the targets of a row each
    stay within ``row_tokens``; ``max_tokens // row_tokens`` rows make a batch. Shuffling, sharding over
    ranks, ``remainder`` and resuming work as in the parent class.

    Raises:
        DataError: an example is longer than ``row_tokens``.
        ValueError: ``row_tokens`` is not positive or exceeds ``max_tokens``.
    """

    def __init__(self, lengths: Lengths, max_tokens: int, *, row_tokens: int = 128, **kwargs) -> None:
        if not 1 <= row_tokens <= max_tokens:
            raise UserError(f"row_tokens={row_tokens}; expected 1 <= row_tokens <= max_tokens={max_tokens}")
        self.row_tokens = row_tokens
        super().__init__(lengths, max_tokens, **kwargs)
        for i, cost in enumerate(self._cost):
            if cost > row_tokens:
                raise DataError(
                    f"example {i} has length {cost}, longer than a packed row of {row_tokens} tokens; "
                    f"raise the row length or filter out long examples"
                )

    def _pack(self, chunk: list[int]) -> list[list[list[int]]]:
        """Rows from one length-sorted chunk (longest example first, then the shortest that fit),
        then batches of ``max_tokens // row_tokens`` consecutive rows (``max_sentences`` caps the
        examples of a batch)."""
        R = self.row_tokens
        # The longer side of the chunk fills rows of R tokens; the other side gets the share its
        # lengths call for (German sources run longer than English targets), so neither side of a
        # row is left mostly empty.
        src_total = sum(self._pairs[i][0] for i in chunk)
        tgt_total = sum(self._pairs[i][1] for i in chunk)
        longest = max(src_total, tgt_total, 1)
        r_src = max(R * src_total // longest, max(self._pairs[i][0] for i in chunk))
        r_tgt = max(R * tgt_total // longest, max(self._pairs[i][1] for i in chunk))
        # First-fit decreasing: each example, longest first, goes into the first row with room for
        # both its source and its target (a new row when none has).
        order = sorted(chunk, key=lambda i: (-self._cost[i], self._pairs[i], i))
        room = torch.empty(len(order), 2, dtype=torch.long)  # (rows, 2) tokens left per side
        room[:, 0], room[:, 1] = r_src, r_tgt
        rows: list[list[int]] = []
        for i in order:
            s, t = self._pairs[i]
            open_rows = room[: len(rows) + 1]
            r = int(((open_rows[:, 0] >= s) & (open_rows[:, 1] >= t)).nonzero()[0])  # the new row always fits
            if r == len(rows):
                rows.append([])
            rows[r].append(i)
            room[r, 0] -= s
            room[r, 1] -= t
        per_batch = max(1, self.max_tokens // R)
        batches, batch, n = [], [], 0
        for row in rows:
            too_many = self.max_sentences is not None and n + len(row) > self.max_sentences
            if batch and (len(batch) == per_batch or too_many):
                batches.append(batch)
                batch, n = [], 0
            batch.append(row)
            n += len(row)
        if batch:
            batches.append(batch)
        return batches

    def state_dict(self) -> dict:
        return {**super().state_dict(), "row_tokens": self.row_tokens}

    def load_state_dict(self, state: dict) -> None:
        if state.get("row_tokens") != self.row_tokens:
            raise UserError(
                f"batcher state does not match this batcher (row_tokens: saved {state.get('row_tokens')!r}, "
                f"now {self.row_tokens!r}); expected equal"
            )
        super().load_state_dict(state)

    def padding_fraction(self, epoch: int | None = None) -> float:
        """Token-weighted padding share of this rank's packed batches in ``epoch`` (default: current):
        each row padded to the batch's longest row, sources and targets counted separately."""
        epoch = self.epoch if epoch is None else epoch
        slots = real = 0
        for batch in self.batches_for_epoch(epoch):
            sums = [(sum(self._pairs[i][0] for i in row), sum(self._pairs[i][1] for i in row)) for row in batch]
            slots += len(batch) * (max(s for s, _ in sums) + max(t for _, t in sums))
            real += sum(s + t for s, t in sums)
        return 1.0 - real / slots if slots else 0.0


class LMStream:
    """Endless random ``(x, y)`` blocks from one token stream, nanoGPT's ``get_batch``.

    Each batch draws ``batch_size`` start positions uniformly from ``[0, N - block_size)``;
    ``x`` (B, block_size) is the stream from each start and ``y`` (B, block_size) the same shifted
    by one (``y[:, t]`` follows ``x[:, t]``). Randomness comes only from a private
    ``torch.Generator`` seeded with ``seed``, whose state ``state_dict()`` captures, so a resumed
    run draws exactly the blocks the interrupted one would have.

    Raises:
        ValueError: ``token_ids`` is not 1-D, is not longer than ``block_size``, or the sizes
            are not positive.
    """

    def __init__(self, token_ids: torch.Tensor, block_size: int, batch_size: int, seed: int = 0) -> None:
        token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        if token_ids.dim() != 1:
            raise UserError(f"token_ids has shape {tuple(token_ids.shape)}; expected a 1-D stream")
        if block_size < 1 or batch_size < 1:
            raise UserError(f"block_size={block_size}, batch_size={batch_size}; expected positive ints")
        if token_ids.numel() <= block_size:
            raise UserError(
                f"token stream has {token_ids.numel()} tokens; expected more than "
                f"block_size={block_size} (a block needs block_size + 1 tokens)"
            )
        self.token_ids = token_ids
        self.block_size = block_size
        self.batch_size = batch_size
        self.seed = seed
        self.steps = 0
        self._gen = torch.Generator().manual_seed(seed)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(x, y)``, both (B, block_size) long tensors on the CPU."""
        starts = torch.randint(
            self.token_ids.numel() - self.block_size, (self.batch_size,), generator=self._gen
        )  # (B,)
        offsets = torch.arange(self.block_size)  # (T,)
        index = starts[:, None] + offsets[None, :]  # (B, T)
        self.steps += 1
        return self.token_ids[index], self.token_ids[index + 1]  # (B, T), (B, T)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {
            "rng_state": self._gen.get_state(),
            "steps": self.steps,
            "seed": self.seed,
            "block_size": self.block_size,
            "batch_size": self.batch_size,
            "num_tokens": self.token_ids.numel(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the generator so the next batch is the one the saved run would have drawn.

        Raises:
            ValueError: block_size, batch_size or stream length differ from the saved ones.
        """
        for key in ("block_size", "batch_size", "num_tokens"):
            saved, now = state.get(key), self.state_dict()[key]
            if saved != now:
                raise UserError(f"LMStream state has {key}={saved!r}, this stream has {now!r}; expected equal")
        self._gen.set_state(state["rng_state"])
        self.steps = int(state["steps"])


def iter_eval_blocks(
    token_ids: torch.Tensor, block_size: int, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive non-overlapping ``(x, y)`` blocks covering the stream, in order.

    Block k starts at ``k * block_size``; ``x``/``y`` are (b, block_size) with ``b <= batch_size``
    (the last batch may be smaller). The tail after the last full block (fewer than
    ``block_size + 1`` tokens) is not evaluated, so compare losses at equal ``block_size`` only.

    Raises:
        ValueError: the stream is not 1-D or is too short for one block.
    """
    token_ids = torch.as_tensor(token_ids, dtype=torch.long)
    if token_ids.dim() != 1 or token_ids.numel() <= block_size:
        raise UserError(
            f"token stream has shape {tuple(token_ids.shape)}; expected 1-D and longer than block_size={block_size}"
        )
    num_blocks = (token_ids.numel() - 1) // block_size
    offsets = torch.arange(block_size)  # (T,)
    for first in range(0, num_blocks, batch_size):
        starts = torch.arange(first, min(first + batch_size, num_blocks)) * block_size  # (b,)
        index = starts[:, None] + offsets[None, :]  # (b, T)
        yield token_ids[index], token_ids[index + 1]  # (b, T), (b, T)
