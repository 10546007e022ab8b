"""Anthropic's Messages API (pydflash/anthropic_messages.py, POST /v1/messages): requests read into a chat as
llama-server reads them (each block kind by hand), replies in Anthropic's shapes read back by the `anthropic`
client's own parser and stream accumulator, errors in its shape; the slow peer test puts the same request to
llama-server's /v1/messages over the same GGUF."""

from __future__ import annotations

import json
import re

import pytest

import pydflash
from pydflash import anthropic_messages as am

from export_pairs import pair_file
from test_tool_calls import TOOLS, _canned

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("fastapi")

WEATHER = [{"name": "get_weather", "description": "the weather in a city",
            "input_schema": TOOLS[0]["function"]["parameters"]}]


def test_messages_read_as_a_chat():
    header = "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;"
    system = [{"type": "text", "text": header}, {"type": "text", "text": "You are terse.", "cache_control": {}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "A tool.", "signature": "x"}, {"type": "redacted_thinking", "data": "z"},
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 2}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sun"},
                                                                          {"type": "text", "text": "ny"}]},
            {"type": "text", "text": "And"}, {"type": "text", "text": "Rome?"}]},
        {"role": "assistant", "content": []},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2"}]}]
    assert am.chat_messages(messages, system) == [
        {"role": "system", "content": "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; "
                                      "cch=fffff;You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."}], "reasoning_content": "A tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": [{"type": "text", "text": "And"}, {"type": "text", "text": "Rome?"}]},
        {"role": "tool", "tool_call_id": "toolu_2", "content": ""}]
    assert am.system_text("x-anthropic-billing-header: cch=123;") == "x-anthropic-billing-header: cch=123;"
    assert am.chat_tools(WEATHER) == [{"type": "function", "function": {
        "name": "get_weather", "description": "the weather in a city", "parameters": WEATHER[0]["input_schema"]}}]
    assert am.chat_tool_choice({"type": "none"}) == "none" and am.thinking_kwargs({"type": "disabled"}) == {
        "enable_thinking": False}


@pytest.mark.parametrize("call, error", [
    (lambda: am.chat_messages([{"role": "robot", "content": "hi"}]), "messages[0].role = 'robot'"),
    (lambda: am.chat_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {
        "type": "image", "source": {}}]}]), "messages[0].content[1]: a 'image' block"),
    (lambda: am.chat_messages([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image"}]}]}]), "messages[0].content[0].content[0]: a 'image' block"),
    (lambda: am.chat_messages([{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": 3}]}]),
     "messages[0].content[0].input: expected an object"),
    (lambda: am.chat_messages([{"role": "user", "content": 5}]), "messages[0].content: expected a string or a list"),
    (lambda: am.system_text([{"type": "image"}]), "system[0].type = 'image'"),
    (lambda: am.chat_tools([{"description": "no name"}]), "tools[0].name: expected a string"),
    (lambda: am.chat_tool_choice({"type": "any"}), "tool_choice = {'type': 'any'} is not supported"),
    (lambda: am.thinking_kwargs({"type": "sometimes"}), "thinking = {'type': 'sometimes'}"),
])
def test_bad_requests_name_the_field(call, error):
    with pytest.raises((ValueError, TypeError), match=re.escape(error)):
        call()


def _client(http) -> "anthropic.Anthropic":
    return anthropic.Anthropic(base_url=str(http.base_url), api_key="key", http_client=http, max_retries=0)


def test_the_server_answers_in_anthropics_shapes(qwen35_template):
    """A reply with thinking, text and a tool call: the message's content blocks, stop_reason tool_use; streamed,
    the anthropic client's accumulator builds the same message from the events (the call's input in several
    input_json_delta pieces); count_tokens is the prompt the same chat renders to."""
    from fastapi.testclient import TestClient

    from pydflash.server import create_app

    reply = ("Paris, so a tool.\n</think>\n\nOn it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
             "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
    request = dict(model="m", max_tokens=64, system="Be brief.", tools=WEATHER,
                   messages=[{"role": "user", "content": "Weather in Paris?"}])
    with pydflash.Model(pair_file("qwen3", "target", "f32"), n_ctx=512) as m:
        _canned(m, reply)
        with TestClient(create_app(m, chat_template=qwen35_template, api_key="key")) as http:
            client = _client(http)
            whole = client.messages.create(**request)
            assert [b.type for b in whole.content] == ["thinking", "text", "tool_use"]
            assert (whole.content[0].thinking, whole.content[1].text) == ("Paris, so a tool.", "On it.")
            assert (whole.content[2].name, whole.content[2].input) == ("get_weather", {"city": "Paris", "days": 2})
            assert (whole.stop_reason, whole.stop_sequence, whole.role) == ("tool_use", None, "assistant")
            with client.messages.stream(**request) as stream:
                events = list(stream)
                streamed = stream.get_final_message()
            assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [
                b.model_dump(exclude={"id"}) for b in whole.content]
            assert streamed.stop_reason == "tool_use" and streamed.usage.output_tokens == whole.usage.output_tokens
            assert sum(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events) > 2
            assert [e.type for e in events if e.type.startswith("content_block_") and e.type != "content_block_delta"
                    ] == ["content_block_start", "content_block_stop"] * 3
            counted = client.messages.count_tokens(**{k: v for k, v in request.items() if k != "max_tokens"})
            prompt = http.post("/apply-template", headers={"Authorization": "Bearer key"}, json={
                "messages": [{"role": "system", "content": "Be brief."}] + request["messages"],
                "tools": am.chat_tools(WEATHER)}).json()["prompt"]
            assert counted.input_tokens == len(m.tokenize(prompt, add_special=False, parse_special=True))


def test_errors_come_in_anthropics_shape(qwen35_template):
    from fastapi.testclient import TestClient

    from pydflash.server import create_app

    with pydflash.Model(pair_file("qwen3", "target", "f32"), n_ctx=512) as m:
        with TestClient(create_app(m, chat_template=qwen35_template, api_key="key")) as http:
            with pytest.raises(anthropic.AuthenticationError):
                anthropic.Anthropic(base_url=str(http.base_url), api_key="wrong", http_client=http,
                                    max_retries=0).messages.create(model="m", max_tokens=4, messages=[
                                        {"role": "user", "content": "hi"}])
            for body, says in (({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "'image' block"),
                               ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "no n"),
                               ({"messages": []}, "messages")):
                r = http.post("/v1/messages", headers={"x-api-key": "key"}, json={"max_tokens": 4, **body})
                assert r.status_code == 400 and r.json()["type"] == "error", r.text
                assert r.json()["error"]["type"] == "invalid_request_error" and says in r.json()["error"]["message"]
            r = http.post("/v1/messages/count_tokens", headers={"x-api-key": "key"}, json={"messages": [
                {"role": "user", "content": "hi"}], "tool_choice": {"type": "any"}})
            assert r.status_code == 400 and "tool_choice" in r.json()["error"]["message"], r.text


def test_a_generation_stops_as_anthropic_says(qwen35_template):
    """Greedy on the committed model: the text is the chat completion's for the same chat; max_tokens gives
    stop_reason max_tokens; a stop sequence met gives stop_sequence and names it; usage counts the tokens."""
    chat = [{"role": "user", "content": "def reverse_list(xs):\n    return"}]  # (the trained model writes code)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    with pydflash.Model(pair_file("qwen3", "target", "q8_0"), n_ctx=512) as m:
        openai_form = m.create_chat_completion(chat, chat_template=qwen35_template, temperature=0.0, max_tokens=12,
                                               **off)
        text = openai_form["choices"][0]["message"]["content"]
        message = m.create_message(chat, chat_template=qwen35_template, temperature=0.0, max_tokens=12, **off)
        assert [(b["type"], b["text"]) for b in message["content"]] == [("text", text)]
        assert (message["stop_reason"], message["stop_sequence"]) == ("max_tokens", None)
        assert message["usage"]["output_tokens"] == 12 == openai_form["usage"]["completion_tokens"]
        assert message["usage"]["input_tokens"] + message["usage"]["cache_read_input_tokens"] == \
            openai_form["usage"]["prompt_tokens"]
        word = text[len(text) // 2:len(text) // 2 + 3]
        assert word.strip() and text.index(word) > 0, text
        stopped = m.create_message(chat, chat_template=qwen35_template, temperature=0.0, max_tokens=12,
                                   stop_sequences=["@@", word], **off)
        assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", word)
        assert stopped["content"] == [{"type": "text", "text": text[:text.index(word)]}]
        events = list(m.create_message(chat, chat_template=qwen35_template, temperature=0.0, max_tokens=12,
                                       stream=True, **off))
        assert [e["type"] for e in events][:2] == ["message_start", "content_block_start"]
        assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == text
        assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
        assert events[-1] == {"type": "message_stop"}


@pytest.mark.slow
def test_messages_answer_as_llama_servers(tmp_path, llama_cpp_dir):
    """The same Anthropic request (system blocks with Claude Code's billing header, a tool call and its result)
    to llama-server's /v1/messages and ours over the same GGUF and template: llama-server's reading of it (the
    chat it logs at -lv 5) renders to the prompt ours renders to, and greedy, the same reply (but for the leading
    spaces llama-server strips)."""
    from test_peer import answers_beside_llama_server

    body = {"model": "m", "max_tokens": 16, "temperature": 0.0, "tools": WEATHER,
            "chat_template_kwargs": {"enable_thinking": False},
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=a5145;"},
                       {"type": "text", "text": "You write Python."}],
            "messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": [
                             {"type": "thinking", "thinking": "A tool.", "signature": ""},
                             {"type": "text", "text": "Looking."},
                             {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                       "content": [{"type": "text", "text": "sun"},
                                                                   {"type": "text", "text": "ny"}]}]},
                         {"role": "user", "content": [{"type": "text", "text": "def reverse_list(xs):"},
                                                      {"type": "text", "text": "    return"}]}]}
    ours_read = {"messages": am.chat_messages(body["messages"], body["system"]), "tools": am.chat_tools(WEATHER),
                 "chat_template_kwargs": body["chat_template_kwargs"]}
    def stripped(content):  # (llama-server's reading of Qwen3.5's replies strips their leading spaces, here a
        return [{**b, "text": b["text"].lstrip()} for b in content]  # line's indent; ours keeps the reply's text)

    for name, got, theirs in answers_beside_llama_server(tmp_path, llama_cpp_dir, "/v1/messages", body, ours_read):
        for key in ("stop_reason", "stop_sequence", "type", "role"):
            assert got[key] == theirs[key], (name, key, got[key], theirs[key])
        assert stripped(got["content"]) == stripped(theirs["content"]), name
        assert got["usage"] == {k: theirs["usage"][k] for k in got["usage"]}, name
