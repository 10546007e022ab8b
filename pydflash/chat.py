"""Chat templates (the GGUF's `tokenizer.chat_template`, Jinja) and the split of a reply into reasoning and
content, as Hugging Face `transformers` renders them and llama-server returns them.

Templates are untrusted code from a model file: they run in Jinja's ImmutableSandboxedEnvironment with only the
helpers Hugging Face templates use (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text), and
with transformers' settings (trim_blocks, lstrip_blocks, loop controls), so that a prompt renders to the same
text as `tokenizer.apply_chat_template`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import PydflashError

__all__ = ["ChatTemplate", "ChatTemplateError", "ReasoningStream", "split_reasoning"]


class ChatTemplateError(PydflashError, ValueError):
    """A chat template that does not compile or raises while rendering (e.g. its own raise_exception), or
    messages the template cannot take."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters, which the models never saw in training
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask markers): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template.

    >>> t = ChatTemplate(source, bos_token="", eos_token="<|im_end|>")
    >>> t.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True, enable_thinking=False)
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", name: str = "chat template"):
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError(f"{name}: empty chat template")
        self.source = source
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{name}: does not compile (line {e.lineno}): {e.message}") from None

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for `messages` (OpenAI-shaped dicts: role, content, and optionally tool_calls,
        reasoning_content, name...). `tools` (JSON schemas) and `kwargs` (e.g. enable_thinking) are passed to
        the template as Hugging Face passes them."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise ChatTemplateError(f"messages[{i}] must be a dict, got {type(m).__name__}")
            if "role" not in m:
                raise ChatTemplateError(f"messages[{i}] has no 'role'")
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs,
                     "messages": [dict(m) for m in messages], "tools": list(tools) if tools else None,
                     "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**variables)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"{self.name}: {e}") from None
        # a value the template cannot take; OverflowError: the sandbox's bound on range()
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
            raise ChatTemplateError(f"{self.name} cannot render these messages: {type(e).__name__}: {e}") from None


@dataclass
class ReasoningSplit:
    reasoning_content: str | None  # the text inside <think>...</think> (None when there was none)
    content: str


def split_reasoning(text: str, *, start: str = "<think>", end: str = "</think>",
                    started: bool = False) -> ReasoningSplit:
    """Separate a reply's reasoning from its content, as llama-server's `reasoning_format` does for Qwen3 /
    Qwen3.5: the text between `start` and `end` (leading and trailing whitespace dropped) is the reasoning, what
    follows `end` the content. `started`: the prompt already opened the block (a template that ends its
    generation prompt with `<think>`), so the reply begins inside it. A block never closed (generation stopped
    while thinking) is all reasoning."""
    body = text
    if not started:
        stripped = text.lstrip()
        if not stripped.startswith(start):
            return ReasoningSplit(None, text)
        body = stripped[len(start):]
    at = body.find(end)
    if at < 0:
        return ReasoningSplit(body.strip(), "")
    return ReasoningSplit(body[:at].strip(), body[at + len(end):].lstrip())


def partial_tag_at_end(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (text a stream must hold back)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningStream:
    """split_reasoning for a reply arriving in pieces: feed() returns (field, text) pairs, field being
    "reasoning_content" or "content"; text that could still be the start of a tag is held back."""

    def __init__(self, *, start: str = "<think>", end: str = "</think>", started: bool = False):
        self._start, self._end = start, end
        self._state = "reasoning" if started else "maybe"  # maybe: no visible text yet
        self._pending = ""
        self._lstrip = started  # whitespace after a tag is dropped until text comes

    def _held(self, tag: str) -> int:
        return partial_tag_at_end(self._pending, tag)

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._pending += text
        out: list[tuple[str, str]] = []
        while True:
            if self._lstrip:
                self._pending = self._pending.lstrip()
                self._lstrip = not self._pending
            if self._state == "maybe":
                stripped = self._pending.lstrip()
                if stripped.startswith(self._start):
                    self._pending = stripped[len(self._start):]
                    self._state, self._lstrip = "reasoning", True
                    continue
                if stripped and not self._start.startswith(stripped):
                    self._state = "content"
                    continue
                return out
            if self._state == "reasoning":
                at = self._pending.find(self._end)
                if at >= 0:
                    if self._pending[:at].rstrip():
                        out.append(("reasoning_content", self._pending[:at].rstrip()))
                    self._pending = self._pending[at + len(self._end):]
                    self._state, self._lstrip = "content", True
                    continue
                # held back: a possible start of the end tag, and trailing whitespace (dropped before the tag)
                ready = self._pending[: len(self._pending) - self._held(self._end)].rstrip()
                if ready:
                    out.append(("reasoning_content", ready))
                self._pending = self._pending[len(ready):]
                return out
            if self._pending:
                out.append(("content", self._pending))
            self._pending = ""
            return out

    def flush(self) -> list[tuple[str, str]]:
        reasoning = self._state == "reasoning"
        text, self._pending = (self._pending.rstrip() if reasoning else self._pending), ""
        return [("reasoning_content" if reasoning else "content", text)] if text else []
