"""Random-weight Qwen3-, Qwen3-MoE- and Qwen3.5-shaped GGUFs for speed measurements (timing does not depend on the weights).

The tokenizer keys come from llama.cpp's real Qwen2 vocabulary fixture, so both engines load the file and
the LM head has the real 151,936-row shape. Weights are quantized with ggml's own quantizer
(`pydflash._core.quantize`), one tensor at a time, so a ~0.6B model needs no torch and little memory.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from pydflash import _core
from pydflash.convert.dflash import default_target_layer_ids

SHAPES = {
    # name: hidden, layers, heads, kv heads, head dim, ffn
    "tiny": dict(hidden=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, n_ff=768),
    "0.6b": dict(hidden=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, n_ff=3072),  # Qwen3-0.6B
}
# MoE (qwen3moe): experts of width expert_ff, top_k of them per token; "1b": 64 experts, top-8, ~1.1B parameters
# (0.25B active per token), Qwen3-30B-A3B's layer in miniature
MOE_SHAPES = {
    "tiny": dict(hidden=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=8, top_k=2, expert_ff=128),
    "1b": dict(hidden=1024, n_layers=16, n_heads=16, n_kv_heads=4, head_dim=128, n_experts=64, top_k=8,
               expert_ff=256),
}
# hybrid: every 4th layer full attention; GDN with k_heads / v_heads of dimension ssm_dim, conv kernel 4
HYBRID_SHAPES = {
    "tiny": dict(hidden=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, n_ff=768, k_heads=2, v_heads=4,
                 ssm_dim=32, n_rot=16),
    "0.8b": dict(hidden=1024, n_layers=24, n_heads=8, n_kv_heads=2, head_dim=256, n_ff=3584, k_heads=16,
                 v_heads=16, ssm_dim=128, n_rot=64),  # Qwen3.5-0.8B-shaped
}

_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
                   "tokenizer.ggml.bos_token_id")


def _copy_keys(writer: gguf.GGUFWriter, meta: dict, keys) -> None:
    """Copy the `keys` present in `meta` (a `_core.gguf_metadata` answer: key -> (type, sub type, value))."""
    for key in keys:
        if key in meta:
            vtype, sub, value = meta[key]
            writer.add_key_value(key, value, gguf.GGUFValueType(vtype),
                                 sub_type=gguf.GGUFValueType(sub) if sub is not None else None)


def _copy_tokenizer(writer: gguf.GGUFWriter, vocab_gguf: Path, n_vocab: int | None = None) -> int:
    """The fixture's tokenizer keys; n_vocab larger than its vocabulary pads it with unused control tokens
    (Qwen3.5's real vocabulary has 248,320 entries, llama.cpp's fixture 151,936)."""
    # ggml's parser (pydflash._core): gguf.GGUFReader takes ~15 s over a 151,936-token vocabulary
    meta = _core.gguf_metadata(str(vocab_gguf), list(_TOKENIZER_KEYS))
    have = len(meta["tokenizer.ggml.tokens"][2])
    if n_vocab is not None and n_vocab > have:
        for key, pad in (("tokenizer.ggml.tokens", [f"<|pad_{i}|>" for i in range(have, n_vocab)]),
                         ("tokenizer.ggml.token_type", [int(gguf.TokenType.CONTROL)] * (n_vocab - have))):
            vtype, sub, value = meta[key]
            meta[key] = (vtype, sub, list(value) + pad)
    _copy_keys(writer, meta, _TOKENIZER_KEYS)
    return len(meta["tokenizer.ggml.tokens"][2])


class _RandomWriter:
    """Random tensors into a GGUFWriter: 2-D weights in one type (quantized by ggml), vectors in f32."""

    def __init__(self, writer: gguf.GGUFWriter, weight_type: str, seed: int):
        self.writer = writer
        self.qtype = gguf.GGMLQuantizationType[weight_type.upper()]
        self.rng = np.random.default_rng(seed)

    def matrix(self, name: str, n_out: int, n_in: int, n_stack: int = 0, qtype=None) -> None:
        """A random [n_out, n_in] weight (numpy order), or n_stack of them stacked ([n_stack, n_out, n_in]: experts)."""
        qtype = self.qtype if qtype is None else qtype
        shape = (n_stack, n_out, n_in) if n_stack else (n_out, n_in)
        w = (self.rng.standard_normal(shape, dtype=np.float32) / np.sqrt(n_in)).astype(np.float32)
        if qtype == gguf.GGMLQuantizationType.F32:
            self.writer.add_tensor(name, w)
        elif qtype == gguf.GGMLQuantizationType.F16:
            self.writer.add_tensor(name, w.astype(np.float16))
        else:
            q = np.asarray(_core.quantize(w.reshape(-1, n_in), int(qtype)))
            self.writer.add_tensor(name, q.reshape(*shape[:-1], -1), raw_dtype=qtype)

    def qwen3_attention(self, p: str, E: int, hd: int, n_heads: int, n_kv: int) -> None:
        """A Qwen3 layer's attention half and the norm before its FFN (tensor names after prefix `p`)."""
        self.vector(p + "attn_norm.weight", E)
        self.matrix(p + "attn_q.weight", hd * n_heads, E)
        self.matrix(p + "attn_k.weight", hd * n_kv, E)
        self.matrix(p + "attn_v.weight", hd * n_kv, E)
        self.matrix(p + "attn_output.weight", E, hd * n_heads)
        self.vector(p + "attn_q_norm.weight", hd)
        self.vector(p + "attn_k_norm.weight", hd)
        self.vector(p + "ffn_norm.weight", E)

    def qwen3_layer(self, il: int, E: int, hd: int, n_heads: int, n_kv: int, n_ff: int) -> None:
        """One Qwen3 decoder layer (the target's and the DFlash draft's layers alike)."""
        p = f"blk.{il}."
        self.qwen3_attention(p, E, hd, n_heads, n_kv)
        self.matrix(p + "ffn_gate.weight", n_ff, E)
        self.matrix(p + "ffn_up.weight", n_ff, E)
        self.matrix(p + "ffn_down.weight", E, n_ff)

    def qwen3moe_layer(self, il: int, E: int, hd: int, n_heads: int, n_kv: int, n_experts: int, expert_ff: int) -> None:
        """One Qwen3-MoE decoder layer: attention as qwen3's, an f32 router and stacked experts."""
        p = f"blk.{il}."
        self.qwen3_attention(p, E, hd, n_heads, n_kv)
        self.matrix(p + "ffn_gate_inp.weight", n_experts, E, qtype=gguf.GGMLQuantizationType.F32)
        self.matrix(p + "ffn_gate_exps.weight", expert_ff, E, n_stack=n_experts)
        self.matrix(p + "ffn_up_exps.weight", expert_ff, E, n_stack=n_experts)
        self.matrix(p + "ffn_down_exps.weight", E, expert_ff, n_stack=n_experts)

    def vector(self, name: str, n: int, center: float = 1.0, spread: float = 0.05) -> None:
        self.writer.add_tensor(name, (center + spread * self.rng.standard_normal(n)).astype(np.float32))

    def raw(self, name: str, data: np.ndarray) -> None:
        self.writer.add_tensor(name, data.astype(np.float32))


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_random_qwen35(path: Path, shape: str, weight_type: str, vocab_gguf: Path, seed: int = 0,
                       n_vocab: int | None = None) -> Path:
    """Write a random Qwen3.5 hybrid GGUF of `shape` (keys and tensors as in gguf-formats.md §3)."""
    s = HYBRID_SHAPES[shape]
    writer = gguf.GGUFWriter(path, "qwen35")
    n_vocab = _copy_tokenizer(writer, vocab_gguf, n_vocab)
    E, hd, S, Hk, Hv = s["hidden"], s["head_dim"], s["ssm_dim"], s["k_heads"], s["v_heads"]
    C = 2 * S * Hk + S * Hv
    a = "qwen35."
    writer.add_name(f"random-qwen35-{shape}")
    writer.add_uint32(a + "block_count", s["n_layers"])
    writer.add_uint32(a + "context_length", 262144)
    writer.add_uint32(a + "embedding_length", E)
    writer.add_uint32(a + "feed_forward_length", s["n_ff"])
    writer.add_uint32(a + "attention.head_count", s["n_heads"])
    writer.add_uint32(a + "attention.head_count_kv", s["n_kv_heads"])
    writer.add_uint32(a + "attention.key_length", hd)
    writer.add_uint32(a + "attention.value_length", hd)
    writer.add_float32(a + "attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(a + "rope.freq_base", 10_000_000.0)
    writer.add_uint32(a + "rope.dimension_count", s["n_rot"])
    half = s["n_rot"] // 2
    writer.add_array(a + "rope.dimension_sections", [half - 2 * (half // 3), half // 3, half // 3, 0])
    writer.add_uint32(a + "ssm.conv_kernel", 4)
    writer.add_uint32(a + "ssm.state_size", S)
    writer.add_uint32(a + "ssm.group_count", Hk)
    writer.add_uint32(a + "ssm.time_step_rank", Hv)
    writer.add_uint32(a + "ssm.inner_size", S * Hv)
    writer.add_uint32(a + "full_attention_interval", 4)
    t = _RandomWriter(writer, weight_type, seed)
    t.matrix("token_embd.weight", n_vocab, E)
    t.vector("output_norm.weight", E)
    for il in range(s["n_layers"]):
        p = f"blk.{il}."
        t.vector(p + "attn_norm.weight", E)
        t.vector(p + "post_attention_norm.weight", E)
        t.matrix(p + "ffn_gate.weight", s["n_ff"], E)
        t.matrix(p + "ffn_up.weight", s["n_ff"], E)
        t.matrix(p + "ffn_down.weight", E, s["n_ff"])
        if (il + 1) % 4 != 0:
            t.matrix(p + "attn_qkv.weight", C, E)
            t.matrix(p + "attn_gate.weight", S * Hv, E)
            t.raw(p + "ssm_conv1d.weight", t.rng.standard_normal((C, 4)) * 0.5)
            t.vector(p + "ssm_dt.bias", Hv, 0.0, 0.5)
            t.raw(p + "ssm_a", -np.exp(t.rng.standard_normal(Hv) * 0.5))
            t.matrix(p + "ssm_beta.weight", Hv, E)
            t.matrix(p + "ssm_alpha.weight", Hv, E)
            t.vector(p + "ssm_norm.weight", S)
            t.matrix(p + "ssm_out.weight", E, S * Hv)
        else:
            t.matrix(p + "attn_q.weight", 2 * hd * s["n_heads"], E)
            t.matrix(p + "attn_k.weight", hd * s["n_kv_heads"], E)
            t.matrix(p + "attn_v.weight", hd * s["n_kv_heads"], E)
            t.matrix(p + "attn_output.weight", E, hd * s["n_heads"])
            t.vector(p + "attn_q_norm.weight", hd)
            t.vector(p + "attn_k_norm.weight", hd)
    _finish(writer)
    return path


def _qwen3_keys(writer: gguf.GGUFWriter, name: str, s: dict, n_ff: int) -> None:
    """The keys a Qwen3-layered model of shape `s` has (qwen3, qwen3moe)."""
    writer.add_name(name)
    writer.add_block_count(s["n_layers"])
    writer.add_context_length(40960)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(s["n_heads"])
    writer.add_head_count_kv(s["n_kv_heads"])
    writer.add_key_length(s["head_dim"])
    writer.add_value_length(s["head_dim"])
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)


def write_random_qwen3(path: Path, shape: str, weight_type: str, vocab_gguf: Path, seed: int = 0,
                       n_vocab: int | None = None) -> Path:
    """Write a random Qwen3 GGUF of `shape` with 2-D weights in `weight_type` (f32, f16, q8_0, q4_0, ...)."""
    s = SHAPES[shape]
    writer = gguf.GGUFWriter(path, "qwen3")
    n_vocab = _copy_tokenizer(writer, vocab_gguf, n_vocab)
    E, hd = s["hidden"], s["head_dim"]
    _qwen3_keys(writer, f"random-qwen3-{shape}", s, s["n_ff"])
    t = _RandomWriter(writer, weight_type, seed)
    t.matrix("token_embd.weight", n_vocab, E)  # tied head, as in Qwen3-0.6B
    t.vector("output_norm.weight", E)
    for il in range(s["n_layers"]):
        t.qwen3_layer(il, E, hd, s["n_heads"], s["n_kv_heads"], s["n_ff"])
    _finish(writer)
    return path


def write_random_qwen3moe(path: Path, shape: str, weight_type: str, vocab_gguf: Path, seed: int = 0,
                          n_vocab: int | None = None) -> Path:
    """Write a random Qwen3-MoE GGUF of `shape` (MOE_SHAPES) with matrices and experts in `weight_type`."""
    s = MOE_SHAPES[shape]
    writer = gguf.GGUFWriter(path, "qwen3moe")
    n_vocab = _copy_tokenizer(writer, vocab_gguf, n_vocab)
    E, hd = s["hidden"], s["head_dim"]
    _qwen3_keys(writer, f"random-qwen3moe-{shape}", s, s["expert_ff"] * s["top_k"])
    writer.add_expert_feed_forward_length(s["expert_ff"])
    writer.add_expert_count(s["n_experts"])
    writer.add_expert_used_count(s["top_k"])
    t = _RandomWriter(writer, weight_type, seed)
    t.matrix("token_embd.weight", n_vocab, E)
    t.vector("output_norm.weight", E)
    t.matrix("output.weight", n_vocab, E)  # untied, as Qwen3-30B-A3B
    for il in range(s["n_layers"]):
        t.qwen3moe_layer(il, E, hd, s["n_heads"], s["n_kv_heads"], s["n_experts"], s["expert_ff"])
    _finish(writer)
    return path


# the target's tokenizer keys a draft carries (gguf-formats.md §5)
_TARGET_TOKENIZER_KEYS = _TOKENIZER_KEYS + (
    "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.seperator_token_id",
    "tokenizer.ggml.cls_token_id", "tokenizer.chat_template")


def default_draft_layers(n_target_layers: int) -> int:
    """Draft depth in the proportion of the public z-lab drafts (5 draft layers for the 36-layer Qwen3-4B)."""
    return max(1, round(n_target_layers * 5 / 36))


def default_target_layers(n_target_layers: int, n_ext: int = 5) -> list[int]:
    """`dflash.target_layers` (layer *inputs*, = HF `target_layer_ids` + 1) as z-lab picks them: `n_ext` ids spread
    uniformly over target layers 1..T-3 (`build_target_layer_ids`); targets too shallow for that get ids 0.. T-2."""
    if n_target_layers >= 8:
        ids = default_target_layer_ids(n_target_layers, n_ext)
    else:
        ids = list(range(min(n_ext, n_target_layers - 1)))
    return [i + 1 for i in ids]


def write_random_dflash(path: Path, target_gguf_path: Path, weight_type: str, n_layers: int | None = None,
                        target_layers: list[int] | None = None, block_size: int = 16, seed: int = 0,
                        head_dim: int | None = None, n_ff: int | None = None, mask_token_id: int = 151669) -> Path:
    """Write a random DFlash draft (arch `dflash`, gguf-formats.md §4) for the target GGUF at `target_gguf_path`.

    Shaped like the z-lab drafts: Qwen3 decoder layers of the target's hidden size (which the format requires),
    head dim min(128, target's), as many query / KV heads as give the target's query / KV widths, the target's
    FFN width; `fc` fuses len(target_layers) captured layers; no `token_embd` / `output` (the draft borrows the
    target's). `n_layers` defaults to `default_draft_layers`, `target_layers` (GGUF convention: layer inputs,
    1..n_layer-1, = HF ids + 1) to `default_target_layers`. The tokenizer keys are the target's; M-RoPE targets
    (qwen35) get `rope.dimension_sections = [head_dim/2, 0, 0, 0]`, as our converter and llama.cpp's write them.
    """
    arch = _core.gguf_metadata(str(target_gguf_path), ["general.architecture"])["general.architecture"][2]
    hparams = ("embedding_length", "block_count", "attention.head_count", "attention.head_count_kv",
               "attention.key_length", "feed_forward_length", "context_length", "rope.freq_base",
               "attention.layer_norm_rms_epsilon", "rope.dimension_sections")
    meta = _core.gguf_metadata(str(target_gguf_path), [f"{arch}.{k}" for k in hparams] + list(_TARGET_TOKENIZER_KEYS))

    def tkey(name: str, default=None):
        entry = meta.get(f"{arch}.{name}")
        return entry[2] if entry is not None else default

    E, T = int(tkey("embedding_length")), int(tkey("block_count"))
    t_heads, t_kv = int(tkey("attention.head_count")), int(tkey("attention.head_count_kv"))
    t_hd = int(tkey("attention.key_length", E // t_heads))
    hd = head_dim or min(128, t_hd)
    n_heads, n_kv = max(1, t_heads * t_hd // hd), max(1, t_kv * t_hd // hd)
    if n_heads % n_kv:
        n_kv = 1
    n_ff = n_ff or int(tkey("feed_forward_length"))
    n_layers = n_layers or default_draft_layers(T)
    target_layers = list(target_layers or default_target_layers(T))
    if not all(1 <= layer <= T - 1 for layer in target_layers):
        raise ValueError(f"target_layers {target_layers} must lie in 1..{T - 1} (inputs of the target's layers)")
    n_vocab = len(meta["tokenizer.ggml.tokens"][2])
    if not 0 <= mask_token_id < n_vocab:
        mask_token_id = n_vocab - 1

    writer = gguf.GGUFWriter(path, "dflash")
    a = "dflash."
    writer.add_name(f"random-dflash-{n_layers}L-for-{Path(target_gguf_path).stem}")
    writer.add_uint32(a + "block_count", n_layers)
    writer.add_uint32(a + "context_length", int(tkey("context_length", 40960)))
    writer.add_uint32(a + "embedding_length", E)
    writer.add_uint32(a + "feed_forward_length", n_ff)
    writer.add_uint32(a + "attention.head_count", n_heads)
    writer.add_uint32(a + "attention.head_count_kv", n_kv)
    writer.add_uint32(a + "attention.key_length", hd)
    writer.add_uint32(a + "attention.value_length", hd)
    writer.add_float32(a + "rope.freq_base", float(tkey("rope.freq_base", 1_000_000.0)))
    writer.add_float32(a + "attention.layer_norm_rms_epsilon", float(tkey("attention.layer_norm_rms_epsilon", 1e-6)))
    writer.add_uint32(a + "block_size", block_size)
    writer.add_array(a + "target_layers", target_layers)
    if tkey("rope.dimension_sections") is not None:
        writer.add_array(a + "rope.dimension_sections", [hd // 2, 0, 0, 0])
    _copy_keys(writer, meta, _TARGET_TOKENIZER_KEYS)
    writer.add_uint32("tokenizer.ggml.mask_token_id", mask_token_id)

    t = _RandomWriter(writer, weight_type, seed)
    t.matrix("fc.weight", E, len(target_layers) * E)
    t.vector("enc.output_norm.weight", E)
    t.vector("output_norm.weight", E)
    for il in range(n_layers):
        t.qwen3_layer(il, E, hd, n_heads, n_kv, n_ff)
    _finish(writer)
    return path
