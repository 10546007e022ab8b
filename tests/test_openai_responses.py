"""OpenAI's Responses API (pydflash/openai_responses.py, POST /v1/responses): input items read into a chat as
llama-server reads them (each item kind by hand), replies read back by the `openai` client's own parser and its
Responses stream accumulator; the slow peer test puts the same request to llama-server's /v1/responses."""

from __future__ import annotations

import json
import re

import pytest

import pydflash
from pydflash import openai_responses as resp

from export_pairs import pair_file
from test_tool_calls import TOOLS, _canned

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

WEATHER = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
            "parameters": TOOLS[0]["function"]["parameters"]}]


def test_input_items_read_as_a_chat():
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in"},
                                                        {"type": "input_text", "text": "Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "A tool."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "sun"},
                                                                          {"type": "input_text", "text": "ny"}]},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_2", "output": "rain"}]
    assert resp.chat_messages(items, "Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": [{"type": "text", "text": "Use tools."}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."}], "reasoning_content": "A tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_2", "type": "function", "function": {
            "name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]
    assert resp.chat_messages("Hi") == [{"role": "user", "content": "Hi"}]
    assert resp.chat_tools(WEATHER) == [{"type": "function", "function": {
        "name": "get_weather", "description": "the weather in a city", "parameters": WEATHER[0]["parameters"]}}]


@pytest.mark.parametrize("call, error", [
    (lambda: resp.chat_messages([{"type": "item_reference", "id": "x"}]), "input[0].type = 'item_reference'"),
    (lambda: resp.chat_messages([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]),
     "input[0].content[0].type = 'input_image'"),
    (lambda: resp.chat_messages([{"role": "tool", "content": "x"}]), "input[0].role = 'tool'"),
    (lambda: resp.chat_messages([{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]),
     "input[0].arguments: expected a string"),
    (lambda: resp.chat_messages(5), "input: expected a string or a list"),
    (lambda: resp.chat_tools([{"type": "web_search"}]), "tools[0].type = 'web_search'"),
    (lambda: resp._chat_options("required", None, None), "tool_choice = 'required' is not supported"),
    (lambda: resp._chat_options(None, {"format": {"type": "json_schema"}}, None), "a json_schema format needs its"),
    (lambda: resp._chat_options(None, {"format": {"type": "xml"}}, None), "expected a format of type text, json"),
    (lambda: resp._chat_options(None, None, {"effort": "max"}), "reasoning = {'effort': 'max'}"),
])
def test_bad_requests_name_the_field(call, error):
    with pytest.raises((ValueError, TypeError), match=re.escape(error)):
        call()


def _what(item) -> tuple:
    """An output item's type, status and what it says (its ids aside)."""
    said = [c.text for c in item.content] if item.type in ("message", "reasoning") else (item.name, item.arguments)
    return item.type, item.status, said


def test_the_server_answers_in_the_responses_shapes(qwen35_template):
    """A reply with reasoning, text and a call: its output items; streamed, the openai client's accumulator builds
    the same response from the events (the arguments in several pieces); errors name the field."""
    from fastapi.testclient import TestClient

    from pydflash.server import create_app

    reply = ("Paris, so a tool.\n</think>\n\nOn it.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
             "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
    request = dict(model="m", input="Weather in Paris?", instructions="Be brief.", tools=WEATHER)
    with pydflash.Model(pair_file("qwen3", "target", "f32"), n_ctx=512) as m:
        _canned(m, reply)
        with TestClient(create_app(m, chat_template=qwen35_template)) as http:
            client = openai.OpenAI(base_url=f"{http.base_url}v1", api_key="k", http_client=http, max_retries=0)
            whole = client.responses.create(**request)
            assert [o.type for o in whole.output] == ["reasoning", "message", "function_call"]
            assert (whole.output[0].content[0].text, whole.output_text) == ("Paris, so a tool.", "On it.")
            call = whole.output[2]
            assert (call.name, json.loads(call.arguments), whole.status) == ("get_weather", {"city": "Paris",
                                                                                            "days": 2}, "completed")
            with client.responses.stream(**request) as stream:
                events = list(stream)
                streamed = stream.get_final_response()
            assert [_what(o) for o in streamed.output] == [_what(o) for o in whole.output]
            assert streamed.output_text == "On it." and streamed.usage.output_tokens == whole.usage.output_tokens
            assert sum(e.type == "response.function_call_arguments.delta" for e in events) > 2
            assert [e.sequence_number for e in events] == list(range(len(events)))
            for body, says in (({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
                               ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
                               ({"input": "hi", "tools": [{"type": "web_search"}]}, "web_search")):
                r = http.post("/v1/responses", json=body)
                assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_a_generation_ends_as_the_responses_api_says(qwen35_template):
    """Greedy on the committed model: the text is the chat completion's for the same chat; max_output_tokens
    gives status incomplete (reason max_output_tokens); streamed, the deltas join to the text."""
    chat = [{"role": "user", "content": "def reverse_list(xs):\n    return"}]  # (the trained model writes code)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    with pydflash.Model(pair_file("qwen3", "target", "q8_0"), n_ctx=512) as m:
        openai_form = m.create_chat_completion(chat, chat_template=qwen35_template, temperature=0.0, max_tokens=12,
                                               **off)
        text = openai_form["choices"][0]["message"]["content"]
        r = m.create_response(chat[0]["content"], chat_template=qwen35_template, temperature=0.0,
                              max_output_tokens=12, reasoning={"effort": "none"})
        assert [(o["type"], o["content"][0]["text"]) for o in r["output"]] == [("message", text)]
        assert (r["status"], r["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
        assert r["usage"]["output_tokens"] == 12 and r["usage"]["input_tokens"] == \
            openai_form["usage"]["prompt_tokens"]
        events = list(m.create_response(chat[0]["content"], chat_template=qwen35_template, temperature=0.0,
                                        max_output_tokens=12, stream=True, **off))
        assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == text
        assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["output"] == [
            {**r["output"][0], "id": events[-1]["response"]["output"][0]["id"]}]


@pytest.mark.slow
def test_responses_answer_as_llama_servers(tmp_path, llama_cpp_dir):
    """The same Responses request (instructions, a function call and its output) to llama-server's /v1/responses
    and ours over the same GGUF and template: llama-server's reading of it (the chat it logs at -lv 5) renders to
    the prompt ours renders to, and greedy, the same text."""
    from test_peer import answers_beside_llama_server

    body = {"model": "m", "max_output_tokens": 16, "temperature": 0.0, "tools": WEATHER, "instructions": "Be brief.",
            "chat_template_kwargs": {"enable_thinking": False},
            "input": [{"role": "user", "content": "Weather in Paris?"},
                      {"type": "message", "role": "assistant",
                       "content": [{"type": "output_text", "text": "Looking."}]},
                      {"type": "function_call", "call_id": "c1", "name": "get_weather",
                       "arguments": '{"city": "Paris"}'},
                      {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                      {"role": "user", "content": [{"type": "input_text", "text": "def reverse_list(xs):"}]}]}
    ours_read = {"messages": resp.chat_messages(body["input"], body["instructions"]),
                 "tools": resp.chat_tools(WEATHER), "chat_template_kwargs": body["chat_template_kwargs"]}
    def texts(r):  # (llama-server's reading of Qwen3.5's replies strips their leading spaces)
        return [p["text"].lstrip() for o in r["output"] if o["type"] == "message" for p in o["content"]]

    for name, got, theirs in answers_beside_llama_server(tmp_path, llama_cpp_dir, "/v1/responses", body,
                                                         ours_read):
        assert texts(got) == texts(theirs), name
        assert got["usage"]["output_tokens"] == theirs["usage"]["output_tokens"]


def test_a_json_text_format_constrains_the_reply(qwen35_template):
    """text.format json_schema (and json_object): the reply's text is JSON under the schema."""
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    with pydflash.Model(pair_file("qwen3", "target", "q8_0"), n_ctx=512) as m:
        r = m.create_response("Reply in JSON.", chat_template=qwen35_template, temperature=0.0, max_output_tokens=60,
                              reasoning={"effort": "none"},
                              text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
        assert r["status"] == "completed" and set(json.loads(r["output"][0]["content"][0]["text"])) == {"ok"}
        r = m.create_response("Reply in JSON.", chat_template=qwen35_template, temperature=0.0, max_output_tokens=4,
                              reasoning={"effort": "none"}, text={"format": {"type": "json_object"}})
        assert r["output"][0]["content"][0]["text"].lstrip().startswith("{")
