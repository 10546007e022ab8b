#!/usr/bin/env python3
"""Plain (autoregressive) decode and prefill speed: pydflash vs llama.cpp built from the same pinned sdist.

Same GGUF, same thread count, same shapes of work as `llama-bench -p N_PROMPT -n N_GEN`: prefill of N_PROMPT
tokens into an empty cache (ours in micro-batches of --n-ubatch, as llama-bench's default -ub 512), and N_GEN
decode steps from a one-token prompt. The two engines run in turn,
--reps times (default 5): each speed is the median of its runs, each ratio the median of the ratios of
runs made one after the other (on a small shared VM one run of either engine can be 20-40% off, more than
the differences being measured, and the machine's speed drifts between runs). Beside the decode ratio: the
spread of those paired ratios (min-max), and the ratio of each engine's best run (the least disturbed one).

    python benchmarks/bench_ar.py                  # tiny and ~0.6B random Qwen3, q4_0 and q8_0
    python benchmarks/bench_ar.py --arch qwen35    # tiny and ~0.8B random Qwen3.5 hybrids
    python benchmarks/bench_ar.py --arch qwen3moe  # tiny and ~1.1B random Qwen3-MoE (64 experts, top-8)
    python benchmarks/bench_ar.py --peer build     # also build llama.cpp first (CPU, ~11 min on 2 cores)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import peer  # noqa: E402
from random_gguf import (HYBRID_SHAPES, MOE_SHAPES, SHAPES, write_random_qwen3, write_random_qwen3moe,  # noqa: E402
                         write_random_qwen35)

from pydflash import _core  # noqa: E402


def ours(path: Path, threads: int, n_prompt: int, n_gen: int, n_ubatch: int = 512) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s)"""
    model = _core.Model(str(path), n_threads=threads)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 150000, n_prompt).astype(np.int32)

    session = _core.Session(model, n_ctx=n_prompt + n_gen + 16, n_ubatch=n_ubatch)

    def prefill() -> None:
        # as the engine's prefill runs it: micro-batches of n_ubatch, each committed whole (no per-token states)
        for i in range(0, n_prompt, n_ubatch):
            part = prompt[i:i + n_ubatch]
            session.eval(part, all_logits=False, read_logits=False, whole=True)
            session.commit(len(part))

    # warm-up with the same prompt, as llama-bench does: first touch of the weights, and the graph and compute
    # buffer for a micro-batch allocated outside the timed pass
    prefill()
    session.truncate(0)
    t0 = time.perf_counter()
    prefill()
    pp = n_prompt / (time.perf_counter() - t0)

    session = _core.Session(model, n_ctx=n_prompt + n_gen + 16)
    session.generate([int(prompt[0])], max_tokens=8, stop_tokens=[])  # warm-up
    session.truncate(0)
    r = session.generate([int(prompt[0])], max_tokens=n_gen + 1, stop_tokens=[])
    # the first generated token comes from the prompt pass; the other n_gen are decode steps
    tg = r["timings"]["n_target_evals"] / (r["timings"]["predicted_ms"] / 1000.0)
    return pp, tg


def llama_cpp(path: Path, threads: int, n_prompt: int, n_gen: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) from llama-bench"""
    r = peer.llama_bench(path, threads, n_prompt, n_gen)
    return 1000.0 * n_prompt / r["pp_ms"], 1000.0 / r["ar_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=["qwen3", "qwen35", "qwen3moe"], default="qwen3")
    ap.add_argument("--shapes", default=None,
                    help="comma-separated; qwen3: tiny,0.6b  qwen35: tiny,0.8b  qwen3moe: tiny,1b")
    ap.add_argument("--types", default="q4_0,q8_0")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--n-ubatch", type=int, default=512,
                    help="our prefill micro-batch (Model's default; llama-bench runs its default, also 512)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved runs of each engine; medians printed")
    ap.add_argument("--peer", choices=["use", "build", "skip"], default="use",
                    help="use llama.cpp if built (default), build it first, or skip it")
    ap.add_argument("--out", type=Path, default=HERE / "out")
    args = ap.parse_args()

    if args.peer == "build":
        peer.build()
    use_peer = args.peer != "skip" and peer.binary("llama-bench") is not None
    models = peer.source_dir() / "models"
    if args.arch == "qwen3":
        vocab, shapes, write = models / "ggml-vocab-qwen2.gguf", SHAPES, write_random_qwen3
    elif args.arch == "qwen3moe":
        vocab, shapes, write = models / "ggml-vocab-qwen2.gguf", MOE_SHAPES, write_random_qwen3moe
    else:
        vocab, shapes, write = models / "ggml-vocab-qwen35.gguf", HYBRID_SHAPES, write_random_qwen35
    args.out.mkdir(parents=True, exist_ok=True)

    print(f"threads={args.threads}  pp{args.n_prompt}  tg{args.n_gen}  "
          f"(tokens/s: medians of {args.reps} interleaved runs; ratio: median of run-by-run ratios)")
    header = (f"{'model':<14} {'pp ours':>9} {'pp llama':>9} {'ratio':>6} | {'tg ours':>8} {'tg llama':>9} {'ratio':>6} "
              f"{'(min-max)':>11} {'best':>5}")
    print(header)
    print("-" * len(header))
    for shape in (args.shapes or ",".join(shapes)).split(","):
        for wtype in args.types.split(","):
            path = args.out / f"random-{args.arch}-{shape}-{wtype}.gguf"
            if not path.exists():
                write(path, shape, wtype, vocab)
            runs_ours, runs_peer = [], []
            for _ in range(args.reps):
                runs_ours.append(ours(path, args.threads, args.n_prompt, args.n_gen, args.n_ubatch))
                if use_peer:
                    runs_peer.append(llama_cpp(path, args.threads, args.n_prompt, args.n_gen))
            pp, tg = np.median(np.array(runs_ours), axis=0)
            if use_peer:
                lpp, ltg = np.median(np.array(runs_peer), axis=0)
                ratios = np.array(runs_ours) / np.array(runs_peer)  # [reps, (pp, tg)], each run vs its neighbour
                rpp, rtg = np.median(ratios, axis=0)
                spread = f"{ratios[:, 1].min():.2f}-{ratios[:, 1].max():.2f}"
                best = np.array(runs_ours)[:, 1].max() / np.array(runs_peer)[:, 1].max()
                print(f"{shape + ' ' + wtype:<14} {pp:9.1f} {lpp:9.1f} {rpp:6.2f} | {tg:8.1f} {ltg:9.1f} "
                      f"{rtg:6.2f} {spread:>11} {best:5.2f}")
            else:
                print(f"{shape + ' ' + wtype:<14} {pp:9.1f} {'-':>9} {'-':>6} | {tg:8.1f} {'-':>9} {'-':>6}")
            sys.stdout.flush()
    if not use_peer and args.peer != "skip":
        print("(llama.cpp not built: run with --peer build for the ratios)")


if __name__ == "__main__":
    main()
