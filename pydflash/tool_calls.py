"""Tool calls in a chat reply, as llama-server returns them (message.tool_calls, finish_reason "tool_calls"), for
the two forms Qwen models write:

- JSON (Qwen3's template, Hermes style): <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
- XML (Qwen3.5's and Qwen3-Coder's): <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
  </function>\\n</tool_call>; a value is JSON where the tool's schema does not allow a string (a number, an
  object...), the text itself where it allows only strings, and for a mixed type JSON if it reads as one, else
  the text (llama.cpp's common/parsers/qwen3-coder.cpp).

The form is the template's: one that writes <function= and <parameter= inside <tool_call> is XML, another with
<tool_call> JSON. A block that does not parse (unclosed, bad JSON) stays in the content, as text."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Mapping, Sequence

from .chat import partial_tag_at_end

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def form_of(template_source: str) -> str | None:
    """"xml", "json" or None (a template that writes no tool calls)."""
    if OPEN not in template_source:
        return None
    return "xml" if "<function=" in template_source and "<parameter=" in template_source else "json"


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
        if types and "string" not in types:
            raise
        return text
    return text if isinstance(value, str) and "string" in types else value


def _call(name: str, arguments: Mapping[str, Any]) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _parse_block(body: str, form: str, tools) -> list[dict] | None:
    """The calls in one <tool_call> block, or None where it does not parse."""
    if form == "json":
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # (some models write them as a JSON string)
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        return [_call(value["name"], arguments)] if isinstance(arguments, Mapping) else None
    calls, at = [], 0
    while at < len(body):
        m = _FUNCTION.match(body, at)
        if m is None:
            return None
        name = m.group(1).strip()
        try:
            arguments = {key.strip(): _xml_value(value, _types(tools, name, key.strip()))
                         for key, value in _PARAMETER.findall(m.group(2))}
        except json.JSONDecodeError:
            return None
        calls.append(_call(name, arguments))
        at = m.end()
    return calls or None


def split(text: str, form: str, tools) -> tuple[str, list[dict]]:
    """(content, tool calls) of a reply: the blocks that parse taken out of the text (the rest stripped)."""
    calls, kept, at = [], [], 0
    for m in _BLOCK.finditer(text):
        parsed = _parse_block(m.group(1).strip(), form, tools)
        if parsed is not None:
            kept.append(text[at:m.start()])
            calls += parsed
            at = m.end()
    kept.append(text[at:])
    return ("".join(kept).strip() if calls else text), calls


class ToolCallStream:
    """split() for a reply arriving in pieces: feed() returns the content that is safe to send now; from the first
    <tool_call> on, everything is held until finish() returns (the rest of the content, the calls)."""

    def __init__(self, form: str, tools):
        self._form, self._tools = form, tools
        self._held = ""
        self._holding = False

    def feed(self, text: str) -> str:
        self._held += text
        if not self._holding:
            at = self._held.find(OPEN)
            if at >= 0:
                out, self._held, self._holding = self._held[:at], self._held[at:], True
                return out
            keep = partial_tag_at_end(self._held, OPEN)
            out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
            return out
        return ""

    def finish(self) -> tuple[str, list[dict]]:
        if not self._holding:
            return self._held, []
        return split(self._held, self._form, self._tools)
