"""The scheduler (:mod:`attnmask.engine.scheduler`) on its own: a :class:`BlockPool`, sequences and
chunks, no model. ``advance`` plays the engine's part: the chunks' tokens are computed, and a chunk
that reaches its sequence's last token yields one new token.

What is checked: sequences join and leave between steps; prefill is chunked under
``max_batch_tokens`` with running decodes first; admission waits for the blocks of everything a
request has (first come, first served: the head of the queue waits, nobody overtakes it); when a
running sequence needs a block and none is free the latest admitted is preempted (blocks freed, back
to the front of the queue with nothing computed); finishing or cancelling frees every block;
``max_seqs`` holds.
"""

from __future__ import annotations

import pytest

from attnmask.engine import BlockPool, Scheduler, Sequence

NEW = 99  # the token every sampling chunk "generates"


def seq(name: str, prompt_len: int, max_tokens: int = 8) -> Sequence:
    return Sequence(name, list(range(1, prompt_len + 1)), prompt_len, max_tokens)


def advance(sched: Scheduler) -> list[tuple[str, int, int, bool]]:
    """One step: schedule, 'compute' the chunks, append a token where a chunk reached the end.
    Returns the chunks as ``(request id, start, n, sample)``."""
    chunks = sched.schedule()
    for c in chunks:
        assert c.start == c.seq.computed and c.n >= 1
        assert len(c.seq.blocks) * sched.block_size >= c.start + c.n, "the chunk's positions have no block"
        assert len(set(c.seq.blocks)) == len(c.seq.blocks) and 0 not in c.seq.blocks
    held = [b for s in sched.running for b in s.blocks]
    assert len(held) == len(set(held)) == sched.pool.used, "a block is held twice, or leaked"
    out = [(c.seq.request_id, c.start, c.n, c.sample) for c in chunks]
    for c in chunks:
        c.seq.computed += c.n
        if c.sample:
            c.seq.tokens.append(NEW)
    return out


def test_sequences_join_and_leave_between_steps():
    sched = Scheduler(BlockPool(20), 4, max_batch_tokens=64)
    a = seq("a", 5)
    sched.add(a)
    assert advance(sched) == [("a", 0, 5, True)]
    assert advance(sched) == [("a", 5, 1, True)]
    sched.add(seq("b", 3))
    assert advance(sched) == [("a", 6, 1, True), ("b", 0, 3, True)]  # b joins beside a's decode
    assert advance(sched) == [("a", 7, 1, True), ("b", 3, 1, True)]
    sched.finish(a)  # a leaves
    assert advance(sched) == [("b", 4, 1, True)]
    assert [s.request_id for s in sched.running] == ["b"] and a.blocks == []


def test_prefill_is_chunked_under_the_token_budget_and_decodes_go_first():
    sched = Scheduler(BlockPool(30), 4, max_batch_tokens=4)
    sched.add(seq("a", 10))
    assert advance(sched) == [("a", 0, 4, False)]
    assert advance(sched) == [("a", 4, 4, False)]
    sched.add(seq("b", 7))
    sched.add(seq("c", 2))
    assert advance(sched) == [("a", 8, 2, True), ("b", 0, 2, False)]  # b takes what a's last chunk leaves
    assert advance(sched) == [("a", 10, 1, True), ("b", 2, 3, False)]  # a's decode first, then b's prefill
    assert advance(sched) == [("a", 11, 1, True), ("b", 5, 2, True), ("c", 0, 1, False)]
    assert advance(sched) == [("a", 12, 1, True), ("b", 7, 1, True), ("c", 1, 1, True)]
    assert advance(sched) == [("a", 13, 1, True), ("b", 8, 1, True), ("c", 2, 1, True)]


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 8])
def test_no_step_exceeds_the_budget_and_every_prompt_gets_through(budget):
    sched = Scheduler(BlockPool(40), 2, max_batch_tokens=budget)
    seqs = [seq(name, n, max_tokens=3) for name, n in zip("abcd", (7, 1, 4, 9))]
    for s in seqs:
        sched.add(s)
    for _ in range(200):
        chunks = advance(sched)
        assert sum(n for _, _, n, _ in chunks) <= budget
        for s in list(sched.running):
            if s.generated >= s.max_tokens:
                sched.finish(s)
        if not sched.running and not sched.waiting:
            break
    assert all(s.generated == 3 for s in seqs) and sched.pool.used == 0


def test_admission_waits_for_blocks_first_come_first_served():
    sched = Scheduler(BlockPool(6), 2, max_batch_tokens=64)  # 5 blocks of 2 positions
    sched.add(seq("a", 6))  # 3 blocks
    assert advance(sched) == [("a", 0, 6, True)]
    sched.add(seq("b", 5))  # 3 blocks: only 2 free
    sched.add(seq("c", 1))  # 1 block would fit, but c does not overtake b
    assert advance(sched) == [("a", 6, 1, True)]  # a grows into a 4th block
    assert [s.request_id for s in sched.waiting] == ["b", "c"] and sched.pool.free == 1
    sched.finish(sched.running[0])
    assert sched.pool.used == 0
    assert advance(sched) == [("b", 0, 5, True), ("c", 0, 1, True)]


def test_the_latest_admitted_sequence_is_preempted_when_a_running_one_needs_a_block():
    pool = BlockPool(5)  # 4 blocks of 2 positions
    sched = Scheduler(pool, 2, max_batch_tokens=64)
    a, b = seq("a", 4), seq("b", 3)
    sched.add(a)
    sched.add(b)
    assert advance(sched) == [("a", 0, 4, True), ("b", 0, 3, True)]  # 2 blocks each: the pool is full
    assert pool.free == 0 and a.admitted < b.admitted
    b_blocks = list(b.blocks)
    # a needs a third block for position 4: b (admitted later) goes, a decodes
    assert advance(sched) == [("a", 4, 1, True)]
    assert b.computed == 0 and b.blocks == [] and b.preemptions == 1
    assert list(sched.waiting) == [b] and sched.running == [a]
    assert set(b_blocks) & set(a.blocks), "b's freed blocks went to a"
    assert b.tokens == [1, 2, 3, NEW]  # what b had generated is kept, to be recomputed
    assert advance(sched) == [("a", 5, 1, True)]  # b needs 2 blocks, 1 is free: it waits
    sched.finish(a)
    assert advance(sched) == [("b", 0, 4, True)]  # prompt and its token prefilled again
    assert b.admitted > a.admitted and pool.used == 2


def test_a_sequence_needing_a_block_preempts_itself_when_it_is_the_latest():
    pool = BlockPool(5)  # 4 blocks of 2 positions
    sched = Scheduler(pool, 2, max_batch_tokens=64)
    a, b = seq("a", 3), seq("b", 4)
    sched.add(a)
    sched.add(b)
    assert advance(sched) == [("a", 0, 3, True), ("b", 0, 4, True)]  # 2 blocks each: the pool is full
    # a's position 3 is in its 2nd block; b's position 4 needs a 3rd: b is the latest, so b goes
    assert advance(sched) == [("a", 3, 1, True)]
    assert list(sched.waiting) == [b] and b.computed == 0 and b.preemptions == 1 and pool.used == 2
    assert a.preemptions == 0


def test_preemption_takes_the_latest_admitted_and_keeps_the_step_consistent():
    pool = BlockPool(7)  # 6 blocks of 2 positions
    sched = Scheduler(pool, 2, max_batch_tokens=64)
    a, b, c = seq("a", 2), seq("b", 2), seq("c", 3)
    for s in (a, b, c):
        sched.add(s)
    assert advance(sched) == [("a", 0, 2, True), ("b", 0, 2, True), ("c", 0, 3, True)]  # 1 + 1 + 2 blocks
    assert advance(sched) == [("a", 2, 1, True), ("b", 2, 1, True), ("c", 3, 1, True)]  # a, b: a block each
    assert pool.free == 0
    assert advance(sched) == [("a", 3, 1, True), ("b", 3, 1, True)]  # c's position 4: c preempts itself
    assert list(sched.waiting) == [c] and c.blocks == [] and c.computed == 0
    assert advance(sched) == [("a", 4, 1, True), ("b", 4, 1, True)]  # c's 2 blocks went to a and b
    assert advance(sched) == [("a", 5, 1, True), ("b", 5, 1, True)]
    # a's position 6 needs a block: b, the latest admitted of the running, is preempted (its chunk too)
    assert advance(sched) == [("a", 6, 1, True)]
    assert sched.running == [a] and list(sched.waiting) == [b, c], "the preempted go to the front"
    assert (b.preemptions, c.preemptions, b.computed, b.blocks) == (1, 1, 0, [])
    assert pool.used == len(a.blocks) == 4
    sched.finish(a)
    assert advance(sched) == [("b", 0, 7, True)]  # b first (3 + 1 blocks would not leave c its 3)
    assert advance(sched) == [("b", 7, 1, True)] and list(sched.waiting) == [c]


@pytest.mark.parametrize("where", ["running", "waiting", "prefilling"])
def test_finish_and_cancel_free_every_block(where):
    pool = BlockPool(12)
    sched = Scheduler(pool, 2, max_batch_tokens=3)
    a, b = seq("a", 5), seq("b", 2)
    sched.add(a)
    advance(sched)  # a: 3 of 5 prompt tokens, all 3 of its blocks held
    sched.add(b)
    if where == "running":
        advance(sched)
        advance(sched)
        assert b in sched.running and a.computed == 6
    if where == "prefilling":
        assert a in sched.running and a.computed == 3
    assert pool.used > 0
    sched.finish(b)
    sched.finish(a)
    assert pool.used == 0 and not sched.running and not sched.waiting
    assert a.blocks == b.blocks == []
    assert advance(sched) == []


def test_max_seqs_holds():
    sched = Scheduler(BlockPool(40), 2, max_batch_tokens=64, max_seqs=2)
    for name in "abcd":
        sched.add(seq(name, 2))
    assert [r for r, *_ in advance(sched)] == ["a", "b"]
    assert [r for r, *_ in advance(sched)] == ["a", "b"]
    assert [s.request_id for s in sched.waiting] == ["c", "d"]
    sched.finish(sched.running[0])
    assert [r for r, *_ in advance(sched)] == ["b", "c"]
    assert len(sched.running) == 2


def test_nothing_to_do_is_an_empty_step():
    sched = Scheduler(BlockPool(3), 2)
    assert sched.schedule() == []
    sched.add(seq("big", 5))  # 3 blocks, 2 exist: never admissible (the engine refuses it up front)
    assert sched.schedule() == [] and list(sched.waiting)[0].request_id == "big"


def test_a_prefix_chain_never_runs_through_a_block_given_to_other_tokens():
    """Two sequences compute the same first block at once: the first keeps it, the second keeps nothing
    more. Were the second to go on from the first's block, that block could be evicted and handed to other
    tokens, and the second's next block found after them: keys and values of the wrong prefix."""
    from attnmask.engine import PrefixCache

    pool = BlockPool(8)
    cache = PrefixCache(pool, 2)
    a = Sequence("a", [1, 2, 3, 4], 4, 0)
    a.tables, a.computed = [pool.allocate(2)], 4
    cache.keep(a)
    b = Sequence("b", [1, 2, 3, 4, 5, 6], 6, 0)
    b.tables, b.computed = [pool.allocate(3)], 2
    cache.keep(b)  # its first block holds a's first block's tokens: a's is kept, b keeps nothing more
    assert len(cache) == 2 and b.kept_parent == -1
    pool.release(a.tables[0])  # a ends; its blocks are the cache's alone
    cache.make_room(pool.free + 2)  # both evicted (the first with the one after it)
    assert len(cache) == 0
    c = Sequence("c", [7, 8], 2, 0)
    c.tables, c.computed = [pool.allocate(1)], 2
    assert c.tables[0] == [a.tables[0][0]]  # the free list hands a's first block back, for other tokens
    cache.keep(c)
    b.computed = 6
    cache.keep(b)
    assert cache.match([7, 8, 3, 4, 9], 4) == (1, [c.tables[0]])  # c's block, and nothing of b's after it
    assert cache.match([1, 2, 3, 4, 9], 4) == (0, [[]])


def prioritized(name: str, prompt_len: int, priority: int) -> Sequence:
    s = seq(name, prompt_len)
    s.priority = priority
    return s


def test_priorities_order_the_queue():
    """``policy="priority"``: lower first, then first come; one at a time (``max_seqs`` 1)."""
    sched = Scheduler(BlockPool(30), 4, max_batch_tokens=64, max_seqs=1, policy="priority")
    for name, p in (("low", 5), ("mid", 1), ("late mid", 1), ("urgent", 0)):
        sched.add(prioritized(name, 3, p))
    order = []
    for _ in range(4):
        order.append(advance(sched)[0][0])
        sched.finish(sched.running[0])
    assert order == ["urgent", "mid", "late mid", "low"]
    with pytest.raises(ValueError, match="policy must be one of fcfs, priority"):
        Scheduler(BlockPool(4), 4, policy="lottery")


def test_a_higher_priority_preempts_lower_ones_for_its_blocks_but_not_equal_ones():
    sched = Scheduler(BlockPool(9), 4, max_batch_tokens=64, policy="priority")  # 8 blocks of 4
    low, mid = prioritized("low", 12, 5), prioritized("mid", 12, 1)
    sched.add(low)
    sched.add(mid)
    assert [c[0] for c in advance(sched)] == ["mid", "low"]  # admitted by priority: 3 + 3 blocks
    sched.add(prioritized("urgent", 16, 0))  # 4 blocks; 2 free: the lowest priority running makes way
    assert [c[0] for c in advance(sched)] == ["mid", "urgent"]
    assert [s.request_id for s in sched.waiting] == ["low"] and low.computed == 0 and low.preemptions == 1
    # one of the same priority waits for blocks rather than preempt
    sched = Scheduler(BlockPool(9), 4, max_batch_tokens=64, policy="priority")
    a, b = prioritized("a", 28, 1), prioritized("b", 8, 1)  # 7 blocks, then 2 (1 free)
    sched.add(a)
    advance(sched)
    sched.add(b)
    assert [c[0] for c in advance(sched)] == ["a"]
    assert list(sched.waiting) == [b] and a.preemptions == 0


def test_a_higher_priority_counts_the_kept_blocks_it_will_start_from():
    """With prefix caching, the head's kept prefix blocks are its own: it preempts nobody for them."""

    def step() -> list[tuple[str, int, int, bool]]:  # advance's part, kept blocks being the cache's too
        chunks = sched.schedule()
        out = [(c.seq.request_id, c.start, c.n, c.sample) for c in chunks]
        for c in chunks:
            c.seq.tokens += [NEW] if c.sample else []
            c.seq.computed += c.n
        return out

    sched = Scheduler(BlockPool(13), 2, max_batch_tokens=64, prefix_caching=True, policy="priority")  # 12 of 2
    first = prioritized("first", 8, 0)
    sched.add(first)
    step()
    sched.prefix.keep(first)  # (the engine keeps after each step)
    sched.finish(first)
    assert len(sched.prefix) == 4  # its 4 full blocks
    low = Sequence("low", list(range(50, 62)), 12, 8, priority=5)  # its own tokens: 6 blocks, 2 left free
    sched.add(low)
    step()
    urgent = Sequence("urgent", [*range(1, 9), 70, 71], 10, 8, priority=0)  # 5 blocks, 4 of them kept
    sched.add(urgent)
    assert step() == [("low", 12, 1, True), ("urgent", 8, 2, True)]
    assert low.preemptions == 0
