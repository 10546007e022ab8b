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
from gguf.utility import LocalTensor, SafetensorsLocal

from pydflash.errors import ConversionError

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
        data = self._fn()
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


def _lazy_from_safetensors(name: str, t: LocalTensor, file: Path) -> LazyTensor:
    if t.dtype not in _ST_DECODERS:
        raise ConversionError(
            f"{file}: tensor {name!r} has dtype {t.dtype}, which pydflash cannot convert "
            f"(supported: {', '.join(_ST_DECODERS)}); convert the original bf16/f16 checkpoint instead")
    dtype, decode = _ST_DECODERS[t.dtype]
    shape = tuple(t.shape)

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
        except (OSError, ValueError, KeyError, UnicodeDecodeError) as e:
            raise ConversionError(f"{file}: not a readable safetensors file: {e}") from e
        for name, t in st.tensors.items():
            if name in tensors:
                raise ConversionError(f"{file}: tensor {name!r} appears in more than one shard")
            tensors[name] = _lazy_from_safetensors(name, t, file)

    if weight_map:
        missing = sorted(set(weight_map) - set(tensors))
        extra = sorted(set(tensors) - set(weight_map))
        if missing or extra:
            raise ConversionError(f"{index_file}: weight_map and shards disagree; "
                                  f"missing from shards: {missing[:8]}, not in weight_map: {extra[:8]}")
    return tensors


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

    def __init__(self, model_dir: str | Path, *, outtype: str = "auto", model_name: str | None = None,
                 target_model_dir: str | Path | None = None, hparams: dict[str, Any] | None = None,
                 fuse_gate_up_exps: bool = False):
        self.dir_model = Path(model_dir)
        # write a MoE layer's gate and up experts as one ffn_gate_up_exps (llama.cpp's --fuse-gate-up-exps; no
        # effect on dense models)
        self.fuse_gate_up_exps = fuse_gate_up_exps
        self.model_name = model_name
        self.target_model_dir = Path(target_model_dir) if target_model_dir is not None else None
        raw = load_hparams(self.dir_model) if hparams is None else hparams
        self.raw_hparams = raw
        self.hparams = {**self.hparam_defaults, **raw}
        if "text_config" in self.hparams:
            self.hparams = {**self.hparams, **self.hparams["text_config"]}
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
        md = gguf.Metadata.load(None, self.dir_model, self.model_name, total)
        # llama.cpp's gguf-py (newer than PyPI gguf 0.19.0) also reads HF's `repetition_penalty`
        gen = gguf.Metadata.load_generation_config(self.dir_model)
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
            self._guess_ftype()
            self.prepare_tensors()
        elif self.ftype == gguf.LlamaFileType.GUESSED:
            self.ftype = gguf.LlamaFileType.MOSTLY_F16
        self.prepare_metadata(vocab_only)

        out = Path(outfile) if outfile is not None else self.dir_model
        if out.is_dir():
            out = out / f"{self.default_outfile(vocab_only)}.gguf"
        else:
            out = out.parent / gguf.fill_templated_filename(out.name, self.ftype.name.partition("_")[2])
        if dry_run:
            for name, ti in self.writer.tensors[0].items():
                logger.info("%-32s %-5s {%s}", name, ti.dtype.name, ", ".join(str(n) for n in reversed(ti.shape)))
            logger.info("dry run: would write %s (%d tensors)", out, len(self.writer.tensors[0]))
            return out
        write_gguf_file(self.writer, out, tensors=not vocab_only, progress=progress)
        logger.info("wrote %s", out)
        return out


def write_gguf_file(writer: gguf.GGUFWriter, outfile: Path, *, tensors: bool = True, progress: bool = True) -> None:
    """Write what `writer` holds to `outfile` (header, metadata, then the tensors, or only their infos) through
    `outfile.partial`, renamed when whole: an error or an interrupted run leaves no truncated GGUF behind."""
    partial = outfile.with_name(outfile.name + ".partial")
    try:
        writer.write_header_to_file(path=partial)
        writer.write_kv_data_to_file()
        if tensors:
            writer.write_tensors_to_file(progress=progress)
        else:
            writer.write_ti_data_to_file()
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    writer.close()
    partial.replace(outfile)


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
