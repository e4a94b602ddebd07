"""Tool calls (OpenAI's ``tools`` and ``tool_choice``) for any chat model, in one JSON format held by a grammar.

The models attnmask serves have chat templates that know nothing of tools (SmolLM2's ChatML, Gemma's
turns, a fine-tuned run's), so tools take one form for every template (the "generic" format
llama.cpp's server used to give such templates) rather than a per-model one:

- **The prompt.** A system message lists the tools (name, description, parameters' JSON schema) and says
  how to answer: ``{"tool_calls": [{"name": ..., "arguments": {...}}]}`` to call tools, or
  ``{"response": "..."}`` to answer in text. An earlier assistant turn's ``tool_calls`` are written in
  the same form, and a ``tool`` message becomes a user turn holding ``{"tool_response": {...}}``, so
  every template renders the conversation with the roles it knows (:func:`render_messages`).
- **The answer.** The answer is held to the JSON schema of those forms (:meth:`Tools.grammar`, an
  llguidance grammar like ``response_format``'s): each call names one of the offered tools and its
  ``arguments`` follow that tool's ``parameters`` (an object schema that does not say otherwise allows no
  properties beyond its own, as llama.cpp's grammars read schemas). ``tool_choice``: ``"auto"`` (a call or a text
  answer), ``"required"`` (calls only), ``{"type": "function", "function": {"name": ...}}`` (that tool
  only), ``"none"`` (the tools are not offered; a plain text answer). ``parallel_tool_calls: false``
  allows one call.
- **The response.** :meth:`Tools.parse` turns the JSON back into OpenAI's message: ``tool_calls`` (each
  with an id ``call_...``, ``arguments`` a JSON string) and ``finish_reason: "tool_calls"``, or the
  ``response`` text as ``content``. An answer cut by ``max_tokens`` is not complete JSON: its raw text is
  the content and the finish reason ``length``, as vLLM answers.

Streamed (:class:`ToolStream`), a text answer's words are sent as they come (the JSON string's text,
decoded, without its quotes and escapes), and calls as OpenAI streams them: a call's id and name once its
name is whole, then its arguments' JSON text in pieces as it is written. A text answer cut by
``max_tokens`` is the text it had, streamed or not; calls cut while streaming end with ``length``.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from attnmask.decode.grammar import Grammar
from attnmask.errors import UserError

__all__ = ["ToolCall", "ToolStream", "Tools", "parse_tools", "render_messages"]

CHOICES = ("none", "auto", "required")
RESPONSE = '{"response":"'  # how a text answer begins (the grammar writes JSON without spaces)


class ToolError(ValueError):
    """A client's mistake in ``tools``/``tool_choice`` or in a message's tool fields: (param, message)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param, self.message = param, message


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}``."""

    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def message(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class Tools:
    """The tools a chat request offers, and which of them the answer may call."""

    functions: tuple[dict[str, Any], ...]  # {"name", "description"?, "parameters"} each, in the request's order
    choice: str  # "auto", "required", or the name of the one tool to call
    parallel: bool = True  # several calls in one answer

    @property
    def offered(self) -> tuple[dict[str, Any], ...]:
        """The tools the answer may call (one, when ``tool_choice`` names it)."""
        if self.choice in ("auto", "required"):
            return self.functions
        return tuple(f for f in self.functions if f["name"] == self.choice)

    def schema(self) -> dict[str, Any]:
        """The JSON schema of an answer (what :meth:`grammar` holds it to)."""
        call = [
            _object({"name": {"const": f["name"]}, "arguments": _closed(f["parameters"])}, ["name", "arguments"])
            for f in self.offered
        ]
        calls = {"type": "array", "items": call[0] if len(call) == 1 else {"anyOf": call}, "minItems": 1}
        if not self.parallel:
            calls["maxItems"] = 1
        answer = _object({"tool_calls": calls}, ["tool_calls"])
        if self.choice == "auto":
            answer = {"anyOf": [answer, _object({"response": {"type": "string"}}, ["response"])]}
        # JSON on one line, with ", " and ": " between items: a small model cannot wander off into whitespace
        return {"x-guidance": {"whitespace_flexible": False}, **answer}

    def grammar(self) -> Grammar:
        """The grammar of :meth:`schema`, one per request's tools (llguidance compiles it once)."""
        return self._grammar

    @functools.cached_property
    def _grammar(self) -> Grammar:
        return Grammar.json_schema(self.schema())

    def instructions(self) -> str:
        """The system message's text that offers the tools and says how to answer."""
        listed = json.dumps(list(self.offered), ensure_ascii=False)
        call = '{"tool_calls": [{"name": "<tool name>", "arguments": {<the tool\'s parameters>}}]}'
        if self.choice == "auto":
            how = f"either call tools with {call}, or answer the user directly with " + '{"response": "<your answer>"}'
        elif self.choice == "required":
            how = f"call one or more tools with {call}"
        else:
            how = f"call the tool {self.choice!r} with {call}"
        if not self.parallel:
            how += " (one call at most)"
        return f"You can call these tools:\n{listed}\nAnswer with one JSON object: {how}."

    def parse(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """``(content, tool calls, finish_reason)`` of the model's answer ``text``: its calls, each with a
        fresh id; or its ``response`` text; or, when the JSON is not complete (cut by ``max_tokens`` or
        a stop string), the text a text answer had, else the raw text, and the engine's finish reason."""
        try:
            answer = json.loads(text)
        except ValueError:
            return (_string_so_far(text[len(RESPONSE) :]) if text.startswith(RESPONSE) else text), [], finish_reason
        if not isinstance(answer, dict):
            return text, [], finish_reason
        if isinstance(answer.get("response"), str):
            return _whole(answer["response"]), [], finish_reason
        calls = [
            ToolCall(c["name"], _whole(json.dumps(c["arguments"], ensure_ascii=False)), f"call_{uuid.uuid4().hex[:24]}")
            for c in answer.get("tool_calls", ())
            if isinstance(c, dict) and isinstance(c.get("name"), str)
        ]
        if not calls:
            return text, [], finish_reason
        return None, calls, "tool_calls"


def _closed(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` in each object schema that does not set it: a call's
    arguments hold the parameters the tool names, nothing else (what llama.cpp's schema grammars assume)."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) if k not in ("const", "enum", "default", "examples") else v for k, v in schema.items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _whole(text: str) -> str:
    """``text`` with any lone surrogate (JSON allows ``"\\ud83d"`` alone; UTF-8 cannot hold it) as U+FFFD."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _string_so_far(body: str) -> str:
    """The text of a JSON string whose opening quote came before ``body``: up to its closing quote, or, while
    it is still being written, up to the last character that is whole (not an escape cut in two)."""
    i, end = 0, len(body)
    while i < end:
        c = body[i]
        if c == '"':
            end = i  # the closing quote
            break
        i += 2 if c == "\\" else 1
    cut = min(i, end)
    while cut > 0:  # an escape cut by the token boundary (\, \u12) waits for the rest
        try:
            text = json.loads(f'"{body[:cut]}"')
        except ValueError:
            cut -= 1
            continue
        if text and "\ud800" <= text[-1] <= "\udbff":  # half of a surrogate pair: its other half is to come
            cut = body.rindex("\\u", 0, cut)
            continue
        return _whole(text)
    return ""


class ToolStream:
    """One streamed answer of a chat that offered tools: :meth:`push` each piece of its text and send what it
    returns, :meth:`finish` at the end.

    A text answer's words are sent as they come. Calls are sent as OpenAI streams them: each call's first
    delta has its ``index``, ``id``, ``type`` and ``function.name`` (and empty ``arguments``) once its name
    is whole, then its ``arguments`` follow in pieces as the model writes them (the JSON text as written,
    without the spaces the whole answer's re-serialized ``arguments`` have: the same JSON value). An answer
    whose JSON takes another shape than the grammar's usual one is sent whole at the end, as before."""

    def __init__(self, tools: Tools):
        self.tools, self.text, self.sent = tools, "", 0
        self.calls: list[str] = []  # the ids of the calls whose first delta was sent
        self._phase = "head"  # head: a call's {"name": ..., "arguments": next; args: inside them; after; done
        self._at = len(CALLS)  # where the text of the current phase begins
        self._args: list = []  # [scanned up to, depth, in a string, after a backslash, sent up to]

    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """``(content delta, tool call deltas)`` for the answer's text so far, ``text`` appended."""
        self.text += text
        if self.text.startswith(RESPONSE):
            content = _string_so_far(self.text[len(RESPONSE) :])
            delta, self.sent = content[self.sent :], len(content)
            return delta, []
        if self._phase == "done" or not self.text.startswith(CALLS):
            if not CALLS.startswith(self.text):  # neither calls nor text in the usual shape: whole at the end
                self._phase = "done"
            return "", []
        return "", self._scan()

    def _scan(self) -> list[dict[str, Any]]:
        deltas, text = [], self.text
        while True:
            if self._phase == "head":
                found = _CALL_HEAD.match(text, self._at)
                if found is None:
                    if not _could_be_head(text[self._at :]):
                        self._phase = "done"
                    return deltas
                call_id = f"call_{uuid.uuid4().hex[:24]}"
                deltas.append({"index": len(self.calls), "id": call_id, "type": "function",
                               "function": {"name": found.group(1), "arguments": ""}})  # fmt: skip
                self.calls.append(call_id)
                self._phase, self._at = "args", found.end()
                self._args = [found.end(), 0, False, False, found.end()]
            elif self._phase == "args":
                i, depth, quoted, escaped, sent = self._args
                end = None
                while i < len(text) and end is None:
                    c = text[i]
                    i += 1
                    if quoted:
                        escaped, quoted = (False, True) if escaped else (c == "\\", c != '"')
                    elif c == '"':
                        quoted = True
                    elif c in "{[":
                        depth += 1
                    elif c in "}]":
                        depth -= 1
                        end = i if depth == 0 else None
                if i > sent:
                    deltas.append({"index": len(self.calls) - 1, "function": {"arguments": text[sent:i]}})
                self._args = [i, depth, quoted, escaped, i]
                if end is None:
                    return deltas
                self._phase, self._at = "after", end
            elif self._phase == "after":  # the call's "}", then "," and the next call, or "]"
                if len(text) < self._at + 2:
                    return deltas
                closing = text[self._at : self._at + 2]
                self._phase = "head" if closing == "}," else "done"
                self._at += 2
            else:
                return deltas

    def finish(self, finish_reason: str | None) -> tuple[str | None, list[dict[str, Any]], str | None]:
        """``(content not yet sent or None, tool call deltas not yet sent, finish_reason)``, as
        :meth:`Tools.parse` reads the whole: the calls not streamed whole (indices after the streamed ones);
        for an answer cut while its calls streamed, nothing more (the finish reason says ``length``)."""
        content, calls, finish = self.tools.parse(self.text, finish_reason)
        if self.calls:
            if not calls:  # cut: the calls' deltas stand as sent
                return None, [], finish
            rest = [call.message(index=len(self.calls) + k) for k, call in enumerate(calls[len(self.calls) :])]
            return None, (self._scan() if self._phase != "done" else []) + rest, finish
        if content is not None:
            content = content[self.sent :] if self.text.startswith(RESPONSE) else content
        return content, [call.message(index=k) for k, call in enumerate(calls)], finish


CALLS = '{"tool_calls":['  # how an answer of calls begins
_CALL_HEAD = re.compile(r'\{"name":"([A-Za-z0-9_-]{1,64})","arguments":')


def _could_be_head(text: str) -> bool:
    """Whether ``text`` may still grow into the start of a call: ``{"name":"<name>","arguments":``."""
    start = '{"name":"'
    if len(text) <= len(start):
        return start.startswith(text)
    if not text.startswith(start):
        return False
    name = re.match(r"[A-Za-z0-9_-]*", text[len(start) :]).group(0)
    rest = text[len(start) + len(name) :]
    return len(name) <= 64 and '","arguments":'.startswith(rest)


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _function(tool: Any, i: int) -> dict[str, Any]:
    param = f"tools[{i}]"
    expected = "{'type': 'function', 'function': {'name': ..., 'description': ..., 'parameters': {...}}}"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ToolError(param, f"'{param}' must be {expected}; got {tool!r}"[:400])
    fn = tool["function"]
    name = fn.get("name")
    if (
        not isinstance(name, str)
        or not name
        or len(name) > 64
        or not all(c.isascii() and (c.isalnum() or c in "_-") for c in name)
    ):
        raise ToolError(f"{param}.function.name", f"'{param}.function.name' must be 1-64 letters, digits, _ or -; "
                        f"got {name!r}")  # fmt: skip
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{param}.function.description", f"'{param}.function.description' must be a string")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}  # OpenAI: a function that takes no arguments
    if not isinstance(parameters, dict):
        raise ToolError(f"{param}.function.parameters", f"'{param}.function.parameters' must be a JSON schema "
                        f"(an object); got {parameters!r}"[:400])  # fmt: skip
    out = {"name": name}
    if description:
        out["description"] = description
    return {**out, "parameters": parameters}


def parse_tools(body: dict) -> Tools | None:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked; None when no tool
    may be called (no tools, or ``tool_choice: "none"``). Raises :class:`ToolError` naming the field."""
    if body.get("functions") is not None or body.get("function_call") is not None:
        name = "functions" if body.get("functions") is not None else "function_call"
        raise ToolError(name, f"'{name}' is OpenAI's deprecated form; send 'tools' and 'tool_choice'")
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls", f"'parallel_tool_calls' must be true or false; got {parallel!r}")
    if tools is None or tools == []:  # no tools offered (some clients send an empty list)
        if choice not in (None, "none"):
            raise ToolError("tool_choice", "'tool_choice' needs 'tools'")
        return None
    if not isinstance(tools, list):
        raise ToolError("tools", f"'tools' must be a list of tools; got {tools!r}"[:400])
    functions = tuple(_function(t, i) for i, t in enumerate(tools))
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise ToolError(
            "tools", f"'tools' names a function twice: {sorted(n for n in set(names) if names.count(n) > 1)}"
        )
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ToolError("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                            f"{{'type': 'function', 'function': {{'name': ...}}}}; got {choice!r}"[:400])  # fmt: skip
        if name not in names:
            raise ToolError(
                "tool_choice", f"'tool_choice' names {name!r}, which is not in 'tools' ({', '.join(names)})"
            )
        choice = name
    elif choice not in CHOICES:
        raise ToolError(
            "tool_choice", f"'tool_choice' must be 'none', 'auto', 'required' or a function; got {choice!r}"
        )
    if choice == "none":
        return None
    spec = Tools(functions, choice, parallel)
    try:
        spec.grammar().check()
    except UserError as err:
        raise ToolError("tools", f"the tools' parameters are not a JSON schema llguidance can follow: {err}") from err
    return spec


def _tool_calls_text(calls: Any, i: int) -> str:
    """An earlier assistant turn's ``tool_calls`` in the answer format."""
    if not isinstance(calls, list):
        raise ToolError(f"messages[{i}].tool_calls", f"'messages[{i}].tool_calls' must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise ToolError(f"messages[{i}].tool_calls[{j}]", f"'messages[{i}].tool_calls[{j}]' must be {{'id': ..., "
                            "'type': 'function', 'function': {'name': ..., 'arguments': '<JSON text>'}}")  # fmt: skip
        try:
            arguments = json.loads(fn["arguments"])
        except ValueError as err:
            raise ToolError(f"messages[{i}].tool_calls[{j}]", f"'messages[{i}].tool_calls[{j}].function.arguments' "
                            f"is not JSON: {err}") from err  # fmt: skip
        out.append({"name": fn["name"], "arguments": arguments})
    return json.dumps({"tool_calls": out}, ensure_ascii=False)


def render_messages(messages: list[dict[str, Any]], tools: Tools | None) -> list[dict[str, str]]:
    """Chat messages as ``{"role", "content"}`` turns any template renders: the tools' instructions in the
    system message (the first, or a new one), assistant tool calls as their JSON, ``tool`` messages as
    user turns holding ``{"tool_response": ...}``. ``messages`` hold ``role``, ``content`` (text) and,
    where the client sent them, ``tool_calls``, ``tool_call_id`` and ``name``."""
    out = []
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role == "assistant" and m.get("tool_calls"):
            content = _tool_calls_text(m["tool_calls"], i)
        elif role == "tool":
            response = {"content": content}
            for key in ("name", "tool_call_id"):
                if isinstance(m.get(key), str):
                    response = {key: m[key], **response}
            role, content = "user", json.dumps({"tool_response": response}, ensure_ascii=False)
        out.append({"role": role, "content": content})
    if tools is not None:
        text = tools.instructions()
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
