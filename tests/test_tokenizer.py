"""pydflash.tokenizer: exact agreement with llama.cpp's tokenizer fixtures, round trips, special tokens and
the errors raised for missing, broken or unsupported GGUF files."""

from __future__ import annotations

import struct
import threading
import time
from pathlib import Path

import gguf
import pytest

from pydflash.errors import GGUFFormatError, ModelLoadError, UnsupportedModelError
from pydflash.tokenizer import Tokenizer

VT = gguf.GGUFValueType
VOCABS = ["qwen2", "qwen35"]
SEP = "\n__ggml_vocab_test__\n"

# Qwen vocabulary ids (both fixture vocabularies share them).
ENDOFTEXT, IM_START, IM_END = 151643, 151644, 151645


# ---------------------------------------------------------------------------------------------------------
# llama.cpp vocabulary fixtures

def read_cases(gguf_path: Path) -> list[tuple[str, list[int]]]:
    """The (text, ids) cases of a llama.cpp vocab fixture, parsed like tests/test-tokenizer-0.cpp."""
    raw = gguf_path.with_name(gguf_path.name + ".inp").read_bytes().decode("utf-8")
    inputs = []
    pos = 0
    while pos < len(raw):
        nxt = raw.find(SEP, pos)
        if nxt < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:nxt])
        pos = nxt + len(SEP)
    # std::getline: lines split on "\n", no trailing empty line; each line stripped and split on spaces.
    text = gguf_path.with_name(gguf_path.name + ".out").read_bytes().decode("utf-8")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    outputs = [[int(tok) for tok in line.strip().split(" ") if tok] for line in lines]
    assert len(inputs) == len(outputs), f"{gguf_path}: {len(inputs)} inputs but {len(outputs)} outputs"
    return list(zip(inputs, outputs))


@pytest.fixture(scope="module")
def vocab_path(llama_cpp_dir):
    def path(name: str) -> Path:
        return llama_cpp_dir / "models" / f"ggml-vocab-{name}.gguf"
    return path


_loaded: dict[str, Tokenizer] = {}


@pytest.fixture(scope="module", params=VOCABS)
def qwen(request, vocab_path) -> tuple[str, Tokenizer, Path]:
    name = request.param
    path = vocab_path(name)
    if name not in _loaded:
        _loaded[name] = Tokenizer.from_gguf(path)
    return name, _loaded[name], path


def test_llama_cpp_fixtures_exact(qwen):
    name, tok, path = qwen
    cases = read_cases(path)
    assert len(cases) >= 40
    failures = []
    for text, expected in cases:
        got = tok.tokenize(text, add_special=False, parse_special=False)
        if got != expected:
            failures.append(f"{text!r}: expected {expected}, got {got}")
    assert not failures, f"{name}: {len(failures)}/{len(cases)} cases differ:\n" + "\n".join(failures)


def test_round_trip(qwen):
    # Byte-level BPE with no normaliser loses nothing, so every fixture string must come back unchanged.
    name, tok, path = qwen
    for text, _ in read_cases(path):
        ids = tok.tokenize(text, add_special=False)
        assert tok.detokenize(ids) == text, f"{name}: {text!r}"
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_properties(qwen):
    name, tok, path = qwen
    assert tok.n_vocab == 151936
    assert tok.pre == name
    assert tok.bos_token_id == ENDOFTEXT
    assert tok.eos_token_id == ENDOFTEXT
    assert tok.pad_token_id == ENDOFTEXT
    assert not tok.add_bos and not tok.add_eos
    assert isinstance(tok.chat_template, str) and "im_start" in tok.chat_template
    assert isinstance(tok.eog_token_ids, frozenset)
    assert {ENDOFTEXT, IM_END} <= tok.eog_token_ids
    assert IM_START not in tok.eog_token_ids
    # llama.cpp also ends generation on any token spelled "</s>" (added for paddleocr); in the Qwen
    # vocabulary that is an ordinary BPE token, and we follow llama.cpp.
    assert tok.tokenize("</s>", parse_special=True) == [128247]
    assert 128247 in tok.eog_token_ids
    assert "n_vocab=151936" in repr(tok)


def test_add_special_follows_gguf_flags(qwen):
    # The Qwen GGUFs set neither add_bos_token nor add_eos_token: add_special adds nothing.
    _, tok, _ = qwen
    assert tok.tokenize("Hello world", add_special=True) == tok.tokenize("Hello world", add_special=False)
    assert tok.tokenize("", add_special=True) == []


def test_parse_special(qwen):
    _, tok, _ = qwen
    text = "<|im_start|>user\nHello<|im_end|>\n"
    parsed = tok.tokenize(text, parse_special=True)
    assert parsed[0] == IM_START and parsed[-2] == IM_END
    assert parsed == [IM_START, *tok.tokenize("user\nHello"), IM_END, *tok.tokenize("\n")]
    # Without parse_special the markers are plain text, as in llama.cpp.
    plain = tok.tokenize(text)
    assert not {IM_START, IM_END, ENDOFTEXT} & set(plain)
    assert tok.detokenize(plain) == text
    # Rendering: control tokens print as their text unless skipped.
    assert tok.detokenize(parsed) == text
    assert tok.detokenize(parsed, skip_special=True) == "user\nHello\n"
    assert tok.token_bytes(IM_END) == b"<|im_end|>"


def test_user_defined_tokens_always_split(qwen):
    # token_type 4 (user-defined, here the "[PAD151650]" fillers) is matched even with parse_special=False.
    _, tok, _ = qwen
    for parse_special in (False, True):
        ids = tok.tokenize("a[PAD151650]b", parse_special=parse_special)
        assert 151650 in ids
        assert tok.detokenize(ids) == "a[PAD151650]b"
    assert tok.detokenize([151650], skip_special=True) == "[PAD151650]"


def test_token_bytes_partial_utf8(qwen):
    _, tok, _ = qwen
    text = "កាន់តែពិសេស 😶‍🌫️"
    ids = tok.tokenize(text)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    partial = [p for p in pieces if _invalid_utf8(p)]
    assert partial, "expected some tokens that hold part of a character"
    # A lone piece of a character decodes to U+FFFD (invalid UTF-8 replaced, like llama.cpp's callers).
    i = ids[pieces.index(partial[0])]
    assert "\ufffd" in tok.detokenize([i])
    with pytest.raises(IndexError):
        tok.token_bytes(tok.n_vocab)
    with pytest.raises(IndexError):
        tok.detokenize([-1])
    # ids that are not ints (before: a TypeError about '<=' on str, list indices, or a bool read as an id)
    for bad in ("a", 1.5, True):
        with pytest.raises(TypeError, match=rf"a token id must be an int, got {type(bad).__name__}"):
            tok.detokenize([bad])
        with pytest.raises(TypeError, match="a token id must be an int"):
            tok.token_bytes(bad)
    np = pytest.importorskip("numpy")
    assert tok.detokenize(np.array([i])) == tok.detokenize([i]) and tok.token_bytes(np.int64(i)) == tok.token_bytes(i)


def _invalid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_bytes_input(qwen):
    _, tok, _ = qwen
    assert tok.tokenize("héllo wörld".encode()) == tok.tokenize("héllo wörld")
    # llama.cpp replaces each undecodable byte by U+FFFD (a truncated 3-byte sequence gives two).
    assert tok.tokenize(b"a\xe2\x82b") == tok.tokenize("a\ufffd\ufffdb")
    assert tok.tokenize(bytearray(b"\xff")) == tok.tokenize("\ufffd")
    # A str with a lone surrogate (no UTF-8 form) is treated like its invalid bytes.
    assert tok.tokenize("a\ud800b") == tok.tokenize("a\ufffd\ufffd\ufffdb")
    with pytest.raises(TypeError):
        tok.tokenize(123)  # type: ignore[arg-type]


def test_thread_safety(qwen):
    # parse_special is per call even when threads mix both modes.
    _, tok, _ = qwen
    text = "<|im_start|>x<|im_end|>" * 20
    want = {True: tok.tokenize(text, parse_special=True), False: tok.tokenize(text, parse_special=False)}
    errors = []

    def work(mode: bool):
        for _ in range(200):
            if tok.tokenize(text, parse_special=mode) != want[mode]:
                errors.append(mode)

    threads = [threading.Thread(target=work, args=(m,)) for m in (True, False, True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_load_time(vocab_path):
    # 151k tokens + 151k merges. Budget ~2 s; the bound is loose for busy CI machines but catches a return
    # to gguf.GGUFReader (5-10 s on this vocabulary).
    start = time.perf_counter()
    Tokenizer.from_gguf(vocab_path("qwen35"))
    assert time.perf_counter() - start < 4.0


# ---------------------------------------------------------------------------------------------------------
# Small synthetic GGUFs

def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> character table, indexed by byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


BYTE_CHARS = _bytes_to_unicode()
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
TOKENS = BYTE_CHARS + [m.replace(" ", "") for m in MERGES] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                                             "<think>"]
TYPES = [1] * (len(TOKENS) - 4) + [3, 3, 3, 4]
T_HELLO = TOKENS.index("hello")
T_WORLD = TOKENS.index("Ġworld")
T_EOT, T_IM_START, T_IM_END, T_THINK = range(len(TOKENS) - 4, len(TOKENS))


def tiny_kv(**changes) -> dict[str, tuple]:
    """Metadata of a small valid vocabulary; `changes` maps key (dots as "__") to (type, value[, subtype])
    or None to leave the key out."""
    kv: dict[str, tuple | None] = {
        "tokenizer.ggml.model": (VT.STRING, "gpt2"),
        "tokenizer.ggml.pre": (VT.STRING, "qwen2"),
        "tokenizer.ggml.tokens": (VT.ARRAY, TOKENS, VT.STRING),
        "tokenizer.ggml.token_type": (VT.ARRAY, TYPES, VT.INT32),
        "tokenizer.ggml.merges": (VT.ARRAY, MERGES, VT.STRING),
        "tokenizer.ggml.bos_token_id": (VT.UINT32, T_EOT),
        "tokenizer.ggml.eos_token_id": (VT.UINT32, T_EOT),
        "tokenizer.chat_template": (VT.STRING, "{{ messages }}"),
    }
    for key, value in changes.items():
        kv[key.replace("__", ".")] = value
    return {k: v for k, v in kv.items() if v is not None}


def write_gguf(path: Path, kv: dict[str, tuple]) -> Path:
    w = gguf.GGUFWriter(str(path), arch="qwen3")
    for key, (vtype, value, *sub) in kv.items():
        w.add_key_value(key, value, vtype, sub_type=sub[0] if sub else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


@pytest.fixture
def tiny(tmp_path) -> Path:
    return write_gguf(tmp_path / "tiny.gguf", tiny_kv())


def test_tiny_vocab(tiny):
    tok = Tokenizer.from_gguf(tiny)
    assert tok.n_vocab == len(TOKENS)
    assert tok.pre == "qwen2"
    assert tok.chat_template == "{{ messages }}"
    assert tok.tokenize("hello world") == [T_HELLO, T_WORLD]
    assert tok.tokenize("<think>hello", parse_special=False) == [T_THINK, T_HELLO]
    assert tok.tokenize("hello<|im_end|>", parse_special=True) == [T_HELLO, T_IM_END]
    assert T_IM_END not in tok.tokenize("hello<|im_end|>")
    assert tok.eog_token_ids == {T_EOT, T_IM_END}
    assert tok.detokenize([T_HELLO, T_WORLD, T_IM_END]) == "hello world<|im_end|>"
    assert tok.detokenize([T_HELLO, T_IM_END, T_THINK], skip_special=True) == "hello<think>"


def test_from_reader_matches_from_gguf(tiny):
    a = Tokenizer.from_gguf(tiny)
    b = Tokenizer.from_reader(gguf.GGUFReader(tiny), tiny)
    text = "hello world <|im_start|><think> héllo"
    for parse_special in (False, True):
        assert a.tokenize(text, parse_special=parse_special) == b.tokenize(text, parse_special=parse_special)
    assert (a.n_vocab, a.eog_token_ids, a.chat_template) == (b.n_vocab, b.eog_token_ids, b.chat_template)


def test_add_bos_eos(tmp_path):
    path = write_gguf(tmp_path / "bos.gguf", tiny_kv(tokenizer__ggml__add_bos_token=(VT.BOOL, True),
                                                     tokenizer__ggml__add_eos_token=(VT.BOOL, True)))
    tok = Tokenizer.from_gguf(path)
    assert tok.add_bos and tok.add_eos
    assert tok.tokenize("hello") == [T_EOT, T_HELLO, T_EOT]
    assert tok.tokenize("hello", add_special=False) == [T_HELLO]
    assert tok.tokenize("") == [T_EOT, T_EOT]


def test_optional_keys_absent(tmp_path):
    path = write_gguf(tmp_path / "bare.gguf", tiny_kv(tokenizer__ggml__bos_token_id=None,
                                                      tokenizer__ggml__eos_token_id=None,
                                                      tokenizer__chat_template=None))
    tok = Tokenizer.from_gguf(path)
    assert tok.bos_token_id is None and tok.eos_token_id is None and tok.chat_template is None
    # <|endoftext|> and <|im_end|> still end generation, by their text.
    assert tok.eog_token_ids == {T_EOT, T_IM_END}


def test_eog_text_forces_control(tmp_path):
    # A token spelled like an end-of-turn marker is made control even when the GGUF says user-defined,
    # so parse_special=False no longer matches it (llama.cpp does the same and warns).
    types = TYPES[:-4] + [3, 3, 4, 4]
    path = write_gguf(tmp_path / "t.gguf", tiny_kv(tokenizer__ggml__token_type=(VT.ARRAY, types, VT.INT32)))
    tok = Tokenizer.from_gguf(path)
    assert T_IM_END in tok.eog_token_ids
    assert T_IM_END not in tok.tokenize("<|im_end|>")
    assert tok.tokenize("<|im_end|>", parse_special=True) == [T_IM_END]


# ---------------------------------------------------------------------------------------------------------
# Bad input

def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        Tokenizer.from_gguf(tmp_path / "absent.gguf")


def test_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="directory"):
        Tokenizer.from_gguf(tmp_path)


@pytest.mark.parametrize("content", [b"", b"GG", b"not a gguf file at all", b"\x00" * 64])
def test_not_gguf(tmp_path, content):
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError) as e:
        Tokenizer.from_gguf(path)
    assert str(path) in str(e.value)
    assert not isinstance(e.value, GGUFFormatError)


def test_unsupported_gguf_version(tmp_path):
    path = tmp_path / "v1.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    with pytest.raises(UnsupportedModelError, match="version 1"):
        Tokenizer.from_gguf(path)


def test_truncated(tiny, tmp_path):
    data = tiny.read_bytes()
    path = tmp_path / "cut.gguf"
    # Every cut inside the header and key table, and a spread of cuts through the large arrays.
    for n in [*range(0, 64), *range(64, len(data), 97), len(data) - 1]:
        path.write_bytes(data[:n])
        with pytest.raises(ModelLoadError) as e:
            Tokenizer.from_gguf(path)
        assert str(path) in str(e.value), n


def test_corrupt_lengths(tiny, tmp_path):
    # A key count and an array length of ~2**64 must be reported, not attempted.
    data = bytearray(tiny.read_bytes())
    struct.pack_into("<Q", data, 16, 2**64 - 1)  # kv count
    path = tmp_path / "kv.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="truncated"):
        Tokenizer.from_gguf(path)

    data = bytearray(tiny.read_bytes())
    key = b"tokenizer.ggml.token_type"
    pos = data.index(key) + len(key) + 4 + 4  # value type ARRAY, element type INT32, then the length
    struct.pack_into("<Q", data, pos, 2**63)
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="truncated"):
        Tokenizer.from_gguf(path)


@pytest.mark.parametrize("key", ["tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                                 "tokenizer.ggml.merges"])
def test_missing_key(tmp_path, key):
    path = write_gguf(tmp_path / "m.gguf", tiny_kv(**{key.replace(".", "__"): None}))
    with pytest.raises(GGUFFormatError) as e:
        Tokenizer.from_gguf(path)
    msg = str(e.value)
    assert str(path) in msg and key in msg and "missing" in msg


@pytest.mark.parametrize("key,value,expected,actual", [
    ("tokenizer.ggml.model", (VT.UINT32, 2), "STRING", "UINT32"),
    ("tokenizer.ggml.tokens", (VT.STRING, "abc"), "ARRAY[STRING]", "STRING"),
    ("tokenizer.ggml.tokens", (VT.ARRAY, list(range(len(TOKENS))), VT.INT32), "ARRAY[STRING]", "ARRAY[INT32]"),
    ("tokenizer.ggml.token_type", (VT.ARRAY, TOKENS, VT.STRING), "ARRAY[INT32]", "ARRAY[STRING]"),
    ("tokenizer.ggml.merges", (VT.UINT8, 1), "ARRAY[STRING]", "UINT8"),
    ("tokenizer.ggml.add_bos_token", (VT.UINT8, 1), "BOOL", "UINT8"),
    ("tokenizer.ggml.eos_token_id", (VT.FLOAT32, 1.0), "UINT32", "FLOAT32"),
    ("tokenizer.chat_template", (VT.ARRAY, ["a", "b"], VT.STRING), "STRING", "ARRAY[STRING]"),
])
def test_wrong_type(tmp_path, key, value, expected, actual):
    path = write_gguf(tmp_path / "w.gguf", tiny_kv(**{key.replace(".", "__"): value}))
    with pytest.raises(GGUFFormatError) as e:
        Tokenizer.from_gguf(path)
    msg = str(e.value)
    assert str(path) in msg and key in msg and expected in msg and actual in msg


@pytest.mark.parametrize("key,value", [("tokenizer.ggml.model", "llama"), ("tokenizer.ggml.pre", "llama-bpe")])
def test_unsupported_tokenizer(tmp_path, key, value):
    path = write_gguf(tmp_path / "u.gguf", tiny_kv(**{key.replace(".", "__"): (VT.STRING, value)}))
    with pytest.raises(UnsupportedModelError) as e:
        Tokenizer.from_gguf(path)
    msg = str(e.value)
    assert str(path) in msg and key in msg and value in msg


def test_inconsistent_vocab(tmp_path):
    path = write_gguf(tmp_path / "a.gguf", tiny_kv(tokenizer__ggml__token_type=(VT.ARRAY, TYPES[:-1], VT.INT32)))
    with pytest.raises(GGUFFormatError, match="token_type.*entries"):
        Tokenizer.from_gguf(path)

    path = write_gguf(tmp_path / "b.gguf", tiny_kv(tokenizer__ggml__merges=(VT.ARRAY, ["h e", "ll"], VT.STRING)))
    with pytest.raises(GGUFFormatError, match="merges.*'ll'"):
        Tokenizer.from_gguf(path)

    path = write_gguf(tmp_path / "c.gguf", tiny_kv(tokenizer__ggml__merges=(VT.ARRAY, ["h e", "x yz"],
                                                                           VT.STRING)))
    with pytest.raises(GGUFFormatError, match="merges"):
        Tokenizer.from_gguf(path)

    path = write_gguf(tmp_path / "d.gguf", tiny_kv(tokenizer__ggml__add_bos_token=(VT.BOOL, True),
                                                   tokenizer__ggml__bos_token_id=(VT.UINT32, 10**6)))
    with pytest.raises(GGUFFormatError, match="add_bos_token"):
        Tokenizer.from_gguf(path)
