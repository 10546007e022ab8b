#!/usr/bin/env python3
"""MoE targets (qwen3moe, qwen35moe): what a verify costs where its rows read the union of their experts, and what
plain decoding, DFlash chains, DDTree trees and auto make of it, against llama.cpp on the same GGUFs and machine.

Pairs:
- cost-realistic: each committed trained MoE target (tests/data/pairs/{qwen3moe,qwen35moe}-target-q8_0.gguf: 32
  experts, top-4) inflated to ~0.3B active parameters per token with exactly the same function
  (pydflash.convert.inflate: every expert and the shared expert widened, 12 MoE layers appended whose random
  routers pick experts as a real MoE's do and whose outputs are zero), q8_0 and q4mix, with the committed q8_0
  drafter; built once into --cache-dir;
- tiny: the committed q8_0 MoE pairs themselves (overhead-bound).

Tables:
1. distinct experts a verify of N rows reads per layer (mean over layers and prompts), measured from the router
   outputs (the `ffn_moe_topk-<layer>` nodes, Session.trace_nodes) on the target's own continuations, beside
   uniform routing's expectation X(1-(1-k/X)^N) and the ratio to one decode step's k;
2. decode tokens/s per engine (bench_tree.py's rows: ours plain, chain 4/8/16 = draft lengths 3/7/15, tree,
   auto; llama.cpp plain and DFlash 3/7/15), with the ratios to our plain and to llama.cpp's best DFlash;
3. a random Qwen3-MoE of a larger shape (random_gguf.MOE_SHAPES "1b": 64 experts, top-8, ~1.1B parameters):
   plain decode and pp512 against llama-bench (bench_ar.py's measurement).

    python benchmarks/bench_moe.py                          # everything (llama.cpp if built: peer.py build)
    python benchmarks/bench_moe.py --skip-peer --tables 1,2 --pairs tiny
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tools"))

import bench_ar  # noqa: E402
import bench_tree  # noqa: E402
import peer  # noqa: E402
from export_pairs import PAIRS_DIR, pair_file, prompt_rows  # noqa: E402
from random_gguf import write_random_qwen3moe  # noqa: E402

import pydflash  # noqa: E402
from pydflash import _core  # noqa: E402

ARCHS = ("qwen3moe", "qwen35moe")
ENGINES = [("plain", None),
           ("chain 4", dict(spec_mode="chain", block_size=4)),
           ("chain 8", dict(spec_mode="chain", block_size=8)),
           ("chain 16", dict(spec_mode="chain")),
           ("tree 16", dict(spec_mode="tree", tree_budget=16)),
           ("tree 63", dict(spec_mode="tree", tree_budget=63)),
           ("auto", dict(spec_mode="auto"))]
WIDTHS = (1, 2, 4, 8, 16)


def pairs_of(kinds, types, cache: Path, drafter: str = "dflash", archs=ARCHS, n_embd: int | None = None) -> list[dict]:
    """The cost-realistic MoE pairs (inflated from the committed q8_0 targets: the MoE pairs are committed in q8_0
    only; n_embd: at that hidden width) and the tiny ones, as bench_tree's pairs, with the committed q8_0 drafter
    of that kind (dflash or dflash2), widened as its target."""
    pairs = []
    for arch in archs:
        if "realistic" in kinds:
            pairs += bench_tree.cost_realistic_pairs(cache, [arch], types, source="q8_0", label="0.3B active",
                                                     n_embd=n_embd)
        if "tiny" in kinds:
            pairs.append({"name": f"{arch} q8_0 (tiny)", "arch": arch, "target": pair_file(arch, "target", "q8_0")})
    for pair in pairs:
        pair["draft"] = bench_tree.drafter_of(cache, pair["arch"], drafter, pair.get("n_embd"))
        pair["name"] += f", {drafter} drafter" if drafter != "dflash" else ""
    return pairs


def experts_per_width(target: Path, prompts: list[str], max_tokens: int) -> dict:
    """{N: mean distinct experts per layer a verify of N rows reads}, over the prompts, from the router outputs:
    each prompt's greedy continuation, its first N tokens evaluated in one batch after the prompt."""
    with pydflash.Model(target, n_ctx=2048) as m:
        continuations = [(m.tokenize(p), m.generate(p, max_tokens=max_tokens).tokens) for p in prompts]
        session = _core.Session(m._model, n_ctx=2048)
    session.trace_nodes("ffn_moe_topk-")
    counts: dict[int, list[int]] = {n: [] for n in WIDTHS}
    for prompt, tokens in continuations:
        session.truncate(0)
        session.eval(np.array(prompt, dtype=np.int32), all_logits=False)
        session.commit(len(prompt))
        for n in WIDTHS:
            if len(tokens) < n:
                continue
            session.take_trace()
            session.eval(np.array(tokens[:n], dtype=np.int32), all_logits=False)
            counts[n] += [len(np.unique(ids)) for ids in session.take_trace().values()]
    return {n: float(np.mean(c)) for n, c in counts.items() if c}


def print_experts(name: str, target: Path, union: dict) -> None:
    arch = name.split()[0]
    fields = gguf.GGUFReader(target).fields
    x = int(fields[f"{arch}.expert_count"].contents())
    k = int(fields[f"{arch}.expert_used_count"].contents())
    print(f"\n{name}: distinct experts per layer a verify of N rows reads ({x} experts, top-{k})")
    print(f"  {'N':>3} {'measured':>9} {'/ decode':>9} {'uniform':>8}")
    for n, u in union.items():
        print(f"  {n:>3} {u:9.1f} {u / k:9.2f} {x * (1 - (1 - k / x) ** n):8.1f}")


def random_shape_rows(args) -> None:
    """Table 3: plain decode and pp512 of the random 1B MoE, ours against llama-bench, interleaved."""
    vocab = peer.source_dir() / "models" / "ggml-vocab-qwen2.gguf"
    use_peer = not args.skip_peer and peer.binary("llama-bench") is not None
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    print(f"\nrandom qwen3moe 1b (64 experts, top-8): pp{args.n_prompt} and tg{args.n_gen}, medians of {args.reps}")
    for wtype in ("q4_0", "q8_0"):
        path = args.cache_dir / f"random-qwen3moe-1b-{wtype}.gguf"
        if not path.exists():
            write_random_qwen3moe(path, "1b", wtype, vocab)
        ours, theirs = [], []
        for _ in range(args.reps):
            ours.append(bench_ar.ours(path, args.threads, args.n_prompt, args.n_gen))
            if use_peer:
                theirs.append(bench_ar.llama_cpp(path, args.threads, args.n_prompt, args.n_gen))
        pp, tg = np.median(np.array(ours), axis=0)
        line = f"  {wtype:<6} ours pp {pp:8.1f} tg {tg:7.1f}"
        if theirs:
            lpp, ltg = np.median(np.array(theirs), axis=0)
            rpp, rtg = np.median(np.array(ours) / np.array(theirs), axis=0)
            line += f" | llama-bench pp {lpp:8.1f} tg {ltg:7.1f} | ratio pp {rpp:.2f} tg {rtg:.2f}"
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default="realistic,tiny", help="realistic, tiny or both (comma-separated)")
    ap.add_argument("--types", default="q8_0,q4mix", help="the cost-realistic pairs' types")
    ap.add_argument("--tables", default="1,2,3")
    ap.add_argument("--n-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0,
                    help="tables 2's layers on the GPU (-1: all), ours and llama.cpp's alike (a GPU build of each)")
    ap.add_argument("--n-prompt", type=int, default=512, help="table 3's prefill")
    ap.add_argument("--n-gen", type=int, default=64, help="table 3's decode steps")
    ap.add_argument("--reps", type=int, default=3, help="table 3's interleaved runs")
    ap.add_argument("--cache-dir", type=Path, default=ROOT / "build" / "inflated")
    ap.add_argument("--skip-peer", action="store_true", help="pydflash rows only")
    ap.add_argument("--json", type=Path, default=None, help="also write tables 1 and 2 here")
    ap.add_argument("--engines", default=None, help="table 2: comma-separated labels of ours to run (default: all; "
                                                      "plain always)")
    ap.add_argument("--warm-costs", action="store_true",
                    help="table 2's engines share the user's cost cache (default: each its own, fresh)")
    ap.add_argument("--warm-passes", type=int, default=0,
                    help="table 2: untimed passes over the prompts before the timed one, each engine keeping what it "
                         "learnt (auto's costs and cool-down: a process past its first tokens; default 0: a fresh one)")
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--drafter", default="dflash", choices=("dflash", "dflash2"),
                    help="table 2's committed drafter kind (tests/data/pairs/<arch>-<kind>-q8_0.gguf)")
    bench_tree.add_width_argument(ap)
    args = ap.parse_args()
    tables = set(args.tables.split(","))
    engines = [e for e in ENGINES if args.engines is None or e[0] == "plain" or e[0] in args.engines.split(",")]
    prompts = [r["text"] for r in prompt_rows("code", PAIRS_DIR)[:args.n_prompts]]
    print(f"{len(prompts)} held-out code prompts x {args.max_tokens} tokens, greedy, {args.threads} threads")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in pairs_of(args.pairs.split(","), args.types.split(","), args.cache_dir,
                             args.drafter, args.archs.split(","), args.n_embd) if tables & {"1", "2"} else []:
            out = results.setdefault(pair["name"], {})
            if "1" in tables:
                out["experts"] = experts_per_width(pair["target"], prompts, args.max_tokens)
                print_experts(pair["name"], pair["target"], out["experts"])
            if "2" in tables:
                rows = bench_tree.run_ours(pair, prompts, args, engines=engines)
                if not args.skip_peer:
                    rows.update(bench_tree.run_llama(pair, prompts, args, Path(tmp)))
                out["engines"] = rows
                bench_tree.print_pair(pair["name"], rows)
    if "3" in tables:
        random_shape_rows(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
