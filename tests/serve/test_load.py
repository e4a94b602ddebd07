"""A bounded load test on 127.0.0.1: 64 concurrent streaming requests through a cache that holds a
few of them at a time, every 8th client leaving mid-way, every 8th other one scoring its prompt
(``echo`` with the top 2 log-probabilities, as evaluation harnesses ask). Each surviving answer must
be its solo answer exactly (text and log-probabilities), and the server must end with no request
running and no cache block used."""

from __future__ import annotations

import asyncio
import re
import threading

import openai
import pytest

from tests.serve.conftest import MODEL, TIMEOUT, PacedEngine, serve, tiny_lm

pytestmark = pytest.mark.usefixtures("one_thread")

N = 64  # concurrent requests
DROP_EVERY = 8  # these clients leave after a few chunks
DROP_AFTER = 3  # chunks
SCORED = 3  # requests i with i % DROP_EVERY == SCORED echo and score their prompts
PENALIZED = 5  # requests i with i % DROP_EVERY == PENALIZED have penalties and a logit bias
STRUCTURED = 6  # requests i with i % DROP_EVERY == STRUCTURED are held to a regex (structured output)
MAX_TOKENS = 24
DROPPED_MAX_TOKENS = 96  # what the leaving clients ask for: still running when they leave
LOAD_TIMEOUT = 60.0  # seconds for the whole concurrent phase

PROMPTS = [f"Request {i}: {'abcdefghij'[i % 10] * (1 + i % 7)}?" for i in range(N)]


@pytest.fixture(scope="module")
def served(tokenizer):
    model = tiny_lm(tokenizer, max_seq_len=128, seed=1)
    # 8-position blocks, 48 of them: a request needs up to 6 (16 if it leaves), so a few run at once and the rest wait
    engine = PacedEngine(model, num_blocks=48, block_size=8, max_batch_tokens=64, max_seqs=64,
                         eos_ids=[tokenizer.eos_id], tokenizer=tokenizer)  # fmt: skip
    engine.pace = 0.001  # a leaving client's request is still running when it leaves
    with serve(engine, tokenizer) as s:
        yield s


def request(i: int, max_tokens: int = MAX_TOKENS) -> dict:
    scores = dict(echo=True, logprobs=2) if i % DROP_EVERY == SCORED else {}
    extra = {"ignore_eos": True}
    if i % DROP_EVERY == PENALIZED:
        scores |= dict(frequency_penalty=0.5, presence_penalty=0.2, logit_bias={"40": 1.0})
        extra |= {"repetition_penalty": 1.2}
    if i % DROP_EVERY == STRUCTURED:
        extra |= {"guided_regex": "[a-z ]{5,15}[.!?]"}
    return dict(model=MODEL, prompt=PROMPTS[i], max_tokens=max_tokens, temperature=0, extra_body=extra,
                **scores)  # fmt: skip


def answer(choice) -> tuple[str, list | None]:
    return choice.text, choice.logprobs.token_logprobs if choice.logprobs else None


def test_concurrent_streams_equal_their_solo_runs(served):
    with openai.OpenAI(base_url=served.base_url, api_key="-", timeout=TIMEOUT, max_retries=0) as client:
        solo = [answer(client.completions.create(**request(i)).choices[0]) for i in range(N)]
    assert len({text for text, _ in solo}) > N // 4  # the prompts give different answers: a mix-up would show
    assert all(lp[0] is None and len(lp) > 10 for i, (_, lp) in enumerate(solo) if i % DROP_EVERY == SCORED)
    assert all(
        re.fullmatch("[a-z ]{5,15}[.!?]", text) for i, (text, _) in enumerate(solo) if i % DROP_EVERY == STRUCTURED
    )
    before = served.metrics()

    most_waiting = 0
    done = threading.Event()

    def watch():  # the engine loop's own snapshot, sampled while the load runs
        nonlocal most_waiting
        while not done.wait(0.005):
            most_waiting = max(most_waiting, served.loop.stats().waiting)

    async def one(client, i: int) -> tuple[str, list | None] | None:
        leaves, scored = i % DROP_EVERY == 0, i % DROP_EVERY == SCORED
        max_tokens = DROPPED_MAX_TOKENS if leaves else MAX_TOKENS
        stream = await client.completions.create(**request(i, max_tokens), stream=True)
        pieces, logprobs = [], [] if scored else None
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
            if scored and chunk.choices[0].logprobs:
                logprobs += chunk.choices[0].logprobs.token_logprobs
            if leaves and len(pieces) == DROP_AFTER:
                await stream.close()  # the client goes away mid-answer
                return None
        return "".join(pieces), logprobs

    async def load() -> list[str | None]:
        async with openai.AsyncOpenAI(base_url=served.base_url, api_key="-", timeout=TIMEOUT, max_retries=0) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(N))), LOAD_TIMEOUT)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        answers = asyncio.run(load())
    finally:
        done.set()
        watcher.join()

    for i, (got, want) in enumerate(zip(answers, solo)):
        if i % DROP_EVERY:
            assert got == want, f"request {i}: {got!r} != solo {want!r}"
        else:
            assert got is None
    assert most_waiting > 0  # the cache was full: requests queued rather than failing
    after = served.wait_idle()
    cancelled = 'attnmask_requests_finished_total{finish_reason="cancelled"}'
    assert N // DROP_EVERY // 2 <= after.get(cancelled, 0) - before.get(cancelled, 0) <= N // DROP_EVERY
    assert after["attnmask_cache_blocks_total"] == served.loop.stats().blocks_total > 0
