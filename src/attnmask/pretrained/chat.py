"""Talking to a pretrained model: its tokenizer with its own special tokens, and its chat template.

Pretrained tokenizers keep their own special tokens (SmolLM2: ``<|endoftext|>`` = 0,
``<|im_start|>`` = 1, ``<|im_end|>`` = 2), so they are wrapped by :class:`PretrainedTokenizer`,
which exposes the same ids as :class:`attnmask.data.tokenizer.Tokenizer` (``pad_id``, ``sos_id``,
``eos_id``, ``unk_id``) plus ``stop_ids``, the tokens that end a generation. :class:`ChatTemplate`
renders a conversation into the prompt text the model was trained on (the checkpoint's Jinja
template, run sandboxed).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence

from torch import Tensor

from attnmask.data.tokenizer import TokenizerBase
from attnmask.errors import UserError, UserTypeError

__all__ = ["TEMPLATES", "ChatTemplate", "Messages", "PretrainedTokenizer", "chat_template_for", "template_source"]


class PretrainedTokenizer(TokenizerBase):
    """A pretrained model's own tokenizer (a Hugging Face ``tokenizers.Tokenizer``) and special ids.

    Unlike :class:`attnmask.data.tokenizer.Tokenizer`, special tokens spelled in the text (as a rendered
    chat template spells ``<|im_start|>``) encode to their ids, as in Hugging Face.
    """

    def __init__(
        self,
        hf_tokenizer,
        *,
        bos_id: int | None,
        eos_id: int,
        pad_id: int | None = None,
        unk_id: int | None = None,
        add_bos: bool = False,
        stop_ids: Sequence[int] | None = None,
    ):
        self._hf = hf_tokenizer
        self.bos_id, self.eos_id, self.unk_id, self.add_bos = bos_id, eos_id, unk_id, add_bos
        self.pad_id = eos_id if pad_id is None else pad_id  # a filler only: padding is masked by lengths
        self.stop_ids = tuple(stop_ids) if stop_ids is not None else (eos_id,)
        self.special_ids = frozenset(i for i, tok in hf_tokenizer.get_added_tokens_decoder().items() if tok.special)

    @classmethod
    def from_special_ids(cls, hf_tokenizer, special_ids: Mapping[str, int | None], *, add_bos: bool = False):
        """From a checkpoint's ``{"bos_id", "eos_id", "pad_id", "unk_id"}``; generation also stops
        at ``<|endoftext|>`` when the vocabulary has it (chat models end turns with their eos)."""
        eos = special_ids["eos_id"]
        if eos is None:
            raise UserError("the checkpoint names no eos token id; expected tokenizer.ggml.eos_token_id")
        end_of_text = hf_tokenizer.token_to_id("<|endoftext|>")
        stop = [eos] + ([end_of_text] if end_of_text is not None and end_of_text != eos else [])
        return cls(
            hf_tokenizer,
            bos_id=special_ids.get("bos_id"),
            eos_id=eos,
            pad_id=special_ids.get("pad_id"),
            unk_id=special_ids.get("unk_id"),
            add_bos=add_bos,
            stop_ids=stop,
        )

    @property
    def sos_id(self) -> int | None:
        """The begin-of-sequence id (``<|im_start|>`` for SmolLM2); prepended only when ``add_bos``."""
        return self.bos_id

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens spelled in it included), with ``<bos>`` first when
        the model expects it. Raises TypeError for non-``str``."""
        if not isinstance(text, str):
            raise UserTypeError(f"expected text as str, got {type(text).__name__}")
        ids = self._hf.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def decode(self, ids: Iterable[int] | Tensor, skip_special: bool = True) -> str:
        """Text of ``ids`` (a list or 1-D tensor); special tokens dropped with ``skip_special``.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        ids = self._check_ids(ids)
        if skip_special:
            ids = [i for i in ids if i not in self.special_ids]
        return self._hf.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"PretrainedTokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, stop_ids={self.stop_ids})"


Messages = str | Sequence[Mapping[str, str]]


def _raise_exception(message):
    raise UserError(f"chat template: {message}")


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    """``source`` compiled once a process, or None without ``jinja2``. Compiled on every render,
    the template took 3 of the 3.2 minutes before a fine-tuning run on 18,000 conversations began
    (three renders a conversation). A compiled template renders from several threads at once."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


class ChatTemplate:
    """Renders chat messages into the prompt text an instruction-tuned model was trained on.

    ``chat("Hi")`` is ``chat([{"role": "user", "content": "Hi"}])``; with ``add_generation_prompt``
    the text ends where the assistant's answer begins. The template is the model's own Jinja
    source, rendered with ``jinja2`` (sandboxed, as Hugging Face does). Without ``jinja2``, a
    ChatML template (SmolLM2's) is rendered by :meth:`render_chatml`, which writes out the same
    rules by hand.
    """

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = ""):
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token

    @classmethod
    def for_tokenizer(cls, source: str, tokenizer: PretrainedTokenizer) -> ChatTemplate:
        """The template with ``bos_token``/``eos_token`` spelled as ``tokenizer`` spells them."""

        def spell(i):
            return tokenizer.id_to_token(i) if i is not None else ""

        return cls(source, bos_token=spell(tokenizer.bos_id), eos_token=spell(tokenizer.eos_id))

    @staticmethod
    def _messages(messages: Messages) -> list[dict[str, str]]:
        if isinstance(messages, str):
            return [{"role": "user", "content": messages}]
        out = []
        for i, m in enumerate(messages):
            if (
                not isinstance(m, Mapping)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise UserError(f"message {i} is {m!r}; expected a dict with str 'role' and 'content'")
            out.append({"role": m["role"], "content": m["content"]})
        if not out:
            raise UserError("no messages to render; expected at least one")
        return out

    def __call__(self, messages: Messages, *, add_generation_prompt: bool = True) -> str:
        if self.source is None:
            raise UserError("this model has no chat template (tokenizer.chat_template); prompt it with plain text")
        msgs = self._messages(messages)
        template = _compile(self.source)
        if template is None:
            return self.render_chatml(msgs, add_generation_prompt=add_generation_prompt)
        return template.render(
            messages=msgs,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    def render_chatml(self, messages: Messages, *, add_generation_prompt: bool = True) -> str:
        """SmolLM2's template by hand: a default system turn unless the first message is one, each
        message as ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, then ``<|im_start|>assistant\\n``."""
        if self.source is None or "<|im_start|>" not in self.source:
            raise UserError("rendering this chat template needs jinja2 (pip install jinja2): it is not ChatML")
        msgs = self._messages(messages)
        default = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", self.source, flags=re.S)
        parts = []
        if default is not None and msgs[0]["role"] != "system":
            parts.append(f"<|im_start|>system\n{default.group(1)}<|im_end|>\n")
        parts += [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs]
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


# Templates for models whose files carry none (a base model, Gemma 3's GGUF), by name. No BOS token
# in the text: the tokenizer puts it first where the model expects one (``add_bos``).
TEMPLATES = {
    # <|im_start|>role\ncontent<|im_end|>\n a turn; no default system turn
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # <start_of_turn>user|model\ncontent<end_of_turn>\n a turn; a system message opens the next user turn
    "gemma": (
        "{% set ns = namespace(system='') %}{% for m in messages %}{% if m['role'] == 'system' %}"
        "{% set ns.system = m['content'] + '\\n\\n' %}{% else %}"
        "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
        "{% if m['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
        "{{ m['content'] + '<end_of_turn>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
    ),
}


def template_source(spec: str, option: str = "--chat-template") -> str:
    """The Jinja source ``spec`` names: a file holding one, or a name of :data:`TEMPLATES`.

    Raises:
        ValueError: neither a readable file nor a known name (the message names ``option``).
    """
    from pathlib import Path

    path = Path(spec)
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"{option} {spec}: cannot read the template ({err}); expected a UTF-8 Jinja file") from err
    if spec in TEMPLATES:
        return TEMPLATES[spec]
    raise UserError(
        f"{option} {spec}: no such file or template name; expected FILE.jinja or one of {sorted(TEMPLATES)}"
    )


def chat_template_for(tokenizer: PretrainedTokenizer, spec: str, option: str = "--chat-template") -> ChatTemplate:
    """The template ``spec`` names (:func:`template_source`), for ``tokenizer``; the token that ends an
    assistant turn in it (a special token of the vocabulary, e.g. ``<end_of_turn>``) joins the
    tokenizer's ``stop_ids``, so that generation stops there and the loss is taken on it.

    Raises:
        ValueError: an unknown ``spec``, or a template that cannot render a user and an assistant turn.
    """
    template = ChatTemplate.for_tokenizer(template_source(spec, option), tokenizer)
    marker = "\u2063answer\u2063"
    try:
        text = template([{"role": "user", "content": "question"}, {"role": "assistant", "content": marker}],
                        add_generation_prompt=False)  # fmt: skip
    except UserError:
        raise
    except Exception as err:  # a Jinja syntax or runtime error in a user's file
        raise UserError(f"{option} {spec}: the template does not render ({type(err).__name__}: {err})") from err
    if marker not in text:
        raise UserError(
            f"{option} {spec}: the template does not write the assistant's message; expected a chat template"
        )
    after = tokenizer.hf.encode(text.split(marker, 1)[1], add_special_tokens=False).ids
    if after and after[0] in tokenizer.special_ids and after[0] not in tokenizer.stop_ids:
        tokenizer.stop_ids = (*tokenizer.stop_ids, after[0])
    return template
