"""llama-server's fill-in-the-middle completion (pydflash/infill.py, POST /infill) on a tiny random Qwen3 whose
vocabulary has Qwen's FIM tokens: the prompt laid out token by token as llama-server lays it out (its layout
written here by hand), its cuts, n_indent and refusals; the slow peer test puts the same requests to
llama-server's /infill over the same GGUF."""

from __future__ import annotations

import json

import pytest

import pydflash
from pydflash.convert import convert_hf_to_gguf
from pydflash.infill import InfillRequest, InfillUnsupported, _Limits, infill_tokens

from export_pairs import pair_file
from hf_models import make_qwen3_checkpoint

pytest.importorskip("fastapi")

FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")


@pytest.fixture(scope="module")
def fim_gguf(tmp_path_factory):
    """A tiny random Qwen3 GGUF (our converter) whose tokenizer has Qwen's six FIM tokens as special tokens."""
    path = tmp_path_factory.mktemp("fim") / "hf"
    make_qwen3_checkpoint(path, vocab_size=800, seed=7)
    data = json.loads((path / "tokenizer.json").read_text())
    config = json.loads((path / "tokenizer_config.json").read_text())
    first = max(t["id"] for t in data["added_tokens"]) + 1
    for i, text in enumerate(FIM):
        token = {"id": first + i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": True}
        data["added_tokens"].append(token)
        config["added_tokens_decoder"][str(first + i)] = {k: v for k, v in token.items() if k != "id"}
    (path / "tokenizer.json").write_text(json.dumps(data))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return convert_hf_to_gguf(path, path.parent / "fim-f32.gguf", outtype="f32", progress=False)


@pytest.fixture(scope="module")
def fim_model(fim_gguf):
    with pydflash.Model(fim_gguf, n_ctx=256, n_threads=1) as m:
        yield m


def test_create_completion_with_a_suffix_fills_the_middle(fim_model):
    """Model.create_completion(prompt, suffix): the greedy completion of [BOS] [FIM_PRE] prompt [FIM_SUF] suffix
    [FIM_MID] (written here by hand), the prompt echoed (not the FIM tokens); a prompt of ids too."""
    m = fim_model
    fim = {text: m.tokenize(text, add_special=False, parse_special=True)[0] for text in FIM}
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"

    def text(s):
        return m.tokenize(s, add_special=False, parse_special=False)

    layout = [*([m.tokenizer.bos_token_id] if m.tokenizer.add_bos else []), fim["<|fim_prefix|>"], *text(prefix),
              fim["<|fim_suffix|>"], *text(suffix), fim["<|fim_middle|>"]]
    middle = m.generate(layout, max_tokens=12, speculative=False).text
    got = m.create_completion(prefix, suffix=suffix, max_tokens=12, temperature=0.0)
    assert got["choices"][0]["text"] == middle and got["usage"]["prompt_tokens"] == len(layout)
    echoed = m.create_completion(prefix, suffix, 12, 0.0, echo=True)["choices"][0]["text"]
    assert echoed == prefix + middle
    assert m.create_completion(text(prefix), suffix=suffix, max_tokens=12, temperature=0.0)["choices"][0]["text"] \
        == middle
    with pytest.raises(TypeError, match="suffix must be a str"):
        m.create_completion(prefix, suffix=3)


def test_the_prompt_is_llama_servers_layout(fim_model):
    m = fim_model
    fim = {text: m.tokenize(text, add_special=False, parse_special=True)[0] for text in FIM}
    assert len(set(fim.values())) == 6 and m.tokenizer.fim_token_ids() == dict(zip(
        ("pre", "suf", "mid", "pad", "rep", "sep"), fim.values()))

    def text(s):
        return m.tokenize(s, add_special=False, parse_special=False)

    req = InfillRequest(input_prefix="def add(a, b):\n    ", input_suffix="\n\nprint(add(1, 2))\n", prompt="ret",
                        input_extra=[{"filename": "util.py", "text": "import os\n"}, {"text": "x = 1\n"}])
    assert infill_tokens(m, req, n_batch=64) == [
        fim["<|repo_name|>"], *text("myproject\n"), fim["<|file_sep|>"], *text("util.py\n"), *text("import os\n"),
        fim["<|file_sep|>"], *text("tmp\n"), *text("x = 1\n"), fim["<|file_sep|>"], *text("filename\n"),
        fim["<|fim_prefix|>"], *text("def add(a, b):\n    "), *text("ret"),
        fim["<|fim_suffix|>"], *text("\n\nprint(add(1, 2))\n"), fim["<|fim_middle|>"]]
    # the prefix keeps its last 3/4 of a batch, the suffix what fits in the last quarter; the extra chunks what
    # the context leaves (256 - 16 + 2 here), none where the batch is as large as the context (the default 2048)
    long = InfillRequest(input_prefix="a b c d e f g h i j k l m n o p", input_suffix="q r s t u v w x y z",
                         prompt="")
    prefix, suffix = text(long.input_prefix), text(long.input_suffix)
    got = infill_tokens(m, long, n_batch=16)
    start = got.index(fim["<|fim_prefix|>"])
    assert got[start:] == [fim["<|fim_prefix|>"], *prefix[-12:], fim["<|fim_suffix|>"], *suffix[:2],
                           fim["<|fim_middle|>"]]
    assert got[:start] == [fim["<|repo_name|>"], *text("myproject\n"), fim["<|file_sep|>"], *text("filename\n")]
    assert infill_tokens(m, req).index(fim["<|fim_prefix|>"]) == 0
    # ids and texts mixed in the prefix, as llama-server's tokenize_mixed takes them
    mixed = InfillRequest(input_prefix=["x", 5, "y"], input_suffix="")
    assert infill_tokens(m, mixed)[-6:] == [fim["<|fim_prefix|>"], *text("x"), 5, *text("y"),
                                            fim["<|fim_suffix|>"], fim["<|fim_middle|>"]]


def _limited(tokens: list[str], ms: float = 0.0, **limits) -> tuple[str, bool]:
    """The completion `tokens` make under `limits` (n_indent, t_max_predict_ms): (its text, whether they cut it)."""
    cut, text = _Limits(InfillRequest(input_prefix="", input_suffix="", **limits)), ""
    for token in tokens:
        end, ended = cut(text + token, token, ms)
        text = (text + token)[:end]
        if ended:
            return text, True
    return text, False


def test_n_indent_and_the_time_limit_cut_as_llama_server_does():
    """llama-server's process_token, token by token (worked by hand): once a newline has come, each token checks
    the line at last_nl_pos and then moves it to the next line, so a cut comes a token or two after the line's
    first character; a blank line is a line of indentation 0."""
    tokens = ["x = 1", "\n", "    y", " = 2", "\n", "return", " 3"]
    assert _limited(tokens, n_indent=4) == ("x = 1\n    y = 2\n", True)
    assert _limited(tokens, n_indent=5) == ("x = 1\n    ", True)  # (line 2 checked at " = 2": 4 < 5)
    assert _limited(tokens[:5], n_indent=4) == ("x = 1\n    y = 2\n", False)
    assert _limited(["x", "\n\n", "y", "z"], n_indent=2) == ("x\n", True)
    assert _limited(["x", "\n\n", "y"], n_indent=2) == ("x\n\ny", False)
    assert _limited(["a", "\n", "b", "\n", "c"], ms=150.0, t_max_predict_ms=100) == ("a\n", True)
    assert _limited(["a", "\n", "b"], ms=50.0, t_max_predict_ms=100) == ("a\nb", False)


def test_the_server_answers_infill(fim_gguf):
    """/infill answers in /completion's shape (its content the completion the same tokens give /completion);
    n_indent ends it as the cut says; a model without FIM tokens gets 501, a request without input_prefix 400."""
    from fastapi.testclient import TestClient

    from pydflash.server import create_app

    body = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "prompt": "", "n_predict": 24,
            "temperature": 0.0, "input_extra": [{"filename": "util.py", "text": "import os\n"}]}
    with pydflash.Model(fim_gguf, n_ctx=256, n_threads=1) as m, TestClient(create_app(m)) as http:
        r = http.post("/infill", json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
        tokens = infill_tokens(m, InfillRequest(**body))
        plain = http.post("/completion", json={"prompt": tokens, "n_predict": 24, "temperature": 0.0,
                                               "return_tokens": True}).json()
        assert (answer["content"], answer["tokens_evaluated"]) == (plain["content"], len(tokens))
        assert answer["stop_type"] == plain["stop_type"]
        with http.stream("POST", "/completion", json={"prompt": tokens, "n_predict": 24, "temperature": 0.0,
                                                       "stream": True}) as streamed:  # (the pieces, as they come)
            chunks = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: ")]
        pieces = [chunk["content"] for chunk in chunks if not chunk["stop"]]
        content, ends = _limited(pieces, n_indent=8)
        indented = http.post("/infill", json={**body, "n_indent": 8}).json()
        assert indented["content"] == content and indented["stop_type"] == ("limit" if ends else plain["stop_type"])
        assert http.post("/infill", json={"input_suffix": ""}).status_code == 400
        # llama-server's response_fields (llama.vscode asks for some): only those, a nested one under its path
        fields = http.post("/infill", json={**body, "response_fields": ["content", "timings/predicted_n",
                                                                        "timings/nothing", "stop_type"]}).json()
        assert fields == {"content": answer["content"], "timings/predicted_n": answer["timings"]["predicted_n"],
                          "stop_type": answer["stop_type"]}
    with pydflash.Model(pair_file("qwen3", "target", "f32"), n_ctx=256) as m, TestClient(create_app(m)) as http:
        r = http.post("/infill", json=body)
        assert r.status_code == 501 and "no FIM pre, suf, mid tokens" in r.json()["error"]["message"], r.text
        with pytest.raises(InfillUnsupported):
            infill_tokens(m, InfillRequest(**body))


@pytest.mark.slow
def test_infill_answers_as_llama_servers(fim_gguf, tmp_path):
    """The same /infill requests to llama-server and ours over the same GGUF, greedy: the same content, tokens
    evaluated and stop type (with extra chunks, a prompt, ids in the prefix, n_indent)."""
    import peer

    from fastapi.testclient import TestClient

    from pydflash.server import create_app

    if peer.binary("llama-server") is None:
        pytest.skip("llama-server is not built (python -c 'import peer; peer.build(server=True)' in benchmarks/)")
    from near_ties import TIE, first_difference, tie_gap
    from test_peer import _llama

    bodies = [{"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n", "prompt": "re"},
              {"input_prefix": ["import ", 100, "\n"], "input_suffix": "",
               "input_extra": [{"filename": "a.py", "text": "x = 1\n"}, {"text": "y = 2\n"}]},
              {"input_prefix": "class A:\n    def f(self):\n        ", "input_suffix": "", "n_indent": 8}]
    bodies.append({**bodies[1], "n_indent": 4})  # (its reply's second line is cut there)
    # (a batch of 256 in a context of 512: the extra chunks fit, as the defaults' 2048 would leave them out)
    with pydflash.Model(fim_gguf, n_ctx=512, n_threads=1) as m, TestClient(create_app(m, n_batch=256)) as ours, \
            peer.llama_server(fim_gguf, 1, 1, 512, tmp_path / "llama-server.log", extra=("-b", "256")) as url:
        for body in bodies:
            body = {**body, "n_predict": 32, "temperature": 0.0, "return_tokens": True}
            got, theirs = ours.post("/infill", json=body).json(), _llama(url, "/infill", body)
            assert (got["tokens_evaluated"], got["prompt"]) == (theirs["tokens_evaluated"], theirs["prompt"]), body
            n = min(len(got["tokens"]), len(theirs["tokens"]))  # (a cut ends ours within a round of theirs)
            if got["tokens"][:n] != theirs["tokens"][:n]:  # (a random model: greedy may part at a near-tie)
                k = first_difference(got["tokens"], theirs["tokens"])
                prompt = infill_tokens(m, InfillRequest(**body), n_batch=256)
                assert tie_gap(m, prompt, got["tokens"], theirs["tokens"], k) < TIE, (body, k)
                continue
            for key in ("content", "stop_type"):
                assert got[key] == theirs[key], (body, key, got[key], theirs[key])
            assert body.get("n_indent") != 4 or got["stop_type"] == "limit"
        # response_fields (llama.vscode's): the same fields, nested ones under their paths, a missing one left out
        fields = ["content", "stop_type", "tokens_evaluated", "timings/predicted_n", "timings/no_such_field"]
        body = {**bodies[0], "n_predict": 32, "temperature": 0.0, "response_fields": fields}
        assert ours.post("/infill", json=body).json() == _llama(url, "/infill", body)
