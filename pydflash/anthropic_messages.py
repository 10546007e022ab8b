"""Anthropic's Messages API (`POST /v1/messages`, `Model.create_message`), as llama-server serves it to Claude
Code and Anthropic's clients, over the chat pipeline (completions.start_chat): the request's system prompt,
messages (text, thinking, tool_use and tool_result blocks), tools, tool_choice, thinking and stop_sequences read
into a chat; the reply as content blocks (thinking, text, tool_use), with stop_reason, stop_sequence and usage;
streamed as Anthropic's events (message_start, content_block_start / _delta / _stop per block, message_delta,
message_stop), a tool call's input in input_json_delta pieces as the model writes it.

Where llama-server reads a field, it is read the same way (llama.cpp's tools/server/server-chat.cpp): system
blocks joined, a Claude Code billing header's per-request stamp (cch=) made constant so that a prompt cache keeps
the prefix, tool_result text joined, tool_use input as JSON that a template prints as its tojson prints it
(llama-server gives a template the object). Where it departs: a user message's blocks
keep their order (tool results, then text, as Claude Code sends them, come out as the tool replies and then the
user's words); tool_choice "any" or "tool", and image or document blocks, are refused by name (a chat completion
refuses them too) rather than passed on; thinking turns the template's enable_thinking on or off (its
budget_tokens is not enforced)."""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from ._arguments import objects_arg, str_arg
from .chat_messages import function_tool
from .completions import ChatReply, chat_prompt, start_chat, stopping_word

if TYPE_CHECKING:  # for the annotations only
    from .model import Model

BILLING_HEADER = "x-anthropic-billing-header:"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    """An error in Anthropic's shape, its type by the HTTP status."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def _constant_billing_stamp(text: str) -> str:
    """Claude Code's system prompt starts with a billing header whose cch=XXXXX; stamp changes with every request:
    made constant (llama-server's fffff), as nothing reads it here."""
    if not text.startswith(BILLING_HEADER):
        return text
    at = text.find("cch=", len(BILLING_HEADER)) + len("cch=")
    if at < len("cch=") or text[at + 5:at + 6] != ";":
        return text
    return text[:at] + "fffff" + text[at + 5:]



def _blocks(value: Any, where: str) -> list[Mapping]:
    return objects_arg(where, value, "a string or a list of content blocks (objects)")


def system_text(system: Any) -> str | None:
    """The system prompt: a string, or text blocks joined (as llama-server joins them)."""
    if system is None:
        return None
    if isinstance(system, str):
        return _constant_billing_stamp(system)
    parts = []
    for i, block in enumerate(_blocks(system, "system")):
        if block.get("type") != "text":
            raise ValueError(f"system[{i}].type = {block.get('type')!r}: a system prompt is text blocks")
        parts.append(_constant_billing_stamp(str_arg(f"system[{i}].text", block.get("text"))))
    return "".join(parts)


def _tool_result(block: Mapping, where: str) -> dict:
    """A tool_result block as the tool's reply (its text blocks joined)."""
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        texts = []
        for k, part in enumerate(_blocks(content, f"{where}.content")):
            if part.get("type") != "text":
                raise ValueError(f"{where}.content[{k}]: a {part.get('type')!r} block (the models served read text)")
            texts.append(str_arg(f"{where}.content[{k}].text", part.get("text")))
        text = "".join(texts)
    return {"role": "tool", "tool_call_id": str_arg(f"{where}.tool_use_id", block.get("tool_use_id", "")),
            "content": text}


def _tool_use(block: Mapping, where: str) -> dict:
    arguments = block.get("input", {})
    if not isinstance(arguments, Mapping):
        raise TypeError(f"{where}.input: expected an object, got {type(arguments).__name__}")
    return {"id": str_arg(f"{where}.id", block.get("id", "")), "type": "function",
            "function": {"name": str_arg(f"{where}.name", block.get("name")),
                         "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _user_messages(blocks: list[Mapping], where: str) -> list[dict]:
    """A user message's blocks in their order: runs of text as user messages, tool results as tool replies."""
    out: list[dict] = []
    for j, block in enumerate(blocks):
        kind, at = block.get("type"), f"{where}.content[{j}]"
        if kind == "text":
            part = {"type": "text", "text": str_arg(f"{at}.text", block.get("text"))}
            if out and out[-1]["role"] == "user":
                out[-1]["content"].append(part)
            else:
                out.append({"role": "user", "content": [part]})
        elif kind == "tool_result":
            out.append(_tool_result(block, at))
        else:
            raise ValueError(f"{at}: a {kind!r} block in a user message (text and tool_result are read: the models "
                             f"served read text)")
    return out


def _assistant_message(blocks: list[Mapping], where: str) -> list[dict]:
    """An assistant message's text, thinking (its reasoning_content) and tool_use blocks (its tool calls)."""
    texts, calls, reasoning = [], [], ""
    for j, block in enumerate(blocks):
        kind, at = block.get("type"), f"{where}.content[{j}]"
        if kind == "text":
            texts.append({"type": "text", "text": str_arg(f"{at}.text", block.get("text"))})
        elif kind == "thinking":
            reasoning += str_arg(f"{at}.thinking", block.get("thinking", ""))
        elif kind == "tool_use":
            calls.append(_tool_use(block, at))
        elif kind != "redacted_thinking":  # (encrypted by Anthropic's servers: nothing a model here can read)
            raise ValueError(f"{at}: a {kind!r} block in an assistant message (text, thinking and tool_use are read)")
    if not (texts or calls or reasoning):
        return []
    message: dict = {"role": "assistant", "content": texts or ""}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return [message]


def chat_messages(messages: Sequence[Any], system: Any = None) -> list[dict]:
    """Anthropic's messages (and system prompt) as a chat's OpenAI-form messages."""
    out = [{"role": "system", "content": text}] if (text := system_text(system)) is not None else []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}]: expected an object, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise ValueError(f"messages[{i}].role = {role!r}, expected 'user' or 'assistant'")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        blocks = _blocks(content, f"messages[{i}].content")
        out += (_user_messages if role == "user" else _assistant_message)(blocks, f"messages[{i}]")
    return out


def chat_tools(tools: Any) -> list[dict] | None:
    """Anthropic's tools (name, description, input_schema) as OpenAI's function tools."""
    if tools is None:
        return None
    return [function_tool(str_arg(f"tools[{i}].name", t.get("name")), t.get("description"), t.get("input_schema"))
            for i, t in enumerate(objects_arg("tools", tools, "a list of tools (objects)"))]


def chat_tool_choice(tool_choice: Any) -> str | None:
    if tool_choice is None:
        return None
    kind = tool_choice.get("type") if isinstance(tool_choice, Mapping) else None
    if kind not in ("auto", "none"):
        raise ValueError(f"tool_choice = {tool_choice!r} is not supported ({{'type': 'auto'}} or {{'type': "
                         f"'none'}}): the model chooses whether to call a tool")
    return kind


def thinking_kwargs(thinking: Any) -> dict:
    """The template variables `thinking` sets: enable_thinking on ("enabled", "adaptive") or off ("disabled")."""
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, Mapping) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise ValueError(f"thinking = {thinking!r}: expected type 'enabled', 'adaptive' or 'disabled'")
    return {"enable_thinking": kind != "disabled"}


def _chat(messages, system, tools, tool_choice, thinking, chat_template_kwargs) -> dict:
    """start_chat's and chat_prompt's arguments for a request (its chat_template_kwargs over thinking's)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise TypeError(f"messages: expected a list of messages, got {type(messages).__name__}")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
    return {"messages": chat_messages(messages, system), "tools": chat_tools(tools),
            "tool_choice": chat_tool_choice(tool_choice), "response_format": None,
            "chat_template_kwargs": {**thinking_kwargs(thinking), **(chat_template_kwargs or {})}}


def count_tokens(model: "Model", messages, *, system=None, tools=None, tool_choice=None, thinking=None,
                 chat_template_kwargs=None, chat_template: str | None = None, chat_format: str | None = None) -> dict:
    """POST /v1/messages/count_tokens: the prompt's tokens ({"input_tokens": n})."""
    chat = _chat(messages, system, tools, tool_choice, thinking, chat_template_kwargs)
    prompt, _, _ = chat_prompt(model, chat.pop("messages"), template=chat_template, chat_format=chat_format, **chat)
    return {"input_tokens": len(prompt)}


def _usage(reply: ChatReply) -> dict:
    """Anthropic's usage: input_tokens those the prompt evaluated, cache_read_input_tokens those reused."""
    t = reply.completion.timings
    return {"input_tokens": t.get("prompt_n", 0), "cache_read_input_tokens": t.get("cached_n", 0),
            "output_tokens": len(reply.completion.tokens)}


def _stop(model: "Model", reply: ChatReply, stop_sequences) -> dict:
    word = stopping_word(model, reply.completion, stop_sequences)
    reason = "tool_use" if reply.calls else "stop_sequence" if word else \
        "max_tokens" if reply.completion.finish_reason == "length" else "end_turn"
    return {"stop_reason": reason, "stop_sequence": word or None}


def _content(message: dict, calls: list[dict]) -> list[dict]:
    """An OpenAI assistant message's reasoning, text and calls as Anthropic's content blocks."""
    blocks = []
    if message.get("reasoning_content"):  # (no signature: nothing here signs a model's thinking)
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    return blocks + [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                      "input": json.loads(c["function"]["arguments"])} for c in calls]


def create_message(model: "Model", messages, *, system, tools, tool_choice, thinking, max_tokens: int | None,
                   stop_sequences, stream: bool, chat_template_kwargs, template: str | None,
                   chat_format: str | None, speculative: bool, sampling: dict) -> dict | Iterator[dict]:
    """Model.create_message: the answer (a "message"), or its stream of events (each a dict whose "type" is the
    event's name); `sampling`: Model.generate's sampling keyword arguments."""
    if not isinstance(stream, bool):
        raise TypeError(f"stream must be a bool, got {type(stream).__name__}")
    chat = _chat(messages, system, tools, tool_choice, thinking, chat_template_kwargs)
    reply = start_chat(model, chat.pop("messages"), template=template, chat_format=chat_format, max_tokens=max_tokens,
                       stop=stop_sequences, speculative=speculative, sampling=sampling, **chat)
    base = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model.model_path}
    if not stream:
        content = _content(reply.message(), reply.calls)
        return {**base, "content": content, **_stop(model, reply, stop_sequences), "usage": _usage(reply),
                "timings": reply.completion.timings}
    return _events(model, reply, base, stop_sequences)


def _events(model: "Model", reply: ChatReply, base: dict, stop_sequences) -> Iterator[dict]:
    yield {"type": "message_start", "message": {**base, "content": [], "stop_reason": None, "stop_sequence": None,
                                                "usage": {"input_tokens": reply.prompt_n, "output_tokens": 0}}}
    blocks = _BlockStream()
    for delta, _ in reply.deltas():
        yield from blocks.events(delta)
    yield from blocks.close()
    yield {"type": "message_delta", "delta": _stop(model, reply, stop_sequences), "usage": _usage(reply),
           "timings": reply.completion.timings}
    yield {"type": "message_stop"}


class _BlockStream:
    """OpenAI deltas as Anthropic's content-block events: a block started where the delta's kind (thinking,
    text, a tool call) changes, the one before it stopped."""

    def __init__(self):
        self.index = -1
        self.kind: str | None = None  # the open block's: "thinking", "text" or a tool call's index

    def _start(self, kind, block: dict) -> Iterator[dict]:
        yield from self.close()
        self.index, self.kind = self.index + 1, kind
        yield {"type": "content_block_start", "index": self.index, "content_block": block}

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def events(self, delta: dict) -> Iterator[dict]:
        if "reasoning_content" in delta:
            if self.kind != "thinking":
                yield from self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            yield self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if "content" in delta:
            if self.kind != "text":
                yield from self._start("text", {"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls", ()):
            if "id" in call:  # (a call's first delta; the ones after it go on in its block)
                yield from self._start(call["index"], {"type": "tool_use", "id": call["id"],
                                                       "name": call["function"]["name"], "input": {}})
            if call["function"].get("arguments"):
                yield self._delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]})

    def close(self) -> Iterator[dict]:
        if self.kind == "thinking":  # (Anthropic's clients expect a signature before a thinking block ends)
            yield self._delta({"type": "signature_delta", "signature": ""})
        if self.kind is not None:
            yield {"type": "content_block_stop", "index": self.index}
        self.kind = None
