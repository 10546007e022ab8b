#!/usr/bin/env python3
"""What a hybrid (Qwen3.5) tree verify costs and keeps, by tree budget: the median time of one round (a tree of
`budget` drafts plus its root evaluated in one pass, then a path of --accept nodes committed) and the recurrent
state the session holds for it. Since issue 27 a verify keeps each node's delta-rule inputs instead of its state
and the commit reruns the delta rule over the accepted path, so run this on two builds to compare (it uses only
the Session API both have).

    python benchmarks/bench_tree_state.py /work/inflated/qwen35-q4mix.gguf --budgets 22,63
    python benchmarks/bench_tree_state.py /work/inflated/qwen35-q4mix.gguf --budgets 3,7,15 --chain
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from pydflash import _core


def ddtree_like(rng, n_nodes: int, depth: int) -> tuple[list[int], list[int]]:
    """parents and depths of a tree shaped as DDTree's are: a spine `depth` deep, then siblings spread over the
    shallower levels (best-first trees are wide near the root)."""
    parents, depths = [-1], [0]
    for d in range(1, min(depth, n_nodes)):
        parents.append(d - 1)
        depths.append(d)
    while len(parents) < n_nodes:
        d = min(int(rng.geometric(0.35)) - 1, depth - 1)
        candidates = [i for i, x in enumerate(depths) if x == d - 1] if d > 0 else [-1]
        p = int(rng.choice(candidates))
        parents.append(p)
        depths.append(d)
    order = np.argsort(depths, kind="stable")  # parents before children
    where = {int(old): new for new, old in enumerate(order)}
    return [(-1 if parents[o] < 0 else where[parents[o]]) for o in order], [depths[o] for o in order]


def timed_rounds(model, budget: int, accept: int, rounds: int, depth: int, chain: bool) -> tuple[float, int]:
    """(median ms of one round: the tree's (chain: a chain of budget + 1 tokens) evaluation and the commit of
    `accept` nodes, recurrent bytes)"""
    n = budget + 1
    s = _core.Session(model, n_ctx=64 + n + accept * (rounds + 2), n_rollback=n)
    rng = np.random.default_rng(0)
    s.eval(rng.integers(0, 1000, 16).astype(np.int32))
    s.commit(16)
    parents, depths = (list(range(-1, n - 1)), list(range(n))) if chain else ddtree_like(rng, n, depth)
    path = [depths.index(d) for d in range(accept)]  # the spine: the first node of each depth
    times = []
    for _ in range(rounds + 1):
        tokens = rng.integers(0, 1000, n).astype(np.int32)
        t0 = time.perf_counter()
        s.eval(tokens, parents=np.array(parents, dtype=np.int32))
        s.commit(path)
        times.append((time.perf_counter() - t0) * 1000)
    return float(np.median(times[1:])), s.recurrent_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--budgets", default="22,63")
    ap.add_argument("--accept", type=int, default=5, help="nodes committed per round")
    ap.add_argument("--depth", type=int, default=15, help="deepest node (a block of 16)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--chain", action="store_true", help="verify chains of budget + 1 tokens instead of trees")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    print(f"threads={args.threads}  accept={args.accept}  {'chains' if args.chain else 'trees'}  "
          f"(median of {args.rounds} rounds)")
    print(f"{'model':<28} {'budget':>6} {'round ms':>9} {'recurrent MiB':>14}")
    for path in args.models:
        model = _core.Model(path, n_threads=args.threads)
        for budget in map(int, args.budgets.split(",")):
            ms, nbytes = timed_rounds(model, budget, args.accept, args.rounds, args.depth, args.chain)
            print(f"{os.path.basename(path):<28} {budget:6d} {ms:9.2f} {nbytes / 2**20:14.1f}", flush=True)


if __name__ == "__main__":
    main()
