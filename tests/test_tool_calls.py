"""Tool calls read out of a chat reply (pydflash/tool_calls.py), as llama-server returns them: each form Qwen
models write, typed by the tool's schema; a reply's calls, sent back in the next request as OpenAI's
assistant message, render to the very text the model wrote (the template is the oracle of the form)."""

from __future__ import annotations

import json

import pytest

import pydflash
from pydflash import tool_calls
from pydflash.chat import ChatTemplate
from pydflash.chat_messages import prepare
from pydflash.model import Completion, Pieces

from export_pairs import pair_file

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"},
                                               "units": {"type": ["string", "null"]},
                                               "where": {"type": "object"}}, "required": ["city"]}}}]


def _arguments(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_json_form_qwen3():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>')
    content, calls = tool_calls.split(text, "json", TOOLS)
    assert content == "Let me look."
    assert _arguments(calls) == [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    for broken in ('<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',  # bad JSON
                   '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',  # never closed
                   '<tool_call>\n["get_weather"]\n</tool_call>'):  # not a call
        assert tool_calls.split(broken, "json", TOOLS) == (broken, [])


def test_xml_form_typed_by_the_tools_schema():
    """Qwen3.5 / Qwen3-Coder: a string parameter is the text itself (even when it reads as JSON), an integer or
    object parameter JSON, a string-or-null one JSON where it reads as such, else the text."""
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=units>\nnull\n</parameter>\n<parameter=where>\n{\"lat\": 48.9}\n</parameter>\n"
            "</function>\n</tool_call>")
    content, calls = tool_calls.split(text, "xml", TOOLS)
    assert content is not None and content == ""
    assert _arguments(calls) == [("get_weather", {"city": "123", "days": 3, "units": None, "where": {"lat": 48.9}})]
    text = ("Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\nCity\n</parameter>\n"
            "<parameter=units>\nmetric\n</parameter>\n</function>\n<function=get_weather>\n<parameter=city>\nOslo\n"
            "</parameter>\n</function>\n</tool_call>")
    content, calls = tool_calls.split(text, "xml", TOOLS)
    assert content == "Checking."
    assert _arguments(calls) == [("get_weather", {"city": "New York\nCity", "units": "metric"}),
                                 ("get_weather", {"city": "Oslo"})]
    # an integer that is not one: its text (the caller's schema check names it; in the content it would be lost)
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>"
    assert _arguments(tool_calls.split(text, "xml", TOOLS)[1]) == [("get_weather", {"days": "three"})]
    for broken in ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
                   "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
                   "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>"):
        assert tool_calls.split(broken, "xml", TOOLS) == (broken, [])


def test_the_form_is_the_templates(llama_cpp_dir):
    templates = llama_cpp_dir / "models" / "templates"
    assert tool_calls.form_of((templates / "Qwen3.5-4B.jinja").read_text()) == "xml"
    assert tool_calls.form_of((templates / "Qwen3-Coder.jinja").read_text()) == "xml"
    assert tool_calls.form_of((templates / "Qwen-Qwen3-0.6B.jinja").read_text()) == "json"
    assert tool_calls.form_of("{{ messages[0]['content'] }}") is None


@pytest.mark.parametrize("name", ["Qwen3.5-4B.jinja", "Qwen-Qwen3-0.6B.jinja"])
def test_calls_sent_back_render_to_what_the_model_wrote(llama_cpp_dir, name):
    source = (llama_cpp_dir / "models" / "templates" / name).read_text()
    template = ChatTemplate(source)
    wrote = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]}
    user = [{"role": "user", "content": "The weather in Paris?"}]
    rendered = template.render(user + [wrote], add_generation_prompt=False)
    reply = rendered[rendered.index(tool_calls.OPEN):rendered.rindex(tool_calls.CLOSE) + len(tool_calls.CLOSE)]
    content, calls = tool_calls.split(reply, tool_calls.form_of(source), TOOLS)
    assert _arguments(calls) == [("get_weather", {"city": "Paris", "days": 2})]
    back = {"role": "assistant", "content": content or None, "tool_calls": calls}
    assert template.render(prepare(user + [back], template), add_generation_prompt=False) == rendered


def test_the_arguments_are_llama_servers():
    """JSON form: the arguments object's text as the model wrote it (so that a call sent back renders to it); as a
    JSON string, that string. XML form: one compact JSON object."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris",  "days": 2}}\n</tool_call>'
    assert [c["function"]["arguments"] for c in tool_calls.split(text, "json", TOOLS)[1]] == [
        '{"city":"Paris",  "days": 2}']
    text = '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>'
    assert [c["function"]["arguments"] for c in tool_calls.split(text, "json", TOOLS)[1]] == ['{"city":"Paris"}']
    text = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>'
    assert [c["function"]["arguments"] for c in tool_calls.split(text, "json", TOOLS)[1]] == ['{"city": "Rome"}']
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSão \"Paulo\"\n</parameter>\n<parameter=days>\n"
            "2\n</parameter>\n</function>\n</tool_call>")
    assert [c["function"]["arguments"] for c in tool_calls.split(text, "xml", TOOLS)[1]] == [
        '{"city":"São \\"Paulo\\"","days":2}']


def _stream(text: str, form: str, sizes) -> tuple[str, list[dict], list[dict]]:
    """The content sent, the tool-call deltas and the calls of `text` fed to a ToolCallStream in pieces of
    `sizes` (cycled)."""
    stream, sent, deltas, at, i = tool_calls.ToolCallStream(form, TOOLS), "", [], 0, 0
    while at < len(text):
        content, found = stream.feed(text[at:at + sizes[i % len(sizes)]])
        sent, deltas, at, i = sent + content, deltas + found, at + sizes[i % len(sizes)], i + 1
    rest, calls = stream.finish()
    return sent + rest, deltas, calls


def _joined(deltas: list[dict]) -> list[dict]:
    """Tool-call deltas joined as OpenAI's clients join them (by index: id, type and name once, arguments
    appended)."""
    calls: list[dict] = []
    for d in deltas:
        if d["index"] == len(calls):
            calls.append({"id": d["id"], "type": d["type"], "function": dict(d["function"])})
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return calls


REPLIES = [  # (form, reply)
    ("json", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"Nord\\"\\n", '
             '"where": {"lat": [48.9, {"x": "}"}]}, "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
             '"arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": '
             '"get_weather"}\n</tool_call>'),
    ("json", '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>\n<tool_call>\n'
             '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\ntrailing text'),
    ("xml", "Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</param City \\ \"é\"\n\n"
            "</parameter>\n<parameter=units>\nnull\n</parameter>\n<parameter=where>\n{\"lat\": 48.9}\n</parameter>\n"
            "</function>\n<function=get_weather>\n<parameter=city>\nOslo</parameter></function>\n</tool_call>\n"
            "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"),
    ("xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>\n<tool_call>"
            "\n<function=get_weather>\n<parameter=city>\n\nLyon\n\n</parameter>\n</function>\n</tool_call>"),
]


@pytest.mark.parametrize("form, reply", REPLIES)
def test_streamed_calls_join_to_the_whole_replys(form, reply):
    """Fed in pieces of any size, the deltas joined are split()'s calls (their ids the stream's), the content
    sent and held is split()'s; what a block that fails sent of its call before failing stays a call of its
    own."""
    content, calls = tool_calls.split(reply, form, TOOLS)
    assert calls
    for sizes in ([1], [2], [3, 1, 5], [7], [11, 2], [len(reply)]):
        sent, deltas, streamed = _stream(reply, form, sizes)
        assert streamed == [{k: v for k, v in c.items() if k != "id"} | {"id": s["id"]}
                            for c, s in zip(calls, streamed)]
        joined = [c for c in _joined(deltas) if c["id"] in {s["id"] for s in streamed}]
        assert joined == streamed and sent == content


def test_a_call_streams_as_it_is_written():
    """The name as soon as it is whole, then a string parameter's text as it comes, other values once whole;
    text that may be a closing tag's start is held back, and spaces that may come before a call."""
    stream = tool_calls.ToolCallStream("xml", TOOLS)
    assert stream.feed("Sure <b>.\n<tool_call>\n<function=get_wea") == ("Sure <b>.", [])
    content, deltas = stream.feed("ther>\n<parameter=days>\n1")
    assert content == "" and [(d["index"], d["type"], d["function"]) for d in deltas] == [
        (0, "function", {"name": "get_weather", "arguments": '{"days":'})]
    assert stream.feed("2\n</parameter>\n<parameter=city>\nNew")[1] == [
        {"index": 0, "function": {"arguments": '12,"city":"New'}}]
    assert stream.feed(" \"York\"\n</para")[1] == [{"index": 0, "function": {"arguments": ' \\"York\\"'}}]
    assert stream.feed("meter>\n</function>\n</tool_call>\nDone.")[1] == [
        {"index": 0, "function": {"arguments": '"}'}}]
    assert stream.finish() == ("Done.", [{"id": deltas[0]["id"], "type": "function", "function": {
        "name": "get_weather", "arguments": '{"days":12,"city":"New \\"York\\""}'}}])
    stream = tool_calls.ToolCallStream("json", TOOLS)
    assert stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')[1][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Pa'}
    assert stream.feed('ris"}}\n</tool_')[1] == [{"index": 0, "function": {"arguments": 'ris"}'}}]
    stream = tool_calls.ToolCallStream("xml", TOOLS)
    assert stream.feed("a <tool_") == ("a", []) and stream.finish() == (" <tool_", [])
    # a reply cut inside a call: what was sent of it stays sent; the block is content, as split() gives it
    stream = tool_calls.ToolCallStream("xml", TOOLS)
    reply = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPa</tool_"
    assert [d["function"]["arguments"] for d in stream.feed(reply)[1]] == ['{"city":"Pa']
    assert stream.finish() == (reply, []) and tool_calls.split(reply, "xml", TOOLS) == (reply, [])


def _canned(model, reply: str):
    """model.pieces answering `reply` (the tiny pairs never call a tool on their own)."""
    def pieces(prompt, max_tokens, **kwargs):
        def it():
            for i in range(0, len(reply), 5):
                yield reply[i:i + 5], None, []  # (text, logprobs, token steps)
            return {}
        timings = {"prompt_n": 4, "cached_n": 0, "prompt_ms": 1.0, "predicted_n": 3, "predicted_ms": 1.0,
                   "predicted_per_second": 3000.0}
        return Pieces(it(), lambda text, result: Completion(text, [1] * 3, "stop", timings))
    model.pieces = pieces


def test_chat_completion_returns_the_calls(llama_cpp_dir):
    """create_chat_completion with tools: message.tool_calls and finish_reason "tool_calls" (content None when
    the reply is only calls), streamed as tool_calls deltas; with tool_choice "none" or no tools the text."""
    source = (llama_cpp_dir / "models" / "templates" / "Qwen3.5-4B.jinja").read_text()
    reply = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with pydflash.Model(pair_file("qwen3", "target", "f32"), n_ctx=512) as m:
        _canned(m, reply)
        r = m.create_chat_completion(messages, tools=TOOLS, chat_template=source,
                                     chat_template_kwargs={"enable_thinking": False})
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert _arguments(choice["message"]["tool_calls"]) == [("get_weather", {"city": "Paris"})]
        chunks = list(m.create_chat_completion(messages, tools=TOOLS, chat_template=source, stream=True,
                                               chat_template_kwargs={"enable_thinking": False}))
        deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
        assert not any(d.get("content") for d in deltas)
        streamed = _joined([call for d in deltas for call in d.get("tool_calls", [])])
        assert _arguments(streamed) == [("get_weather", {"city": "Paris"})]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        for kwargs in (dict(tools=TOOLS, tool_choice="none"), dict()):
            r = m.create_chat_completion(messages, chat_template=source,
                                         chat_template_kwargs={"enable_thinking": False}, **kwargs)
            assert r["choices"][0]["message"]["content"] == reply and r["choices"][0]["finish_reason"] == "stop"
            assert "tool_calls" not in r["choices"][0]["message"]


def test_the_server_returns_the_calls_in_openais_shape(llama_cpp_dir):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from fastapi.testclient import TestClient
    from openai.lib.streaming.chat import ChatCompletionStreamState

    from pydflash.server import create_app

    source = (llama_cpp_dir / "models" / "templates" / "Qwen3.5-4B.jinja").read_text()
    reply = ("On it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
            "chat_template_kwargs": {"enable_thinking": False}}
    with pydflash.Model(pair_file("qwen3", "target", "f32"), n_ctx=512) as m:
        _canned(m, reply)
        with TestClient(create_app(m, chat_template=source)) as http:
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            # read as the openai client reads it
            parsed = openai.types.chat.ChatCompletion.model_validate(r.json())
            choice = parsed.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content == "On it."
            call = choice.message.tool_calls[0]
            assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather",
                                                                                  {"city": "Paris", "days": 2})
            # streamed, joined by the openai client's own accumulator: the same message, in more than one delta
            state = ChatCompletionStreamState()
            with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
                events = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            for event in events:
                state.handle_chunk(openai.types.chat.ChatCompletionChunk.model_validate(event))
            joined = state.get_final_completion().choices[0]
            assert joined.finish_reason == "tool_calls" and joined.message.content == "On it."
            assert [(c.function.name, c.function.arguments) for c in joined.message.tool_calls] == [
                (call.function.name, call.function.arguments)]
            assert sum("tool_calls" in e["choices"][0]["delta"] for e in events if e["choices"]) > 2
