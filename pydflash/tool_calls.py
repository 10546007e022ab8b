"""Tool calls in a chat reply, as llama-server returns them (message.tool_calls, finish_reason "tool_calls"), for
the two forms Qwen models write:

- JSON (Qwen3's template, Hermes style): <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>. The
  arguments are the object's text as the model wrote it (as llama-server gives them), so that a call sent back
  renders to the very text, and a prompt cache keeps its prefix; written as a JSON string, that string.
- XML (Qwen3.5's and Qwen3-Coder's): <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
  </function>\\n</tool_call>. The arguments are the parameters as one compact JSON object (llama-server's form);
  a value is the text itself where the tool's schema allows only strings, and JSON where it reads as JSON (a
  number, an object...) unless it reads as a string and the schema allows one (llama.cpp's
  common/parsers/qwen3-coder.cpp). A value that does not read as JSON is its text: the caller's schema check
  then names it, where the call would otherwise be lost in the content.

Streamed (ToolCallStream), a call goes out as llama-server streams it: its id and name as soon as the name is
whole, then its arguments in pieces as they are written, each piece one that no later text can change (a string
parameter's text as it comes, any other value once whole); the pieces joined are the arguments split() gives.

The form is the template's: one that writes <function= and <parameter= inside <tool_call> is XML, another with
<tool_call> JSON. A block that does not parse (unclosed, bad JSON) stays in the content, as text. Streamed, what
of its call was already sent stays sent: a reply cut inside a call (max_tokens) ends with that call's arguments
unfinished, and finish_reason "length"."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Mapping, Sequence

from .chat import partial_tag_at_end

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_COMPACT = {"ensure_ascii": False, "separators": (",", ":")}
# a JSON call whose name is written first, and the start of its arguments object where they follow
_JSON_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_JSON_ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:\s*(?=\{)')
# a string (an unfinished one runs to the end of the text) or a bracket
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[{}\[\]]')


def form_of(template_source: str) -> str | None:
    """"xml", "json" or None (a template that writes no tool calls)."""
    if OPEN not in template_source:
        return None
    return "xml" if FUNCTION in template_source and PARAMETER in template_source else "json"


def _types(tools: Sequence[Mapping[str, Any]], function: str, parameter: str) -> set[str]:
    """The JSON types the tool's schema allows for the parameter (empty: not known)."""
    for tool in tools or ():
        f = tool.get("function", {}) if isinstance(tool, Mapping) else {}
        if f.get("name") == function:
            schema = (f.get("parameters") or {}).get("properties", {}).get(parameter, {})
            kind = schema.get("type") if isinstance(schema, Mapping) else None
            return set(kind) if isinstance(kind, list) else {kind} if isinstance(kind, str) else set()
    return set()


def _xml_value(text: str, types: set[str]) -> Any:
    if types == {"string"}:
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return text if isinstance(value, str) and "string" in types else value


def _escaped(text: str) -> str:
    """`text` as it reads inside a JSON string (piece by piece, the same as whole)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _xml_parameter(body: str, at: int, function: str, tools, closed: bool) -> tuple[str, int | None] | None:
    """The JSON member written for the <parameter= at body[at] and where the text goes on after it (None: the text
    ends inside it, the member so far); None where it does not parse."""
    key_end = body.find(">", at)
    if key_end < 0:
        return None if closed else ("", None)
    key = body[at + len(PARAMETER):key_end].strip()
    if not key or "\n" in key:
        return None
    types = _types(tools, function, key)
    head = json.dumps(key, ensure_ascii=False) + ":"
    start = key_end + 1
    if start < len(body) and body[start] == "\n":
        start += 1
    end = body.find(PARAMETER_END, start)
    if end >= 0:
        value = body[start:end]
        value = value[:-1] if value.endswith("\n") else value
        return head + json.dumps(_xml_value(value, types), **_COMPACT), end + len(PARAMETER_END)
    if closed:
        return None
    if types != {"string"}:
        return head, None
    written = body[start:]  # (empty while a first newline, which is not the value's, may still come)
    held = max(partial_tag_at_end(written, "\n" + PARAMETER_END), partial_tag_at_end(written, PARAMETER_END))
    return head + '"' + _escaped(written[:len(written) - held]), None


def _xml_arguments(body: str, at: int, function: str, tools, closed: bool) -> tuple[str, int | None] | None:
    """The arguments of the call whose parameters start at body[at] and where the text goes on after its
    </function> (None: the text ends inside the call, the arguments so far); None where it does not parse.
    Text between parameters is passed over."""
    members: list[str] = []
    while True:
        parameter, end = body.find(PARAMETER, at), body.find(FUNCTION_END, at)
        if end >= 0 and (parameter < 0 or end < parameter):
            return "{" + ",".join(members) + "}", end + len(FUNCTION_END)
        if parameter < 0:
            return None if closed else ("{" + ",".join(members), None)
        read = _xml_parameter(body, parameter, function, tools, closed)
        if read is None:
            return None
        member, at = read
        if at is None:
            return "{" + ",".join(members + [member] if member else members), None
        members.append(member)


def _xml_calls(body: str, tools, closed: bool) -> list[tuple[str, str]] | None:
    calls: list[tuple[str, str]] = []
    at = 0
    while True:
        while at < len(body) and body[at].isspace():
            at += 1
        if at == len(body):
            return calls if calls or not closed else None
        if not body.startswith(FUNCTION, at):
            return calls if not closed and FUNCTION.startswith(body[at:]) else None
        name_end = body.find(">", at)
        if name_end < 0:
            return None if closed else calls
        name = body[at + len(FUNCTION):name_end].strip()
        if not name or "\n" in name:
            return None
        read = _xml_arguments(body, name_end + 1, name, tools, closed)
        if read is None:
            return None
        calls.append((name, read[0]))
        if read[1] is None:
            return calls
        at = read[1]


def _json_end(text: str, start: int) -> int | None:
    """The end of the JSON object at text[start] (None: not written to its end yet)."""
    depth = 0
    for token in _JSON_TOKEN.finditer(text, start):
        if token.group() in "{[":
            depth += 1
        elif token.group() in "}]":
            depth -= 1
            if depth == 0:
                return token.end()
    return None


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _json_calls(body: str, closed: bool) -> list[tuple[str, str]] | None:
    head = _JSON_NAME.match(body)
    name = _json_or_none(head.group(1)) if head else None  # the name written first
    opened = _JSON_ARGUMENTS.match(body, head.end()) if head else None
    end = _json_end(body, opened.end()) if opened else None
    written = body[opened.end():end] if opened else None  # the arguments object's text, so far or whole
    if not closed:
        return [(name, written or "")] if isinstance(name, str) else []
    value = _json_or_none(body)
    if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
        return None
    if head is not None and name != value["name"]:
        return None  # (two names: the first was sent)
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # (some models write them as a JSON string)
        return [(value["name"], arguments)] if isinstance(_json_or_none(arguments), Mapping) else None
    if not isinstance(arguments, Mapping):
        return None
    if written is None:
        return [(value["name"], json.dumps(arguments, **_COMPACT))]
    return [(value["name"], written)] if end is not None and json.loads(written) == arguments else None


def _calls_in(body: str, form: str, tools, closed: bool) -> list[tuple[str, str]] | None:
    """(name, arguments) of each call in the text of a <tool_call> block. `closed`: the block is whole (None where
    it does not parse); else its text so far, each call's arguments as far as no later text can change them."""
    return _json_calls(body, closed) if form == "json" else _xml_calls(body, tools, closed)


class ToolCallStream:
    """split() for a reply arriving in pieces. feed() returns the content that is safe to send now and the tool-call
    deltas (OpenAI's: index, then id, type and name once, then arguments in pieces); from the first <tool_call> on,
    content is held until finish() returns it with the calls."""

    def __init__(self, form: str, tools):
        self._form, self._tools = form, tools
        self._text = ""  # the reply from the first <tool_call> on (before one: a tag's start or spaces, held back)
        self._holding = False
        self._at = 0  # where the text after the last whole block starts
        self._kept_from = 0  # where the content not yet in _kept starts
        self._kept: list[str] = []  # the content between the blocks that parsed
        self._sent: list[list[str]] = []  # per call index: its id, the arguments sent
        self._first = 0  # the index of the block being read's first call
        self._calls: list[dict] = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._text += text
        if self._holding:
            return "", self._read()
        # whitespace is held too: before a call it is not content (split() strips it)
        at = self._text.find(OPEN)
        ready = len(self._text[:len(self._text) - partial_tag_at_end(self._text, OPEN) if at < 0 else at].rstrip())
        out, self._text, self._holding = self._text[:ready], self._text[ready:], at >= 0
        return out, self._read() if at >= 0 else []

    def finish(self) -> tuple[str, list[dict]]:
        """The content held (the text outside the calls, stripped, where there are calls) and the calls."""
        if not self._calls:
            return self._text, []
        return "".join(self._kept + [self._text[self._kept_from:]]).strip(), self._calls

    def _read(self) -> list[dict]:
        deltas: list[dict] = []
        while True:
            start = self._text.find(OPEN, self._at)
            if start < 0:
                return deltas
            body = start + len(OPEN)
            end = self._text.find(CLOSE, body)
            if end < 0:
                written = self._text[body:]
                written = written[:len(written) - partial_tag_at_end(written, CLOSE)]
                return deltas + self._sending(_calls_in(written, self._form, self._tools, closed=False) or [])
            calls = _calls_in(self._text[body:end], self._form, self._tools, closed=True)
            if calls is not None:
                deltas += self._sending(calls)
                self._kept.append(self._text[self._kept_from:start])
                self._kept_from = end + len(CLOSE)
                self._calls += [{"id": self._sent[self._first + i][0], "type": "function",
                                 "function": {"name": name, "arguments": arguments}}
                                for i, (name, arguments) in enumerate(calls)]
            self._at, self._first = end + len(CLOSE), len(self._sent)

    def _sending(self, calls: list[tuple[str, str]]) -> list[dict]:
        """The deltas that bring the block's calls as sent up to `calls`."""
        deltas = []
        for i, (name, arguments) in enumerate(calls, self._first):
            if i == len(self._sent):
                self._sent.append([f"call_{uuid.uuid4().hex[:24]}", arguments])
                deltas.append({"index": i, "id": self._sent[i][0], "type": "function",
                               "function": {"name": name, "arguments": arguments}})
                continue
            sent = self._sent[i][1]
            if not arguments.startswith(sent):
                raise RuntimeError(f"tool call {i}: arguments {arguments!r} do not go on from those sent {sent!r}")
            if len(arguments) > len(sent):
                deltas.append({"index": i, "function": {"arguments": arguments[len(sent):]}})
                self._sent[i][1] = arguments
        return deltas


def split(text: str, form: str, tools) -> tuple[str, list[dict]]:
    """(content, tool calls) of a reply: the blocks that parse taken out of the text (the rest stripped)."""
    stream = ToolCallStream(form, tools)
    before, _ = stream.feed(text)
    rest, calls = stream.finish()
    return ((before + rest).strip() if calls else text), calls
