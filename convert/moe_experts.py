"""The routed experts of a MoE layer as llama.cpp's converter writes them (`Qwen2MoeModel.modify_tensors` and, for
`--fuse-gate-up-exps`, `ModelBase.modify_tensors`, `conversion/qwen.py` / `base.py`), shared by the qwen3moe and
qwen35moe converters.

A checkpoint stores a layer's experts per expert (`model.layers.N.mlp.experts.X.{gate,up,down}_proj.weight`, what
`save_pretrained` writes) or fused (`mlp.experts.gate_up_proj` [n_expert, 2F, E] and `mlp.experts.down_proj`
[n_expert, E, F], the layout transformers 5 holds in memory). Either way they become `blk.N.ffn_{down,gate,up}_exps`
([n_expert, rows, cols], so ggml's ne = {cols, rows, n_expert}); per-expert tensors are stacked once all of a
layer's are read, yielded down, gate, up as llama.cpp yields them. With `fuse_gate_up`, gate and up are written as
one `blk.N.ffn_gate_up_exps` ([n_expert, 2F, E], gate first) in place of the two.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from pydflash.errors import ConversionError

from .base import LazyTensor

_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")
_ROUTER_RE = re.compile(r"^model\.layers\.\d+\.mlp\.gate\.weight$")
# the stacked tensors, in the order llama.cpp yields a layer's
_STACKED = {"down_proj": "ffn_down_exps", "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps"}
GATE_UP = "ffn_gate_up_exps"

Named = list[tuple[str, LazyTensor]]


def add_expert_widths(writer: Any, hparams: dict[str, Any]) -> None:
    """`expert_feed_forward_length` and, when the config has a shared expert, `expert_shared_feed_forward_length`
    (llama.cpp `Qwen2MoeModel.set_gguf_parameters`)."""
    if (width := hparams.get("moe_intermediate_size")) is not None:
        writer.add_expert_feed_forward_length(width)
    if (shared := hparams.get("shared_expert_intermediate_size")) is not None:
        writer.add_expert_shared_feed_forward_length(shared)


class RoutedExperts:
    """Turns a checkpoint's expert tensors into the GGUF's, checking their shapes (and the routers') against the
    config: `take` each tensor (None: not an expert tensor), `check_complete` once all are read."""

    def __init__(self, where: Path, *, n_expert: int, n_embd: int, n_ff: int, fuse_gate_up: bool = False):
        self.where = where
        self.n_expert, self.n_embd, self.n_ff = n_expert, n_embd, n_ff
        self.fuse_gate_up = fuse_gate_up
        # per-expert tensors read so far, by layer, until the layer's are all there
        self._pending: dict[int, dict[str, LazyTensor]] = {}
        # llama.cpp's name → the checkpoint's, where they differ (errors name the checkpoint's)
        self._shown: dict[str, str] = {}

    def take(self, data: LazyTensor, name: str, block_count: int, *, stored: str | None = None) -> Named | None:
        """The GGUF tensors (possibly none yet) that HF tensor `name` (llama.cpp's `model.layers.N.…` naming; the
        checkpoint's name is `stored` when it differs) makes, or None when it is no expert tensor (a router is
        checked, then left to the caller to rename)."""
        shown = stored or name
        if _ROUTER_RE.match(name) is not None:
            if data.shape != (self.n_expert, self.n_embd):
                raise ConversionError(f"{self.where}: router {shown!r} has shape {list(data.shape)}, expected "
                                      f"{[self.n_expert, self.n_embd]} (num_experts, hidden_size)")
            return None
        if (m := _FUSED_RE.match(name)) is not None:
            self._check_layer(shown, int(m[1]), block_count)
            return self._fused(data, shown, int(m[1]), m[2])
        if (m := _EXPERT_RE.match(name)) is not None:
            self._check_layer(shown, int(m[1]), block_count)
            if stored is not None:
                self._shown[name] = stored
            return self._one(data, name, int(m[1]), int(m[2]), m[3])
        return None

    def check_complete(self) -> None:
        left = sorted(self._shown.get(n, n) for layer in self._pending.values() for n in layer)
        if left:
            raise ConversionError(f"{self.where}: incomplete experts (each layer needs gate_proj, up_proj and "
                                  f"down_proj of all {self.n_expert} experts); left over: {left[:8]}")

    def _check_layer(self, name: str, bid: int, block_count: int) -> None:
        if bid >= block_count:
            raise ConversionError(f"{self.where}: cannot map tensor {name!r}: layer {bid}, but the checkpoint has "
                                  f"{block_count} blocks")

    def _one(self, data: LazyTensor, name: str, bid: int, xid: int, proj: str) -> Named:
        shown = self._shown.get(name, name)
        if xid >= self.n_expert:
            raise ConversionError(f"{self.where}: tensor {shown!r} names expert {xid}, but num_experts is "
                                  f"{self.n_expert}")
        expected = (self.n_embd, self.n_ff) if proj == "down_proj" else (self.n_ff, self.n_embd)
        if data.shape != expected:
            raise ConversionError(f"{self.where}: tensor {shown!r} has shape {list(data.shape)}, expected "
                                  f"{list(expected)} (hidden_size, moe_intermediate_size)")
        layer = self._pending.setdefault(bid, {})
        layer[name] = data
        if len(layer) < 3 * self.n_expert:
            return []
        del self._pending[bid]
        stacks = {proj: _stacked([layer[f"model.layers.{bid}.mlp.experts.{x}.{proj}.weight"]
                                  for x in range(self.n_expert)]) for proj in _STACKED}
        if self.fuse_gate_up:
            return [(f"blk.{bid}.ffn_down_exps.weight", stacks["down_proj"]),
                    (f"blk.{bid}.{GATE_UP}.weight", _gate_up(stacks["gate_proj"], stacks["up_proj"]))]
        return [(f"blk.{bid}.{gguf_name}.weight", stacks[proj]) for proj, gguf_name in _STACKED.items()]

    def _fused(self, data: LazyTensor, name: str, bid: int, proj: str) -> Named:
        X, E, F = self.n_expert, self.n_embd, self.n_ff
        if proj == "gate_up_proj":
            expected, dims = (X, 2 * F, E), "num_experts, 2 × moe_intermediate_size, hidden_size"
        else:
            expected, dims = (X, E, F), "num_experts, hidden_size, moe_intermediate_size"
        if data.shape != expected:
            raise ConversionError(f"{self.where}: tensor {name!r} has shape {list(data.shape)}, expected "
                                  f"{list(expected)} ({dims})")
        if proj == "down_proj":
            return [(f"blk.{bid}.ffn_down_exps.weight", data)]
        if self.fuse_gate_up:  # already gate then up along the F axis
            return [(f"blk.{bid}.{GATE_UP}.weight", data)]
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


def _gate_up(gate: LazyTensor, up: LazyTensor) -> LazyTensor:
    """[n_expert, F, E] gate and up → one [n_expert, 2F, E] tensor, gate first."""
    X, F, E = gate.shape
    return LazyTensor((X, 2 * F, E), gate.dtype, lambda: np.concatenate([gate.numpy(), up.numpy()], axis=1),
                      what=f"{gate!r} + up", source_dtype=gate.source_dtype)
