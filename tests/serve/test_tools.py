"""Tool calls (:mod:`attnmask.serve.tools`): OpenAI's ``tools`` and ``tool_choice`` for any chat template.

- The checks: every mistake in ``tools``, ``tool_choice``, ``parallel_tool_calls`` or a message's tool
  fields is a 400 naming the field; tools in a completion, or beside structured output, are refused.
- The prompt: the tools offered in the system message (merged into the client's own), earlier calls and
  tool results rendered as JSON turns any template takes.
- The answer: held to the tools' JSON form, so every call names an offered tool (the named one, with
  ``tool_choice`` naming one) with arguments that follow its parameters and nothing else; one call
  with ``parallel_tool_calls: false``. Parsed into ``tool_calls`` with ``finish_reason: "tool_calls"``,
  streamed or not (the same calls); a cut answer comes back as text with ``length``.
- Streamed, a text answer's words come as they are written (escapes split anywhere), the same text as
  the whole answer.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from attnmask.decode.sampling import GREEDY, Sampling
from attnmask.engine import Engine, RequestParams
from attnmask.serve.protocol import ApiError, parse_chat
from attnmask.serve.tools import ToolError, Tools, ToolStream, parse_tools, render_messages
from tests.serve.conftest import MODEL, TEMPLATE, TIMEOUT, serve, tiny_lm

pytestmark = pytest.mark.usefixtures("one_thread")

# Finite parameters (enums, booleans): a random model's calls end within a few dozen characters.
PAINT = {
    "type": "function",
    "function": {
        "name": "paint",
        "description": "Paint the wall",
        "parameters": {
            "type": "object",
            "properties": {"color": {"enum": ["red", "blue"]}, "glossy": {"type": "boolean"}},
            "required": ["color", "glossy"],
        },
    },
}
STOP = {"type": "function", "function": {"name": "stop", "description": "Stop painting"}}  # no parameters
TOOLS = [PAINT, STOP]
ASK = [{"role": "user", "content": "Paint it"}]


def tools_of(**body) -> Tools:
    tools = parse_tools({"tools": TOOLS, **body})
    assert tools is not None
    return tools


def valid_call(call: dict) -> bool:
    if call["name"] == "stop":
        return call["arguments"] == {}
    args = call["arguments"]
    return (
        call["name"] == "paint"
        and set(args) == {"color", "glossy"}
        and args["color"] in ("red", "blue")
        and (isinstance(args["glossy"], bool))
    )


# ---- checks, prompt, parsing -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": {}}, "tools"),
        ({"tools": [], "tool_choice": "auto"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "café"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "x", "parameters": "{}"}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [PAINT, PAINT]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [{"name": "x"}]}, "functions"),
        ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "frog"}}}]}, "tools"),
    ],
)
def test_tool_mistakes_name_their_field(body, param):
    with pytest.raises(ToolError) as err:
        parse_tools(body)
    assert err.value.param == param, err.value.message


def test_no_tools_or_tool_choice_none_offers_nothing():
    assert parse_tools({}) is None
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}) is None
    assert parse_tools({"tools": []}) is None
    assert tools_of().choice == "auto" and tools_of(tool_choice={"type": "function", "function": {"name": "stop"}}
                                                    ).choice == "stop"  # fmt: skip


def test_the_answer_schema_offers_what_tool_choice_allows():
    auto, required = tools_of().schema(), tools_of(tool_choice="required").schema()
    assert [set(s["properties"]) for s in auto["anyOf"]] == [{"tool_calls"}, {"response"}]
    calls = required["properties"]["tool_calls"]
    assert calls["minItems"] == 1 and "maxItems" not in calls
    assert [c["properties"]["name"]["const"] for c in calls["items"]["anyOf"]] == ["paint", "stop"]
    paint = calls["items"]["anyOf"][0]["properties"]["arguments"]
    assert (
        paint["additionalProperties"] is False and PAINT["function"]["parameters"].get("additionalProperties") is None
    )
    named = tools_of(tool_choice={"type": "function", "function": {"name": "paint"}}, parallel_tool_calls=False)
    calls = named.schema()["properties"]["tool_calls"]
    assert calls["maxItems"] == 1 and calls["items"]["properties"]["name"] == {"const": "paint"}


def test_history_is_rendered_as_turns_any_template_takes():
    history = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "paint", "arguments": '{"color": "red"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]  # fmt: skip
    turns = render_messages(history, tools_of())
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert (
        turns[0]["content"].startswith("Be brief.\n\nYou can call these tools:\n") and '"paint"' in turns[0]["content"]
    )
    assert json.loads(turns[2]["content"]) == {"tool_calls": [{"name": "paint", "arguments": {"color": "red"}}]}
    assert json.loads(turns[3]["content"]) == {"tool_response": {"tool_call_id": "call_1", "content": "done"}}
    assert render_messages(ASK, tools_of())[0]["role"] == "system"  # a system turn of its own
    assert render_messages(ASK, None) == ASK
    bad = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "paint", "arguments": "{"}}]}]
    with pytest.raises(ToolError, match="not JSON"):
        render_messages(bad, None)


def test_answers_parse_into_calls_or_text():
    tools = tools_of()
    content, calls, finish = tools.parse('{"tool_calls":[{"name":"paint","arguments":{"color":"red"}}]}', "stop")
    assert content is None and finish == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("paint", {"color": "red"})]
    assert calls[0].id.startswith("call_") and len({c.id for c in tools.parse('{"tool_calls":[{"name":"stop",'
        '"arguments":{}},{"name":"stop","arguments":{}}]}', "stop")[1]}) == 2  # fmt: skip
    assert tools.parse('{"response":"Done."}', "stop") == ("Done.", [], "stop")
    assert tools.parse('{"tool_calls":[{"name":"pai', "length") == ('{"tool_calls":[{"name":"pai', [], "length")
    assert tools.parse('{"response":"Not fini', "length") == ("Not fini", [], "length")  # the text it had
    lone = r'{"response":"a\ud83db"}'  # JSON may hold half a surrogate pair; UTF-8 cannot
    assert tools.parse(lone, "stop")[0] == "a\ufffdb"
    (call,) = tools.parse(r'{"tool_calls":[{"name":"stop","arguments":{"x":"\udc00"}}]}', "stop")[1]
    assert call.arguments == '{"x": "\ufffd"}'


def assembled(deltas) -> dict[int, tuple[str, str, str]]:
    """Streamed tool call deltas put together as a client does: ``{index: (id, name, arguments)}``."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        d = d if isinstance(d, dict) else d.model_dump(exclude_none=True)
        call = calls.setdefault(d["index"], ["", "", ""])
        call[0] += d.get("id") or ""
        call[1] += (d.get("function") or {}).get("name") or ""
        call[2] += (d.get("function") or {}).get("arguments") or ""
    return {i: tuple(c) for i, c in calls.items()}


@pytest.mark.parametrize("cut", range(1, 8))
def test_a_streamed_text_answer_is_its_words_as_they_come(cut):
    """Pushed in pieces of ``cut`` characters (escapes and surrogate pairs split anywhere), the deltas add up
    to the answer's text, and no delta holds a broken escape."""
    text = r"Line one\nA \"quote\", tab\t, \u00e9t\u00e9, \ud83d\ude00 and \\ done"  # JSON string body
    answer = '{"response":"' + text + '"}'
    stream, deltas = ToolStream(tools_of()), []
    for i in range(0, len(answer), cut):
        content, calls = stream.push(answer[i : i + cut])
        deltas.append(content)
        assert not calls
    rest, calls, finish = stream.finish("stop")
    assert "".join(deltas) + rest == json.loads(f'"{text}"') and not calls and finish == "stop"
    assert sum(bool(d) for d in deltas) > 5 and rest == ""


@pytest.mark.parametrize("cut", range(1, 8))
def test_streamed_calls_are_their_names_then_their_arguments_as_they_come(cut):
    """Each call's id and name as soon as the name is whole, then its arguments' JSON text in pieces (braces
    and quotes inside strings do not end them), adding up to the arguments the whole answer parses to."""
    answer = ('{"tool_calls":[{"name":"paint","arguments":{"color":"r\\"e}d","glossy":true}},'
              '{"name":"stop","arguments":{}}]}')  # fmt: skip
    stream, deltas, pieces = ToolStream(tools_of()), [], 0
    for i in range(0, len(answer), cut):
        content, calls = stream.push(answer[i : i + cut])
        assert content == ""
        deltas += calls
        pieces += bool(calls)
    rest, calls, finish = stream.finish("stop")
    assert rest is None and finish == "tool_calls"
    got = assembled(deltas + calls)
    whole = tools_of().parse(answer, "stop")[1]
    assert [(name, json.loads(arguments)) for _, name, arguments in got.values()] == [
        (c.name, json.loads(c.arguments)) for c in whole
    ]
    assert all(i.startswith("call_") for i, _, _ in got.values()) and len({i for i, _, _ in got.values()}) == 2
    assert pieces > (3 if cut < 5 else 1), "the arguments should come in pieces"


def test_calls_cut_while_streaming_end_with_length_and_other_shapes_come_whole():
    stream = ToolStream(tools_of())
    _, deltas = stream.push('{"tool_calls":[{"name":"paint","arguments":{"col')
    assert assembled(deltas) == {0: (deltas[0]["id"], "paint", '{"col')}
    assert stream.finish("length") == (None, [], "length")  # the deltas sent stand
    spaced = '{"tool_calls": [{"name": "stop", "arguments": {}}]}'  # not the grammar's shape: whole at the end
    stream = ToolStream(tools_of())
    assert all(stream.push(c) == ("", []) for c in spaced)
    rest, calls, finish = stream.finish("stop")
    assert rest is None and [(c["index"], c["function"]["name"]) for c in calls] == [(0, "stop")]


def test_the_protocol_refuses_tools_where_they_cannot_be_honoured():
    chat = dict(encode=lambda t: [1] * len(t), render=TEMPLATE, capacity=4096)
    with pytest.raises(ApiError) as err:
        parse_chat({"messages": ASK, "tools": TOOLS, "response_format": {"type": "json_object"}}, **chat)
    assert err.value.param == "response_format"
    gen = parse_chat({"messages": ASK, "tools": TOOLS, "response_format": {"type": "text"}}, **chat)
    assert gen.tools is not None and gen.params.grammar == gen.tools.grammar()
    assert parse_chat({"messages": ASK, "tools": TOOLS, "tool_choice": "none"}, **chat).params.grammar is None


# ---- the engine -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_lm(tokenizer, max_seq_len=1024)


def engine_of(model, tokenizer, **kw) -> Engine:
    return Engine(model, **{"kv_cache_mib": 16, "eos_ids": [tokenizer.eos_id], "tokenizer": tokenizer, **kw})


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=1.0)])
@pytest.mark.parametrize("choice", ["required", "paint", "stop"])
def test_every_call_names_an_offered_tool_with_arguments_that_follow_its_parameters(model, tokenizer, sampling, choice):
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    tools = tools_of(tool_choice=tool_choice, parallel_tool_calls=False)
    prompt = tokenizer.encode(TEMPLATE(render_messages(ASK, tools)))
    engine = engine_of(model, tokenizer)
    for seed in range(6):
        (c,) = engine.generate([prompt], RequestParams(max_tokens=120, grammar=tools.grammar(), sampling=sampling,
                                                        seed=seed))  # fmt: skip
        text = tokenizer.decode([t for t in c.tokens if t != tokenizer.eos_id])
        content, calls, finish = tools.parse(text, c.finish_reason)
        assert content is None and finish == "tool_calls" and len(calls) == 1, text
        call = {"name": calls[0].name, "arguments": json.loads(calls[0].arguments)}
        assert valid_call(call) and (choice == "required" or call["name"] == choice), text


# ---- through the server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(model, tokenizer):
    with (
        serve(engine_of(model, tokenizer), tokenizer) as s,
        openai.OpenAI(base_url=s.base_url, api_key="-", timeout=TIMEOUT, max_retries=0) as c,
    ):
        c.served = s
        yield c


def test_tool_calls_through_the_openai_client_streamed_or_not(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=120, temperature=0)  # fmt: skip
    r = client.chat.completions.create(**kw)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert valid_call({"name": call.function.name, "arguments": json.loads(call.function.arguments)})
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = assembled(t for d in deltas for t in d.tool_calls or ())
    assert [(i, name, json.loads(arguments)) for i, (_, name, arguments) in streamed.items()] == [
        (0, call.function.name, json.loads(call.function.arguments))
    ]
    assert sum(bool(d.tool_calls) for d in deltas) > 2, "the arguments should stream in pieces"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert r.usage.completion_tokens > 10


def test_a_text_answer_streams_its_words_and_equals_the_whole(client, tokenizer):
    """``r`` after ``{"`` picks the text answer; a bias on it keeps the random model writing r's until
    ``max_tokens``: streamed word by word, the same text as the whole answer, cut with ``length``."""
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=30, temperature=0,
              logit_bias={str(tokenizer.encode("r")[0]): 30})  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "length" and whole.message.content and not whole.message.tool_calls
    chunks = [c.choices[0] for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    texts = [c.delta.content for c in chunks if c.delta.content]
    assert "".join(texts) == whole.message.content and len(texts) > 5
    assert chunks[-1].finish_reason == "length"


def test_several_streamed_answers_with_logprobs_each_end_with_their_own_calls(client):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=120, temperature=1.0, seed=3, n=2, logprobs=True)  # fmt: skip
    whole = client.chat.completions.create(**kw)
    chunks = [c for c in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})]
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        calls = assembled(t for c in mine for t in c.delta.tool_calls or ())
        assert [(name, json.loads(arguments)) for _, name, arguments in calls.values()] == [
            (t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls
        ]
        assert mine[-1].finish_reason == choice.finish_reason == "tool_calls"
        streamed = [t.logprob for c in mine if c.logprobs for t in c.logprobs.content]
        assert streamed == [t.logprob for t in choice.logprobs.content]  # every token's, JSON syntax included
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_conversation_with_earlier_calls_and_their_results(client):
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "paint", "arguments": '{"color": "red", "glossy": true}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "painted"}]  # fmt: skip
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=40, temperature=0)
    assert r.choices[0].finish_reason in ("tool_calls", "stop", "length")
    count = lambda body: httpx.post(f"{client.served.url}/tokenize", json=body, timeout=TIMEOUT).json()["count"]  # noqa: E731
    with_tools, without = count({"messages": history, "tools": TOOLS}), count({"messages": history})
    assert with_tools > without + len(json.dumps(TOOLS)) // 2  # the tools are in the prompt


def test_tool_choice_none_answers_as_without_tools(client):
    kw = dict(model=MODEL, messages=ASK, max_tokens=12, temperature=0)
    plain = client.chat.completions.create(**kw)
    none = client.chat.completions.create(**kw, tools=TOOLS, tool_choice="none")
    assert (
        none.choices[0].message.content == plain.choices[0].message.content and not none.choices[0].message.tool_calls
    )


def test_a_cut_answer_is_its_text(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == '{"too'  # characters
    assert not r.choices[0].message.tool_calls


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [PAINT], "tool_choice": {"type": "function", "function": {"name": "stop"}}}, "tool_choice"),
        ({"tools": [PAINT], "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [PAINT], "extra_body": {"guided_regex": "a+"}}, "guided_regex"),
        ({"tools": "paint"}, "tools"),
    ],
)
def test_tool_mistakes_are_400s(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, **extra)
    assert err.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Paint", extra_body={"tools": [PAINT]})
    assert err.value.body["param"] == "tools"
