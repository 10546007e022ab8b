"""HF `tokenizer.json` (byte-level BPE) → GGUF tokenizer keys, without transformers.

Writes what llama.cpp's converter writes for Qwen checkpoints (`TextModel._set_vocab_gpt2` plus
`gguf.SpecialVocab` of its gguf-py): `tokenizer.ggml.model = gpt2`, `pre`, `tokens`, `token_type`,
`merges`, the special-token ids, the add-BOS/EOS flags and the chat template.

The pre-tokenizer type is recognised from the Split regex in tokenizer.json (llama.cpp hashes the
token ids of a probe string instead, which needs the tokenizer to run). Only the two Qwen regexes
are known; anything else raises `ConversionError`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from pydflash.errors import ConversionError

logger = logging.getLogger("pydflash.convert")

# tokenizer.json Split regexes → tokenizer.ggml.pre (llama.cpp src/llama-vocab.cpp, "original regex
# from tokenizer.json" comments of LLAMA_VOCAB_PRE_TYPE_QWEN2 / _QWEN35). qwen35 adds \p{M}.
PRE_TOKENIZER_REGEXES: dict[str, str] = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}

# gguf.SpecialVocab's special-token kinds, in its order
SPECIAL_TOKEN_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object (every tokenizer / config file read here does)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path}: cannot read: {e}") from e
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def detect_pre_tokenizer(tokenizer: dict[str, Any], where: Path | str = "tokenizer.json") -> str:
    """`tokenizer.ggml.pre` for a tokenizer.json: Sequence[Split(Regex, isolated), ByteLevel] with a
    known Qwen regex."""
    pre = tokenizer.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    splits = [s for s in steps if s.get("type") == "Split"]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    shape = " + ".join(str(s.get("type")) for s in steps) or "none"
    if len(splits) != 1 or len(byte_level) != 1 or len(steps) != 2 or steps[0] is not splits[0]:
        raise ConversionError(
            f"{where}: unsupported pre_tokenizer ({shape}); pydflash supports byte-level BPE with "
            "Split(regex) + ByteLevel as in Qwen2/Qwen3 ('qwen2') and Qwen3.5 ('qwen35') tokenizers")
    regex = (splits[0].get("pattern") or {}).get("Regex")
    behavior = str(splits[0].get("behavior", "")).lower()
    if regex is None or behavior != "isolated" or splits[0].get("invert", False):
        raise ConversionError(f"{where}: unsupported Split pre-tokenizer {splits[0]!r}; expected an isolated "
                              "Regex split as in Qwen tokenizers")
    if byte_level[0].get("use_regex", True):
        raise ConversionError(f"{where}: ByteLevel pre-tokenizer with use_regex=true is not a Qwen tokenizer")
    for name, known in PRE_TOKENIZER_REGEXES.items():
        if regex == known:
            return name
    raise ConversionError(
        f"{where}: unknown pre-tokenizer regex {regex!r}; pydflash knows only the Qwen2/Qwen3 ('qwen2') and "
        "Qwen3.5 ('qwen35') regexes")


def _does_token_look_special(token: str) -> bool:
    # llama.cpp TextModel.does_token_look_special
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _encode_merges(merges: list[Any], where: Path) -> list[str]:
    if not merges:
        return []
    if isinstance(merges[0], str):
        return list(merges)
    if isinstance(merges[0], list) and len(merges[0]) == 2 and isinstance(merges[0][0], str):
        # "a b" pairs; a literal space inside a part is stored as U+0120 + 256 offset (gguf.SpecialVocab)
        return [" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in pair) for pair in merges]
    raise ConversionError(f"{where}: unknown model.merges format")


@dataclass
class GPT2Vocab:
    tokens: list[str]
    token_types: list[int]
    pre: str
    merges: list[str]
    special_token_ids: dict[str, int] = field(default_factory=dict)     # kind → id, in write order
    add_special_token: dict[str, bool] = field(default_factory=dict)    # kind → flag, in write order
    chat_template: str | list[dict[str, str]] | None = None
    normalizer_lowercase: bool | None = None
    normalizer_strip_accents: bool | None = None

    def add_to_gguf(self, w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(self.pre)
        w.add_token_list(self.tokens)
        w.add_token_types(self.token_types)
        w.add_token_merges(self.merges)
        for kind, tid in self.special_token_ids.items():
            getattr(w, f"add_{kind}_token_id")(tid)
        for kind, flag in self.add_special_token.items():
            getattr(w, f"add_add_{kind}_token")(flag)
        if self.chat_template is not None:
            w.add_chat_template(self.chat_template)
        # keys of llama.cpp's gguf-py (not in PyPI gguf 0.19.0)
        if self.normalizer_lowercase is not None:
            w.add_bool("tokenizer.ggml.normalizer.lowercase", self.normalizer_lowercase)
        if self.normalizer_strip_accents is not None:
            w.add_bool("tokenizer.ggml.normalizer.strip_accents", self.normalizer_strip_accents)


def load_gpt2_vocab(model_dir: str | Path, n_vocab: int | None = None) -> GPT2Vocab:
    """Read tokenizer.json (+ tokenizer_config.json, config.json, chat_template.*) of `model_dir`.

    `n_vocab` is the model's vocab_size (embedding rows); ids the tokenizer lacks become
    `[PAD<id>]` tokens of type UNUSED, as in llama.cpp.
    """
    model_dir = Path(model_dir)
    tj_path = model_dir / "tokenizer.json"
    if not tj_path.is_file():
        if (model_dir / "tokenizer.model").is_file():
            raise ConversionError(f"{model_dir}: SentencePiece tokenizer.model is not supported; pydflash needs a "
                                  "byte-level BPE tokenizer.json (Qwen)")
        raise ConversionError(f"{model_dir}: missing tokenizer.json")
    tok = _read_json(tj_path)
    model = tok.get("model") or {}
    if not isinstance(model, dict):
        raise ConversionError(f"{tj_path}: 'model' = {type(model).__name__}, expected an object")
    if model.get("type", "BPE") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ConversionError(f"{tj_path}: tokenizer model {model.get('type')!r} is not BPE")
    pre = detect_pre_tokenizer(tok, tj_path)

    vocab: dict[str, int] = dict(model["vocab"])
    added_tokens: list[dict[str, Any]] = list(tok.get("added_tokens") or [])
    added = {t["content"]: t for t in added_tokens}
    for t in added_tokens:
        vocab[t["content"]] = t["id"]
    max_id = max(vocab.values())
    if n_vocab is None:
        n_vocab = max_id + 1
    if max_id >= n_vocab:
        raise ConversionError(f"{tj_path}: token id {max_id} does not fit the model's vocab_size {n_vocab}")
    reverse = {i: t for t, i in vocab.items()}

    tokens: list[str] = []
    types: list[int] = []
    for i in range(n_vocab):
        t = reverse.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif t in added:
            if added[t].get("special") or _does_token_look_special(t):
                types.append(gguf.TokenType.CONTROL)
            else:
                t = t.replace("\u2581", " ")  # pre-normalize user-defined spaces
                types.append(gguf.TokenType.USER_DEFINED)
            tokens.append(t)
        else:
            tokens.append(t)
            types.append(gguf.TokenType.NORMAL)

    merges = _encode_merges(model.get("merges") or [], tj_path)
    if not merges:
        raise ConversionError(f"{tj_path}: BPE tokenizer without merges")

    v = GPT2Vocab(tokens=tokens, token_types=types, pre=pre, merges=merges)
    _load_special(v, model_dir, tok, added_tokens, n_vocab)
    return v


def _parse_normalizer(v: GPT2Vocab, normalizer: dict[str, Any]) -> None:
    kind = normalizer.get("type")
    if kind == "Lowercase":
        v.normalizer_lowercase = True
    elif kind == "StripAccents":
        v.normalizer_strip_accents = True
    elif kind == "BertNormalizer":
        if "lowercase" in normalizer:
            v.normalizer_lowercase = normalizer["lowercase"]
        if "strip_accents" in normalizer:
            v.normalizer_strip_accents = normalizer["strip_accents"]
    elif kind == "Sequence":
        for n in normalizer.get("normalizers", []):
            _parse_normalizer(v, n)


def _load_special(v: GPT2Vocab, model_dir: Path, tok: dict[str, Any], added_tokens: list[dict[str, Any]],
                  n_vocab: int) -> None:
    """Special ids, add-BOS/EOS flags and chat template, with gguf.SpecialVocab's precedence:
    tokenizer_config.json `<kind>_token` (looked up among added tokens) first, then config.json
    `<kind>_token_id`; the first value found for a kind wins."""
    if (normalizer := tok.get("normalizer")):
        _parse_normalizer(v, normalizer)
    tc_path = model_dir / "tokenizer_config.json"
    tc = _tokenizer_config(tc_path)
    if (post := tok.get("post_processor")):
        _check_post_processor(v, model_dir, post)
    if tc:
        template = tc.get("chat_template", _chat_template_files(model_dir))
        if template is None or isinstance(template, (str, list)):
            v.chat_template = template
        else:
            logger.warning("%s: chat_template has type %s; ignored", tc_path, type(template).__name__)
        for kind in SPECIAL_TOKEN_TYPES:
            flag = tc.get(f"add_{kind}_token")
            if isinstance(flag, bool) and kind not in v.add_special_token:
                v.add_special_token[kind] = flag
            entry = tc.get(f"{kind}_token")
            if isinstance(entry, dict):
                entry = entry.get("content")
            if isinstance(entry, str):
                tid = next((t.get("id") for t in added_tokens if t.get("content") == entry), None)
                _set_special_id(v, model_dir, n_vocab, kind, tid)
    cfg_path = model_dir / "config.json"
    if cfg_path.is_file():
        cfg = _read_json(cfg_path)
        for kind in SPECIAL_TOKEN_TYPES:
            tid = cfg.get(f"{kind}_token_id")
            if tid is None and "text_config" in cfg:
                tid = cfg["text_config"].get(f"{kind}_token_id")
            _set_special_id(v, model_dir, n_vocab, kind, tid)


def _set_special_id(v: GPT2Vocab, model_dir: Path, n_vocab: int, kind: str, tid: Any) -> None:
    """`kind`'s id, unless one was found before (an id outside the vocabulary is left out, with a warning)."""
    if not isinstance(tid, int) or isinstance(tid, bool):
        return
    if tid < 0:
        raise ConversionError(f"{model_dir}: invalid {kind} token id {tid}")
    if tid >= n_vocab:
        logger.warning("%s: %s token id %d is outside the vocabulary (%d); not written", model_dir, kind, tid, n_vocab)
    elif kind not in v.special_token_ids:
        v.special_token_ids[kind] = tid


def _tokenizer_config(tc_path: Path) -> dict[str, Any] | None:
    """tokenizer_config.json (None if absent), a cls / sep token standing in for a missing bos / eos."""
    tc: dict[str, Any] | None = _read_json(tc_path) if tc_path.is_file() else None
    if tc is not None and not isinstance(tc, dict):
        raise ConversionError(f"{tc_path}: expected a JSON object")
    if tc is not None:
        if not tc.get("bos_token") and tc.get("cls_token"):
            tc["bos_token"] = tc["cls_token"]
        if not tc.get("eos_token") and tc.get("sep_token"):
            tc["eos_token"] = tc["sep_token"]
    return tc


def _check_post_processor(v: GPT2Vocab, model_dir: Path, post: dict[str, Any]) -> None:
    """ByteLevel post-processors (Qwen's) add no BOS / EOS; any other kind is refused."""
    for proc in post.get("processors", [post]):
        kind = proc.get("type")
        if kind == "ByteLevel":
            v.add_special_token.setdefault("bos", False)
            v.add_special_token.setdefault("eos", False)
        else:
            raise ConversionError(
                f"{model_dir / 'tokenizer.json'}: post_processor {kind!r} is not supported (Qwen tokenizers use "
                "ByteLevel)")


def _chat_template_files(model_dir: Path) -> str | list[dict[str, str]] | None:
    """The chat template kept beside tokenizer_config.json: chat_template.jinja (with additional_chat_templates/,
    as named templates) or chat_template.json."""
    jinja = model_dir / "chat_template.jinja"
    cj = model_dir / "chat_template.json"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
        extra = sorted((model_dir / "additional_chat_templates").glob("*.jinja"))
        if not extra:
            return template
        return [{"name": "default", "template": template}] + \
            [{"name": p.stem, "template": p.read_text(encoding="utf-8")} for p in extra]
    if cj.is_file():
        return _read_json(cj).get("chat_template")
    return None


def set_vocab_gpt2(writer: gguf.GGUFWriter, model_dir: str | Path, n_vocab: int | None) -> GPT2Vocab:
    """Read the tokenizer of `model_dir` and add its keys to `writer`."""
    v = load_gpt2_vocab(model_dir, n_vocab)
    v.add_to_gguf(writer)
    return v
