"""HF `Qwen3MoeForCausalLM` → GGUF arch `qwen3moe` (llama.cpp `Qwen3MoeModel(Qwen2MoeModel)`, `conversion/qwen.py`).

Keys: the generic decoder keys (with `expert_count` and `expert_used_count`), then `expert_feed_forward_length`
(`moe_intermediate_size`). Tensors: the Qwen3 layer's attention and norms renamed; the router `mlp.gate` →
`ffn_gate_inp` (kept F32); the experts, stored per expert or fused, stacked into `ffn_{down,gate,up}_exps`
(convert/moe_experts.py).

llama.cpp's qwen3moe always renormalises the top-k router probabilities and has no dense layers, so checkpoints
with `norm_topk_prob: false`, `mlp_only_layers` or a `decoder_sparse_step` other than 1 are refused (converted,
they would compute something else than the checkpoint). So is `--fuse-gate-up-exps`: llama.cpp's converter fails
on it for qwen3moe (its gguf-py lists no `ffn_gate_up_exps` for the arch) and its qwen3moe loader would not read one.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from pydflash.errors import ConversionError

from .base import LazyTensor, ModelConverter, register
from .moe_experts import RoutedExperts, add_expert_widths
from .qwen_names import ATTENTION, MOE_ROUTER, gguf_name
from .vocab import set_vocab_gpt2

# HF name (after "model.layers.N.", without ".weight") → GGUF name (after "blk.N.")
_LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    **ATTENTION,
    "post_attention_layernorm": "ffn_norm",
    **MOE_ROUTER,
}
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")


@register("Qwen3MoeForCausalLM")
class Qwen3MoeConverter(ModelConverter):
    gguf_arch = "qwen3moe"
    # Qwen3MoeConfig defaults for optional fields (what AutoConfig(...).to_dict() would add)
    hparam_defaults = {
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "num_experts": 128,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
    }

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.hparams.setdefault("num_key_value_heads", self.hparams.get("num_attention_heads"))
        cfg = self.dir_model / "config.json"
        if self.fuse_gate_up_exps:
            raise ConversionError(f"{self.dir_model}: --fuse-gate-up-exps: llama.cpp's qwen3moe has no merged "
                                  "ffn_gate_up_exps tensor (neither its converter nor its loader knows one); "
                                  "convert without the flag")
        if not self.hparams["norm_topk_prob"]:
            raise ConversionError(f"{cfg}: norm_topk_prob is false (or absent, its default), but llama.cpp's "
                                  "qwen3moe always renormalises the top-k router probabilities; expected true")
        if self.hparams.get("mlp_only_layers") or self.hparams["decoder_sparse_step"] != 1:
            raise ConversionError(f"{cfg}: mlp_only_layers = {self.hparams.get('mlp_only_layers')}, "
                                  f"decoder_sparse_step = {self.hparams['decoder_sparse_step']}: dense layers among "
                                  "the MoE ones are not in llama.cpp's qwen3moe; expected [] and 1")
        n_expert = int(self.find_hparam(["num_local_experts", "num_experts"]))
        used = int(self.find_hparam(["num_experts_per_tok"]))
        if not 1 <= used <= n_expert:
            raise ConversionError(f"{cfg}: num_experts_per_tok = {used}, expected 1..num_experts ({n_expert})")
        self.experts = RoutedExperts(self.dir_model, n_expert=n_expert, n_embd=int(self.find_hparam(["hidden_size"])),
                                     n_ff=int(self.hparams["moe_intermediate_size"]))

    def set_gguf_parameters(self) -> None:
        super().set_gguf_parameters()
        add_expert_widths(self.writer, self.hparams)

    def set_vocab(self) -> None:
        set_vocab_gpt2(self.writer, self.dir_model, int(self.hparams["vocab_size"]))

    def map_tensor_name(self, name: str) -> str:
        if (mapped := gguf_name(name, _GLOBAL_TENSORS, _LAYER_RE, _LAYER_TENSORS, self.block_count, ".weight")):
            return mapped
        raise ConversionError(f"{self.dir_model}: cannot map tensor {name!r} of a Qwen3MoeForCausalLM checkpoint "
                              f"(block_count {self.block_count})")

    def modify_tensors(self, data: LazyTensor, name: str, bid: int | None) -> Iterable[tuple[str, LazyTensor]]:
        if (experts := self.experts.take(data, name, self.block_count)) is not None:
            return experts
        return [(self.map_tensor_name(name), data)]

    def prepare_tensors(self) -> None:
        super().prepare_tensors()
        self.experts.check_complete()
