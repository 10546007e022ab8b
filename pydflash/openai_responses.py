"""OpenAI's Responses API (`POST /v1/responses`, `Model.create_response`), as llama-server serves it to Codex and
OpenAI's newer clients, over the chat pipeline (completions.start_chat): the request's instructions and input
items (messages, function_call, function_call_output, reasoning) read into a chat; the reply as output items
(reasoning, message, function_call) with status and usage; streamed as the Responses events (response.created,
per item output_item.added, its deltas and .done events, output_item.done, then response.completed or
response.incomplete), each with its sequence_number, output_index and content_index, a call's arguments in
function_call_arguments.delta pieces as the model writes them.

Read as llama-server reads it (llama.cpp's tools/server/server-chat.cpp): a message's text parts as text parts,
an assistant's items after one another (its text, reasoning and function calls) merged into one assistant
message, a function call output as the tool's reply; previous_response_id refused (nothing is stored). Where it
departs: a developer message is a system message (llama-server passes the role on, which Qwen's templates do
not know); tools other than functions, tool_choice "required" or a named function, and image or file inputs
are refused by name; reasoning.effort "none" or "minimal" turns the template's enable_thinking off, any other
effort on; a json_object or json_schema text format constrains the reply (pydflash/grammar.py)."""

from __future__ import annotations

import itertools
import time
import uuid
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from ._arguments import objects_arg, str_arg
from .chat_messages import function_tool
from .completions import ChatReply, start_chat

if TYPE_CHECKING:  # for the annotations only
    from .model import Model


def _parts(content: Any, where: str, kinds: tuple[str, ...]) -> list[dict]:
    """A message's content (a string, or parts of `kinds`) as chat text parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    for k, part in enumerate(objects_arg(where, content, "a string or a list of content parts (objects)")):
        if part.get("type") not in kinds:
            raise ValueError(f"{where}[{k}].type = {part.get('type')!r}, expected one of {', '.join(kinds)} (the "
                             f"models served read text)")
    return [{"type": "text", "text": str_arg(f"{where}[{k}].text", p.get("text"))} for k, p in enumerate(content)]


def _assistant(out: list[dict]) -> dict:
    """The assistant message an item goes into: the last message if it is one, else a new one."""
    if not out or out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": ""})
    return out[-1]


def _read_item(item: Mapping, where: str, out: list[dict]) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role == "assistant":
            message = _assistant(out)
            parts = _parts(item.get("content", ""), f"{where}.content", ("output_text", "input_text"))
            message["content"] = (message["content"] or []) + parts
        elif role in ("user", "system", "developer"):
            out.append({"role": "system" if role == "developer" else role,
                        "content": _parts(item.get("content"), f"{where}.content", ("input_text",))})
        else:
            raise ValueError(f"{where}.role = {role!r}, expected 'user', 'system', 'developer' or 'assistant'")
    elif kind == "function_call":
        _assistant(out).setdefault("tool_calls", []).append({
            "id": str_arg(f"{where}.call_id", item.get("call_id")), "type": "function",
            "function": {"name": str_arg(f"{where}.name", item.get("name")),
                         "arguments": str_arg(f"{where}.arguments", item.get("arguments"))}})
    elif kind == "function_call_output":
        output = item.get("output")
        text = "".join(p["text"] for p in _parts(output, f"{where}.output", ("input_text",)))
        out.append({"role": "tool", "tool_call_id": str_arg(f"{where}.call_id", item.get("call_id")), "content": text})
    elif kind == "reasoning":
        texts = item.get("content") or item.get("summary") or []
        _assistant(out)["reasoning_content"] = "".join(
            p["text"] for p in _parts(texts, f"{where}.content", ("reasoning_text", "summary_text")))
    else:
        raise ValueError(f"{where}.type = {kind!r}: expected a message, function_call, function_call_output or "
                         f"reasoning item")


def chat_messages(input: Any, instructions: Any = None) -> list[dict]:
    """The Responses input (a string, or items) and instructions as a chat's OpenAI-form messages."""
    out = [] if instructions is None else [{"role": "system", "content": str_arg("instructions", instructions)}]
    if isinstance(input, str):
        return out + [{"role": "user", "content": input}]
    for i, item in enumerate(objects_arg("input", input, "a string or a list of items (objects)")):
        _read_item(item, f"input[{i}]", out)
    return out


def chat_tools(tools: Any) -> list[dict] | None:
    """The Responses function tools (name, description, parameters at the top) as chat function tools."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(objects_arg("tools", tools, "a list of tools (objects)")):
        if tool.get("type") != "function":
            raise ValueError(f"tools[{i}].type = {tool.get('type')!r}: only function tools are served")
        out.append(function_tool(str_arg(f"tools[{i}].name", tool.get("name")), tool.get("description"),
                                 tool.get("parameters")))
    return out


def _chat_options(tool_choice: Any, text: Any, reasoning: Any) -> dict:
    """start_chat's tool_choice, the template variables reasoning sets and the response_format of the request's
    text format (json_object or json_schema: the reply constrained, pydflash/grammar.py)."""
    if tool_choice not in (None, "auto", "none"):
        raise ValueError(f"tool_choice = {tool_choice!r} is not supported ('auto' or 'none'): the model chooses "
                         f"whether to call a tool")
    form = text.get("format") if isinstance(text, Mapping) else None
    if text is not None and (not isinstance(form, Mapping) or form.get("type") not in ("text", "json_object",
                                                                                       "json_schema")):
        raise ValueError(f"text = {text!r}: expected a format of type text, json_object or json_schema")
    if form is not None and form["type"] == "json_schema" and not isinstance(form.get("schema"), Mapping):
        raise ValueError(f"text = {text!r}: a json_schema format needs its schema (an object)")
    response_format = None if form is None or form["type"] == "text" else \
        {"type": "json_object"} if form["type"] == "json_object" else \
        {"type": "json_schema", "json_schema": {"schema": form.get("schema")}}
    effort = reasoning.get("effort") if isinstance(reasoning, Mapping) else None
    if reasoning is not None and effort not in (None, "none", "minimal", "low", "medium", "high", "xhigh"):
        raise ValueError(f"reasoning = {reasoning!r}: expected an effort of none, minimal, low, medium, high or "
                         f"xhigh")
    kwargs = {} if effort is None else {"enable_thinking": effort not in ("none", "minimal")}
    return {"tool_choice": tool_choice, "kwargs": kwargs, "response_format": response_format}


def _usage(reply: ChatReply) -> dict:
    t, n = reply.completion.timings, len(reply.completion.tokens)
    prompt = t.get("prompt_n", 0) + t.get("cached_n", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": t.get("cached_n", 0)},
            "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + n}


def create_response(model: "Model", input, *, instructions, tools, tool_choice, text, reasoning,
                    max_output_tokens: int | None, stream: bool, chat_template_kwargs, template: str | None,
                    chat_format: str | None, speculative: bool, sampling: dict) -> dict | Iterator[dict]:
    """Model.create_response: the response, or its stream of events (each a dict whose "type" is the event's
    name); `sampling`: Model.generate's sampling keyword arguments."""
    if not isinstance(stream, bool):
        raise TypeError(f"stream must be a bool, got {type(stream).__name__}")
    options = _chat_options(tool_choice, text, reasoning)
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
    reply = start_chat(model, chat_messages(input, instructions), tools=chat_tools(tools),
                       tool_choice=options["tool_choice"], response_format=options["response_format"],
                       chat_template_kwargs={**options["kwargs"], **(chat_template_kwargs or {})}, template=template,
                       chat_format=chat_format, max_tokens=max_output_tokens, stop=None, speculative=speculative,
                       sampling=sampling)
    base = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "model": model.model_path, "instructions": instructions, "tools": tools or [],
            "tool_choice": tool_choice or "auto", "parallel_tool_calls": True, "error": None}
    if not stream:
        message, items = reply.message(), _Items()
        for delta in ({"reasoning_content": message.get("reasoning_content")}, {"content": message["content"]},
                      {"tool_calls": [{"index": i, **c} for i, c in enumerate(reply.calls)]}):
            list(items.read({k: v for k, v in delta.items() if v}))
        return {**base, **_ending(reply), "output": items.done_items(), "usage": _usage(reply),
                "timings": reply.completion.timings}
    return _events(reply, base)


def _ending(reply: ChatReply) -> dict:
    """status and incomplete_details: incomplete where max_output_tokens (or the context) cut the reply."""
    if reply.completion.finish_reason == "length" and not reply.calls:
        return {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    return {"status": "completed", "incomplete_details": None}


def _events(reply: ChatReply, base: dict) -> Iterator[dict]:
    items, number = _Items(), itertools.count()
    started = {**base, "status": "in_progress", "incomplete_details": None, "output": []}
    yield {"type": "response.created", "sequence_number": next(number), "response": started}
    yield {"type": "response.in_progress", "sequence_number": next(number), "response": started}
    for delta, _ in reply.deltas():
        for event in items.read(delta):
            yield {**event, "sequence_number": next(number)}
    for event in items.close():
        yield {**event, "sequence_number": next(number)}
    ending = _ending(reply)
    final = {**base, **ending, "output": items.done_items(), "usage": _usage(reply)}
    yield {"type": "response." + ending["status"], "sequence_number": next(number), "response": final,
           "timings": reply.completion.timings}


class _Items:
    """OpenAI chat deltas as Responses output items and their events: an item started where the delta's kind
    (reasoning, text, a tool call) changes, the one before it done."""

    def __init__(self):
        self.items: list[dict] = []  # every item, as it stands
        self.kind: str | int | None = None  # the open item's: "reasoning", "text" or a tool call's index

    def done_items(self) -> list[dict]:
        list(self.close())
        return self.items

    def _start(self, kind, item: dict) -> Iterator[dict]:
        yield from self.close()
        self.kind = kind
        self.items.append(item)
        yield {"type": "response.output_item.added", "output_index": len(self.items) - 1,
               "item": {**item, "status": "in_progress"}}

    def read(self, delta: dict) -> Iterator[dict]:
        if "reasoning_content" in delta:
            if self.kind != "reasoning":
                yield from self._start("reasoning", {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}",
                                                     "summary": [], "content": [{"type": "reasoning_text",
                                                                                 "text": ""}]})
            self.items[-1]["content"][0]["text"] += delta["reasoning_content"]
            yield {"type": "response.reasoning_text.delta", "item_id": self.items[-1]["id"],
                   "output_index": len(self.items) - 1, "content_index": 0, "delta": delta["reasoning_content"]}
        if "content" in delta:
            yield from self._text(delta["content"])
        for call in delta.get("tool_calls", ()):
            if "id" in call:  # (a call's first delta; the ones after it go on in its item)
                yield from self._start(call["index"], {"type": "function_call", "id": f"fc_{call['id']}",
                                                       "call_id": call["id"], "name": call["function"]["name"],
                                                       "arguments": ""})
            piece = call["function"].get("arguments", "")
            if piece:
                self.items[-1]["arguments"] += piece
                yield {"type": "response.function_call_arguments.delta", "item_id": self.items[-1]["id"],
                       "output_index": len(self.items) - 1, "delta": piece}

    def _text(self, piece: str) -> Iterator[dict]:
        if self.kind != "text":
            yield from self._start("text", {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant",
                                            "content": []})
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.items[-1]["content"].append(part)
            yield {"type": "response.content_part.added", "item_id": self.items[-1]["id"],
                   "output_index": len(self.items) - 1, "content_index": 0, "part": dict(part)}
        self.items[-1]["content"][0]["text"] += piece
        yield {"type": "response.output_text.delta", "item_id": self.items[-1]["id"],
               "output_index": len(self.items) - 1, "content_index": 0, "delta": piece, "logprobs": []}

    def close(self) -> Iterator[dict]:
        """The open item's .done events."""
        if self.kind is None:
            return
        item, at = self.items[-1], {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}
        if self.kind == "reasoning":
            yield {"type": "response.reasoning_text.done", **at, "content_index": 0,
                   "text": item["content"][0]["text"]}
        elif self.kind == "text":
            yield {"type": "response.output_text.done", **at, "content_index": 0,
                   "text": item["content"][0]["text"], "logprobs": []}
            yield {"type": "response.content_part.done", **at, "content_index": 0, "part": item["content"][0]}
        else:
            yield {"type": "response.function_call_arguments.done", **at, "arguments": item["arguments"]}
        item["status"] = "completed"
        self.kind = None
        yield {"type": "response.output_item.done", "output_index": len(self.items) - 1, "item": item}
