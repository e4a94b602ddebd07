"""Who runs next: continuous batching with chunked prefill under a token budget, admission by free cache
blocks, preemption by recomputation.

The scheduler only decides; it computes nothing. Each step it lets every running sequence advance
(decoding sequences one token each, in admission order, so running streams keep flowing), fills the
rest of the step's token budget with prefill chunks, and admits waiting requests, first come first
served, while the budget, the sequence limit and the free cache blocks allow: a request is admitted
only when the blocks for everything it has so far are free, so an admitted prompt is never
preempted by its own prefill. When a running sequence needs one more block and none is free, the
most recently admitted sequence is preempted: its blocks are freed and it goes back to the front of
the queue, to be prefilled again (prompt and tokens so far) when blocks free up. Its result does not
change: every step computes each row independently of the others (:mod:`attnmask.engine.step`).

Models whose layers have several windows (Gemma 3) keep a block table per sequence per layer group,
all in the one pool (:class:`~attnmask.model.cache.Paging`). A window group's blocks are taken chunk by
chunk and given back as they fall out of the window (before each chunk is scheduled and after it is
computed), so a sequence holds at most ``ceil((window + max_batch_tokens) / S) + 1`` of them: admission
waits for the blocks of everything a request has in the full groups plus that many (or fewer, for a
short request) in each window group, and allocates those of the full groups and of its first chunk; a
later chunk that finds no block free preempts, as a decode token does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from attnmask.engine.cache import BlockPool, Paging

__all__ = ["Chunk", "Scheduler", "Sequence"]


@dataclass(eq=False)
class Sequence:
    """One request's tokens and cache state, as the scheduler sees it."""

    request_id: str
    tokens: list[int]  # the prompt, then every token generated so far
    prompt_len: int
    max_tokens: int
    tables: list[list[int]] = field(default_factory=lambda: [[]])  # its block table in each layer group
    computed: int = 0  # leading tokens whose keys and values are in the cache
    admitted: int = -1  # admission order, for preemption (latest first)
    preemptions: int = 0

    @property
    def blocks(self) -> list[int]:
        """Its block table in the first layer group (the only one unless the model has several windows)."""
        return self.tables[0]

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def pending(self) -> int:
        """Tokens not yet computed: the prompt's rest while prefilling, 1 while decoding."""
        return len(self.tokens) - self.computed


@dataclass
class Chunk:
    """``n`` tokens of ``seq`` starting at position ``start``; ``sample``: the chunk reaches the last
    known token, so the step's logits at its last row give the sequence's next token."""

    seq: Sequence
    start: int
    n: int

    @property
    def sample(self) -> bool:
        return self.start + self.n == len(self.seq.tokens)


class Scheduler:
    """Continuous batching over one :class:`BlockPool` of ``block_size``-position blocks.

    Args:
        windows: the window of each layer group of the cache (0: full), one block table per group.
        max_batch_tokens: tokens computed per step at most (decode tokens and prefill chunks).
        max_seqs: sequences running at once at most.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        *,
        windows: tuple[int, ...] = (0,),
        max_batch_tokens: int = 256,
        max_seqs: int = 64,
    ):
        self.pool, self.block_size = pool, block_size
        self.paging = Paging(pool, block_size, tuple(windows))
        self.max_batch_tokens, self.max_seqs = max_batch_tokens, max_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admissions = 0
        self.preemptions = 0  # since the scheduler started

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def most_blocks(self, positions: int) -> int:
        """The most blocks a sequence of ``positions`` positions holds at once (every group)."""
        return self.paging.peak(positions, self.max_batch_tokens)

    def add(self, seq: Sequence) -> None:
        if len(seq.tables) != len(self.paging.windows):
            seq.tables = self.paging.new()
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Free a finished or cancelled sequence's blocks, wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.paging.release(seq.tables)

    def forget(self, seq: Sequence) -> None:
        """Give back the window groups' blocks that ``seq`` no longer reads (from ``seq.computed`` on)."""
        self.paging.forget(seq.tables, seq.computed)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.paging.release(seq.tables)
        seq.computed, seq.preemptions = 0, seq.preemptions + 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _grow(self, seq: Sequence, positions: int) -> bool:
        """Give ``seq`` blocks for ``positions`` positions (a window group's old ones given back first),
        preempting later sequences if needed; False if ``seq`` itself had to go."""
        self.forget(seq)
        need = self.paging.missing(seq.tables, positions, seq.computed)
        while need > self.pool.free:
            victim = max(self.running, key=lambda s: s.admitted)
            self._preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            self.paging.extend(seq.tables, positions, seq.computed)
        return True

    def schedule(self) -> list[Chunk]:
        """The chunks of the next step (empty when nothing is running or admissible)."""
        budget, chunks = self.max_batch_tokens, []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted by an earlier sequence's growth this step
                continue
            n = min(seq.pending, budget)
            if not self._grow(seq, seq.computed + n):
                continue
            chunks.append(Chunk(seq, seq.computed, n))
            budget -= n
        chunks = [c for c in chunks if c.seq in self.running]  # a preempted sequence's chunk goes too
        budget = self.max_batch_tokens - sum(c.n for c in chunks)
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            if self.most_blocks(len(seq.tokens)) > self.pool.free:
                break  # first come, first served: the head of the queue waits for blocks
            self.waiting.popleft()
            n = min(seq.pending, budget)
            # the full groups: everything it has; the window groups: its first chunk
            upto = [len(seq.tokens) if w == 0 else seq.computed + n for w in self.paging.windows]
            self.paging.extend(seq.tables, upto, seq.computed)
            seq.admitted, self._admissions = self._admissions, self._admissions + 1
            self.running.append(seq)
            chunks.append(Chunk(seq, seq.computed, n))
            budget -= n
        return chunks
