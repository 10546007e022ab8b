"""HF `Qwen3MoeForCausalLM` → GGUF arch `qwen3moe` (llama.cpp `Qwen3MoeModel(Qwen2MoeModel)`, `conversion/qwen.py`).

Keys: the generic decoder keys (with `expert_count` and `expert_used_count`), then `expert_feed_forward_length`
(`moe_intermediate_size`). Tensors: the Qwen3 layer's attention and norms renamed; the router `mlp.gate` →
`ffn_gate_inp` (kept F32); the experts stacked over the expert index into `ffn_{down,gate,up}_exps`
([n_expert, rows, cols], so ggml's ne = {cols, rows, n_expert}). The experts may be stored per expert
(`mlp.experts.N.{gate,up,down}_proj.weight`, as `save_pretrained` writes them; stacked once a layer's are all
read, down, gate, up, as llama.cpp yields them) or fused (`mlp.experts.gate_up_proj` [n_expert, 2F, E], split in
half into gate and up, and `mlp.experts.down_proj` [n_expert, E, F]).

llama.cpp's qwen3moe always renormalises the top-k router probabilities and has no dense layers, so checkpoints
with `norm_topk_prob: false`, `mlp_only_layers` or a `decoder_sparse_step` other than 1 are refused (converted,
they would compute something else than the checkpoint).
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import numpy as np

from pydflash.errors import ConversionError

from .base import LazyTensor, ModelConverter, register
from .qwen_names import ATTENTION, gguf_name
from .vocab import set_vocab_gpt2

# HF name (after "model.layers.N.", without ".weight") → GGUF name (after "blk.N.")
_LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    **ATTENTION,
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
}
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")
# the stacked tensors, in the order llama.cpp yields a layer's
_EXPERT_OUT = {"down_proj": "ffn_down_exps", "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps"}


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
        if not self.hparams["norm_topk_prob"]:
            raise ConversionError(f"{cfg}: norm_topk_prob is false (or absent, its default), but llama.cpp's "
                                  "qwen3moe always renormalises the top-k router probabilities; expected true")
        if self.hparams.get("mlp_only_layers") or self.hparams["decoder_sparse_step"] != 1:
            raise ConversionError(f"{cfg}: mlp_only_layers = {self.hparams.get('mlp_only_layers')}, "
                                  f"decoder_sparse_step = {self.hparams['decoder_sparse_step']}: dense layers among "
                                  "the MoE ones are not in llama.cpp's qwen3moe; expected [] and 1")
        self.n_expert = int(self.find_hparam(["num_local_experts", "num_experts"]))
        self.n_ff_exp = int(self.hparams["moe_intermediate_size"])
        self.n_embd = int(self.find_hparam(["hidden_size"]))
        used = int(self.find_hparam(["num_experts_per_tok"]))
        if not 1 <= used <= self.n_expert:
            raise ConversionError(f"{cfg}: num_experts_per_tok = {used}, expected 1..num_experts ({self.n_expert})")
        # per-expert tensors read so far, by layer, until the layer's are all there
        self._experts: dict[int, dict[str, LazyTensor]] = {}

    def set_gguf_parameters(self) -> None:
        super().set_gguf_parameters()
        self.writer.add_expert_feed_forward_length(self.n_ff_exp)
        if (shared := self.hparams.get("shared_expert_intermediate_size")) is not None:
            self.writer.add_expert_shared_feed_forward_length(shared)

    def set_vocab(self) -> None:
        set_vocab_gpt2(self.writer, self.dir_model, int(self.hparams["vocab_size"]))

    def map_tensor_name(self, name: str) -> str:
        if (mapped := gguf_name(name, _GLOBAL_TENSORS, _LAYER_RE, _LAYER_TENSORS, self.block_count, ".weight")):
            return mapped
        raise ConversionError(f"{self.dir_model}: cannot map tensor {name!r} of a Qwen3MoeForCausalLM checkpoint "
                              f"(block_count {self.block_count})")

    def modify_tensors(self, data: LazyTensor, name: str, bid: int | None) -> Iterable[tuple[str, LazyTensor]]:
        if (m := _FUSED_RE.match(name)) is not None:
            return self._fused_experts(data, name, int(m[1]), m[2])
        if (m := _EXPERT_RE.match(name)) is not None:
            return self._one_expert(data, name, int(m[1]), int(m[2]), m[3])
        return [(self.map_tensor_name(name), data)]

    def prepare_tensors(self) -> None:
        super().prepare_tensors()
        left = sorted(n for layer in self._experts.values() for n in layer)
        if left:
            raise ConversionError(f"{self.dir_model}: incomplete experts (each layer needs gate_proj, up_proj and "
                                  f"down_proj of all {self.n_expert} experts); left over: {left[:8]}")

    # -- experts ------------------------------------------------------------------------------------

    def _expected(self, proj: str) -> tuple[int, int]:
        return (self.n_embd, self.n_ff_exp) if proj == "down_proj" else (self.n_ff_exp, self.n_embd)

    def _check_layer(self, name: str, bid: int) -> None:
        if bid >= self.block_count:
            raise ConversionError(f"{self.dir_model}: cannot map tensor {name!r} of a Qwen3MoeForCausalLM checkpoint "
                                  f"(block_count {self.block_count})")

    def _one_expert(self, data: LazyTensor, name: str, bid: int, xid: int, proj: str) -> list[tuple[str, LazyTensor]]:
        self._check_layer(name, bid)
        if xid >= self.n_expert:
            raise ConversionError(f"{self.dir_model}: tensor {name!r} names expert {xid}, but num_experts is "
                                  f"{self.n_expert}")
        if data.shape != self._expected(proj):
            raise ConversionError(f"{self.dir_model}: tensor {name!r} has shape {list(data.shape)}, expected "
                                  f"{list(self._expected(proj))} (hidden_size, moe_intermediate_size)")
        layer = self._experts.setdefault(bid, {})
        layer[name] = data
        if len(layer) < 3 * self.n_expert:
            return []
        del self._experts[bid]
        out = []
        for proj, gguf_name in _EXPERT_OUT.items():
            parts = [layer[f"model.layers.{bid}.mlp.experts.{x}.{proj}.weight"] for x in range(self.n_expert)]
            out.append((f"blk.{bid}.{gguf_name}.weight", _stacked(parts)))
        return out

    def _fused_experts(self, data: LazyTensor, name: str, bid: int, proj: str) -> list[tuple[str, LazyTensor]]:
        self._check_layer(name, bid)
        X, E, F = self.n_expert, self.n_embd, self.n_ff_exp
        if proj == "gate_up_proj":
            expected, dims = (X, 2 * F, E), "num_experts, 2 × moe_intermediate_size, hidden_size"
        else:
            expected, dims = (X, E, F), "num_experts, hidden_size, moe_intermediate_size"
        if data.shape != expected:
            raise ConversionError(f"{self.dir_model}: tensor {name!r} has shape {list(data.shape)}, expected "
                                  f"{list(expected)} ({dims})")
        if proj == "down_proj":
            return [(f"blk.{bid}.ffn_down_exps.weight", data)]
        half = (X, F, E)
        gate = data.map(lambda a: np.ascontiguousarray(a[:, :F, :]), shape=half)
        up = data.map(lambda a: np.ascontiguousarray(a[:, F:, :]), shape=half)
        return [(f"blk.{bid}.ffn_gate_exps.weight", gate), (f"blk.{bid}.ffn_up_exps.weight", up)]


def _stacked(parts: list[LazyTensor]) -> LazyTensor:
    """The experts' 2-D tensors stacked into one [n_expert, rows, cols] tensor, read when written."""
    dtypes = {p.dtype for p in parts}
    if len(dtypes) != 1:
        raise ConversionError(f"experts of mixed dtypes {sorted(str(d) for d in dtypes)}: {parts[0]!r} ...")
    return LazyTensor((len(parts), *parts[0].shape), parts[0].dtype, lambda: np.stack([p.numpy() for p in parts]),
                      what=f"{parts[0]!r} ... stacked", source_dtype=parts[0].source_dtype)
