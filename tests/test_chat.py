"""Chat templates render as Hugging Face `transformers` renders them (its own render_jinja_template, on the real
Qwen3 and Qwen3.5 templates shipped with llama.cpp's pinned sources), and replies split into reasoning and
content as llama-server splits them."""

from __future__ import annotations

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from pydflash.chat import ChatTemplate, ChatTemplateError, ReasoningStream, split_reasoning

TEMPLATES = ["Qwen-Qwen3-0.6B.jinja", "Qwen3.5-4B.jinja", "Qwen3-Coder.jinja"]

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}

CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is 2+2?"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Héllo, wörld ✓"}],
    "turns": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "A joke."}],
    "reasoning": [{"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
                  {"role": "user", "content": "Again"}],
    "tools": [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "",
               "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                "arguments": {"city": "Paris"}}}]},
              {"role": "tool", "content": "{\"temp_c\": 18}"},
              {"role": "user", "content": "And in Rome?"}],
}


@pytest.fixture(scope="module")
def template_source(llama_cpp_dir):
    return lambda name: (llama_cpp_dir / "models" / "templates" / name).read_text()


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}],
                         ids=["default", "thinking-off", "thinking-on"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers(template_source, name, conversation, kwargs, add_generation_prompt):
    source = template_source(name)
    messages = CONVERSATIONS[conversation]
    tools = [WEATHER_TOOL] if conversation == "tools" else None
    expected, _ = render_jinja_template([messages], tools=tools, chat_template=source,
                                        add_generation_prompt=add_generation_prompt, bos_token="",
                                        eos_token="<|im_end|>", **kwargs)
    got = ChatTemplate(source, eos_token="<|im_end|>").render(messages, tools=tools,
                                                               add_generation_prompt=add_generation_prompt, **kwargs)
    assert got == expected[0]


def test_thinking_off_closes_the_think_block_in_the_prompt(template_source):
    t = ChatTemplate(template_source("Qwen-Qwen3-0.6B.jinja"))
    off = t.render(CONVERSATIONS["user"], enable_thinking=False)
    on = t.render(CONVERSATIONS["user"])
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")


def test_template_errors_are_typed(template_source):
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% if %}")
    with pytest.raises(ChatTemplateError, match="empty chat template"):
        ChatTemplate("  ")
    # the template's own raise_exception (Qwen3.5 refuses a system message that is not first)
    t = ChatTemplate(template_source("Qwen3.5-4B.jinja"))
    with pytest.raises(ChatTemplateError, match="[Ss]ystem message"):
        t.render([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\] has no 'role'"):
        t.render([{"content": "a"}])
    with pytest.raises(ChatTemplateError, match="messages must be a list"):
        t.render("hello")


def test_templates_are_sandboxed():
    """A template cannot reach Python internals (the sandbox refuses attribute access to them) nor change
    the objects it is given."""
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set _ = messages.append(1) %}").render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("text, started, reasoning, content", [
    ("<think>\nAdd them.\n</think>\n\nFour.", False, "Add them.", "Four."),
    ("Four.", False, None, "Four."),
    ("<think>\n\n</think>\n\nFour.", False, "", "Four."),  # thinking turned off by the template
    ("Add them.\n</think>\n\nFour.", True, "Add them.", "Four."),  # the prompt opened the block
    ("<think>\nStill thinking", False, "Still thinking", ""),  # stopped inside the block
    ("  <think>x</think>y", False, "x", "y"),
])
def test_split_reasoning(text, started, reasoning, content):
    r = split_reasoning(text, started=started)
    assert (r.reasoning_content, r.content) == (reasoning, content)


@pytest.mark.parametrize("text, started", [
    ("<think>\nAdd them.\n</think>\n\nFour.", False), ("Four.", False), ("<think>\n\n</think>\n\nFour.", False),
    ("Add them.\n</think>\n\nFour.", True), ("<think>\nStill thinking  ", False), ("  <think>x</think>y", False),
    ("  plain", False), ("<thin", False), ("a </thin", True)])
@pytest.mark.parametrize("cut", [1, 2, 3, 7])
def test_reasoning_stream_equals_the_whole_split(text, started, cut):
    """Fed in pieces of every size, the stream gives what split_reasoning gives for the whole text."""
    stream = ReasoningStream(started=started)
    parts: dict[str, str] = {"reasoning_content": "", "content": ""}
    for i in range(0, len(text), cut):
        for field, piece in stream.feed(text[i:i + cut]):
            parts[field] += piece
    for field, piece in stream.flush():
        parts[field] += piece
    whole = split_reasoning(text, started=started)
    assert parts["reasoning_content"] == (whole.reasoning_content or "")
    assert parts["content"] == whole.content
