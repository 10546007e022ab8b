"""HF Qwen3.5-MoE → GGUF arch `qwen35moe` (llama.cpp `Qwen3_5MoeTextModel`, `conversion/qwen.py`): the Qwen3.5
converter (convert/qwen35.py: the hybrid layers, both checkpoint layouts, MTP blocks appended) with a MoE FFN in
every block, the MTP ones included.

Keys: qwen35's, where the generic ones carry `expert_count` and `expert_used_count`, followed by
`expert_feed_forward_length` and `expert_shared_feed_forward_length`. Tensors: the router `mlp.gate` →
`ffn_gate_inp` (kept F32); the routed experts, stored per expert or fused, → `ffn_{gate,up,down}_exps`, or
`ffn_gate_up_exps` and `ffn_down_exps` with `--fuse-gate-up-exps` (convert/moe_experts.py); the shared expert
`mlp.shared_expert.*` → `ffn_{gate,up,down}_shexp` and its gate `mlp.shared_expert_gate` → `ffn_gate_inp_shexp`
(F32).
"""

from __future__ import annotations

from typing import Any, Iterable

from pydflash.errors import ConversionError

from .base import LazyTensor, register
from .moe_experts import RoutedExperts, add_expert_widths
from .qwen35 import QWEN35_TEXT_DEFAULTS, Qwen35Converter
from .qwen_names import MOE_ROUTER, SHARED_EXPERT, weights

# `Qwen3_5MoeTextConfig` defaults (transformers 5) where they differ from the dense config's; it has no
# intermediate_size, so no feed_forward_length is written unless config.json has one
QWEN35MOE_TEXT_DEFAULTS: dict[str, Any] = {
    **{k: v for k, v in QWEN35_TEXT_DEFAULTS.items() if k != "intermediate_size"},
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}


@register("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
class Qwen35MoeConverter(Qwen35Converter):
    gguf_arch = "qwen35moe"
    hparam_defaults = QWEN35MOE_TEXT_DEFAULTS
    ffn_tensors = weights({**MOE_ROUTER, **SHARED_EXPERT})

    def _read_ffn_config(self) -> None:
        cfg = self.dir_model / "config.json"
        raw = {**self.raw_hparams, **(self.raw_hparams.get("text_config") or {})}
        if "num_experts" not in raw:
            # transformers would assume 256 experts; a config without its expert count is a dense one renamed
            raise ConversionError(f"{cfg}: no num_experts: Qwen3.5 MoE checkpoints (arch qwen35moe) are not "
                                  "supported without their expert count; a dense Qwen3.5 is Qwen3_5ForCausalLM")
        n_expert = int(self.hparams["num_experts"])
        used = int(self.hparams["num_experts_per_tok"])
        if not 1 <= used <= n_expert:
            raise ConversionError(f"{cfg}: num_experts_per_tok = {used}, expected 1..num_experts ({n_expert})")
        self.experts = RoutedExperts(self.dir_model, n_expert=n_expert, n_embd=int(self.hparams["hidden_size"]),
                                     n_ff=int(self.hparams["moe_intermediate_size"]),
                                     fuse_gate_up=self.fuse_gate_up_exps)

    def _add_ffn_parameters(self) -> None:
        add_expert_widths(self.writer, self.hparams)

    def modify_tensors(self, data: LazyTensor, name: str, bid: int | None) -> Iterable[tuple[str, LazyTensor]]:
        # the experts by their llama.cpp name: an MTP block's are numbered after the trunk's layers
        if (experts := self.experts.take(data, self._hf_name(name), self.block_count, stored=name)) is not None:
            return experts
        return super().modify_tensors(data, name, bid)

    def prepare_tensors(self) -> None:
        super().prepare_tensors()
        self.experts.check_complete()
