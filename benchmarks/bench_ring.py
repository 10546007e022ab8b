#!/usr/bin/env python3
"""Why the target-feature ring holds n_ubatch rows (512 by default).

The target writes the drafter's features into the ring during every evaluation, and the drafter turns them
into context K/V right after; so the ring must hold one evaluation: a verify block (16 rows) or a prefill
micro-batch (n_ubatch rows). A smaller ring therefore means smaller prefill micro-batches. This measures what
those cost (prefill tokens/s of a DFlash-enabled Model by n_ubatch) beside the ring's memory, for the random
~0.6B Qwen3 target and its random 4-layer drafter of benchmarks/bench_dflash.py, and for the ring of a real
Qwen3.5-27B DFlash pair (5 target layers x 5120 floats per row) for scale.

    python benchmarks/bench_ring.py                 # 0.6b q4_0, 2 threads
    python benchmarks/bench_ring.py --shape tiny
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import peer  # noqa: E402
from random_gguf import write_random_dflash, write_random_qwen3  # noqa: E402

import pydflash  # noqa: E402

ROW_BYTES_27B = 5 * 5120 * 4  # Qwen3.5-27B: hidden 5120, z-lab drafter reads 5 target layers, f32 rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="0.6b", choices=["tiny", "0.6b"])
    ap.add_argument("--type", default="q4_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens per prefill")
    args = ap.parse_args()

    out = HERE / "out"
    out.mkdir(exist_ok=True)
    target = out / f"random-qwen3-{args.shape}-{args.type}.gguf"
    if not target.exists():
        write_random_qwen3(target, args.shape, args.type, peer.source_dir() / "models" / "ggml-vocab-qwen2.gguf")
    draft = out / f"random-dflash-qwen3-{args.shape}-{args.type}-ring.gguf"
    if not draft.exists():
        write_random_dflash(draft, target, args.type)
    prompt = np.random.default_rng(0).integers(1000, 100000, args.prompt).tolist()

    print(f"feature ring = n_ubatch rows; {target.name}, {args.threads} threads, {args.prompt}-token prompt")
    print(f"{'n_ubatch':>8} {'prefill tok/s':>14} {'ring MiB':>9} {'ring MiB (27B pair)':>20}")
    for n_ubatch in (32, 64, 128, 256, 512):
        with pydflash.Model(target, draft_model_path=draft, n_ctx=args.prompt + 64, n_ubatch=n_ubatch,
                            n_threads=args.threads, spec_mode="chain") as m:
            m.generate(prompt[:n_ubatch], max_tokens=1)          # graphs built, pages touched
            best = 0.0
            for rep in range(2):
                c = m.generate([7 + rep] + prompt[1:], max_tokens=1)   # a new first token: no prefix reuse
                best = max(best, c.timings["prompt_per_second"])
            ring = m._draft.ring_bytes
        print(f"{n_ubatch:8d} {best:14.1f} {ring / 2**20:9.1f} {n_ubatch * ROW_BYTES_27B / 2**20:20.1f}")


if __name__ == "__main__":
    main()
