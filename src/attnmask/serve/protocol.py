"""OpenAI's wire format: request bodies checked and turned into engine requests, errors as JSON.

:func:`parse_completions` (``POST /v1/completions``, one :class:`Generation` a prompt: ``prompt`` may
hold several, each answered as its own choice) and :func:`parse_chat`
(``POST /v1/chat/completions``) read a decoded JSON body and return a :class:`Generation` (prompt
ids, :class:`~attnmask.engine.RequestParams`, streaming options), or raise :class:`ApiError`, which
the app answers with OpenAI's error object ``{"error": {"message", "type", "param", "code"}}`` and
a 4xx status. Every field a client can get wrong is checked here, with the field's name in
``param``; fields this server does not implement are refused when they would change the answer
(``suffix``; ``tools`` in a completion; ``best_of`` in a chat, or streamed) rather than silently
ignored. A request's ``n`` answers to each prompt are ``n`` engine requests (:func:`with_choices`); with a completion's
``best_of``, ``best_of`` of them, of which the app returns the ``n`` most likely.

Penalties: OpenAI's ``presence_penalty`` and ``frequency_penalty`` (over the generated tokens) and
``logit_bias`` (``{"token id": bias}``), vLLM's ``repetition_penalty`` (over prompt and generated
tokens) and ``min_tokens`` (no end-of-sequence or stop id before that many tokens): see
:class:`~attnmask.decode.sampling.Penalties`.

Structured output (:class:`~attnmask.decode.grammar.Grammar`): OpenAI's ``response_format``
(``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"schema": ...}}``) and vLLM's
``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar`` (Lark or GBNF); one of them
at most, checked here (a grammar that does not compile is a 400 naming the field).

Tool calls: a chat's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (:mod:`attnmask.serve.tools`:
the tools offered in the system message, the answer held to their JSON form); earlier turns'
``tool_calls`` and ``tool`` messages are rendered in that form.

Log-probabilities: a completion's ``logprobs`` N (0 to 20) reports each token's and, for N >= 1, the N
most likely tokens' at its position; ``echo`` sends the prompt back before the completion and, with
``logprobs``, scores it (each prompt token after the first, given the ones before it: what evaluation
harnesses such as lm-evaluation-harness read, usually with ``max_tokens`` 1, or 0: the prompt only).
A chat's ``logprobs: true`` with ``top_logprobs`` N (0 to 20) likewise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from attnmask.decode.grammar import Grammar
from attnmask.decode.sampling import MAX_LOGIT_BIAS, MAX_PENALTY, Penalties, Sampling
from attnmask.engine import RequestParams
from attnmask.engine.engine import MAX_TOP_LOGPROBS
from attnmask.errors import UserError
from attnmask.serve.tools import ToolError, Tools, parse_tools, render_messages

__all__ = [
    "ApiError",
    "Generation",
    "check_model",
    "messages_of",
    "chat_prompt",
    "parse_chat",
    "parse_completion",
    "parse_completions",
    "choices_of",
    "with_choices",
]

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_CHOICES = 32  # ``n``: answers to one prompt at most


class ApiError(Exception):
    """A request the server cannot answer, as OpenAI reports it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002  (OpenAI's field name)
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Generation:
    """What one request asks the engine for, and how the answer is to be sent."""

    prompt: list[int]
    params: RequestParams
    stream: bool
    include_usage: bool  # streaming: a last chunk with ``usage`` (``stream_options.include_usage``)
    logprobs: bool  # report each chosen token's log-probability
    top_logprobs: int = 0  # and that many most likely tokens' at each position
    echo: bool = False  # a completion: the prompt first (scored too, with logprobs)
    prompt_text: str | None = None  # the prompt as the client sent it, when it sent text
    copy: int = 0  # which of the prompt's ``n`` answers (:func:`with_choices`)
    best_of: int = 1  # answers computed for a prompt, of which the n most likely are returned (>= n)
    tools: Tools | None = None  # a chat whose answer may call tools (its text is their JSON form)


# ---- fields -------------------------------------------------------------------------------------
def _bad(param: str, expected: str, value: Any) -> ApiError:
    return ApiError(400, f"'{param}' must be {expected}; got {value!r}", param=param)


def _int(body: dict, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    expected = "an integer" + (f" >= {minimum}" if minimum is not None else "")
    expected += f" and <= {maximum}" if maximum is not None else ""
    if isinstance(value, float) and value.is_integer():  # JSON writers may send 16.0
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(name, expected, value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise _bad(name, expected, value)
    return value


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise _bad(name, "a number", value)
    return float(value)


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(name, "true or false", value)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise _bad("stop", f"a non-empty string or a list of at most {MAX_STOP_STRINGS} of them", value)
    return tuple(stops)


def _choices(body: dict, *, chat: bool) -> tuple[int, int]:
    """``(n, best_of)``: answers returned and computed for each prompt."""
    n = _int(body, "n", minimum=1, maximum=MAX_CHOICES) or 1
    best_of = _int(body, "best_of", minimum=1, maximum=MAX_CHOICES)
    if best_of is None or best_of == 1 and n == 1:
        return n, n
    if chat:
        raise ApiError(400, "'best_of' is a /v1/completions field; chat completions take 'n'", param="best_of")
    if best_of < n:
        raise ApiError(400, f"'best_of' must be >= 'n' ({n}); got {best_of}", param="best_of")
    if best_of > n and _bool(body, "stream"):
        raise ApiError(400, "'best_of' > 'n' cannot be streamed (the best are known at the end)", param="best_of")
    return n, best_of


GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # vLLM's extensions


def _structured_fields(body: dict) -> list[str]:
    """The fields that ask for structured output (``response_format`` of type ``text`` does not)."""
    fmt = body.get("response_format")
    text = isinstance(fmt, dict) and fmt.get("type") == "text"
    return [name for name in ("response_format", *GUIDED) if body.get(name) is not None and not (
        name == "response_format" and text)]  # fmt: skip


def _grammar(body: dict) -> Grammar | None:
    """The structured output a request asks for: ``response_format`` or one of vLLM's ``guided_*``."""
    asked = _structured_fields(body)
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") in ("text", "json_object", "json_schema")):
        raise _bad("response_format", "{'type': 'text' | 'json_object' | 'json_schema', ...}", fmt)
    if len(asked) > 1:
        raise ApiError(400, f"give one kind of structured output; got {', '.join(asked)}", param=asked[1])
    if not asked:
        return None
    name, value = asked[0], body[asked[0]]
    try:
        if name == "response_format" and fmt["type"] == "json_object":
            grammar = Grammar.json_object()
        elif name == "response_format":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise _bad(name, "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}", fmt)
            grammar = Grammar.json_schema(spec["schema"])
        elif name == "guided_json":
            grammar = Grammar.json_schema(value)
        elif name == "guided_choice":
            grammar = Grammar.choice(value)
        elif not isinstance(value, str) or not value:
            raise _bad(name, "a non-empty string", value)
        else:
            grammar = Grammar.regex(value) if name == "guided_regex" else Grammar.lark(value)
        grammar.check()
    except UserError as err:
        raise ApiError(400, f"'{name}': {err}", param=name) from err
    return grammar


def _no_tools(body: dict) -> None:
    """``/v1/completions`` has no tool calls: its tool fields are a 400, never ignored."""
    for name in ("tools", "functions", "tool_choice", "function_call"):
        if body.get(name) is not None:
            raise ApiError(400, f"'{name}' is a /v1/chat/completions field; completions take a plain prompt",
                           param=name)  # fmt: skip


def _tools(body: dict) -> Tools | None:
    try:
        tools = parse_tools(body)
    except ToolError as err:
        raise ApiError(400, err.message, param=err.param) from err
    if tools is not None and (asked := _structured_fields(body)):
        raise ApiError(400, f"give 'tools' or structured output ('{asked[0]}'), not both: tool calls are "
                       "JSON of their own form", param=asked[0])  # fmt: skip
    return tools


def _stop_ids(body: dict) -> tuple[int, ...]:
    """``stop_token_ids`` (vLLM's extension): token ids that end the answer (the last token, as vLLM's)."""
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise _bad("stop_token_ids", "a list of token ids (integers >= 0)", value)
    return tuple(value)


def _penalty(body: dict, name: str) -> float:
    value = _number(body, name)
    if value is not None and not -MAX_PENALTY <= value <= MAX_PENALTY:
        raise _bad(name, f"a number from -{MAX_PENALTY:g} to {MAX_PENALTY:g}", value)
    return value or 0.0


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """``{"token id": bias}`` (JSON's keys are strings; ids as ints also taken), bias in [-100, 100]."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    expected = f"an object mapping token ids to numbers from -{MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g}"
    if not isinstance(value, dict):
        raise _bad("logit_bias", expected, value)
    out = {}
    for key, bias in value.items():
        token = key if isinstance(key, int) else int(key) if isinstance(key, str) and key.isdigit() else None
        ok = isinstance(bias, (int, float)) and not isinstance(bias, bool) and math.isfinite(bias)
        if token is None or not ok or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ApiError(400, f"'logit_bias' must be {expected}; got {key!r}: {bias!r}", param="logit_bias")
        if token in out:
            raise ApiError(400, f"'logit_bias' names token {token} twice", param="logit_bias")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _penalties(body: dict) -> Penalties:
    repetition = _number(body, "repetition_penalty")  # an extension (vLLM's, Hugging Face's)
    if repetition is not None and not repetition > 0:
        raise _bad("repetition_penalty", "a number > 0 (1 = none)", repetition)
    return Penalties(
        presence=_penalty(body, "presence_penalty"),
        frequency=_penalty(body, "frequency_penalty"),
        repetition=1.0 if repetition is None else repetition,
        logit_bias=_logit_bias(body),
    )


def _sampling(body: dict) -> Sampling:
    temperature = _number(body, "temperature")
    temperature = 1.0 if temperature is None else temperature  # OpenAI's default
    if temperature < 0:
        raise _bad("temperature", "a number >= 0 (0 = greedy)", temperature)
    top_p = _number(body, "top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise _bad("top_p", "a number in (0, 1]", top_p)
    top_k = _int(body, "top_k", minimum=-1)  # an extension; -1 and 0 switch it off, as in vLLM
    return Sampling(temperature=temperature, top_k=top_k if top_k and top_k > 0 else None, top_p=top_p)


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _bad("stream_options", "an object", options)
    if not stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
    return _bool(options, "include_usage")


def _max_tokens(
    requested: int | None, prompt_len: int, capacity: int, *, default: int | None, param: str, prompt_param: str
) -> int:
    """``requested``, or the default clipped to what fits; ApiError when the prompt leaves no room."""
    room = capacity - prompt_len
    if room < 1:
        raise ApiError(
            400,
            f"the prompt has {prompt_len} tokens; this server holds at most {capacity} tokens per request, prompt "
            "and completion together (the model's context length or the KV cache). Shorten the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise ApiError(
            400,
            f"this model's maximum context length is {capacity} tokens; you requested {prompt_len + requested} "
            f"tokens ({prompt_len} in the prompt, {requested} for the completion). Shorten the prompt or "
            f"lower '{param}'.",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def check_model(body: dict, served: str) -> None:
    """The body's ``model`` must be the served model's name (or absent); 404 otherwise."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise _bad("model", "a string", model)
    if model != served:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


def _params(
    body: dict, max_tokens: int, logprobs: bool, top: int = 0, score_prompt: bool = False, tools: Tools | None = None
) -> RequestParams:
    min_tokens = _int(body, "min_tokens", minimum=0) or 0  # an extension (vLLM's)
    if min_tokens > max_tokens:
        raise _bad("min_tokens", f"an integer from 0 to the request's max_tokens ({max_tokens})", min_tokens)
    try:
        return RequestParams(
            max_tokens=max_tokens,
            sampling=_sampling(body),
            seed=_int(body, "seed", minimum=-(2**63), maximum=2**64 - 1),  # what torch.Generator takes
            stop=_stop(body),
            stop_ids=_stop_ids(body),
            ignore_eos=_bool(body, "ignore_eos"),  # an extension (vLLM's)
            logprobs=logprobs,
            top_logprobs=top,
            prompt_logprobs=score_prompt,
            penalties=_penalties(body),
            min_tokens=min_tokens,
            grammar=tools.grammar() if tools is not None else _grammar(body),
            priority=_int(body, "priority", minimum=-(2**31), maximum=2**31 - 1) or 0,  # vLLM's; lower first
        )
    except UserError as err:
        raise ApiError(400, str(err)) from err


# ---- endpoints ----------------------------------------------------------------------------------
def _prompt_ids(value: Any, encode: Callable[[str], list[int]]) -> list[int]:
    """A completion prompt: a string, a list of token ids, or a list holding one of those."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        return encode(value)
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise ApiError(400, f"'prompt' holds {len(value)} prompts; this server takes one per request", param="prompt")
    raise _bad("prompt", "a string or a non-empty list of token ids", value)


def parse_completion(body: dict, *, encode: Callable[[str], list[int]], capacity: int) -> Generation:
    """``POST /v1/completions``: ``prompt``, ``max_tokens`` (default 16; 0 with ``echo``: score the
    prompt only), sampling, ``stop``, ``seed``, ``logprobs`` (an int N: the chosen tokens'
    log-probabilities and the N most likely tokens'), ``echo``, ``stream``, penalties, ``logit_bias``,
    ``min_tokens``; ``n`` and ``best_of`` are read by :func:`with_choices`."""
    _choices(body, chat=False)
    _no_tools(body)
    echo = _bool(body, "echo")
    if body.get("suffix"):
        raise ApiError(400, "'suffix' is not supported by this server", param="suffix")
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required", param="prompt")
    prompt = _prompt_ids(body["prompt"], encode)
    if not prompt:
        raise ApiError(400, "'prompt' is empty; expected at least one token", param="prompt")
    top = _int(body, "logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
    logprobs = top is not None
    max_tokens = _max_tokens(
        _int(body, "max_tokens", minimum=0 if echo else 1),
        len(prompt),
        capacity,
        default=DEFAULT_COMPLETION_TOKENS,
        param="max_tokens",
        prompt_param="prompt",
    )
    stream = _bool(body, "stream")
    # best_of ranks its answers by their log-probabilities: the engine computes them, asked for or not
    n, best_of = _choices(body, chat=False)
    ranked = best_of > n
    # echo scores the prompt when log-probabilities are asked for (and with max_tokens 0, the whole request)
    params = _params(
        body, max_tokens, logprobs or ranked, top or 0, score_prompt=echo and (logprobs or max_tokens == 0)
    )
    text = _prompt_text(body["prompt"])
    return Generation(
        prompt, params, stream=stream, include_usage=_stream_options(body, stream), logprobs=logprobs,
        top_logprobs=top or 0, echo=echo, prompt_text=text,
    )  # fmt: skip


def parse_completions(body: dict, *, encode: Callable[[str], list[int]], capacity: int) -> list[Generation]:
    """``POST /v1/completions`` whose ``prompt`` may be a list of prompts (strings or token-id lists, as
    OpenAI's API and evaluation harnesses batch them): one :class:`Generation` each, with the request's
    other fields, answered as choices 0, 1, ... in order. A mistake in any prompt refuses the request."""
    prompts = body.get("prompt")
    if not (isinstance(prompts, list) and len(prompts) > 1 and all(isinstance(p, (str, list)) for p in prompts)):
        return [parse_completion(body, encode=encode, capacity=capacity)]
    out = []
    for i, prompt in enumerate(prompts):
        try:
            out.append(parse_completion({**body, "prompt": prompt}, encode=encode, capacity=capacity))
        except ApiError as err:
            raise ApiError(err.status, f"prompt {i} of {len(prompts)}: {err.message}", param=err.param,
                           code=err.code) from err  # fmt: skip
    return out


def with_choices(gens: list[Generation], body: dict, *, chat: bool = False) -> list[Generation]:
    """Each generation ``best_of`` times (the body's ``best_of``, else ``n``, default 1), as OpenAI numbers
    the choices: prompt by prompt, then answer by answer. Answer ``j`` of a request with a ``seed`` draws
    from ``seed + j`` (wrapping within what a generator takes), so answers differ when sampled and repeat
    with the seed. Of a prompt's ``best_of`` answers the app returns the ``n`` most likely."""
    n, best_of = _choices(body, chat=chat)
    out = []
    for gen in gens:
        for j in range(best_of):
            seed = gen.params.seed
            if seed is not None and j:
                seed = seed + j if seed + j < 2**64 else seed + j - 2**64
            out.append(replace(gen, params=replace(gen.params, seed=seed), copy=j, best_of=best_of))
    return out


def choices_of(body: dict) -> int:
    """``n``: the answers returned for each prompt (after :func:`with_choices` checked the body)."""
    return _int(body, "n", minimum=1, maximum=MAX_CHOICES) or 1


def _prompt_text(value: Any) -> str | None:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    return value if isinstance(value, str) else None


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        texts = [p.get("text") for p in content]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise _bad(f"messages[{i}].content", "a string or a list of text parts", content)


def messages_of(body: dict) -> list[dict[str, Any]]:
    """The request's ``messages``, checked: ``role`` and ``content`` (text) each, and the tool fields
    (``tool_calls``, ``tool_call_id``, ``name``) where sent."""
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty list of messages", messages)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "an object with a string 'role' and 'content'", m)
        message = {"role": m["role"], "content": _content(m, i)}
        for key in ("tool_calls", "tool_call_id", "name"):
            if m.get(key) is not None:
                message[key] = m[key]
        out.append(message)
    return out


def chat_prompt(body: dict, render) -> tuple[str, Tools | None]:
    """The prompt text of a chat request's ``messages`` (with its tools, when offered), and the tools.

    vLLM's ``add_generation_prompt`` (default true: the text ends where the assistant's answer begins)
    and ``continue_final_message`` (the last message is the assistant's answer so far, a prefill: the
    text ends right after its content, and the answer continues it)."""
    messages, tools = messages_of(body), _tools(body)
    generation = body.get("add_generation_prompt", True)
    if not isinstance(generation, bool):
        raise _bad("add_generation_prompt", "true or false", generation)
    continued = _bool(body, "continue_final_message")
    if continued and generation and "add_generation_prompt" in body:
        raise ApiError(400, "'continue_final_message' continues the last message; it needs "
                       "'add_generation_prompt': false", param="continue_final_message")  # fmt: skip
    if continued and (messages[-1]["role"] != "assistant" or not messages[-1]["content"] or tools is not None):
        raise ApiError(400, "'continue_final_message' needs the last message to be the assistant's, with text, "
                       "and no tools", param="continue_final_message")  # fmt: skip
    if render is None:
        raise ApiError(
            400, "this model has no chat template; use /v1/completions with a plain prompt", param="messages"
        )
    try:
        turns = render_messages(messages, tools)
    except ToolError as err:
        raise ApiError(400, err.message, param=err.param) from err
    try:
        text = render(turns, add_generation_prompt=generation and not continued)
    except UserError as err:
        raise ApiError(400, f"the chat template could not render these messages: {err}", param="messages") from err
    if continued:  # cut after the final message's content: the template's end of turn goes
        final = messages[-1]["content"]
        end = text.rfind(final)
        if end < 0:
            raise ApiError(400, "the chat template does not write the final message's text as given, so it "
                           "cannot be continued", param="continue_final_message")  # fmt: skip
        text = text[: end + len(final)]
    return text, tools


def parse_chat(body: dict, *, encode: Callable[[str], list[int]], render, capacity: int) -> Generation:
    """``POST /v1/chat/completions``: ``messages`` rendered by ``render`` (the model's chat template,
    or None when it has none), ``max_tokens`` / ``max_completion_tokens`` (default: what fits),
    sampling, ``stop``, ``seed``, ``logprobs`` (true / false), ``top_logprobs``, ``stream``, penalties,
    ``logit_bias``, ``min_tokens``, ``tools`` / ``tool_choice`` / ``parallel_tool_calls``,
    ``add_generation_prompt`` / ``continue_final_message``; ``n`` is read by :func:`with_choices`."""
    _choices(body, chat=True)
    text, tools = chat_prompt(body, render)
    prompt = encode(text)
    if not prompt:
        raise ApiError(400, "the rendered conversation is empty", param="messages")
    logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS) or 0
    if top and not logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _max_tokens(
        _int(body, name, minimum=1), len(prompt), capacity, default=None, param=name, prompt_param="messages"
    )
    stream = _bool(body, "stream")
    params = _params(body, max_tokens, logprobs, top, tools=tools)
    return Generation(
        prompt, params, stream=stream, include_usage=_stream_options(body, stream), logprobs=logprobs,
        top_logprobs=top, tools=tools,
    )  # fmt: skip
