"""A multi-token-prediction head appended to a Qwen3.5 (or Qwen3.5-MoE) GGUF that has none: `append_mtp_head`
writes the target's keys and tensors unchanged and the head's tensors as llama.cpp's converter (and ours, convert/qwen35.py) writes a
checkpoint's `mtp.*`: block `blk.{n_layer}` (its attention layer and FFN) with `nextn.eh_proj`, `nextn.enorm`,
`nextn.hnorm` and `nextn.shared_head_norm`, counted in `block_count`, with `nextn_predict_layers` = 1 and the block
marked full attention in `attention.recurrent_layers`. The head's tensors come in the Qwen3.5 checkpoints' names and
conventions (`mtp.fc.weight`, `mtp.layers.0.self_attn.q_proj.weight`, norms stored as their offset from 1 ...; a MoE
head's experts per expert as saved, or fused as transformers holds them), as tools/train_mtp.py trains them."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np

from pydflash.errors import ConversionError

from .base import write_gguf_file
from .qwen35 import _ATTENTION, _COMMON, _MTP_GLOBAL, _NEXTN
from .qwen_names import FFN, MOE_ROUTER, SHARED_EXPERT, weights
from .quantize import _copy_kv

ARCHS = ("qwen35", "qwen35moe")
_LAYER = re.compile(r"^mtp\.layers\.0\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def mtp_tensor_name(name: str, n_layer: int, arch: str = "qwen35") -> tuple[str, bool]:
    """A checkpoint MTP tensor's GGUF name in a model of n_layer trunk layers, and whether it is a norm (stored
    in the GGUF as 1 + the checkpoint's value, as the converter stores every Qwen3.5 RMSNorm but the gated one).
    Not the routed experts (head_tensors stacks them)."""
    ffn = weights(FFN) if arch == "qwen35" else weights({**MOE_ROUTER, **SHARED_EXPERT})
    if (m := _LAYER.match(name)) is not None:
        table = {**_COMMON, **ffn, **_ATTENTION}
        sub = m[1]
    elif name.startswith("mtp.") and name[4:].rpartition(".")[0] in _MTP_GLOBAL:
        stem = name[4:].rpartition(".")[0]
        table, sub = _NEXTN, f"{_MTP_GLOBAL[stem]}.weight"
    else:
        raise ConversionError(f"cannot map MTP tensor {name!r} (expected mtp.fc / mtp.pre_fc_norm_* / mtp.norm or "
                              f"mtp.layers.0.*)")
    if sub not in table:
        raise ConversionError(f"cannot map MTP tensor {name!r} of a {arch} head")
    return f"blk.{n_layer}.{table[sub]}", sub.endswith("norm.weight")


def head_tensors(head: dict[str, np.ndarray], n_layer: int, arch: str) -> list[tuple[str, np.ndarray]]:
    """The head's tensors by GGUF name, in float32: norms as 1 + their value, routed experts stacked [X, rows,
    cols] (gate and up apart)."""
    out, experts = [], {}
    for name in sorted(head):
        a = np.asarray(head[name], dtype=np.float32)
        sub = name[len("mtp.layers.0."):] if name.startswith("mtp.layers.0.") else ""
        if (m := _EXPERT.match(sub)) is not None:
            experts.setdefault(m[2], {})[int(m[1])] = a
        elif sub in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # fused: [X, 2F, E] / [X, E, F]
            if sub.endswith("down_proj"):
                experts["down_proj"] = a
            else:
                half = a.shape[1] // 2
                experts["gate_proj"], experts["up_proj"] = a[:, :half], a[:, half:]
        else:
            gguf_name, is_norm = mtp_tensor_name(name, n_layer, arch)
            out.append((gguf_name, a + np.float32(1) if is_norm else a))
    for proj, parts in experts.items():
        stacked = parts if isinstance(parts, np.ndarray) else np.stack([parts[x] for x in range(len(parts))])
        out.append((f"blk.{n_layer}.{_STACKED[proj]}.weight", np.ascontiguousarray(stacked)))
    return out


def append_mtp_head(target: str | Path, out: str | Path, head: dict[str, np.ndarray], *,
                    progress: bool = False) -> Path:
    """Write `out`: the GGUF `target` (arch qwen35 or qwen35moe, no MTP head) with the head `head` ({checkpoint
    name: float32 array}) appended as its MTP block."""
    target, out = Path(target), Path(out)
    reader = gguf.GGUFReader(target)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    if arch not in ARCHS:
        raise ConversionError(f"{target}: general.architecture = {arch!r}, expected one of {', '.join(ARCHS)}")
    key = lambda k: reader.fields[f"{arch}.{k}"].contents() if f"{arch}.{k}" in reader.fields else None  # noqa: E731
    if key("nextn_predict_layers"):
        raise ConversionError(f"{target}: has an MTP head already (nextn_predict_layers = "
                              f"{key('nextn_predict_layers')})")
    n_layer = int(key("block_count"))
    writer = gguf.GGUFWriter(path=None, arch=arch)
    _copy_kv(reader, writer, target, also_skip=frozenset({f"{arch}.block_count", f"{arch}.attention.recurrent_layers",
                                                          gguf.Keys.General.SIZE_LABEL}))
    writer.add_uint32(f"{arch}.block_count", n_layer + 1)
    writer.add_uint32(f"{arch}.nextn_predict_layers", 1)
    if key("attention.recurrent_layers") is not None:
        recurrent = [bool(x) for x in key("attention.recurrent_layers")]
        writer.add_array(f"{arch}.attention.recurrent_layers", recurrent + [False])
    writer.add_file_type(int(key_or(reader, gguf.Keys.General.FILE_TYPE, 0)))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for gguf_name, a in head_tensors(head, n_layer, arch):
        writer.add_tensor(gguf_name, a)
    if gguf.Keys.General.SIZE_LABEL in reader.fields:  # (it counts every parameter, the head's too)
        writer.add_size_label(gguf.size_label(*writer.get_total_parameter_count()))
    out.parent.mkdir(parents=True, exist_ok=True)
    write_gguf_file(writer, out, progress=progress)
    return out


def key_or(reader: gguf.GGUFReader, name: str, default):
    return reader.fields[name].contents() if name in reader.fields else default
