"""The hidden width (`embedding_length`, E) of an inflated model: the residual stream becomes m = E' / E copies
of itself, so that the model computes the same function at the cost of a model of width E' (a width-192
model's cost per verified row is not a real model's: on ggml's CPU kernels its 1-row step costs more than its
2-row one; docs/benchmarks.md). Whole copies keep every RMSNorm over the stream exact with the same eps and no
rescaling: the mean of the squares of m copies is the mean of one (a stream padded with zeros instead would
change every norm's divisor, which a rescaled eps can undo only for the norms over the stream, not for the
per-head ones that share it: the gated delta net's output norm is sensitive to it).

- Reading tensors (numpy's last axis, ggml's ne0, is the stream; `fc` and `nextn.eh_proj` read several
  streams side by side): they read the first copy; zero columns for the others.
- Writing tensors (numpy's axis -2: ggml's ne1): their rows repeated m times, so that every copy gets the
  same update.
- The embedding, the RMSNorms' weights over the stream, DFlash2's per-channel convolution bases: repeated.
- DFlash2's coefficient projection writes one coefficient per group of channels for each side and tap: its
  rows repeated per copy (and it reads the first copy).
- A tied LM head (no `output.weight`) would read every copy of the repeated embedding: the inflated target
  gets its own `output.weight`, which reads the first.
"""


from __future__ import annotations

import numpy as np

from pydflash.errors import ConversionError

# tensor suffixes (after "blk.N.", or the whole name) by what they do to the stream
NORMS = frozenset({"attn_norm.weight", "ffn_norm.weight", "post_attention_norm.weight", "output_norm.weight",
                   "enc.output_norm.weight", "nextn.enorm.weight", "nextn.hnorm.weight",
                   "nextn.shared_head_norm.weight"})
READERS = frozenset({"attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_qkv.weight", "attn_gate.weight",
                     "ssm_alpha.weight", "ssm_beta.weight", "ffn_gate.weight", "ffn_up.weight",
                     "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_gate_inp.weight", "ffn_gate_shexp.weight",
                     "ffn_up_shexp.weight", "ffn_gate_inp_shexp.weight", "output.weight", "selector_hidden.weight",
                     "nextn.shared_head_head.weight", "fc.weight", "nextn.eh_proj.weight",
                     "attn_conv_proj.weight", "ffn_conv_proj.weight"})
WRITERS = frozenset({"attn_output.weight", "ssm_out.weight", "ffn_down.weight", "ffn_down_exps.weight",
                     "ffn_down_shexp.weight", "fc.weight", "nextn.eh_proj.weight"})
EMBEDDINGS = frozenset({"token_embd.weight", "nextn.embed_tokens.weight"})
CONV_BASES = frozenset({"attn_conv_base", "ffn_conv_base"})
CONV_PROJECTIONS = frozenset({"attn_conv_proj.weight", "ffn_conv_proj.weight"})
# tensors with no axis on the stream (head widths, recurrent state, the selector's vocabulary tables)
UNTOUCHED = frozenset({"attn_q_norm.weight", "attn_k_norm.weight", "ssm_a", "ssm_dt.bias", "ssm_conv1d.weight",
                       "ssm_norm.weight", "selector_predecessor.weight", "selector_successor.weight"})


class EmbdWidth:
    """Widens a model's tensors from hidden width `old` to `new` (see the module text); `streams` is how many
    streams `fc` reads (a DFlash drafter's captured target layers), `conv` DFlash2's (kernel, group size)."""

    def __init__(self, old: int, new: int, *, streams: int = 1, conv: tuple[int, int] | None = None):
        self.old, self.new, self.streams, self.conv = old, new, streams, conv

    def widen(self, name: str, suffix: str, a: np.ndarray) -> np.ndarray:
        """Tensor `name` (layer suffix `suffix`; numpy order) at the new width."""
        if self.new == self.old or suffix in UNTOUCHED:
            return a
        if suffix in NORMS or suffix in EMBEDDINGS or suffix in CONV_BASES:  # (conv bases: [2 sides, K taps, E])
            return self._repeat(a, -1, 1, name)
        if suffix not in READERS and suffix not in WRITERS:
            raise ConversionError(f"{name}: inflating the hidden width does not know this tensor's axes")
        if suffix in CONV_PROJECTIONS:
            a = self._widen_groups(a, name)
        if suffix in READERS:
            a = self._first_copy(a, {"fc.weight": self.streams, "nextn.eh_proj.weight": 2}.get(suffix, 1), name)
        if suffix in WRITERS:
            a = self._repeat(a, -2, 1, name)
        return a

    def lm_head(self, embedding: np.ndarray) -> np.ndarray:
        """The `output.weight` of a target whose LM head was its (old) embedding: reads the first copy."""
        return self._first_copy(embedding, 1, "output.weight")

    def _runs(self, a: np.ndarray, axis: int, n_streams: int, name: str) -> tuple[np.ndarray, int]:
        """`a` with `axis` split into (n_streams, old), checked; and that axis's index."""
        axis %= a.ndim
        if a.shape[axis] != n_streams * self.old:
            raise ConversionError(f"{name}: axis {a.ndim - 1 - axis} (ggml order) has {a.shape[axis]} channels, "
                                  f"expected {n_streams} x the hidden width {self.old}")
        return a.reshape(a.shape[:axis] + (n_streams, self.old) + a.shape[axis + 1:]), axis

    def _first_copy(self, a: np.ndarray, n_streams: int, name: str) -> np.ndarray:
        """`a` (stream on its last axis, `n_streams` side by side) reading each stream's first copy."""
        runs, axis = self._runs(a, -1, n_streams, name)
        pad = [(0, 0)] * (runs.ndim - 1) + [(0, self.new - self.old)]
        return np.pad(runs, pad).reshape(a.shape[:axis] + (n_streams * self.new,))

    def _repeat(self, a: np.ndarray, axis: int, n_streams: int, name: str) -> np.ndarray:
        """`a` with each of the `n_streams` runs of channels on `axis` repeated m times."""
        runs, axis = self._runs(a, axis, n_streams, name)
        tiled = np.concatenate([runs] * (self.new // self.old), axis=axis + 1)
        return tiled.reshape(a.shape[:axis] + (n_streams * self.new,) + a.shape[axis + 1:])

    def _widen_groups(self, a: np.ndarray, name: str) -> np.ndarray:
        """A DFlash2 coefficient projection [2 * K * G, E]: its rows (side, tap, group) with the groups repeated
        for every copy of the stream."""
        if self.conv is None:
            raise ConversionError(f"{name}: a DFlash2 convolution, but the file lacks dflash.conv_kernel_size or "
                                  "dflash.conv_group_size")
        kernel, group = self.conv
        if a.shape[0] != 2 * kernel * (self.old // group):
            raise ConversionError(f"{name}: {a.shape[0]} coefficient rows, expected 2 x {kernel} taps x "
                                  f"{self.old // group} groups")
        runs = a.reshape(2 * kernel, self.old // group, a.shape[1])
        return np.concatenate([runs] * (self.new // self.old), axis=1).reshape(-1, a.shape[1])


def check_width(old: int, new: int, qtype: str) -> None:
    """Raise ConversionError unless `new` is a hidden width this model can take."""
    if new < old or new % old:
        raise ConversionError(f"n_embd = {new} is not a multiple of the model's hidden width {old} "
                              "(embedding_length): the stream widens by whole copies")
    if qtype != "f32" and new % 32:
        raise ConversionError(f"n_embd = {new} is not a multiple of 32 (the {qtype} blocks of the matrices that "
                              "read the stream)")
