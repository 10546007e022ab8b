"""Shared machinery of the HF → GGUF converters: the architecture registry, safetensors indexing
(torch-free, bf16 included), lazily evaluated tensors, llama.cpp's dtype rules and the write driver.

One subclass of `ModelConverter` per Hugging Face architecture (`convert/qwen3.py`, later
`qwen35.py`, `dflash.py`), registered with `@register("HFArchName", ...)`. A subclass sets
`gguf_arch` and overrides `set_gguf_parameters`, `set_vocab` and `modify_tensors`, the same hooks
as llama.cpp's `conversion/base.py`, so files come out key-for-key and tensor-for-tensor identical
to `convert_hf_to_gguf.py`'s.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable

import gguf
import numpy as np
import yaml
from gguf.utility import LocalTensor, SafetensorsLocal

from pydflash.errors import ConversionError

from .outfile import checked_target, checkpoint_inputs, output_path

logger = logging.getLogger("pydflash.convert")

GGMLType = gguf.GGMLQuantizationType

# --outtype → general.file_type (llama.cpp `convert_hf_to_gguf.py` ftype_map)
OUTTYPES: dict[str, gguf.LlamaFileType] = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "auto": gguf.LlamaFileType.GUESSED,
}

_FTYPE_TO_TYPE: dict[gguf.LlamaFileType, GGMLType] = {
    gguf.LlamaFileType.ALL_F32: GGMLType.F32,
    gguf.LlamaFileType.MOSTLY_F16: GGMLType.F16,
    gguf.LlamaFileType.MOSTLY_BF16: GGMLType.BF16,
    gguf.LlamaFileType.MOSTLY_Q8_0: GGMLType.Q8_0,
}

# GGUF tensor names (without ".weight") that stay F32 whatever --outtype says
# (llama.cpp `ModelBase.prepare_tensors`: FFN_GATE_INP, POS_EMBD, SSM_CONV1D, ...).
_F32_TENSOR_SUFFIXES = ("ffn_gate_inp", "ffn_gate_inp_shexp", "position_embd", "token_types", "ssm_conv1d")

# HF tensors nobody needs (llama.cpp skips the same suffixes).
_SKIPPED_SUFFIXES = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")


# ---------------------------------------------------------------------------------------------------
# lazy tensors


class LazyTensor:
    """A tensor known by shape and dtype whose data is produced on demand.

    `gguf.GGUFWriter` only needs `shape`, `dtype`, `nbytes` and `tofile`, so a converter can add every
    tensor before any data is read and the writer then loads, converts and writes one tensor at a
    time (memory stays at about one tensor). Shapes are numpy order (ggml order reversed).
    """

    __slots__ = ("shape", "dtype", "source_dtype", "_fn", "_what")

    def __init__(self, shape: tuple[int, ...], dtype: Any, fn: Callable[[], np.ndarray], what: str = "tensor",
                 source_dtype: str = ""):
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.source_dtype = source_dtype  # safetensors dtype string ("BF16", ...) for checkpoint tensors
        self._fn = fn
        self._what = what

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def numpy(self) -> np.ndarray:
        try:
            data = self._fn()
        except (ValueError, IndexError, RuntimeError) as e:
            # a transform (reshape, head reorder) met a tensor of a shape the config does not describe
            raise ConversionError(f"{self._what} {self.dtype}{list(self.shape)}: cannot convert: {e}") from e
        if data.shape != self.shape or data.dtype != self.dtype:
            raise ConversionError(
                f"{self._what}: produced {data.dtype}{list(data.shape)}, expected {self.dtype}{list(self.shape)}")
        return data

    def map(self, fn: Callable[[np.ndarray], np.ndarray], *, shape: tuple[int, ...] | None = None,
            dtype: Any = None) -> LazyTensor:
        """A new lazy tensor `fn(self.numpy())`; give `shape` / `dtype` when `fn` changes them."""
        return LazyTensor(self.shape if shape is None else shape, self.dtype if dtype is None else dtype,
                          lambda: fn(self.numpy()), self._what)

    def tofile(self, fout: Any) -> None:
        np.ascontiguousarray(self.numpy()).tofile(fout)

    def __repr__(self) -> str:
        return f"LazyTensor({self._what}, {self.dtype}, {list(self.shape)})"


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)


# safetensors dtype → (meta dtype, decoder). Like llama.cpp, everything that is not F16/F32 is
# widened to F32 first (BF16 exactly: bf16 is the top half of an f32).
_ST_DECODERS: dict[str, tuple[Any, Callable[[np.ndarray], np.ndarray]]] = {
    "F32": (np.float32, lambda b: b.view("<f4")),
    "F16": (np.float16, lambda b: b.view("<f2")),
    "BF16": (np.float32, _bf16_to_f32),
    "F64": (np.float32, lambda b: b.view("<f8").astype(np.float32)),
    "I64": (np.float32, lambda b: b.view("<i8").astype(np.float32)),
    "I32": (np.float32, lambda b: b.view("<i4").astype(np.float32)),
    "I16": (np.float32, lambda b: b.view("<i2").astype(np.float32)),
    "I8": (np.float32, lambda b: b.view("i1").astype(np.float32)),
    "U8": (np.float32, lambda b: b.astype(np.float32)),
    "BOOL": (np.float32, lambda b: b.astype(np.float32)),
}


# bytes per element of each safetensors dtype
_ST_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _lazy_from_safetensors(name: str, t: LocalTensor, file: Path, file_size: int) -> LazyTensor:
    if t.dtype not in _ST_DECODERS:
        raise ConversionError(
            f"{file}: tensor {name!r} has dtype {t.dtype}, which pydflash cannot convert "
            f"(supported: {', '.join(_ST_DECODERS)}); convert the original bf16/f16 checkpoint instead")
    dtype, decode = _ST_DECODERS[t.dtype]
    shape = t.shape
    if not isinstance(shape, tuple) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                               for n in shape):
        raise ConversionError(f"{file}: tensor {name!r} has shape {shape!r}, expected a list of sizes")
    # the header's data_offsets must cover exactly the tensor's bytes, inside the file: else numpy fails mid-write
    # (mmap past the end, a reshape of the wrong size) or reads a neighbour's bytes
    need = int(np.prod(shape, dtype=np.int64)) * _ST_ITEMSIZE[t.dtype]
    offset, size = t.data_range.offset, t.data_range.size
    if not isinstance(offset, int) or not isinstance(size, int) or size != need or offset < 0 \
            or offset + size > file_size:
        raise ConversionError(f"{file}: tensor {name!r} needs {need} bytes at offset {offset} "
                              f"({t.dtype}{list(shape)}; the header gives {size}), the file has {file_size}")

    def load() -> np.ndarray:
        return decode(t.mmap_bytes()).reshape(shape)

    return LazyTensor(shape, dtype, load, what=f"{file.name}:{name}", source_dtype=t.dtype)


# ---------------------------------------------------------------------------------------------------
# checkpoint reading


def load_hparams(model_dir: Path) -> dict[str, Any]:
    """config.json as a dict (raw, like gguf.SpecialVocab and gguf.Metadata read it)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConversionError(f"{model_dir}: not a directory (expected a Hugging Face model folder)")
    config = model_dir / "config.json"
    if not config.is_file():
        raise ConversionError(f"{model_dir}: missing config.json; pydflash-convert needs a Hugging Face checkpoint "
                              "folder with config.json, tokenizer.json and *.safetensors")
    try:
        hparams = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{config}: cannot read: {e}") from e
    if not isinstance(hparams, dict):
        raise ConversionError(f"{config}: expected a JSON object, got {type(hparams).__name__}")
    return hparams


def index_safetensors(model_dir: Path) -> dict[str, LazyTensor]:
    """Every tensor of the checkpoint, in the order llama.cpp's converter visits them: shard files
    sorted by name (from model.safetensors.index.json when present), tensors sorted by name within a
    shard. Shards and index must agree."""
    model_dir = Path(model_dir)
    index_file = model_dir / "model.safetensors.index.json"
    weight_map: dict[str, str] = {}
    if index_file.is_file():
        try:
            index = json.loads(index_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConversionError(f"{index_file}: cannot read: {e}") from e
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ConversionError(f"{index_file}: no 'weight_map' object")
        for key, part in weight_map.items():
            if not isinstance(part, str) or not part or Path(part).name != part:
                raise ConversionError(f"{index_file}: weight_map[{key!r}] = {part!r}, expected the file name of a "
                                      "shard in the same folder")
        parts = sorted(set(weight_map.values()))
    else:
        parts = sorted(p.name for p in model_dir.iterdir() if p.name.startswith("model") and p.name.endswith(".safetensors"))
    if not parts:
        if any(model_dir.glob("pytorch_model*.bin")):
            raise ConversionError(f"{model_dir}: only PyTorch .bin weights found; pydflash-convert reads safetensors "
                                  "(re-save the model with save_pretrained(..., safe_serialization=True))")
        raise ConversionError(f"{model_dir}: no model*.safetensors files found")

    tensors: dict[str, LazyTensor] = {}
    for part in parts:
        file = model_dir / part
        if not file.is_file():
            raise ConversionError(f"{index_file}: lists shard {part!r}, which does not exist in {model_dir}")
        try:
            st = SafetensorsLocal(file)
            file_size = file.stat().st_size
        except (OSError, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as e:
            raise ConversionError(f"{file}: not a readable safetensors file: {e}") from e
        for name, t in st.tensors.items():
            if name in tensors:
                raise ConversionError(f"{file}: tensor {name!r} appears in more than one shard")
            tensors[name] = _lazy_from_safetensors(name, t, file, file_size)

    if weight_map:
        missing = sorted(set(weight_map) - set(tensors))
        extra = sorted(set(tensors) - set(weight_map))
        if missing or extra:
            raise ConversionError(f"{index_file}: weight_map and shards disagree; "
                                  f"missing from shards: {missing[:8]}, not in weight_map: {extra[:8]}")
    return tensors


# config.json fields that are counts or sizes: integers (bool excluded) from 1 (0 where _ZERO_OK) up to the GGUF
# uint32 they are written as; _NULLABLE ones may be null (the converters then use a default or derive them)
_INT_HPARAMS = frozenset({
    "n_layers", "num_hidden_layers", "n_layer", "num_layers", "max_position_embeddings", "n_ctx", "hidden_size",
    "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "full_attention_interval", "mtp_num_hidden_layers",
    "decoder_sparse_step", "max_window_layers", "num_target_layers", "original_max_position_embeddings",
    "sliding_window", "block_size"})
# (num_experts_per_tok: the MoE converters range-check it against the expert count, a more useful message)
_ZERO_OK = frozenset({"mtp_num_hidden_layers", "max_window_layers", "num_target_layers", "num_experts_per_tok"})
_NULLABLE = frozenset({"head_dim", "sliding_window", "original_max_position_embeddings", "mtp_num_hidden_layers",
                       "max_window_layers", "num_target_layers"})
# real-valued fields (an integer is a real number too: rope_theta is often written 1000000)
_FLOAT_HPARAMS = frozenset({"rope_theta", "rms_norm_eps", "norm_eps", "layer_norm_eps", "layer_norm_epsilon",
                            "norm_epsilon", "partial_rotary_factor", "factor"})
_UINT32_MAX = 2**32 - 1


def check_hparams(hparams: dict[str, Any], cfg: Path) -> None:
    """Type- and range-check the numeric config.json fields pydflash writes (and the rope dict's), so that a string,
    a bool, a float or an out-of-range count is reported by name instead of failing as a traceback or being
    written as a wrong key."""
    rope = hparams.get("rope_parameters") or hparams.get("rope_scaling") or {}
    fields = list(hparams.items())
    if isinstance(rope, dict):
        fields += [(f"rope_parameters.{k}", v) for k, v in rope.items() if k in _FLOAT_HPARAMS]
    for key, value in fields:
        base = key.rpartition(".")[2]
        if key in _INT_HPARAMS:
            if value is None and key in _NULLABLE:
                continue
            low = 0 if key in _ZERO_OK else 1
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= _UINT32_MAX:
                what = "a non-negative integer" if low == 0 else "a positive integer"
                raise ConversionError(f"{cfg}: {key} = {value!r}, expected {what} (at most {_UINT32_MAX})")
        elif base in _FLOAT_HPARAMS and (key == base or key.startswith("rope_parameters.")):
            if value is None and base == "factor":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConversionError(f"{cfg}: {key} = {value!r}, expected a positive number")


# ---------------------------------------------------------------------------------------------------
# registry


_REGISTRY: dict[str, type[ModelConverter]] = {}


def register(*hf_architectures: str) -> Callable[[type[ModelConverter]], type[ModelConverter]]:
    """Class decorator: convert checkpoints whose config.json `architectures[0]` is one of these."""
    def wrap(cls: type[ModelConverter]) -> type[ModelConverter]:
        for arch in hf_architectures:
            if arch in _REGISTRY and _REGISTRY[arch] is not cls:
                raise ValueError(f"HF architecture {arch!r} already registered by {_REGISTRY[arch].__name__}")
            _REGISTRY[arch] = cls
        cls.hf_architectures = tuple(hf_architectures)
        return cls
    return wrap


def supported_architectures() -> list[str]:
    return sorted(a for a, cls in _REGISTRY.items() if cls.unsupported is None)


def hf_architecture(hparams: dict[str, Any], where: Path | str = "config.json") -> str:
    """The architecture name llama.cpp dispatches on (`text_config.architectures` wins)."""
    arches = hparams.get("architectures")
    text_arches = (hparams.get("text_config") or {}).get("architectures")
    if text_arches:
        arches = text_arches
    if not arches or not isinstance(arches, list) or not isinstance(arches[0], str):
        raise ConversionError(f"{where}: no 'architectures' list; cannot tell which model this is "
                              f"(supported: {', '.join(supported_architectures())})")
    return arches[0]


def converter_class(arch: str) -> type[ModelConverter]:
    try:
        cls = _REGISTRY[arch]
    except KeyError:
        raise ConversionError(f"unsupported architecture {arch!r}; pydflash-convert supports: "
                              f"{', '.join(supported_architectures())}") from None
    if cls.unsupported is not None:
        raise ConversionError(f"{arch}: {cls.unsupported}")
    return cls


# ---------------------------------------------------------------------------------------------------
# converter base


def _block_id(name: str) -> int | None:
    """First all-digit dotted part of a tensor name (llama.cpp's `bid`)."""
    for part in name.split("."):
        if part.isdecimal():
            return int(part)
    return None


class ModelConverter:
    """Base class: one subclass per HF architecture (see module docstring)."""

    gguf_arch: ClassVar[str]                      # value of general.architecture
    hf_architectures: ClassVar[tuple[str, ...]] = ()
    # set on classes registered only to reject a known architecture with a clear reason
    unsupported: ClassVar[str | None] = None
    # defaults applied to config.json for fields the HF config class fills in when absent
    # (llama.cpp reads `AutoConfig.from_pretrained(...).to_dict()`, which has them).
    hparam_defaults: ClassVar[dict[str, Any]] = {}
    # the untied LM head's HF name (None: the model has no head of its own, e.g. a draft borrowing its target's)
    head_tensor: ClassVar[str | None] = "lm_head.weight"
    # whether --no-nextn applies (the architecture may carry MTP blocks)
    supports_no_mtp: ClassVar[bool] = False

    def __init__(self, model_dir: str | Path, *, outtype: str = "auto", model_name: str | None = None,
                 target_model_dir: str | Path | None = None, hparams: dict[str, Any] | None = None,
                 fuse_gate_up_exps: bool = False, no_mtp: bool = False):
        self.dir_model = Path(model_dir)
        if no_mtp and not self.supports_no_mtp:
            raise ConversionError(f"--no-nextn is not supported for {', '.join(self.hf_architectures)} "
                                  "(it has no multi-token-prediction head)")
        # leave the checkpoint's multi-token-prediction blocks out (llama.cpp's --no-nextn / --no-mtp)
        self.no_mtp = no_mtp
        # write a MoE layer's gate and up experts as one ffn_gate_up_exps (llama.cpp's --fuse-gate-up-exps; no
        # effect on dense models)
        self.fuse_gate_up_exps = fuse_gate_up_exps
        self.model_name = model_name
        self.target_model_dir = Path(target_model_dir) if target_model_dir is not None else None
        raw = load_hparams(self.dir_model) if hparams is None else hparams
        self.raw_hparams = raw
        self.hparams = {**self.hparam_defaults, **raw}
        if isinstance(self.hparams.get("text_config"), dict):
            self.hparams = {**self.hparams, **self.hparams["text_config"]}
        check_hparams(self.hparams, self.dir_model / "config.json")
        if outtype not in OUTTYPES:
            raise ConversionError(f"unknown --outtype {outtype!r}; choose one of {', '.join(OUTTYPES)}")
        self.outtype = outtype
        self.ftype = OUTTYPES[outtype]
        self.model_tensors: dict[str, LazyTensor] = {}
        self.block_count = int(self.find_hparam(["n_layers", "num_hidden_layers", "n_layer", "num_layers"]))
        self.writer = gguf.GGUFWriter(path=None, arch=self.gguf_arch)
        self.metadata: gguf.Metadata | None = None

    # -- hparams ------------------------------------------------------------------------------------

    def find_hparam(self, keys: Iterable[str], optional: bool = False) -> Any:
        for k in keys:
            if k in self.hparams:
                return self.hparams[k]
        if optional:
            return None
        raise ConversionError(f"{self.dir_model / 'config.json'}: missing {' / '.join(keys)}")

    def rope_parameters(self) -> dict[str, Any]:
        """transformers-5 style `rope_parameters` (legacy `rope_scaling` + `rope_theta` folded in), as
        llama.cpp's `TextModel.__init__` builds it."""
        rope = dict(self.hparams.get("rope_parameters") or self.hparams.get("rope_scaling") or {})
        if "full_attention" in rope or "sliding_attention" in rope:
            return rope
        theta = self.find_hparam(["global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta",
                                  "rotary_emb_base"], optional=True)
        if "rope_theta" not in rope and theta is not None:
            rope["rope_theta"] = theta
        if "rope_type" not in rope and rope.get("type") is not None:
            rope["rope_type"] = rope["type"]
        prf = self.find_hparam(["partial_rotary_factor", "rope_pct", "rope_percent"], optional=True)
        if "partial_rotary_factor" not in rope and prf is not None:
            rope["partial_rotary_factor"] = prf
        omax = self.find_hparam(["original_max_position_embeddings"], optional=True)
        if "original_max_position_embeddings" not in rope and omax is not None:
            rope["original_max_position_embeddings"] = omax
        return rope

    # -- hooks --------------------------------------------------------------------------------------

    def set_gguf_parameters(self) -> None:
        """The generic decoder keys (llama.cpp `TextModel.set_gguf_parameters`)."""
        w, find = self.writer, self.find_hparam
        w.add_block_count(self.block_count)
        if (n_ctx := find(["max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length",
                           "model_max_length"], optional=True)) is not None:
            w.add_context_length(n_ctx)
        if (n_embd := find(["hidden_size", "n_embd", "dim"], optional=True)) is not None:
            w.add_embedding_length(n_embd)
        if (n_ff := find(["prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size", "n_inner",
                          "hidden_dim"], optional=True)) is not None:
            w.add_feed_forward_length(n_ff)
        if (n_head := find(["num_attention_heads", "n_head", "n_heads"], optional=True)) is not None:
            w.add_head_count(n_head)
        if (n_head_kv := find(["num_key_value_heads", "n_kv_heads"], optional=True)) is not None:
            w.add_head_count_kv(n_head_kv)
        if self.hparams.get("is_causal") is False:
            w.add_causal_attention(False)

        rope_all = self.rope_parameters()
        rope = rope_all.get("full_attention", rope_all)
        rope_type = rope.get("rope_type")
        factor = rope.get("factor")
        if rope_type == "linear" and factor is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(factor)
        elif rope_type == "yarn" and factor is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(factor)
            if (orig_ctx := rope.get("original_max_position_embeddings")) is None:
                raise ConversionError(f"{self.dir_model / 'config.json'}: YaRN rope scaling without "
                                      "original_max_position_embeddings")
            w.add_rope_scaling_orig_ctx_len(orig_ctx)
            if (v := rope.get("extrapolation_factor")) is not None:
                w.add_rope_scaling_yarn_ext_factor(v)
            if (v := rope.get("attention_factor", rope.get("attn_factor"))) is not None:
                w.add_rope_scaling_yarn_attn_factor(v)
            if (v := rope.get("beta_fast")) is not None:
                w.add_rope_scaling_yarn_beta_fast(v)
            if (v := rope.get("beta_slow")) is not None:
                w.add_rope_scaling_yarn_beta_slow(v)
        elif rope_type in ("su", "longrope"):
            w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        elif rope_type not in (None, "default", "dynamic", "llama3"):
            logger.warning("unknown RoPE type %r in config.json: written without scaling", rope_type)
        if "mrope_section" in rope_all:
            sections = list(rope_all["mrope_section"])
            sections += [0] * (4 - len(sections))
            w.add_rope_dimension_sections(sections[:4])
        if (theta := rope.get("rope_theta")) is not None:
            w.add_rope_freq_base(theta)
        if (theta_swa := rope_all.get("sliding_attention", {}).get("rope_theta")) is not None:
            w.add_rope_freq_base_swa(theta_swa)
        if (eps := find(["rms_norm_eps", "norm_eps"], optional=True)) is not None:
            w.add_layer_norm_rms_eps(eps)
        if (eps := find(["layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"], optional=True)) is not None:
            w.add_layer_norm_eps(eps)
        if (n_exp := find(["num_local_experts", "num_experts", "n_routed_experts"], optional=True)) is not None:
            w.add_expert_count(n_exp)
        if (n_used := find(["num_experts_per_tok", "num_experts_per_token", "top_k_experts"], optional=True)) is not None:
            w.add_expert_used_count(n_used)
        if (head_dim := self.hparams.get("head_dim")) is not None:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        w.add_file_type(self.ftype)

    def set_vocab(self) -> None:
        raise NotImplementedError(f"{type(self).__name__}.set_vocab")

    def map_tensor_name(self, name: str) -> str:
        raise NotImplementedError(f"{type(self).__name__}.map_tensor_name")

    def modify_tensors(self, data: LazyTensor, name: str, bid: int | None) -> Iterable[tuple[str, LazyTensor]]:
        """HF tensor → zero or more (GGUF name, tensor). Default: rename only."""
        return [(self.map_tensor_name(name), data)]

    def skip_tensor(self, name: str) -> bool:
        return name.endswith(_SKIPPED_SUFFIXES)

    def tensor_force_type(self, gguf_name: str, n_dims: int) -> GGMLType | None:
        """A type that overrides --outtype for this tensor, or None."""
        return None

    # -- dtype rules --------------------------------------------------------------------------------

    def tensor_type(self, gguf_name: str, shape: tuple[int, ...]) -> GGMLType:
        """Output type of one tensor (llama.cpp `ModelBase.prepare_tensors`): F32 for 1-D tensors,
        norms, router/conv tensors and anything not ending in `.weight`; else the --outtype type,
        with F16 when a Q8_0 row length is not a multiple of 32."""
        n_dims = len(shape)
        qtype = self.tensor_force_type(gguf_name, n_dims)
        if n_dims <= 1 or gguf_name.endswith("_norm.weight"):
            qtype = GGMLType.F32
        if qtype is None:
            stem = gguf_name.rsplit(".", 1)[0]
            tail = stem.rsplit(".", 1)[-1]
            if tail in _F32_TENSOR_SUFFIXES or gguf_name[-7:] not in (".weight", ".lora_a", ".lora_b"):
                qtype = GGMLType.F32
        if qtype is None:
            qtype = _FTYPE_TO_TYPE[self.ftype]
        if qtype not in (GGMLType.F32, GGMLType.F16):
            block = gguf.GGML_QUANT_SIZES[qtype][0]
            if shape[-1] % block != 0:
                logger.warning("%s: row length %d is not a multiple of %d (%s); writing F16",
                               gguf_name, shape[-1], block, qtype.name)
                qtype = GGMLType.F16
        return qtype

    # -- driver -------------------------------------------------------------------------------------

    def _guess_ftype(self) -> None:
        """--outtype auto: bf16 or f16 after the first 2-D+ tensor stored in one of them, else f16."""
        if self.ftype != gguf.LlamaFileType.GUESSED:
            return
        self.ftype = gguf.LlamaFileType.MOSTLY_F16
        for name, lt in self.model_tensors.items():
            if self.skip_tensor(name):
                continue
            if lt.ndim >= 2 and lt.source_dtype in ("BF16", "F16"):
                if lt.source_dtype == "BF16":
                    self.ftype = gguf.LlamaFileType.MOSTLY_BF16
                break
        logger.info("--outtype auto: writing %s", self.ftype.name)

    def prepare_tensors(self) -> None:
        """Map, convert (lazily) and add every tensor to the writer, in llama.cpp's order."""
        for name, data in self.model_tensors.items():
            if self.skip_tensor(name):
                continue
            bid = _block_id(name)
            for new_name, new_data in self.modify_tensors(data, name, bid):
                qtype = self.tensor_type(new_name, new_data.shape)
                out = _converted(new_data, qtype, new_name)
                logger.debug("%-32s %s --> %s, ggml shape {%s}", new_name, data.dtype, qtype.name,
                             ", ".join(str(n) for n in reversed(new_data.shape)))
                try:
                    self.writer.add_tensor(new_name, out, raw_dtype=qtype)  # type: ignore[arg-type]
                except ValueError as e:
                    raise ConversionError(f"{self.dir_model}: tensor {new_name!r}: {e}") from e

    def prepare_metadata(self, vocab_only: bool) -> None:
        """general.* keys (gguf.Metadata, as llama.cpp), then the arch keys, then the tokenizer."""
        total, shared, expert, n_expert = self.writer.get_total_parameter_count()
        gen = _checked_generation_config(self.dir_model)
        readme = self.dir_model / "README.md"
        try:
            md = gguf.Metadata.load(None, self.dir_model, self.model_name, total)
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            raise ConversionError(f"{readme}: the model card's YAML front matter cannot be read "
                                  f"({getattr(e, 'problem', None) or e}{f', {where}'.strip() if where else ''})") from e
        except UnicodeDecodeError as e:
            raise ConversionError(f"{readme}: the model card is not UTF-8 text: {e}") from e
        # llama.cpp's gguf-py (newer than PyPI gguf 0.19.0) also reads HF's `repetition_penalty`
        if md.sampling_penalty_repeat is None and "penalty_repeat" not in gen and "repetition_penalty" in gen:
            md.sampling_penalty_repeat = gen["repetition_penalty"]
        if md.name is None:
            md.name = self.dir_model.name
        if md.size_label is None and total > 0:
            md.size_label = gguf.size_label(total, shared, expert, n_expert)
        self.adjust_metadata(md)
        self.metadata = md
        self.writer.add_type(gguf.GGUFType.MODEL)
        md.set_gguf_meta_model(self.writer)
        self.set_gguf_parameters()
        self.writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        self.set_vocab()

    def adjust_metadata(self, md: gguf.Metadata) -> None:
        """What a converter adds to the general.* keys it read (none by default)."""

    def default_outfile(self, vocab_only: bool) -> str:
        assert self.metadata is not None
        md = self.metadata
        output_type = self.ftype.name.partition("_")[2]
        if vocab_only:
            return gguf.naming_convention(md.name, md.basename, md.finetune, md.version, None, None, model_type="vocab")
        return gguf.naming_convention(md.name, md.basename, md.finetune, md.version, md.size_label, output_type)

    def write(self, outfile: str | Path | None = None, *, vocab_only: bool = False, dry_run: bool = False,
              progress: bool = True) -> Path:
        """Convert and write the GGUF; returns its path. `outfile` may be a folder (default name
        inside it) or contain `{ftype}`; None writes next to the checkpoint."""
        if not vocab_only:
            self.model_tensors = index_safetensors(self.dir_model)
            self.check_tensors(set(self.model_tensors))
            self._guess_ftype()
            self.prepare_tensors()
        elif self.ftype == gguf.LlamaFileType.GUESSED:
            self.ftype = gguf.LlamaFileType.MOSTLY_F16
        self.prepare_metadata(vocab_only)

        out = output_path(outfile, self.dir_model, f"{self.default_outfile(vocab_only)}.gguf",
                          self.ftype.name.partition("_")[2])
        inputs = checkpoint_inputs(self.dir_model) + checkpoint_inputs(self.target_model_dir)
        if dry_run:
            checked_target(out, inputs)  # a dry run reports a bad --outfile too (write_gguf_file checks a real one)
            for name, ti in self.writer.tensors[0].items():
                logger.info("%-32s %-5s {%s}", name, ti.dtype.name, ", ".join(str(n) for n in reversed(ti.shape)))
            logger.info("dry run: would write %s (%d tensors)", out, len(self.writer.tensors[0]))
            return out
        write_gguf_file(self.writer, out, tensors=not vocab_only, progress=progress, inputs=inputs,
                        validate=None if vocab_only else self.validate_gguf)
        logger.info("wrote %s", out)
        return out

    def check_tensors(self, names: set[str]) -> None:
        """Refuse a checkpoint whose tensors cannot make a working model, before anything is converted. An untied
        model needs its LM head: without it the GGUF would load with the embedding as the head (silently wrong)."""
        if self.head_tensor is None or self.hparams.get("tie_word_embeddings") is not False:
            return
        if not any(n == self.head_tensor or n.endswith("." + self.head_tensor) for n in names):
            raise ConversionError(f"{self.dir_model}: missing tensor {self.head_tensor!r}, which config.json's "
                                  "tie_word_embeddings = false requires (the LM head is not the embedding)")

    def validate_gguf(self, path: Path) -> None:
        """Open the written (not yet renamed) GGUF the way pydflash loads it, from its metadata only, and refuse it
        if the load would: a config that disagrees with the tensors converts fine and fails only there. Skipped
        without the compiled core (conversion needs only numpy and gguf)."""
        try:
            from pydflash import _core
        except ImportError:
            logger.debug("pydflash's compiled core is not importable: the GGUF is not test-loaded")
            return
        from pydflash.errors import PydflashError

        try:
            model = _core.Model(str(path), n_threads=1, plan_only=True)
        except PydflashError as e:
            msg = str(e).replace(str(path), path.name[:-len(".partial")])
            hint = "; convert with --no-nextn to leave the MTP head out" if "nextn" in msg else ""
            raise ConversionError(f"{self.dir_model}: the converted GGUF would not load: {msg}{hint}") from e
        del model


# generation_config.json's sampling fields gguf.Metadata copies into general.sampling.* (None: a string)
_GENERATION_FIELDS: dict[str, Any] = {
    "sequence": str, "top_k": int, "penalty_last_n": int, "mirostat": int, "top_p": float, "min_p": float,
    "xtc_probability": float, "xtc_threshold": float, "temperature": float, "penalty_repeat": float,
    "repetition_penalty": float, "mirostat_tau": float, "mirostat_eta": float}


def _checked_generation_config(model_dir: Path) -> dict[str, Any]:
    """generation_config.json as gguf.Metadata reads it (unreadable JSON counts as absent, as in llama.cpp), with
    the sampling fields it writes type-checked: a wrong type would fail as a traceback inside the writer."""
    path = model_dir / "generation_config.json"
    gen = gguf.Metadata.load_generation_config(model_dir)
    if not isinstance(gen, dict):
        raise ConversionError(f"{path}: expected a JSON object, got {type(gen).__name__}")
    for key, kind in _GENERATION_FIELDS.items():
        value = gen.get(key)
        if value is None:
            continue
        ok = isinstance(value, str) if kind is str else (
            not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int))
        if not ok:
            what = {str: "a string", int: "an integer", float: "a number"}[kind]
            raise ConversionError(f"{path}: {key} = {value!r}, expected {what}")
    return gen


def write_gguf_file(writer: gguf.GGUFWriter, outfile: Path, *, tensors: bool = True, progress: bool = True,
                    inputs: Iterable[Path] = (), validate: Callable[[Path], None] | None = None) -> None:
    """Write what `writer` holds to `outfile` (header, metadata, then the tensors, or only their infos) through
    `outfile.partial`, renamed when whole: an error or an interrupted run leaves no truncated GGUF behind.
    `outfile` is checked first (convert/outfile.py: a symlink is written through; a non-regular file or one of
    `inputs` is refused). `validate(partial)` may refuse the written file before it replaces anything."""
    target = checked_target(outfile, inputs)
    partial = target.with_name(target.name + ".partial")
    try:
        try:
            writer.write_header_to_file(path=partial)
            writer.write_kv_data_to_file()
            if tensors:
                writer.write_tensors_to_file(progress=progress)
            else:
                writer.write_ti_data_to_file()
            writer.close()
        except OSError as e:
            raise ConversionError(f"{outfile}: cannot write the GGUF: {e.strerror or e}"
                                  f"{f' ({e.filename})' if e.filename else ''}") from e
        if validate is not None:
            validate(partial)
        try:
            partial.replace(target)
        except OSError as e:
            raise ConversionError(f"{outfile}: cannot move the finished GGUF into place: {e.strerror or e}") from e
    except BaseException:
        _discard(writer, partial)
        raise


def _discard(writer: gguf.GGUFWriter, partial: Path) -> None:
    """Close and remove a failed write's partial file; a second failure here is only logged, so that the first
    error is the one reported."""
    try:
        writer.close()
    except OSError as e:
        logger.debug("closing %s after an error: %s", partial, e)
    try:
        partial.unlink(missing_ok=True)
    except OSError as e:
        logger.warning("could not remove %s: %s", partial, e)


def _converted(data: LazyTensor, qtype: GGMLType, name: str) -> LazyTensor:
    """Lazy `gguf.quants.quantize(data, qtype)`: same numerics as llama.cpp's converter."""
    if qtype == GGMLType.F32:
        return data if data.dtype == np.float32 else data.map(lambda a: a.astype(np.float32), dtype=np.float32)
    if qtype == GGMLType.F16:
        return data if data.dtype == np.float16 else data.map(lambda a: a.astype(np.float16), dtype=np.float16)
    shape = gguf.quant_shape_to_byte_shape(data.shape, qtype)
    return data.map(lambda a: gguf.quants.quantize(a, qtype), shape=shape, dtype=np.uint8)


def run_command(prog: str, work: Callable[[], Path | None], *, verbose: bool = False) -> int:
    """The body of a converter command (pydflash-convert, pydflash-quantize, inflate): log at INFO (DEBUG when
    verbose), run work(); a ConversionError is one line on stderr and exit status 1, else the path work()
    wrote (if any) is printed."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s:%(name)s:%(message)s")
    try:
        out = work()
    except ConversionError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    if out is not None:
        print(out)
    return 0
