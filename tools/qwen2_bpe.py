"""A Qwen2-style byte-level BPE trained with `tokenizers` (the tokenizer of our test checkpoints and of the
trained pairs): NFC, the Qwen2 Split regex + ByteLevel, so a GGUF converter recognises `tokenizer.ggml.pre =
qwen2`; Qwen's added tokens get the highest ids, as in its vocabulary."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

# The pre-tokenizer regex of Qwen2 / Qwen3 tokenizer.json files (llama.cpp `qwen2`).
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
USER_TOKENS = ("<think>", "</think>")
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_qwen2_bpe(texts: Iterable[str], vocab_size: int, length: int | None = None, extra_special: tuple = ()):
    """A tokenizers.Tokenizer of `vocab_size` entries: learned ones (bytes + merges), then SPECIAL_TOKENS,
    USER_TOKENS and `extra_special` (special) added after training."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    n_learned = vocab_size - len(SPECIAL_TOKENS) - len(USER_TOKENS) - len(extra_special)
    trainer = trainers.BpeTrainer(vocab_size=n_learned, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in USER_TOKENS])
    if extra_special:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra_special])
    return tok


def write_tokenizer_files(path: Path, data: dict, *, eos_token: str, mask_token: str | None = None) -> None:
    """tokenizer.json (`data`, the tokenizer's JSON) and a Qwen2 tokenizer_config.json (ChatML template) into
    `path`; `mask_token` (a DFlash drafter's) is declared as such and as an additional special token."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for t in data["added_tokens"]
        },
        "additional_special_tokens": [IM_START, IM_END] + ([mask_token] if mask_token else []),
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos_token,
        "errors": "replace",
        **({"mask_token": mask_token} if mask_token else {}),
        "model_max_length": 4096,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
