"""HF Qwen3.5 (dense) → GGUF arch `qwen35` (llama.cpp `Qwen3_5TextModel`, `conversion/qwen.py`;
contract in gguf-formats.md §3).

Accepted checkpoints: `Qwen3_5ForCausalLM` (tensors `model.layers.*`) and the text part of
`Qwen3_5ForConditionalGeneration` (`model.language_model.*`; the vision tower `model.visual.*` is
skipped). Multi-token-prediction weights (`mtp.*`, shipped by the Qwen releases, dropped by
transformers' `save_pretrained`) are appended as extra blocks exactly as llama.cpp does.

Keys: the generic decoder keys, then `nextn_predict_layers` (MTP only), the five `ssm.*` keys,
`attention.recurrent_layers`, `full_attention_interval`, `rope.dimension_count`
(`head_dim × partial_rotary_factor`) and `rope.dimension_sections` (default `[11, 11, 10, 0]`).

Tensor transforms, in llama.cpp's order (§3.3): V-head reorder grouped → tiled when the numbers of
K and V heads differ; `A_log` → `ssm_a = −exp(A_log)`; `dt_bias` → `ssm_dt.bias`; conv1d squeezed
to 2-D; `+1` on every zero-centred RMSNorm weight (all `*norm.weight` except `linear_attn.norm`).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Iterable

import numpy as np

from pydflash.errors import ConversionError

from .base import LazyTensor, ModelConverter, index_safetensors, register
from .qwen_names import ATTENTION, FFN, weights
from .vocab import set_vocab_gpt2

logger = logging.getLogger("pydflash.convert")

# `Qwen3_5TextConfig` defaults (transformers 5): llama.cpp reads the config through
# `AutoConfig(...).to_dict()`, which fills these in when config.json omits them.
QWEN35_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
}
DEFAULT_MROPE_SECTION = [11, 11, 10, 0]
DEFAULT_FULL_ATTENTION_INTERVAL = 4
LAYER_TYPES = ("linear_attention", "full_attention")

# keys PyPI gguf 0.19.0 has no writer method for (written with add_uint32 / add_array)
KEY_NEXTN_PREDICT_LAYERS = "{arch}.nextn_predict_layers"
KEY_RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"
KEY_FULL_ATTENTION_INTERVAL = "{arch}.full_attention_interval"
KEY_SSM_CONV_KERNEL = "{arch}.ssm.conv_kernel"
KEY_SSM_STATE_SIZE = "{arch}.ssm.state_size"
KEY_SSM_GROUP_COUNT = "{arch}.ssm.group_count"
KEY_SSM_TIME_STEP_RANK = "{arch}.ssm.time_step_rank"
KEY_SSM_INNER_SIZE = "{arch}.ssm.inner_size"

# HF name after "model.layers.N." → GGUF name after "blk.N.", by block kind
_COMMON = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
}
_ATTENTION = weights(ATTENTION)
_LINEAR = {
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}
_NEXTN = {
    "eh_proj.weight": "nextn.eh_proj.weight",
    "enorm.weight": "nextn.enorm.weight",
    "hnorm.weight": "nextn.hnorm.weight",
    "embed_tokens.weight": "nextn.embed_tokens.weight",
    "shared_head.head.weight": "nextn.shared_head_head.weight",
    "shared_head.norm.weight": "nextn.shared_head_norm.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# `mtp.<name>.weight` (block-level MTP tensors) → the nextn name they take in the first MTP block
_MTP_GLOBAL = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
               "norm": "shared_head.norm"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MTP_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
# the vision / audio towers of the multimodal checkpoints (llama.cpp `TextModel.filter_tensors`)
_MULTIMODAL_MARKERS = ("visual.", "vision.", "vision_", "audio.", "audio_", "merger.", "patch_embed")


def reorder_v_heads(a: np.ndarray, axis: int, n_k_heads: int, n_v_per_k: int, head_dim: int) -> np.ndarray:
    """V heads grouped by K head (`[G0_v0..v(r−1), G1_v0..]`, HF) → tiled (`[K0, K1, .., K0, K1, ..]`,
    what ggml's broadcast in `ggml_gated_delta_net` expects) along `axis`."""
    axis %= a.ndim
    shape = a.shape
    b = a.reshape(*shape[:axis], n_k_heads, n_v_per_k, head_dim, *shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(b, axis, axis + 1)).reshape(shape)


def neg_exp(a: np.ndarray) -> np.ndarray:
    """`−exp(a)` rounded once from float64 (llama.cpp computes it with torch in the tensor's dtype;
    the two can differ in the last bit, see tests/test_convert_qwen35.py)."""
    return (-np.exp(a.astype(np.float64))).astype(a.dtype)


@register("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
class Qwen35Converter(ModelConverter):
    gguf_arch = "qwen35"
    hparam_defaults = QWEN35_TEXT_DEFAULTS
    # the FFN's tensors (after "model.layers.N.", GGUF name after "blk.N."), in every block, MTP ones included
    ffn_tensors = weights(FFN)
    supports_no_mtp = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        hp, cfg = self.hparams, self.dir_model / "config.json"
        self._read_ffn_config()
        self.n_layer = int(hp["num_hidden_layers"])
        self.n_k_heads = int(hp["linear_num_key_heads"])
        self.n_v_heads = int(hp["linear_num_value_heads"])
        self.head_k_dim = int(hp["linear_key_head_dim"])
        self.head_v_dim = int(hp["linear_value_head_dim"])
        if self.head_k_dim != self.head_v_dim:
            raise ConversionError(
                f"{cfg}: linear_key_head_dim ({self.head_k_dim}) != linear_value_head_dim ({self.head_v_dim}); "
                "the qwen35 GGUF format has one state size for both (ssm.state_size)")
        if self.n_k_heads <= 0 or self.n_v_heads % self.n_k_heads != 0:
            raise ConversionError(f"{cfg}: linear_num_value_heads ({self.n_v_heads}) must be a multiple of "
                                  f"linear_num_key_heads ({self.n_k_heads})")
        self.layer_types = self._layer_types()
        self.n_mtp: int | None = None  # known once the tensors are indexed

    # -- hparams ------------------------------------------------------------------------------------

    def _read_ffn_config(self) -> None:
        """Check (and keep what the tensors need of) the FFN's config fields; a dense FFN has none of its own."""
        if any(k in self.hparams for k in ("num_experts", "num_local_experts", "moe_intermediate_size")):
            raise ConversionError(f"{self.dir_model / 'config.json'}: MoE fields (num_experts, moe_intermediate_size) "
                                  f"in a dense {', '.join(self.hf_architectures)} config; a Qwen3.5 MoE checkpoint "
                                  "names Qwen3_5MoeForCausalLM (arch qwen35moe)")

    def _add_ffn_parameters(self) -> None:
        """Keys of the FFN beyond the generic decoder ones, written right after them (none for the dense FFN)."""

    def _layer_types(self) -> list[str]:
        cfg = self.dir_model / "config.json"
        types = self.hparams.get("layer_types")
        if types is None:  # Qwen3_5TextConfig.__post_init__
            interval = self.hparams.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
            if not isinstance(interval, int) or interval < 1:
                raise ConversionError(f"{cfg}: full_attention_interval must be a positive integer, got {interval!r}")
            return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(self.n_layer)]
        if not isinstance(types, list) or len(types) != self.n_layer:
            n = len(types) if isinstance(types, list) else type(types).__name__
            raise ConversionError(f"{cfg}: layer_types has {n} entries, expected num_hidden_layers ({self.n_layer})")
        unknown = sorted({str(t) for t in types if t not in LAYER_TYPES})
        if unknown:
            raise ConversionError(f"{cfg}: unknown layer type(s) {unknown} in layer_types; Qwen3.5 layers are "
                                  f"{' or '.join(LAYER_TYPES)}")
        return list(types)

    def rope_parameters(self) -> dict[str, Any]:
        # the config class always supplies rope_theta and partial_rotary_factor (defaults above)
        rope = super().rope_parameters()
        rope.setdefault("rope_theta", QWEN35_TEXT_DEFAULTS["rope_theta"])
        rope.setdefault("partial_rotary_factor", QWEN35_TEXT_DEFAULTS["partial_rotary_factor"])
        return rope

    def _count_mtp(self) -> int:
        """MTP blocks present in the checkpoint (`mtp.layers.K.*`). The block count follows the weights;
        a config that says otherwise is reported (transformers' save_pretrained drops `mtp.*` but keeps
        `mtp_num_hidden_layers`)."""
        if self.n_mtp is not None:
            return self.n_mtp
        if self.no_mtp:  # --no-nextn: the trunk alone, as if the checkpoint had no mtp.* tensors
            self.n_mtp = 0
            return 0
        names = self.model_tensors
        if not names:
            try:
                names = index_safetensors(self.dir_model)
            except ConversionError:
                names = {}
        found = {int(m[1]) for n in names if (m := _MTP_LAYER_RE.match(_canonical(n))) is not None}
        n_mtp = max(found) + 1 if found else 0
        if found and found != set(range(n_mtp)):
            raise ConversionError(f"{self.dir_model}: MTP layers {sorted(found)} are not numbered 0..{n_mtp - 1}")
        stated = int(self.hparams.get("mtp_num_hidden_layers") or 0)
        if names and stated != n_mtp and "mtp_num_hidden_layers" in self.hparams:
            logger.warning("%s: config.json says mtp_num_hidden_layers = %d but the checkpoint holds %d MTP layer(s); "
                           "writing %d", self.dir_model, stated, n_mtp, n_mtp)
        elif not names:
            n_mtp = stated
        if n_mtp:
            logger.info("MTP: appending %d multi-token-prediction block(s) as blk.%d..blk.%d "
                        "(nextn_predict_layers = %d; not run by the main graph)",
                        n_mtp, self.n_layer, self.n_layer + n_mtp - 1, n_mtp)
        self.n_mtp = n_mtp
        self.block_count = self.n_layer + n_mtp
        return n_mtp

    def set_gguf_parameters(self) -> None:
        n_mtp = self._count_mtp()
        super().set_gguf_parameters()
        self._add_ffn_parameters()
        w, arch, hp = self.writer, self.gguf_arch, self.hparams
        if n_mtp:
            w.add_uint32(KEY_NEXTN_PREDICT_LAYERS.format(arch=arch), n_mtp)
        w.add_uint32(KEY_SSM_CONV_KERNEL.format(arch=arch), int(hp["linear_conv_kernel_dim"]))
        w.add_uint32(KEY_SSM_STATE_SIZE.format(arch=arch), self.head_k_dim)
        w.add_uint32(KEY_SSM_GROUP_COUNT.format(arch=arch), self.n_k_heads)
        w.add_uint32(KEY_SSM_TIME_STEP_RANK.format(arch=arch), self.n_v_heads)
        w.add_uint32(KEY_SSM_INNER_SIZE.format(arch=arch), self.head_v_dim * self.n_v_heads)
        recurrent = [t == "linear_attention" for t in self.layer_types] + [False] * n_mtp
        w.add_array(KEY_RECURRENT_LAYERS.format(arch=arch), recurrent)
        w.add_uint32(KEY_FULL_ATTENTION_INTERVAL.format(arch=arch),
                     int(hp.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)))
        head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
        rope = self.rope_parameters()
        w.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        if "mrope_section" not in rope:
            w.add_rope_dimension_sections(list(DEFAULT_MROPE_SECTION))

    def set_vocab(self) -> None:
        set_vocab_gpt2(self.writer, self.dir_model, int(self.hparams["vocab_size"]))

    # -- tensors ------------------------------------------------------------------------------------

    def skip_tensor(self, name: str) -> bool:
        if self.no_mtp and _canonical(name).startswith("mtp."):
            return True
        return super().skip_tensor(name) or any(m in name for m in _MULTIMODAL_MARKERS)

    def prepare_tensors(self) -> None:
        self._check_mtp_head(self._count_mtp())
        super().prepare_tensors()

    def _check_mtp_head(self, n_mtp: int) -> None:
        """An MTP head the checkpoint holds only in part would convert and then not load: refuse it by the first
        missing tensor (its projections, norms and each block's attention)."""
        if not n_mtp:
            return
        names = {_canonical(n) for n in self.model_tensors}
        needed = [f"mtp.{stem}.weight" for stem in _MTP_GLOBAL]
        for k in range(n_mtp):
            needed += [f"mtp.layers.{k}.{sub}" for sub in (*_COMMON, *_ATTENTION)]
        missing = [n for n in needed if n not in names]
        if missing:
            raise ConversionError(f"{self.dir_model}: the multi-token-prediction head is incomplete: missing tensor "
                                  f"{missing[0]!r}{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; "
                                  "convert with --no-nextn to leave the MTP head out")

    def _hf_name(self, name: str) -> str:
        """Checkpoint name → llama.cpp's internal HF-style name (`model.layers.N.…`, MTP blocks
        appended after the trunk)."""
        name = _canonical(name)
        if (m := _MTP_LAYER_RE.match(name)) is not None:
            name = f"model.layers.{self.n_layer + int(m[1])}.{m[2]}"
        elif name.startswith("mtp."):
            stem, _, suffix = name[4:].rpartition(".")
            if stem not in _MTP_GLOBAL or suffix != "weight":
                raise ConversionError(f"{self.dir_model}: cannot map MTP tensor {name!r}")
            name = f"model.layers.{self.n_layer}.{_MTP_GLOBAL[stem]}.weight"
        return name

    def map_tensor_name(self, name: str) -> str:
        if name in _GLOBAL:
            return _GLOBAL[name]
        m = _LAYER_RE.match(name)
        if m is not None:
            bid, sub = int(m[1]), m[2]
            if bid < self.n_layer:
                kind = self.layer_types[bid]
                table = {**_COMMON, **self.ffn_tensors, **(_LINEAR if kind == "linear_attention" else _ATTENTION)}
                if sub not in table and sub in (_ATTENTION if kind == "linear_attention" else _LINEAR):
                    raise ConversionError(f"{self.dir_model}: tensor {name!r} does not belong in layer {bid}, which "
                                          f"layer_types declares {kind!r}")
            elif bid < self.block_count:
                table = {**_COMMON, **self.ffn_tensors, **_ATTENTION, **_NEXTN}
            else:
                table = {}
            if sub in table:
                return f"blk.{bid}.{table[sub]}"
        raise ConversionError(f"{self.dir_model}: cannot map tensor {name!r} of a Qwen3.5 checkpoint "
                              f"({self.n_layer} layers + {self.n_mtp or 0} MTP)")

    def _linear_attn_shapes(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """The shapes config.json gives each linear-attention tensor (after "linear_attn."), each allowed form."""
        nk, nv, hk, hv = self.n_k_heads, self.n_v_heads, self.head_k_dim, self.head_v_dim
        n_embd, conv = int(self.hparams["hidden_size"]), int(self.hparams["linear_conv_kernel_dim"])
        channels = 2 * hk * nk + hv * nv
        return {"in_proj_qkv.weight": ((channels, n_embd),), "in_proj_z.weight": ((hv * nv, n_embd),),
                "in_proj_a.weight": ((nv, n_embd),), "in_proj_b.weight": ((nv, n_embd),),
                "A_log": ((nv,),), "dt_bias": ((nv,),), "norm.weight": ((hv,),),
                "conv1d.weight": ((channels, 1, conv), (channels, conv)), "out_proj.weight": ((n_embd, hv * nv),)}

    def _check_linear_attn(self, data: LazyTensor, name: str) -> None:
        """The head reorder and the transforms reshape these tensors by the config's head counts: a tensor of
        another shape is refused by name here, not by a numpy error mid-write."""
        sub = name.partition(".linear_attn.")[2]
        allowed = self._linear_attn_shapes().get(sub)
        if allowed is not None and data.shape not in allowed:
            raise ConversionError(
                f"{self.dir_model}: tensor {name!r} has shape {list(data.shape)}, expected "
                f"{' or '.join(str(list(a)) for a in allowed)} from config.json (hidden_size, linear_num_key_heads "
                f"{self.n_k_heads}, linear_num_value_heads {self.n_v_heads}, linear_key/value_head_dim "
                f"{self.head_k_dim}, linear_conv_kernel_dim)")

    def modify_tensors(self, data: LazyTensor, name: str, bid: int | None) -> Iterable[tuple[str, LazyTensor]]:
        name = self._hf_name(name)
        if ".linear_attn." in name:
            self._check_linear_attn(data, name)
        nk, nv, hk, hv = self.n_k_heads, self.n_v_heads, self.head_k_dim, self.head_v_dim
        # 1. V heads grouped → tiled (only the V parts; conv1d is squeezed first)
        if nk != nv and ".linear_attn." in name:
            r = nv // nk
            qk = 2 * hk * nk
            if name.endswith(".in_proj_qkv.weight"):
                data = data.map(lambda a: np.concatenate([a[:qk], reorder_v_heads(a[qk:], 0, nk, r, hv)], axis=0))
            elif name.endswith(".in_proj_z.weight"):
                data = data.map(lambda a: reorder_v_heads(a, 0, nk, r, hv))
            elif name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
                data = data.map(lambda a: reorder_v_heads(a, 0, nk, r, 1))
            elif name.endswith(".conv1d.weight"):
                data = _squeezed(data, name)
                data = data.map(lambda a: np.concatenate([a[:qk], reorder_v_heads(a[qk:], 0, nk, r, hv)], axis=0))
            elif name.endswith(".out_proj.weight"):
                data = data.map(lambda a: reorder_v_heads(a, 1, nk, r, hv))
        # 2. value transforms (Qwen3NextModel.modify_tensors)
        if name.endswith(".A_log"):
            data = data.map(neg_exp)
        elif name.endswith(".conv1d.weight"):
            data = _squeezed(data, name)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            data = data.map(lambda a: a + a.dtype.type(1))
        return [(self.map_tensor_name(name), data)]


def _canonical(name: str) -> str:
    """`model.language_model.X` → `model.X`, `model.mtp.X` → `mtp.X` (llama.cpp's filter_tensors)."""
    if "language_model." in name:
        name = name.replace("language_model.", "")
    if name.startswith("model.mtp."):
        name = name[len("model."):]
    return name


def _squeezed(data: LazyTensor, name: str) -> LazyTensor:
    if data.ndim == 2:
        return data
    if data.ndim != 3 or data.shape[1] != 1:
        raise ConversionError(f"{name}: expected a depthwise conv1d weight [channels, 1, kernel], "
                              f"got {list(data.shape)}")
    shape = (data.shape[0], data.shape[2])
    return data.map(lambda a: a.reshape(shape), shape=shape)
