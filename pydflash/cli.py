"""The `pydflash` command: `pydflash demo`, `pydflash generate MODEL.gguf "prompt" [--draft DRAFT.gguf]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _generate(args: argparse.Namespace) -> int:
    from .model import Model

    with Model(args.model, n_ctx=args.n_ctx, n_threads=args.threads, kv_type=args.kv_type,
               n_gpu_layers=args.n_gpu_layers, draft_model_path=args.draft, block_size=args.block_size,
               spec_mode=args.spec_mode, tree_budget=args.tree_budget, verbose=args.verbose) as model:
        sampling = dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                        typical_p=args.typical, repeat_penalty=args.repeat_penalty,
                        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                        repeat_last_n=args.repeat_last_n, seed=args.seed)
        for piece in model.stream(args.prompt, max_tokens=args.max_tokens, **sampling):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import demo_prompts, run_demo

    if args.n_prompts < 1:
        raise ValueError(f"--n-prompts must be at least 1, got {args.n_prompts}")
    prompts = [args.prompt] if args.prompt else demo_prompts()[: args.n_prompts]
    # the identity of the outputs is printed; it is a demonstration, not a test (tests/test_pairs.py)
    run_demo(prompts, max_tokens=args.max_tokens, n_threads=args.threads, block_size=args.block_size,
             realistic=not args.tiny_only, cache=args.cache_dir)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pydflash", description="DFlash speculative decoding on GGUF models")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generation from a GGUF model (greedy unless --temp > 0)")
    gen.add_argument("model", help="path to a qwen3 / qwen35 GGUF")
    gen.add_argument("prompt")
    gen.add_argument("-n", "--max-tokens", type=int, default=128)
    gen.add_argument("-c", "--n-ctx", type=int, default=4096)
    gen.add_argument("-t", "--threads", type=int, default=None)
    gen.add_argument("--kv-type", default="f16")
    gen.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    gen.add_argument("-md", "--draft", default=None, help="a dflash draft GGUF for speculative decoding")
    gen.add_argument("-b", "--block-size", type=int, default=None)
    gen.add_argument("--spec-mode", choices=("auto", "tree", "chain"), default="auto",
                     help="with a draft: choose per round (auto), DDTree trees, or DFlash chains")
    gen.add_argument("--tree-budget", type=int, default=None, help="draft nodes a tree verifies (tree: per round, "
                                                                    "auto: at most)")
    samp = gen.add_argument_group("sampling (llama.cpp's flags and order; the defaults are llama-cpp-python's)")
    samp.add_argument("--temp", type=float, default=0.0, help="temperature (0: greedy)")
    samp.add_argument("--top-k", type=int, default=40, help="0: off")
    samp.add_argument("--top-p", type=float, default=0.95, help="1: off")
    samp.add_argument("--min-p", type=float, default=0.05, help="0: off")
    samp.add_argument("--typical", type=float, default=1.0, help="typical-p (1: off)")
    samp.add_argument("--repeat-penalty", type=float, default=1.0, help="1: off")
    samp.add_argument("--presence-penalty", type=float, default=0.0)
    samp.add_argument("--frequency-penalty", type=float, default=0.0)
    samp.add_argument("--repeat-last-n", type=int, default=64, help="tokens the penalties look at (-1: all)")
    samp.add_argument("-s", "--seed", type=int, default=None, help="a seed makes sampling reproducible")
    gen.add_argument("-v", "--verbose", action="store_true")
    gen.set_defaults(func=_generate)
    demo = sub.add_parser("demo", help="speculative vs plain decoding on the embedded trained pair (no download)")
    demo.add_argument("prompt", nargs="?", default=None, help="a prompt (default: held-out code prompts)")
    demo.add_argument("-n", "--max-tokens", type=int, default=128)
    demo.add_argument("-p", "--n-prompts", type=int, default=8, help="how many embedded prompts to run")
    demo.add_argument("-b", "--block-size", type=int, default=None)
    demo.add_argument("-t", "--threads", type=int, default=None)
    demo.add_argument("--tiny-only", action="store_true", help="skip the cost-realistic copy of the pair")
    demo.add_argument("--cache-dir", type=Path, default=None,
                      help="where the cost-realistic target is built (default: ~/.cache/pydflash)")
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except Exception as e:  # a clear one-line message instead of a traceback for user errors
        from .errors import PydflashError

        if isinstance(e, (PydflashError, ValueError, TypeError)):
            print(f"pydflash: error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
