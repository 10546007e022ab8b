#!/usr/bin/env python3
"""How far any choice of what to verify per round can go on the cost-realistic pairs, on this machine.

bench_tree.py measures engines; this replays one fixed history instead. For each held-out code prompt it
records the drafter's top-8 proposals at every position of the target's greedy continuation (what the drafter
proposes depends only on the text before it, so every policy sees the same ones), and measures the time of a
target evaluation of 1..16, 32 and 64 tokens (the verify) and of one draft. Then each policy is replayed round
by round, its time the sum of its drafts and verifies:

- fixed draft length k (llama.cpp's --spec-draft-n-max k; our chain at block k+1): verify k+1 tokens;
- oracle chain: knows how many of the drafter's top-1 chain the target will accept (a) and verifies the
  cheapest width that holds a+1 tokens;
- oracle tree: the same for the target's path when every token of it is among the drafter's top-8 at its
  position (a tree that holds exactly that path).

Oracles bound what per-round choices built on this drafter can reach: the oracle chain bounds any choice of
chain length, the oracle tree any tree that must pay for each node it verifies.

    python benchmarks/bench_bound.py                       # both archs, q8_0 and q4mix, 8 prompts x 96 tokens
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tools"))

from bench_tree import cost_realistic_pairs  # noqa: E402
from export_pairs import PAIRS_DIR, pair_file, prompt_rows  # noqa: E402

import pydflash  # noqa: E402
from pydflash import _core  # noqa: E402

WIDTHS = list(range(1, 17)) + [32, 64]
TOP_K = 8


def verify_costs(target: Path, threads: int, context: int) -> dict[int, float]:
    """ms of one evaluation of w tokens after `context` committed ones, reading every row's greedy pick as the
    decode loop's verify does (fastest of 5, each after a warm run)."""
    model = _core.Model(str(target), n_threads=threads)
    s = _core.Session(model, n_ctx=context + 128, n_rollback=64)
    s.eval(np.arange(1, context + 1, dtype=np.int32) % 1000, all_logits=False)
    s.commit(context)
    costs = {}
    for w in WIDTHS:
        toks = (np.arange(w, dtype=np.int32) * 7 + 11) % 1000
        best = float("inf")
        for _ in range(5):
            s.eval(toks, all_logits=True, read_logits=False)
            t0 = time.perf_counter()
            s.eval(toks, all_logits=True, read_logits=False)
            best = min(best, time.perf_counter() - t0)
        costs[w] = 1000 * best
    return costs


def cost_of(costs: dict[int, float], w: int) -> float:
    if w in costs:
        return costs[w]
    lo = max(k for k in costs if k < w)
    hi = min(k for k in costs if k > w)
    return costs[lo] + (w - lo) / (hi - lo) * (costs[hi] - costs[lo])


def cheapest_holding(costs: dict[int, float], n: int) -> float:
    """the cheapest verify of at least n tokens (verify times need not grow with the width)"""
    return min(cost_of(costs, w) for w in range(n, 65))


def histories(arch: str, prompts: list[str], max_tokens: int, threads: int):
    """per prompt: the greedy continuation and, at each of its positions, the drafter's top-8 ids [15, 8]"""
    target, draft = pair_file(arch, "target", "q8_0"), pair_file(arch, "dflash", "q8_0")
    tok = pydflash.Tokenizer.from_gguf(target)
    model = _core.Model(str(target), n_threads=threads)
    draft_ms = []
    out = []
    for text in prompts:
        ids = tok.tokenize(text, add_special=False)
        greedy = _core.Session(model, n_ctx=2048).generate(ids, max_tokens=max_tokens + 16, stop_tokens=[])["tokens"]
        seq = ids + greedy
        ds = _core.DraftSession(model, str(draft), n_ctx=2048, top_k=TOP_K)
        _, feats = _core.Session(model, n_ctx=2048).eval(np.array(seq, dtype=np.int32),
                                                         capture_layers=ds.capture_layers)
        feats = np.concatenate(feats, axis=1)
        proposals, done = [], 0
        for p in range(len(ids), len(ids) + max_tokens):
            t0 = time.perf_counter()
            top, _ = ds.draft(feats[done:p], np.arange(done, p, dtype=np.int32), seq[p], p, with_logprobs=True)
            draft_ms.append(1000 * (time.perf_counter() - t0))
            done = p
            proposals.append(top)
        out.append((greedy, proposals))
    return out, float(np.median(draft_ms))


def replay(hist, policy) -> float:
    """tokens per second of `policy(proposals, truth) -> (committed, ms)` over the histories"""
    tokens = ms = 0.0
    for greedy, proposals in hist:
        j = 0
        while j < len(proposals):
            committed, t = policy(proposals[j], greedy[j + 1:j + 16])
            tokens += committed
            ms += t
            j += committed
    return 1000.0 * tokens / ms


def accepted(top, truth, k):
    """how many drafted positions match the target's path, each token among the drafter's top-k there"""
    a = 0
    while a < len(truth) and a < len(top) and truth[a] in top[a][:k].tolist():
        a += 1
    return a


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default="qwen3,qwen35")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", type=Path, default=HERE.parent / "build" / "inflated")
    args = ap.parse_args()
    prompts = [r["text"] for r in prompt_rows("code", PAIRS_DIR)[:args.n_prompts]]
    print(f"{len(prompts)} held-out code prompts x {args.max_tokens} tokens, {args.threads} threads; tok/s of each "
          f"policy replayed with measured verify and draft times")
    for arch in args.archs.split(","):
        hist, draft_ms = histories(arch, prompts, args.max_tokens, args.threads)
        for pair in (p for p in cost_realistic_pairs(args.cache_dir, [arch])):
            costs = verify_costs(pair["target"], args.threads, context=200)
            rows = {}
            for k in range(1, 16):
                rows[f"fixed draft length {k}"] = replay(
                    hist, lambda top, truth, k=k: (accepted(top[:k], truth, 1) + 1, cost_of(costs, k + 1) + draft_ms))
            best_fixed = max(rows.values())
            best_k = max(rows, key=rows.get)
            oracle_chain = replay(hist, lambda top, truth: (accepted(top, truth, 1) + 1,
                                                            cheapest_holding(costs, accepted(top, truth, 1) + 1)
                                                            + draft_ms))
            oracle_tree = replay(hist, lambda top, truth: (accepted(top, truth, TOP_K) + 1,
                                                           cheapest_holding(costs, accepted(top, truth, TOP_K) + 1)
                                                           + draft_ms))
            print(f"\n{pair['name']}: verify ms " + " ".join(f"{w}:{costs[w]:.1f}" for w in (1, 2, 4, 8, 16, 32, 64))
                  + f"; draft {draft_ms:.2f} ms")
            print(f"  best fixed draft length ({best_k.split()[-1]}): {best_fixed:7.1f} tok/s")
            print(f"  oracle chain:                 {oracle_chain:7.1f} tok/s  {oracle_chain / best_fixed:.2f}x")
            print(f"  oracle tree (top-{TOP_K} path):    {oracle_tree:7.1f} tok/s  {oracle_tree / best_fixed:.2f}x")


if __name__ == "__main__":
    main()
