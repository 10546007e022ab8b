"""OpenAI-shaped completions over a `Model` (llama-cpp-python's `create_completion` / `create_chat_completion`):
the result dicts and stream chunks, with `usage`, and `timings` in llama-server's names plus the draft stats.

Chat prompts come from the GGUF's chat template (pydflash.chat), rendered as Hugging Face renders them; the
reply's `<think>` block is returned as `reasoning_content`, apart from `content`, as llama-server does.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Iterator, Mapping, Sequence

from . import tool_calls
from ._arguments import bool_arg, optional_int_arg
from .chat import ChatTemplate, ChatTemplateError, ReasoningStream, split_reasoning
from .chat_messages import prepare
from .grammar import response_format_grammar

if TYPE_CHECKING:  # for the annotations only: model.py imports this module
    from .model import Completion, Model

# chat_format names with a built-in template (llama-cpp-python's names)
CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
          "{%- endif %}")
CHAT_FORMATS = {"chatml": CHATML}


def _usage(completion: "Completion") -> dict:
    """OpenAI's usage: the prompt's tokens (of them, those reused from the session's cache in
    prompt_tokens_details.cached_tokens, as OpenAI and llama-server report them) and the completion's."""
    t = completion.timings
    cached = t.get("cached_n", 0)
    prompt = t.get("prompt_n", 0) + cached
    return {"prompt_tokens": prompt, "completion_tokens": len(completion.tokens),
            "total_tokens": prompt + len(completion.tokens), "prompt_tokens_details": {"cached_tokens": cached}}


def stopping_word(model: "Model", completion: "Completion", stop) -> str:
    """The stop string (of `stop`: a string or a list of them) the generation ended on; "" where it ended
    otherwise (the end-of-generation token, max_tokens)."""
    if completion.finish_reason != "stop" or not stop:
        return ""
    rest = model.detokenize(completion.tokens)[len(completion.text):]  # what the text was cut at
    return next((s for s in ([stop] if isinstance(stop, str) else stop) if s and rest.startswith(s)), "")


def _include_usage(stream_options: Mapping | None) -> bool:
    if stream_options is None:
        return False
    if not isinstance(stream_options, Mapping):
        raise TypeError(f"stream_options must be a dict, got {type(stream_options).__name__}")
    return bool_arg("stream_options.include_usage", stream_options.get("include_usage", False))


def create_completion(model: "Model", prompt, *, max_tokens: int | None, echo: bool, stop, stream: bool,
                      stream_options, speculative: bool, sampling: dict, echoed=None) -> dict | Iterator[dict]:
    """Model.create_completion; `sampling`: Model.generate's sampling keyword arguments; `echoed`: the prompt
    echo puts first, where it is not `prompt` (a fill-in-the-middle prompt's own prompt)."""
    bool_arg("echo", echo)
    bool_arg("stream", stream)
    with_usage = _include_usage(stream_options)
    base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model.model_path}
    echoed = prompt if echoed is None else echoed
    prefix = (echoed if isinstance(echoed, str) else model.detokenize(echoed)) if echo else ""
    pieces = model.pieces(prompt, max_tokens, stop=stop, speculative=speculative, **sampling)

    def choice(text: str, lp: dict | None, finish: str | None) -> dict:
        if lp is not None and prefix:  # offsets into the text returned, which begins with the prompt
            lp = {**lp, "text_offset": [len(prefix) + k for k in lp["text_offset"]]}
        return {"text": text, "index": 0, "logprobs": lp, "finish_reason": finish}

    if not stream:
        text = prefix + "".join(p for p, _ in pieces)
        c = pieces.completion
        return {**base, "choices": [choice(text, c.logprobs, c.finish_reason)], "usage": _usage(c),
                "timings": c.timings}

    def chunks() -> Iterator[dict]:
        if prefix:
            yield {**base, "choices": [choice(prefix, None, None)]}
        for text, lp in pieces:
            yield {**base, "choices": [choice(text, lp, None)]}
        c = pieces.completion
        yield {**base, "choices": [choice("", None, c.finish_reason)], "timings": c.timings}
        if with_usage:
            yield {**base, "choices": [], "usage": _usage(c)}

    return chunks()


def check_chat_format(name, option: str = "chat_format") -> str:
    """`name` if it names a built-in template (CHAT_FORMATS), else ValueError naming it and the names there are."""
    if name not in CHAT_FORMATS:
        raise ValueError(f"{option}={name!r} is not one of {', '.join(sorted(CHAT_FORMATS))}")
    return name


def chat_template(model: "Model", template: str | None, chat_format: str | None) -> ChatTemplate:
    """The template to render with: an explicit `template`, a named `chat_format`, or the GGUF's own."""
    tok = model.tokenizer
    def text_of(token: int | None) -> str:
        return "" if token is None else tok.token_bytes(token).decode("utf-8", errors="replace")

    specials = {"bos_token": text_of(tok.bos_token_id), "eos_token": text_of(tok.eos_token_id)}
    if template is not None and chat_format is not None:
        raise ValueError("give chat_template or chat_format, not both")
    if chat_format is not None:
        check_chat_format(chat_format)
        return ChatTemplate(CHAT_FORMATS[chat_format], name=f"chat_format {chat_format}", **specials)
    if template is not None:
        if not isinstance(template, str):
            raise TypeError(f"chat_template must be a string, got {type(template).__name__}")
        return ChatTemplate(template, name="chat_template", **specials)
    if not tok.chat_template:
        raise ChatTemplateError(f"{model.model_path}: the model has no tokenizer.chat_template; pass "
                                f"chat_template= or chat_format=")
    return ChatTemplate(tok.chat_template, name=f"{model.model_path}: tokenizer.chat_template", **specials)


def _check_chat_options(tools, tool_choice, chat_template_kwargs) -> None:
    if tools is not None and (isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence)):
        raise TypeError(f"tools must be a list of tool schemas, got {type(tools).__name__}")
    if tool_choice not in (None, "auto", "none"):
        raise ValueError(f"tool_choice={tool_choice!r} is not supported (None, 'auto' or 'none'): the model chooses "
                         f"whether to call a tool")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
    for key in chat_template_kwargs or {}:
        if not isinstance(key, str) or key in ("messages", "tools", "add_generation_prompt"):
            raise ValueError(f"chat_template_kwargs[{key!r}]: expected a template variable's name other than "
                             f"messages, tools and add_generation_prompt (the call's own)")


def _chat_logprobs(lp: dict | None) -> dict | None:
    """OpenAI's chat shape (content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]) from
    the completion shape (Completion.logprobs)."""
    if lp is None:
        return None

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(t, v), "top_logprobs": [entry(a, av) for a, av in top.items()]}
                        for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]}


class ChatReply:
    """A chat reply being generated (start_chat), read as llama-server reads it: reasoning_content, content and
    tool calls, whole (message()) or as OpenAI deltas (deltas()); then `calls`, `completion` and
    finish_reason()."""

    def __init__(self, pieces, started: bool, calls_form: str | None, tools, prompt_n: int):
        self.pieces, self.prompt_n = pieces, prompt_n
        self._started, self._calls_form, self._tools = started, calls_form, tools
        self.calls: list[dict] = []  # the tool calls (whole), once read

    @property
    def completion(self) -> "Completion":
        return self.pieces.completion

    def finish_reason(self) -> str:
        return "tool_calls" if self.calls else self.completion.finish_reason

    def message(self) -> dict:
        """The whole reply as OpenAI's assistant message (content None where the reply is only calls)."""
        split = split_reasoning("".join(p for p, _ in self.pieces), started=self._started)
        content = split.content
        if self._calls_form:
            content, self.calls = tool_calls.split(content, self._calls_form, self._tools)
        message = {"role": "assistant", "content": content or (None if self.calls else content)}
        if split.reasoning_content is not None:
            message["reasoning_content"] = split.reasoning_content
        if self.calls:
            message["tool_calls"] = self.calls
        return message

    def deltas(self) -> Iterator[tuple[dict, dict | None]]:
        """(delta, logprobs) as the reply is made: OpenAI's deltas (reasoning_content, content, a tool call's
        pieces), a piece's logprobs (completion shape) with its first delta, or with {} where it adds none yet."""
        reasoning = ReasoningStream(started=self._started)
        calls = tool_calls.ToolCallStream(self._calls_form, self._tools) if self._calls_form else None

        def read(fields) -> list[dict]:
            out = []
            for field, text in fields:
                found = []
                if calls and field == "content":  # (content held from a tool call's start on)
                    text, found = calls.feed(text)
                if text:
                    out.append({field: text})
                out += [{"tool_calls": [call]} for call in found]
            return out

        for piece, lp in self.pieces:
            ready = read(reasoning.feed(piece))
            if not ready and lp is not None:
                yield {}, lp
            for i, delta in enumerate(ready):
                yield delta, lp if i == 0 else None
        for delta in read(reasoning.flush()):
            yield delta, None
        if calls:
            content, self.calls = calls.finish()
            if content:
                yield {"content": content}, None


def start_chat(model: "Model", messages, *, tools, tool_choice, response_format, chat_template_kwargs,
               template: str | None, chat_format: str | None, max_tokens: int | None, stop, speculative: bool,
               sampling: dict) -> ChatReply:
    """The chat's prompt (chat_prompt) and its generation started; `sampling`: Model.generate's sampling keyword
    arguments (a grammar among them), response_format's grammar (pydflash/grammar.py) over the whole reply."""
    grammar = response_format_grammar(response_format)
    if grammar is not None and sampling.get("grammar") is not None:
        raise ValueError("response_format and grammar both constrain the reply: give one of them")
    prompt, text, calls_form = chat_prompt(model, messages, tools=tools, tool_choice=tool_choice,
                                           response_format=response_format,
                                           chat_template_kwargs=chat_template_kwargs, template=template,
                                           chat_format=chat_format)
    # a template may open the reasoning block itself (the reply then starts inside it)
    started = text.rstrip().endswith("<think>")
    if started and (grammar is not None or sampling.get("grammar") is not None):
        raise ValueError("response_format / grammar constrain the whole reply, which this template starts inside a "
                         "<think> block: turn thinking off (chat_template_kwargs={'enable_thinking': False})")
    if grammar is not None:
        sampling = {**sampling, "grammar": grammar}
    pieces = model.pieces(prompt, max_tokens, stop=stop, speculative=speculative, **sampling)
    return ChatReply(pieces, started, calls_form, tools if calls_form else None, len(prompt))


def chat_prompt(model: "Model", messages, *, tools, tool_choice, response_format, chat_template_kwargs,
                template: str | None, chat_format: str | None) -> tuple[list[int], str, str | None]:
    """(prompt tokens, prompt text, the form the reply's tool calls are read in: None where no tools are offered)
    of a chat, rendered with the template."""
    _check_chat_options(tools, tool_choice, chat_template_kwargs)
    rendering = chat_template(model, template, chat_format)
    tools = None if tool_choice == "none" else tools
    text = rendering.render(prepare(messages, rendering), tools=tools, add_generation_prompt=True,
                            **(chat_template_kwargs or {}))
    calls_form = tool_calls.form_of(rendering.source) if tools else None
    return model._prompt_tokens(text, add_special=False, parse_special=True), text, calls_form


def create_chat_completion(model: "Model", messages, *, tools, tool_choice, response_format, chat_template_kwargs,
                           template: str | None, chat_format: str | None, max_tokens: int | None, stop,
                           stream: bool, stream_options, logprobs: bool, top_logprobs: int | None,
                           speculative: bool, sampling: dict) -> dict | Iterator[dict]:
    """Model.create_chat_completion; `sampling`: Model.generate's sampling keyword arguments."""
    bool_arg("stream", stream)
    # None: OpenAI's and llama-cpp-python's default
    logprobs = bool_arg("logprobs", False if logprobs is None else logprobs)
    top_logprobs = optional_int_arg("top_logprobs", top_logprobs, 0, 20)
    with_usage = _include_usage(stream_options)
    reply = start_chat(model, messages, tools=tools, tool_choice=tool_choice, response_format=response_format,
                       chat_template_kwargs=chat_template_kwargs, template=template, chat_format=chat_format,
                       max_tokens=max_tokens, stop=stop, speculative=speculative,
                       sampling={**sampling, "logprobs": (top_logprobs or 0) if logprobs else None})
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model.model_path}

    if not stream:
        message = reply.message()
        c = reply.completion
        return {**base, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "logprobs": _chat_logprobs(c.logprobs),
                             "finish_reason": reply.finish_reason()}],
                "usage": _usage(c), "timings": c.timings}

    def chunk(delta: dict, finish: str | None = None, lp: dict | None = None) -> dict:
        return {**base, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

    def chunks() -> Iterator[dict]:
        yield chunk({"role": "assistant"})
        for delta, lp in reply.deltas():
            yield chunk(delta, lp=_chat_logprobs(lp))
        c = reply.completion
        yield {**chunk({}, reply.finish_reason()), "timings": c.timings}
        if with_usage:
            yield {**base, "object": "chat.completion.chunk", "choices": [], "usage": _usage(c)}

    return chunks()
