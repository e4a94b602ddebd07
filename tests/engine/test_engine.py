"""The serving engine (:mod:`attnmask.engine.engine`) end to end on tiny decoders.

- Greedy engine output is :func:`attnmask.decode.greedy`'s, token for token (rotary GQA with fused
  projections, rotary GQA, learned positions with LayerNorm and GELU, post-norm, sinusoidal tied).
- The claim of the package, as a property: a request's tokens AND log-probabilities are bitwise
  those of its solo run whoever else is in the batch, whenever they arrive, whatever the step's token
  budget (chunks of 1 included), the block size, and a cache small enough to force preemption;
  greedy and sampled (temperature 0.8, top-p 0.9, a seed per request); 1 or 2 threads; and without
  the native kernels (a subprocess with ``ATTNMASK_KERNELS=0``).
- Log-probabilities: the top tokens' and the prompt's (``echo``) are the model's own (float64
  reference), and bitwise the same alone and in any batch, over any chunking and preemption (in the
  properties above); a request of ``max_tokens`` 0 scores its prompt only.
- Penalties (presence, frequency, repetition), a logit bias and ``min_tokens`` choose what a float64
  reference of them chooses, and keep the requests bitwise their solo runs (in the properties above).
- Cancellation, stop ids, stop strings, ``max_tokens``, ``ignore_eos``, ``stats()``, and the
  requests the engine refuses.
- ``slow``: the real SmolLM2 in GGUF blocks, alone and together, and against ``decode.greedy``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnmask import decode, masks
from attnmask.data.tokenizer import EOS_ID
from attnmask.decode.sampling import GREEDY, Sampling
from attnmask.engine import BlockPool, Engine, Logprob, Paging, Penalties, RequestParams, layer_groups
from attnmask.errors import UserError
from attnmask.ops import decoding
from tests.conftest import run_python, tiny_model
from tests.engine.test_step import MODELS, model_of

pytestmark = pytest.mark.usefixtures("one_thread")

INPUTS = [[5, 6, 7, 8, 9], [10, 11], [4, 5, 6], [7], [8, 9, 10, 11, 4, 5], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
SAMPLED = Sampling(temperature=0.8, top_p=0.9)


@functools.cache
def model(variant: str):
    """A tiny decoder whose ``<eos>`` is likely enough that requests end at different steps."""
    m = model_of(variant)
    with torch.no_grad():
        # the post-norm models' logits are larger
        m.lm_head.bias[EOS_ID] = {"learned-post-norm": 3.0, "gemma-style": 2.0}.get(variant, 1.0)
    return m


def engine_of(variant: str, **kw) -> Engine:
    kw = {"num_blocks": 64, "block_size": 4, "max_batch_tokens": 256, "eos_ids": [EOS_ID], **kw}
    return Engine(model(variant), **kw)


def run(engine: Engine, requests, arrivals=None, order=None, cancel=None, scores=None) -> tuple[dict, int]:
    """Feed ``requests`` (``(prompt, params)``; id = its index) into ``engine``, request ``i`` before
    step ``arrivals[i]``, those of one step in ``order``; ``cancel``: ``{step: [ids]}``. Steps until
    done; returns ``({id: (tokens, logprobs, finish_reason)}, the most preemptions stats() showed)``;
    ``scores`` (a dict) gets ``{id: (each token's top log-probabilities, the prompt's)}``."""
    arrivals = arrivals or [0] * len(requests)
    order = order or list(range(len(requests)))
    queue = sorted(order, key=lambda i: arrivals[i])  # stable: `order` within a step
    out, most, step = {}, 0, 0
    while queue or engine.has_work():
        while queue and arrivals[queue[0]] <= step:
            i = queue.pop(0)
            engine.add_request(requests[i][0], requests[i][1], request_id=i)
            out[str(i)] = ([], [], None)
            if scores is not None:
                scores[str(i)] = ([], None)
        for rid in (cancel or {}).get(step, []):
            engine.cancel(rid)
        for event in engine.step():
            tokens, logprobs, reason = out[event.request_id]
            assert reason is None, f"an event after {event.request_id} finished"
            if event.token is not None:
                assert event.index == len(tokens)
                tokens.append(event.token)
                logprobs.append(event.logprob)
            if scores is not None:
                tops, prompt = scores[event.request_id]
                assert event.prompt_logprobs is None or (prompt is None and not tokens[:-1]), "prompt scores twice"
                if event.token is not None:
                    tops.append(event.top)
                scores[event.request_id] = (tops, event.prompt_logprobs if prompt is None else prompt)
            out[event.request_id] = (tokens, logprobs, event.finish_reason)
        most = max(most, engine.stats().preemptions)
        step += 1
        assert step < 5000, "the engine does not finish"
    assert engine.stats().blocks_used == 0, "blocks leaked"
    if engine.scheduler.prefix is not None:  # what it keeps, it gives back
        engine.scheduler.prefix.clear()
    assert engine.cache.pool.used == 0, "blocks leaked"
    return out, most


# every penalty, a bias towards a token and against <eos>, and <eos> ruled out for 2 tokens
PENALIZED = dict(
    penalties=Penalties(presence=0.4, frequency=0.3, repetition=1.3, logit_bias=((5, 1.5), (EOS_ID, -0.5))),
    min_tokens=2,
)


def params_of(
    max_tokens: int, sampled: bool, seed: int, scored: bool = False, penalized: bool = False, plain: bool = False
) -> RequestParams:
    """Log-probabilities unless ``plain``; ``scored``: the 2 top tokens' at each position and the prompt's
    too; ``penalized``: :data:`PENALIZED`'s penalties, bias and ``min_tokens``."""
    sampling = SAMPLED if sampled else GREEDY
    extra = dict(top_logprobs=2, prompt_logprobs=True) if scored else {}
    if penalized:
        extra |= dict(PENALIZED, min_tokens=min(max_tokens, PENALIZED["min_tokens"]))
    logprobs = scored or not plain
    return RequestParams(max_tokens=max_tokens, sampling=sampling, seed=seed, logprobs=logprobs, **extra)


@functools.cache
def solo(
    variant: str, prompt: tuple, max_tokens: int, sampled: bool, seed: int, scored: bool = False,
    penalized: bool = False, plain: bool = False,
):  # fmt: skip
    """A request alone in a roomy engine: its prompt in one chunk. ``scored``: its scores after the rest."""
    scores = {}
    params = params_of(max_tokens, sampled, seed, scored, penalized, plain)
    got = run(engine_of(variant), [(list(prompt), params)], scores=scores)[0]
    return got["0"] + ((scores["0"],) if scored else ())


# ---------------------------------------------------------------------------------------------
# Greedy decoding as decode.greedy does it
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(MODELS))
def test_greedy_engine_equals_decode_greedy(variant):
    want = decode.greedy(model(variant), prompts=INPUTS, max_new_tokens=10)  # without the final <eos>
    # a budget of 5 tokens a step and blocks of 3: prompts chunked, several requests in every step
    engine = engine_of(variant, block_size=3, max_batch_tokens=5, num_blocks=40)
    got = engine.generate(INPUTS, RequestParams(max_tokens=10))
    for w, c in zip(want, got):
        expected = (w + [EOS_ID], "stop") if len(w) < 10 else (w, "length")
        assert (c.tokens, c.finish_reason) == expected
    assert {c.finish_reason for c in got} == {"stop", "length"}, "the prompts should end both ways"


# ---------------------------------------------------------------------------------------------
# The claim: bitwise the same as alone
# ---------------------------------------------------------------------------------------------
VARIANTS = list(MODELS)


def windows(variant: str) -> tuple[int, ...]:
    """The window of each layer group of the engine's cache for ``variant``."""
    return tuple(g.window for g in layer_groups(model(variant).config, by_window=True))


@st.composite
def workloads(draw, sampled: bool, cached: bool = False):
    """``cached``: prefix caching on, requests arriving apart (so later ones find earlier ones' blocks)."""
    variant = draw(st.sampled_from(VARIANTS))
    n = draw(st.integers(1, 5))
    common = draw(st.lists(st.integers(3, 23), min_size=4, max_size=12))  # a shared start, for the prefix cache
    tails = draw(st.lists(st.lists(st.integers(3, 23), min_size=1, max_size=12), min_size=n, max_size=n))
    prompts = [common + t if draw(st.sampled_from([True, True, False])) else t for t in tails]
    max_tokens = draw(st.lists(st.integers(1, 10), min_size=n, max_size=n))
    scored = draw(st.lists(st.booleans(), min_size=n, max_size=n))  # top and prompt log-probabilities too
    penalized = draw(st.lists(st.booleans(), min_size=n, max_size=n))  # penalties, a logit bias, min_tokens
    plain = draw(st.lists(st.booleans(), min_size=n, max_size=n))  # no log-probabilities: greedy steps may screen
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    max_batch_tokens = draw(st.sampled_from([1, 2, 3, 5, 8, 16, 64]))
    # the blocks of the largest request at its peak, in every layer group of the engine's cache
    paging = Paging(BlockPool(2), block_size, windows(variant))
    need = max(paging.peak(len(p) + m, max_batch_tokens) for p, m in zip(prompts, max_tokens))
    return dict(
        variant=variant,
        requests=[
            (tuple(p), m, sampled, 100 + i, c, z, q)
            for i, (p, m, c, z, q) in enumerate(zip(prompts, max_tokens, scored, penalized, plain))
        ],
        arrivals=draw(
            st.lists(st.sampled_from([0, 3, 6, 12] if cached else [0, 0, 1, 2, 5, 12]), min_size=n, max_size=n)
        ),  # fmt: skip
        order=draw(st.permutations(range(n))),
        max_batch_tokens=max_batch_tokens,
        block_size=block_size,
        num_blocks=1 + need + draw(st.sampled_from([0, 0, 1, 3, 100])),  # 0: one request fills the cache
        prefix_caching=cached or draw(st.booleans()),  # (the solo runs: without)
        speculative=draw(st.sampled_from([0, 0, 1, 3])),  # draft tokens a step (the solo runs: none)
        # priorities reorder the queue and preempt for blocks (the solo runs: first come, first served)
        priorities=draw(st.one_of(st.none(), st.lists(st.integers(-2, 2), min_size=n, max_size=n))),
    )


def invariant_results(w, threads: int = 1, engines: list | None = None) -> tuple[list, list, int]:
    """Run workload ``w`` in one engine: each request's ``(tokens, logprobs, finish reason)`` there, the
    same of its solo run, and the most preemptions seen."""
    priorities = w.get("priorities") or [0] * len(w["requests"])
    requests = [(list(r[0]), replace(params_of(*r[1:]), priority=p)) for r, p in zip(w["requests"], priorities)]
    engine = engine_of(
        w["variant"], num_blocks=w["num_blocks"], block_size=w["block_size"], max_batch_tokens=w["max_batch_tokens"],
        prefix_caching=w.get("prefix_caching", False), speculative_tokens=w.get("speculative", 0),
        scheduling="priority" if w.get("priorities") else "fcfs",
    )  # fmt: skip
    if engines is not None:  # the caller's, for its statistics
        engines.append(engine)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        scores = {}
        got, preempted = run(engine, requests, w["arrivals"], w["order"], scores=scores)
    finally:
        torch.set_num_threads(before)
    scored = [len(r) > 4 and r[4] for r in w["requests"]]
    together = [tuple(got[str(i)]) + ((scores[str(i)],) if c else ()) for i, c in enumerate(scored)]
    alone = [tuple(solo(w["variant"], *r)) for r in w["requests"]]
    return together, alone, preempted


def check_invariant(w, threads: int = 1) -> int:
    """Run workload ``w`` in one engine; every request's result must be its solo run's, bit for bit.
    Returns the most preemptions seen."""
    together, alone, preempted = invariant_results(w, threads)
    for i, (got, want) in enumerate(zip(together, alone)):
        assert got[0] == want[0], f"request {i}: tokens differ from its solo run"
        assert got[1] == want[1], f"request {i}: logprobs differ from its solo run (bitwise)"
        assert got[2] == want[2]
        assert all(isinstance(x, float) for x in got[1])
    return preempted


@contextlib.contextmanager
def screening_every_head():
    """Greedy steps find their tokens through head_argmax's screen even for the tiny models' heads."""
    least = decoding.SCREEN_MIN_WEIGHTS
    decoding.SCREEN_MIN_WEIGHTS = 0
    try:
        yield
    finally:
        decoding.SCREEN_MIN_WEIGHTS = least


def test_an_engine_makes_its_heads_screen_before_the_first_request(monkeypatch):
    """The screen of a large float32 head is made with the engine (like its panels), not in the first
    greedy step, whose request would wait for it."""
    monkeypatch.setattr(decoding, "SCREEN_MIN_WEIGHTS", 0)
    decoding._SCREENS.pop(model("rotary-gqa").lm_head.weight, None)  # made by an earlier test, if any
    engine = engine_of("rotary-gqa")
    assert engine.model.lm_head.weight in decoding._SCREENS


@settings(max_examples=60, deadline=None)
@given(workloads(sampled=False))
def test_greedy_requests_are_bitwise_their_solo_runs(w):
    """Steps whose rows all want their arg-max only take it from the screened head, steps with log-
    probabilities or penalties from the logits: a request's answer is the same in either."""
    with screening_every_head():
        together, alone, _ = invariant_results(w)
    assert together == alone  # tokens, logprobs (bitwise) and finish reasons


@settings(max_examples=40, deadline=None)
@given(workloads(sampled=True))
def test_sampled_requests_are_bitwise_their_solo_runs(w):
    together, alone, _ = invariant_results(w)
    assert together == alone  # tokens, logprobs (bitwise) and finish reasons


@settings(max_examples=30, deadline=None)
@given(workloads(sampled=True, cached=True))
def test_prefix_cached_requests_are_bitwise_their_solo_runs(w):
    together, alone, _ = invariant_results(w)
    assert together == alone


PREEMPTING = dict(
    variant="rotary-gqa-fused",
    requests=[((5, 6, 7, 8, 9, 10, 11), 10, False, 1), ((12, 13), 10, True, 2), ((4, 5, 6, 7), 9, False, 3),
              ((20,), 10, True, 4), ((9, 8, 7, 6, 5, 4, 3, 22, 21, 20), 6, False, 5)],
    arrivals=[0, 0, 1, 3, 3],
    order=[0, 1, 2, 3, 4],
    max_batch_tokens=6,
    block_size=2,
    num_blocks=11,  # 10 blocks: 20 positions for 5 requests of up to 17
)  # fmt: skip


def test_preempted_requests_are_bitwise_their_solo_runs():
    assert check_invariant(PREEMPTING) > 0, "this workload is meant to preempt"


def test_prioritized_requests_are_bitwise_their_solo_runs():
    """Later arrivals of higher priority (lower values) preempt the earlier ones for blocks: each answer is
    still its solo run's."""
    assert check_invariant({**PREEMPTING, "priorities": [3, 2, 1, 0, -1]}) > 0, "this workload is meant to preempt"


def test_prefix_cached_requests_are_bitwise_their_solo_runs_through_preemption():
    """Requests that begin alike (a shared 6-token start, then the same prompt again later) in a cache
    small enough to preempt and to evict kept blocks: each result is its solo run's (computed whole),
    and the kept blocks did save work."""
    start = (5, 6, 7, 8, 9, 10)
    requests = [(start + p[6:], m, smp, seed) for p, m, smp, seed in PREEMPTING["requests"]]
    requests += [requests[0], requests[2]]
    w = {**PREEMPTING, "requests": requests, "arrivals": [0, 0, 1, 3, 3, 9, 12], "order": list(range(7)),
         "prefix_caching": True, "num_blocks": 14}  # fmt: skip
    engines = []
    together, alone, preempted = invariant_results(w, engines=engines)
    assert together == alone and preempted > 0
    assert engines[0].stats().tokens_cached > 0, "nothing was found in the prefix cache"


def test_the_prefix_cache_keeps_full_blocks_and_evicts_the_least_recently_used():
    engine = engine_of("rotary-gqa", block_size=2, num_blocks=12, prefix_caching=True, eos_ids=[])
    prefix = engine.scheduler.prefix
    a = engine.generate([[3, 4, 5, 6, 7]], RequestParams(max_tokens=2))[0]
    # positions 0..5 computed (the last token is not): blocks (3, 4), (5, 6), (7, t0) kept
    assert len(prefix) == 3 and engine.stats().blocks_cached == 3 and engine.stats().blocks_used == 0
    b = engine.generate([[3, 4, 5, 6, 9, 9]], RequestParams(max_tokens=2))[0]
    assert engine.stats().tokens_cached == 4  # (3, 4), (5, 6)
    alone = engine_of("rotary-gqa", block_size=2, num_blocks=12, eos_ids=[])
    assert b.tokens == alone.generate([[3, 4, 5, 6, 9, 9]], RequestParams(max_tokens=2))[0].tokens
    # a request needing every block evicts what nobody holds, least recently used first, and runs
    c = engine.generate([[20, 21] * 10], RequestParams(max_tokens=2))[0]
    assert c.finish_reason == "length" and engine.stats().blocks_used == 0
    assert len(prefix) <= 11 and a.tokens
    # a request that scores its prompt computes every row, whatever is kept
    before = engine.stats().tokens_cached
    engine.generate([[20, 21] * 10], RequestParams(max_tokens=1, prompt_logprobs=True))
    assert engine.stats().tokens_cached == before


def test_with_windows_the_prefix_cache_keeps_every_layer_groups_blocks():
    """A model whose layers alternate a window with full attention: a request that begins as an earlier one
    starts from its kept blocks, full groups' and window groups' alike, and answers as it would alone."""
    assert len(set(windows("rotary-windows"))) > 1, "this test needs a model with several layer groups"
    kw = dict(block_size=2, num_blocks=64, max_batch_tokens=4, eos_ids=[])
    engine, alone = engine_of("rotary-windows", prefix_caching=True, **kw), engine_of("rotary-windows", **kw)
    start = list(range(3, 23))  # 20 tokens: 10 blocks, longer than the windows
    engine.generate([start + [5]], RequestParams(max_tokens=3))
    groups = len(windows("rotary-windows"))
    assert engine.stats().blocks_cached == groups * ((len(start) + 1 + 2) // 2)  # every group's, none let go
    for tail in ([7, 8, 9], [5, 6]):
        got = engine.generate([start + tail], RequestParams(max_tokens=6, logprobs=True))[0]
        want = alone.generate([start + tail], RequestParams(max_tokens=6, logprobs=True))[0]
        assert (got.tokens, got.logprobs) == (want.tokens, want.logprobs)
    assert engine.stats().tokens_cached >= 2 * len(start)


def test_preempted_requests_score_their_prompts_once_and_bitwise_as_alone():
    """Every request scores its prompt and its tokens' top 2 too: a preempted prompt is computed again,
    its scores are not (``run`` checks they come once, with the first event)."""
    w = {**PREEMPTING, "requests": [r + (True,) for r in PREEMPTING["requests"]]}
    together, alone, preempted = invariant_results(w)
    assert preempted > 0 and together == alone
    for (prompt, *_), got in zip(w["requests"], together):
        tops, scores = got[3]
        assert [s.token for s in scores] == list(prompt[1:]) and all(len(s.top) == 2 for s in scores)
        assert len(tops) == len(got[0]) and all(len(t) == 2 for t in tops)


def test_preempted_requests_with_window_groups_are_bitwise_their_solo_runs():
    """Three layer groups (a full layer, two of window 3) in one pool: the largest request needs 9 full
    blocks and 6 of each window group at its peak (blocks of 2, chunks of 6 at most), 21 of 27 or 28."""
    assert windows("rotary-windows") == (0, 3, 3)
    preempted = [check_invariant({**PREEMPTING, "variant": "rotary-windows", "num_blocks": n}) for n in (28, 29)]
    assert sum(preempted) > 0, "these pools are meant to preempt"


def test_window_groups_give_their_blocks_back_as_a_request_grows():
    """A 20-token prompt and 30 new tokens, blocks of 2, chunks of 4: the full group holds every
    position's block, each window group (window 3) the last 2 or 3 blocks only, counted by stats()."""
    engine = engine_of("rotary-windows", block_size=2, max_batch_tokens=4, num_blocks=64, eos_ids=[])
    rid = engine.add_request(list(range(3, 23)), greedy_params(30, ignore_eos=True))
    seq = engine.scheduler.running[0] if engine.scheduler.running else None
    held = []
    while engine.has_work():
        engine.step()
        seq = seq or engine.scheduler.running[0]
        if engine.scheduler.running:
            full, *local = seq.tables
            assert 0 not in full and len(full) == -(-max(seq.computed, seq.prompt_len) // 2)
            assert all(sum(1 for b in t if b) <= 3 for t in local), f"window blocks kept: {local}"
            held.append(engine.stats().blocks_used)
    assert engine.stats().blocks_used == 0 and seq.request_id == rid
    # after the 29th token, positions 0..47 computed: 24 full blocks; the next row (48) reads 46..48, and
    # each window group keeps block 23 (46, 47) only
    assert held[-1] == 24 + 2 * 1
    assert max(held) <= 24 + 2 * 3 and len(held) == 5 + 28  # 5 prefill steps (chunks of 4), 28 decodes


def test_two_threads_give_the_bits_of_one():
    """The solo runs on one thread, the packed run on two: products split the weight's rows over
    threads, never a sum, so nothing changes."""
    for w in (PREEMPTING, {**PREEMPTING, "max_batch_tokens": 64, "num_blocks": 64}):
        together, alone, _ = invariant_results(w, threads=2)
        assert together == alone


def test_stats_keep_counting_preemptions_after_the_requests_finish():
    engine = engine_of("rotary-gqa", num_blocks=5, block_size=2, max_batch_tokens=64, eos_ids=[])
    _, most = run(engine, [(prompt, RequestParams(max_tokens=4)) for prompt in ([3, 4, 5, 6], [7, 8, 9])])
    assert most == 1  # seen while the preempted request ran
    assert engine.stats().preemptions == 1, "the count went back down when the request finished"


def test_without_native_kernels_requests_are_still_bitwise_their_solo_runs():
    """A fresh process with ``ATTNMASK_KERNELS=0``: products one row at a time through PyTorch,
    attention by its PyTorch definition; the invariance holds there too, and the tokens are the
    native run's (the logprobs up to float32 rounding)."""
    code = (
        "import json, torch\n"
        "from attnmask import ops\n"
        "from tests.engine.test_engine import PREEMPTING, check_invariant, solo\n"
        "torch.set_num_threads(1)\n"
        "assert not ops.available()\n"
        "assert check_invariant(PREEMPTING) > 0\n"
        "w = {**PREEMPTING, 'variant': 'learned-layernorm-gelu', 'max_batch_tokens': 1}\n"
        "check_invariant(w)\n"
        "print(json.dumps([solo(PREEMPTING['variant'], *r) for r in PREEMPTING['requests']]))\n"
    )
    lines = run_python(code, ATTNMASK_KERNELS="0")
    fallback = json.loads(lines[-1])
    for (tokens, logprobs, reason), r in zip(fallback, PREEMPTING["requests"]):
        want = solo(PREEMPTING["variant"], *r)
        assert (tokens, reason) == (want[0], want[2])
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want[1]), atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# Log-probabilities: the top tokens' and the prompt's
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["rotary-gqa-fused", "rotary-windows", "learned-layernorm-gelu"])
def test_prompt_and_top_logprobs_are_the_models_own(variant):
    """A 20-token prompt scored in chunks of 3 (windows of 3 in ``rotary-windows``): each prompt token
    after the first gets log_softmax(the model's full-forward logits at the position before), within
    float32's rounding of a float64 evaluation; the top 5 are that row's 5 largest, most likely first;
    each generated token's log-probability and top 5 likewise at its own position."""
    m = model(variant)
    prompt = [int(t) for t in torch.randint(3, 24, (20,), generator=torch.Generator().manual_seed(7))]
    engine = engine_of(variant, max_batch_tokens=3, eos_ids=[])
    params = RequestParams(max_tokens=4, logprobs=True, top_logprobs=5, prompt_logprobs=True)
    got = engine.generate([prompt], params)[0]
    whole = prompt + got.tokens
    with torch.no_grad():
        want = torch.log_softmax(copy.deepcopy(m).double().decode(torch.tensor([whole]), mask=masks.causal())[0], -1)
    assert [p.token for p in got.prompt_logprobs] == prompt[1:]
    scores = [(p.logprob, p.top) for p in got.prompt_logprobs] + list(zip(got.logprobs, got.top))
    assert len(scores) == len(whole) - 1  # positions 0 .. the one before the last token
    for position, (logprob, top) in enumerate(scores):
        row = want[position]
        assert logprob == pytest.approx(float(row[whole[position + 1]]), abs=5e-5)
        values, ids = row.topk(5)
        assert [i for i, _ in top] == ids.tolist(), f"position {position}: the top 5 in order"
        assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=5e-5)
    # the generated tokens' own top 1 (greedy): the token itself
    assert [t[0][0] for t in got.top] == got.tokens


def test_a_request_of_no_tokens_scores_its_prompt_only():
    variant = "rotary-gqa"
    prompt = [5, 6, 7, 8, 9, 10, 11]
    engine = engine_of(variant, block_size=2, max_batch_tokens=3)
    scored = engine.generate([prompt], RequestParams(max_tokens=6, prompt_logprobs=True))[0]
    only = engine.generate([prompt], RequestParams(max_tokens=0, prompt_logprobs=True))[0]
    assert (only.tokens, only.logprobs, only.finish_reason) == ([], [], "length")
    assert only.prompt_logprobs == scored.prompt_logprobs and len(only.prompt_logprobs) == len(prompt) - 1
    assert all(p.top == () for p in only.prompt_logprobs)  # none asked
    assert scored.logprobs == [] and scored.top == []  # the generated tokens': not asked either
    assert engine.stats().blocks_used == 0
    # a one-token prompt has nothing to score
    single = engine.generate([[5]], RequestParams(max_tokens=0, prompt_logprobs=True))[0]
    assert single.prompt_logprobs == [] and single.finish_reason == "length"


def test_top_logprobs_break_ties_by_the_lower_id_and_a_row_is_the_same_alone():
    from attnmask.engine.engine import _logprobs

    row = torch.tensor([0.0, 2.0, 1.0, 2.0, 2.0, -1.0])
    (got,) = _logprobs(row[None], [5], [3])
    assert [i for i, _ in got.top] == [1, 3, 4] and got.token == 5
    assert isinstance(got, Logprob) and got.logprob == pytest.approx(float(torch.log_softmax(row, 0)[5]))
    (got,) = _logprobs(row[None], [0], [2])  # the tie crosses the cut: the lower ids
    assert [i for i, _ in got.top] == [1, 3]
    rows = torch.stack([row, row.flip(0), torch.zeros(6)])
    together = _logprobs(rows, [0, 1, 2], [4, 0, 2])
    assert [i for i, _ in together[0].top] == [1, 3, 4, 2] and together[1].top == ()
    assert [i for i, _ in together[2].top] == [0, 1]  # all equal: the lowest ids
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(37, 1000, generator=g) * 4
    together = _logprobs(rows, list(range(37)), [i % 6 for i in range(37)])
    assert together == [_logprobs(r[None], [i], [i % 6])[0] for i, r in enumerate(rows)]  # bit for bit


def test_request_params_check_their_log_probability_settings():
    with pytest.raises(UserError, match="max_tokens must be an int >= 1"):
        RequestParams(max_tokens=0)
    with pytest.raises(UserError, match="top_logprobs must be an int from 0 to 20"):
        RequestParams(top_logprobs=21)
    with pytest.raises(UserError, match="top_logprobs"):
        RequestParams(top_logprobs=True)
    assert RequestParams(max_tokens=0, prompt_logprobs=True).max_tokens == 0


# ---------------------------------------------------------------------------------------------
# Speculative decoding (prompt lookup)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["rotary-gqa-fused", "learned-layernorm-gelu"])
@pytest.mark.parametrize("sampled", [False, True])
def test_speculative_decoding_gives_the_answers_without_it_in_fewer_steps(variant, sampled):
    """Drafts from the requests' own repeats, checked in the step of their next token: the same tokens and
    log-probabilities as without (greedy, and drawn from each request's generator in the same order), a
    step budget that cuts drafts short included; some drafts are kept, so steps are saved. (Drafts are
    checked while a step is small: 2 requests at once, or one.)"""
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [12, 13] * 6 + [14], [20, 21, 22]]
    # sampled at a low temperature: drafts are kept often enough to exercise the generator's order
    sampling = Sampling(temperature=0.3, top_p=0.95) if sampled else GREEDY
    params = RequestParams(max_tokens=24, logprobs=True, ignore_eos=True, sampling=sampling, seed=3)
    plain = engine_of(variant)
    want = plain.generate(prompts[:2], params)
    for budget in (256, 2):  # 2 requests: a draft each (DRAFT_ROWS 5 shared out), cut short by a budget of 2
        engine = engine_of(variant, speculative_tokens=4, max_batch_tokens=budget)
        got = engine.generate(prompts[:2], params)
        assert [(c.tokens, c.logprobs) for c in got] == [(c.tokens, c.logprobs) for c in want]
        stats = engine.stats()
        assert stats.draft_accepted > 0 and stats.draft_tokens >= stats.draft_accepted
        assert stats.blocks_used == 0
    # alone, a request needs no more steps with drafts, and fewer where some are kept
    saved = []
    for prompt in prompts:
        steps = []
        for k in (0, 4):
            engine = engine_of(variant, speculative_tokens=k)
            engine.generate([prompt], params)
            steps.append(engine.stats().steps)
        saved.append(steps[0] - steps[1])
    assert min(saved) >= 0 and max(saved) > 0, saved


def test_speculative_requests_are_bitwise_their_solo_runs_through_preemption():
    w = dict(PREEMPTING, speculative=3)
    assert check_invariant(w) > 0


# ---------------------------------------------------------------------------------------------
# Penalties, a logit bias, min_tokens
# ---------------------------------------------------------------------------------------------
def reference_penalized(row, prompt: list[int], generated: list[int], penalties: Penalties):
    """The penalties on ``row`` in float64, token by token as their definitions read."""
    row = row.double().clone()
    for token, bias in penalties.logit_bias:
        row[token] += bias
    for token in set(prompt) | set(generated):
        x = float(row[token])
        row[token] = x / penalties.repetition if x > 0 else x * penalties.repetition
    for token in set(generated):
        row[token] -= penalties.frequency * generated.count(token) + penalties.presence
    return row


@pytest.mark.parametrize("variant", ["rotary-gqa-fused", "learned-post-norm"])
def test_penalized_greedy_requests_choose_what_a_float64_reference_chooses(variant):
    """Each generated token is the arg-max of the float64 reference of the penalties applied to the model's
    full-forward logits (within float32's rounding of a near tie), and the penalties change the answer."""
    m = model(variant)
    penalties = Penalties(presence=0.5, frequency=0.7, repetition=1.4, logit_bias=((7, 0.8), (9, -0.6)))
    prompt = [5, 6, 7, 8, 5, 6, 7, 8]
    engine = engine_of(variant, max_batch_tokens=3, eos_ids=[])
    plain = engine.generate([prompt], RequestParams(max_tokens=12))[0]
    got = engine.generate([prompt], RequestParams(max_tokens=12, penalties=penalties))[0]
    assert got.tokens != plain.tokens, "the penalties should change this answer"
    whole = prompt + got.tokens
    with torch.no_grad():
        rows = copy.deepcopy(m).double().decode(torch.tensor([whole]), mask=masks.causal())[0]
    for i, token in enumerate(got.tokens):
        want = reference_penalized(rows[len(prompt) + i - 1], prompt, got.tokens[:i], penalties)
        assert float(want[token]) >= float(want.max()) - 1e-5, f"token {i}: {token} is not the reference's arg-max"
    assert max(got.tokens.count(t) for t in set(got.tokens)) < max(plain.tokens.count(t) for t in set(plain.tokens))


def test_a_logit_bias_forces_or_bans_a_token_and_logprobs_stay_the_models():
    variant = "rotary-gqa"
    engine = engine_of(variant, eos_ids=[])
    prompt = [5, 6, 7]
    plain = engine.generate([prompt], RequestParams(max_tokens=6, logprobs=True))[0]
    forced = engine.generate([prompt], RequestParams(max_tokens=6, logprobs=True, penalties=Penalties(
        logit_bias=((11, 100.0),))))[0]  # fmt: skip
    assert forced.tokens == [11] * 6
    banned = plain.tokens[0]
    other = engine.generate([prompt], RequestParams(max_tokens=6, penalties=Penalties(
        logit_bias=((banned, -100.0),))))[0]  # fmt: skip
    assert banned not in other.tokens
    # the reported log-probabilities are the model's own (before the bias): the first token's row is plain's
    with torch.no_grad():
        row = model(variant).decode(torch.tensor([prompt]), mask=masks.causal())[0, -1]
    assert forced.logprobs[0] == pytest.approx(float(torch.log_softmax(row.double(), -1)[11]), abs=5e-5)
    assert forced.logprobs[0] < plain.logprobs[0]


def test_min_tokens_rules_out_the_stop_ids_until_enough_tokens_came():
    engine = engine_of("rotary-gqa")
    eager = Penalties(logit_bias=((EOS_ID, 100.0),))  # <eos> first whenever it may come
    plain = engine.generate(INPUTS, RequestParams(max_tokens=10, penalties=eager))
    assert all(c.tokens == [EOS_ID] for c in plain)
    got = engine.generate(INPUTS, RequestParams(max_tokens=10, penalties=eager, min_tokens=5))
    assert all(len(c.tokens) == 6 and c.tokens[5] == EOS_ID and EOS_ID not in c.tokens[:5] for c in got)
    assert {c.finish_reason for c in got} == {"stop"}
    # a stop id likewise, and min_tokens == max_tokens runs to the end
    stop = Penalties(logit_bias=((9, 100.0),))
    got = engine.generate(INPUTS, RequestParams(max_tokens=4, penalties=stop, stop_ids=(9,), min_tokens=4))
    assert all(9 not in c.tokens and c.finish_reason == "length" for c in got)


def test_request_params_check_their_penalties():
    with pytest.raises(UserError, match=r"presence penalty must be a number in \[-2, 2\]"):
        Penalties(presence=2.5)
    with pytest.raises(UserError, match="repetition penalty must be a number > 0"):
        Penalties(repetition=0.0)
    with pytest.raises(UserError, match=r"logit bias must be a number in \[-100, 100\]"):
        Penalties(logit_bias=((3, 101.0),))
    with pytest.raises(UserError, match="names a token twice"):
        Penalties(logit_bias=((3, 1.0), (3, 2.0)))
    with pytest.raises(UserError, match="min_tokens must be an int from 0 to max_tokens"):
        RequestParams(max_tokens=3, min_tokens=4)
    assert not Penalties().active and Penalties(repetition=1.1).active
    engine = engine_of("rotary-gqa")
    with pytest.raises(UserError, match=r"logit_bias token ids must be in \[0, "):
        engine.add_request([3], RequestParams(penalties=Penalties(logit_bias=((10**6, 1.0),))))


# ---------------------------------------------------------------------------------------------
# Requests' lifetimes
# ---------------------------------------------------------------------------------------------
def greedy_params(max_tokens=10, **kw) -> RequestParams:
    return RequestParams(max_tokens=max_tokens, logprobs=True, **kw)


def test_cancelling_frees_blocks_and_leaves_the_others_alone():
    variant = "rotary-gqa"
    requests = [(p, greedy_params(10, seed=0)) for p in INPUTS[:4]]
    engine = engine_of(variant, block_size=2, max_batch_tokens=4, num_blocks=40)
    # 1 is cancelled while decoding, 3 while its prompt is still queued (the budget is 4 a step)
    got, _ = run(engine, requests, cancel={5: ["1"], 0: ["3"]})
    assert got["3"] == ([], [], "cancelled")
    tokens, logprobs, reason = got["1"]
    want = solo(variant, tuple(INPUTS[1]), 10, False, 0)
    assert reason == "cancelled" and 0 < len(tokens) < len(want[0]), "cancelled while decoding"
    assert (tokens, logprobs) == (want[0][: len(tokens)], want[1][: len(tokens)])
    for i in (0, 2):
        assert got[str(i)] == solo(variant, tuple(INPUTS[i]), 10, False, 0)
    # the blocks come back at the step that sees the cancellation
    engine = engine_of(variant, block_size=2, max_batch_tokens=64, num_blocks=40)
    a = engine.add_request([3, 4, 5, 6, 7], greedy_params(10, ignore_eos=True))
    b = engine.add_request([8, 9, 10], greedy_params(10, ignore_eos=True))
    engine.step()
    engine.step()
    used = engine.stats().blocks_used
    assert used == 3 + 2  # positions 0..5 and 0..3 in blocks of 2
    engine.cancel(a)
    engine.cancel("no-such-request")  # ignored
    events = engine.step()
    assert [(e.request_id, e.token, e.index, e.finish_reason) for e in events][0] == (a, None, 2, "cancelled")
    assert [e.request_id for e in events[1:]] == [b] and engine.stats().blocks_used == 3  # b's positions 0..4
    engine.cancel(a)  # again: ignored
    assert all(e.request_id == b for e in engine.run())
    assert engine.stats().blocks_used == 0


def test_ignore_eos_goes_on_where_the_solo_run_stops():
    variant = "rotary-gqa"
    stopping = [p for p in INPUTS if solo(variant, tuple(p), 10, False, 0)[2] == "stop"]
    assert stopping, "some prompt should end with <eos>"
    prompt = stopping[0]
    want = solo(variant, tuple(prompt), 10, False, 0)
    got, _ = run(engine_of(variant), [(prompt, greedy_params(10, seed=0, ignore_eos=True))])
    tokens, logprobs, reason = got["0"]
    assert want[0][-1] == EOS_ID and len(want[0]) < 10
    assert tokens[: len(want[0])] == want[0] and logprobs[: len(want[1])] == want[1]
    assert len(tokens) == 10 and reason == "length"


def test_stop_ids_stop_strings_and_max_tokens():
    variant = "learned-layernorm-gelu"
    prompt = INPUTS[5]
    engine = engine_of(variant, eos_ids=[], detokenize=lambda ids: "".join(chr(ord("a") + t) for t in ids))
    free, _ = run(engine, [(prompt, greedy_params(12))])
    tokens = free["0"][0]
    assert len(tokens) == 12 and free["0"][2] == "length"  # no eos ids: only max_tokens ends it
    k = 4
    stop_id = tokens[k]
    first = tokens.index(stop_id)
    got, _ = run(engine, [(prompt, greedy_params(12, stop_ids=(stop_id,)))])
    assert got["0"][0] == tokens[: first + 1] and got["0"][2] == "stop"  # the stop id included
    text = "".join(chr(ord("a") + t) for t in tokens)
    stop = text[k - 1 : k + 1]
    end = text.index(stop) + len(stop)
    got, _ = run(engine, [(prompt, greedy_params(12, stop=(stop, "no such text")))])
    assert got["0"][0] == tokens[:end] and got["0"][2] == "stop"
    got, _ = run(engine, [(prompt, greedy_params(3))])
    assert got["0"][0] == tokens[:3] and got["0"][2] == "length"
    got, _ = run(engine, [(prompt, RequestParams(max_tokens=2))])
    assert got["0"] == (tokens[:2], [None, None], "length")  # no logprobs unless asked


def test_a_late_stop_string_across_textless_tokens_ends_a_long_request_where_the_whole_text_would():
    """Stop strings are searched in the text of the last tokens only, yet found where searching all the
    generated text at every token finds them: here 400 sampled tokens, most of which give no text, so
    the stop string (taken from late in the text) spans many more tokens than it has characters."""

    def text_of(t: int) -> str:  # two ids in three give no text (bytes of a split character); the rest letters
        return "" if t % 3 else chr(ord("a") + t) * (1 + t % 2)

    calls = []

    def detokenize(ids: list[int]) -> str:
        calls.append(len(ids))
        return "".join(text_of(t) for t in ids)

    n = 400
    m = model("rotary-gqa")
    engine = Engine(m, num_blocks=2 + (8 + n) // 16, block_size=16, eos_ids=[], detokenize=detokenize)
    params = dict(max_tokens=n, sampling=Sampling(temperature=1.0), seed=3)
    [free] = engine.generate([INPUTS[0]], RequestParams(**params))
    assert len(free.tokens) == n and free.finish_reason == "length"
    texts = [text_of(t) for t in free.tokens]
    at = sum(len(t) for t in texts[:330])
    stop = "".join(texts)[at : at + 12]  # 12 letters from late in the text
    first = next(i for i in range(n) if stop in "".join(texts[: i + 1]))  # the whole text at every token
    assert first >= 300, "the stop string should first appear late"
    start = next(j for j in range(first, -1, -1) if stop in "".join(texts[j : first + 1]))
    assert first + 1 - start > len(stop) + 8  # it spans more tokens than it has characters, and a margin

    calls.clear()
    [got] = engine.generate([INPUTS[0]], RequestParams(**params, stop=(stop,)))
    assert got.tokens == free.tokens[: first + 1] and got.finish_reason == "stop"
    assert len(calls) >= first + 1  # every token was searched
    assert max(calls) <= 120  # and none decoded the whole generated text (over 300 tokens by then)


def test_a_model_context_ends_a_request_and_bounds_what_it_may_ask():
    m = tiny_model("decoder", vocab=24, std=0.5, positions="learned", max_seq_len=12)
    engine = Engine(m, num_blocks=64, block_size=4)
    assert engine.capacity == 12
    with pytest.raises(UserError, match=r"the prompt's 5 tokens \+ max_tokens 8 exceed the 12 positions"):
        engine.add_request([3] * 5, RequestParams(max_tokens=8))
    [c] = engine.generate([[3] * 5], RequestParams(max_tokens=7))
    assert len(c.tokens) == 7 and c.finish_reason == "length"


def test_add_request_refuses_what_it_cannot_serve():
    engine = engine_of("rotary-gqa", num_blocks=3, block_size=4)  # 2 blocks: 8 positions a request
    assert engine.capacity == 8
    with pytest.raises(UserError, match="the prompt is empty"):
        engine.add_request([])
    with pytest.raises(UserError, match=r"prompt token ids must be in \[0, 24\); got 3\.\.24"):
        engine.add_request([3, 24])
    with pytest.raises(UserError, match=r"in \[0, 24\); got -1\.\.5"):
        engine.add_request([-1, 5])
    with pytest.raises(UserError, match=r"the prompt's 5 tokens \+ max_tokens 4 exceed the 8 positions"):
        engine.add_request([3] * 5, RequestParams(max_tokens=4))
    engine.add_request([3] * 5, RequestParams(max_tokens=3), request_id="x")
    with pytest.raises(UserError, match="request id 'x' is already in use"):
        engine.add_request([4], RequestParams(max_tokens=1), request_id="x")  # queued
    engine.step()
    with pytest.raises(UserError, match="request id 'x' is already in use"):
        engine.add_request([4], RequestParams(max_tokens=1), request_id="x")  # running
    with pytest.raises(UserError, match="stop strings need an engine with a detokenize function"):
        engine.add_request([4], RequestParams(max_tokens=1, stop=("a",)))
    for bad in (dict(max_tokens=0), dict(max_tokens=True), dict(stop=("",)), dict(sampling=0.5)):
        with pytest.raises(UserError):
            RequestParams(**bad)
    assert engine.stats().waiting == 0  # nothing refused was queued
    list(engine.run())
    engine.add_request([4], RequestParams(max_tokens=1), request_id="x")  # finished: the id is free again


def test_the_engine_refuses_what_it_cannot_run():
    with pytest.raises(UserError, match="decoder-only"):
        Engine(tiny_model("encoder_decoder", vocab=24))
    with pytest.raises(UserError, match="the engine serves attnmask Transformers"):
        Engine(torch.nn.Linear(2, 2))
    with pytest.raises(UserError, match="must be >= 1"):
        engine_of("rotary-gqa", max_batch_tokens=0)
    with pytest.raises(UserError, match="at least 2 blocks|need >= 2"):
        engine_of("rotary-gqa", num_blocks=1)
    with pytest.raises(UserError, match=r"--kv-cache-mib 1e-06 holds 0 blocks"):
        Engine(model("rotary-gqa"), kv_cache_mib=1e-6)


def test_stats_count_steps_tokens_and_blocks():
    engine = engine_of("rotary-gqa-fused", block_size=4, max_batch_tokens=5, eos_ids=[])
    assert engine.stats() == engine.stats().__class__(0, 0, 0, 63, 0, 0, 0, 0)
    engine.add_request([3, 4, 5, 6, 7, 8], RequestParams(max_tokens=3))
    engine.add_request([9, 10], RequestParams(max_tokens=2))
    s = engine.stats()
    assert (s.running, s.waiting, s.steps) == (0, 2, 0)
    engine.step()  # 5 prompt tokens of the first
    s = engine.stats()
    assert (s.running, s.waiting, s.blocks_used, s.steps, s.tokens_in, s.tokens_out) == (1, 1, 2, 1, 5, 0)
    engine.step()  # its last prompt token (and first new token), and the second's prompt
    s = engine.stats()
    assert (s.running, s.waiting, s.blocks_used, s.steps, s.tokens_in, s.tokens_out) == (2, 0, 3, 2, 8, 2)
    list(engine.run())
    s = engine.stats()
    assert (s.running, s.waiting, s.blocks_used, s.tokens_in, s.tokens_out, s.preemptions) == (0, 0, 0, 8, 5, 0)
    assert s.steps == 4 and s.blocks_total == 63


def test_an_engine_steps_on_without_requests_and_takes_new_ones():
    engine = engine_of("rotary-gqa")
    assert engine.step() == [] and not engine.has_work()
    [first] = engine.generate([INPUTS[0]], greedy_params(6))
    [again] = engine.generate([INPUTS[0]], greedy_params(6))
    assert (first.tokens, first.logprobs) == (again.tokens, again.logprobs)  # the cache's leftovers change nothing


# ---------------------------------------------------------------------------------------------
# GGUF blocks with int8 activations (llama.cpp's arithmetic, an opt-in): invariant too
# ---------------------------------------------------------------------------------------------
def test_int8_activation_requests_are_bitwise_their_solo_runs(tmp_path):
    """A tiny GGUF Llama (Q4_1 layers, a Q8_0 head) loaded with ``activations="int8"``: each request's
    tokens and logprobs are its solo run's, bit for bit, with chunked prefill, late arrivals and
    preemption; greedy is decode.greedy's; and the logits are not the float32 blocks' (the setting is
    in use: the activations are rounded)."""
    from attnmask import ops
    from attnmask.pretrained import load
    from attnmask.pretrained.quantized import BlockLinear
    from tests.pretrained.test_pretrained import write_tiny_gguf

    if not ops.available():
        pytest.skip(f"no native kernels here: {ops.status().why}")
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tied=False)
    model = load(path, quantized=True, activations="int8", cache=False)[0]
    exact = load(path, quantized=True, cache=False)[0]
    layers = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert layers and all(m.activations == "int8" for m in layers)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [12, 13], [4, 5, 6, 7, 8], [20], [9, 8, 7, 6, 5, 4, 3, 22, 21, 20]]
    with torch.no_grad():
        ids = torch.tensor([prompts[0]])
        assert not torch.equal(model(ids).logits, exact(ids).logits)
    params = RequestParams(max_tokens=10, logprobs=True, ignore_eos=True)
    requests = [(p, params) for p in prompts]

    def engine(**kw):
        return Engine(model, **{"num_blocks": 64, "block_size": 4, "max_batch_tokens": 256, **kw})

    alone = [run(engine(), [r])[0]["0"] for r in requests]
    together, _ = run(engine(max_batch_tokens=5), requests, arrivals=[0, 0, 1, 3, 3], order=[2, 0, 1, 3, 4])
    assert [together[str(i)] for i in range(len(prompts))] == alone
    together, preempted = run(engine(max_batch_tokens=6, num_blocks=11), requests, arrivals=[0, 0, 1, 3, 3])
    assert preempted > 0 and [together[str(i)] for i in range(len(prompts))] == alone
    assert [tokens for tokens, _, _ in alone] == decode.greedy(model, prompts=prompts, max_new_tokens=10, eos_id=None)


# ---------------------------------------------------------------------------------------------
# The real SmolLM2, in GGUF blocks
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_q(tmp_path_factory):
    from attnmask.pretrained import load
    from tests.pretrained.test_pretrained import _smollm2_path

    _smollm2_path()  # skips when the weights are not installed
    model, tok, _ = load("smollm2", quantized=True, cache=tmp_path_factory.mktemp("cache"))
    return model, tok


@pytest.mark.slow  # the real SmolLM2-135M (GGUF blocks): a few hundred packed steps
def test_smollm2_requests_are_bitwise_their_solo_runs_and_decode_greedy(smol_q):
    model, tok = smol_q
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    ",
        "Numbers: 12, 345, 6789. Next: ",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
        "Q: What is 2 + 2?\nA:",
        "Hi",
    ]
    prompts = [tok.encode(t) for t in texts]
    assert len({len(p) for p in prompts}) == len(prompts)
    params = RequestParams(max_tokens=12, logprobs=True, ignore_eos=True)

    def generate(prompts, num_blocks=64, **kw):
        engine = Engine(model, num_blocks=num_blocks, block_size=16, **kw)
        got, most = run(engine, [(p, params) for p in prompts])
        return [got[str(i)][:2] for i in range(len(prompts))], most

    alone = [generate([p], max_batch_tokens=256)[0][0] for p in prompts]
    for budget in (16, 64):
        assert generate(prompts, max_batch_tokens=budget)[0] == alone, f"max_batch_tokens={budget}"
    together, preempted = generate(prompts, max_batch_tokens=16, num_blocks=7)  # 6 blocks: 2 a request at most
    assert together == alone and preempted > 0
    want = decode.greedy(model, prompts=prompts, max_new_tokens=12, eos_id=None)
    assert [tokens for tokens, _ in alone] == want, "engine greedy != decode.greedy"
    # text as decode.generate gives it, ending at the tokenizer's stop ids
    stops = list(getattr(tok, "stop_ids", None) or [tok.eos_id])
    engine = Engine(model, num_blocks=64, block_size=16, max_batch_tokens=16, eos_ids=stops)
    got = [[t for t in c.tokens if t not in stops] for c in engine.generate(prompts, RequestParams(max_tokens=12))]
    assert [tok.decode(g) for g in got] == decode.generate(model, tok, texts, max_new_tokens=12, temperature=0)
