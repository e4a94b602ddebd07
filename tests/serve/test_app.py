"""The OpenAI-compatible server end to end: the official ``openai`` client against a real uvicorn server
on 127.0.0.1, a tiny model behind it. Answers are checked against the engine run directly."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnmask.decode.sampling import GREEDY
from attnmask.engine import Engine, Penalties, RequestParams
from tests.serve.conftest import MODEL, TEMPLATE, TIMEOUT, PacedEngine, serve, tiny_lm

pytestmark = pytest.mark.usefixtures("one_thread")

CAPACITY = 512  # the tiny model's context (its cache holds more)


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_lm(tokenizer, max_seq_len=CAPACITY)


@pytest.fixture(scope="module")
def served(model, tokenizer):
    engine = PacedEngine(model, kv_cache_mib=4, block_size=16, eos_ids=[tokenizer.eos_id], tokenizer=tokenizer)
    with serve(engine, tokenizer) as s:
        yield s


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served.base_url, api_key="unused", timeout=TIMEOUT, max_retries=0) as c:
        yield c


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served.url, timeout=TIMEOUT) as h:
        yield h


@pytest.fixture
def paced(served):
    """Steps of at least 5 ms for one test: its request is still running when the test acts."""
    served.engine.pace = 0.005
    yield served
    served.engine.pace = 0.0


def direct(model, tokenizer, prompt_ids, **params):
    """The answer of the engine itself (no server): ids, log-probabilities, finish reason."""
    engine = Engine(model, kv_cache_mib=4, eos_ids=[tokenizer.eos_id], tokenizer=tokenizer)
    (c,) = engine.generate([prompt_ids], RequestParams(**params))
    return c


# ---- answers ---------------------------------------------------------------------------------------
def test_completion_is_the_engines_answer(client, model, tokenizer):
    r = client.completions.create(model=MODEL, prompt="Hello, world", max_tokens=12, temperature=0)
    want = direct(model, tokenizer, tokenizer.encode("Hello, world"), max_tokens=12, sampling=GREEDY)
    assert r.choices[0].text == tokenizer.decode(want.tokens)
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.model == MODEL and r.object == "text_completion" and r.id.startswith("cmpl-")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (12, len(want.tokens))
    assert r.usage.total_tokens == 12 + len(want.tokens)


def test_ignore_eos_runs_to_max_tokens(client):
    r = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"


def test_completion_logprobs_are_the_engines(client, model, tokenizer):
    r = client.completions.create(model=MODEL, prompt="The cat", max_tokens=8, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    want = direct(model, tokenizer, tokenizer.encode("The cat"), max_tokens=8, sampling=GREEDY, ignore_eos=True,
                  logprobs=True)  # fmt: skip
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(want.logprobs, abs=0)  # the same floats, sent as JSON
    assert lp.tokens == [tokenizer.decode([t], skip_special=False) for t in want.tokens]
    assert lp.text_offset == list(range(8)) and all(x <= 0 for x in lp.token_logprobs)


def test_echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_read_it(client, model, tokenizer):
    """lm-evaluation-harness's loglikelihood request: token ids (context + continuation), ``echo``,
    ``logprobs`` 1, ``max_tokens`` 1, greedy. It reads ``token_logprobs[ctxlen:-1]`` (their sum: the
    continuation's log-likelihood) and ``top_logprobs[ctxlen:-1]`` (greedy where each token's logprob is
    its position's largest). Both are the engine's own, bit for bit."""
    context, continuation = tokenizer.encode("The cat sat on"), tokenizer.encode(" the mat")
    ids = context + continuation
    r = client.completions.create(model=MODEL, prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0)
    want = direct(model, tokenizer, ids, max_tokens=1, sampling=GREEDY, logprobs=True, top_logprobs=1,
                  prompt_logprobs=True)  # fmt: skip
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text == tokenizer.decode(ids) + tokenizer.decode(want.tokens)
    assert lp.tokens == [tokenizer.decode([t], skip_special=False) for t in ids + want.tokens]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert lp.token_logprobs[1:] == [s.logprob for s in want.prompt_logprobs] + want.logprobs  # the same floats
    ctx = len(context)
    loglikelihood = sum(lp.token_logprobs[ctx:-1])
    greedy = all(tok == max(top.values()) for tok, top in zip(lp.token_logprobs[ctx:-1], lp.top_logprobs[ctx:-1]))
    assert loglikelihood == sum(s.logprob for s in want.prompt_logprobs[ctx - 1 :]) < 0
    assert greedy == all(s.top[0][0] == s.token for s in want.prompt_logprobs[ctx - 1 :])
    for entry, score in zip(lp.top_logprobs[1:], want.prompt_logprobs):  # the top token and the prompt's own
        top_text = tokenizer.decode([score.top[0][0]], skip_special=False)
        assert entry[top_text] == score.top[0][1] and entry[tokenizer.decode([score.token])] == score.logprob
    assert lp.text_offset == list(range(len(ids) + 1))  # one character a token
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1


def test_echo_with_no_tokens_scores_the_prompt_only_streamed_or_not(client, model, tokenizer):
    prompt = "Score this prompt"
    ids = tokenizer.encode(prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    want = direct(model, tokenizer, ids, max_tokens=0, logprobs=True, top_logprobs=2, prompt_logprobs=True)
    choice = r.choices[0]
    assert (choice.text, choice.finish_reason, r.usage.completion_tokens) == (prompt, "length", 0)
    assert choice.logprobs.token_logprobs == [None] + [s.logprob for s in want.prompt_logprobs]
    assert all(len(top) in (2, 3) for top in choice.logprobs.top_logprobs[1:])  # the 2 most likely, the prompt's
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0,
                                            stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == prompt and chunks[-1].choices[0].finish_reason == "length"
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == choice.logprobs.token_logprobs
    # echo without logprobs: the prompt, then the completion
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=5, temperature=0)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert r.choices[0].text == prompt + plain.choices[0].text and r.choices[0].logprobs is None


def test_top_logprobs_of_a_completion_and_of_a_chat(client, model, tokenizer):
    r = client.completions.create(model=MODEL, prompt="The dog", max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    want = direct(model, tokenizer, tokenizer.encode("The dog"), max_tokens=6, sampling=GREEDY, ignore_eos=True,
                  logprobs=True, top_logprobs=3)  # fmt: skip
    lp = r.choices[0].logprobs
    for entry, top, chosen in zip(lp.top_logprobs, want.top, want.logprobs):
        assert list(entry.values())[:3] == [x for _, x in top] and max(entry.values()) == chosen  # greedy
    messages = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=4)  # fmt: skip
    want = direct(model, tokenizer, tokenizer.encode(TEMPLATE(messages)), max_tokens=5, sampling=GREEDY,
                  logprobs=True, top_logprobs=4)  # fmt: skip
    for entry, top in zip(r.choices[0].logprobs.content, want.top):
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
            (tokenizer.decode([i], skip_special=False), x) for i, x in top
        ]
        assert entry.top_logprobs[0].bytes == list(entry.top_logprobs[0].token.encode())


def test_a_batch_of_prompts_is_answered_as_choices_each_its_solo_answer(client):
    """lm-evaluation-harness with batch_size > 1 sends several prompts in one request: each is its own
    choice, in order, each the answer it gets alone (streamed or not); usage counts them all."""
    prompts = ["The cat", "A dog ran", "Hello"]
    kw = dict(model=MODEL, max_tokens=6, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    r = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert [c.logprobs.token_logprobs for c in r.choices] == [a.choices[0].logprobs.token_logprobs for a in alone]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone) and r.usage.completion_tokens == 18
    chunks = list(client.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True}, **kw))
    texts = ["", "", ""]
    for c in chunks[:-1]:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [a.choices[0].text for a in alone] and chunks[-1].usage.completion_tokens == 18


def test_n_answers_each_prompt_with_seeds_that_repeat(client):
    """``n`` sampled answers: answer j draws from seed + j, so answer 0 is the request's with n = 1 and
    the others differ; several prompts number their answers prompt by prompt; a prompt's tokens count once."""
    kw = dict(model=MODEL, max_tokens=12, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    one = client.completions.create(prompt="Tell", **kw)
    r = client.completions.create(prompt="Tell", n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.choices[0].text == one.choices[0].text
    assert len({c.text for c in r.choices}) == 3
    assert r.choices[1].text == client.completions.create(prompt="Tell", **{**kw, "seed": 8}).choices[0].text
    assert r.usage.prompt_tokens == one.usage.prompt_tokens and r.usage.completion_tokens == 36
    r = client.completions.create(prompt=["Tell", "Ask me"], n=2, **kw)
    assert [c.text for c in r.choices][::2] == [one.choices[0].text, client.completions.create(
        prompt="Ask me", **kw).choices[0].text]  # fmt: skip
    assert r.usage.prompt_tokens == len("Tell") + len("Ask me")
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, n=2, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message == chat.choices[1].message


def test_priorities_need_priority_scheduling_and_change_no_answer(client, model, tokenizer):
    kw = dict(model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError, match="needs priority scheduling"):
        client.completions.create(prompt="ab", **{**kw, "extra_body": {"priority": 1}})
    with pytest.raises(openai.BadRequestError, match="'priority' must be an integer"):
        client.completions.create(prompt="ab", **{**kw, "extra_body": {"priority": "high"}})
    prompts = ["ab", "a longer prompt", "xyz"]
    want = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    engine = Engine(model, kv_cache_mib=1, eos_ids=[tokenizer.eos_id], tokenizer=tokenizer, scheduling="priority")
    with serve(engine, tokenizer) as s, openai.OpenAI(base_url=s.base_url, api_key="-", timeout=TIMEOUT) as c:
        got = c.completions.create(
            prompt=prompts, model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True, "priority": -3}
        )
        assert [choice.text for choice in got.choices] == want


def test_penalties_and_logit_bias_are_the_engines(client, model, tokenizer):
    """OpenAI's penalties and ``logit_bias``, vLLM's ``repetition_penalty``: the engine's own answer with
    the same settings, and not the plain one."""
    prompt = tokenizer.encode("the the the cat")
    kw = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw, presence_penalty=0.6, frequency_penalty=0.8, logit_bias={"40": 3.0},
                                  extra_body={"ignore_eos": True, "repetition_penalty": 1.3})  # fmt: skip
    penalties = Penalties(presence=0.6, frequency=0.8, repetition=1.3, logit_bias=((40, 3.0),))
    want = direct(model, tokenizer, prompt, max_tokens=16, ignore_eos=True, penalties=penalties)
    assert r.choices[0].text == tokenizer.decode(want.tokens) != plain.choices[0].text
    # a bias of 100 forces a token, in a chat too
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, logit_bias={"65": 100})
    assert chat.choices[0].message.content == tokenizer.decode([65] * 5)


def test_min_tokens_holds_back_the_end(client, tokenizer):
    bias = {str(tokenizer.eos_id): 100}  # <eos> at once, unless held back
    kw = dict(model=MODEL, prompt="abc", max_tokens=10, temperature=0, logit_bias=bias)
    assert client.completions.create(**kw).usage.completion_tokens == 1
    r = client.completions.create(**kw, extra_body={"min_tokens": 4})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "stop"


def test_best_of_returns_the_most_likely_of_its_answers(client):
    """``best_of`` 4: the 4 answers are those of seeds 7..10; the one returned has the highest mean
    log-probability per token; usage counts every token computed; ``n`` 2 returns the two best in order."""
    kw = dict(model=MODEL, prompt="Tell", max_tokens=8, temperature=1.5, extra_body={"ignore_eos": True})
    each = [client.completions.create(**kw, seed=7 + j, logprobs=0).choices[0] for j in range(4)]
    means = [sum(c.logprobs.token_logprobs) / 8 for c in each]
    ranked = [each[j].text for j in sorted(range(4), key=lambda j: -means[j])]
    assert len(set(ranked)) == 4, "the seeds should give different answers"
    r = client.completions.create(**kw, seed=7, best_of=4)
    assert [c.text for c in r.choices] == ranked[:1] and r.usage.completion_tokens == 32
    assert r.choices[0].logprobs is None  # not asked for
    r = client.completions.create(**kw, seed=7, best_of=4, n=2, logprobs=1)
    assert [c.text for c in r.choices] == ranked[:2] and [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].logprobs.token_logprobs is not None
    with pytest.raises(openai.BadRequestError, match="cannot be streamed"):
        client.completions.create(**kw, best_of=2, stream=True)


def test_stop_token_ids_end_the_answer(client, tokenizer):
    kw = dict(model=MODEL, prompt="abc", max_tokens=10, temperature=0, logit_bias={"66": 100})  # "66" always
    assert client.completions.create(**kw, extra_body={"ignore_eos": True}).usage.completion_tokens == 10
    r = client.completions.create(**kw, extra_body={"ignore_eos": True, "stop_token_ids": [66]})
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"


def test_tokenize_and_detokenize(client, http, tokenizer):
    """vLLM's /tokenize (a prompt, or messages through the chat template: the ids a chat request's prompt
    has) and /detokenize."""
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello, world"}).json()
    assert r["tokens"] == tokenizer.encode("Hello, world") and r["count"] == 12 and r["max_model_len"] > 12
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello, world"}
    messages = [{"role": "user", "content": "Hi"}]
    r = http.post("/tokenize", json={"messages": messages}).json()
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert r["count"] == chat.usage.prompt_tokens
    bad = [
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
        ("/detokenize", {"tokens": "ab"}, "tokens"),
        ("/tokenize", {"model": "x", "prompt": "a"}, "model"),
    ]
    for path, body, param in bad:
        answer = http.post(path, json=body)
        assert answer.status_code in (400, 404) and answer.json()["error"]["param"] == param


def test_a_refused_prompt_in_a_batch_refuses_the_request_and_runs_nothing(client, http):
    with pytest.raises(openai.BadRequestError, match="prompt 1 of 2"):
        client.completions.create(model=MODEL, prompt=["fine", "x" * CAPACITY], max_tokens=4)
    metrics = http.get("/metrics").text
    assert "attnmask_requests_running 0.0" in metrics and "attnmask_cache_blocks_used 0.0" in metrics
    # refused by the engine when the second is submitted (an id outside the vocabulary): the first, queued
    # already, is cancelled
    with pytest.raises(openai.BadRequestError, match="token ids must be in"):
        client.completions.create(model=MODEL, prompt=[[5, 6, 7], [10**6]], max_tokens=4)
    deadline = time.time() + TIMEOUT
    while time.time() < deadline:
        metrics = http.get("/metrics").text
        if all(f"attnmask_{m} 0.0" in metrics for m in ("requests_running", "requests_waiting", "cache_blocks_used")):
            break
        time.sleep(0.02)
    assert "attnmask_requests_waiting 0.0" in metrics and "attnmask_cache_blocks_used 0.0" in metrics


def test_sampling_with_a_seed_is_reproducible(client):
    def ask():
        extra = {"ignore_eos": True, "top_k": 8}  # top_k: an extension
        r = client.completions.create(model=MODEL, prompt="x", max_tokens=16, temperature=1.0, top_p=0.9, seed=1234,
                                      extra_body=extra)  # fmt: skip
        return r.choices[0].text

    assert ask() == ask()


def test_stop_string_cuts_the_answer(client):
    full = client.completions.create(model=MODEL, prompt="Once", max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text  # fmt: skip
    stop = full[5:7]
    cut = full[: full.find(stop)]
    r = client.completions.create(model=MODEL, prompt="Once", max_tokens=30, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(full[: full.find(stop) + len(stop)])  # one character per token
    streamed = client.completions.create(model=MODEL, prompt="Once", max_tokens=30, temperature=0, stop=stop,
                                         stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_chat_uses_the_template(client, model, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True)
    prompt = tokenizer.encode(TEMPLATE(messages))
    want = direct(model, tokenizer, prompt, max_tokens=10, sampling=GREEDY, logprobs=True)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == tokenizer.decode(want.tokens)
    assert r.object == "chat.completion" and r.usage.prompt_tokens == len(prompt)
    assert [c.logprob for c in choice.logprobs.content] == want.logprobs
    assert [c.token for c in choice.logprobs.content] == [
        tokenizer.decode([t], skip_special=False) for t in want.tokens
    ]


def test_a_chat_continues_the_assistants_prefill(client, model, tokenizer, http):
    """vLLM's ``continue_final_message``: the prompt ends right after the last (assistant) message's text,
    without the template's end of turn, and the answer is that text's continuation."""
    messages = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon"}]
    body = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    r = client.chat.completions.create(**body, extra_body=extra)
    prompt = tokenizer.encode("<|user|>Tell a story\n<|assistant|>Once upon")
    want = direct(model, tokenizer, prompt, max_tokens=10, sampling=GREEDY)
    assert r.choices[0].message.content == tokenizer.decode(want.tokens) and r.usage.prompt_tokens == len(prompt)
    assert client.chat.completions.create(**body, extra_body={"continue_final_message": True}).choices[
        0
    ].message.content == (r.choices[0].message.content)  # add_generation_prompt left out: taken as false
    assert http.post("/tokenize", json={"messages": messages, **extra}).json()["count"] == len(prompt)
    no_prompt = http.post("/tokenize", json={"messages": messages[:1], "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == tokenizer.encode("<|user|>Tell a story\n")
    for wrong in (
        {"messages": messages[:1], "continue_final_message": True},
        {"messages": messages, "continue_final_message": True, "add_generation_prompt": True},
        {"messages": messages, "continue_final_message": "yes"},
        {"messages": messages, "add_generation_prompt": 1},
        {"messages": messages, "continue_final_message": True, "tools": [
            {"type": "function", "function": {"name": "f"}}]},
    ):  # fmt: skip
        r = http.post("/v1/chat/completions", json={"model": MODEL, **wrong})
        assert r.status_code == 400 and r.json()["error"]["param"] in (
            "continue_final_message",
            "add_generation_prompt",
        )


def test_streaming_completion_equals_the_whole(client):
    kwargs = dict(model=MODEL, prompt="Stream me", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    *text_chunks, usage = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert usage.choices == [] and usage.usage.completion_tokens == 20 and usage.usage.prompt_tokens == 9


def test_streaming_chat(client):
    messages = [{"role": "user", "content": "Tell me"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=15, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=15, temperature=0,
                                                 stream=True, logprobs=True))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(tokens) == whole.usage.completion_tokens


def test_raw_sse_format(http):
    body = {"model": MODEL, "prompt": "raw", "max_tokens": 3, "temperature": 0, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2]) and len(events[:-2]) == 3
    assert json.loads(events[0][len("data: ") :])["object"] == "text_completion"


def test_models_health_metrics(client, http):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert http.get("/health").json() == {"status": "ok"}
    client.completions.create(
        model=MODEL, prompt="count me", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    text = http.get("/metrics").text
    for name in [
        "attnmask_requests_running", "attnmask_requests_waiting", "attnmask_cache_blocks_used",
        "attnmask_cache_blocks_total", "attnmask_prompt_tokens_total", "attnmask_generation_tokens_total",
        "attnmask_time_to_first_token_seconds_bucket", "attnmask_inter_token_latency_seconds_bucket",
        "attnmask_preemptions",
    ]:  # fmt: skip
        assert f"\n{name}" in text, name
    m = {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in text.splitlines() if line[:1] != "#"}
    assert m["attnmask_generation_tokens_total"] >= 5 and m["attnmask_time_to_first_token_seconds_count"] >= 1
    assert m["attnmask_inter_token_latency_seconds_count"] >= 4 and m["attnmask_cache_blocks_total"] > 0


# ---- client mistakes: 4xx with OpenAI's error object, never a 500 ---------------------------------
ERRORS = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b"\xff\xfe\x00", 400, None),
    (b"[" * 100_000, 400, None),
    ({"model": "gpt-4", "prompt": "a"}, 404, "model"),
    ({"model": MODEL, "prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "a" * CAPACITY}, 400, "prompt"),
    ({"model": MODEL, "prompt": "a" * 100, "max_tokens": CAPACITY}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "a", "n": 33}, 400, "n"),
    ({"model": MODEL, "prompt": [10_000]}, 400, None),  # a token id outside the vocabulary
    ({"model": MODEL, "prompt": {"text": "a"}}, 400, "prompt"),
    ({"model": MODEL, "prompt": "a", "temperature": "warm"}, 400, "temperature"),
]


@pytest.mark.parametrize("body, status, param", ERRORS)
def test_completion_mistakes(http, body, status, param):
    r = http.post("/v1/completions", **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": MODEL}, 400, "messages"),
        ({"model": MODEL, "messages": "hi"}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "user"}], "n": 0}, 400, "n"),
        ({"model": "other", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi" * CAPACITY}]}, 400, "messages"),
    ],
)
def test_chat_mistakes(http, body, status, param):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_mistakes_through_the_openai_client(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="a")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="a", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="'n' must be an integer >= 1 and <= 32"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], n=33)


def test_routes_and_methods_answer_json(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = http.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_chat_without_a_template_is_400(model, tokenizer):
    engine = Engine(model, kv_cache_mib=1, eos_ids=[tokenizer.eos_id], tokenizer=tokenizer)
    with serve(engine, tokenizer, chat_template=None) as s, httpx.Client(base_url=s.url, timeout=TIMEOUT) as h:
        r = h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        assert h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_an_api_key_guards_the_api_but_not_health_or_metrics(model, tokenizer):
    engine = Engine(model, kv_cache_mib=1, eos_ids=[tokenizer.eos_id], tokenizer=tokenizer)
    with serve(engine, tokenizer, api_key="sk-right") as s, httpx.Client(base_url=s.url, timeout=TIMEOUT) as h:
        for key in ("sk-wrong", "-"):
            with openai.OpenAI(base_url=s.base_url, api_key=key, timeout=TIMEOUT, max_retries=0) as c:
                with pytest.raises(openai.AuthenticationError) as err:
                    c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
                assert err.value.body["code"] == "invalid_api_key"
        r = h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 401 and "no API key given" in r.json()["error"]["message"]
        assert r.headers["www-authenticate"] == "Bearer"
        assert all(h.post(p, json={"prompt": "hi"}).status_code == 401 for p in ("/tokenize", "/detokenize"))
        assert h.get("/v1/models").status_code == 401
        with openai.OpenAI(base_url=s.base_url, api_key="sk-right", timeout=TIMEOUT, max_retries=0) as c:
            assert c.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
            chunks = list(c.completions.create(model=MODEL, prompt="hi", max_tokens=3, stream=True))
            assert chunks[-1].choices[0].finish_reason is not None
        assert h.get("/health").json() == {"status": "ok"}
        assert s.metrics()['attnmask_requests_rejected_total{status="401"}'] == 6


def test_prefix_caching_serves_the_same_answers_and_says_what_it_saved(model, tokenizer):
    """Two chats with one long system prompt, through an engine with prefix caching: the second finds
    the first's blocks (``/metrics``), and both answers are those of an engine without."""
    system = {"role": "system", "content": "You are a terse assistant. Answer in one short line. " * 3}
    asks = [[system, {"role": "user", "content": q}] for q in ("Name a colour.", "Name a fruit.")]
    answers = {}
    for caching in (False, True):
        engine = Engine(model, kv_cache_mib=2, eos_ids=[tokenizer.eos_id], tokenizer=tokenizer,
                        prefix_caching=caching)  # fmt: skip
        with serve(engine, tokenizer) as s, openai.OpenAI(base_url=s.base_url, api_key="-", timeout=TIMEOUT) as c:
            answers[caching] = [
                c.chat.completions.create(model=MODEL, messages=m, max_tokens=8, temperature=0, logprobs=True)
                for m in asks
            ]
            metrics = s.metrics()
        saved = metrics.get("attnmask_prefix_cache_tokens_total", 0)
        assert (saved >= 16 * (len(TEMPLATE(asks[0][:1])) // 16)) if caching else saved == 0
    for a, b in zip(answers[False], answers[True]):
        assert a.choices[0].message.content == b.choices[0].message.content
        assert [t.logprob for t in a.choices[0].logprobs.content] == [t.logprob for t in b.choices[0].logprobs.content]


def test_speculative_decoding_serves_the_same_answers_and_counts_its_drafts(model, tokenizer):
    """Prompts that repeat themselves, through an engine that drafts by prompt lookup: the answers (text and
    log-probabilities, streamed or not) are those of an engine without, and ``/metrics`` counts the drafts."""
    prompts = ["abc abc abc abc abc abc", "x = 1; x = 1; x = 1; x = 1;", "Hello hello hello hello"]
    kw = dict(model=MODEL, max_tokens=24, temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    answers = {}
    for k in (0, 4):
        engine = Engine(model, kv_cache_mib=2, eos_ids=[tokenizer.eos_id], tokenizer=tokenizer, speculative_tokens=k)
        with serve(engine, tokenizer) as s, openai.OpenAI(base_url=s.base_url, api_key="-", timeout=TIMEOUT) as c:
            answers[k] = [c.completions.create(prompt=p, **kw).choices[0] for p in prompts]
            streamed = ["".join(x.choices[0].text for x in c.completions.create(prompt=p, stream=True, **kw))
                        for p in prompts]  # fmt: skip
            metrics = s.metrics()
        assert streamed == [a.text for a in answers[k]]
        drafted = metrics.get("attnmask_draft_tokens_total", 0)
        accepted = metrics.get("attnmask_draft_accepted_tokens_total", 0)
        assert (drafted >= accepted > 0) if k else drafted == 0
    for a, b in zip(answers[0], answers[4]):
        assert a.text == b.text and a.logprobs.token_logprobs == b.logprobs.token_logprobs


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 8) | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "stop", "n", "seed",
          "logprobs", "stream", "stream_options"]  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       body=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6))  # fmt: skip
def test_no_body_makes_a_500(http, path, body):
    body.setdefault("max_tokens", 3)
    r = http.post(path, content=json.dumps(body))
    assert r.status_code in (200, 400, 404), (r.status_code, r.text)
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# ---- a client that goes away -----------------------------------------------------------------------
def test_a_streaming_client_that_leaves_cancels_its_request(paced, client):
    before = paced.metrics()
    stream = client.completions.create(model=MODEL, prompt="long story", max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    after = paced.wait_idle()
    cancelled = 'attnmask_requests_finished_total{finish_reason="cancelled"}'
    assert after[cancelled] == before.get(cancelled, 0) + 1
    generated = after["attnmask_generation_tokens_total"] - before["attnmask_generation_tokens_total"]
    assert 4 <= generated < 400  # stopped well before max_tokens


def test_a_non_streaming_client_that_leaves_cancels_its_request(paced):
    before = paced.metrics()
    body = {"model": MODEL, "prompt": "long story", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{paced.url}/v1/completions", json=body, timeout=0.3)  # the client gives up, closing the socket
    after = paced.wait_idle()
    cancelled = 'attnmask_requests_finished_total{finish_reason="cancelled"}'
    assert after[cancelled] == before.get(cancelled, 0) + 1
    assert after["attnmask_generation_tokens_total"] - before["attnmask_generation_tokens_total"] < 400


def test_shutdown_refuses_new_requests_and_cancels_running_ones(model, tokenizer):
    engine = PacedEngine(model, kv_cache_mib=1, eos_ids=[tokenizer.eos_id], tokenizer=tokenizer)
    engine.pace = 0.005
    with serve(engine, tokenizer) as s, openai.OpenAI(base_url=s.base_url, api_key="-", max_retries=0,
                                                      timeout=TIMEOUT) as c:  # fmt: skip
        stream = c.completions.create(model=MODEL, prompt="abc", max_tokens=400, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})  # fmt: skip
        next(iter(stream))
        s.loop.stop_admitting()
        with pytest.raises(openai.InternalServerError) as err:  # 503
            c.completions.create(model=MODEL, prompt="abc", max_tokens=2)
        assert err.value.status_code == 503
        assert httpx.get(f"{s.url}/health").status_code == 503
        start = time.monotonic()
        s.loop.shutdown()  # cancels what is running
        reasons = [chunk.choices[0].finish_reason for chunk in stream]
        assert reasons[-1] == "cancelled" and time.monotonic() - start < 5
        assert engine.stats().blocks_used == 0 and not engine.has_work()


class FailingEngine(Engine):
    """An engine with a bug: its first step raises."""

    def step(self):
        raise RuntimeError("boom")


def test_an_engine_failure_is_a_500_and_the_server_stops_admitting(model, tokenizer):
    engine = FailingEngine(model, kv_cache_mib=1, eos_ids=[tokenizer.eos_id], tokenizer=tokenizer)
    with serve(engine, tokenizer) as s, httpx.Client(base_url=s.url, timeout=TIMEOUT) as h:
        r = h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
        assert h.get("/health").status_code == 503
        assert h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 503
