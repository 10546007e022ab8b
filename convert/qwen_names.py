"""Hugging Face tensor names of the Qwen blocks and their GGUF names (after "layers.N." and after "blk.N.", without
the ".weight" / ".bias" ending), shared by the qwen3, qwen35 and DFlash converters."""

from __future__ import annotations

# full attention: the projections and the per-head QK norms
ATTENTION = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
# the SwiGLU FFN
FFN = {
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# a Qwen3 layer (also the DFlash drafter's): a norm before the attention, one before the FFN
QWEN3_LAYER = {"input_layernorm": "attn_norm", **ATTENTION, "post_attention_layernorm": "ffn_norm", **FFN}


def weights(names: dict[str, str]) -> dict[str, str]:
    """The same table with the ".weight" ending on both sides."""
    return {f"{hf}.weight": f"{gguf}.weight" for hf, gguf in names.items()}
