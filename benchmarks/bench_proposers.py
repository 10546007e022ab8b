#!/usr/bin/env python3
"""Proposers against each other and against llama.cpp's: plain decoding, a DFlash drafter (auto), n-gram lookup
(no drafter; chain and auto), both merged in one tree (auto), the target's own MTP head (chain, tree and auto), and
auto over the head with the others ("all auto": the drafter, the lookup and the head merged in one tree, each round
drafting with the models whose rounds pay; its notes give the share of rounds each drafted in), on the same GGUFs,
machine and prompts.

Pairs: the cost-realistic ones of bench_tree (the committed trained targets inflated to a ~0.3B model's cost, q4mix
or, with --quants, q8_0 too, with the committed q8_0 drafter), with --pairs mtp the committed qwen35 and qwen35moe
targets with their trained MTP heads inflated the same way (the head kept last; the pair's drafter drafts for it
too), and with --pairs tiny the committed q8_0 pairs.
Workloads:
- code: the held-out code prompts, continued;
- repeat: each of them followed by its first 40% again, so that the continuation repeats the context (what a
  code edit or a quoting answer does; where prompt lookup is meant to pay).

llama.cpp, each in the same run: plain (`llama-completion`), `draft-dflash` at draft lengths 3/7/15,
`ngram-simple` (its defaults, lookup 12 / draft 48, and a short lookup 3 / draft 7), `ngram-mod` (its
defaults) and, on the MTP pair, `draft-mtp` at draft lengths 2/3/5/7.
Columns as bench_tree's, the ratio to llama.cpp's best row of the pair and workload (any method).

    python benchmarks/bench_proposers.py                          # cost-realistic pairs, 6 prompts x 96 tokens
    python benchmarks/bench_proposers.py --pairs tiny --skip-peer
    python benchmarks/bench_proposers.py --quants q8_0 --engines "ngram auto"   # q8_0 targets, n-gram only
    python benchmarks/bench_proposers.py --pairs mtp --workloads code
    python benchmarks/bench_proposers.py --pairs mtp --archs qwen35moe --workloads code
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import bench_tree
import peer
from export_pairs import PAIRS_DIR, pair_file, prompt_rows

OURS = [("plain", None),
        ("dflash auto", dict(spec_mode="auto")),
        ("ngram chain", dict(draft_model_path=None, proposers=("ngram",), spec_mode="chain")),
        ("ngram auto", dict(draft_model_path=None, proposers=("ngram",), spec_mode="auto")),
        ("dflash+ngram auto", dict(proposers=("dflash", "ngram"), spec_mode="auto"))]
# the target's own head (pairs whose target has one)
OURS_MTP = [("mtp chain", dict(draft_model_path=None, proposers=("mtp",), spec_mode="chain")),
            ("mtp chain 8", dict(draft_model_path=None, proposers=("mtp",), spec_mode="chain", block_size=8)),
            ("mtp tree", dict(draft_model_path=None, proposers=("mtp",), spec_mode="tree")),
            ("mtp auto", dict(draft_model_path=None, proposers=("mtp",), spec_mode="auto")),
            ("mtp+ngram auto", dict(draft_model_path=None, proposers=("ngram", "mtp"), spec_mode="auto")),
            ("dflash+mtp auto", dict(proposers=("dflash", "mtp"), spec_mode="auto")),
            ("all auto", dict(proposers=("dflash", "ngram", "mtp"), spec_mode="auto"))]
LLAMA_MTP = (2, 3, 5, 7)
LLAMA_NGRAM = [("ngram-simple 12/48", "ngram-simple", ()),
               ("ngram-simple 3/7", "ngram-simple", ("--spec-ngram-simple-size-n", "3",
                                                      "--spec-ngram-simple-size-m", "7")),
               ("ngram-mod", "ngram-mod", ())]


def workloads(n_prompts: int) -> dict[str, list[str]]:
    code = [r["text"] for r in prompt_rows("code", PAIRS_DIR)[:n_prompts]]
    return {"code": code, "repeat": [t + t[: len(t) * 2 // 5] for t in code]}


def _llama_rows(prompts: list[str], tmp: Path, runs) -> dict:
    """One row per (label, run): run(prompt file) -> a parsed llama-speculative-simple result, over every prompt."""
    files = [peer.prompt_file(tmp / f"s{i}.txt", t) for i, t in enumerate(prompts)]
    rows = {}
    for label, run in runs:
        try:
            rs = [run(f) for f in files]
        except peer.PeerError as e:
            rows[f"llama.cpp {label}"] = {"error": str(e)}
            continue
        n_predict, rounds = sum(r["n_predict"] for r in rs), sum(r["rounds"] for r in rs)
        rows[f"llama.cpp {label}"] = {"tok_s": 1000.0 * sum(r["tokens"] for r in rs) / sum(r["ms"] for r in rs),
                                      "tau": n_predict / rounds if rounds else 1.0}
    return rows


def run_llama_ngram(pair: dict, prompts: list[str], args, tmp: Path) -> dict:
    return _llama_rows(prompts, tmp, [
        (label, lambda f, t=spec_type, fl=flags: peer.llama_ngram(pair["target"], f, args.max_tokens, args.threads,
                                                                   2048, t, fl, n_gpu_layers=args.n_gpu_layers))
        for label, spec_type, flags in LLAMA_NGRAM])


def run_llama_mtp(pair: dict, prompts: list[str], args, tmp: Path) -> dict:
    return _llama_rows(prompts, tmp, [
        (f"mtp {n}", lambda f, n=n: peer.llama_mtp(pair["target"], f, args.max_tokens, args.threads, 2048, n,
                                                        n_gpu_layers=args.n_gpu_layers))
        for n in LLAMA_MTP])


def run_all(pair: dict, prompts: list[str], engines, args, tmp: Path) -> dict:
    """One run of every row: ours, then llama.cpp's."""
    rows = bench_tree.run_ours(pair, prompts, args, engines=engines)
    if not args.skip_peer:
        rows.update(bench_tree.run_llama(pair, prompts, args, tmp))
        rows.update(run_llama_ngram(pair, prompts, args, tmp))
        if pair.get("mtp"):
            rows.update(run_llama_mtp(pair, prompts, args, tmp))
    return rows


def mean_rows(runs: list[dict]) -> dict:
    """Each row's numbers averaged over the runs (counts summed: same outputs, auto's choices, rounds drafted)."""
    rows = {}
    for label, first in runs[0].items():
        if "error" in first:
            rows[label] = first
            continue
        rs = [r[label] for r in runs]
        # (tau and the rest: over the runs that had speculative rounds)
        row = {k: statistics.mean(r[k] for r in rs if k in r) for k in ("tok_s", "tau", "verified_per_token")
               if any(k in r for r in rs)}
        for k in ("auto", "ran"):
            if k in first:
                row[k] = {name: sum(r.get(k, {}).get(name, 0) for r in rs) for name in first[k]}
        if "same_as_plain" in first:
            row["same_as_plain"] = sum(r["same_as_plain"] for r in rs)
        rows[label] = row
    return rows


def mtp_pairs(cache: Path, archs, n_embd: int | None = None) -> list[dict]:
    """The committed qwen35 / qwen35moe targets with their trained MTP heads, inflated to q4mix (built once into
    `cache`); n_embd: at that hidden width (bench_tree.inflated), the drafter widened with it."""
    pairs = []
    for arch in (a for a in archs if a in ("qwen35", "qwen35moe")):
        source = PAIRS_DIR / f"{arch}-target-mtp-q8_0.gguf"
        width = bench_tree.hidden_width(source, n_embd)
        target = bench_tree.inflated(cache, source, f"{arch}-mtp-inflated", "q4mix", width)
        pairs.append({"name": f"{arch}+MTP q4mix (0.3B cost{f', width {width}' if width else ''})", "arch": arch,
                      "target": target, "draft": bench_tree.drafter_of(cache, arch, "dflash", width), "mtp": True,
                      "n_embd": width})
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default="realistic", help="realistic, tiny or both (comma-separated)")
    ap.add_argument("--archs", default="qwen3,qwen35")
    ap.add_argument("--n-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0,
                    help="layers on the GPU, ours and llama.cpp's (-1: all)")
    ap.add_argument("--cache-dir", type=Path, default=bench_tree.ROOT / "build" / "inflated")
    ap.add_argument("--quants", default="q4mix", help="the realistic pairs' target quantizations: q4mix, q8_0 or both")
    ap.add_argument("--skip-peer", action="store_true", help="pydflash rows only")
    ap.add_argument("--workloads", default="code,repeat")
    ap.add_argument("--engines", default=None, help="comma-separated labels of ours to run (default: all; plain "
                                                      "always)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of every row, ours and llama.cpp's alternating (the "
                                                          "machine's speed drifts); means reported")
    bench_tree.add_width_argument(ap)
    args = ap.parse_args()
    chosen = lambda label: label == "plain" or args.engines is None or label in args.engines.split(",")  # noqa: E731
    archs, kinds = args.archs.split(","), args.pairs.split(",")
    pairs = (bench_tree.cost_realistic_pairs(args.cache_dir, archs, kinds=tuple(args.quants.split(",")),
                                             n_embd=args.n_embd)
             if "realistic" in kinds
             else []) + ([{"name": f"{a} q8_0 (tiny)", "arch": a, "target": pair_file(a, "target", "q8_0"),
                           "draft": pair_file(a, "dflash", "q8_0")} for a in archs] if "tiny" in kinds else []) + \
        (mtp_pairs(args.cache_dir, archs, args.n_embd) if "mtp" in kinds else [])
    print(f"{args.n_prompts} held-out code prompts x {args.max_tokens} tokens per workload, greedy, "
          f"{args.threads} threads")
    with tempfile.TemporaryDirectory() as tmp:
        for pair in pairs:
            engines = [e for e in OURS + (OURS_MTP if pair.get("mtp") else []) if chosen(e[0])]
            for workload, prompts in workloads(args.n_prompts).items():
                if workload not in args.workloads.split(","):
                    continue
                runs = [run_all(pair, prompts, engines, args, Path(tmp)) for _ in range(args.rounds)]
                bench_tree.print_pair(f"{pair['name']}, {workload}" + (f" (means of {args.rounds} runs)" if
                                                                        args.rounds > 1 else ""), mean_rows(runs),
                                      best_of="llama.cpp")


if __name__ == "__main__":
    main()
