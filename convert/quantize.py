"""`pydflash-quantize IN.gguf OUT.gguf TYPE`: re-encode a GGUF's weight matrices with ggml's own
quantizers (through `pydflash._core.quantize`), choosing per-tensor types the way llama.cpp's
`llama-quantize` does (`src/llama-quant.cpp`).

TYPE:
- `q4_0`, `q4_k`, `q5_k`, `q6_k`, `q8_0`: every quantizable tensor gets that type, like
  `llama-quantize --pure` (llama.cpp's names `Q4_K` / `Q5_K` are aliases of `Q4_K_M` / `Q5_K_M`,
  so general.file_type says so, as llama.cpp writes it).
- `q4_k_m`: llama.cpp's Q4_K_M mix: q4_k, with q6_k for `output.weight` (or `token_embd.weight`
  when the head is tied) and for `attn_v` / `ffn_down` (and fused `attn_qkv`) in the "use more bits"
  layers.

Tensors whose row length is not a multiple of the type's block size fall back like llama.cpp
(q4_k → q5_0, q5_k → q5_1, q6_k → q8_0, then f16). 1-D tensors (trailing dimensions of 1 not counted, as in
ggml), norms, MoE routers and conv kernels are copied unchanged; the experts (3-D) quantize like other matrices.
All metadata is copied; `general.quantization_version` and `general.file_type` are (re)set at the end, as
llama.cpp does.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from pydflash.errors import ConversionError

from .base import LazyTensor, run_command, write_gguf_file

logger = logging.getLogger("pydflash.convert")

T = gguf.GGMLQuantizationType
FT = gguf.LlamaFileType


@dataclass(frozen=True)
class QuantType:
    ftype: gguf.LlamaFileType   # written as general.file_type
    default: gguf.GGMLQuantizationType
    pure: bool


QUANT_TYPES: dict[str, QuantType] = {
    "q4_0": QuantType(FT.MOSTLY_Q4_0, T.Q4_0, pure=True),
    "q4_k": QuantType(FT.MOSTLY_Q4_K_M, T.Q4_K, pure=True),
    "q5_k": QuantType(FT.MOSTLY_Q5_K_M, T.Q5_K, pure=True),
    "q6_k": QuantType(FT.MOSTLY_Q6_K, T.Q6_K, pure=True),
    "q8_0": QuantType(FT.MOSTLY_Q8_0, T.Q8_0, pure=True),
    "q4_k_m": QuantType(FT.MOSTLY_Q4_K_M, T.Q4_K, pure=False),
}

_BLK_RE = re.compile(r"^blk\.\s*([+-]?\d+)")

# substrings that keep a tensor unquantized (llama.cpp tensor_allows_quantization)
_NO_QUANT_SUBSTRINGS = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight",
    "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight", "time_mix_v0.weight",
    "time_mix_v1.weight", "time_mix_v2.weight", "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight",
    "time_mix_g1.weight", "time_mix_g2.weight", "time_mix_decay_w1.weight", "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_",
    ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
)


def _layer_of(name: str) -> int:
    m = _BLK_RE.match(name)
    return int(m[1]) if m else -1


def tensor_order(names: list[str]) -> list[str]:
    """llama.cpp's weight order (llama_model_loader weight_name_comparer): by layer, non-layer tensors
    first, then by name. Output files list tensors in this order and the per-layer counters of the
    mixes count in it."""
    return sorted(names, key=lambda n: (_layer_of(n), n.encode()))


def ggml_n_dims(ne: tuple[int, ...]) -> int:
    """ggml's `ggml_n_dims`: trailing dimensions of 1 do not count (a [E, 1] tensor such as qwen35moe's
    `ffn_gate_inp_shexp` is 1-D to llama-quantize, so it stays as it is)."""
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return max(n, 1)


def allows_quantization(name: str, n_dims: int) -> bool:
    if n_dims < 2 or not name.endswith("weight"):
        return False
    if name in ("position_embd.weight", "token_types.weight"):
        return False
    return not any(s in name for s in _NO_QUANT_SUBSTRINGS)


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"), ("attn_v.weight", "attn_v"),
                     ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
                     ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _block_size(t: gguf.GGMLQuantizationType) -> int:
    return gguf.GGML_QUANT_SIZES[t][0]


_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def _fallback(name: str, ncols: int, t: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """llama.cpp tensor_type_fallback: a type whose block divides the row length."""
    if ncols % _block_size(t) == 0:
        return t
    new = _FALLBACK.get(t, t)
    if ncols % _block_size(new) != 0:
        new = T.F16
    logger.info("%s: row length %d not divisible by %d (%s); falling back to %s",
                name, ncols, _block_size(t), t.name, new.name)
    return new


class TypePlanner:
    """Per-tensor target types for one file (llama.cpp llama_tensor_get_type, for the mixes above)."""

    def __init__(self, qt: QuantType, names: list[str], n_layer: int, n_expert: int):
        self.qt = qt
        self.n_layer = n_layer
        self.n_expert = n_expert
        self.tied = "output.weight" not in names
        self.n_attention_wv = sum(_category(n) in ("attn_v", "attn_qkv", "attn_kv_b") for n in names)
        self.i_attention_wv = 0
        self.i_ffn_down = 0
        self.n_fallback = 0

    def target(self, name: str, ne: tuple[int, ...], cur: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
        """`ne` in ggml order (ne[0] = row length)."""
        if not allows_quantization(name, ggml_n_dims(ne)):
            return cur
        t = self.qt.default
        if not self.qt.pure:
            t = self._mix(name, ne, t)
        new = _fallback(name, ne[0], t)
        self.n_fallback += new != t
        return new

    def _mix(self, name: str, ne: tuple[int, ...], t: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
        # only the rules that fire for LLAMA_FTYPE_MOSTLY_Q4_K_M
        cat = _category(name)
        if cat == "output" or (self.tied and cat == "token_embd"):
            if ne[0] % _block_size(t) != 0:
                return T.Q8_0
            return T.Q6_K if t != T.Q8_0 else t
        if cat == "token_embd":
            return t
        if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
            if _use_more_bits(self.i_attention_wv, self.n_attention_wv):
                t = T.Q6_K
            if self.n_expert == 8:
                t = T.Q8_0
            self.i_attention_wv += 1
        elif cat == "attn_k":
            if self.n_expert == 8:
                t = T.Q8_0
        elif cat == "ffn_down":
            i_layer, n_layer = self.i_ffn_down, self.n_layer
            if self.n_expert > 1:
                i_layer = _layer_of(name)
                if not 0 <= i_layer < n_layer:
                    raise ConversionError(f"tensor {name!r}: layer {i_layer} outside [0, {n_layer})")
            if _use_more_bits(i_layer, n_layer):
                t = T.Q6_K
            self.i_ffn_down += 1
        elif cat == "attn_output":
            if self.n_expert == 8:
                t = T.Q5_K
        return t


def _to_f32_rows(data: np.ndarray, cur: gguf.GGMLQuantizationType, ne0: int) -> np.ndarray:
    if cur == T.F32:
        rows = data
    elif cur == T.F16:
        rows = data.astype(np.float32)
    else:
        try:
            rows = gguf.quants.dequantize(data, cur)
        except NotImplementedError as e:
            raise ConversionError(f"cannot dequantize {cur.name} tensors: {e}") from e
    return np.ascontiguousarray(rows, dtype=np.float32).reshape(-1, ne0)


def _quantize_fn(core: Any, data: np.ndarray, cur: gguf.GGMLQuantizationType, new: gguf.GGMLQuantizationType,
                 ne: tuple[int, ...], byte_shape: tuple[int, ...], name: str):
    def run() -> np.ndarray:
        rows = _to_f32_rows(np.asarray(data), cur, ne[0])
        q = core.quantize(rows, int(new))
        q = np.asarray(q)
        if q.dtype != np.uint8 or q.shape != (rows.shape[0], byte_shape[-1]):
            raise ConversionError(f"{name}: _core.quantize returned {q.dtype}{list(q.shape)}, expected uint8"
                                  f"{[rows.shape[0], byte_shape[-1]]}")
        return q.reshape(byte_shape)
    return run


def _copy_kv(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, path: Path, also_skip: frozenset = frozenset()) -> None:
    """Every metadata key of `reader` but the file-level ones (and `also_skip`) into `writer`."""
    skip = {gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.QUANTIZATION_VERSION, gguf.Keys.General.FILE_TYPE,
            gguf.Keys.Split.LLM_KV_SPLIT_NO, gguf.Keys.Split.LLM_KV_SPLIT_COUNT, gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT,
            *also_skip}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in skip:
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = None
        if vtype == gguf.GGUFValueType.ARRAY:
            if len(field.types) != 2:
                raise ConversionError(f"{path}: key {key!r} is a nested array, which pydflash-quantize cannot copy")
            sub = gguf.GGUFValueType(field.types[1])
        value = field.contents()
        if key == gguf.Keys.General.ALIGNMENT:
            writer.data_alignment = int(value)
        writer.add_key_value(key, value, vtype, sub_type=sub)


def quantize_gguf(infile: str | Path, outfile: str | Path, qtype: str, *, progress: bool = True) -> Path:
    """Write `outfile`, a `qtype` (see QUANT_TYPES) re-encoding of the GGUF `infile`."""
    infile, outfile = Path(infile), Path(outfile)
    if qtype.lower() not in QUANT_TYPES:
        raise ConversionError(f"unknown quantization type {qtype!r}; choose one of {', '.join(QUANT_TYPES)}")
    qt = QUANT_TYPES[qtype.lower()]
    if infile.resolve() == outfile.resolve():
        raise ConversionError(f"{outfile}: output would overwrite the input")
    try:
        from pydflash import _core
    except ImportError as e:
        raise ConversionError(f"pydflash-quantize needs the compiled core (pydflash._core): {e}") from e
    try:
        reader = gguf.GGUFReader(infile)
    except (OSError, ValueError) as e:
        raise ConversionError(f"{infile}: not a readable GGUF file: {e}") from e
    arch_field = reader.fields.get(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise ConversionError(f"{infile}: missing general.architecture")
    arch = arch_field.contents()

    def u32(key: str, default: int) -> int:
        f = reader.fields.get(key.format(arch=arch))
        return int(f.contents()) if f is not None else default

    tensors = {t.name: t for t in reader.tensors}
    names = tensor_order(list(tensors))
    planner = TypePlanner(qt, names, n_layer=u32(gguf.Keys.LLM.BLOCK_COUNT, 0),
                          n_expert=u32(gguf.Keys.LLM.EXPERT_COUNT, 0))

    writer = gguf.GGUFWriter(path=None, arch=arch)
    _copy_kv(reader, writer, infile)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(qt.ftype)

    for name in names:
        t = tensors[name]
        cur = T(t.tensor_type)
        ne = tuple(int(n) for n in t.shape)  # ggml order
        new = planner.target(name, ne, cur)
        if new == cur:
            writer.add_tensor(name, t.data, raw_dtype=cur)
            continue
        if cur not in (T.F32, T.F16, T.BF16):
            logger.warning("%s: requantizing %s -> %s loses precision", name, cur.name, new.name)
        byte_shape = gguf.quant_shape_to_byte_shape(tuple(reversed(ne)), new)
        lazy = LazyTensor(byte_shape, np.uint8, _quantize_fn(_core, t.data, cur, new, ne, byte_shape, name),
                          what=f"{infile.name}:{name}")
        writer.add_tensor(name, lazy, raw_dtype=new)  # type: ignore[arg-type]
        logger.debug("%-32s %s -> %s", name, cur.name, new.name)

    if planner.n_fallback:
        logger.warning("%d of %d tensors needed a fallback type (row length not a multiple of the block size)",
                       planner.n_fallback, len(names))
    write_gguf_file(writer, outfile, progress=progress)
    logger.info("wrote %s (%s)", outfile, qtype)
    return outfile


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pydflash-quantize", description="Quantize a GGUF model with ggml's quantizers")
    p.add_argument("infile", type=Path, help="input GGUF (f32/f16/bf16, or already quantized)")
    p.add_argument("outfile", type=Path, help="output GGUF")
    p.add_argument("type", type=str.lower, choices=list(QUANT_TYPES), help="target type")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="log every tensor")
    args = p.parse_args(argv)
    return run_command("pydflash-quantize",
                       lambda: quantize_gguf(args.infile, args.outfile, args.type, progress=not args.no_progress),
                       verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
