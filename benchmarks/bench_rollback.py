#!/usr/bin/env python3
"""What rollback without replay costs on a hybrid (Qwen3.5) target: an N-token evaluation that keeps each token's
delta-rule inputs (so the caller can commit at any token; a partial commit recomputes the state from them) against
one committed whole (the final state only), plus the recurrent state's memory at n_rollback 1 and N. One AR step
for scale. (bench_tree_state.py times whole rounds, trees and partial commits included.)

    python benchmarks/bench_rollback.py                     # random ~0.8B hybrid, q8_0 and q4_0, N = 16
    python benchmarks/bench_rollback.py --shape tiny --n 8
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
from random_gguf import write_random_qwen35  # noqa: E402

from pydflash import _core  # noqa: E402


def timed_evals(model, n_tokens: int, n_rollback: int, reps: int, whole: bool) -> tuple[float, int]:
    """(median ms of one n_tokens evaluation committed in full, recurrent-state bytes)"""
    s = _core.Session(model, n_ctx=64 + n_tokens * (reps + 2), n_rollback=n_rollback)
    rng = np.random.default_rng(0)
    s.eval(rng.integers(0, 1000, 16).astype(np.int32))
    s.commit(16)
    times = []
    for _ in range(reps + 1):
        block = rng.integers(0, 1000, n_tokens).astype(np.int32)
        t0 = time.perf_counter()
        s.eval(block, all_logits=True, whole=whole)
        times.append((time.perf_counter() - t0) * 1000)
        s.commit(n_tokens)
    return float(np.median(times[1:])), s.recurrent_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="0.8b")
    ap.add_argument("--types", default="q8_0,q4_0")
    ap.add_argument("--n", type=int, default=16, help="tokens per verify")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", type=Path, default=HERE / "out")
    args = ap.parse_args()
    models = peer.source_dir() / "models"
    args.out.mkdir(parents=True, exist_ok=True)

    print(f"threads={args.threads}  N={args.n}  (median of {args.reps} evaluations)")
    header = (f"{'model':<12} {'AR step ms':>10} {'N, whole':>15} {'N, any prefix':>15} {'extra':>7} "
              f"{'state MiB (1 / N)':>18}")
    print(header)
    print("-" * len(header))
    for wtype in args.types.split(","):
        path = args.out / f"random-qwen35-{args.shape}-{wtype}.gguf"
        if not path.exists():
            write_random_qwen35(path, args.shape, wtype, models / "ggml-vocab-qwen35.gguf")
        model = _core.Model(str(path), n_threads=args.threads)
        t_ar, _ = timed_evals(model, 1, 1, args.reps, whole=False)
        t_final, mem_final = timed_evals(model, args.n, 1, args.reps, whole=True)
        t_snap, mem_snap = timed_evals(model, args.n, args.n, args.reps, whole=False)
        print(f"{args.shape + ' ' + wtype:<12} {t_ar:10.1f} {t_final:15.1f} {t_snap:15.1f} "
              f"{100 * (t_snap / t_final - 1):6.1f}% {mem_final / 2**20:8.1f} / {mem_snap / 2**20:7.1f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
