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

Priorities (``policy="priority"``, vLLM's): the waiting queue is ordered by each request's ``priority``
(lower first), then by arrival; a request that finds too few free blocks preempts running sequences of
a lower priority (a larger value), latest admitted first, and preemption for growth takes the lowest
priority first. Which requests run together changes when each is answered, never what: the answers
stay those of each request alone.

Prefix caching (``prefix_caching=True``): the full blocks of tokens a sequence has computed are kept
after it ends (:class:`PrefixCache`), and a sequence admitted with nothing computed starts from the
longest run of kept blocks its tokens begin with, computing only the rest (at least its last token,
whose logits it samples from). A block is found by its parent block and its own tokens, compared
whole, never by a hash alone. Kept blocks nobody else holds are given back, least recently used
first, whenever blocks are wanted. Since every row of a step is computed as it would be alone, a kept
block holds the bits the sequence would compute itself: reuse never changes an answer. A sequence
that scores its prompt (``reuse=False``) computes every row. With several layer groups (windows), a
kept position block is that block of every group, kept before the sequence lets its window groups'
old blocks go; a sequence that starts from ``k`` kept blocks takes the full groups' ``k`` and, of each
window group, those its next rows read (the rest are null entries, as if it had let them go itself).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from attnmask.engine.cache import BlockPool, Paging

__all__ = ["POLICIES", "Chunk", "PrefixCache", "Scheduler", "Sequence"]

POLICIES = ("fcfs", "priority")


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
    reuse: bool = True  # may start from kept prefix blocks (False: it needs every row's logits)
    kept: int = 0  # its leading blocks handed to the prefix cache so far
    kept_parent: int = 0  # its last kept block (the next one's parent); -1: it keeps no more
    draft: list[int] = field(default_factory=list)  # tokens guessed to follow, checked by the next step
    priority: int = 0  # lower first (the "priority" policy)
    arrival: int = -1  # order of arrival in the scheduler (ties of priority)

    @property
    def blocks(self) -> list[int]:
        """Its block table in the first layer group (the only one unless the model has several windows)."""
        return self.tables[0]

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def pending(self) -> int:
        """Tokens not yet computed: the prompt's rest while prefilling, 1 while decoding (and its draft)."""
        return len(self.tokens) + len(self.draft) - self.computed


@dataclass
class Chunk:
    """``n`` tokens of ``seq`` starting at position ``start``; ``sample``: the chunk reaches the last
    known token, so the step's logits at its last row give the sequence's next token."""

    seq: Sequence
    start: int
    n: int

    @property
    def sample(self) -> bool:
        return self.start + self.n == len(self.seq.tokens) + len(self.seq.draft)

    @property
    def drafted(self) -> int:
        """Draft tokens the chunk checks (its logits rows: the last ``drafted + 1``)."""
        return len(self.seq.draft) if self.sample else 0


class PrefixCache:
    """Full blocks of computed tokens kept for later sequences that begin with the same tokens.

    Each kept block is held once by the cache (:meth:`BlockPool.share`) and found by ``(parent,
    tokens)``: the kept block before it (0 for a sequence's first) and its own tokens, exact. With
    several layer groups, a kept block (of the first group) stands for that position block in every
    group: the other groups' blocks are kept with it (0 where one was already let go). Blocks only the
    cache holds are evicted least recently used first, each with the blocks kept after it."""

    def __init__(self, pool: BlockPool, block_size: int, windows: tuple[int, ...] = (0,)):
        self.pool, self.block_size = pool, block_size
        self.paging = Paging(pool, block_size, tuple(windows))
        self._block: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent, tokens) -> block
        self._key: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> its (parent, tokens)
        self._others: dict[int, tuple[int, ...]] = {}  # block -> the other groups' blocks of its positions
        self._children: dict[int, set[int]] = {}  # block -> kept blocks whose parent it is
        self._recent: OrderedDict[int, None] = OrderedDict()  # kept blocks, least recently used first
        self.reused = 0  # positions sequences did not compute, thanks to kept blocks

    def __len__(self) -> int:
        return len(self._key)

    def idle(self) -> int:
        """Kept blocks no sequence holds (free for the asking), of every group."""
        return sum(1 for b in self._key for o in (b, *self._others[b]) if o and self.pool.refs(o) == 1)

    def _reads(self, chain: list[int], k: int) -> list[list[int]]:
        """The tables of a sequence starting from the first ``k`` blocks of ``chain``: every group's blocks
        its rows from position ``k * block_size`` on read, null entries before them."""
        tables = []
        for g, w in enumerate(self.paging.windows):
            first = self.paging.first_kept(w, k * self.block_size)
            tables.append([0] * first + [b if g == 0 else self._others[b][g - 1] for b in chain[first:k]])
        return tables

    def match(self, tokens: list[int], most: int) -> tuple[int, list[list[int]]]:
        """``(k, tables)``: the largest ``k`` with ``k * block_size <= most`` whose kept blocks hold
        ``tokens[:k * block_size]`` and, in every group, the blocks that rows from there on read; the
        tables of a sequence starting from them, each block now also held by the caller."""
        S, chain, parent = self.block_size, [], 0
        for i in range(most // S):
            block = self._block.get((parent, tuple(tokens[i * S : (i + 1) * S])))
            if block is None:
                break
            self._recent.move_to_end(block)
            chain.append(block)
            parent = block
        k, tables = len(chain), self.paging.new()
        while k:  # cut back where a window group's block was let go before it was kept
            tables = self._reads(chain, k)
            if all(all(t[self.paging.first_kept(w, k * S) :]) for t, w in zip(tables, self.paging.windows)):
                break
            k, tables = k - 1, self.paging.new()
        self.paging.share([[b for b in t if b] for t in tables])
        return k, tables

    def keep(self, seq: Sequence) -> None:
        """Keep the blocks of ``seq`` whose positions are all computed (those not kept yet), in every group.
        Each kept block's parent is a block ``seq`` holds, so no parent is evicted while a sequence holds
        its child (where the first group has a window, an old block ``seq`` let go may be evicted, and the
        blocks kept after it with it: ``seq`` then keeps nothing more); where another block already holds
        the same tokens (two sequences computed them at once), ``seq`` keeps nothing more."""
        S, table = self.block_size, seq.tables[0]
        for i in range(seq.kept, seq.computed // S):
            parent = seq.kept_parent
            if parent < 0 or (parent and (table[i - 1] != parent or parent not in self._key)):
                seq.kept_parent = -1  # a window: it let its parent go, or the parent went with an evicted one
                return
            key = (seq.kept_parent, tuple(seq.tokens[i * S : (i + 1) * S]))
            block = self._block.get(key)
            if block is None:  # new: the cache holds it too
                block = table[i]
                others = tuple(t[i] for t in seq.tables[1:])
                self._block[key], self._key[block], self._others[block] = block, key, others
                self._children.setdefault(key[0], set()).add(block)
                self.pool.share([block, *(o for o in others if o)])
            self._recent[block] = None
            self._recent.move_to_end(block)
            seq.kept, seq.kept_parent = i + 1, block if block == table[i] else -1

    def make_room(self, need: int) -> None:
        """Evict kept blocks only the cache holds, least recently used first, until ``need`` blocks are free
        or none is left to evict. Then, of kept blocks sequences still hold, let go the other groups' blocks
        that only the cache holds (a window group's that the sequence has let go): the cache then holds
        nothing a sequence without it would not, so it never starves one."""
        while self.pool.free < need:
            idle = next((b for b in self._recent if self.pool.refs(b) == 1), None)
            if idle is not None:
                self._evict(idle)
                continue
            held = next((b for b in self._recent if any(o and self.pool.refs(o) == 1 for o in self._others[b])), None)
            if held is None:
                return
            drop = [o for o in self._others[held] if o and self.pool.refs(o) == 1]
            self._others[held] = tuple(0 if o in drop else o for o in self._others[held])
            self.pool.release(drop)

    def _evict(self, block: int) -> None:
        for child in list(self._children.pop(block, ())):
            self._evict(child)
        parent, tokens = self._key.pop(block)
        del self._block[(parent, tokens)]
        self._children.get(parent, set()).discard(block)
        del self._recent[block]
        self.pool.release([block, *(o for o in self._others.pop(block) if o)])

    def clear(self) -> None:
        """Let every kept block go (those sequences hold stay theirs)."""
        for block in [b for b in self._recent if self._key[b][0] == 0]:  # the first blocks, with those after
            self._evict(block)


class Scheduler:
    """Continuous batching over one :class:`BlockPool` of ``block_size``-position blocks.

    Args:
        windows: the window of each layer group of the cache (0: full), one block table per group.
        max_batch_tokens: tokens computed per step at most (decode tokens and prefill chunks).
        max_seqs: sequences running at once at most.
        prefix_caching: keep computed blocks for later sequences that begin the same way
            (:class:`PrefixCache`).
        policy: ``"fcfs"`` (first come, first served) or ``"priority"`` (each sequence's ``priority``,
            lower first; then first come).
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        *,
        windows: tuple[int, ...] = (0,),
        max_batch_tokens: int = 256,
        max_seqs: int = 64,
        prefix_caching: bool = False,
        policy: str = "fcfs",
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        self.policy = policy
        self.prefix = PrefixCache(pool, block_size, tuple(windows)) if prefix_caching else None
        self.pool, self.block_size = pool, block_size
        self.paging = Paging(pool, block_size, tuple(windows))
        self.max_batch_tokens, self.max_seqs = max_batch_tokens, max_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admissions = self._arrivals = 0
        self.preemptions = 0  # since the scheduler started

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def most_blocks(self, positions: int) -> int:
        """The most blocks a sequence of ``positions`` positions holds at once (every group)."""
        return self.paging.peak(positions, self.max_batch_tokens)

    def add(self, seq: Sequence) -> None:
        if len(seq.tables) != len(self.paging.windows):
            seq.tables = self.paging.new()
        seq.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        self._wait(seq)

    def _wait(self, seq: Sequence) -> None:
        """Queue ``seq`` in its place: last (first come, first served), or after every sequence of its
        priority or a higher one that came before it (a preempted one goes back before those that came
        after it, as it goes to the front under ``fcfs``)."""
        if self.policy == "fcfs":
            self.waiting.append(seq)
            return
        key = (seq.priority, seq.arrival)
        at = next((i for i, w in enumerate(self.waiting) if (w.priority, w.arrival) > key), len(self.waiting))
        self.waiting.insert(at, seq)

    def _victim(self) -> Sequence:
        """The running sequence to preempt: the latest admitted (of the lowest priority, by ``priority``)."""
        if self.policy == "fcfs":
            return max(self.running, key=lambda s: s.admitted)
        return max(self.running, key=lambda s: (s.priority, s.admitted))

    def finish(self, seq: Sequence) -> None:
        """Free a finished or cancelled sequence's blocks, wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.paging.release(seq.tables)
        seq.kept = seq.kept_parent = 0

    def forget(self, seq: Sequence) -> None:
        """Give back the window groups' blocks that ``seq`` no longer reads (from ``seq.computed`` on)."""
        self.paging.forget(seq.tables, seq.computed)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.paging.release(seq.tables)
        seq.computed, seq.preemptions = 0, seq.preemptions + 1
        seq.kept = seq.kept_parent = 0
        seq.draft.clear()
        self.preemptions += 1
        if self.policy == "fcfs":
            self.waiting.appendleft(seq)
        else:
            self._wait(seq)

    def _grow(self, seq: Sequence, positions: int) -> bool:
        """Give ``seq`` blocks for ``positions`` positions (a window group's old ones given back first),
        preempting later sequences if needed; False if ``seq`` itself had to go."""
        self.forget(seq)
        need = self.paging.missing(seq.tables, positions, seq.computed)
        if self.prefix is not None:
            self.prefix.make_room(need)
        while need > self.pool.free:
            victim = self._victim()
            self._preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            self.paging.extend(seq.tables, positions, seq.computed)
        return True

    def _make_way(self) -> None:
        """``priority``: preempt running sequences of a lower priority than the head of the queue, lowest
        and latest first, while the head cannot get the blocks (or the sequence slot) it needs; the kept
        prefix blocks it will start from count as its own (held meanwhile, so none is evicted for it)."""
        head = self.waiting[0] if self.waiting else None
        if self.policy != "priority" or head is None:
            return
        found = None
        if self.prefix is not None and head.reuse and head.computed == 0:
            found = self.prefix.match(head.tokens, len(head.tokens) - 1)[1]
        need = self.most_blocks(len(head.tokens)) - (self.paging.held(found) if found else 0)
        try:
            while self.running:
                if self.prefix is not None:
                    self.prefix.make_room(need)
                if need <= self.pool.free and len(self.running) < self.max_seqs:
                    return
                victim = self._victim()
                if victim.priority <= head.priority:
                    return
                self._preempt(victim)
        finally:
            if found is not None:
                self.paging.release(found)

    def schedule(self) -> list[Chunk]:
        """The chunks of the next step (empty when nothing is running or admissible)."""
        self._make_way()
        budget, chunks = self.max_batch_tokens, []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted by an earlier sequence's growth this step
                continue
            n = min(seq.pending, budget)
            if seq.draft and n < seq.pending:  # the budget cuts the draft short (it checks n - 1 of it)
                del seq.draft[max(0, n - (len(seq.tokens) - seq.computed)) :]
                n = seq.pending
            if not self._grow(seq, seq.computed + n):
                continue
            chunks.append(Chunk(seq, seq.computed, n))
            budget -= n
        chunks = [c for c in chunks if c.seq in self.running]  # a preempted sequence's chunk goes too
        budget = self.max_batch_tokens - sum(c.n for c in chunks)
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            k, reused = 0, None  # kept blocks its tokens begin with (held from here on: never evicted for it)
            if self.prefix is not None and seq.reuse and seq.computed == 0:
                k, reused = self.prefix.match(seq.tokens, len(seq.tokens) - 1)  # its last token computed anyway
            # the blocks it reuses count towards its peak (a window group's, once it lets them go, are the
            # cache's alone, and make_room gives them back when blocks are wanted)
            need = self.most_blocks(len(seq.tokens)) - (self.paging.held(reused) if k else 0)
            if self.prefix is not None:
                self.prefix.make_room(need)
            if need > self.pool.free:
                if reused is not None:
                    self.paging.release(reused)
                break  # first come, first served: the head of the queue waits for blocks
            if k:
                seq.tables = reused
                seq.kept, seq.kept_parent = k, reused[0][-1]
                seq.computed = k * self.block_size
                self.prefix.reused += seq.computed
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
