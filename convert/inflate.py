"""Cost-realistic targets from small trained ones: `inflate_gguf` widens every FFN of a qwen3 / qwen35 / qwen3moe /
qwen35moe GGUF and appends layers, all with zero output projections, so the new model computes *exactly* the same
function as the small one (its DFlash drafter still fits) at the cost of a ~0.3B-parameter model (MoE: ~0.3B active
per token).

- FFN: `ffn_gate` / `ffn_up` get extra units (random rows), `ffn_down` zero columns for them: the units are
  computed and contribute nothing. MoE targets: every expert (`ffn_{gate,up,down}_exps`, to `n_ff_exp` units) and
  the shared expert (`ffn_{gate,up,down}_shexp`, to `n_ff_shexp`) alike; the experts' count stays (a router over
  more experts would route differently).
- Layers: `extra_layers` copies of the model's layer shapes (Qwen3.5: recurrent or full attention by the
  model's own interval rule) with random weights and zero `attn_output` / `ssm_out` / `ffn_down`: each
  passes its input through unchanged, after computing everything (attention over a growing KV cache, the
  gated delta net's state; MoE: its random router picks each token's experts, so a verify of N rows reads the
  union of their experts as a real MoE's does, and the experts output zero).
- MTP: a Qwen3.5 model's multi-token-prediction block(s) (`nextn_predict_layers`) stay last, after the appended
  layers (renumbered), their FFN widened as every other; the head drafts as it did.
- Hidden width (`n_embd`, optional, a multiple of the model's): the residual stream becomes n_embd / E copies of
  itself, which keeps every RMSNorm exact (convert/embd_width.py): a width-192 model's cost per verified row is
  not a real model's (on ggml's CPU kernels its 1-row step costs more than its 2-row one). The drafter borrows
  the target's embedding and LM head, so it must be widened to the same width: `inflate_gguf` on a DFlash (or
  DFlash2) drafter widens its hidden width (and, if asked, its FFN) alone.
- Types: `f32`, `f16`, `q8_0` (every matrix), or `q4mix`: q4_0 for the appended layers and q8_0 for the
  trained ones (q4_0 would change the trained model's function; zeros stay exactly zero in any type).

    python -m pydflash.convert.inflate tests/data/pairs/qwen3-target-f32.gguf build/qwen3-inflated-q8_0.gguf q8_0
    python -m pydflash.convert.inflate tests/data/pairs/qwen3-target-f32.gguf build/qwen3-768-q8_0.gguf q8_0 \
        --n-embd 768 --n-ff 8192
    python -m pydflash.convert.inflate tests/data/pairs/qwen3-dflash-f32.gguf build/qwen3-dflash-768.gguf q8_0 \
        --n-embd 768

The benchmarks (benchmarks/bench_tree.py) and `pydflash demo` build their cost-realistic pairs with it.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path

import gguf
import numpy as np

from pydflash.errors import ConversionError

from .base import LazyTensor, run_command, write_gguf_file
from .embd_width import EmbdWidth, check_width
from .quantize import _copy_kv

logger = logging.getLogger("pydflash.convert")

T = gguf.GGMLQuantizationType
TYPES = ("f32", "f16", "q8_0", "q4mix")
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# a layer's output projections: zero in the appended layers, so that each adds nothing to the residual
_OUTPUT_PROJECTIONS = ("attn_output.weight", "ssm_out.weight", "ffn_down.weight", "ffn_down_exps.weight",
                       "ffn_down_shexp.weight")
# the widened tensors: (the width they take, the numpy axis of its units, whether the new units are inputs
# (random) or outputs (zero)); numpy order: dense [F, E] / [E, F], experts [X, F, E] / [X, E, F]
_WIDENED = {
    "ffn_gate.weight": ("ffn", 0, "in"), "ffn_up.weight": ("ffn", 0, "in"), "ffn_down.weight": ("ffn", 1, "out"),
    "ffn_gate_exps.weight": ("exp", 1, "in"), "ffn_up_exps.weight": ("exp", 1, "in"),
    "ffn_down_exps.weight": ("exp", 2, "out"),
    "ffn_gate_shexp.weight": ("shexp", 0, "in"), "ffn_up_shexp.weight": ("shexp", 0, "in"),
    "ffn_down_shexp.weight": ("shexp", 1, "out"),
}
# the keys of those widths (a file has those of its FFNs)
_WIDTH_KEYS = {"ffn": "feed_forward_length", "exp": "expert_feed_forward_length",
               "shexp": "expert_shared_feed_forward_length"}
ARCHS = ("qwen3", "qwen35", "qwen3moe", "qwen35moe")
DRAFTER_ARCH = "dflash"


def _source_array(t: gguf.ReaderTensor) -> np.ndarray:
    """The tensor as float32 in numpy order (ggml order reversed)."""
    cur = T(t.tensor_type)
    if cur == T.F32:
        data = np.asarray(t.data, dtype=np.float32)
    elif cur in (T.F16,):
        data = np.asarray(t.data).astype(np.float32)
    elif cur in (T.BF16, T.Q8_0):  # (q8_0 requantizes to the same blocks: each block's largest value sets its scale)
        data = gguf.quants.dequantize(np.asarray(t.data), cur)
    else:
        raise ConversionError(f"{t.name}: inflation needs an f32/f16/bf16/q8_0 source, got {cur.name}")
    return data.reshape(tuple(int(n) for n in reversed(t.shape)))


def _matrix_type(qtype: str, trained: bool) -> T:
    if qtype == "q4mix":
        return T.Q8_0 if trained else T.Q4_0
    return {"f32": T.F32, "f16": T.F16, "q8_0": T.Q8_0}[qtype]


def inflate_gguf(infile: str | Path, outfile: str | Path, qtype: str = "q8_0", *, n_ff: int | None = None,
                 n_ff_exp: int = 8192, n_ff_shexp: int = 8192, extra_layers: int | None = None,
                 n_embd: int | None = None, seed: int = 0, progress: bool = True) -> Path:
    """Write `outfile`: `infile` (an f32/f16/bf16/q8_0 qwen3, qwen35, qwen3moe or qwen35moe GGUF, or a DFlash
    drafter) with dense FFNs of `n_ff` units (MoE: experts of `n_ff_exp`, shared experts of `n_ff_shexp`),
    `extra_layers` appended layers, every new unit and layer with zero output projections, and a hidden width
    of `n_embd`; see the module text. Defaults: targets n_ff 32768 and 12 appended layers, drafters their own FFN
    width and none (a drafter takes none); the hidden width stays unless given."""
    infile, outfile = Path(infile), Path(outfile)
    if qtype not in TYPES:
        raise ConversionError(f"unknown type {qtype!r}; choose one of {', '.join(TYPES)}")
    try:
        from pydflash import _core
    except ImportError as e:
        raise ConversionError(f"inflation needs the compiled core (pydflash._core): {e}") from e
    source = _Source(infile)
    n_layer = source.n_layer
    drafter = source.arch == DRAFTER_ARCH
    if extra_layers is None:
        extra_layers = 0 if drafter else 12
    if drafter and extra_layers:
        raise ConversionError(f"{infile}: a DFlash drafter takes no appended layers (extra_layers = {extra_layers})")
    if n_ff is None:
        n_ff = source.widths["ffn"] if drafter else 32768
    embd = source.embd_width(n_embd if n_embd is not None else source.n_embd, qtype)
    widths = {k: w for k, w in (("ffn", n_ff), ("exp", n_ff_exp), ("shexp", n_ff_shexp)) if k in source.widths}
    for k, w in widths.items():
        if w < source.widths[k]:
            arg = {"ffn": "n_ff", "exp": "n_ff_exp", "shexp": "n_ff_shexp"}[k]
            raise ConversionError(f"{arg} = {w} is smaller than the model's {source.widths[k]} ({_WIDTH_KEYS[k]})")
    recurrent = source.recurrent_layers(n_layer + extra_layers)
    if recurrent is not None:
        recurrent += [False] * source.n_mtp  # (MTP blocks are full attention)
    writer = _start_writer(source, n_layer + extra_layers + source.n_mtp, widths, recurrent, qtype, embd)
    out = _Inflation(writer, qtype, seed, widths, source.widths, embd, _core)
    # the MTP blocks follow the appended layers
    out.add_trained(source.tensors, lambda il: il + extra_layers if il >= n_layer else il)
    out.add_appended(source.tensors, n_layer, extra_layers, recurrent)
    if not drafter and embd.new != embd.old and "output.weight" not in source.tensors:
        out.add_lm_head(source.tensors["token_embd.weight"])  # (a tied head would read every copy of the stream)
    outfile.parent.mkdir(parents=True, exist_ok=True)
    write_gguf_file(writer, outfile, progress=progress)
    logger.info("wrote %s (%s: %d + %d layers, FFN widths %s, hidden width %d)", outfile, qtype, n_layer,
                extra_layers, widths, embd.new)
    return outfile


class _Source:
    """The GGUF being inflated: its architecture, sizes and tensors, checked."""

    def __init__(self, path: Path):
        self.path, self.reader = path, gguf.GGUFReader(path)
        self.arch = self.reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
        if self.arch not in ARCHS + (DRAFTER_ARCH,):
            raise ConversionError(f"{path}: general.architecture = {self.arch!r}, expected one of "
                                  f"{', '.join(ARCHS + (DRAFTER_ARCH,))}")
        self.n_embd = int(self.key("embedding_length") or 0)
        self.n_mtp = int(self.key("nextn_predict_layers") or 0)
        self.n_layer = int(self.key("block_count")) - self.n_mtp  # the trunk's
        self.tensors = {t.name: t for t in self.reader.tensors}
        if "blk.0.ffn_gate_up_exps.weight" in self.tensors:
            raise ConversionError(f"{path}: merged ffn_gate_up_exps are not inflated (convert without "
                                  "--fuse-gate-up-exps)")
        # the FFN widths the file's tensors have (the key when present, as the engine reads it)
        suffixes = {_LAYER_RE.match(n)[2] for n in self.tensors if _LAYER_RE.match(n)}
        self.widths = {k: int(self.key(_WIDTH_KEYS[k]) or 0) for k in _WIDTH_KEYS
                       if any(s in suffixes for s, (w, _, _) in _WIDENED.items() if w == k)}
        for k, w in self.widths.items():
            if w == 0:
                raise ConversionError(f"{path}: key '{self.arch}.{_WIDTH_KEYS[k]}' is missing (its FFN is inflated)")

    def key(self, name: str):
        f = self.reader.fields.get(f"{self.arch}.{name}")
        return f.contents() if f is not None else None

    def embd_width(self, n_embd: int, qtype: str) -> EmbdWidth:
        """The widening of the hidden width to `n_embd`, checked."""
        conv = None
        kernel, group = self.key("conv_kernel_size"), self.key("conv_group_size")
        if kernel is not None and group is not None:
            conv = (int(kernel), int(group))
        if n_embd != self.n_embd:
            check_width(self.n_embd, n_embd, qtype)
        return EmbdWidth(self.n_embd, n_embd, streams=len(self.key("target_layers") or [0]), conv=conv)

    def recurrent_layers(self, n_layer: int) -> list[bool] | None:
        """Which of `n_layer` layers are recurrent (qwen35, qwen35moe; None for qwen3, qwen3moe): the model's own
        interval rule, which its recurrent_layers key (if any) must follow."""
        if self.arch not in ("qwen35", "qwen35moe"):
            return None
        interval = int(self.key("full_attention_interval") or 4)
        recurrent = [(il + 1) % interval != 0 for il in range(n_layer)]
        given = self.key("attention.recurrent_layers")
        if given is not None and [bool(x) for x in given][:self.n_layer] != recurrent[:self.n_layer]:
            raise ConversionError(f"{self.path}: attention.recurrent_layers does not follow full_attention_interval")
        return recurrent


def _start_writer(source: _Source, n_layer: int, widths: dict[str, int], recurrent: list[bool] | None,
                  qtype: str, embd: EmbdWidth) -> gguf.GGUFWriter:
    """A writer with the source's keys, and the new layer count, FFN widths, hidden width, layer kinds and file
    type."""
    arch = source.arch
    writer = gguf.GGUFWriter(path=None, arch=arch)
    _copy_kv(source.reader, writer, source.path,
             also_skip=frozenset({f"{arch}.block_count", f"{arch}.attention.recurrent_layers",
                                  f"{arch}.embedding_length"} |
                                 {f"{arch}.{_WIDTH_KEYS[k]}" for k in widths}))
    writer.add_uint32(f"{arch}.block_count", n_layer)
    writer.add_uint32(f"{arch}.embedding_length", embd.new)
    for k, w in widths.items():
        writer.add_uint32(f"{arch}.{_WIDTH_KEYS[k]}", w)
    if recurrent is not None and source.key("attention.recurrent_layers") is not None:
        writer.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4mix": gguf.LlamaFileType.MOSTLY_Q4_0}[qtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return writer


class _Inflation:
    """The inflated model's tensors, added to `writer` in order; each new random tensor draws from its own
    stream (seed, salt), the salt counting every tensor added."""

    def __init__(self, writer: gguf.GGUFWriter, qtype: str, seed: int, widths: dict[str, int],
                 old_widths: dict[str, int], embd: EmbdWidth, core):
        self.writer, self.qtype, self.seed, self.widths, self.old_widths, self.embd, self.core = \
            writer, qtype, seed, widths, old_widths, embd, core
        self.salt = 0

    def add(self, name: str, make, shape: tuple[int, ...], trained: bool) -> None:
        """Add `name` (numpy shape `shape`, float32 from make()) in the type its role and the qtype give."""
        # matrices and stacked experts (not vectors stored as [1, n]: the shared expert's gate)
        is_matrix = (len(shape) in (2, 3) and min(shape) > 1 and "ssm_conv1d" not in name
                     and not name.endswith(("norm.weight", "_conv_base")))
        new = _matrix_type(self.qtype, trained) if is_matrix else T.F32
        if new == T.F32:
            self.writer.add_tensor(name, LazyTensor(shape, np.float32, make, what=name), raw_dtype=T.F32)
        elif new == T.F16:
            self.writer.add_tensor(name, LazyTensor(shape, np.float16, lambda: make().astype(np.float16),
                                                    what=name), raw_dtype=T.F16)
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(shape, new)
            quantized = lambda: np.asarray(self.core.quantize(make().reshape(-1, shape[-1]),  # noqa: E731
                                                              int(new))).reshape(byte_shape)
            self.writer.add_tensor(name, LazyTensor(byte_shape, np.uint8, quantized, what=name), raw_dtype=new)

    def random_like(self, src: np.ndarray, shape: tuple[int, ...]):
        """make() for a random tensor of `shape` at the scale of `src` (the next salt's stream)."""
        scale, seed, salt = float(src.std()) or 0.02, self.seed, self.salt
        return lambda: np.random.default_rng([seed, salt]).standard_normal(shape, dtype=np.float32) * scale

    def widened_shape(self, suffix: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of a tensor `suffix` of this shape once its FFN has the new width (others: as it is)."""
        if suffix not in _WIDENED:
            return shape
        width, axis, _ = _WIDENED[suffix]
        return shape[:axis] + (self.widths[width],) + shape[axis + 1:]

    def add_trained(self, tensors: dict[str, gguf.ReaderTensor], block_of=lambda il: il) -> None:
        """The source's tensors: FFNs widened (new input units random, new output columns zero), everything else as
        it is; layer il's as layer block_of(il)."""
        for name, t in tensors.items():
            m = _LAYER_RE.match(name)
            suffix = m[2] if m else name
            src = self.embd.widen(name, suffix, _source_array(t))
            name = f"blk.{block_of(int(m[1]))}.{suffix}" if m else name
            self.salt += 1
            if suffix not in _WIDENED:
                self.add(name, lambda src=src: src, src.shape, True)
                continue
            _, axis, role = _WIDENED[suffix]
            shape = self.widened_shape(suffix, src.shape)
            extra_shape = shape[:axis] + (shape[axis] - src.shape[axis],) + shape[axis + 1:]
            extra = (self.random_like(src, extra_shape) if role == "in"
                     else lambda extra_shape=extra_shape: np.zeros(extra_shape, np.float32))
            self.add(name, lambda src=src, extra=extra, axis=axis: np.concatenate([src, extra()], axis=axis), shape,
                     True)

    def add_lm_head(self, embedding: gguf.ReaderTensor) -> None:
        """`output.weight` for a target whose LM head was its embedding."""
        head = self.embd.lm_head(_source_array(embedding))
        self.add("output.weight", lambda: head, head.shape, True)

    def add_appended(self, tensors: dict[str, gguf.ReaderTensor], n_layer: int, extra_layers: int,
                     recurrent: list[bool] | None) -> None:
        """The appended layers: the shapes of the first trained layer of the same kind, random inputs, zero
        outputs."""
        first = {False: 0, True: 0}  # the first trained layer of each kind (recurrent or not)
        if recurrent is not None:
            first = {r: next(il for il in range(n_layer) if recurrent[il] == r) for r in (False, True)}
        for il in range(n_layer, n_layer + extra_layers):
            prefix = f"blk.{first[recurrent[il]] if recurrent is not None else 0}."
            for name, t in tensors.items():
                if name.startswith(prefix):
                    suffix = name[len(prefix):]
                    self._add_appended_tensor(f"blk.{il}.", suffix, self.embd.widen(name, suffix, _source_array(t)))

    def _add_appended_tensor(self, prefix: str, suffix: str, src: np.ndarray) -> None:
        shape = self.widened_shape(suffix, src.shape)
        self.salt += 1
        if suffix in _OUTPUT_PROJECTIONS:
            self.add(prefix + suffix, lambda: np.zeros(shape, np.float32), shape, False)
        elif len(shape) == 1 or suffix.endswith("norm.weight") or "ssm_conv1d" in suffix:
            self.add(prefix + suffix, lambda: src, shape, False)  # norms, gates' biases, decay rates, conv
        else:
            self.add(prefix + suffix, self.random_like(src, shape), shape, False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pydflash.convert.inflate",
                                description="Widen a small qwen3/qwen35/qwen3moe/qwen35moe GGUF (or its DFlash "
                                            "drafter) to a larger model's cost, same function")
    p.add_argument("infile", type=Path, help="input GGUF (f32, f16, bf16 or q8_0)")
    p.add_argument("outfile", type=Path)
    p.add_argument("type", choices=TYPES)
    p.add_argument("--n-ff", type=int, help="FFN units per layer (default: 32768 for a target, a drafter's own)")
    p.add_argument("--n-ff-exp", type=int, default=8192, help="units per expert (MoE; default 8192)")
    p.add_argument("--n-ff-shexp", type=int, default=8192, help="units of the shared expert (qwen35moe; default 8192)")
    p.add_argument("--extra-layers", type=int, help="appended pass-through layers (default: 12 for a target, "
                                                        "none for a drafter)")
    p.add_argument("--n-embd", type=int, help="hidden width (default: the model's; a drafter's must be its "
                                              "inflated target's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    return run_command("inflate", lambda: inflate_gguf(args.infile, args.outfile, args.type, n_ff=args.n_ff,
                                                       n_ff_exp=args.n_ff_exp, n_ff_shexp=args.n_ff_shexp,
                                                       extra_layers=args.extra_layers, n_embd=args.n_embd,
                                                       seed=args.seed))


if __name__ == "__main__":
    sys.exit(main())
