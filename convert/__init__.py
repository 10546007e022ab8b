"""Hugging Face → GGUF conversion and GGUF quantization (installed as `pydflash.convert`).

    from pydflash.convert import convert_hf_to_gguf, quantize_gguf
    convert_hf_to_gguf("Qwen3-0.6B", "qwen3-0.6b-f16.gguf", outtype="f16")
    quantize_gguf("qwen3-0.6b-f16.gguf", "qwen3-0.6b-q4_k_m.gguf", "q4_k_m")

The files match llama.cpp's `convert_hf_to_gguf.py` / `llama-quantize` key for key. Command lines:
`pydflash-convert` (`cli.main`) and `pydflash-quantize` (`quantize.main`).
Conversion needs numpy, gguf and tqdm only (no torch / transformers); quantization needs the
compiled core (`pydflash._core`).
"""

from __future__ import annotations

from pathlib import Path

from .base import (
    LazyTensor,
    ModelConverter,
    OUTTYPES,
    converter_class,
    hf_architecture,
    index_safetensors,
    load_hparams,
    register,
    supported_architectures,
)
from .vocab import GPT2Vocab, detect_pre_tokenizer, load_gpt2_vocab
from .quantize import QUANT_TYPES, quantize_gguf

# converter modules register their HF architectures on import
from . import qwen3  # noqa: F401  (Qwen3ForCausalLM)
from . import qwen35  # noqa: F401  (Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration)
from . import qwen3moe  # noqa: F401  (Qwen3MoeForCausalLM)
from . import qwen35moe  # noqa: F401  (Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration)
from . import dflash  # noqa: F401  (DFlashDraftModel)

__all__ = [
    "convert_hf_to_gguf",
    "quantize_gguf",
    "QUANT_TYPES",
    "OUTTYPES",
    "ModelConverter",
    "LazyTensor",
    "register",
    "converter_class",
    "hf_architecture",
    "supported_architectures",
    "load_hparams",
    "index_safetensors",
    "GPT2Vocab",
    "load_gpt2_vocab",
    "detect_pre_tokenizer",
]


def convert_hf_to_gguf(model_dir: str | Path, outfile: str | Path | None = None, *, outtype: str = "auto",
                       vocab_only: bool = False, dry_run: bool = False, model_name: str | None = None,
                       target_model_dir: str | Path | None = None, fuse_gate_up_exps: bool = False,
                       progress: bool = True, no_mtp: bool = False) -> Path:
    """Convert the HF checkpoint folder `model_dir` to GGUF; returns the written path.

    `outtype`: f32 | f16 | bf16 | q8_0 | auto (bf16/f16 after the checkpoint's dtype). `outfile`
    may be a folder or contain `{ftype}`; None writes into `model_dir` with llama.cpp's default name.
    `target_model_dir` is required for DFlash drafts (the target's folder: tokenizer, hidden size,
    layer count). `fuse_gate_up_exps` writes a MoE layer's gate and up experts as one `ffn_gate_up_exps` tensor
    (llama.cpp's `--fuse-gate-up-exps`; qwen35moe only, as in llama.cpp). `no_mtp` leaves a Qwen3.5 checkpoint's
    multi-token-prediction blocks out (llama.cpp's `--no-nextn` / `--no-mtp`).
    Raises `pydflash.errors.ConversionError` for anything it cannot convert.
    """
    hparams = load_hparams(Path(model_dir))
    cls = converter_class(hf_architecture(hparams, Path(model_dir) / "config.json"))
    conv = cls(model_dir, outtype=outtype, model_name=model_name, target_model_dir=target_model_dir, hparams=hparams,
               fuse_gate_up_exps=fuse_gate_up_exps, no_mtp=no_mtp)
    return conv.write(outfile, vocab_only=vocab_only, dry_run=dry_run, progress=progress)
