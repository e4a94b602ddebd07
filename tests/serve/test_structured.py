"""Structured output (:mod:`attnmask.decode.grammar`): answers held to a regex, a choice, a JSON schema or a
Lark grammar, in the engine and through the server.

- Every answer is in its grammar's language, and ends (``stop``) when the grammar does.
- A greedy constrained token is the arg-max of the model's full-forward logits over the tokens a fresh
  matcher allows there; the reported log-probabilities are the model's own (before the mask).
- Constrained requests, greedy and sampled, beside plain ones, over small chunks and a preempting
  cache, are bitwise their solo runs.
- The server's ``response_format`` and ``guided_*`` fields, streamed or not, and their mistakes.
"""

from __future__ import annotations

import json
import re

import openai
import pytest
import torch

from attnmask import masks
from attnmask.decode.grammar import Grammar, Matcher, grammar_tokenizer
from attnmask.decode.sampling import GREEDY, Sampling
from attnmask.engine import Engine, RequestParams
from attnmask.errors import UserError
from tests.serve.conftest import MODEL, TIMEOUT, serve, tiny_lm

pytestmark = pytest.mark.usefixtures("one_thread")

BOOLEAN_AND_COLOR = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},  # a finite language: a random model cannot pad it forever
}
REGEX = r"[a-f]{2,5}(x|yz)"


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_lm(tokenizer, max_seq_len=256)


def engine_of(model, tokenizer, **kw) -> Engine:
    return Engine(model, **{"kv_cache_mib": 4, "eos_ids": [tokenizer.eos_id], "tokenizer": tokenizer, **kw})


def answer(engine, tokenizer, prompt: str, grammar, sampling=GREEDY, seed=0, max_tokens=40):
    (c,) = engine.generate([tokenizer.encode(prompt)], RequestParams(
        max_tokens=max_tokens, grammar=grammar, sampling=sampling, seed=seed, logprobs=True))  # fmt: skip
    return c, tokenizer.decode([t for t in c.tokens if t != tokenizer.eos_id])


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=1.0)])
def test_answers_are_in_their_grammars_language(model, tokenizer, sampling):
    engine = engine_of(model, tokenizer)
    for i, prompt in enumerate(["Hello", "What?", "x = 1;", "The quick brown fox"]):
        c, text = answer(engine, tokenizer, prompt, Grammar.regex(REGEX), sampling, seed=i)
        assert re.fullmatch(REGEX, text) and c.finish_reason == "stop", text
        c, text = answer(engine, tokenizer, prompt, Grammar.choice(["alpha", "beta", "gamma"]), sampling, seed=i)
        assert text in ("alpha", "beta", "gamma") and c.finish_reason == "stop"
        c, text = answer(engine, tokenizer, prompt, Grammar.json_schema(BOOLEAN_AND_COLOR), sampling, seed=i)
        value = json.loads(text)
        assert (
            set(value) == {"ok", "color"}
            and isinstance(value["ok"], bool)
            and value["color"] in ("red", "green", "blue")
        )
        c, text = answer(engine, tokenizer, prompt, Grammar.lark('start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'),
                         sampling, seed=i, max_tokens=60)  # fmt: skip
        assert re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", text) or c.finish_reason == "length", text
    assert engine.stats().blocks_used == 0


def test_a_greedy_constrained_token_is_the_arg_max_over_the_allowed_tokens(model, tokenizer):
    engine = engine_of(model, tokenizer, max_batch_tokens=3)
    grammar = Grammar.regex(r"[0-9a-z ]{4,12}\.")
    prompt = tokenizer.encode("Count: ")
    c, text = answer(engine, tokenizer, "Count: ", grammar)
    plain, _ = answer(engine, tokenizer, "Count: ", None, max_tokens=len(c.tokens))
    assert c.tokens != plain.tokens, "the grammar should change this answer"
    whole = prompt + c.tokens
    with torch.no_grad():
        rows = model.double().decode(torch.tensor([whole]), mask=masks.causal())[0]
    model.float()
    replay = Matcher(grammar, grammar_tokenizer(tokenizer, model.config.vocab_size, [tokenizer.eos_id]))
    bitmask = torch.zeros(1, (model.config.vocab_size + 31) // 32, dtype=torch.int32)
    for i, token in enumerate(c.tokens):
        row = rows[len(prompt) + i - 1]
        replay.fill(bitmask, 0)
        bits = (bitmask[0, :, None] >> torch.arange(32)) & 1
        allowed = bits.flatten()[: row.shape[0]].bool()
        assert allowed[token], f"token {i} is not allowed"
        best = float(row.masked_fill(~allowed, float("-inf")).max())
        assert float(row[token]) >= best - 1e-5, f"token {i} is not the arg-max over the allowed tokens"
        assert c.logprobs[i] == pytest.approx(float(torch.log_softmax(row, -1)[token]), abs=5e-5)  # the model's own
        replay.advance(token)
    assert replay.done


def test_structured_requests_are_bitwise_their_solo_runs(model, tokenizer):
    grammars = [Grammar.regex(REGEX), None, Grammar.choice(["alpha", "beta"]), Grammar.json_schema(BOOLEAN_AND_COLOR),
                None, Grammar.regex(r"[0-9]{3,9}")]  # fmt: skip
    prompts = [tokenizer.encode(p) for p in ["Hello", "What is it?", "x = 1;", "Tell me", "Once upon", "abc"]]
    params = [RequestParams(max_tokens=30, grammar=g, logprobs=True, seed=i,
                            sampling=Sampling(temperature=0.9) if i % 2 else GREEDY)
              for i, g in enumerate(grammars)]  # fmt: skip
    alone = [engine_of(model, tokenizer).generate([p], q)[0] for p, q in zip(prompts, params)]
    # 5 tokens a step and 14 blocks of 4: chunked prompts, requests preempted and recomputed; arriving apart
    engine = engine_of(model, tokenizer, num_blocks=15, block_size=4, max_batch_tokens=5)
    order, got, step = [3, 0, 5, 1, 4, 2], {}, 0
    while order or engine.has_work():
        if order and step % 2 == 0:
            i = order.pop(0)
            engine.add_request(prompts[i], params[i], request_id=i)
            got[str(i)] = ([], [])
        for event in engine.step():
            if event.token is not None:
                got[event.request_id][0].append(event.token)
                got[event.request_id][1].append(event.logprob)
        step += 1
    assert engine.stats().preemptions > 0, "this workload is meant to preempt"
    for i, a in enumerate(alone):
        assert got[str(i)] == (a.tokens, a.logprobs), f"request {i} differs from its solo run"


def test_a_complete_grammar_that_min_tokens_holds_open_ends_the_request(model, tokenizer):
    """After "yes" only <eos> may come, and min_tokens rules it out: nothing may come, the request stops
    (no token, no crash) and the engine goes on with the others."""
    engine = engine_of(model, tokenizer)
    prompt = tokenizer.encode("Pick:")
    params = RequestParams(max_tokens=8, min_tokens=6, grammar=Grammar.choice(["yes", "no"]))
    got = engine.generate([prompt, prompt], params)
    for c in got:
        assert tokenizer.decode(c.tokens) in ("yes", "no") and c.finish_reason == "stop"
    assert engine.generate([prompt], RequestParams(max_tokens=3))[0].tokens  # still serving
    assert engine.stats().blocks_used == 0


@pytest.mark.filterwarnings("ignore::attnmask.data.tokenizer.UnknownCharactersWarning")  # the brace, as llguidance asks
def test_a_grammar_the_vocabulary_cannot_write_ends_its_request_not_the_engine():
    """A character vocabulary without braces cannot write JSON: the request stops (a warning in the log)
    and the engine serves the next one."""
    from attnmask.data.tokenizer import Tokenizer

    letters = Tokenizer.train_chars(["abc "])
    engine = Engine(tiny_lm(letters), kv_cache_mib=4, eos_ids=[letters.eos_id], tokenizer=letters)
    (c,) = engine.generate([letters.encode("abc")], RequestParams(max_tokens=8, grammar=Grammar.json_object()))
    assert c.finish_reason == "stop" and len(c.tokens) <= 1
    assert engine.generate([letters.encode("abc")], RequestParams(max_tokens=3))[0].finish_reason
    assert engine.stats().blocks_used == 0


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=0.7)])
def test_speculative_drafts_of_forced_tokens_give_the_answers_without_them(model, tokenizer, sampling):
    """With speculative decoding a grammar's forced tokens (the schema's keys, its punctuation) are drafted
    and checked several at once, each position masked with the grammar's state there: the answers, tokens
    and log-probabilities, are those without drafts, and the forced tokens are kept."""
    schema = {"type": "object", "properties": {"temperature": {"type": "integer"}, "description": {"enum": [
        "sunny and warm", "cold"]}}, "required": ["temperature", "description"], "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False}}  # fmt: skip
    grammars = [Grammar.json_schema(schema), Grammar.regex(REGEX), Grammar.choice(["alpha", "alphabet soup"])]
    prompts = [tokenizer.encode(p) for p in ["Weather:", "Code:", "Pick:"]]
    for grammar in grammars:
        params = RequestParams(max_tokens=40, grammar=grammar, sampling=sampling, seed=5, logprobs=True)
        want = [engine_of(model, tokenizer).generate([p], params)[0] for p in prompts]
        engine = engine_of(model, tokenizer, speculative_tokens=4)
        got = [engine.generate([p], params)[0] for p in prompts]
        assert [(c.tokens, c.logprobs, c.finish_reason) for c in got] == [
            (c.tokens, c.logprobs, c.finish_reason) for c in want]  # fmt: skip
        if grammar.kind == "json_schema":
            assert engine.stats().draft_accepted >= len('{"temperature":') - 1, "the forced keys are kept"


def test_the_engine_refuses_what_it_cannot_constrain(model, tokenizer):
    with pytest.raises(UserError, match="needs an engine with a tokenizer"):
        Engine(model, kv_cache_mib=4, eos_ids=[tokenizer.eos_id]).add_request([5], RequestParams(
            grammar=Grammar.json_object()))  # fmt: skip
    with pytest.raises(UserError, match="regex grammar is not valid"):
        engine_of(model, tokenizer).add_request([5], RequestParams(grammar=Grammar.regex("(")))
    with pytest.raises(UserError, match="grammar must be a Grammar"):
        RequestParams(grammar="[a-z]+")
    with pytest.raises(UserError, match="choices must be"):
        Grammar.choice([])


# ---- through the server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(model, tokenizer):
    engine = engine_of(model, tokenizer, kv_cache_mib=8)
    with serve(engine, tokenizer) as s, openai.OpenAI(base_url=s.base_url, api_key="-", timeout=TIMEOUT,
                                                      max_retries=0) as c:  # fmt: skip
        yield c


def test_response_format_and_guided_fields_through_the_openai_client(client):
    messages = [{"role": "user", "content": "A color, please"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": BOOLEAN_AND_COLOR}}
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, response_format=fmt)
    value = json.loads(r.choices[0].message.content)
    assert value["color"] in ("red", "green", "blue") and r.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, response_format=fmt,
                                              stream=True, temperature=0)  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, response_format=fmt,
                                           temperature=0)  # fmt: skip
    assert text == whole.choices[0].message.content
    r = client.completions.create(
        model=MODEL, prompt="Pick:", max_tokens=10, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="Code:", max_tokens=12, extra_body={"guided_regex": REGEX})
    assert re.fullmatch(REGEX, r.choices[0].text)


def test_structured_output_mistakes_are_400s(client):
    with pytest.raises(openai.BadRequestError, match="guided_regex") as err:
        client.completions.create(model=MODEL, prompt="a", extra_body={"guided_regex": "(["})
    assert err.value.body["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       response_format={"type": "json_schema"})  # fmt: skip
