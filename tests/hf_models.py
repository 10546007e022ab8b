"""Tiny random Hugging Face checkpoints for tests (never downloaded).

`make_qwen3_checkpoint(path, ...)` writes a `Qwen3ForCausalLM` folder the way `save_pretrained` does
(config.json, generation_config.json, safetensors, optionally sharded with an index) plus a Qwen-style
byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json with a ChatML template).

The tokenizer is trained offline on a few Python standard-library sources with the Qwen2 pre-tokenizer
(Split regex + ByteLevel), so a converter exercises the real `tokenizer.ggml.pre = qwen2` path.
Weights are drawn with larger spreads than HF's init (std ~0.2 instead of 0.02) so greedy decoding
has clear top-1 / top-2 logit gaps instead of near-ties.

torch, transformers and tokenizers are needed here (test-only dependencies).
"""

from __future__ import annotations

import functools
import json
import textwrap
from pathlib import Path

# The pre-tokenizer regex of Qwen2 / Qwen3 tokenizer.json files (llama.cpp `qwen2`).
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Added but not special (Qwen3 has <think>/</think> like this): exercises USER_DEFINED token types.
USER_TOKENS = ("<think>", "</think>")

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Offline training text: a few pure-Python stdlib modules (present in every CPython install).
_CORPUS_MODULES = ("textwrap.py", "shlex.py", "string.py", "heapq.py", "json/decoder.py")

# Named shapes covering GQA ratios, head dims, tied/untied heads. (hidden, layers, heads, kv_heads, head_dim, tie)
QWEN3_SHAPES: dict[str, dict] = {
    "gqa4x2_hd64": dict(hidden=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, tie=False),
    "gqa4x1_hd64_tied": dict(hidden=128, n_layers=3, n_heads=4, n_kv_heads=1, head_dim=64, tie=True),
    "mha2x2_hd128": dict(hidden=256, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=128, tie=False),
    "gqa4x2_hd128_tied": dict(hidden=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=128, tie=True),
}


def _corpus() -> list[str]:
    root = Path(textwrap.__file__).parent
    return [(root / name).read_text(encoding="utf-8") for name in _CORPUS_MODULES]


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    """Train (once per process) a Qwen2-style byte-level BPE; returns the tokenizer.json text."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    n_added = len(SPECIAL_TOKENS) + len(USER_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_added,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Added after training so they get the highest ids, as in Qwen's vocab.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in USER_TOKENS])
    return tok.to_str(pretty=False)


def write_qwen_tokenizer(path: str | Path, *, vocab_size: int = 768, split_regex: str | None = None) -> dict[str, int]:
    """Write tokenizer.json + tokenizer_config.json into `path`; returns the special-token ids.

    `split_regex` replaces the Split pattern (to test pre-tokenizer detection); `vocab_size` is the
    tokenizer's size including the added tokens.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    data = json.loads(_tokenizer_json(vocab_size))
    if split_regex is not None:
        data["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": split_regex}
    (path / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")

    ids = {t["content"]: t["id"] for t in data["added_tokens"]}
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for t in data["added_tokens"]
        },
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return {"endoftext": ids[ENDOFTEXT], "im_start": ids[IM_START], "im_end": ids[IM_END], "n_tokens": len(data["model"]["vocab"]) + len(ids)}


def _scale_weights(model, *, seed: int, weight_std: float, embed_std: float) -> None:
    """Re-draw every parameter with a fixed generator: linears N(0, weight_std), embeddings
    N(0, embed_std), norm weights 1 + N(0, 0.1) (non-trivial so a norm mix-up shows)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(embed_std * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(weight_std * torch.randn(p.shape, generator=gen))


def make_qwen3_checkpoint(
    path: str | Path,
    *,
    hidden: int = 128,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate: int | None = None,
    tie: bool = False,
    seed: int = 0,
    dtype: str = "float32",
    tokenizer_vocab: int = 768,
    vocab_size: int | None = None,
    max_shard_size: str | int | None = None,
    weight_std: float = 0.2,
    embed_std: float = 1.0,
    rope_theta: float = 1_000_000.0,
    max_position_embeddings: int = 4096,
    rms_norm_eps: float = 1e-6,
    generation: dict | None = None,
    model_card: str | None = None,
) -> Path:
    """Write a tiny random `Qwen3ForCausalLM` checkpoint + tokenizer into `path` and return it.

    `vocab_size` (config/embedding rows) defaults to the tokenizer size; a larger value pads the
    vocabulary like real Qwen checkpoints (151936 rows for 151669 tokens). `dtype` is the safetensors
    dtype ("float32", "bfloat16", "float16"). `max_shard_size` (e.g. "40KB") writes a sharded
    checkpoint with model.safetensors.index.json. `generation` adds generation_config.json fields
    (e.g. temperature, top_k); `model_card` is written as README.md.
    """
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    tok = write_qwen_tokenizer(path, vocab_size=tokenizer_vocab)
    n_vocab = vocab_size if vocab_size is not None else tok["n_tokens"]
    if n_vocab < tok["n_tokens"]:
        raise ValueError(f"vocab_size {n_vocab} < tokenizer size {tok['n_tokens']}")

    config = Qwen3Config(
        vocab_size=n_vocab,
        hidden_size=hidden,
        intermediate_size=intermediate if intermediate is not None else 3 * hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=tie,
        attention_bias=False,
        bos_token_id=tok["endoftext"],
        eos_token_id=tok["im_end"],
        architectures=["Qwen3ForCausalLM"],
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    _scale_weights(model, seed=seed, weight_std=weight_std, embed_std=embed_std)
    model = model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=tok["endoftext"], eos_token_id=[tok["im_end"], tok["endoftext"]], pad_token_id=tok["endoftext"],
        **(generation or {}),
    )
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    if model_card is not None:
        (path / "README.md").write_text(model_card, encoding="utf-8")
    return path


def make_qwen3_shape(path: str | Path, shape: str, **overrides) -> Path:
    """`make_qwen3_checkpoint` with one of the named `QWEN3_SHAPES`."""
    return make_qwen3_checkpoint(path, **{**QWEN3_SHAPES[shape], **overrides})
