"""Hugging Face tensor names of the Qwen blocks and their GGUF names (after "layers.N." and after "blk.N.", without
the ".weight" / ".bias" ending), shared by the qwen3, qwen35, MoE and DFlash converters."""

from __future__ import annotations

import re

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
# a MoE FFN's router, and the shared expert with its sigmoid gate (qwen35moe); the routed experts are stacked
# (convert/moe_experts.py)
MOE_ROUTER = {"mlp.gate": "ffn_gate_inp"}
SHARED_EXPERT = {
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# a Qwen3 layer (also the DFlash drafter's): a norm before the attention, one before the FFN
QWEN3_LAYER = {"input_layernorm": "attn_norm", **ATTENTION, "post_attention_layernorm": "ffn_norm", **FFN}


def weights(names: dict[str, str]) -> dict[str, str]:
    """The same table with the ".weight" ending on both sides."""
    return {f"{hf}.weight": f"{gguf}.weight" for hf, gguf in names.items()}


def gguf_name(name: str, global_names: dict[str, str], layer_re: re.Pattern, layer_names: dict[str, str],
              block_count: int, ending: str = "") -> str | None:
    """The GGUF name of HF tensor `name`: a global one (`global_names`), or "blk.N." + its layer name + `ending`
    when `layer_re` matches it as (N, what follows "layers.N.") with N below block_count; None when neither."""
    if name in global_names:
        return global_names[name]
    if (m := layer_re.match(name)) is not None:
        bid, sub = int(m[1]), m[2]
        if sub in layer_names and bid < block_count:
            return f"blk.{bid}.{layer_names[sub]}{ending}"
    return None
