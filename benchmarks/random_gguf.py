"""Random-weight Qwen3-shaped GGUFs for speed measurements (timing does not depend on the weights).

The tokenizer keys come from llama.cpp's real Qwen2 vocabulary fixture, so both engines load the file and
the LM head has the real 151,936-row shape. Weights are quantized with ggml's own quantizer
(`pydflash._core.quantize`), one tensor at a time, so a ~0.6B model needs no torch and little memory.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from pydflash import _core

SHAPES = {
    # name: hidden, layers, heads, kv heads, head dim, ffn
    "tiny": dict(hidden=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, n_ff=768),
    "0.6b": dict(hidden=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, n_ff=3072),  # Qwen3-0.6B
}

_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
                   "tokenizer.ggml.bos_token_id")


def _copy_tokenizer(writer: gguf.GGUFWriter, vocab_gguf: Path) -> int:
    reader = gguf.GGUFReader(vocab_gguf)
    for key in _TOKENIZER_KEYS:
        field = reader.fields[key]
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def write_random_qwen3(path: Path, shape: str, weight_type: str, vocab_gguf: Path, seed: int = 0) -> Path:
    """Write a random Qwen3 GGUF of `shape` with 2-D weights in `weight_type` (f32, f16, q8_0, q4_0, ...)."""
    s = SHAPES[shape]
    qtype = gguf.GGMLQuantizationType[weight_type.upper()]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "qwen3")
    n_vocab = _copy_tokenizer(writer, vocab_gguf)
    E, hd = s["hidden"], s["head_dim"]
    writer.add_name(f"random-qwen3-{shape}")
    writer.add_block_count(s["n_layers"])
    writer.add_context_length(40960)
    writer.add_embedding_length(E)
    writer.add_feed_forward_length(s["n_ff"])
    writer.add_head_count(s["n_heads"])
    writer.add_head_count_kv(s["n_kv_heads"])
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)

    def matrix(name: str, n_out: int, n_in: int) -> None:
        w = rng.standard_normal((n_out, n_in), dtype=np.float32) * (1.0 / np.sqrt(n_in))
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(name, w.astype(np.float16 if qtype == gguf.GGMLQuantizationType.F16 else np.float32))
        else:
            writer.add_tensor(name, _core.quantize(w, int(qtype)), raw_dtype=qtype)

    def vector(name: str, n: int) -> None:
        writer.add_tensor(name, (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32))

    matrix("token_embd.weight", n_vocab, E)  # tied head, as in Qwen3-0.6B
    vector("output_norm.weight", E)
    for il in range(s["n_layers"]):
        p = f"blk.{il}."
        vector(p + "attn_norm.weight", E)
        matrix(p + "attn_q.weight", hd * s["n_heads"], E)
        matrix(p + "attn_k.weight", hd * s["n_kv_heads"], E)
        matrix(p + "attn_v.weight", hd * s["n_kv_heads"], E)
        matrix(p + "attn_output.weight", E, hd * s["n_heads"])
        vector(p + "attn_q_norm.weight", hd)
        vector(p + "attn_k_norm.weight", hd)
        vector(p + "ffn_norm.weight", E)
        matrix(p + "ffn_gate.weight", s["n_ff"], E)
        matrix(p + "ffn_up.weight", s["n_ff"], E)
        matrix(p + "ffn_down.weight", E, s["n_ff"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
