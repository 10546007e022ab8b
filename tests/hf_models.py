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

from qwen2_bpe import ENDOFTEXT, IM_END, IM_START, train_qwen2_bpe, write_tokenizer_files

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
    tok = train_qwen2_bpe(_corpus(), vocab_size)
    return tok.to_str(pretty=False)


def write_qwen_tokenizer(path: str | Path, *, vocab_size: int = 768, split_regex: str | None = None) -> dict[str, int]:
    """Write tokenizer.json + tokenizer_config.json into `path`; returns the special-token ids.

    `split_regex` replaces the Split pattern (to test pre-tokenizer detection); `vocab_size` is the
    tokenizer's size including the added tokens.
    """
    data = json.loads(_tokenizer_json(vocab_size))
    if split_regex is not None:
        data["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": split_regex}
    write_tokenizer_files(Path(path), data, eos_token=IM_END)
    ids = {t["content"]: t["id"] for t in data["added_tokens"]}
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


def _tokenizer_and_rows(path: Path, tokenizer_vocab: int, vocab_size: int | None,
                        split_regex: str | None = None) -> tuple[dict[str, int], int]:
    """The checkpoint's tokenizer files (write_qwen_tokenizer's ids) and its embedding rows: `vocab_size`, or the
    tokenizer's size when None (a ValueError when fewer)."""
    tok = write_qwen_tokenizer(path, vocab_size=tokenizer_vocab, split_regex=split_regex)
    n_vocab = vocab_size if vocab_size is not None else tok["n_tokens"]
    if n_vocab < tok["n_tokens"]:
        raise ValueError(f"vocab_size {n_vocab} < tokenizer size {tok['n_tokens']}")
    return tok, n_vocab


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
    rope_scaling: dict | None = None,
    max_position_embeddings: int = 4096,
    rms_norm_eps: float = 1e-6,
    generation: dict | None = None,
    model_card: str | None = None,
    n_experts: int = 0,
    top_k: int = 2,
    expert_ff: int = 64,
    norm_topk_prob: bool = True,
    experts: str = "per_expert",
    router_std: float = 0.5,
) -> Path:
    """Write a tiny random `Qwen3ForCausalLM` checkpoint + tokenizer into `path` and return it.

    `vocab_size` (config/embedding rows) defaults to the tokenizer size; a larger value pads the
    vocabulary like real Qwen checkpoints (151936 rows for 151669 tokens). `dtype` is the safetensors
    dtype ("float32", "bfloat16", "float16"). `max_shard_size` (e.g. "40KB") writes a sharded
    checkpoint with model.safetensors.index.json. `generation` adds generation_config.json fields
    (e.g. temperature, top_k); `model_card` is written as README.md. `rope_scaling` joins the config's
    rope_parameters (e.g. {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}).

    `n_experts > 0` makes it `Qwen3MoeForCausalLM`: every layer's FFN is `n_experts` experts of width `expert_ff`,
    `top_k` of them per token. The routers are drawn with `router_std` (larger than the other weights: clear gaps
    between a token's k-th and (k+1)-th expert, so f32 rounding does not change which experts a token takes).
    `experts="per_expert"` keeps what `save_pretrained` writes; `"fused"` rewrites the experts as
    `mlp.experts.gate_up_proj` / `down_proj` (the layout transformers 5 holds in memory).
    """
    import torch
    import transformers
    from transformers import GenerationConfig

    moe = n_experts > 0
    family = "Qwen3Moe" if moe else "Qwen3"
    config_class, model_class = (getattr(transformers, family + kind) for kind in ("Config", "ForCausalLM"))
    moe_fields = dict(num_experts=n_experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_ff,
                      norm_topk_prob=norm_topk_prob) if moe else {}
    if experts not in ("per_expert", "fused"):
        raise ValueError(f"experts {experts!r}")

    path = Path(path)
    tok, n_vocab = _tokenizer_and_rows(path, tokenizer_vocab, vocab_size)

    config = config_class(
        vocab_size=n_vocab,
        hidden_size=hidden,
        intermediate_size=intermediate if intermediate is not None else 3 * hidden,
        **moe_fields,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})},
        tie_word_embeddings=tie,
        attention_bias=False,
        bos_token_id=tok["endoftext"],
        eos_token_id=tok["im_end"],
        architectures=[family + "ForCausalLM"],
    )
    torch.manual_seed(seed)
    model = model_class(config)
    _scale_weights(model, seed=seed, weight_std=weight_std, embed_std=embed_std)
    if moe:
        _draw_routers(model, seed=seed, router_std=router_std)
    model = model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=tok["endoftext"], eos_token_id=[tok["im_end"], tok["endoftext"]], pad_token_id=tok["endoftext"],
        **(generation or {}),
    )
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    if model_card is not None:
        (path / "README.md").write_text(model_card, encoding="utf-8")
    if experts == "fused":
        _fuse_experts(path)
    return path


def make_qwen3_shape(path: str | Path, shape: str, **overrides) -> Path:
    """`make_qwen3_checkpoint` with one of the named `QWEN3_SHAPES`."""
    return make_qwen3_checkpoint(path, **{**QWEN3_SHAPES[shape], **overrides})


# ---------------------------------------------------------------------------------------------------
# Qwen3.5 (hybrid gated-delta-net / gated attention) targets

# The pre-tokenizer regex of Qwen3.5 tokenizer.json files (llama.cpp `qwen35`: adds \p{M}).
QWEN35_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Named shapes: K/V linear-attention head ratios (1:1, 1:2, 1:3), partial rotary 0.25 / 0.5, explicit and
# default M-RoPE sections, layer patterns, tied head, MTP, the multimodal checkpoint layout.
QWEN35_SHAPES: dict[str, dict] = {
    # 4 layers, interval 4: L L L A; GDN K 2 / V 4 heads (reorder), rotary 8 of 32
    "k2v4_hd32": dict(hidden=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, linear_k_heads=2,
                      linear_v_heads=4, linear_head_dim=16),
    # K = V heads (no reorder), partial rotary 0.5, no mrope_section in the config (default sections)
    "k2v2_prf05_nomrope": dict(hidden=64, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=32, linear_k_heads=2,
                               linear_v_heads=2, linear_head_dim=16, partial_rotary=0.5, mrope_section=None,
                               layer_types=["linear_attention", "full_attention", "linear_attention"]),
    # K 1 / V 3 heads, tied embeddings, conv kernel 3, 1 MTP block
    "k1v3_tied_mtp": dict(hidden=48, n_layers=4, n_heads=3, n_kv_heads=1, head_dim=16, linear_k_heads=1,
                          linear_v_heads=3, linear_head_dim=16, conv_kernel=3, tie=True, mtp_layers=1),
    # K 8 / V 32 heads of dim 8 (ratio 4; 32 ssm_a values), 5 layers (L L L A L)
    "k8v32_hd8": dict(hidden=64, n_layers=5, n_heads=2, n_kv_heads=2, head_dim=32, linear_k_heads=8,
                      linear_v_heads=32, linear_head_dim=8),
    # Qwen3_5ForConditionalGeneration layout (model.language_model.*, a vision tower), 2 MTP blocks
    "vl_k2v4_mtp2": dict(hidden=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, linear_k_heads=2,
                         linear_v_heads=4, linear_head_dim=16, layout="conditional", mtp_layers=2),
}


# Qwen3.5-MoE: expert counts (odd and even), top-k 1 to 4, a shared expert always (as the class has), both
# checkpoint layouts, experts per expert and fused, MTP blocks with their MoE FFN, tied head.
QWEN35MOE_SHAPES: dict[str, dict] = {
    # 4 layers (L L L A), GDN K 2 / V 4 heads, 4 experts top-1
    "x4k1": dict(hidden=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, linear_k_heads=2, linear_v_heads=4,
                 linear_head_dim=16, n_experts=4, top_k=1, expert_ff=32, shared_ff=48),
    # the multimodal layout with one MTP block, 5 experts top-2, experts per expert
    "vl_x5k2_mtp": dict(hidden=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, linear_k_heads=2,
                        linear_v_heads=4, linear_head_dim=16, layout="conditional", mtp_layers=1, n_experts=5,
                        top_k=2, expert_ff=48, shared_ff=32),
    # fused experts, 7 experts top-3, tied head, K = V heads, 3 layers (L A L)
    "x7k3_fused_tied": dict(hidden=48, n_layers=3, n_heads=3, n_kv_heads=1, head_dim=16, linear_k_heads=2,
                            linear_v_heads=2, linear_head_dim=16, tie=True, experts="fused", n_experts=7, top_k=3,
                            expert_ff=24, shared_ff=64, layer_types=["linear_attention", "full_attention",
                                                                     "linear_attention"]),
    # 8 experts top-4, 5 layers (L L L A L)
    "x8k4": dict(hidden=64, n_layers=5, n_heads=2, n_kv_heads=2, head_dim=32, linear_k_heads=2, linear_v_heads=4,
                 linear_head_dim=16, n_experts=8, top_k=4, expert_ff=32, shared_ff=32),
}


def _default_mrope_section(head_dim: int, partial_rotary: float) -> list[int]:
    """Sections in Qwen3.5's proportions ([11, 11, 10] of 32 rotary pairs)."""
    half = int(head_dim * partial_rotary) // 2
    t = max(1, round(half * 11 / 32))
    return [t, t, half - 2 * t]


def _qwen35_weights(model, *, seed: int, weight_std: float, embed_std: float) -> None:
    """Re-draw the parameters of a Qwen3.5 model: zero-centred RMSNorm weights (the model uses 1 + w)
    N(0, 0.1), the gated norm `linear_attn.norm` 1 + N(0, 0.1), A_log = log U(0.5, 8), dt_bias
    1 + N(0, 0.1), embeddings N(0, embed_std), everything else N(0, weight_std)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            p.copy_(_qwen35_value(name, tuple(p.shape), gen, weight_std, embed_std))


def _qwen35_value(name: str, shape: tuple, gen, weight_std: float, embed_std: float):
    import torch

    if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("A_log"):
        return torch.log(0.5 + 7.5 * torch.rand(shape, generator=gen))
    if "norm" in name:
        return 0.1 * torch.randn(shape, generator=gen)
    if "embed_tokens" in name:
        return embed_std * torch.randn(shape, generator=gen)
    return weight_std * torch.randn(shape, generator=gen)


def _mtp_tensors(config, n_mtp: int, *, seed: int, weight_std: float, embed_std: float,
                 experts: str = "per_expert") -> dict:
    """Random MTP weights with the names and shapes of the Qwen3.5 releases (`mtp.*`; transformers'
    Qwen3_5 classes neither build nor save them). A Qwen3.5-MoE config gives the blocks its MoE FFN (router,
    experts in the `experts` layout, shared expert and its gate)."""
    import torch

    h, hd, nh, nkv, ff = config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads, \
        config.intermediate_size
    shapes = {"mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,), "mtp.pre_fc_norm_embedding.weight": (h,),
              "mtp.pre_fc_norm_hidden.weight": (h,)}
    for k in range(n_mtp):
        p = f"mtp.layers.{k}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (2 * nh * hd, h), p + "self_attn.k_proj.weight": (nkv * hd, h),
            p + "self_attn.v_proj.weight": (nkv * hd, h), p + "self_attn.o_proj.weight": (h, nh * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
        })
        shapes.update(_mtp_ffn_shapes(config, p + "mlp.", experts))
    gen = torch.Generator().manual_seed(seed + 1)
    return {name: _qwen35_value(name, shape, gen, weight_std, embed_std) for name, shape in sorted(shapes.items())}


def _mtp_ffn_shapes(config, p: str, experts: str) -> dict:
    """The shapes of one MTP block's FFN tensors (names after `p`), dense or MoE as the config is."""
    h = config.hidden_size
    if not getattr(config, "num_experts", 0):
        ff = config.intermediate_size
        return {p + "gate_proj.weight": (ff, h), p + "up_proj.weight": (ff, h), p + "down_proj.weight": (h, ff)}
    n, f, sf = config.num_experts, config.moe_intermediate_size, config.shared_expert_intermediate_size
    shapes = {p + "gate.weight": (n, h), p + "shared_expert_gate.weight": (1, h),
              p + "shared_expert.gate_proj.weight": (sf, h), p + "shared_expert.up_proj.weight": (sf, h),
              p + "shared_expert.down_proj.weight": (h, sf)}
    if experts == "fused":
        shapes.update({p + "experts.gate_up_proj": (n, 2 * f, h), p + "experts.down_proj": (n, h, f)})
    else:
        for x in range(n):
            shapes.update({f"{p}experts.{x}.gate_proj.weight": (f, h), f"{p}experts.{x}.up_proj.weight": (f, h),
                           f"{p}experts.{x}.down_proj.weight": (h, f)})
    return shapes


def _unfuse_experts(state: dict) -> dict:
    """The fused experts of a MoE state dict (`….mlp.experts.gate_up_proj` [X, 2F, E], `down_proj` [X, E, F]) as
    the per-expert tensors `save_pretrained` writes (`….mlp.experts.N.{gate,up,down}_proj.weight`)."""
    out = {}
    for name, t in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            base, f = name[: -len("gate_up_proj")], t.shape[1] // 2
            for x in range(t.shape[0]):
                out[f"{base}{x}.gate_proj.weight"], out[f"{base}{x}.up_proj.weight"] = t[x, :f], t[x, f:]
        elif name.endswith(".mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for x in range(t.shape[0]):
                out[f"{base}{x}.down_proj.weight"] = t[x]
        else:
            out[name] = t
    return out


def _draw_routers(model, *, seed: int, router_std: float) -> None:
    """Re-draw every router (`mlp.gate.weight`) N(0, router_std): wider than the other weights, so a token's k-th
    and (k+1)-th experts are far enough apart that f32 rounding does not swap them."""
    import torch

    gen = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("mlp.gate.weight"):
                p.copy_(router_std * torch.randn(p.shape, generator=gen))


def _add_safetensors_part(path: Path, part: str, tensors: dict) -> None:
    """Write `tensors` as another shard `part` and list every tensor in model.safetensors.index.json."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        index = json.loads(index_file.read_text())
    else:
        index = {"metadata": {}, "weight_map": {}}
        for f in sorted(path.glob("model*.safetensors")):
            with safe_open(f, "pt") as st:
                index["weight_map"].update({k: f.name for k in st.keys()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / part), metadata={"format": "pt"})
    index["weight_map"].update({k: part for k in tensors})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index_file.write_text(json.dumps(index, indent=2))


def make_qwen35_checkpoint(
    path: str | Path,
    *,
    hidden: int = 64,
    n_layers: int = 4,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 32,
    intermediate: int | None = None,
    linear_k_heads: int = 2,
    linear_v_heads: int = 4,
    linear_head_dim: int = 16,
    conv_kernel: int = 4,
    partial_rotary: float = 0.25,
    mrope_section: list[int] | str | None = "auto",
    layer_types: list[str] | None = None,
    full_attention_interval: int | None = None,
    tie: bool = False,
    mtp_layers: int = 0,
    layout: str = "causal",
    n_experts: int = 0,
    top_k: int = 2,
    expert_ff: int = 32,
    shared_ff: int = 48,
    experts: str = "per_expert",
    router_std: float = 0.5,
    seed: int = 0,
    dtype: str = "float32",
    tokenizer_vocab: int = 768,
    vocab_size: int | None = None,
    max_shard_size: str | int | None = None,
    weight_std: float = 0.2,
    embed_std: float = 1.0,
    rope_theta: float = 10_000_000.0,
    max_position_embeddings: int = 4096,
    rms_norm_eps: float = 1e-6,
) -> Path:
    """Write a tiny random Qwen3.5 (dense) checkpoint + a Qwen3.5-style tokenizer into `path`.

    `layout="causal"`: `Qwen3_5ForCausalLM` saved by transformers. `layout="conditional"`: the
    `Qwen3_5ForConditionalGeneration` layout of the Qwen releases (`model.language_model.*`, a small
    random vision tower under `model.visual.*`, config with text_config / vision_config).
    `mtp_layers > 0` adds multi-token-prediction weights (`mtp.*`, in their own shard
    `model-mtp.safetensors`, with an index) and `mtp_num_hidden_layers` to the config, as the
    releases ship them. `mrope_section="auto"` writes sections in Qwen3.5's proportions
    (`rope_parameters.mrope_section`, `mrope_interleaved`); None leaves them out (the config
    default). `layer_types=None` lets the config derive them from `full_attention_interval`
    (written only when given; default 4).

    `n_experts > 0` makes it Qwen3.5-MoE (`Qwen3_5MoeForCausalLM` / `…ForConditionalGeneration`): every layer's
    FFN is `n_experts` routed experts of width `expert_ff`, `top_k` per token, plus a shared expert of width
    `shared_ff` behind a sigmoid gate. Routers are drawn with `router_std` (clear margins between a token's k-th
    and (k+1)-th expert). `experts="per_expert"` keeps what `save_pretrained` writes; `"fused"` rewrites them as
    `mlp.experts.gate_up_proj` / `down_proj` (the layout transformers 5 holds in memory).
    """
    import torch
    from safetensors.torch import save_file
    import transformers
    from transformers import GenerationConfig

    moe = n_experts > 0
    family = "Qwen3_5Moe" if moe else "Qwen3_5"
    Qwen3_5Config = getattr(transformers, family + "Config")
    Qwen3_5ForCausalLM = getattr(transformers, family + "ForCausalLM")
    Qwen3_5TextConfig = getattr(transformers, family + "TextConfig")
    moe_fields = dict(num_experts=n_experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_ff,
                      shared_expert_intermediate_size=shared_ff) if moe else {}
    if experts not in ("per_expert", "fused"):
        raise ValueError(f"experts {experts!r}")

    path = Path(path)
    tok, n_vocab = _tokenizer_and_rows(path, tokenizer_vocab, vocab_size, QWEN35_SPLIT_REGEX)
    if layout not in ("causal", "conditional"):
        raise ValueError(f"layout {layout!r}")

    rope = {"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": partial_rotary}
    if mrope_section == "auto":
        mrope_section = _default_mrope_section(head_dim, partial_rotary)
    if mrope_section is not None:
        rope.update(mrope_section=list(mrope_section), mrope_interleaved=True)
    extra = {} if full_attention_interval is None else {"full_attention_interval": full_attention_interval}
    text = Qwen3_5TextConfig(
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
        rope_parameters=rope,
        tie_word_embeddings=tie,
        linear_conv_kernel_dim=conv_kernel,
        linear_key_head_dim=linear_head_dim,
        linear_value_head_dim=linear_head_dim,
        linear_num_key_heads=linear_k_heads,
        linear_num_value_heads=linear_v_heads,
        layer_types=layer_types,
        bos_token_id=tok["endoftext"],
        eos_token_id=tok["im_end"],
        architectures=[family + "ForCausalLM"],
        **moe_fields,
        **extra,
    )
    if mtp_layers:
        text.mtp_num_hidden_layers = mtp_layers
        text.mtp_use_dedicated_embeddings = False
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(text)
    _qwen35_weights(model, seed=seed, weight_std=weight_std, embed_std=embed_std)
    if moe:
        _draw_routers(model, seed=seed, router_std=router_std)
    model = model.to(getattr(torch, dtype))
    generation = GenerationConfig(bos_token_id=tok["endoftext"], eos_token_id=[tok["im_end"], tok["endoftext"]],
                                  pad_token_id=tok["endoftext"])

    if layout == "causal":
        model.generation_config = generation
        model.save_pretrained(path, **({} if max_shard_size is None else {"max_shard_size": max_shard_size}))
        if full_attention_interval is not None and layer_types is None:
            # Qwen3_5TextConfig turns the interval into layer_types; keep the raw field as the Hub configs do
            cfg = json.loads((path / "config.json").read_text())
            cfg["full_attention_interval"] = full_attention_interval
            (path / "config.json").write_text(json.dumps(cfg, indent=2))
    else:
        state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                 for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
        if moe and experts == "per_expert":
            state = _unfuse_experts(state)
        gen = torch.Generator().manual_seed(seed + 2)
        state["model.visual.patch_embed.proj.weight"] = 0.02 * torch.randn((16, 3, 2, 4, 4), generator=gen)
        state["model.visual.merger.linear_fc1.weight"] = 0.02 * torch.randn((64, 64), generator=gen)
        state = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in sorted(state.items())}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        text_dict = text.to_dict()
        for k in ("architectures", "transformers_version", "_name_or_path"):
            text_dict.pop(k, None)
        full = Qwen3_5Config(
            text_config=text_dict,
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                               temporal_patch_size=2, out_hidden_size=hidden),
            tie_word_embeddings=tie,
            architectures=[family + "ForConditionalGeneration"],
        )
        full.save_pretrained(path)
        generation.save_pretrained(path)
    if experts == "fused":
        _fuse_experts(path)
    if mtp_layers:
        mtp = _mtp_tensors(text, mtp_layers, seed=seed, weight_std=weight_std, embed_std=embed_std, experts=experts)
        _add_safetensors_part(path, "model-mtp.safetensors", {k: v.to(getattr(torch, dtype)) for k, v in mtp.items()})
    return path


def make_qwen35_shape(path: str | Path, shape: str, **overrides) -> Path:
    """`make_qwen35_checkpoint` with one of the named `QWEN35_SHAPES`."""
    return make_qwen35_checkpoint(path, **{**QWEN35_SHAPES[shape], **overrides})


def make_qwen35moe_shape(path: str | Path, shape: str, **overrides) -> Path:
    """`make_qwen35_checkpoint` (Qwen3.5-MoE) with one of the named `QWEN35MOE_SHAPES`."""
    return make_qwen35_checkpoint(path, **{**QWEN35MOE_SHAPES[shape], **overrides})


# ---------------------------------------------------------------------------------------------------
# DFlash drafts (z-lab layout)


def _target_text_config(target_dir: Path) -> dict:
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    return {**cfg, **(cfg.get("text_config") or {})}


def make_dflash_checkpoint(
    path: str | Path,
    target_dir: str | Path,
    *,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate: int | None = None,
    hidden: int | None = None,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    block_size: int | None = 16,
    is_causal: bool | None = None,
    prefix: str = "",
    with_lm_head: bool = False,
    with_embed_tokens: bool = False,
    extra_config: dict | None = None,
    extra_tensors: dict | None = None,
    seed: int = 0,
    dtype: str = "float32",
    weight_std: float = 0.2,
    rms_norm_eps: float = 1e-6,
) -> Path:
    """Write a tiny random DFlash draft for the target checkpoint `target_dir` (z-lab layout).

    Tensors (safetensors, no `model.` prefix unless `prefix="model."`): Qwen3 decoder layers
    `layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
    post_attention_layernorm, mlp.{gate,up,down}_proj}`, `fc.weight` `[H, n_ext·H]`,
    `hidden_norm.weight`, `norm.weight`; no embedding and no LM head (the target's), unless
    `with_embed_tokens` / `with_lm_head`. config.json as z-lab ships it: `architectures:
    [DFlashDraftModel]`, `model_type: qwen3`, `dflash_config {mask_token_id, target_layer_ids}`,
    `block_size`, `num_target_layers`, the Qwen3 fields (rope from the target). Defaults: hidden
    size = the target's, target_layer_ids spread like z-lab's build_target_layer_ids, mask token =
    the last row of the target embedding. `is_causal` is written only when given; `extra_config`
    entries are merged in last (None values delete a key); `extra_tensors` (name → shape) adds
    random tensors.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3Model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tcfg = _target_text_config(Path(target_dir))
    n_target = tcfg["num_hidden_layers"]
    hidden = hidden if hidden is not None else tcfg["hidden_size"]
    head_dim = head_dim if head_dim is not None else max(16, hidden // n_heads)
    if target_layer_ids is None:
        if n_layers == 1:
            target_layer_ids = [n_target // 2]
        else:
            target_layer_ids = [int(round(1 + i * (n_target - 4) / (n_layers - 1))) for i in range(n_layers)]
    n_vocab = tcfg["vocab_size"]
    mask_token_id = n_vocab - 1 if mask_token_id is None else mask_token_id
    rope = tcfg.get("rope_parameters") or {}
    rope_theta = rope.get("rope_theta", tcfg.get("rope_theta", 10000.0))

    config = Qwen3Config(
        vocab_size=n_vocab, hidden_size=hidden, intermediate_size=intermediate or 3 * hidden,
        num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, head_dim=head_dim,
        rms_norm_eps=rms_norm_eps, max_position_embeddings=tcfg.get("max_position_embeddings", 4096),
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    body = Qwen3Model(config)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in sorted(body.state_dict().items()):
        if name == "embed_tokens.weight" and not with_embed_tokens:
            continue
        state[name] = (1.0 + 0.1 * torch.randn(p.shape, generator=gen)) if "norm" in name else \
            weight_std * torch.randn(p.shape, generator=gen)
    n_ext = len(target_layer_ids)
    state["fc.weight"] = weight_std / n_ext ** 0.5 * torch.randn((hidden, n_ext * hidden), generator=gen)
    state["hidden_norm.weight"] = 1.0 + 0.1 * torch.randn((hidden,), generator=gen)
    if with_lm_head:
        state["lm_head.weight"] = weight_std * torch.randn((n_vocab, hidden), generator=gen)
    for name, shape in (extra_tensors or {}).items():
        state[name] = weight_std * torch.randn(tuple(shape), generator=gen)
    state = {prefix + k: v.to(getattr(torch, dtype)).contiguous() for k, v in sorted(state.items())}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})

    cfg = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": block_size,
        "bos_token_id": tcfg.get("bos_token_id"),
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
        "dtype": dtype,
        "eos_token_id": tcfg.get("eos_token_id"),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": config.intermediate_size,
        "layer_types": ["full_attention"] * n_layers,
        "max_position_embeddings": config.max_position_embeddings,
        "max_window_layers": n_layers,
        "model_type": "qwen3",
        "num_attention_heads": n_heads,
        "num_hidden_layers": n_layers,
        "num_key_value_heads": n_kv_heads,
        "num_target_layers": n_target,
        "rms_norm_eps": rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": n_vocab,
    }
    if block_size is None:
        del cfg["block_size"]
    if is_causal is not None:
        cfg["is_causal"] = is_causal
    for k, v in (extra_config or {}).items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def make_dflash2_checkpoint(path: str | Path, target_dir: str | Path, *, conv_kernel_size: int = 4,
                            conv_group_size: int = 16, selector_rank: int = 8, selector_top_k: int = 4,
                            codebook_suffix: str = "", **kw) -> Path:
    """A tiny random DFlash2 draft (z-lab's `DFlash2DraftModel` layout): make_dflash_checkpoint's DFlash draft plus,
    per layer, `attention_conv` / `mlp_conv` (`base_kernel` [2, K, H], `kernel_projection.weight`
    [2*K*groups, H]) and a `candidate_selector` (`predecessor_codebook` / `successor_codebook` [V, rank], stored
    without a `.weight` suffix as z-lab ships them unless codebook_suffix=".weight"; `hidden_projection.weight`
    [rank, H]), with the four sizes in dflash_config."""
    path = make_dflash_checkpoint(path, target_dir, **kw)
    cfg = json.loads((path / "config.json").read_text())
    hidden, n_layers, n_vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    groups = hidden // conv_group_size
    extra = {"candidate_selector.hidden_projection.weight": (selector_rank, hidden),
             f"candidate_selector.predecessor_codebook{codebook_suffix}": (n_vocab, selector_rank),
             f"candidate_selector.successor_codebook{codebook_suffix}": (n_vocab, selector_rank)}
    for il in range(n_layers):
        for conv in ("attention_conv", "mlp_conv"):
            extra[f"layers.{il}.{conv}.base_kernel"] = (2, conv_kernel_size, hidden)
            extra[f"layers.{il}.{conv}.kernel_projection.weight"] = (2 * conv_kernel_size * groups, hidden)
    kw = {**kw, "extra_tensors": {**(kw.get("extra_tensors") or {}), **extra}}
    path = make_dflash_checkpoint(path, target_dir, **kw)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["auto_map"] = {"AutoModel": "dflash.DFlash2DraftModel"}
    cfg["dflash_config"].update(conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
                                selector_rank=selector_rank, selector_top_k=selector_top_k)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


# ---------------------------------------------------------------------------------------------------
# references read out of a transformers model


def final_pre_norm_hidden(ref, tokens: list[int]):
    """transformers' final hidden state of every token before the output norm, [n_tokens, hidden] (its
    hidden_states[-1] is after the norm): the input of the text model's `norm`."""
    import torch

    modules = dict(ref.named_modules())
    norm = modules.get("model.norm") or modules["model.language_model.norm"]
    seen = {}

    def keep_input(module, args, output):
        seen["x"] = args[0][0].numpy()  # returns None: the output stays as it is

    hook = norm.register_forward_hook(keep_input)
    try:
        with torch.no_grad():
            ref(torch.tensor([tokens]))
    finally:
        hook.remove()
    return seen["x"]


# ---------------------------------------------------------------------------------------------------
# Qwen3 MoE targets

# Named shapes: expert counts (odd and even), top-k 1 to 4, tied / untied heads, head dims.
# (hidden, layers, heads, kv_heads, head_dim, experts, top-k, expert width, tie)
QWEN3MOE_SHAPES: dict[str, dict] = {
    "x4k1": dict(hidden=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, n_experts=4, top_k=1, expert_ff=64),
    "x5k2_tied": dict(hidden=64, n_layers=3, n_heads=4, n_kv_heads=1, head_dim=32, n_experts=5, top_k=2,
                      expert_ff=96, tie=True),
    "x8k4": dict(hidden=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=8, top_k=4, expert_ff=64),
    "x7k3": dict(hidden=64, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=64, n_experts=7, top_k=3, expert_ff=32),
}


def _fuse_experts(path: Path) -> None:
    """Rewrite the per-expert tensors of a saved MoE checkpoint (`mlp.experts.N.{gate,up,down}_proj.weight`)
    in the fused layout transformers 5 holds in memory (`mlp.experts.gate_up_proj` [X, 2F, E],
    `mlp.experts.down_proj` [X, E, F]), one safetensors file, no index."""
    import re

    import torch
    from safetensors.torch import load_file, save_file

    state = {}
    for f in sorted(path.glob("model*.safetensors")):
        state.update(load_file(str(f)))
        f.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    per_expert = re.compile(r"^(.*\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    layers: dict[str, dict[str, dict[int, object]]] = {}
    fused = {}
    for name, t in state.items():
        if (m := per_expert.match(name)) is not None:
            layers.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = t
        else:
            fused[name] = t
    if not layers:
        raise ValueError(f"{path}: no per-expert tensors to fuse")
    for prefix, projs in layers.items():
        n = len(projs["down_proj"])
        stack = {p: torch.stack([projs[p][x] for x in range(n)]) for p in projs}
        fused[prefix + ".gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        fused[prefix + ".down_proj"] = stack["down_proj"]
    save_file({k: v.contiguous() for k, v in sorted(fused.items())}, str(path / "model.safetensors"),
              metadata={"format": "pt"})


def make_qwen3moe_shape(path: str | Path, shape: str, **overrides) -> Path:
    """`make_qwen3_checkpoint` (Qwen3-MoE) with one of the named `QWEN3MOE_SHAPES`."""
    return make_qwen3_checkpoint(path, **{**QWEN3MOE_SHAPES[shape], **overrides})


# --------------------------------------------------------------------------------------------------
# made checkpoints, cached and edited (the converters' tests)


def checkpoint_cache(make_shape, tmp_path_factory):
    """`make(shape, **overrides) -> Path` over a `make_*_shape` function, each checkpoint written once, into a fresh
    temporary folder (for a module- or session-scoped fixture)."""
    made: dict = {}

    def make(shape: str, **overrides) -> Path:
        key = (shape, json.dumps(overrides, sort_keys=True))
        if key not in made:
            made[key] = make_shape(tmp_path_factory.mktemp(shape) / "hf", shape, **overrides)
        return made[key]

    return make


def copy_checkpoint(model: Path, dst: Path) -> Path:
    """A copy of the checkpoint folder `model` to edit."""
    import shutil

    return Path(shutil.copytree(model, dst))


def edit_config(model: Path, fn) -> None:
    """Rewrite `model`/config.json with `fn(config dict)` applied."""
    cfg = json.loads((model / "config.json").read_text())
    fn(cfg)
    (model / "config.json").write_text(json.dumps(cfg, indent=2))


def hf_tensors(model: Path) -> dict:
    """Every tensor of the checkpoint's safetensors files, by name (numpy)."""
    from safetensors.numpy import load_file

    out: dict = {}
    for f in sorted(model.glob("model*.safetensors")):
        out.update(load_file(f))
    return out


def drop_tensor(model: Path, name: str) -> None:
    """Remove tensor `name` from the checkpoint (its shard and, if there is one, the index)."""
    from safetensors.numpy import load_file, save_file

    for f in sorted(model.glob("model*.safetensors")):
        state = load_file(str(f))
        if name in state:
            del state[name]
            save_file(state, str(f), metadata={"format": "pt"})
            index = model / "model.safetensors.index.json"
            if index.is_file():
                idx = json.loads(index.read_text())
                del idx["weight_map"][name]
                index.write_text(json.dumps(idx, indent=2))
            return
    raise KeyError(f"{model}: no tensor {name!r}")
