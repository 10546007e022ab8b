"""HF `Qwen3ForCausalLM` → GGUF arch `qwen3` (llama.cpp `Qwen3Model(Qwen2Model)`,
`conversion/qwen.py`; contract in gguf-formats.md §2).

Keys: the generic decoder keys plus `attention.key_length` / `value_length` = `head_dim`
(Qwen3's head_dim differs from hidden/heads). Tensors are renamed only; no transforms.
"""

from __future__ import annotations

import json
import re
from typing import Any

import gguf

from pydflash.errors import ConversionError

from .base import ModelConverter, register
from .qwen_names import QWEN3_LAYER
from .vocab import set_vocab_gpt2

# HF name (after "model.layers.N.") → GGUF name (after "blk.N.")
_LAYER_TENSORS = QWEN3_LAYER
_GLOBAL_TENSORS = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(.+)\.(weight|bias)$")

_POOLING = {"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS, "lasttoken": gguf.PoolingType.LAST}


@register("Qwen3ForCausalLM")
class Qwen3Converter(ModelConverter):
    gguf_arch = "qwen3"
    # Qwen3Config defaults for optional fields (what AutoConfig(...).to_dict() would add)
    hparam_defaults = {
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "head_dim": 128,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.hparams.setdefault("num_key_value_heads", self.hparams.get("num_attention_heads"))
        if self._is_reranker():
            raise ConversionError(f"{self.dir_model}: Qwen3 reranker checkpoints are not supported (llama.cpp writes "
                                  "them with a classifier head); pydflash converts causal LMs")

    def _is_reranker(self) -> bool:
        readme = self.dir_model / "README.md"
        text = readme.read_text(encoding="utf-8", errors="replace").lower() if readme.is_file() else ""
        if "# qwen3-reranker" in text or "# qwen3-vl-reranker" in text:
            return True
        hints = [self.dir_model.name, str(self.hparams.get("_name_or_path", "")), str(self.hparams.get("model_type", ""))]
        return any("qwen3-reranker" in h.lower() or "qwen3-vl-reranker" in h.lower() for h in hints)

    def check_tensors(self, names: set[str]) -> None:
        # a sentence-transformers embedding model (modules.json) has no LM head, tied or not
        if not (self.dir_model / "modules.json").is_file():
            super().check_tensors(names)

    def set_gguf_parameters(self) -> None:
        super().set_gguf_parameters()
        self._set_pooling_type()

    def _set_pooling_type(self) -> None:
        """sentence-transformers pooling (Qwen3-Embedding), as llama.cpp `_try_set_pooling_type`."""
        modules = self.dir_model / "modules.json"
        if not modules.is_file():
            return
        path = next((m["path"] for m in json.loads(modules.read_text(encoding="utf-8"))
                     if str(m.get("type", "")).endswith("Pooling")), None)
        if path is None:
            return
        cfg = json.loads((self.dir_model / path / "config.json").read_text(encoding="utf-8"))
        if cfg.get("pooling_mode_mean_tokens"):
            kind = gguf.PoolingType.MEAN
        elif cfg.get("pooling_mode_cls_token"):
            kind = gguf.PoolingType.CLS
        elif cfg.get("pooling_mode_lasttoken"):
            kind = gguf.PoolingType.LAST
        elif cfg.get("pooling_mode") in _POOLING:
            kind = _POOLING[cfg["pooling_mode"]]
        else:
            raise ConversionError(f"{self.dir_model / path / 'config.json'}: only mean, cls and last-token pooling "
                                  "are supported")
        self.writer.add_pooling_type(kind)

    def set_vocab(self) -> None:
        set_vocab_gpt2(self.writer, self.dir_model, int(self.hparams["vocab_size"]))

    def map_tensor_name(self, name: str) -> str:
        if (m := _LAYER_RE.match(name)) is not None:
            bid, sub, suffix = int(m[1]), m[2], m[3]
            if sub in _LAYER_TENSORS and bid < self.block_count:
                return f"blk.{bid}.{_LAYER_TENSORS[sub]}.{suffix}"
        elif (m := _GLOBAL_RE.match(name)) is not None and m[1] in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[m[1]]}.{m[2]}"
        raise ConversionError(f"{self.dir_model}: cannot map tensor {name!r} of a Qwen3ForCausalLM checkpoint "
                              f"(block_count {self.block_count})")
