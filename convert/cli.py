"""`pydflash-convert HF_DIR --outfile OUT.gguf --outtype f32|f16|bf16|q8_0|auto [--target-model-dir TARGET]`

The flags mirror llama.cpp's `convert_hf_to_gguf.py` (`--outfile`, `--outtype`, `--vocab-only`,
`--dry-run`, `--model-name`, `--target-model-dir`, `--fuse-gate-up-exps`, `--no-nextn` / `--no-mtp`,
`--no-progress`, `--verbose`, `--print-supported-models`). Not supported: `--mtp`, `--metadata`,
`--split-max-tensors`, `--split-max-size`, `--bigendian`, `--use-temp-file`, `--no-lazy`, `--remote`, `--mmproj`
(docs/converting.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .base import run_command


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pydflash-convert",
                                description="Convert a Hugging Face checkpoint to a llama.cpp-compatible GGUF file")
    p.add_argument("model", type=Path, nargs="?",
                   help="Hugging Face model folder (config.json, tokenizer.json, *.safetensors)")
    # a str, not a Path: Path() would drop the trailing separator that marks a folder
    p.add_argument("--outfile", default=None,
                   help="output path; a folder gets llama.cpp's default name; '{ftype}' is replaced by the outtype")
    p.add_argument("--outtype", choices=["f32", "f16", "bf16", "q8_0", "auto"], default="auto",
                   help="tensor type for weight matrices (norms and 1-D tensors stay f32); auto: bf16 or f16 as stored")
    p.add_argument("--vocab-only", action="store_true", help="write only the metadata and tokenizer")
    p.add_argument("--dry-run", action="store_true", help="print the tensor plan without writing a file")
    p.add_argument("--model-name", default=None, help="general.name (default: from the model card or folder name)")
    p.add_argument("--target-model-dir", type=Path, default=None,
                   help="target model folder; required for DFlash and DFlash2 drafts (DFlashDraftModel, "
                        "DFlash2DraftModel), which borrow the target's tokenizer, embedding and LM head")
    p.add_argument("--fuse-gate-up-exps", action="store_true",
                   help="write each MoE layer's gate and up experts as one ffn_gate_up_exps tensor (qwen35moe)")
    p.add_argument("--no-nextn", "--no-mtp", dest="no_mtp", action="store_true",
                   help="leave the multi-token-prediction (MTP / NextN) blocks out of the GGUF (qwen35, qwen35moe)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="log every tensor")
    p.add_argument("--print-supported-models", action="store_true", help="list the supported HF architectures")
    return p


def main(argv: list[str] | None = None) -> int:
    from . import convert_hf_to_gguf, supported_architectures

    args = build_parser().parse_args(argv)
    if args.print_supported_models:
        print("\n".join(supported_architectures()))
        return 0
    if args.model is None:
        build_parser().error("the following arguments are required: model")

    def convert() -> Path | None:
        out = convert_hf_to_gguf(args.model, args.outfile, outtype=args.outtype, vocab_only=args.vocab_only,
                                 dry_run=args.dry_run, model_name=args.model_name,
                                 target_model_dir=args.target_model_dir,
                                 fuse_gate_up_exps=args.fuse_gate_up_exps, progress=not args.no_progress,
                                 no_mtp=args.no_mtp)
        return None if args.dry_run else out

    return run_command("pydflash-convert", convert, verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
