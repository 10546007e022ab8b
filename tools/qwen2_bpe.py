"""A Qwen2-style byte-level BPE trained with `tokenizers` (the tokenizer of our test checkpoints and of the
trained pairs): NFC, the Qwen2 Split regex + ByteLevel, so a GGUF converter recognises `tokenizer.ggml.pre =
qwen2`; Qwen's added tokens get the highest ids, as in its vocabulary."""

from __future__ import annotations

from collections.abc import Iterable

# The pre-tokenizer regex of Qwen2 / Qwen3 tokenizer.json files (llama.cpp `qwen2`).
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
USER_TOKENS = ("<think>", "</think>")


def train_qwen2_bpe(texts: Iterable[str], n_learned: int, length: int | None = None, extra_special: tuple = ()):
    """A tokenizers.Tokenizer with `n_learned` learned entries (bytes + merges), then SPECIAL_TOKENS,
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
    trainer = trainers.BpeTrainer(vocab_size=n_learned, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in USER_TOKENS])
    if extra_special:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra_special])
    return tok
