#!/usr/bin/env python3
"""Sampling: what it costs per decode step, and how speculation holds up when the target samples.

Table 1, cost: a plain decode step, greedy (the device's argmax) against sampled settings, on random-weight
~0.6B Qwen3 (151,936-entry vocabulary) and ~0.8B Qwen3.5 (248,320: the fixture's tokenizer padded) GGUFs.
ms/step: medians of --reps interleaved runs of --n-gen steps each (this VM's noise is several percent);
sampling ms: the engine's own timing of choosing each token (the logits row read back, the chain, the draw;
timings["sample_ms"] per token), and its share of the greedy step (the goal: < 5%). Random weights give
nearly flat distributions, the worst case for top-p (a nucleus of most of the vocabulary).

Table 2, speed: tau and decode tokens/s at T = 0, 0.7 and 1.0 (T > 0 with llama-cpp-python's defaults top-k 40,
top-p 0.95, min-p 0.05), for plain decoding, chain, tree (budget 16) and auto, ours, and llama.cpp's plain
(`llama-completion`) and DFlash (`llama-speculative-simple --spec-type draft-dflash`, draft length 7) with the
same `--temp` and filters, on the cost-realistic pairs (the committed targets inflated to a ~0.3B model's cost,
see bench_tree.py) and the tiny committed pairs. Sampled rows use one seed per prompt (the same for every engine
of ours, so their outputs must be identical: the "same" column counts it).

    python benchmarks/bench_sampling.py                        # both tables
    python benchmarks/bench_sampling.py --skip-cost --pairs tiny --skip-peer
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tools"))

import peer  # noqa: E402
import bench_tree  # noqa: E402
from bench_tree import cost_realistic_pairs, tiny_pairs  # noqa: E402
from export_pairs import PAIRS_DIR, prompt_rows  # noqa: E402
from random_gguf import write_random_qwen3, write_random_qwen35  # noqa: E402

import pydflash  # noqa: E402
from pydflash import _core  # noqa: E402

FILTERS = dict(top_k=40, top_p=0.95, min_p=0.05)
COST_SETTINGS = [
    ("greedy", None),
    ("T=0.7 top-k 40/top-p/min-p", dict(temperature=0.7, **FILTERS)),
    ("T=1.0, no filter", dict(temperature=1.0)),
    ("T=1.0 top-p 0.95 only", dict(temperature=1.0, top_p=0.95)),
    ("T=0.7 + penalties", dict(temperature=0.7, **FILTERS, repeat_penalty=1.1, presence_penalty=0.5,
                               frequency_penalty=0.5)),
]
TEMPS = (0.0, 0.7, 1.0)
QWEN35_VOCAB = 248320  # Qwen3.5's (the fixture's tokenizer padded)
OURS = [("plain", None), ("chain", dict(spec_mode="chain")), ("tree 16", dict(spec_mode="tree", tree_budget=16)),
        ("auto", dict(spec_mode="auto"))]
LLAMA_DRAFT = 7


def cost_table(args) -> None:
    models = peer.source_dir() / "models"
    files = [("qwen3 0.6b", write_random_qwen3, "0.6b", models / "ggml-vocab-qwen2.gguf", None),
             ("qwen35 0.8b", write_random_qwen35, "0.8b", models / "ggml-vocab-qwen35.gguf", QWEN35_VOCAB)]
    print(f"\nTable 1: a plain decode step, greedy vs sampled ({args.threads} threads, {args.n_gen} steps, "
          f"median of {args.reps})")
    print(f"  {'model':<18} {'vocab':>7} {'setting':<28} {'ms/step':>8} {'sampling ms':>12} {'share':>7}")
    for name, write, shape, vocab, n_vocab in files:
        for wtype in args.cost_types.split(","):
            path = args.out / f"random-{name.split()[0]}-{shape}-{wtype}{'-v' + str(n_vocab) if n_vocab else ''}.gguf"
            if not path.exists():
                print(f"  writing {path.name} ...", flush=True)
                write(path, shape, wtype, vocab, n_vocab=n_vocab)
            model = _core.Model(str(path), n_threads=args.threads)
            session = _core.Session(model, n_ctx=args.n_gen + 64)
            prompt = [int(t) for t in np.random.default_rng(0).integers(0, 150000, 8)]
            session.generate(prompt, max_tokens=8, stop_tokens=[])  # warm-up: pages, graphs
            runs = {label: [] for label, _ in COST_SETTINGS}
            sample_ms = {label: [] for label, _ in COST_SETTINGS}
            for _ in range(args.reps):
                for label, sampling in COST_SETTINGS:  # interleaved
                    session.truncate(0)
                    r = session.generate(prompt, max_tokens=args.n_gen + 1, stop_tokens=[],
                                         sampling=None if sampling is None else {**sampling, "seed": 1})
                    t = r["timings"]
                    runs[label].append(t["predicted_ms"] / t["n_target_evals"])
                    # every generated token was drawn once (the first from the prompt's logits)
                    sample_ms[label].append(t["sample_ms"] / t["predicted_n"])
            greedy = statistics.median(runs["greedy"])
            for label, _ in COST_SETTINGS:
                ms, smp = statistics.median(runs[label]), statistics.median(sample_ms[label])
                share = "-" if label == "greedy" else f"{100 * smp / greedy:6.1f}%"
                print(f"  {name + ' ' + wtype:<18} {model.n_vocab:>7} {label:<28} {ms:8.2f} {smp:12.3f} "
                      f"{share:>7}", flush=True)
            del session, model


def run_ours(pair: dict, prompts: list[str], temp: float, args) -> dict:
    sampling = {} if temp == 0 else dict(temperature=temp, **FILTERS)
    return bench_tree.run_ours(pair, prompts, args, OURS, lambda i: dict(seed=1000 + i, **sampling))


def run_llama(pair: dict, prompts: list[str], temp: float, args, tmp: Path) -> dict:
    files = [peer.prompt_file(tmp / f"p{i}.txt", t) for i, t in enumerate(prompts)]
    rows = {}
    try:
        ar = [peer.llama_ar(pair["target"], f, args.max_tokens, args.threads, 2048, temp, 1000 + i)
              for i, f in enumerate(files)]
        rows["llama.cpp plain"] = {"tok_s": 1000.0 * sum(r["tokens"] for r in ar) / sum(r["ms"] for r in ar)}
        rs = [peer.llama_dflash(pair["target"], pair["draft"], f, args.max_tokens, args.threads, 2048, LLAMA_DRAFT,
                                temp, 1000 + i) for i, f in enumerate(files)]
        rows[f"llama.cpp dflash {LLAMA_DRAFT}"] = {
            "tok_s": 1000.0 * sum(r["tokens"] for r in rs) / sum(r["ms"] for r in rs),
            "tau": sum(r["n_predict"] for r in rs) / sum(r["rounds"] for r in rs)}
    except peer.PeerError as e:
        rows["llama.cpp"] = {"error": str(e)}
    return rows


def speed_table(args) -> None:
    archs = args.archs.split(",")
    kinds = args.pairs.split(",")
    pairs = (cost_realistic_pairs(args.cache_dir, archs) if "realistic" in kinds else []) + \
            ([p for p in tiny_pairs(archs) if "q8_0" in p["name"]] if "tiny" in kinds else [])
    prompts = [r["text"] for r in prompt_rows("code", PAIRS_DIR)[:args.n_prompts]]
    use_peer = not args.skip_peer and peer.binary("llama-speculative-simple") is not None
    print(f"\nTable 2: {len(prompts)} held-out code prompts x {args.max_tokens} tokens, {args.threads} threads; "
          f"T > 0 with top-k 40, top-p 0.95, min-p 0.05")
    with tempfile.TemporaryDirectory() as tmp:
        for pair in pairs:
            print(f"\n{pair['name']}")
            print(f"  {'T':>4} {'engine':<20} {'tok/s':>8} {'tau':>6} {'/ plain':>8} {'/ llama':>8} {'same':>6}")
            for temp in TEMPS:
                rows = run_ours(pair, prompts, temp, args)
                if use_peer:
                    rows.update(run_llama(pair, prompts, temp, args, Path(tmp)))
                plain = rows["plain"]["tok_s"]
                llama = [r["tok_s"] for k, r in rows.items() if k.startswith("llama.cpp dflash") and "tok_s" in r]
                for label, r in rows.items():
                    if "error" in r:
                        print(f"  {temp:4.1f} {label:<20} ({r['error']})")
                        continue
                    tau = f"{r['tau']:.2f}" if "tau" in r else "-"
                    vs_llama = f"{r['tok_s'] / llama[0]:.2f}" if llama else "-"
                    same = f"{r['same_as_plain']}/{len(prompts)}" if "same_as_plain" in r else "-"
                    print(f"  {temp:4.1f} {label:<20} {r['tok_s']:8.1f} {tau:>6} {r['tok_s'] / plain:8.2f} "
                          f"{vs_llama:>8} {same:>6}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n-gen", type=int, default=48, help="decode steps per timed run (table 1)")
    ap.add_argument("--cost-types", default="q8_0", help="weight types of the random GGUFs (table 1)")
    ap.add_argument("--pairs", default="realistic,tiny")
    ap.add_argument("--archs", default="qwen3,qwen35")
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cache-dir", type=Path, default=ROOT / "build" / "inflated")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--out", type=Path, default=HERE / "out", help="random GGUFs go here")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.skip_cost:
        cost_table(args)
    if not args.skip_speed:
        speed_table(args)


if __name__ == "__main__":
    main()
