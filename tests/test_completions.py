"""The OpenAI-shaped calls (llama-cpp-python's create_completion / create_chat_completion) on a committed pair
with its drafter: what they return equals what generate() gives for the same prompt and seed, streamed or not,
with usage and timings; unsupported options are refused by name."""

from __future__ import annotations

import pytest

import pydflash
from pydflash.chat import ChatTemplate, split_reasoning
from pydflash.errors import ContextLengthExceededError

from export_pairs import pair_file

MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A parser, please."}]


@pytest.fixture(scope="module")
def model():
    # chain: bit-reproducible (auto chooses verify widths from measured timings, so its logits may differ in the
    # last bits between calls: tests/test_determinism.py)
    with pydflash.Model(pair_file("qwen3", "target", "f32"), n_ctx=1024, spec_mode="chain",
                        draft_model_path=pair_file("qwen3", "dflash", "f32")) as m:
        yield m


def test_chat_completion_is_generate_on_the_rendered_template(model):
    r = model.create_chat_completion(MESSAGES, max_tokens=24, seed=4, temperature=0.7)
    text = ChatTemplate(model.tokenizer.chat_template).render(MESSAGES)
    prompt = model.tokenize(text, add_special=False, parse_special=True)
    c = model.generate(prompt, max_tokens=24, seed=4, temperature=0.7, top_k=40, top_p=0.95, min_p=0.05)
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    choice = r["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == split_reasoning(c.text).content
    assert choice["finish_reason"] == c.finish_reason
    assert r["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(c.tokens),
                          "total_tokens": len(prompt) + len(c.tokens),
                          "prompt_tokens_details": {"cached_tokens": r["timings"]["cached_n"]}}
    assert r["timings"]["predicted_n"] == len(c.tokens) and "tau" in r["timings"]


def test_streamed_chat_equals_the_whole_reply(model):
    whole = model.create_chat_completion(MESSAGES, max_tokens=32, seed=9, logprobs=True, top_logprobs=2)
    chunks = list(model.create_chat_completion(MESSAGES, max_tokens=32, seed=9, logprobs=True, top_logprobs=2,
                                               stream=True, stream_options={"include_usage": True}))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    body = [c for c in chunks if c["choices"]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in body) == \
        whole["choices"][0]["message"]["content"]
    assert body[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    streamed_lp = [e for c in body if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    whole_lp = whole["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["bytes"]) for e in streamed_lp] == [(e["token"], e["bytes"]) for e in whole_lp]
    assert [e["logprob"] for e in streamed_lp] == pytest.approx([e["logprob"] for e in whole_lp], abs=1e-3)
    assert all(len(e["top_logprobs"]) == 2 for e in streamed_lp)


def test_reasoning_content_when_the_template_opens_the_block(model):
    """A template whose generation prompt ends inside <think>: the reply is reasoning until </think> (this
    small model never closes it, so all of it), streamed or not."""
    template = ChatTemplate(model.tokenizer.chat_template).source + "{{- '<think>\\n' }}"
    kw = dict(max_tokens=24, seed=3, temperature=1.0, chat_template=template)
    whole = model.create_chat_completion(MESSAGES, **kw)["choices"][0]["message"]
    prompt = model.tokenize(ChatTemplate(template).render(MESSAGES), add_special=False, parse_special=True)
    reply = model.generate(prompt, max_tokens=24, seed=3, temperature=1.0).text
    assert "</think>" not in reply and reply.strip()
    assert whole["content"] == "" and whole["reasoning_content"] == reply.strip()
    chunks = list(model.create_chat_completion(MESSAGES, stream=True, **kw))
    assert "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks) == \
        whole["reasoning_content"]


def test_completion_streamed_and_not(model):
    r = model.create_completion("def parse(line):", max_tokens=20, seed=5, logprobs=1)
    c = model.generate("def parse(line):", max_tokens=20, seed=5, temperature=0.8, logprobs=1)
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == c.text
    got = r["choices"][0]["logprobs"]
    assert got["tokens"] == c.logprobs["tokens"] and got["text_offset"] == c.logprobs["text_offset"]
    assert got["token_logprobs"] == pytest.approx(c.logprobs["token_logprobs"], abs=1e-3)
    chunks = list(model.create_completion("def parse(line):", max_tokens=20, seed=5, stream=True))
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == c.text
    assert chunks[-1]["choices"][0]["finish_reason"] == c.finish_reason
    echoed = model.create_completion("def parse(line):", max_tokens=20, seed=5, echo=True, logprobs=1)
    text = echoed["choices"][0]["text"]
    assert text == "def parse(line):" + c.text
    # offsets into the text returned, which begins with the prompt (before: from 0, into the prompt's text)
    offsets = echoed["choices"][0]["logprobs"]["text_offset"]
    assert [text[k:k + len(t)] for k, t in zip(offsets, c.logprobs["tokens"])] == c.logprobs["tokens"]
    assert offsets[0] == len("def parse(line):")
    streamed = list(model.create_completion("def parse(line):", max_tokens=20, seed=5, echo=True, logprobs=1,
                                            stream=True))
    assert [k for ch in streamed if ch["choices"] and ch["choices"][0]["logprobs"]
            for k in ch["choices"][0]["logprobs"]["text_offset"]] == offsets


def test_llama_cpp_python_call_forms(model):
    """Its positional order (prompt, suffix, max_tokens, ...), logprobs=None in a chat (its default and OpenAI
    clients'), seed -1 or LLAMA_DEFAULT_SEED (0xFFFFFFFF) as a fresh seed, not a fixed one."""
    r = model.create_completion("def parse(line):", None, 5, 0.0)
    assert r["usage"]["completion_tokens"] == 5
    with pytest.raises(ValueError, match="suffix='x': .*target.*: infill is not supported by this model: it has no "
                                         "FIM pre, suf, mid tokens"):
        model.create_completion("def parse(line):", "x")  # (the committed pairs' vocabulary has none)
    assert model("def parse(line):", max_tokens=5, temperature=0.0)["choices"][0]["text"] == \
        model.generate("def parse(line):", max_tokens=5).text  # llama-cpp-python's llm(prompt, ...)
    assert model.create_chat_completion(MESSAGES, max_tokens=3, logprobs=None)["choices"][0]["logprobs"] is None
    for seed in (-1, 0xFFFFFFFF):
        seeds = {model.generate("def parse(line):", max_tokens=2, temperature=1.0, seed=seed).seed
                 for _ in range(3)}
        assert len(seeds) == 3 and seed not in seeds, seeds
    assert model.generate("def parse(line):", max_tokens=2, temperature=1.0, seed=-2).seed == -2


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(response_format={"type": "yaml"}), ValueError, "response_format type 'yaml' is not one of"),
    (dict(tool_choice="required"), ValueError, "tool_choice='required' is not supported"),
    (dict(chat_format="vicuna"), ValueError, "chat_format='vicuna' is not one of chatml"),
    (dict(chat_template="{% if %}"), ValueError, "does not compile"),
    (dict(chat_template_kwargs=["enable_thinking"]), TypeError, "chat_template_kwargs must be a dict"),
    (dict(top_logprobs=50, logprobs=True), ValueError, "top_logprobs = 50"),
    (dict(stream="yes"), TypeError, "stream must be True or False"),
    (dict(messages=[]), ValueError, "messages is empty"),
    # a variable the call sets itself (before: "got multiple values for keyword argument"), a name not a string
    (dict(chat_template_kwargs={"add_generation_prompt": False}), ValueError,
     r"chat_template_kwargs\['add_generation_prompt'\]: expected a template variable's name other than"),
    (dict(chat_template_kwargs={1: 2}), ValueError, r"chat_template_kwargs\[1\]"),
    # the sandbox's bound on range() (before: OverflowError from inside jinja2)
    (dict(chat_template="{% for x in range(10**9) %}a{% endfor %}"), ValueError, "cannot render these messages"),
    # a text no context of 1024 tokens holds, refused before it is tokenized (before: after ~2 minutes)
    (dict(chat_template="{{ 'a' * 10**8 }}"), ContextLengthExceededError,
     r"the prompt has 100000000 characters, more than n_ctx = 1024 tokens of at most \d+ bytes each can hold"),
])
def test_unsupported_options_are_refused(model, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        model.create_chat_completion(kwargs.pop("messages", MESSAGES), max_tokens=4, **kwargs)


def test_chat_format_chatml(model):
    r = model.create_chat_completion(MESSAGES, max_tokens=8, seed=1, chat_format="chatml")
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in MESSAGES) + "<|im_start|>assistant\n"
    c = model.generate(model.tokenize(text, add_special=False, parse_special=True), max_tokens=8, seed=1,
                       temperature=0.2)
    assert r["choices"][0]["message"]["content"] == c.text


def test_a_model_without_a_template_says_so(tmp_path):
    from gguf_edit import rewrite

    from pydflash.chat import ChatTemplateError

    path = rewrite(pair_file("qwen3", "target", "f32"), tmp_path / "no-template.gguf",
                   drop_keys=["tokenizer.chat_template"])
    with pydflash.Model(path, n_ctx=256) as m:
        with pytest.raises(ChatTemplateError, match="no-template.gguf: the model has no tokenizer.chat_template"):
            m.create_chat_completion(MESSAGES, max_tokens=4)
        # an explicit format works
        assert m.create_chat_completion(MESSAGES, max_tokens=4, chat_format="chatml")["choices"][0]["message"]


def test_a_second_generation_on_a_busy_model_is_refused(model):
    """One Model runs one generation at a time: a call while a stream is unfinished (or from another thread)
    raises ModelBusyError instead of racing on the session; once the stream is done the Model is free."""
    from pydflash.errors import ModelBusyError

    # (no end-of-generation token and no max_tokens: it runs to the end of the context, ~1000 steps, while the
    # second call comes microseconds after the first piece)
    no_end = {t: float("-inf") for t in model.tokenizer.eog_token_ids}
    stream = model.stream("def f(x):", max_tokens=None, temperature=0.0, logit_bias=no_end)
    next(stream)
    with pytest.raises(ModelBusyError, match="already generating"):
        model.generate("x", max_tokens=2)
    stream.close()
    assert model.generate("x", max_tokens=2).tokens


def test_max_tokens_zero_counts_and_caches_the_prompt(model):
    """As llama-server's n_predict 0: the prompt is evaluated (and cached for the next call), nothing generated;
    usage counts the prompt (before: 0 prompt tokens, and nothing evaluated)."""
    prompt = "def tokens_of(line):"
    n = len(model.tokenize(prompt))
    r = model.create_completion(prompt + " # zero", max_tokens=0)
    usage = r["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(model.tokenize(prompt + " # zero")), 0)
    assert r["choices"][0]["text"] == "" and r["choices"][0]["finish_reason"] == "length"
    model.generate("import os", max_tokens=2)  # the cache holds another prompt
    model.create_completion(prompt, max_tokens=0)
    assert model.generate(prompt, max_tokens=2).timings["cached_n"] == n
