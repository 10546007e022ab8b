"""HF DFlash draft (`DFlashDraftModel`, z-lab layout) → GGUF arch `dflash` (llama.cpp `DFlashModel`,
`conversion/qwen.py`; contract in gguf-formats.md §4).

The draft is a stack of Qwen3 decoder layers plus `fc` (fuses the target's extracted hidden states)
and `hidden_norm`; it borrows the target's token embedding and LM head. z-lab checkpoints store
`layers.*`, `fc.weight`, `hidden_norm.weight`, `norm.weight` without the `model.` prefix (either
form is accepted). The tokenizer keys are the target's, written by the target's own converter from
`--target-model-dir` (mandatory, as in llama.cpp).

Keys beyond the generic decoder keys (HF `dflash_config.<name>` is read before top-level `<name>`):
`dflash.block_size` (default 16), `dflash.target_layers` = HF `target_layer_ids` + 1 (llama.cpp
records layer inputs, HF ids name layer outputs), `tokenizer.ggml.mask_token_id`,
`dflash.attention.causal` (only when the config states `is_causal` / `dflash_config.causal`),
`dflash.rope.dimension_sections = [head_dim/2, 0, 0, 0]` when the target uses M-RoPE (its config
has `mrope_section`, as Qwen3.5 checkpoints do), and the optional scales / sliding-window keys.

PyPI gguf 0.19.0 has no DFLASH arch, so every DFlash-specific key is written with the generic
`add_uint32 / add_float32 / add_bool / add_array` from the table below.

DFlash2 drafts (`DFlash2DraftModel`) are DFlash plus, per layer, a grouped dynamic causal conv around the
attention and around the MLP (`attention_conv` / `mlp_conv`: `base_kernel` [2, K, H] and `kernel_projection`
[2*K*groups, H]) and a candidate selector (`candidate_selector`: `predecessor_codebook` / `successor_codebook`
[V, rank], `hidden_projection` [rank, H]); they convert as llama.cpp's converter writes them, with
`dflash.conv_kernel_size`, `dflash.conv_group_size`, `dflash.selector_rank`, `dflash.selector_top_k`
(csrc/models/dflash2.h runs them). DSpark drafts are recognised and rejected.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Iterable

import gguf
import numpy as np

from pydflash.errors import ConversionError

from .base import LazyTensor, ModelConverter, converter_class, hf_architecture, load_hparams, register
from .qwen_names import QWEN3_LAYER, gguf_name, weights

logger = logging.getLogger("pydflash.convert")

# llama.cpp `gguf-py/gguf/constants.py` (Keys.LLM / Keys.Attention / Keys.Rope / Keys.Tokenizer)
KEY_TARGET_LAYERS = "{arch}.target_layers"
KEY_BLOCK_SIZE = "{arch}.block_size"
KEY_CAUSAL = "{arch}.attention.causal"
KEY_VALUE_SCALE = "{arch}.attention.value_scale"
KEY_LOGIT_SCALE = "{arch}.logit_scale"
KEY_FINAL_LOGIT_SOFTCAPPING = "{arch}.final_logit_softcapping"
KEY_EMBEDDING_SCALE = "{arch}.embedding_scale"
KEY_SLIDING_WINDOW = "{arch}.attention.sliding_window"
KEY_SLIDING_WINDOW_PATTERN = "{arch}.attention.sliding_window_pattern"
KEY_ROPE_DIMENSION_COUNT = "{arch}.rope.dimension_count"
KEY_ROPE_DIMENSION_SECTIONS = "{arch}.rope.dimension_sections"
KEY_MASK_TOKEN_ID = "tokenizer.ggml.mask_token_id"

DEFAULT_BLOCK_SIZE = 16

# `Qwen3Config` defaults (transformers 5): llama.cpp reads the draft config (model_type "qwen3")
# through AutoConfig(...).to_dict(), which fills these in when config.json omits them.
QWEN3_CONFIG_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}
DRAFT_LAYER_TYPES = ("full_attention", "sliding_attention")

# HF name after "layers.N." → GGUF name after "blk.N."
_LAYER_TENSORS = weights(QWEN3_LAYER)
_GLOBAL_TENSORS = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "embed_tokens.weight": "token_embd.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
# interleaved-RoPE checkpoints (rope_is_neox_style = false) are permuted to the NEOX layout
_ROPE_PERMUTE = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight")

# what marks the variants (llama.cpp `tensor_mapping.py` DFLASH_* / DSPARK_*); DFlash2's config keys are written as
# dflash.<key>
_DFLASH2_CONFIG = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# DFlash2's tensors (llama.cpp `constants.py` DFLASH_ATTN_CONV_BASE ... DFLASH_SELECTOR_HIDDEN); the base kernels
# keep no ".weight" suffix, and the codebooks, stored without one, get it
_DFLASH2_LAYER_TENSORS = {
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}
_DFLASH2_GLOBAL_TENSORS = {
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.predecessor_codebook.weight": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.successor_codebook.weight": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
}
_DFLASH2_PARTS = ("candidate_selector", "attention_conv", "mlp_conv", "selector_hidden", "selector_predecessor",
                  "selector_successor")
_DSPARK_PARTS = ("markov_head", "markov_w1", "markov_w2", "confidence_head", "conf_proj", "d2t", "t2d")


def draft_variant(name: str) -> str | None:
    """"DFlash2" / "DSpark" when a checkpoint tensor name belongs to one of those variants."""
    parts = name.split(".")
    if any(p in _DFLASH2_PARTS for p in parts):
        return "DFlash2"
    if any(p in _DSPARK_PARTS for p in parts):
        return "DSpark"
    return None


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's `build_target_layer_ids`: for n > 1, n ids spread uniformly over layers 1..T−3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = (num_target_layers - 3) - 1
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@register("DFlashDraftModel")
class DFlashConverter(ModelConverter):
    gguf_arch = "dflash"
    hparam_defaults = QWEN3_CONFIG_DEFAULTS
    dflash2 = False  # DFlash2Converter: the conv and selector tensors and keys belong here
    head_tensor = None  # the draft borrows its target's LM head

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        cfg = self.dir_model / "config.json"
        hp = self.hparams
        dc = hp.get("dflash_config") or {}
        if not isinstance(dc, dict):
            raise ConversionError(f"{cfg}: dflash_config must be an object, got {type(dc).__name__}")
        self.dflash_config: dict[str, Any] = dc
        variant = [k for k in _DFLASH2_CONFIG if k in dc or k in hp]
        if variant and not self.dflash2:
            raise ConversionError(f"{cfg}: this is a DFlash2 draft ({', '.join(variant)} in its config) but its "
                                  "architectures name DFlashDraftModel; DFlash2 checkpoints are DFlash2DraftModel")
        self.dflash2_config = self._dflash2_config() if self.dflash2 else {}
        if self.target_model_dir is None:
            raise ConversionError(f"{self.dir_model}: a DFlash draft borrows the target's tokenizer, embedding and "
                                  "LM head; pass the target model folder with --target-model-dir "
                                  "(target_model_dir=... in Python)")
        if (self.dir_model / "mask_embedding.pt").is_file():
            raise ConversionError(f"{self.dir_model / 'mask_embedding.pt'}: drafts that patch the target embedding "
                                  "(mask_embedding.pt) are not supported")

        # Qwen3Config.__post_init__
        if hp.get("num_key_value_heads") is None:
            hp["num_key_value_heads"] = hp.get("num_attention_heads", 32)
        if not hp.get("use_sliding_window"):
            hp["sliding_window"] = None
        if hp.get("layer_types") is None:
            swa = hp["sliding_window"] is not None
            hp["layer_types"] = ["sliding_attention" if swa and i >= hp["max_window_layers"] else "full_attention"
                                 for i in range(self.block_count)]
        types = hp["layer_types"]
        if not isinstance(types, list) or len(types) != self.block_count:
            raise ConversionError(f"{cfg}: layer_types must list num_hidden_layers ({self.block_count}) entries")
        if unknown := sorted({str(t) for t in types if t not in DRAFT_LAYER_TYPES}):
            raise ConversionError(f"{cfg}: unknown layer type(s) {unknown} in layer_types; DFlash draft layers are "
                                  f"{' or '.join(DRAFT_LAYER_TYPES)}")

        self.target_hparams = self._load_target()
        self.target_layers = self._target_layers()
        self.mask_token_id = self._mask_token_id()

    def _dflash2_config(self) -> dict[str, int]:
        """DFlash2's four sizes (dflash_config first, as z-lab reads them), each a positive integer, with the hidden
        size a multiple of the conv group size."""
        cfg, out = self.dir_model / "config.json", {}
        for k in _DFLASH2_CONFIG:
            v = self.dflash_config.get(k, self.hparams.get(k))
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConversionError(f"{cfg}: dflash_config.{k} = {v!r}; a DFlash2 draft needs a positive integer")
            out[k] = v
        if int(self.hparams["hidden_size"]) % out["conv_group_size"] != 0:
            raise ConversionError(f"{cfg}: hidden_size {self.hparams['hidden_size']} is not a multiple of "
                                  f"conv_group_size {out['conv_group_size']}")
        return out

    # -- the target ---------------------------------------------------------------------------------

    def _load_target(self) -> dict[str, Any]:
        assert self.target_model_dir is not None
        raw = load_hparams(self.target_model_dir)
        self.target_arch = hf_architecture(raw, self.target_model_dir / "config.json")
        self.target_cls = converter_class(self.target_arch)
        if issubclass(self.target_cls, DFlashConverter):
            raise ConversionError(f"{self.target_model_dir}: --target-model-dir points at another DFlash draft; "
                                  "give the target model")
        text = {**self.target_cls.hparam_defaults, **raw, **(raw.get("text_config") or {})}
        t_embd, d_embd = text.get("hidden_size"), self.hparams.get("hidden_size")
        if t_embd != d_embd:
            raise ConversionError(
                f"{self.dir_model / 'config.json'}: draft hidden_size {d_embd} != target hidden_size {t_embd} "
                f"({self.target_model_dir / 'config.json'}); a DFlash draft must match its target's hidden size")
        d_vocab = self.raw_hparams.get("vocab_size")
        if d_vocab is not None and d_vocab != text.get("vocab_size"):
            raise ConversionError(
                f"{self.dir_model / 'config.json'}: draft vocab_size {d_vocab} != target vocab_size "
                f"{text.get('vocab_size')} ({self.target_model_dir / 'config.json'}); the draft uses the target's "
                "vocabulary")
        return text

    def _target_layers(self) -> list[int]:
        cfg = self.dir_model / "config.json"
        ids = self.dflash_config.get("target_layer_ids", self.hparams.get("target_layer_ids"))
        n_target = int(self.target_hparams["num_hidden_layers"])
        if not ids:
            ids = default_target_layer_ids(int(self.hparams.get("num_target_layers") or n_target), self.block_count)
            logger.warning("%s: no target_layer_ids; using the reference default %s (build_target_layer_ids)", cfg, ids)
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ConversionError(f"{cfg}: target_layer_ids must be a list of integers, got {ids!r}")
        bad = [i for i in ids if not 0 <= i <= n_target - 2]
        if bad:
            raise ConversionError(
                f"{cfg}: target_layer_ids {bad} out of range for a {n_target}-layer target: an id l names the output "
                f"of target layer l, read as the input of layer l+1, so 0 <= l <= {n_target - 2}")
        return [i + 1 for i in ids]

    def _mask_token_id(self) -> int:
        cfg = self.dir_model / "config.json"
        mid = self.dflash_config.get("mask_token_id", self.hparams.get("mask_token_id"))
        if mid is None:
            raise ConversionError(f"{cfg}: no dflash_config.mask_token_id (the MASK token the draft fills its block "
                                  "with)")
        n_vocab = int(self.target_hparams.get("vocab_size") or 0)
        if not isinstance(mid, int) or isinstance(mid, bool) or not 0 <= mid < n_vocab:
            raise ConversionError(f"{cfg}: mask_token_id {mid!r} is not a token of the target vocabulary "
                                  f"(vocab_size {n_vocab})")
        return mid

    def target_uses_mrope(self) -> bool:
        """llama.cpp `_target_uses_mrope`: the target's raw config has rope `mrope_section`."""
        assert self.target_model_dir is not None
        raw = json.loads((self.target_model_dir / "config.json").read_text(encoding="utf-8"))
        raw = raw.get("text_config", raw)
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        return "mrope_section" in rope

    # -- keys ---------------------------------------------------------------------------------------

    def set_gguf_parameters(self) -> None:
        super().set_gguf_parameters()
        w, arch, hp, dc = self.writer, self.gguf_arch, self.hparams, self.dflash_config

        def key(k: str) -> str:
            return k.format(arch=arch)

        def pick(name: str) -> Any:
            return dc.get(name, hp.get(name))

        head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
        if (prf := self.rope_parameters().get("partial_rotary_factor")) is not None:
            w.add_uint32(key(KEY_ROPE_DIMENSION_COUNT), int(head_dim * prf))
        if (value_scale := dc.get("attention_value_scale")) is not None:
            w.add_float32(key(KEY_VALUE_SCALE), float(value_scale))
        w.add_uint32(key(KEY_BLOCK_SIZE), int(dc.get("block_size", hp.get("block_size", DEFAULT_BLOCK_SIZE))))
        for k, v in self.dflash2_config.items():  # (DFlash2: right after the block size, as llama.cpp writes them)
            w.add_uint32(f"{arch}.{k}", v)
        if (v := pick("output_multiplier")) is not None:
            w.add_float32(key(KEY_LOGIT_SCALE), float(v))
        if (v := pick("final_logit_softcapping")) is not None and float(v) > 0:
            w.add_float32(key(KEY_FINAL_LOGIT_SOFTCAPPING), float(v))
        if (v := pick("input_embedding_scale")) is not None:
            w.add_float32(key(KEY_EMBEDDING_SCALE), float(v))
        w.add_array(key(KEY_TARGET_LAYERS), self.target_layers)

        use_swa = hp.get("use_sliding_window", False) or dc.get("use_swa", False)
        window = dc.get("swa_window_size") or hp.get("sliding_window")
        if use_swa and window:
            is_swa = ([True] * self.block_count if dc.get("use_swa", False)
                      else [t == "sliding_attention" for t in hp.get("layer_types") or []])
            w.add_uint32(key(KEY_SLIDING_WINDOW), int(window))
            w.add_array(key(KEY_SLIDING_WINDOW_PATTERN), is_swa)

        causal = hp.get("is_causal")
        if causal is None:
            causal = dc.get("causal")
        if causal is not None and not (causal is False and key(KEY_CAUSAL) in w.kv_data[0]):
            w.add_bool(key(KEY_CAUSAL), bool(causal))  # (is_causal = false is already written by the base)

        if self.target_uses_mrope():
            # the draft ropes on the temporal section only: degenerate M-RoPE sections
            w.add_array(key(KEY_ROPE_DIMENSION_SECTIONS), [head_dim // 2, 0, 0, 0])

    def adjust_metadata(self, md: gguf.Metadata) -> None:
        """general.base_model.0.name: the target the drafter is for, as the target's own conversion names it
        (general.name), unless the drafter's model card names its base models already. Loading the drafter onto
        another target then warns (pydflash/drafter_target.py); llama.cpp's converter writes these keys from the
        model card only."""
        if md.base_models:
            return
        assert self.target_model_dir is not None
        target = gguf.Metadata.load(None, self.target_model_dir, None, 0)
        md.base_models = [{"name": target.name or self.target_model_dir.name}]

    def set_vocab(self) -> None:
        """The target's tokenizer, written by the target's converter (llama.cpp calls the target
        class's set_vocab on the draft, so the draft's vocab_size sizes the token list)."""
        assert self.target_model_dir is not None
        logger.info("DFlash: tokenizer from the target model %s (%s)", self.target_model_dir, self.target_arch)
        if "vocab_size" not in self.raw_hparams:
            self.hparams["vocab_size"] = self.target_hparams["vocab_size"]
        own_dir = self.dir_model
        self.dir_model = self.target_model_dir
        try:
            self.target_cls.set_vocab(self)  # type: ignore[arg-type]
        finally:
            self.dir_model = own_dir
        self.writer.add_uint32(KEY_MASK_TOKEN_ID, self.mask_token_id)

    # -- tensors ------------------------------------------------------------------------------------

    def prepare_tensors(self) -> None:
        for name in self.model_tensors:
            variant = draft_variant(name)
            if variant is not None and not (variant == "DFlash2" and self.dflash2):
                raise ConversionError(f"{self.dir_model}: tensor {name!r} belongs to a {variant} draft; its "
                                      f"architectures name {'DFlash2DraftModel' if self.dflash2 else 'DFlashDraftModel'}")
        names = {_strip(n) for n in self.model_tensors}
        if "fc.weight" not in names:
            raise ConversionError(f"{self.dir_model}: no fc.weight; not a DFlash draft checkpoint")
        if self.dflash2:
            self._check_dflash2_tensors(names)
        self._check_layer_shapes(names)
        super().prepare_tensors()

    def _check_layer_shapes(self, names: set[str]) -> None:
        """Every draft layer's Qwen3 tensors, in the shapes config.json gives. A draft GGUF cannot be test-loaded
        alone (see validate_gguf), so what the load would refuse is checked here instead."""
        hp, cfg = self.hparams, self.dir_model / "config.json"
        n_embd, n_ff = int(hp["hidden_size"]), int(hp["intermediate_size"])
        head_dim = int(hp.get("head_dim") or n_embd // int(hp["num_attention_heads"]))
        n_q, n_kv = int(hp["num_attention_heads"]) * head_dim, int(hp["num_key_value_heads"]) * head_dim
        expected = {"self_attn.q_proj": (n_q, n_embd), "self_attn.k_proj": (n_kv, n_embd),
                    "self_attn.v_proj": (n_kv, n_embd), "self_attn.o_proj": (n_embd, n_q),
                    "mlp.gate_proj": (n_ff, n_embd), "mlp.up_proj": (n_ff, n_embd), "mlp.down_proj": (n_embd, n_ff),
                    "input_layernorm": (n_embd,), "post_attention_layernorm": (n_embd,)}
        shapes = {_strip(n): t.shape for n, t in self.model_tensors.items()}
        for bid in range(self.block_count):
            for sub, shape in expected.items():
                name = f"layers.{bid}.{sub}.weight"
                if name not in names:
                    raise ConversionError(f"{self.dir_model}: missing tensor {name!r} (config.json: "
                                          f"num_hidden_layers = {self.block_count})")
                if tuple(shapes[name]) != shape:
                    raise ConversionError(f"{self.dir_model}: tensor {name!r} has shape {list(shapes[name])}, "
                                          f"expected {list(shape)} from config.json (hidden_size {n_embd}, "
                                          f"intermediate_size {n_ff}, heads x head_dim {n_q}, kv {n_kv})")

    def validate_gguf(self, path: Path) -> None:
        """Not test-loaded: a draft loads only onto its target's GGUF (`_core.DraftModel(target, path)`), and the
        conversion has the target's HF folder, not a GGUF of it; _check_layer_shapes checked what it can."""

    def _check_dflash2_tensors(self, names: set[str]) -> None:
        """Every layer's two convs and the selector, in the shapes the config's sizes give."""
        H, V = int(self.hparams["hidden_size"]), int(self.target_hparams["vocab_size"])
        c = self.dflash2_config
        K, groups, rank = c["conv_kernel_size"], H // c["conv_group_size"], c["selector_rank"]
        want = {"candidate_selector.hidden_projection.weight": (rank, H)}
        for book in ("predecessor_codebook", "successor_codebook"):
            name = f"candidate_selector.{book}"
            want[name + ".weight" if name + ".weight" in names else name] = (V, rank)
        for il in range(self.block_count):
            for conv in ("attention_conv", "mlp_conv"):
                want[f"layers.{il}.{conv}.base_kernel"] = (2, K, H)
                want[f"layers.{il}.{conv}.kernel_projection.weight"] = (2 * K * groups, H)
        shapes = {_strip(n): tuple(t.shape) for n, t in self.model_tensors.items()}
        for name, shape in want.items():
            if name not in shapes:
                raise ConversionError(f"{self.dir_model}: a DFlash2 draft needs tensor {name!r}, which is missing")
            if shapes[name] != shape:
                raise ConversionError(f"{self.dir_model}: tensor {name!r} is {list(shapes[name])}, expected "
                                      f"{list(shape)}")

    def map_tensor_name(self, name: str) -> str:
        try:
            return gguf_tensor_name(name, self.block_count, self.dflash2)
        except ConversionError as e:
            raise ConversionError(f"{self.dir_model}: {e}") from None

    def modify_tensors(self, data: LazyTensor, name: str, bid: int | None) -> Iterable[tuple[str, LazyTensor]]:
        name = _strip(name)
        if name == "embed_tokens.weight" and not self.hparams.get("has_embed_tokens", True):
            return []
        if name == "fc.weight":
            n_embd, n_ext = int(self.hparams["hidden_size"]), len(self.target_layers)
            if data.shape != (n_embd, n_ext * n_embd):
                raise ConversionError(f"{self.dir_model}: fc.weight is {list(data.shape)}, expected "
                                      f"[{n_embd}, {n_ext * n_embd}] (hidden_size x {n_ext} target layers)")
        if not self.hparams.get("rope_is_neox_style", True) and name.endswith(_ROPE_PERMUTE):
            head_dim = int(self.hparams["head_dim"])
            data = data.map(lambda a: _interleaved_to_neox(a, head_dim))
        return [(self.map_tensor_name(name), data)]


@register("DFlash2DraftModel")
class DFlash2Converter(DFlashConverter):
    dflash2 = True


@register("Qwen3DSparkModel", "DSparkDraftModel", "DSparkSpeculator", "Lfm2DSparkDraftModel", "LingDSparkModel")
class DSparkConverter(ModelConverter):
    gguf_arch = "dflash"
    unsupported = ("a DSpark draft (DFlash + Markov head); pydflash converts DFlash (v1) drafts (DFlashDraftModel) "
                   "only")


def gguf_tensor_name(name: str, block_count: int, dflash2: bool = False) -> str:
    """The GGUF name llama.cpp's converter gives a drafter checkpoint tensor `name` (z-lab's names, with or without
    the `model.` prefix); ConversionError for one it has none for."""
    name = _strip(name)
    if dflash2:
        if name in _DFLASH2_GLOBAL_TENSORS:
            return _DFLASH2_GLOBAL_TENSORS[name]
        m = _LAYER_RE.match(name)
        if m and m[2] in _DFLASH2_LAYER_TENSORS and int(m[1]) < block_count:
            return f"blk.{m[1]}.{_DFLASH2_LAYER_TENSORS[m[2]]}"
    if (mapped := gguf_name(name, _GLOBAL_TENSORS, _LAYER_RE, _LAYER_TENSORS, block_count)):
        return mapped
    raise ConversionError(f"cannot map tensor {name!r} of a DFlash drafter (block_count {block_count})")


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _interleaved_to_neox(a: np.ndarray, head_dim: int) -> np.ndarray:
    """Per head: interleaved pairs (x0, x1), (x2, x3), … → NEOX halves (x0, x2, …, x1, x3, …)."""
    shape = a.shape
    return np.ascontiguousarray(a.reshape(-1, head_dim // 2, 2, *shape[1:]).swapaxes(1, 2)).reshape(shape)
