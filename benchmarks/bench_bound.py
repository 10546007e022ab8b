#!/usr/bin/env python3
"""How far any choice of what to verify per round can go on the cost-realistic pairs, on this machine, for each
proposer: the DFlash and DFlash2 drafters and the target's own MTP head.

bench_tree.py measures engines; this replays one fixed history instead. For each held-out code prompt it
records the proposer's proposals at every position of the target's greedy continuation (what a DFlash drafter
proposes depends only on the text before it, and so does what the MTP head drafts after the target's token there,
so every policy sees the same ones: the drafters' top-8, the head's greedy chain), and measures the time of a target
evaluation of 1..16, 32 and 64 tokens (the verify) and of drafting (a DFlash draft: one forward of the committed
drafter; the head: one step per drafted token, on the cost-realistic target). Then each policy is replayed round
by round, its time the sum of its drafts and verifies:

- fixed draft length k (llama.cpp's --spec-draft-n-max k, what its draft-dflash and draft-mtp run; our chain at
  block k+1): draft k, verify k+1 tokens;
- oracle chain: knows how many of the proposer's greedy chain the target will accept (a), drafts and verifies the
  cheapest width that holds a+1 tokens (the head paying a step per token it drafts);
- oracle tree (DFlash drafters): the same for the target's path when every token of it is among the drafter's
  top-8 at its position (a tree that holds exactly that path).

Oracles bound what per-round choices built on this proposer can reach: the oracle chain bounds any choice of
chain length, the oracle tree any tree that must pay for each node it verifies. Since llama.cpp runs the same
ggml kernels, a goal of r x llama.cpp's best-tuned method (its best fixed draft length) is out of reach of any
choice of chain length on this machine where the oracle chain's ratio is below r.

    python benchmarks/bench_bound.py             # qwen3 and qwen35 with DFlash, q8_0 and q4mix, 8 prompts x 96 tokens
    python benchmarks/bench_bound.py --archs qwen35,qwen35moe --proposers dflash2,mtp
    python benchmarks/bench_bound.py --archs qwen35,qwen35moe --proposers dflash,dflash2,mtp -ngl -1  # on a GPU
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

from bench_moe import pairs_of as moe_pairs  # noqa: E402
from bench_proposers import mtp_pairs  # noqa: E402
from bench_tree import add_width_argument, cost_realistic_pairs, drafter_of  # noqa: E402
from export_pairs import PAIRS_DIR, pair_file, prompt_rows  # noqa: E402

import pydflash  # noqa: E402
from pydflash import _core  # noqa: E402

WIDTHS = list(range(1, 17)) + [32, 64]
TOP_K = 8
DEPTH = 15  # positions proposed per round (a DFlash block of 16; the head's block of 16)
MOE = ("qwen3moe", "qwen35moe")


def verify_costs(target: Path, threads: int, context: int, ngl: int = 0) -> dict[int, float]:
    """ms of one evaluation of w tokens after `context` committed ones, reading every row's greedy pick as the
    decode loop's verify does (fastest of 5, each after a warm run); ngl: layers on the GPU"""
    model = _core.Model(str(target), n_threads=threads, n_gpu_layers=ngl)
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


def head_step_ms(target: Path, prompt: list[int], threads: int, ngl: int = 0) -> float:
    """ms of the target's MTP head per token it drafts, as the decode loop drafts (its rows for the tokens a round
    accepted appended too): a greedy generation with chains of 7 drafts (the second of two)"""
    model = _core.Model(str(target), n_threads=threads, n_gpu_layers=ngl)
    s = _core.Session(model, n_ctx=2048)
    head = _core.MtpDrafter(s, block_size=8, spec_mode="chain")
    for _ in range(2):
        t = s.generate(np.array(prompt, dtype=np.int32), max_tokens=96, mtp=head, stop_tokens=[])["timings"]
    return t["draft_ms"] / t["draft_n"]


def cost_of(costs: dict[int, float], w: int) -> float:
    if w in costs:
        return costs[w]
    lo = max(k for k in costs if k < w)
    hi = min(k for k in costs if k > w)
    return costs[lo] + (w - lo) / (hi - lo) * (costs[hi] - costs[lo])


def cheapest_holding(costs: dict[int, float], n: int, draft_ms) -> float:
    """the cheapest round that verifies at least n tokens (verify times need not grow with the width): its verify
    and its drafting"""
    return min(cost_of(costs, w) + draft_ms(w - 1) for w in range(n, 65))


def greedy_sequences(target: Path, prompts: list[str], max_tokens: int, model) -> list[tuple[list[int], list[int]]]:
    """per prompt: its tokens and the target's greedy continuation (max_tokens + DEPTH + 1 tokens)"""
    tok = pydflash.Tokenizer.from_gguf(target)
    out = []
    for text in prompts:
        ids = tok.tokenize(text, add_special=False)
        greedy = _core.Session(model, n_ctx=2048).generate(ids, max_tokens=max_tokens + DEPTH + 1,
                                                          stop_tokens=[])["tokens"]
        out.append((ids, greedy))
    return out


def drafter_histories(target: Path, drafter: Path, prompts: list[str], max_tokens: int, threads: int, ngl: int = 0):
    """per prompt: the greedy continuation and, at each of its positions, the drafter's top-8 ids [15, 8]; and the
    median ms of a draft (ngl: the layers on the GPU, the drafter with them)"""
    model = _core.Model(str(target), n_threads=threads, n_gpu_layers=ngl)
    draft_ms, out = [], []
    for ids, greedy in greedy_sequences(target, prompts, max_tokens, model):
        seq = ids + greedy
        ds = _core.DraftSession(model, str(drafter), n_ctx=2048, top_k=TOP_K)
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


def head_histories(arch: str, prompts: list[str], max_tokens: int, threads: int, ngl: int = 0):
    """per prompt: the greedy continuation and, at each of its positions, the MTP head's greedy chain of 15 drafts
    after the target's token there ([15, 1]), as the decode loop drafts it after a verify (the head's cache holds
    its rows for every committed position)"""
    target = pair_file(arch, "target-mtp", "q8_0")
    model = _core.Model(str(target), n_threads=threads, n_gpu_layers=ngl)
    out, parted = [], 0
    for ids, greedy in greedy_sequences(target, prompts, max_tokens, model):
        seq = ids + greedy
        s = _core.Session(model, n_ctx=2048)
        head = _core.MtpDrafter(s, block_size=DEPTH + 1, spec_mode="chain")
        proposals = []
        for p in range(len(ids), len(ids) + max_tokens):
            anchor, top, _ = head.draft_after(s, np.array(seq[:p], dtype=np.int32), DEPTH)
            # (a prefill's pick can part from the stepped generation's at a near-tie of the target's logits: the
            # head drafted after another token there, and nothing it drafted counts)
            parted += anchor != seq[p]
            proposals.append(top if anchor == seq[p] else np.full_like(top, -1))
        out.append((greedy, proposals))
    if parted:
        print(f"({arch}: at {parted} of {len(out) * max_tokens} positions a prefill's pick parted from the greedy "
              f"continuation at a near-tie; the head's drafts there count as none accepted)")
    return out


def replay(hist, policy) -> tuple[float, float]:
    """tokens per second of `policy(proposals, truth) -> (committed, ms)` over the histories, and tau (tokens
    committed per round)"""
    tokens = ms = rounds = 0.0
    for greedy, proposals in hist:
        j = 0
        while j < len(proposals):
            committed, t = policy(proposals[j], greedy[j + 1:j + DEPTH + 1])
            tokens += committed
            ms += t
            j += committed
            rounds += 1
    return 1000.0 * tokens / ms, tokens / rounds


def accepted(top, truth, k):
    """how many drafted positions match the target's path, each token among the proposer's top-k there"""
    a = 0
    while a < len(truth) and a < len(top) and truth[a] in top[a][:k].tolist():
        a += 1
    return a


def policies(costs: dict[int, float], draft_ms, tree: bool) -> dict:
    """label -> policy(proposals, truth) -> (committed, ms); draft_ms(k): ms of drafting k tokens"""
    rows = {f"fixed draft length {k}": (lambda top, truth, k=k: (accepted(top[:k], truth, 1) + 1,
                                                                 cost_of(costs, k + 1) + draft_ms(k)))
            for k in range(1, DEPTH + 1)}
    rows["oracle chain"] = lambda top, truth: (accepted(top, truth, 1) + 1,
                                               cheapest_holding(costs, accepted(top, truth, 1) + 1, draft_ms))
    if tree:
        rows[f"oracle tree (top-{TOP_K} path)"] = lambda top, truth: (
            accepted(top, truth, TOP_K) + 1, cheapest_holding(costs, accepted(top, truth, TOP_K) + 1, draft_ms))
    return rows


def print_bound(name: str, costs: dict[int, float], drafting: str, rates: dict[str, tuple[float, float]]) -> None:
    """rates: label -> (tok/s, tau)"""
    fixed = {label: r for label, r in rates.items() if label.startswith("fixed")}
    best_k = max(fixed, key=lambda label: fixed[label][0])
    best = fixed[best_k][0]
    print(f"\n{name}: verify ms " + " ".join(f"{w}:{costs[w]:.1f}" for w in (1, 2, 4, 8, 16, 32, 64))
          + f"; {drafting}")
    at = {k: fixed[f"fixed draft length {k}"] for k in (3, 7, 15)}
    print("  fixed draft lengths 3/7/15: " + ", ".join(f"{r:.1f} tok/s (tau {tau:.2f})" for r, tau in at.values()))
    print(f"  {f'best fixed draft length ({best_k.split()[-1]}):':30s}{best:7.1f} tok/s  tau {fixed[best_k][1]:.2f}")
    for label in (label for label in rates if label.startswith("oracle")):
        rate, tau = rates[label]
        print(f"  {label + ':':30s}{rate:7.1f} tok/s  tau {tau:.2f}  {rate / best:.2f}x")


def targets_of(arch: str, proposer: str, cache: Path, n_embd: int | None) -> list[dict]:
    """the cost-realistic targets a proposer of `arch` drafts for (none: an MTP head on an arch without one)"""
    if proposer == "mtp":
        return mtp_pairs(cache, [arch], n_embd)
    if arch in MOE:
        return moe_pairs(("realistic",), ("q4mix",), cache, archs=[arch], n_embd=n_embd)
    return cost_realistic_pairs(cache, [arch], n_embd=n_embd)


def bound(arch: str, proposer: str, prompts: list[str], args) -> None:
    targets = targets_of(arch, proposer, args.cache_dir, args.n_embd)
    if not targets:
        return
    if proposer == "mtp":
        hist = head_histories(arch, prompts, args.max_tokens, args.threads, args.n_gpu_layers)
    else:
        # the committed pair (the same tokens as the inflated one), or at another width the widened pair, whose
        # draft costs what the width's does
        width = targets[0]["n_embd"]
        target, drafter = ((pair_file(arch, "target", "q8_0"), pair_file(arch, proposer, "q8_0")) if width is None
                           else (targets[0]["target"], drafter_of(args.cache_dir, arch, proposer, width)))
        hist, draft_ms = drafter_histories(target, drafter, prompts, args.max_tokens, args.threads,
                                           args.n_gpu_layers)
    for pair in targets:
        costs = verify_costs(pair["target"], args.threads, context=200, ngl=args.n_gpu_layers)
        if proposer == "mtp":
            prompt = pydflash.Tokenizer.from_gguf(pair["target"]).tokenize(prompts[0], add_special=False)
            step = head_step_ms(pair["target"], prompt, args.threads, args.n_gpu_layers)
            rates = {label: replay(hist, p) for label, p in policies(costs, lambda k: k * step, False).items()}
            drafting = f"a head step {step:.2f} ms"
        else:
            rates = {label: replay(hist, p)
                     for label, p in policies(costs, lambda k: draft_ms if k else 0.0, True).items()}
            drafting = f"a draft {draft_ms:.2f} ms"
        print_bound(f"{pair['name']}, {proposer}", costs, drafting, rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default="qwen3,qwen35", help="qwen3, qwen35, qwen3moe, qwen35moe")
    ap.add_argument("--proposers", default="dflash", help="dflash, dflash2, mtp (the head: qwen35 and qwen35moe)")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0,
                    help="layers on the GPU for every timing and history (-1: all)")
    ap.add_argument("--cache-dir", type=Path, default=HERE.parent / "build" / "inflated")
    add_width_argument(ap)
    args = ap.parse_args()
    prompts = [r["text"] for r in prompt_rows("code", PAIRS_DIR)[:args.n_prompts]]
    print(f"{len(prompts)} held-out code prompts x {args.max_tokens} tokens, {args.threads} threads"
          + (f", {args.n_gpu_layers} layers on the GPU" if args.n_gpu_layers else "")
          + "; tok/s of each policy replayed with measured verify and draft times")
    for arch in args.archs.split(","):
        for proposer in args.proposers.split(","):
            bound(arch, proposer, prompts, args)


if __name__ == "__main__":
    main()
