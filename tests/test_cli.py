"""The `pydflash` command: run (and its older spelling generate), chat and bench, on a committed pair."""

from __future__ import annotations

import io
import logging
import os
import signal
import socket
import sys
import threading
import time

import pytest

import pydflash
from pydflash.cli import chat_loop, main

from export_pairs import pair_file

TARGET, DRAFT = str(pair_file("qwen3", "target", "f32")), str(pair_file("qwen3", "dflash", "f32"))


def test_run_streams_what_generate_gives(capsys):
    assert main(["run", TARGET, "-p", "def f(x):", "-n", "24", "--temp", "0.9", "--top-k", "20", "--seed", "5",
                 "-md", DRAFT, "--spec-mode", "chain"]) == 0
    printed = capsys.readouterr().out
    with pydflash.Model(TARGET, n_ctx=4096) as m:
        expected = m.generate("def f(x):", max_tokens=24, temperature=0.9, top_k=20, seed=5).text
    assert printed == expected + "\n"
    assert main(["generate", TARGET, "def f(x):", "-n", "24", "--temp", "0.9", "--top-k", "20", "-s", "5"]) == 0
    assert capsys.readouterr().out == printed
    assert main(["run", TARGET, "-p", "x", "--top-p", "2"]) == 1
    assert "top_p = 2.0" in capsys.readouterr().err
    assert main(["run", TARGET]) == 1
    assert "no prompt" in capsys.readouterr().err


def test_library_warnings_print_as_the_commands_own(capsys):
    """A warning of the library's (threads capped at the cores) printed bare before, through Python's fallback;
    now once, as the command's other messages are"""
    assert main(["run", TARGET, "-p", "x", "-n", "1", "-t", "100000"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "n_threads = 100000" in line]
    assert len(warnings) == 1 and warnings[0].startswith("pydflash: warning: n_threads = 100000 exceeds the ")
    assert not logging.getLogger("pydflash").handlers  # the command's handler leaves with it


def test_run_with_ngram_lookup(capsys):
    """--proposers reaches the Model: n-gram lookup with no draft model prints plain decoding's text; a drafter's
    proposer without -md is refused, naming what is missing."""
    text = "def f(x):\n    return x + 1\n\ndef f(x):\n"
    assert main(["run", TARGET, "-p", text, "-n", "24", "--proposers", "ngram", "--spec-mode", "chain"]) == 0
    printed = capsys.readouterr().out
    with pydflash.Model(TARGET, n_ctx=4096) as m:
        assert printed == m.generate(text, max_tokens=24).text + "\n"
    assert main(["run", TARGET, "-p", "x", "--proposers", "ngram,dflash"]) == 1
    assert "needs a DFlash drafter: draft_model_path" in capsys.readouterr().err


def test_run_warns_when_the_context_is_full(capsys):
    assert main(["run", TARGET, "-p", "def f(x):", "-c", "24"]) == 0
    assert "stopped at the end of the context (n_ctx = 24)" in capsys.readouterr().err


class _Lines:
    def __init__(self, lines):
        self.lines = list(lines)

    def __call__(self, prompt):
        if not self.lines:
            raise EOFError
        return self.lines.pop(0)


def test_chat_keeps_history_and_resets():
    with pydflash.Model(TARGET, n_ctx=1024, draft_model_path=DRAFT, spec_mode="chain") as m:
        out = io.StringIO()
        sampling = dict(temperature=0.0)
        chat_loop(m, _Lines(["hello", "and more", "/reset", "hello"]), out, sampling=sampling, max_tokens=12)
        text = out.getvalue()
        assert "\x1b[" not in text  # no ANSI codes off a terminal
        first = m.create_chat_completion([{"role": "user", "content": "hello"}], max_tokens=12, temperature=0.0)
        answer = first["choices"][0]["message"]["content"]
        second = m.create_chat_completion([{"role": "user", "content": "hello"}, {"role": "assistant", "content": answer},
                                           {"role": "user", "content": "and more"}], max_tokens=12, temperature=0.0)
        lines = text.split("\n")
        assert lines[0] == answer and lines[1] == second["choices"][0]["message"]["content"]
        assert lines[2] == "(conversation reset)" and lines[3] == answer  # the same first turn again


class _Interrupting:
    """A model whose answers raise KeyboardInterrupt (Ctrl-C) after the first chunk of the first answer."""

    def __init__(self, model):
        self.model, self.n_ctx, self.calls = model, model.n_ctx, 0

    def create_chat_completion(self, messages, **kw):
        self.calls += 1
        inner = self.model.create_chat_completion(messages, **kw)
        if self.calls > 1:
            return inner

        def chunks():
            for i, c in enumerate(inner):
                if i == 2:
                    raise KeyboardInterrupt
                yield c
        return chunks()


def test_ctrl_c_stops_the_answer_only():
    with pydflash.Model(TARGET, n_ctx=1024) as m:
        out = io.StringIO()
        fake = _Interrupting(m)
        chat_loop(fake, _Lines(["hello", "again"]), out, sampling=dict(temperature=0.0), max_tokens=12)
        lines = out.getvalue().split("\n")
        assert lines[0].endswith("[stopped]")
        assert fake.calls == 2 and lines[1]  # the chat went on with the next turn


def test_bench_prints_plain_and_speculative(capsys):
    # a chain: auto speculates only where it measures that it pays, which on this tiny pair and a CPU it need not
    assert main(["bench", TARGET, "-md", DRAFT, "-n", "16", "--n-prompts", "2", "--spec-mode", "chain"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "2 prompts x 16 tokens, temperature 0.0"
    assert out[2].split()[0] == "plain" and out[3].split()[0] == "speculative"
    assert float(out[3].split()[2]) > 1.0  # tau of the trained pair


class _Terminal:
    """`pydflash ...` run on a pseudo-terminal (its controlling terminal: Ctrl-C there is a SIGINT)."""

    def __init__(self, args: list[str], cwd: str):
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child
            os.chdir(cwd)
            os.execv(sys.executable, [sys.executable, "-c", "import sys; from pydflash.cli import main; "
                                      "sys.exit(main())", *args])
        self.seen = b""

    def read_until(self, marker: bytes, timeout: float = 120.0) -> bytes:
        """Everything up to and including the next `marker` (what was read before is not searched again)."""
        import select

        start = len(self.seen)
        deadline = time.time() + timeout
        while marker not in self.seen[start:]:
            left = deadline - time.time()
            assert left > 0, f"no {marker!r} within {timeout} s; the terminal shows:\n{self.seen[-2000:]!r}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    data = os.read(self.fd, 65536)
                except OSError:  # the child is gone
                    data = b""
                assert data, f"the program ended before {marker!r}:\n{self.seen[-2000:]!r}"
                self.seen += data
        end = self.seen.index(marker, start) + len(marker)
        got, self.seen = self.seen[start:end], self.seen[:end]  # later reads start after the marker
        return got

    def read_more(self, n: int, timeout: float = 120.0) -> None:
        """Wait until at least n more bytes have arrived."""
        import select

        want, deadline = len(self.seen) + n, time.time() + timeout
        while len(self.seen) < want:
            assert time.time() < deadline, f"no output within {timeout} s:\n{self.seen[-2000:]!r}"
            if select.select([self.fd], [], [], 0.1)[0]:
                self.seen += os.read(self.fd, 65536)

    def type(self, text: bytes) -> None:
        os.write(self.fd, text)

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.time() + timeout
        while time.time() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        os.kill(self.pid, 9)
        raise AssertionError("the program did not exit")


def test_chat_on_a_terminal(tmp_path):
    """Type, read the streamed answer, Ctrl-C stops that answer only, /reset, /exit."""
    # the trained tiny pair never ends a chat answer on its own: each runs to -n tokens unless stopped
    term = _Terminal(["chat", TARGET, "-md", DRAFT, "-c", "8192", "-n", "4000", "--temp", "0", "-t", "1"],
                     str(tmp_path))
    prompt = b"\x1b[1m> \x1b[0m"  # bold: stdout is a terminal
    term.read_until(prompt)
    term.type(b"write a long module\r")
    term.read_until(b"module\r\n")  # the terminal's echo of the line
    term.read_more(20)  # the answer is streaming
    term.type(b"\x03")  # Ctrl-C
    stopped = term.read_until(prompt, timeout=30)
    assert b"[stopped]" in stopped
    term.type(b"/reset\r")
    assert b"(conversation reset)" in term.read_until(prompt)
    term.type(b"/exit\r")
    assert term.wait() == 0


def test_chat_on_a_terminal_started_with_ctrl_c_ignored(tmp_path):
    """A process started with SIGINT ignored (as a shell without job control starts `pytest ... &`, and so the
    chat under it): Ctrl-C on the chat's own terminal still stops the answer."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited across fork and exec
    try:
        term = _Terminal(["chat", TARGET, "-md", DRAFT, "-c", "8192", "-n", "4000", "--temp", "0", "-t", "1"],
                         str(tmp_path))
    finally:
        signal.signal(signal.SIGINT, previous)
    prompt = b"\x1b[1m> \x1b[0m"
    term.read_until(prompt)
    term.type(b"write a long module\r")
    term.read_until(b"module\r\n")
    term.read_more(20)
    term.type(b"\x03")
    assert b"[stopped]" in term.read_until(prompt, timeout=30)
    term.type(b"/exit\r")
    assert term.wait() == 0


class _RecordingSession:
    """A Model's core session that records abort() calls and what generate() returned."""

    def __init__(self, session):
        self._session, self.aborted, self.results = session, threading.Event(), []

    def abort(self):
        self.aborted.set()
        self._session.abort()

    def generate(self, *args, **kwargs):
        self.results.append(self._session.generate(*args, **kwargs))
        return self.results[-1]

    def __getattr__(self, name):
        return getattr(self._session, name)


def test_ctrl_c_before_the_first_token_stops_the_answer():
    """Ctrl-C that lands while the answer is being set up, before the core generates (which clears the core's
    abort flag as it starts), still ends that answer rather than letting it run to max_tokens."""
    with pydflash.Model(TARGET, n_ctx=4096, n_threads=1) as m:
        session = m._session = _RecordingSession(m._session)
        prepare = m._choose_ubatch

        def interrupted(tokens):  # on the generation's thread, just before the core's generate
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            assert session.aborted.wait(60), "the chat did not abort on Ctrl-C"
            prepare(tokens)

        m._choose_ubatch = interrupted
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            out = io.StringIO()
            banned = {t: float("-inf") for t in m.tokenizer.eog_token_ids}  # else the answer runs to max_tokens
            chat_loop(m, _Lines(["write a long module"]), out, sampling=dict(temperature=0.0, logit_bias=banned),
                      max_tokens=2000)
        finally:
            signal.signal(signal.SIGINT, previous)
        assert out.getvalue().split("\n")[0].endswith("[stopped]")
        assert session.aborted.is_set()  # the chat asked the core to stop, while the thread waited for it
        ended = list(session.results)
        assert all(r["finish_reason"] == "abort" and len(r["tokens"]) <= 1 for r in ended), \
            [(r["finish_reason"], len(r["tokens"])) for r in ended]
        m._choose_ubatch = prepare
        assert m.generate("x", max_tokens=2).tokens  # the stopped turn let go of the Model (not busy)


def test_run_with_the_models_mtp_head(capsys):
    """A target with an MTP head drafts with it by default (bench names it), --proposers mtp asks for it, and a file
    without one is refused naming what it lacks."""
    mtp_target = str(pair_file("qwen35", "target-mtp", "q8_0"))
    assert main(["run", mtp_target, "-p", "def f(x):", "-n", "24", "--proposers", "mtp", "--spec-mode", "chain"]) == 0
    printed = capsys.readouterr().out
    with pydflash.Model(mtp_target, n_ctx=4096) as m:
        assert m.proposers == ("mtp",)
        assert printed == m.generate("def f(x):", max_tokens=24, speculative=False).text + "\n"
    assert main(["run", TARGET, "-p", "x", "--proposers", "mtp"]) == 1
    assert "no multi-token-prediction head" in capsys.readouterr().err


class _Opened(Exception):
    """What the recording Model raises once it has the arguments the command gave it."""


def _model_arguments(monkeypatch, argv):
    """The keyword arguments `pydflash` hands Model for argv (the model is not loaded)."""
    import pydflash.model

    seen = {}

    def record(path, **kwargs):
        seen.update(kwargs, model_path=path)
        raise _Opened

    monkeypatch.setattr(pydflash.model, "Model", record)
    try:
        main(argv)
    except _Opened:
        return seen
    raise AssertionError(f"{argv} did not open a model")


def test_llama_cpp_spellings_mean_what_they_mean_there(monkeypatch):
    """llama.cpp's names for the model's options (-m, --ctx-size, --gpu-layers, -ctk/-ctv, --model-draft,
    --spec-draft-n-max N = N drafts a round) open the Model that the values mean in llama.cpp."""
    got = _model_arguments(monkeypatch, ["run", "-m", TARGET, "--ctx-size", "512", "--gpu-layers", "0", "-ctk",
                                         "q8_0", "-ctv", "q8_0", "--model-draft", DRAFT, "--spec-draft-n-max", "3",
                                         "-p", "x"])
    assert (got["model_path"], got["n_ctx"], got["n_gpu_layers"], got["kv_type"]) == (TARGET, 512, 0, "q8_0")
    assert (got["draft_model_path"], got["block_size"]) == (DRAFT, 4)  # 3 drafts and the anchor
    # the same under our own names; serve and chat take them too
    assert _model_arguments(monkeypatch, ["run", TARGET, "-c", "512", "-ngl", "0", "--kv-type", "q8_0", "-md",
                                          DRAFT, "--block-size", "4", "-p", "x"]) == got
    for command in ("chat", "bench", "serve"):
        assert _model_arguments(monkeypatch, [command, "--model", TARGET, "--spec-draft-model", DRAFT,
                                              "--cache-type-k", "q4_0", "--cache-type-v", "q4_0"])["kv_type"] == "q4_0"
    from pydflash.cli import build_parser

    assert build_parser().parse_args(["chat", TARGET, "-sys", "Be brief."]).system == "Be brief."
    assert build_parser().parse_args(["chat", TARGET, "--system-prompt", "Be brief."]).system == "Be brief."


def test_run_reads_the_prompt_file_as_llama_cpp_does(tmp_path, capsys):
    """-f FNAME: the file's text, one final newline dropped; --predict and --temperature as -n and --temp."""
    text = "def f(x):\n"
    (tmp_path / "prompt.txt").write_text(text)
    assert main(["run", "-m", TARGET, "-f", str(tmp_path / "prompt.txt"), "--predict", "16", "--temperature", "0.9",
                 "-s", "3"]) == 0
    printed = capsys.readouterr().out
    with pydflash.Model(TARGET, n_ctx=4096) as m:
        expected = m.generate(text[:-1], max_tokens=16, temperature=0.9, seed=3).text
        assert expected != m.generate(text, max_tokens=16, temperature=0.9, seed=3).text  # the newline counts
    assert printed == expected + "\n"


def test_llama_cpp_spellings_that_disagree_are_refused(tmp_path, capsys):
    cases = [
        (["run", TARGET, "-ctk", "q8_0", "-p", "x"], "-ctk q8_0 alone: the K and V caches share one type here"),
        (["run", TARGET, "-ctk", "q8_0", "-ctv", "q4_0", "-p", "x"], "-ctk q8_0, -ctv q4_0 disagree"),
        (["run", TARGET, "--kv-type", "q4_0", "-ctk", "q8_0", "-ctv", "q8_0", "-p", "x"],
         "--kv-type q4_0, -ctk q8_0, -ctv q8_0 disagree"),
        (["run", TARGET, "-m", DRAFT, "-p", "x"], f"two models: '{TARGET}' and -m '{DRAFT}'"),
        (["run", "-p", "x"], "no model: pass the GGUF's path (or -m FNAME)"),
        (["plan", "-c", "64"], "no model"),
        (["run", TARGET, "-md", DRAFT, "--block-size", "8", "--spec-draft-n-max", "3", "-p", "x"],
         "--spec-draft-n-max 3 drafts 3 tokens a round (block size 4), but --block-size is 8"),
        (["run", TARGET, "-md", DRAFT, "--spec-draft-n-max", "0", "-p", "x"], "--spec-draft-n-max must be at least 1"),
        (["run", TARGET, "-p", "x", "-f", str(tmp_path / "none.txt")], "two prompts: -p and -f"),
        (["run", TARGET, "-f", str(tmp_path / "none.txt")],
         f"cannot read the prompt file {tmp_path / 'none.txt'}: No such file or directory"),
    ]
    for argv, message in cases:
        assert main(argv) == 1, argv
        assert message in capsys.readouterr().err, argv


def test_plan_takes_llama_cpp_spellings(capsys):
    import json

    assert main(["plan", "-m", TARGET, "--ctx-size", "1024", "-ctk", "q4_0", "-ctv", "q4_0", "--ubatch-size", "64",
                 "--model-draft", DRAFT, "--spec-draft-n-max", "7", "--json"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["n_ctx"], config["kv_type"], config["n_ubatch"], config["block_size"]) == (1024, "q4_0", 64, 8)
    assert config["draft_model_path"] == DRAFT


def _gguf_value(path: str, key: str):
    import gguf

    field = gguf.GGUFReader(path).fields[key]
    return field.parts[field.data[0]].tolist()


def test_more_llama_cpp_flags_mean_what_they_mean_there(monkeypatch):
    """-c 0 (the model's trained context), -n -1 (no limit), -ub, --spec-type (each llama.cpp type as the
    proposer it names, none: plain decoding), and the flags that say what pydflash always does (-fa, --jinja,
    --no-mmap, -b) accepted."""
    got = _model_arguments(monkeypatch, ["run", "-m", TARGET, "-p", "x", "-c", "0", "-n", "-1", "-ub", "64",
                                         "-fa", "on", "--jinja", "--no-mmap", "-b", "2048"])
    assert (got["n_ctx"], got["n_ubatch"]) == (0, 64)
    assert _model_arguments(monkeypatch, ["run", TARGET, "-p", "x"])["n_ubatch"] == "auto"
    for types, proposers in (("draft-mtp", ("mtp",)), ("ngram-mod", ("ngram",)), ("ngram-simple,draft-mtp",
                                                                                 ("ngram", "mtp")), ("none", ())):
        assert _model_arguments(monkeypatch, ["run", TARGET, "-p", "x", "--spec-type", types])["proposers"] == \
            proposers, types
    got = _model_arguments(monkeypatch, ["serve", TARGET, "-md", DRAFT, "--spec-type", "draft-dflash"])
    assert (got["proposers"], got["draft_model_path"]) == (("dflash",), DRAFT)


def test_predict_minus_one_runs_to_the_end_of_the_context(capsys):
    assert main(["run", TARGET, "-p", "def f(x):", "-n", "-1", "-c", "40"]) == 0
    assert "stopped at the end of the context (n_ctx = 40)" in capsys.readouterr().err


def test_ctx_size_zero_is_the_models_trained_context(tmp_path, capsys):
    """n_ctx=0 (llama-cpp-python's) and -c 0 (llama.cpp's): the GGUF's context_length, here set to 1536 (the
    committed pairs say 4096, which is also the default)."""
    import gguf

    from gguf_edit import rewrite

    target = str(rewrite(TARGET, tmp_path / "trained-1536.gguf",
                         set_keys={"qwen3.context_length": (1536, gguf.GGUFValueType.UINT32)}))
    assert _gguf_value(target, "qwen3.context_length") == [1536]
    with pydflash.Model(target, n_ctx=0) as m:
        assert m.n_ctx == 1536
    assert pydflash.plan(target, n_ctx=0).config["n_ctx"] == 1536
    assert main(["run", target, "-p", "def f(x):", "-n", "-1", "-c", "0", "-v"]) == 0
    assert "n_ctx=1536" in capsys.readouterr().err


def test_ignore_eos_bans_the_end_of_generation_tokens(monkeypatch, capsys):
    """--ignore-eos (llama.cpp's): the GGUF's end-of-generation token is banned (a -inf bias), and the text runs
    to -n tokens."""
    seen = {}
    real = pydflash.Model.pieces

    def pieces(self, prompt, max_tokens, **kw):
        seen.update(kw)
        return real(self, prompt, max_tokens, **kw)

    monkeypatch.setattr(pydflash.Model, "pieces", pieces)
    assert main(["run", TARGET, "-p", "def f(x):", "-n", "8", "--ignore-eos"]) == 0
    eos = _gguf_value(TARGET, "tokenizer.ggml.eos_token_id")[0]
    assert seen["logit_bias"][eos] == float("-inf")
    assert all(v == float("-inf") for v in seen["logit_bias"].values())


def test_run_follows_a_grammar(tmp_path, capsys):
    """llama.cpp's --grammar-file and -j/--json-schema: the output the Model gives under that grammar."""
    pytest.importorskip("llguidance")
    (tmp_path / "digits.gbnf").write_text('root ::= [0-9]+ "," [0-9]+ "\\n"')
    assert main(["run", TARGET, "-p", "x = ", "-n", "12", "--grammar-file", str(tmp_path / "digits.gbnf")]) == 0
    out = capsys.readouterr().out
    with pydflash.Model(TARGET, n_ctx=512, n_threads=1) as m:
        want = m.generate("x = ", max_tokens=12, grammar='root ::= [0-9]+ "," [0-9]+ "\\n"').text
        assert want in out and want
        assert main(["run", TARGET, "-p", "x = ", "-n", "30", "-j", '{"type": "array", "maxItems": 1}']) == 0
        assert m.generate("x = ", max_tokens=30, grammar=pydflash.Grammar.from_json_schema(
            {"type": "array", "maxItems": 1})).text in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["run", TARGET, "-p", "x", "-mg", "0"], "-mg is llama.cpp's, with no counterpart here: -ts/--tensor-split"),
    (["run", TARGET, "-p", "x", "-sm", "row"], "-sm is llama.cpp's, with no counterpart here"),
    (["run", TARGET, "-p", "x", "-tb", "2"], "-tb is llama.cpp's, with no counterpart here: one pool of -t threads"),
    (["run", TARGET, "-p", "x", "-cnv"], "-cnv is llama.cpp's, with no counterpart here: `pydflash chat`"),
    (["chat", TARGET, "-no-cnv"], "-no-cnv is llama.cpp's"),
    (["run", TARGET, "-p", "x", "-nkvo"], "-nkvo is llama.cpp's"),
    (["serve", TARGET, "--grammar-file", "g.gbnf"], "each request's grammar, json_schema or response_format"),
    (["run", TARGET, "-p", "x", "--grammar-file", "nope.gbnf"], "--grammar-file nope.gbnf: cannot read it"),
    (["run", TARGET, "-p", "x", "--grammar", "root ::= \"a\"", "-j", "{}"], "two grammars: --grammar and"),
    (["run", TARGET, "-p", "x", "-j", "{nope"], "json_schema is not JSON"),
    (["serve", TARGET, "-nocb"], "slots generating at the same time are always batched"),
    (["serve", TARGET, "--ssl-key-file", "k.pem"], "--ssl-key-file is llama.cpp's"),
    (["run", TARGET, "-p", "x", "--spec-type", "draft-eagle3"], "--spec-type draft-eagle3: EAGLE-3 drafters are not"),
    (["run", TARGET, "-p", "x", "--spec-type", "ngram"], "--spec-type 'ngram', expected one of draft-dflash"),
    (["run", TARGET, "-p", "x", "--spec-type", "draft-mtp", "--proposers", "ngram"],
     "--spec-type draft-mtp means --proposers mtp, but --proposers is ngram"),
    (["run", TARGET, "-p", "x", "-n", "-2"], "-n/--predict = -2, expected a count >= 0, or -1"),
    (["run", TARGET, "-p", "x", "-c", "-1"], "-c/--ctx-size = -1, expected a size >= 1, or 0"),
    (["run", TARGET, "-p", "x", "-ub", "0"], "-ub/--ubatch-size = 0, expected at least 1"),
    (["serve", TARGET, "-to", "-5"], "-to/--timeout = -5, expected seconds > 0"),
    (["serve", TARGET, "--read-timeout", "0"], "-to/--timeout = 0, expected seconds > 0"),
    (["bench", TARGET, "--n-prompts", "0"], "--n-prompts = 0, expected at least 1"),
    (["run", TARGET, "-p", "x", "--draft", "8"], "--draft 8: no such file; --draft is the draft model here"),
    (["serve", TARGET, "--chat-template", "chatml", "--chat-format", "chatml"],
     "give one of --chat-template and --chat-format"),
])
def test_llama_cpp_flags_without_a_counterpart_are_refused_by_name(argv, message, capsys):
    """Before: argparse read -mg 0 as -m g, -tb as -t b, -cnv as -c nv, ...; a value that llama.cpp takes and we
    do not went through as a Python parameter's error, or silently (-n -1, -to -5: every request then 408)."""
    assert main(argv) == 1, argv
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_ports_are_checked_before_anything_loads(capsys):
    for argv in (["serve", TARGET, "--port", "99999"], ["rpc-server", "-p", "-1"], ["rpc-server", "-p", "70000"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert "expected a TCP port in [0, 65535]" in capsys.readouterr().err


def test_rpc_server_that_cannot_listen_says_where_and_why(capsys):
    """Before, ggml's server printed "Failed to create server socket" and the command exited 0."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["rpc-server", "-p", str(port), "-d", "cpu"]) == 1
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err
    assert main(["rpc-server", "-H", "999.1.1.1", "-d", "cpu"]) == 1
    assert "cannot listen on 999.1.1.1:50052" in capsys.readouterr().err


def test_an_unreachable_rpc_server_is_one_line(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    assert main(["run", TARGET, "-p", "x", "-n", "2", "--rpc", f"127.0.0.1:{port}"]) == 1
    assert capsys.readouterr().err == f"pydflash: error: could not connect to the RPC server at 127.0.0.1:{port}\n"


def test_the_prompts_escapes_are_read_as_llama_cpp_reads_them(tmp_path, capsys):
    """-p / -f with \\n, \\t, \\\\, \\xHH ... (llama.cpp's -e, on by default there and here): the characters they
    stand for; --no-escape: the backslashes as typed. Other backslashes stay (llama.cpp's
    string_process_escapes)."""
    from pydflash.llama_flags import process_escapes

    for typed, meant in (("a\\nb", "a\nb"), ("a\\\\nb", "a\\nb"), ("x\\x41y", "xAy"),
                         ("it\\'s \\\"q\\\"", "it's \"q\""), ("\\q\\xZZ", "\\q\\xZZ"),
                         ("tail\\", "tail\\"), ("\\xc3\\xa9\\r\\t", "\u00e9\r\t")):
        assert process_escapes(typed) == meant, typed
    typed = "def f(x):\\n    return"
    with pydflash.Model(TARGET, n_ctx=4096) as m:
        meant = m.generate("def f(x):\n    return", max_tokens=12).text
        as_typed = m.generate(typed, max_tokens=12).text
    assert meant != as_typed
    assert main(["run", TARGET, "-p", typed, "-n", "12"]) == 0
    assert capsys.readouterr().out == meant + "\n"
    (tmp_path / "p.txt").write_text(typed + "\n")
    assert main(["run", TARGET, "-f", str(tmp_path / "p.txt"), "-n", "12"]) == 0
    assert capsys.readouterr().out == meant + "\n"
    assert main(["run", TARGET, "-p", typed, "-n", "12", "--no-escape"]) == 0
    assert capsys.readouterr().out == as_typed + "\n"
