"""Metadata-only GGUFs with the shapes of real models (Qwen3.5-27B, Qwen3-8B, the z-lab Qwen3.5-27B DFlash
drafter): every key and tensor info a load reads, no tensor data (a few KB), for memory plans.

Shapes: gguf-formats.md §3.5 (Qwen3.5-27B: 64 layers, 48 GDN + 16 attention, hidden 5120, FFN 17408, vocab
248320, 24 Q / 4 KV heads of 256, GDN state 128, 16 K groups, 48 V heads, conv kernel 4), dflash-algorithm.md
§1.8 (its drafter: 5 layers, 32/8 heads of 128, FFN 17408, block 16, HF target layers [1, 16, 31, 46, 61]), and
Qwen3-8B's config (36 layers, hidden 4096, 32/8 heads of 128, FFN 12288, vocab 151936, untied head).
Weight types follow llama.cpp's Q4_K_M recipe in outline: Q6_K for the output head, attn_v and every other
ffn_down, Q4_K for the other matrices, F32 norms and small vectors; the drafter in Q8_0. Each writer returns the path and {tensor name: bytes of its data}.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


class _InfoWriter:
    """Tensor infos (name, shape, type) into a GGUFWriter; no data."""

    def __init__(self, writer: gguf.GGUFWriter):
        self.writer = writer
        self.nbytes: dict[str, int] = {}  # name -> bytes of its data (were it written)

    def tensor(self, name: str, shape: tuple[int, ...], qtype: Q = Q.F32) -> None:
        # shape in numpy order (rows, columns); ggml's ne is the reverse
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n = int(np.prod(shape))
        if shape[-1] % block:
            raise ValueError(f"{name}: {shape[-1]} columns are not a multiple of {qtype.name}'s block {block}")
        self.nbytes[name] = n // block * type_size
        self.writer.add_tensor_info(name, shape, np.dtype(np.float32), self.nbytes[name], raw_dtype=qtype)

    def attention_layer(self, p: str, E: int, hd: int, n_heads: int, n_kv: int, gated_q: bool, mat: Q,
                        v_type: Q) -> None:
        self.tensor(p + "attn_q.weight", ((2 if gated_q else 1) * hd * n_heads, E), mat)
        self.tensor(p + "attn_k.weight", (hd * n_kv, E), mat)
        self.tensor(p + "attn_v.weight", (hd * n_kv, E), v_type)
        self.tensor(p + "attn_output.weight", (E, hd * n_heads), mat)
        self.tensor(p + "attn_q_norm.weight", (hd,))
        self.tensor(p + "attn_k_norm.weight", (hd,))

    def embeddings_and_head(self, V: int, E: int) -> None:
        """Q4_K_M's token embeddings (Q4_K) and untied head (Q6_K), and the final norm."""
        self.tensor("token_embd.weight", (V, E), Q.Q4_K)
        self.tensor("output.weight", (V, E), Q.Q6_K)
        self.tensor("output_norm.weight", (E,))

    def ffn(self, p: str, E: int, n_ff: int, mat: Q, down: Q) -> None:
        self.tensor(p + "ffn_gate.weight", (n_ff, E), mat)
        self.tensor(p + "ffn_up.weight", (n_ff, E), mat)
        self.tensor(p + "ffn_down.weight", (E, n_ff), down)


def _decoder_keys(w: gguf.GGUFWriter, arch: str, *, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int,
                  head_dim: int, rope_base: float, context: int = 262144, **more: int) -> None:
    """The `{arch}.` hyper-parameters every decoder has, and `more` u32 keys (`__` for `.` in their names)."""
    keys = {"block_count": layers, "context_length": context, "embedding_length": hidden, "feed_forward_length": ffn,
            "attention.head_count": heads, "attention.head_count_kv": kv_heads, "attention.key_length": head_dim,
            "attention.value_length": head_dim, **more}
    for key, value in keys.items():
        w.add_uint32(f"{arch}.{key.replace('__', '.')}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", rope_base)


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()  # and no tensor data
    writer.close()
    # the data section starts at the next multiple of the alignment: ggml's reader seeks there
    path = Path(writer.path)
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\0" * (-size % gguf.GGUF_DEFAULT_ALIGNMENT))


def write_qwen35_27b(path: Path) -> tuple[Path, dict]:
    E, L, n_ff, V = 5120, 64, 17408, 248320
    hd, n_heads, n_kv = 256, 24, 4
    S, Hk, Hv, K = 128, 16, 48, 4
    C = 2 * S * Hk + S * Hv  # conv channels, 10240
    w = gguf.GGUFWriter(path, "qwen35")
    w.add_name("Qwen3.5-27B shape (metadata only)")
    _decoder_keys(w, "qwen35", layers=L, hidden=E, ffn=n_ff, heads=n_heads, kv_heads=n_kv, head_dim=hd,
                  rope_base=10_000_000.0, rope__dimension_count=64, ssm__conv_kernel=K, ssm__state_size=S,
                  ssm__group_count=Hk, ssm__time_step_rank=Hv, ssm__inner_size=S * Hv, full_attention_interval=4)
    w.add_array("qwen35.rope.dimension_sections", [11, 11, 10, 0])
    t = _InfoWriter(w)
    t.embeddings_and_head(V, E)
    for il in range(L):
        p = f"blk.{il}."
        down = Q.Q6_K if il % 2 == 0 else Q.Q4_K
        t.tensor(p + "attn_norm.weight", (E,))
        t.tensor(p + "post_attention_norm.weight", (E,))
        t.ffn(p, E, n_ff, Q.Q4_K, down)
        if (il + 1) % 4 != 0:
            t.tensor(p + "attn_qkv.weight", (C, E), Q.Q4_K)
            t.tensor(p + "attn_gate.weight", (S * Hv, E), Q.Q4_K)
            t.tensor(p + "ssm_conv1d.weight", (C, K))
            t.tensor(p + "ssm_dt.bias", (Hv,))
            t.tensor(p + "ssm_a", (Hv,))
            t.tensor(p + "ssm_beta.weight", (Hv, E))
            t.tensor(p + "ssm_alpha.weight", (Hv, E))
            t.tensor(p + "ssm_norm.weight", (S,))
            t.tensor(p + "ssm_out.weight", (E, S * Hv), Q.Q4_K)
        else:
            t.attention_layer(p, E, hd, n_heads, n_kv, True, Q.Q4_K, Q.Q6_K)
    _finish(w)
    return Path(path), t.nbytes


def write_qwen35_27b_dflash(path: Path) -> tuple[Path, dict]:
    E, L, n_ff = 5120, 5, 17408
    hd, n_heads, n_kv = 128, 32, 8
    w = gguf.GGUFWriter(path, "dflash")
    w.add_name("z-lab Qwen3.5-27B-DFlash shape (metadata only)")
    _decoder_keys(w, "dflash", layers=L, hidden=E, ffn=n_ff, heads=n_heads, kv_heads=n_kv, head_dim=hd,
                  rope_base=10_000_000.0, block_size=16)
    w.add_array("dflash.target_layers", [i + 1 for i in (1, 16, 31, 46, 61)])
    w.add_array("dflash.rope.dimension_sections", [hd // 2, 0, 0, 0])
    w.add_uint32("tokenizer.ggml.mask_token_id", 248070)
    t = _InfoWriter(w)
    t.tensor("fc.weight", (E, 5 * E), Q.Q8_0)
    t.tensor("enc.output_norm.weight", (E,))
    t.tensor("output_norm.weight", (E,))
    for il in range(L):
        p = f"blk.{il}."
        t.tensor(p + "attn_norm.weight", (E,))
        t.tensor(p + "ffn_norm.weight", (E,))
        t.attention_layer(p, E, hd, n_heads, n_kv, False, Q.Q8_0, Q.Q8_0)
        t.ffn(p, E, n_ff, Q.Q8_0, Q.Q8_0)
    _finish(w)
    return Path(path), t.nbytes


def write_qwen3_8b(path: Path) -> tuple[Path, dict]:
    E, L, n_ff, V = 4096, 36, 12288, 151936
    hd, n_heads, n_kv = 128, 32, 8
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_name("Qwen3-8B shape (metadata only)")
    _decoder_keys(w, "qwen3", layers=L, hidden=E, ffn=n_ff, heads=n_heads, kv_heads=n_kv, head_dim=hd,
                  rope_base=1_000_000.0, context=40960)
    t = _InfoWriter(w)
    t.embeddings_and_head(V, E)
    for il in range(L):
        p = f"blk.{il}."
        t.tensor(p + "attn_norm.weight", (E,))
        t.tensor(p + "ffn_norm.weight", (E,))
        t.attention_layer(p, E, hd, n_heads, n_kv, False, Q.Q4_K, Q.Q6_K)
        t.ffn(p, E, n_ff, Q.Q4_K, Q.Q6_K if il % 2 == 0 else Q.Q4_K)
    _finish(w)
    return Path(path), t.nbytes
