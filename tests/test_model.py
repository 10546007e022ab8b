"""pydflash.Model: the Python surface, and every bad-input case of GGUF loading."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from gguf_edit import rewrite

import pydflash
from pydflash import _core
from pydflash.errors import (
    ContextLengthExceededError,
    GGUFFormatError,
    ModelLoadError,
    UnsupportedModelError,
)


@pytest.fixture(scope="module")
def gguf_path(qwen3_checkpoint, tmp_path_factory):
    from pydflash.convert import convert_hf_to_gguf

    out = tmp_path_factory.mktemp("model") / "tiny-f32.gguf"
    return convert_hf_to_gguf(qwen3_checkpoint("gqa4x2_hd64"), out, outtype="f32", progress=False)


@pytest.fixture(scope="module")
def model(gguf_path):
    with pydflash.Model(gguf_path, n_ctx=512) as m:
        yield m


def test_generate_returns_completion(model):
    c = model.generate("def fib(n):", max_tokens=20)
    assert isinstance(c, pydflash.Completion)
    assert c.finish_reason in ("length", "stop")
    assert 0 < len(c.tokens) <= 20
    assert c.text == model.detokenize(c.tokens)
    for key in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "prompt_per_second",
                "predicted_per_second"):
        assert key in c.timings
    assert c.timings["predicted_n"] == len(c.tokens)


def test_generate_is_deterministic_and_reuses_the_prompt_cache(model):
    a = model.generate("import os\n", max_tokens=16)
    b = model.generate("import os\n", max_tokens=16)
    assert a.tokens == b.tokens
    assert b.timings["cached_n"] > 0  # the second call re-used the cached prompt prefix


def test_token_prompt_equals_text_prompt(model):
    ids = model.tokenize("class Foo:")
    assert model.generate(ids, max_tokens=12).tokens == model.generate("class Foo:", max_tokens=12).tokens


def test_stream_concatenates_to_generate(model):
    pieces = list(model.stream("for i in range(", max_tokens=24))
    assert "".join(pieces) == model.generate("for i in range(", max_tokens=24).text
    for piece in pieces:
        piece.encode("utf-8")  # never a lone surrogate / split character


def test_stream_closed_early_stops_generation(model):
    it = model.stream("while True:", max_tokens=200)
    next(it)
    it.close()
    # the model is usable afterwards
    assert model.generate("x = ", max_tokens=4).tokens


def test_stop_string_cuts_text(model):
    full = model.generate("def f(x):", max_tokens=32)
    assert len(full.text) > 4
    stop = full.text[2:4]
    cut = model.generate("def f(x):", max_tokens=32, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    assert "".join(model.stream("def f(x):", max_tokens=32, stop=stop)) == cut.text


def test_max_tokens_zero_and_bad_arguments(model):
    assert model.generate("a", max_tokens=0).tokens == []
    assert model.generate("a", max_tokens=0, temperature=0.7, logprobs=2).logprobs["token_logprobs"] == []
    with pytest.raises(ValueError):
        model.generate([], max_tokens=4)


def test_prompt_longer_than_context(gguf_path):
    with pydflash.Model(gguf_path, n_ctx=16) as m:
        with pytest.raises(ContextLengthExceededError) as info:
            m.generate(list(range(1, 40)), max_tokens=4)
        assert info.value.n_ctx == 16
        # a text that cannot fit whatever its tokens: refused before it is tokenized
        with pytest.raises(ContextLengthExceededError, match=r"the prompt has 1000000 bytes, more than n_ctx = 16 "):
            m.generate(b"x" * 10**6, max_tokens=4)
        # generation that reaches n_ctx ends with "length" at the context limit
        c = m.generate(list(range(1, 10)), max_tokens=100)
        assert c.finish_reason == "length"
        assert 9 + len(c.tokens) <= 16 + 1


def test_generate_releases_the_gil(model):
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(1)
            stop.wait(0.001)

    t = threading.Thread(target=ticker)
    t.start()
    model._session.generate(model.tokenize("x"), max_tokens=200, stop_tokens=[])
    stop.set()
    t.join()
    assert len(ticks) > 1


def test_kv_types_and_sizes(gguf_path):
    sizes = {}
    for kv in ("f32", "f16", "q8_0", "q4_0"):
        with pydflash.Model(gguf_path, n_ctx=256, kv_type=kv) as m:
            sizes[kv] = m.kv_bytes
            assert m.generate("def", max_tokens=4).tokens
    assert sizes["f32"] == 2 * sizes["f16"] > sizes["q8_0"] > sizes["q4_0"]
    with pytest.raises(ValueError):
        pydflash.Model(gguf_path, kv_type="q3_k")


def test_context_that_does_not_fit_in_memory(gguf_path):
    with pytest.raises(ContextLengthExceededError, match="n_ctx"):
        pydflash.Model(gguf_path, n_ctx=2**30)


def test_closed_model_raises(gguf_path):
    m = pydflash.Model(gguf_path, n_ctx=64)
    m.close()
    with pytest.raises(RuntimeError, match="closed"):
        m.generate("a")
    # its properties too (before: AttributeError on None, or a silently wrong proposers == () and tree budget)
    for name in ("n_ctx", "n_ubatch", "n_vocab", "arch", "n_threads", "kv_bytes", "recurrent_bytes", "tree_budget",
                 "block_size", "proposers"):
        with pytest.raises(RuntimeError, match="this Model is closed"):
            getattr(m, name)


def test_close_ends_what_runs_and_what_starts_later(tmp_path, monkeypatch):
    """close() with a stream not yet started, or while another thread generates (a fresh cache: the first long
    prompt measures its micro-batch): before, AttributeError on None from inside the generation (the session read
    after the close). Now the generation in progress is aborted and the close waits for it; one started later
    raises "closed". Each delay lands the close somewhere else in the call."""
    from export_pairs import pair_file

    target, draft = pair_file("qwen3", "target", "q8_0"), pair_file("qwen3", "dflash", "q8_0")
    m = pydflash.Model(target, draft_model_path=draft, n_ctx=256)
    pieces = m.pieces("Hello", max_tokens=16)
    m.close()
    with pytest.raises(RuntimeError, match="this Model is closed"):
        list(pieces)
    for delay in (0.0, 0.005, 0.02, 0.05, 0.2):
        monkeypatch.setenv("PYDFLASH_CACHE", str(tmp_path / f"cache-{delay}"))
        m = pydflash.Model(target, draft_model_path=draft, n_ctx=1024)
        outcome = []

        def run():
            try:
                outcome.append(m.generate("Hi " * 500, max_tokens=64).finish_reason)
            except RuntimeError as e:  # (closed before it began)
                outcome.append(str(e))

        worker = threading.Thread(target=run)
        worker.start()
        time.sleep(delay)
        m.close()
        worker.join(60)
        assert not worker.is_alive() and outcome in (["abort"], ["length"], ["this Model is closed"]), (delay, outcome)


def test_a_model_is_not_pickled(model):
    import pickle

    with pytest.raises(TypeError, match=r"a Model \(.*tiny-f32\.gguf\) cannot be pickled"):  # (before: '_thread.lock')
        pickle.dumps(model)


def test_pieces_are_iterated_once(model):
    pieces = model.pieces("def f(x):", max_tokens=4)
    assert "".join(text for text, _ in pieces) == pieces.completion.text
    with pytest.raises(RuntimeError, match="iterated once"):  # (before: TypeError from inside)
        list(pieces)


def test_arguments_are_checked_when_the_call_is_made(model):
    """stream() checks its prompt and arguments at the call, as pieces() does (before: at the first next());
    one text where a list of prompts goes, token ids that are not ids, and a bias that bans every token are
    refused by name."""
    with pytest.raises(ValueError, match="top_p = 5.0"):
        model.stream("a", top_p=5)
    with pytest.raises(ValueError, match="the prompt is empty"):
        model.stream("")
    with pytest.raises(TypeError, match="prompts must be a list of prompts"):
        model.generate_batch("some prompt")
    with pytest.raises(TypeError, match=r"^pieces\(\) got an unexpected keyword argument 'bogus'$"):
        model.pieces("a", bogus=1)  # (it named Model._sampling())
    for prompts in ({"a": 1}, 5):  # (a dict's keys were generated, an int said "'int' object is not iterable")
        with pytest.raises(TypeError, match=rf"prompts must be a list of prompts .*got {type(prompts).__name__}"):
            model.generate_batch(prompts)
    with pytest.raises(TypeError, match=r"tokens must be text or a sequence of token ids"):
        model.detokenize("abc")
    with pytest.raises(ValueError, match=r"tokens\[0\] = -1 is outside the vocabulary"):
        model.detokenize([-1])
    banned = {t: float("-inf") for t in range(model.n_vocab)}
    with pytest.raises(ValueError, match=f"logit_bias bans every one of the {model.n_vocab} tokens"):
        model.generate("a", logit_bias=banned)
    del banned[7]  # one left: it is what comes out
    assert set(model.generate("a", max_tokens=3, logit_bias=banned).tokens) == {7}


# ---- bad GGUF input: a typed error naming the file and key/tensor, never a crash ----

def load(path):
    return _core.Model(str(path))


def test_every_error_comes_with_the_package():
    """docs/api.md: `import pydflash` gives the errors (ModelBusyError, raised by a second call at once, was only
    in pydflash.errors)"""
    from pydflash import errors

    for name in errors.__all__:
        assert getattr(pydflash, name) is getattr(errors, name) and name in pydflash.__all__, name


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        pydflash.Model(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="nope.gguf"):
        load(tmp_path / "nope.gguf")
    for call in (pydflash.Model, pydflash.plan):  # (before: os.fspath's message, naming no parameter)
        with pytest.raises(TypeError, match="model_path must be a str or os.PathLike, got NoneType"):
            call(None)


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load(p)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load(tmp_path / "empty.gguf")


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.0005])
def test_truncated_file(gguf_path, tmp_path, keep):
    data = open(gguf_path, "rb").read()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*(truncated|malformed)"):
        load(p)


def test_missing_key(gguf_path, tmp_path):
    p = rewrite(gguf_path, tmp_path / "k.gguf", drop_keys=["qwen3.attention.layer_norm_rms_epsilon"])
    with pytest.raises(GGUFFormatError, match=r"k\.gguf.*'qwen3\.attention\.layer_norm_rms_epsilon'"):
        load(p)


def test_wrong_key_type(gguf_path, tmp_path):
    p = rewrite(gguf_path, tmp_path / "t.gguf",
                set_keys={"qwen3.block_count": ("two", gguf.GGUFValueType.STRING)})
    with pytest.raises(GGUFFormatError, match=r"'qwen3\.block_count' has type str.*expected an unsigned integer"):
        load(p)


def test_missing_tensor(gguf_path, tmp_path):
    p = rewrite(gguf_path, tmp_path / "m.gguf", drop_tensors=["blk.1.ffn_down.weight"])
    with pytest.raises(GGUFFormatError, match=r"missing required tensor 'blk\.1\.ffn_down\.weight'"):
        load(p)


def test_wrong_tensor_shape(gguf_path, tmp_path):
    reader = gguf.GGUFReader(gguf_path)
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight")
    rows, cols = t.data.shape
    p = rewrite(gguf_path, tmp_path / "s.gguf", reshape={"blk.0.attn_k.weight": (rows // 2, cols)})
    with pytest.raises(GGUFFormatError, match=r"'blk\.0\.attn_k\.weight' has shape \{%d, %d\}, expected \{%d, %d\}"
                       % (cols, rows // 2, cols, rows)):
        load(p)


def test_unknown_architecture(gguf_path, tmp_path):
    p = rewrite(gguf_path, tmp_path / "a.gguf", arch="llama")
    with pytest.raises(UnsupportedModelError, match=r"general\.architecture = 'llama'.*qwen3"):
        load(p)


def test_vocab_only_file_is_not_a_model(llama_cpp_dir, tmp_path):
    src = llama_cpp_dir / "models" / "ggml-vocab-qwen2.gguf"
    p = tmp_path / "vocab.gguf"
    shutil.copy(src, p)
    with pytest.raises(UnsupportedModelError, match="qwen2"):
        load(p)


def test_our_vocab_only_file_says_what_it_is(qwen3_checkpoint, tmp_path):
    """(before: "key 'qwen3.block_count' = 2 but the file has tensors for 0 layers")"""
    from pydflash.convert import convert_hf_to_gguf

    vocab = convert_hf_to_gguf(qwen3_checkpoint("gqa4x2_hd64"), tmp_path / "vocab.gguf", vocab_only=True,
                               progress=False)
    for call in (pydflash.Model, pydflash.plan):
        with pytest.raises(GGUFFormatError, match=r"vocab\.gguf: the file holds no tensors \(a vocabulary-only GGUF"):
            call(vocab)


HUGE_PAGE_PROBE = """
import re, sys
import pydflash

def advised_kib():  # VMAs the process asked huge pages for (VmFlags "hg")
    total = 0
    for block in re.split(r"\\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read()):
        if re.search(r"^VmFlags:.* hg", block, re.M):
            total += int(re.search(r"^Size:\\s+(\\d+) kB", block, re.M).group(1))
    return total

before = advised_kib()
with pydflash.Model(sys.argv[1], n_ctx=64) as m:
    print(before, advised_kib())
"""


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
                    reason="no transparent huge pages (Linux only)")
def test_weights_in_system_memory_ask_for_huge_pages(tmp_path):
    """A decode step reads every active weight: their buffers ask the kernel for 2 MiB pages (madvise), as the
    process's memory map shows (the weights of the f32 pair: one CPU buffer the size of the file)."""
    import subprocess
    import sys

    path = Path(__file__).parent / "data" / "pairs" / "qwen3-target-f32.gguf"
    # its own cwd, so the installed package is imported (not the source tree's, which has no extension)
    res = subprocess.run([sys.executable, "-c", HUGE_PAGE_PROBE, str(path)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout.split()
    before, loaded = int(out[0]), int(out[1])
    assert loaded - before >= 0.9 * path.stat().st_size / 1024, (before, loaded, path.stat().st_size)
