"""Tests for attnmask.serve.protocol: OpenAI request bodies into engine requests, or a 4xx ApiError
naming the field."""

from __future__ import annotations

import pytest

from attnmask.decode.sampling import Penalties, Sampling
from attnmask.serve.protocol import (
    ApiError,
    check_model,
    parse_chat,
    parse_completion,
    parse_completions,
    with_choices,
)


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def render(messages, add_generation_prompt=True):
    return "".join(f"[{m['role']}]{m['content']}" for m in messages) + ("[assistant]" if add_generation_prompt else "")


def completion(capacity=64, **body):
    return parse_completion(body, encode=encode, capacity=capacity)


def chat(capacity=64, render=render, **body):
    return parse_chat(body, encode=encode, render=render, capacity=capacity)


def test_a_completion_request():
    g = completion(prompt="abc", max_tokens=5, temperature=0, stop="x", seed=3, logprobs=1, stream=True,
                   stream_options={"include_usage": True})  # fmt: skip
    assert g.prompt == [97, 98, 99] and g.stream and g.include_usage and g.logprobs
    p = g.params
    assert (p.max_tokens, p.sampling, p.stop, p.seed, p.logprobs) == (5, Sampling(0.0), ("x",), 3, True)


def test_openai_defaults():
    g = completion(prompt="abc")
    assert g.params.max_tokens == 16 and g.params.sampling == Sampling(1.0)  # OpenAI's defaults
    assert not g.stream and not g.logprobs and g.params.stop == ()
    assert completion(capacity=10, prompt="abcdefgh").params.max_tokens == 2  # the default clipped to what fits
    assert chat(capacity=40, messages=[{"role": "user", "content": "hi"}]).params.max_tokens == 40 - 19


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7]], ["\x05\x06\x07"]])
def test_prompt_as_token_ids_or_a_batch_of_one(prompt):
    assert completion(prompt=prompt).prompt == [5, 6, 7]


def test_top_k_extension_and_its_off_values():
    assert completion(prompt="a", top_k=5).params.sampling.top_k == 5
    assert completion(prompt="a", top_k=-1).params.sampling.top_k is None
    assert completion(prompt="a", top_k=0).params.sampling.top_k is None


def test_chat_renders_messages_and_text_parts():
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    g = chat(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": parts}], logprobs=True,
             max_completion_tokens=4)  # fmt: skip
    assert g.prompt == encode("[system]s[user]hi[assistant]") and g.logprobs and g.params.max_tokens == 4


def test_logprobs_top_logprobs_and_echo():
    """A completion's ``logprobs`` N: the chosen tokens' and the N most likely; ``echo`` with them scores
    the prompt (lm-evaluation-harness's request: echo, logprobs 1, max_tokens 1), with ``max_tokens`` 0
    the prompt only; a chat's ``top_logprobs`` goes with ``logprobs: true``."""
    g = completion(prompt="abc", echo=True, logprobs=1, max_tokens=1, temperature=0)
    assert g.echo and g.logprobs and g.top_logprobs == 1 and g.prompt_text == "abc"
    p = g.params
    assert (p.prompt_logprobs, p.top_logprobs, p.logprobs, p.max_tokens) == (True, 1, True, 1)
    g = completion(prompt=[[5, 6, 7]], echo=True, max_tokens=0)
    assert g.prompt_text is None and not g.logprobs and g.params.max_tokens == 0 and g.params.prompt_logprobs
    g = completion(prompt="abc", echo=True)  # echoed, not scored
    assert not g.params.prompt_logprobs and g.params.max_tokens == 16
    g = completion(prompt="abc", logprobs=0)
    assert g.logprobs and g.top_logprobs == 0 and not g.echo and not g.params.prompt_logprobs
    assert completion(prompt="abc", logprobs=20).params.top_logprobs == 20
    g = chat(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=3)
    assert g.logprobs and g.top_logprobs == 3 and g.params.top_logprobs == 3 and not g.echo


def test_a_batch_of_prompts_is_one_generation_each():
    gens = parse_completions({"prompt": ["ab", [5, 6], "c"], "max_tokens": 3, "echo": True, "logprobs": 1},
                             encode=encode, capacity=64)  # fmt: skip
    assert [g.prompt for g in gens] == [[97, 98], [5, 6], [99]]
    assert [g.prompt_text for g in gens] == ["ab", None, "c"]
    assert all(g.params.max_tokens == 3 and g.params.prompt_logprobs and g.echo for g in gens)
    assert [g.prompt for g in parse_completions({"prompt": [[5, 6]]}, encode=encode, capacity=64)] == [[5, 6]]
    assert [g.prompt for g in parse_completions({"prompt": [5, 6]}, encode=encode, capacity=64)] == [[5, 6]]
    with pytest.raises(ApiError, match="prompt 1 of 2: ") as err:
        parse_completions({"prompt": ["ab", "x" * 64]}, encode=encode, capacity=64)
    assert err.value.status == 400 and err.value.param == "prompt"


def test_n_answers_a_prompt_that_many_times_each_with_its_own_seed():
    body = {"prompt": ["ab", "c"], "n": 3, "seed": 2**64 - 2, "temperature": 1.0}
    gens = with_choices(parse_completions(body, encode=encode, capacity=64), body)
    assert [(g.prompt, g.copy) for g in gens] == [([97, 98], 0), ([97, 98], 1), ([97, 98], 2), ([99], 0), ([99], 1),
                                                   ([99], 2)]  # fmt: skip
    assert [g.params.seed for g in gens[:3]] == [2**64 - 2, 2**64 - 1, 0]  # wrapped, as a generator takes it
    assert [g.params.seed for g in with_choices(gens[:1], {"n": 2})] == [2**64 - 2, 2**64 - 1]
    assert [g.params.seed for g in with_choices([completion(prompt="a")], {"n": 2})] == [None, None]
    assert len(with_choices([chat(messages=[{"role": "user", "content": "hi"}])], {})) == 1


def test_penalties_logit_bias_and_min_tokens():
    """OpenAI's penalties and ``logit_bias`` (keys are strings in JSON), vLLM's ``repetition_penalty``
    and ``min_tokens``; absent, nothing changes."""
    g = completion(prompt="a", presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2,
                   logit_bias={"7": -100, "3": 2.5}, min_tokens=4)  # fmt: skip
    assert g.params.penalties == Penalties(0.5, -1.0, 1.2, ((3, 2.5), (7, -100.0)))
    assert g.params.min_tokens == 4
    plain = completion(prompt="a", presence_penalty=0, logit_bias={})
    assert not plain.params.penalties.active and plain.params.min_tokens == 0
    g = chat(messages=[{"role": "user", "content": "hi"}], frequency_penalty=0.3, logit_bias={"5": 1})
    assert g.params.penalties == Penalties(frequency=0.3, logit_bias=((5, 1.0),))


def test_structured_output_fields_become_grammars():
    from attnmask.decode.grammar import Grammar

    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    assert completion(prompt="a", response_format={"type": "json_object"}).params.grammar == Grammar.json_object()
    g = chat(
        messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
    )
    assert g.params.grammar == Grammar.json_schema(schema) and '"b"' in g.params.grammar.text.split('"a"')[0]  # order
    assert completion(prompt="a", guided_json=schema).params.grammar == Grammar.json_schema(schema)
    assert completion(prompt="a", guided_regex="[0-9]+").params.grammar == Grammar.regex("[0-9]+")
    assert completion(prompt="a", guided_choice=["x", "y"]).params.grammar == Grammar.choice(["x", "y"])
    assert completion(prompt="a", guided_grammar='start: "a"+').params.grammar.kind == "lark"
    assert completion(prompt="a", response_format={"type": "text"}).params.grammar is None


def test_stop_token_ids_and_the_harmless_forms_of_unsupported_fields():
    assert completion(prompt="a", stop_token_ids=[3, 9]).params.stop_ids == (3, 9)
    g = chat(messages=[{"role": "user", "content": "hi"}], response_format={"type": "text"}, tools=[],
             tool_choice="none")  # fmt: skip
    assert g.params.stop_ids == ()


def test_best_of_computes_more_answers_and_asks_for_their_logprobs():
    body = {"prompt": "ab", "n": 2, "best_of": 4, "temperature": 1.0, "seed": 5}
    gens = with_choices(parse_completions(body, encode=encode, capacity=64), body)
    assert [(g.copy, g.best_of, g.params.seed) for g in gens] == [(0, 4, 5), (1, 4, 6), (2, 4, 7), (3, 4, 8)]
    assert all(g.params.logprobs and not g.logprobs for g in gens)  # computed for the ranking, not reported
    body = {"prompt": "ab", "n": 2, "best_of": 2}
    gens = with_choices(parse_completions(body, encode=encode, capacity=64), body)
    assert [g.best_of for g in gens] == [2, 2] and not gens[0].params.logprobs  # nothing to rank


# ---- mistakes: status and the field named --------------------------------------------------------
BAD_COMPLETIONS = [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": 7}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "a", "max_tokens": "8"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 64}, "max_tokens"),  # 1 + 64 > capacity 64
    ({"prompt": "a" * 64}, "prompt"),  # leaves no room at all
    ({"prompt": "a", "temperature": -0.1}, "temperature"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "temperature": float("nan")}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "top_k": -2}, "top_k"),
    ({"prompt": "a", "top_k": 2.5}, "top_k"),
    ({"prompt": "a", "seed": "x"}, "seed"),
    ({"prompt": "a", "seed": 2**64}, "seed"),
    ({"prompt": "a", "stop": ""}, "stop"),
    ({"prompt": "a", "stop": ["a", 1]}, "stop"),
    ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "a", "n": 33}, "n"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "n": 3, "best_of": 2}, "best_of"),
    ({"prompt": "a", "best_of": 3, "stream": True}, "best_of"),
    ({"prompt": "a", "best_of": 33}, "best_of"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "logprobs": -1}, "logprobs"),
    ({"prompt": "a", "logprobs": True}, "logprobs"),
    ({"prompt": "a", "echo": "yes"}, "echo"),
    ({"prompt": "a", "echo": True, "max_tokens": -1}, "max_tokens"),
    ({"prompt": "a", "suffix": "b"}, "suffix"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "a", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "a", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "a", "frequency_penalty": "high"}, "frequency_penalty"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "a", "logit_bias": {"1": 101}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"-1": 1}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"1": True}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": [1, 2]}, "logit_bias"),
    ({"prompt": "a", "min_tokens": 17}, "min_tokens"),  # > max_tokens (16)
    ({"prompt": "a", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "a", "stop_token_ids": [1, -2]}, "stop_token_ids"),
    ({"prompt": "a", "stop_token_ids": 3}, "stop_token_ids"),
    ({"prompt": "a", "response_format": {"type": "xml"}}, "response_format"),
    ({"prompt": "a", "response_format": {"type": "json_schema"}}, "response_format"),
    ({"prompt": "a", "guided_regex": "("}, "guided_regex"),
    ({"prompt": "a", "guided_regex": ""}, "guided_regex"),
    ({"prompt": "a", "guided_choice": []}, "guided_choice"),
    ({"prompt": "a", "guided_json": "{not json"}, "guided_json"),
    ({"prompt": "a", "guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"prompt": "a", "guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),  # two kinds
    ({"prompt": "a", "ignore_eos": 1}, "ignore_eos"),
]


@pytest.mark.parametrize("body, param", BAD_COMPLETIONS)
def test_completion_mistakes_are_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as err:
        completion(**body)
    assert err.value.status == 400 and err.value.param == param, err.value.message
    assert err.value.body()["error"]["type"] == "invalid_request_error"


BAD_CHATS = [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages[0]"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x" * 64}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "best_of": 2}, "best_of"),  # a completions field
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": -101}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, "tool_choice"),
]


@pytest.mark.parametrize("body, param", BAD_CHATS)
def test_chat_mistakes_are_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as err:
        chat(**body)
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_chat_without_a_template_is_400():
    with pytest.raises(ApiError, match="no chat template") as err:
        chat(render=None, messages=[{"role": "user", "content": "hi"}])
    assert err.value.status == 400


def test_the_model_name():
    check_model({}, "m")
    check_model({"model": "m"}, "m")
    with pytest.raises(ApiError) as err:
        check_model({"model": "gpt-4"}, "m")
    assert err.value.status == 404 and err.value.code == "model_not_found" and "'gpt-4'" in err.value.message
    with pytest.raises(ApiError) as err:
        check_model({"model": 3}, "m")
    assert err.value.status == 400
