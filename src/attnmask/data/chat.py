"""Conversations for chat fine-tuning: JSONL rows checked, rendered with a chat template, tokenized
with a mask of the tokens the loss is taken on (the assistant's).

One JSON object a line, either of::

    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
    {"prompt": "...", "completion": "..."}      # = a user turn and an assistant turn

Every row needs at least one assistant turn, and a user turn before the first one. Bad rows (not
JSON, a missing or unknown role, no assistant turn, longer than the limit) are reported by line
number and skipped (:class:`ChatRows`); a file with no good row is a :class:`DataError`.

Which tokens are the assistant's comes from the template itself, not from a per-model rule: for
assistant turn ``i``, the text before it is ``render(messages[:i], add_generation_prompt=True)``
(what the model is prompted with at inference) and the text through it is
``render(messages[:i + 1])``; the characters between the two are the turn. Each piece is tokenized
on its own, so the assistant's tokens are exactly those the model would generate after that prompt.
Inside a turn, the tokens up to and including the first end-of-turn token (``end_ids``, e.g.
``<|im_end|>``) are labelled; what the template writes after it (a newline) is not.

This module knows no tokenizer or template class: :func:`tokenize_chat` takes ``render`` and
``encode`` functions (:mod:`attnmask.train.chat` passes a pretrained model's own).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from attnmask.data.files import DataError, read_all_lines
from attnmask.errors import UserError

ROLES = ("system", "user", "assistant")

Message = dict[str, str]
Render = Callable[..., str]  # render(messages, add_generation_prompt=bool) -> text


class RowError(UserError):
    """One conversation that cannot be used, and why (reported with its line number, then skipped)."""


@dataclass
class ChatExample:
    """One tokenized conversation."""

    ids: list[int]  # every token of the rendered conversation
    targets: list[bool]  # per token: True where the loss is taken (assistant text and end of turn)
    line: int = 0  # 1-based line of the file it came from (0: not from a file)

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class ChatRows:
    """The conversations of a JSONL file and the rows that were skipped."""

    path: str
    conversations: list[tuple[int, list[Message]]] = field(default_factory=list)  # (line, messages)
    bad: list[tuple[int, str]] = field(default_factory=list)  # (line, why)

    def report(self) -> list[str]:
        """One line per bad row, then the count (empty when every row is good)."""
        if not self.bad:
            return []
        lines = [f"{self.path}:{line}: skipped: {why}" for line, why in self.bad]
        total = len(self.bad) + len(self.conversations)
        return lines + [f"{self.path}: skipped {len(self.bad)} of {total} rows"]


def parse_row(obj) -> list[Message]:
    """The messages of one decoded JSON row.

    Raises:
        RowError: not an object of either form, a message without a known ``role`` or a ``str``
            ``content``, no assistant turn, or an assistant turn before any user turn.
    """
    if not isinstance(obj, dict):
        raise RowError(f'a JSON {type(obj).__name__}; expected {{"messages": [...]}} or {{"prompt", "completion"}}')
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise RowError('"messages" is not a non-empty list of {"role", "content"} objects')
    elif "prompt" in obj or "completion" in obj:
        for key in ("prompt", "completion"):
            if not isinstance(obj.get(key), str):
                raise RowError(f'"{key}" is {"missing" if key not in obj else "not a string"}; expected both strings')
        messages = [{"role": "user", "content": obj["prompt"]}, {"role": "assistant", "content": obj["completion"]}]
    else:
        raise RowError(f'keys {sorted(obj)}; expected {{"messages": [...]}} or {{"prompt", "completion"}}')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RowError(f'message {i} is a JSON {type(m).__name__}; expected {{"role", "content"}}')
        if "role" not in m:
            raise RowError(f"message {i} has no role; expected one of {ROLES}")
        if m["role"] not in ROLES:
            raise RowError(f"message {i} has role {m['role']!r}; expected one of {ROLES}")
        if not isinstance(m.get("content"), str):
            raise RowError(f"message {i} ({m['role']}) has no string content")
        out.append({"role": m["role"], "content": m["content"]})
    roles = [m["role"] for m in out]
    if "assistant" not in roles:
        raise RowError("no assistant turn; expected at least one to learn from")
    if "user" not in roles[: roles.index("assistant")]:
        raise RowError("the first assistant turn has no user turn before it")
    return out


def read_chat_jsonl(path: str | Path) -> ChatRows:
    """Every line of ``path`` (UTF-8, ``.gz`` allowed) parsed; blank lines are ignored.

    Raises:
        FileNotFoundError, DataError: the file cannot be read (see :mod:`attnmask.data.files`).
    """
    rows = ChatRows(str(path))
    for number, line in enumerate(read_all_lines(path), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            rows.bad.append((number, f"not JSON ({err.msg} at column {err.colno})"))
            continue
        try:
            rows.conversations.append((number, parse_row(obj)))
        except RowError as err:
            rows.bad.append((number, str(err)))
    return rows


def tokenize_chat(
    messages: Sequence[Message],
    *,
    render: Render,
    encode: Callable[[str], list[int]],
    end_ids: Collection[int] = (),
    bos_id: int | None = None,
) -> ChatExample:
    """Token ids of the rendered conversation and which of them are the assistant's (module docstring).

    ``encode`` adds no special tokens of its own (special tokens spelled in the text are theirs);
    ``bos_id``, when given, is put first.

    Raises:
        RowError: the template does not render the conversation as a sequence of growing prefixes
            (each assistant turn must start where the generation prompt ends), or refuses it.
    """
    messages = list(messages)
    try:
        final = render(messages, add_generation_prompt=False)
        pieces: list[tuple[str, bool]] = []  # (text, assistant turn)
        pos = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            head = render(messages[:i], add_generation_prompt=True)
            through = render(messages[: i + 1], add_generation_prompt=False)
            if not (len(head) >= pos and through.startswith(head) and final.startswith(through)):
                raise RowError(
                    f"the chat template does not render assistant turn {i} after its generation prompt; "
                    "expected each turn to extend the rendered conversation"
                )
            pieces += [(final[pos : len(head)], False), (final[len(head) : len(through)], True)]
            pos = len(through)
        pieces.append((final[pos:], False))
    except RowError:
        raise
    except UserError as err:  # the template's raise_exception (e.g. roles that must alternate)
        raise RowError(str(err)) from err
    ids: list[int] = [] if bos_id is None else [bos_id]
    targets: list[bool] = [False] * len(ids)
    for text, assistant in pieces:
        if not text:
            continue
        piece = encode(text)
        labelled = len(piece) if assistant else 0
        if assistant:
            end = next((j for j, t in enumerate(piece) if t in end_ids), None)
            labelled = len(piece) if end is None else end + 1
        ids += piece
        targets += [True] * labelled + [False] * (len(piece) - labelled)
    return ChatExample(ids, targets)


def tokenize_rows(
    rows: ChatRows,
    *,
    render: Render,
    encode: Callable[[str], list[int]],
    max_len: int,
    end_ids: Collection[int] = (),
    bos_id: int | None = None,
) -> list[ChatExample]:
    """Tokenize every conversation of ``rows``; those the template refuses, longer than ``max_len``
    tokens, or with no target token go to ``rows.bad`` (so :meth:`ChatRows.report` lists them).

    Raises:
        DataError: no good row is left.
    """
    examples, kept = [], []
    for line, messages in rows.conversations:
        try:
            ex = tokenize_chat(messages, render=render, encode=encode, end_ids=end_ids, bos_id=bos_id)
        except RowError as err:
            rows.bad.append((line, str(err)))
            continue
        if len(ex) > max_len:
            rows.bad.append((line, f"{len(ex)} tokens, longer than --max-len {max_len}"))
            continue
        if not any(ex.targets[1:]):  # the first token is never predicted
            rows.bad.append((line, "no assistant token to learn from after rendering"))
            continue
        ex.line = line
        examples.append(ex)
        kept.append((line, messages))
    rows.conversations = kept
    rows.bad.sort()
    if not examples:
        raise DataError(
            f"{rows.path}: no usable conversation in {len(rows.bad)} rows (first: line {rows.bad[0][0]}: "
            f"{rows.bad[0][1]})"
            if rows.bad
            else f"{rows.path}: no conversation; expected one JSON object a line"
        )
    return examples


# --- an example file, generated (no download) ----------------------------------------------------

EXAMPLE_SYSTEM = "You convert dates to ISO 8601 (YYYY-MM-DD) and answer with the date alone."


def example_conversations(n: int = 200, *, seed: int = 0) -> list[dict]:
    """``n`` JSONL rows teaching the built-in dates task (:mod:`attnmask.data.synthetic`) as a chat:
    single and multi-turn ``messages`` rows, some with a system turn, and ``prompt``/``completion``
    rows. Deterministic in ``seed``; ``examples/chat.jsonl`` is ``example_conversations()``."""
    import random

    from attnmask.data.synthetic import get_task

    pairs = get_task("dates").make_pairs(3 * n, seed=seed, split="train")
    rng = random.Random(seed)
    rows, k = [], 0
    for i in range(n):
        kind = i % 4
        if kind == 3:
            src, tgt = pairs[k]
            k += 1
            rows.append({"prompt": f"Write {src} in ISO 8601.", "completion": tgt})
            continue
        messages = [{"role": "system", "content": EXAMPLE_SYSTEM}] if kind == 0 else []
        for _ in range(1 if kind < 2 else rng.randint(2, 3)):
            src, tgt = pairs[k]
            k += 1
            ask = rng.choice(["What is {} in ISO 8601?", "Convert to ISO 8601: {}", "ISO date for {}, please."])
            messages += [{"role": "user", "content": ask.format(src)}, {"role": "assistant", "content": tgt}]
        rows.append({"messages": messages})
    return rows


def write_example(path: str | Path, n: int = 200, *, seed: int = 0) -> Path:
    """Write :func:`example_conversations` as JSONL: ``python -c "from attnmask.data.chat import
    write_example; write_example('examples/chat.jsonl')"``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in example_conversations(n, seed=seed))
    path.write_text(text, encoding="utf-8")
    return path
