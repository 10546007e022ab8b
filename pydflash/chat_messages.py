"""OpenAI chat messages in the form a model's chat template takes them, as llama-server prepares them
(common/chat.cpp: common_chat_msgs_parse_oaicompat and the template workarounds):

- content given as a list of parts: text parts only (another part, an image say, is refused: these models read
  text); for a template that renders only string content, the texts joined with newlines; for one that renders
  only typed parts, a string becomes one text part;
- content null (an assistant message that only calls tools): the empty string;
- tool-call arguments given as a JSON string (OpenAI's form): parsed into an object for a template that reads
  them as one (Qwen3.5's iterates their items), left a string for one that prints the string (Qwen3's).

What a template renders is found once per template by rendering small probe conversations, as llama.cpp's
template capabilities are (common/jinja/caps.cpp)."""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from .chat import ChatTemplate, ChatTemplateError

_NEEDLE = "pydflash-probe-7f3a"
# TemplateNeeds by template text: a server renders every chat with one or two templates
_known: dict[str, "TemplateNeeds"] = {}


def _renders(template: ChatTemplate, messages: list[dict], tools: list[dict] | None = None) -> str | None:
    try:
        return template.render(messages, tools=tools, add_generation_prompt=False)
    except ChatTemplateError:  # (a template that cannot take the form probed)
        return None


class TemplateNeeds:
    """What a chat template renders: string content, typed content parts, tool-call arguments as strings."""

    def __init__(self, template: ChatTemplate):
        def shown(messages, tools=None) -> bool:
            text = _renders(template, messages, tools)
            return text is not None and _NEEDLE in text

        self.string_content = shown([{"role": "user", "content": _NEEDLE}])
        self.typed_content = shown([{"role": "user", "content": [{"type": "text", "text": _NEEDLE}]}])
        tool = {"type": "function", "function": {"name": "probe", "description": "", "parameters": {
            "type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]}}}
        call = {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
            "name": "probe", "arguments": json.dumps({"arg": _NEEDLE})}}]}
        self.string_arguments = shown([{"role": "user", "content": "hi"}, call], [tool])


def _content(content: Any, where: str, needs: TemplateNeeds) -> Any:
    if content is None:
        return ""
    if isinstance(content, str):
        if needs.typed_content and not needs.string_content:
            return [{"type": "text", "text": content}]
        return content
    if not isinstance(content, Sequence):
        raise ValueError(f"{where}.content must be a string, a list of parts or null, got {type(content).__name__}")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text":
            if kind in ("image_url", "input_image", "image", "input_audio", "audio", "file"):
                raise ValueError(f"{where}.content[{i}] is {kind} input, which is not supported: this model reads "
                                 f"text only")
            raise ValueError(f"{where}.content[{i}]: expected a part of type 'text', got {part!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.content[{i}].text must be a string, got {part.get('text')!r}")
        texts.append(part["text"])
    if needs.string_content and not needs.typed_content:
        return "\n".join(texts)
    return [{"type": "text", "text": t} for t in texts]


def _tool_calls(calls: Any, where: str, needs: TemplateNeeds) -> Any:
    if needs.string_arguments or not isinstance(calls, Sequence):
        return calls
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        arguments = function.get("arguments") if isinstance(function, Mapping) else None
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}.tool_calls[{i}].function.arguments is not JSON ({e.msg} at character "
                                 f"{e.pos})") from None
            call = {**call, "function": {**function, "arguments": parsed}}
        out.append(call)
    return out


def needs_of(template: ChatTemplate) -> TemplateNeeds:
    if template.source not in _known:
        if len(_known) >= 64:
            _known.clear()
        _known[template.source] = TemplateNeeds(template)
    return _known[template.source]


def prepare(messages: Sequence[Mapping[str, Any]], template: ChatTemplate) -> list[dict]:
    """`messages` as `template` takes them (a ValueError naming the message and field where one cannot be)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages is empty: a chat needs at least one message")
    needs = needs_of(template)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        m = dict(m)
        if "content" in m:
            m["content"] = _content(m["content"], f"messages[{i}]", needs)
        if "tool_calls" in m:
            m["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{i}]", needs)
        out.append(m)
    return out


def function_tool(name: str, description: Any, parameters: Any) -> dict:
    """A tool in OpenAI's chat form (what templates render), from another API's fields."""
    return {"type": "function", "function": {"name": name, "description": description or "",
                                             "parameters": parameters or {}}}
