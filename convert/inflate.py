"""Cost-realistic targets from small trained ones: `inflate_gguf` widens every FFN of a qwen3 / qwen35 GGUF and
appends layers, all with zero output projections, so the new model computes *exactly* the same function as the
small one (its DFlash drafter still fits) at the cost of a ~0.3B-parameter model.

- FFN: `ffn_gate` / `ffn_up` get extra units (random rows), `ffn_down` zero columns for them: the units are
  computed and contribute nothing.
- Layers: `extra_layers` copies of the model's layer shapes (Qwen3.5: recurrent or full attention by the
  model's own interval rule) with random weights and zero `attn_output` / `ssm_out` / `ffn_down`: each
  passes its input through unchanged, after computing everything (attention over a growing KV cache, the
  gated delta net's state).
- Types: `f32`, `f16`, `q8_0` (every matrix), or `q4mix`: q4_0 for the appended layers and q8_0 for the
  trained ones (q4_0 would change the trained model's function; zeros stay exactly zero in any type).

    python -m pydflash.convert.inflate tests/data/pairs/qwen3-target-f32.gguf build/qwen3-inflated-q8_0.gguf q8_0

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
from .quantize import _copy_kv

logger = logging.getLogger("pydflash.convert")

T = gguf.GGMLQuantizationType
TYPES = ("f32", "f16", "q8_0", "q4mix")
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# a layer's output projections: zero in the appended layers, so that each adds nothing to the residual
_OUTPUT_PROJECTIONS = ("attn_output.weight", "ssm_out.weight", "ffn_down.weight")


def _source_array(t: gguf.ReaderTensor) -> np.ndarray:
    """The tensor as float32 in numpy order (ggml order reversed)."""
    cur = T(t.tensor_type)
    if cur == T.F32:
        data = np.asarray(t.data, dtype=np.float32)
    elif cur in (T.F16,):
        data = np.asarray(t.data).astype(np.float32)
    elif cur == T.BF16:
        data = gguf.quants.dequantize(np.asarray(t.data), cur)
    else:
        raise ConversionError(f"{t.name}: inflation needs an f32/f16/bf16 source, got {cur.name}")
    return data.reshape(tuple(int(n) for n in reversed(t.shape)))


def _matrix_type(qtype: str, trained: bool) -> T:
    if qtype == "q4mix":
        return T.Q8_0 if trained else T.Q4_0
    return {"f32": T.F32, "f16": T.F16, "q8_0": T.Q8_0}[qtype]


def inflate_gguf(infile: str | Path, outfile: str | Path, qtype: str = "q8_0", *, n_ff: int = 32768,
                 extra_layers: int = 12, seed: int = 0, progress: bool = True) -> Path:
    """Write `outfile`: `infile` (an f32/f16/bf16 qwen3 or qwen35 GGUF) with FFNs of `n_ff` units and
    `extra_layers` appended layers, every new unit and layer with zero output projections; see the module text."""
    infile, outfile = Path(infile), Path(outfile)
    if qtype not in TYPES:
        raise ConversionError(f"unknown type {qtype!r}; choose one of {', '.join(TYPES)}")
    try:
        from pydflash import _core
    except ImportError as e:
        raise ConversionError(f"inflation needs the compiled core (pydflash._core): {e}") from e
    source = _Source(infile)
    n_layer = source.n_layer
    if n_ff < source.n_ff:
        raise ConversionError(f"n_ff = {n_ff} is smaller than the model's {source.n_ff}")
    recurrent = source.recurrent_layers(n_layer + extra_layers)
    writer = _start_writer(source, n_layer + extra_layers, n_ff, recurrent, qtype)
    out = _Inflation(writer, qtype, seed, n_ff, source.n_ff, _core)
    out.add_trained(source.tensors)
    out.add_appended(source.tensors, n_layer, extra_layers, recurrent)
    outfile.parent.mkdir(parents=True, exist_ok=True)
    write_gguf_file(writer, outfile, progress=progress)
    logger.info("wrote %s (%s: %d + %d layers, FFN %d)", outfile, qtype, n_layer, extra_layers, n_ff)
    return outfile


class _Source:
    """The GGUF being inflated: its architecture, sizes and tensors, checked."""

    def __init__(self, path: Path):
        self.path, self.reader = path, gguf.GGUFReader(path)
        self.arch = self.reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
        if self.arch not in ("qwen3", "qwen35"):
            raise ConversionError(f"{path}: general.architecture = {self.arch!r}, expected qwen3 or qwen35")
        self.n_layer, self.n_ff = int(self.key("block_count")), int(self.key("feed_forward_length"))
        if self.key("nextn_predict_layers"):
            raise ConversionError(f"{path}: MTP layers are not inflated (nextn_predict_layers > 0)")
        self.tensors = {t.name: t for t in self.reader.tensors}

    def key(self, name: str):
        f = self.reader.fields.get(f"{self.arch}.{name}")
        return f.contents() if f is not None else None

    def recurrent_layers(self, n_layer: int) -> list[bool] | None:
        """Which of `n_layer` layers are recurrent (qwen35; None for qwen3): the model's own interval rule, which
        its recurrent_layers key (if any) must follow."""
        if self.arch != "qwen35":
            return None
        interval = int(self.key("full_attention_interval") or 4)
        recurrent = [(il + 1) % interval != 0 for il in range(n_layer)]
        given = self.key("attention.recurrent_layers")
        if given is not None and [bool(x) for x in given][:self.n_layer] != recurrent[:self.n_layer]:
            raise ConversionError(f"{self.path}: attention.recurrent_layers does not follow full_attention_interval")
        return recurrent


def _start_writer(source: _Source, n_layer: int, n_ff: int, recurrent: list[bool] | None,
                  qtype: str) -> gguf.GGUFWriter:
    """A writer with the source's keys, and the new layer count, FFN width, layer kinds and file type."""
    arch = source.arch
    writer = gguf.GGUFWriter(path=None, arch=arch)
    _copy_kv(source.reader, writer, source.path,
             also_skip=frozenset({f"{arch}.block_count", f"{arch}.feed_forward_length",
                                  f"{arch}.attention.recurrent_layers"}))
    writer.add_uint32(f"{arch}.block_count", n_layer)
    writer.add_uint32(f"{arch}.feed_forward_length", n_ff)
    if recurrent is not None and source.key("attention.recurrent_layers") is not None:
        writer.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4mix": gguf.LlamaFileType.MOSTLY_Q4_0}[qtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return writer


class _Inflation:
    """The inflated model's tensors, added to `writer` in order; each new random tensor draws from its own
    stream (seed, salt), the salt counting every tensor added."""

    def __init__(self, writer: gguf.GGUFWriter, qtype: str, seed: int, n_ff: int, n_ff_old: int, core):
        self.writer, self.qtype, self.seed, self.n_ff, self.n_ff_old, self.core = \
            writer, qtype, seed, n_ff, n_ff_old, core
        self.salt = 0

    def add(self, name: str, make, shape: tuple[int, ...], trained: bool) -> None:
        """Add `name` (numpy shape `shape`, float32 from make()) in the type its role and the qtype give."""
        is_matrix = len(shape) == 2 and "ssm_conv1d" not in name and not name.endswith("norm.weight")
        new = _matrix_type(self.qtype, trained) if is_matrix else T.F32
        if new == T.F32:
            self.writer.add_tensor(name, LazyTensor(shape, np.float32, make, what=name), raw_dtype=T.F32)
        elif new == T.F16:
            self.writer.add_tensor(name, LazyTensor(shape, np.float16, lambda: make().astype(np.float16),
                                                    what=name), raw_dtype=T.F16)
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(shape, new)
            quantized = lambda: np.asarray(self.core.quantize(make(), int(new))).reshape(byte_shape)  # noqa: E731
            self.writer.add_tensor(name, LazyTensor(byte_shape, np.uint8, quantized, what=name), raw_dtype=new)

    def random_like(self, src: np.ndarray, shape: tuple[int, ...]):
        """make() for a random tensor of `shape` at the scale of `src` (the next salt's stream)."""
        scale, seed, salt = float(src.std()) or 0.02, self.seed, self.salt
        return lambda: np.random.default_rng([seed, salt]).standard_normal(shape, dtype=np.float32) * scale

    def add_trained(self, tensors: dict[str, gguf.ReaderTensor]) -> None:
        """The source's tensors: FFNs widened, everything else as it is."""
        n_ff, extra_units = self.n_ff, self.n_ff - self.n_ff_old
        for name, t in tensors.items():
            src = _source_array(t)
            m = _LAYER_RE.match(name)
            suffix = m[2] if m else ""
            self.salt += 1
            if suffix in ("ffn_gate.weight", "ffn_up.weight"):  # numpy [n_ff, E]: extra random rows
                extra = self.random_like(src, (extra_units, src.shape[1]))
                self.add(name, lambda src=src, extra=extra: np.concatenate([src, extra()]), (n_ff, src.shape[1]),
                         True)
            elif suffix == "ffn_down.weight":  # numpy [E, n_ff]: zero columns
                self.add(name, lambda src=src: np.concatenate([src, np.zeros((src.shape[0], extra_units),
                                                                             np.float32)], axis=1),
                         (src.shape[0], n_ff), True)
            else:
                self.add(name, lambda src=src: src, src.shape, True)

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
                    self._add_appended_tensor(f"blk.{il}.", name[len(prefix):], _source_array(t))

    def _add_appended_tensor(self, prefix: str, suffix: str, src: np.ndarray) -> None:
        shape = src.shape
        if suffix in ("ffn_gate.weight", "ffn_up.weight"):
            shape = (self.n_ff, src.shape[1])
        elif suffix == "ffn_down.weight":
            shape = (src.shape[0], self.n_ff)
        self.salt += 1
        if suffix in _OUTPUT_PROJECTIONS:
            self.add(prefix + suffix, lambda: np.zeros(shape, np.float32), shape, False)
        elif len(shape) == 1 or suffix.endswith("norm.weight") or "ssm_conv1d" in suffix:
            self.add(prefix + suffix, lambda: src, shape, False)  # norms, gates' biases, decay rates, conv
        else:
            self.add(prefix + suffix, self.random_like(src, shape), shape, False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pydflash.convert.inflate",
                                description="Widen a small qwen3/qwen35 GGUF to a larger model's cost, same function")
    p.add_argument("infile", type=Path, help="input GGUF (f32, f16 or bf16)")
    p.add_argument("outfile", type=Path)
    p.add_argument("type", choices=TYPES)
    p.add_argument("--n-ff", type=int, default=32768, help="FFN units per layer (default 32768)")
    p.add_argument("--extra-layers", type=int, default=12, help="appended pass-through layers (default 12)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    return run_command("inflate", lambda: inflate_gguf(args.infile, args.outfile, args.type, n_ff=args.n_ff,
                                                       extra_layers=args.extra_layers, seed=args.seed))


if __name__ == "__main__":
    sys.exit(main())
