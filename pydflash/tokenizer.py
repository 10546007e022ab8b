"""Text <-> token ids for the Qwen3 / Qwen3.5 GGUF models pydflash runs, matching llama.cpp token for token.

The vocabulary, merges and flags come from the GGUF metadata; the byte-level BPE itself is Hugging Face
`tokenizers`, configured the way llama.cpp tokenizes the `qwen2` / `qwen35` pre-tokenizer types
(see src/llama-vocab.cpp in the pinned llama.cpp tree, which this module follows rule by rule):

* text is first split on special tokens: user-defined tokens (token_type 4) always, control / unknown
  tokens (3 / 2) only when `parse_special=True`;
* the remaining text is split with the pre-tokenizer regex, mapped to GPT-2 "byte-level" characters and
  merged with BPE;
* pieces are turned back into bytes per token (`token_bytes`); control tokens render as their text.

Reading the metadata: `gguf.GGUFReader` builds numpy views for every element of every array, which takes
5-10 s for a 151k-token vocabulary (300k strings). `Tokenizer.from_gguf` therefore reads the keys with ggml's
gguf parser in the core (~0.3 s); `Tokenizer.from_reader` accepts a reader that is already open.
"""

from __future__ import annotations

import codecs
import functools
import operator
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from .errors import GGUFFormatError, ModelLoadError, UnsupportedModelError

__all__ = ["Tokenizer"]

_T = gguf.GGUFValueType
_NORMAL = int(gguf.TokenType.NORMAL)
_UNKNOWN = int(gguf.TokenType.UNKNOWN)
_CONTROL = int(gguf.TokenType.CONTROL)
_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)
_UNUSED = int(gguf.TokenType.UNUSED)
_BYTE = int(gguf.TokenType.BYTE)

_KEY_MODEL = gguf.Keys.Tokenizer.MODEL
_KEY_PRE = gguf.Keys.Tokenizer.PRE
_KEY_TOKENS = gguf.Keys.Tokenizer.LIST
_KEY_TOKEN_TYPE = gguf.Keys.Tokenizer.TOKEN_TYPE
_KEY_MERGES = gguf.Keys.Tokenizer.MERGES
_KEY_ADD_BOS = gguf.Keys.Tokenizer.ADD_BOS
_KEY_ADD_EOS = gguf.Keys.Tokenizer.ADD_EOS
_KEY_CHAT_TEMPLATE = gguf.Keys.Tokenizer.CHAT_TEMPLATE

# Special-token id keys, by the slot name used below.
_ID_KEYS = {
    "bos": gguf.Keys.Tokenizer.BOS_ID,
    "eos": gguf.Keys.Tokenizer.EOS_ID,
    "eot": gguf.Keys.Tokenizer.EOT_ID,
    "eom": gguf.Keys.Tokenizer.EOM_ID,
    "pad": gguf.Keys.Tokenizer.PAD_ID,
    "fim_pre": gguf.Keys.Tokenizer.FIM_PRE_ID,
    "fim_suf": gguf.Keys.Tokenizer.FIM_SUF_ID,
    "fim_mid": gguf.Keys.Tokenizer.FIM_MID_ID,
    "fim_pad": gguf.Keys.Tokenizer.FIM_PAD_ID,
    "fim_rep": gguf.Keys.Tokenizer.FIM_REP_ID,
    "fim_sep": gguf.Keys.Tokenizer.FIM_SEP_ID,
}

# The keys whose values are read; every other key is skipped without decoding its (possibly large) value.
_WANTED_KEYS = frozenset({_KEY_MODEL, _KEY_PRE, _KEY_TOKENS, _KEY_TOKEN_TYPE, _KEY_MERGES, _KEY_ADD_BOS,
                          _KEY_ADD_EOS, _KEY_CHAT_TEMPLATE, *_ID_KEYS.values()})

# Pre-tokenizer regexes, verbatim from llama.cpp (src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_QWEN2 / _QWEN35).
# tokenizer.json has `(?i:'s|'t|'re|'ve|'m|'ll|'d)`; llama.cpp spells the case-insensitive group out, which
# also keeps Oniguruma's case folding from matching e.g. "'ſ" (U+017F folds to "s").
_QWEN2_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# qwen35 differs only in counting combining marks (\p{M}) as part of letter runs.
_QWEN35_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                 r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre values llama.cpp maps to these two pre-tokenizer types.
_PRE_REGEXES = {
    "qwen2": _QWEN2_REGEX,
    "deepseek-r1-qwen": _QWEN2_REGEX,
    "kormo": _QWEN2_REGEX,
    "f2llmv2": _QWEN2_REGEX,
    "qwen35": _QWEN35_REGEX,
}

# Special tokens llama.cpp finds by their text when the GGUF does not name them, in llama.cpp's order
# (llama_vocab::impl::load). A detected token is also forced to control type.
_AUTODETECT = (
    ("eot", ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
             "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")),
    ("eom", ("<|eom_id|>",)),
    ("fim_pre", ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                 "<|code_prefix|>", "<|prefix|>")),
    ("fim_suf", ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                 "<|code_suffix|>", "<|suffix|>")),
    ("fim_mid", ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                 "<|code_middle|>", "<|middle|>")),
    ("fim_pad", ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
    ("fim_rep", ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
    ("fim_sep", ("<|file_sep|>",)),
)

# Tokens that end generation because of their text (llama.cpp: "maintain a list of tokens that cause
# end-of-generation", ref. llama.cpp issue 9606). They are forced to control type as well.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})


# --------------------------------------------------------------------------------------------------------
# Byte-level alphabet and UTF-8 handling

def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character standing for each byte -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char_to_byte = {chr(b): b for b in printable}
    n = 0
    for b in range(256):
        if b not in char_to_byte.values():
            char_to_byte[chr(256 + n)] = b
            n += 1
    return char_to_byte


_CHAR_TO_BYTE = _byte_level_alphabet()
# str.translate table taking a byte-level string to a string of code points < 256 (then encoded as latin-1).
# Code points < 256 that are not in the alphabet map to U+FFFF so that the latin-1 encode fails on them.
_BYTE_LEVEL_DECODE = {ord(c): b for c, b in _CHAR_TO_BYTE.items()}
_BYTE_LEVEL_DECODE.update({cp: 0xFFFF for cp in range(256) if chr(cp) not in _CHAR_TO_BYTE})


def _byte_level_to_bytes(text: str) -> bytes:
    """The bytes a byte-level BPE token text stands for (llama_decode_text)."""
    try:
        return text.translate(_BYTE_LEVEL_DECODE).encode("latin-1")
    except UnicodeEncodeError:
        pass
    # A character outside the alphabet: llama.cpp writes a marker (including the whole token text).
    out = bytearray()
    for c in text:
        if c in _CHAR_TO_BYTE:
            out.append(_CHAR_TO_BYTE[c])
        else:
            utf8 = c.encode("utf-8", "surrogatepass")
            out += b"[UNK_BYTE_0x" + utf8.hex().encode() + text.encode("utf-8", "surrogatepass") + b"]"
    return bytes(out)


def _byte_level_to_bytes_all(texts: list[str]) -> list[bytes]:
    """_byte_level_to_bytes of every text, in one translate/encode pass over their concatenation (the
    translation is one character to one character, so each token's bytes are a slice of the result)."""
    try:
        blob = "".join(texts).translate(_BYTE_LEVEL_DECODE).encode("latin-1")
    except UnicodeEncodeError:
        return [_byte_level_to_bytes(text) for text in texts]
    out = []
    off = 0
    for text in texts:
        n = len(text)
        out.append(blob[off:off + n])
        off += n
    return out


def _replace_each_byte(exc: UnicodeError) -> tuple[str, int]:
    # llama.cpp (unicode_cpts_from_utf8) replaces every byte it cannot decode with U+FFFD and resumes at
    # the next byte; Python's "replace" would use one U+FFFD for a whole truncated sequence.
    if isinstance(exc, UnicodeDecodeError):
        return "\ufffd", exc.start + 1
    raise exc


_UTF8_ERRORS = "pydflash.replace_each_byte"
codecs.register_error(_UTF8_ERRORS, _replace_each_byte)


# --------------------------------------------------------------------------------------------------------
# GGUF metadata

@dataclass(frozen=True)
class _Value:
    """One metadata value: its GGUF type (element type for arrays) and the decoded Python value."""
    type: _T
    elem: _T | None  # element type when type is ARRAY
    value: Any


_INT_TYPES = frozenset({_T.UINT8, _T.INT8, _T.UINT16, _T.INT16, _T.UINT32, _T.INT32, _T.UINT64, _T.INT64})


def _type_name(t: _T, elem: _T | None = None) -> str:
    return f"ARRAY[{elem.name}]" if t == _T.ARRAY and elem is not None else t.name


def _read_metadata(path: str) -> dict[str, _Value]:
    """The tokenizer keys, parsed by ggml's gguf reader in the core (gguf.GGUFReader takes ~10 s on a
    151k-token vocabulary because it makes a numpy view per string)."""
    from . import _core

    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ModelLoadError(f"{path}: is a directory, expected a GGUF file")
    raw = _core.gguf_metadata(path, sorted(_WANTED_KEYS))
    return {key: _Value(_T(t), None if elem is None else _T(elem), value) for key, (t, elem, value) in raw.items()}


def _metadata_from_reader(reader: gguf.GGUFReader, path: str) -> dict[str, _Value]:
    out: dict[str, _Value] = {}
    for key in _WANTED_KEYS:
        field = reader.fields.get(key)
        if field is None:
            continue
        types = list(field.types)
        t = types[0]
        elem = types[-1] if t == _T.ARRAY and len(types) > 1 else None
        try:
            value = field.contents()
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"{path}: key '{key}' is not valid UTF-8 ({e})") from None
        if t == _T.BOOL:
            value = bool(value)
        out[key] = _Value(t, elem, value)
    return out


class _Meta:
    """Typed access to the metadata, raising GGUFFormatError naming the file, key, expected and actual."""

    def __init__(self, values: Mapping[str, _Value], path: str):
        self.values = values
        self.path = path

    def _get(self, key: str, expected: str, ok, required: bool) -> _Value | None:
        v = self.values.get(key)
        if v is None:
            if required:
                raise GGUFFormatError(f"{self.path}: missing key '{key}' (expected {expected})")
            return None
        if not ok(v):
            raise GGUFFormatError(f"{self.path}: key '{key}' has type {_type_name(v.type, v.elem)}, "
                                  f"expected {expected}")
        return v

    def string(self, key: str, required: bool = True) -> str | None:
        v = self._get(key, "STRING", lambda v: v.type == _T.STRING, required)
        return None if v is None else v.value

    def boolean(self, key: str) -> bool | None:
        v = self._get(key, "BOOL", lambda v: v.type == _T.BOOL, False)
        return None if v is None else bool(v.value)

    def integer(self, key: str) -> int | None:
        v = self._get(key, "an integer (UINT32)", lambda v: v.type in _INT_TYPES, False)
        return None if v is None else int(v.value)

    def strings(self, key: str, required: bool = True) -> list[str] | None:
        v = self._get(key, "ARRAY[STRING]", lambda v: v.type == _T.ARRAY and v.elem == _T.STRING, required)
        return None if v is None else v.value

    def integers(self, key: str, required: bool = True) -> list[int] | None:
        v = self._get(key, "ARRAY[INT32]", lambda v: v.type == _T.ARRAY and v.elem in _INT_TYPES, required)
        return None if v is None else [int(x) for x in v.value]


# --------------------------------------------------------------------------------------------------------

class Tokenizer:
    """A GGUF model's tokenizer (byte-level BPE, `tokenizer.ggml.model == "gpt2"`), equivalent to llama.cpp's.

    Build it with `Tokenizer.from_gguf(path)` or `Tokenizer.from_reader(reader, path)`. Instances are safe to
    share between threads."""

    def __init__(self, meta: Mapping[str, _Value], path: str):
        # Internal: `meta` is the parsed metadata; use from_gguf / from_reader.
        m = _Meta(meta, path)
        self._path = path

        model = m.string(_KEY_MODEL)
        if model != "gpt2":
            raise UnsupportedModelError(f"{path}: key '{_KEY_MODEL}' is {model!r}; only 'gpt2' (byte-level BPE) "
                                        f"tokenizers are supported")
        pre = m.string(_KEY_PRE)
        if pre not in _PRE_REGEXES:
            raise UnsupportedModelError(f"{path}: key '{_KEY_PRE}' is {pre!r}; supported pre-tokenizers: "
                                        f"{', '.join(sorted(_PRE_REGEXES))}")
        self._pre = pre

        tokens = m.strings(_KEY_TOKENS)
        n_vocab = len(tokens)
        if n_vocab == 0:
            raise GGUFFormatError(f"{path}: key '{_KEY_TOKENS}' is empty")
        # llama.cpp treats every token as normal when the types are absent.
        types = m.integers(_KEY_TOKEN_TYPE, required=False) or [_NORMAL] * n_vocab
        if len(types) != n_vocab:
            raise GGUFFormatError(f"{path}: key '{_KEY_TOKEN_TYPE}' has {len(types)} entries, expected {n_vocab} "
                                  f"(one per token in '{_KEY_TOKENS}')")
        merges = m.strings(_KEY_MERGES)

        # For qwen pre-tokenizers llama.cpp adds neither BOS nor EOS unless the GGUF says so.
        self._add_bos = bool(m.boolean(_KEY_ADD_BOS))
        self._add_eos = bool(m.boolean(_KEY_ADD_EOS))
        self._chat_template = m.string(_KEY_CHAT_TEMPLATE, required=False)

        # Special ids named by the GGUF. An id outside the vocabulary is ignored (llama.cpp warns and keeps
        # its default; its BPE default of 11 for bos/eos is a legacy value that would be wrong here).
        ids: dict[str, int | None] = {}
        for slot, key in _ID_KEYS.items():
            v = m.integer(key)
            ids[slot] = v if v is not None and 0 <= v < n_vocab else None

        # Text -> id; for duplicate texts the last id wins, as in llama.cpp's token_to_id.
        vocab = {text: i for i, text in enumerate(tokens)}
        types = list(types)
        self._eog = self._apply_llama_special_rules(tokens, vocab, types, ids)
        self._ids = ids

        if self._add_bos and ids["bos"] is None:
            raise GGUFFormatError(f"{path}: '{_KEY_ADD_BOS}' is true but there is no valid "
                                  f"'{_ID_KEYS['bos']}'")
        if self._add_eos and ids["eos"] is None:
            raise GGUFFormatError(f"{path}: '{_KEY_ADD_EOS}' is true but there is no valid "
                                  f"'{_ID_KEYS['eos']}'")

        self._n_vocab = n_vocab
        # A few hundred special tokens among ~150k normal ones: index them once.
        not_normal = [i for i, t in enumerate(types) if t != _NORMAL]
        normal_texts = list(tokens)
        for i in not_normal:
            normal_texts[i] = ""  # not byte-level text; rendered below
        self._token_bytes = _byte_level_to_bytes_all(normal_texts)
        for i in not_normal:
            self._token_bytes[i] = _special_token_bytes(tokens[i], types[i])
        self._hidden = frozenset(i for i in not_normal if types[i] in (_CONTROL, _UNKNOWN))
        self._hf = self._build_hf(path, vocab, merges,
                                  special=[tokens[i] for i in not_normal if types[i] in (_CONTROL, _UNKNOWN)],
                                  user=[tokens[i] for i in not_normal if types[i] == _USER_DEFINED],
                                  regex=_PRE_REGEXES[pre])
        # `encode_special_tokens` is tokenizer-wide state; tokenize() flips it per call under this lock.
        self._lock = threading.Lock()

    # ---- construction ----------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load the tokenizer of a GGUF file (reads the metadata only)."""
        p = os.fspath(path)
        return cls(_read_metadata(p), p)

    @classmethod
    def from_reader(cls, reader: gguf.GGUFReader, path: str | os.PathLike[str] | None = None) -> Tokenizer:
        """Build the tokenizer from an already open `gguf.GGUFReader` (`path` is used in messages)."""
        p = os.fspath(path) if path is not None else "<GGUFReader>"
        return cls(_metadata_from_reader(reader, p), p)

    @staticmethod
    def _apply_llama_special_rules(tokens: list[str], vocab: dict[str, int], types: list[int],
                                   ids: dict[str, int | None]) -> frozenset[int]:
        """llama.cpp's text-based fix-ups of special tokens (llama_vocab::impl::load): auto-detect EOT/EOM/FIM
        tokens, force end-of-generation-looking tokens to control type. Fills in `ids`, updates `types` and
        returns the set of end-of-generation ids."""
        # llama.cpp walks an unordered_map here, so which of several candidates wins a slot is unspecified
        # there; walking in id order makes it deterministic (only matters for the eot/eom/fim ids themselves).
        for slot, texts in _AUTODETECT:
            if ids[slot] is not None:
                continue
            found = sorted(vocab[t] for t in texts if t in vocab)
            if found:
                ids[slot] = found[0]
                types[found[0]] = _CONTROL

        eog = {ids[s] for s in ("fim_pad", "fim_rep", "fim_sep") if ids[s] is not None}
        for text in _EOG_TEXTS:
            i = vocab.get(text)
            if i is not None:
                eog.add(i)
                types[i] = _CONTROL
        # gpt-oss: these are always rendered.
        for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
            if text in vocab:
                types[vocab[text]] = _USER_DEFINED
        eog.update(ids[s] for s in ("eos", "eot", "eom") if ids[s] is not None)

        # o200k_harmony / solar-open: "<|end|>" ends a message, not the generation.
        texts = {tokens[i] for i in eog}
        if "<|end|>" in texts and (("<|return|>" in texts and "<|call|>" in texts)
                                   or ("<|calls|>" in texts and "<|flush|>" in texts)):
            end_id = vocab["<|end|>"]
            eog.discard(end_id)
            types[end_id] = _USER_DEFINED
        # gemma4 / plamo: "</s>" is an ordinary token there.
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            s_id = vocab["</s>"]
            eog.discard(s_id)
            types[s_id] = _NORMAL
        return frozenset(eog)

    @staticmethod
    def _build_hf(path: str, vocab: dict[str, int], merges: list[str], special: list[str], user: list[str],
                  regex: str) -> _HFTokenizer:
        pairs = []
        for i, merge in enumerate(merges):
            # llama.cpp splits at the first space after the first character (a merge may start with one).
            pos = merge.find(" ", 1)
            if pos < 0:
                raise GGUFFormatError(f"{path}: key '{_KEY_MERGES}' entry #{i} {merge!r} is not two tokens "
                                      f"separated by a space")
            pairs.append((merge[:pos], merge[pos + 1:]))
        try:
            bpe = models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False, ignore_merges=False)
        except Exception as e:  # tokenizers raises a plain Exception for a merge naming an unknown token
            raise GGUFFormatError(f"{path}: key '{_KEY_MERGES}' does not fit '{_KEY_TOKENS}': {e}") from None
        hf = _HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
        hf.decoder = decoders.ByteLevel()
        # Control/unknown tokens are "special" (split out only when encode_special_tokens is off, i.e. with
        # parse_special); user-defined ones are split out always, as llama.cpp does. Their text is matched
        # raw, never normalised, and keeps surrounding spaces (no lstrip/rstrip for these models).
        hf.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in special])
        hf.add_tokens([AddedToken(text, special=False, normalized=False) for text in user])
        return hf

    # ---- properties ------------------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        """Number of tokens in the vocabulary."""
        return self._n_vocab

    @property
    def bos_token_id(self) -> int | None:
        return self._ids["bos"]

    @property
    def eos_token_id(self) -> int | None:
        return self._ids["eos"]

    @property
    def pad_token_id(self) -> int | None:
        return self._ids["pad"]

    def fim_token_ids(self) -> dict[str, int | None]:
        """The fill-in-the-middle tokens (pre, suf, mid, pad, rep, sep: None where the vocabulary has none), named
        by the GGUF or found by their text, by llama.cpp's rules."""
        return {name[4:]: self._ids[name] for name in self._ids if name.startswith("fim_")}

    @property
    def eog_token_ids(self) -> frozenset[int]:
        """Tokens that end generation: eos, eot, eom, the FIM pad/repo/sep tokens and tokens whose text marks
        an end of turn (`<|im_end|>`, `<|endoftext|>`, ...), by llama.cpp's rules."""
        return self._eog

    @property
    def control_token_ids(self) -> frozenset[int]:
        """Control (and unknown) tokens: no text of theirs is generated text (detokenize(skip_special) drops them)."""
        return self._hidden

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @property
    def add_eos(self) -> bool:
        return self._add_eos

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def pre(self) -> str:
        """The pre-tokenizer name (`tokenizer.ggml.pre`)."""
        return self._pre

    def __repr__(self) -> str:
        return f"Tokenizer({self._path!r}, pre={self._pre!r}, n_vocab={self._n_vocab})"

    # ---- text <-> ids ----------------------------------------------------------------------------------

    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`.

        add_special: add BOS / EOS where the GGUF asks for them (`tokenizer.ggml.add_bos_token` / `add_eos_token`;
        neither is set for Qwen models, so this usually adds nothing).
        parse_special: let the text of control tokens (`<|im_start|>`, `<|im_end|>`...) stand for those
        tokens; otherwise it is tokenized as plain text. User-defined tokens (`<think>`...) are always
        recognised. Invalid UTF-8 in `bytes` input becomes U+FFFD, one per bad byte, as in llama.cpp."""
        if isinstance(text, (bytes, bytearray, memoryview)):
            text = bytes(text).decode("utf-8", _UTF8_ERRORS)
        elif not isinstance(text, str):
            raise TypeError(f"tokenize() expects str or bytes, got {type(text).__name__}")
        ids: list[int] = []
        if add_special and self._add_bos:
            ids.append(self._ids["bos"])  # type: ignore[arg-type]
        if text:
            try:
                ids += self._encode(text, parse_special)
            except TypeError:
                # A str with lone surrogates has no UTF-8 form and cannot be handed to tokenizers; treat their
                # bytes as the invalid UTF-8 they are.
                ids += self._encode(text.encode("utf-8", "surrogatepass").decode("utf-8", _UTF8_ERRORS),
                                    parse_special)
        if add_special and self._add_eos:
            ids.append(self._ids["eos"])  # type: ignore[arg-type]
        return ids

    def _encode(self, text: str, parse_special: bool) -> list[int]:
        with self._lock:
            self._hf.encode_special_tokens = not parse_special
            return self._hf.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """The bytes of the longest token's text: a text of more than n bytes this long has more than n tokens."""
        return max(map(len, self._token_bytes), default=1)

    def token_bytes(self, token_id: int, special: bool = True) -> bytes:
        """The bytes token `token_id` stands for (a control token's own text; none with special=False, as
        llama.cpp's token_to_piece renders it). A token may hold part of a UTF-8 character, so a streamer should
        hold back an incomplete tail until the next token arrives."""
        token_id = _token_id(token_id)
        if not 0 <= token_id < self._n_vocab:
            raise IndexError(f"token id {token_id} is out of range (vocabulary of {self._n_vocab} tokens)")
        return b"" if not special and token_id in self._hidden else self._token_bytes[token_id]

    def detokenize(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of `ids`. skip_special drops control tokens (`<|im_end|>`...); user-defined tokens are
        kept. Invalid UTF-8 (e.g. a character cut in two) is replaced with U+FFFD."""
        table = self._token_bytes
        n = self._n_vocab
        parts = []
        for i in ids:
            if type(i) is not int:
                i = _token_id(i)
            if not 0 <= i < n:
                raise IndexError(f"token id {i} is out of range (vocabulary of {n} tokens)")
            if skip_special and i in self._hidden:
                continue
            parts.append(table[i])
        return b"".join(parts).decode("utf-8", "replace")


def _token_id(value: Any) -> int:
    """An int token id (a numpy integer too; not a bool, a float or a string)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"a token id must be an int, got {type(value).__name__} {value!r}")
    return operator.index(value)


def _special_token_bytes(text: str, token_type: int) -> bytes:
    """token_to_piece for the token types other than normal (llama_vocab::impl::token_to_piece, BPE case)."""
    if token_type in (_CONTROL, _USER_DEFINED, _UNKNOWN):
        return text.encode("utf-8")  # rendered as written, not byte-level decoded
    if token_type == _BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return bytes([int(text[3:5], 16)])
        except ValueError:
            pass
    if token_type == _BYTE:
        return _byte_level_to_bytes(text)
    return b""  # unused (and unknown-to-llama.cpp) types render as nothing
