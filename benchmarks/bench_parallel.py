#!/usr/bin/env python3
"""Parallel streams: aggregate and per-request decode speed at 1, 2 and 4 concurrent generations, plain vs
speculative, and where speculation stops paying as streams compete for the machine.

Each of N streams is a session of its own over one copy of the weights (`Model.new_session()`, what
`pydflash serve --parallel N` runs), on a thread of its own. Every session is given --threads, as
`pydflash serve -t` gives them: the threads of the whole model, never more of them busy however many sessions
generate (llama-server's meaning of -t). Every stream runs the same --n-prompts held-out code prompts
(rotated by stream) for --max-tokens tokens each; the N streams start together.

  aggregate tok/s   all streams' generated tokens / the wall time until the last stream finished
  per request       the mean over requests of generated tokens / that request's own wall time (prompt included)
  spec rounds       auto: the share of its rounds that verified drafts (the rest decoded plainly, or drafted and
                    verified nothing), from its own measurements of what verifying costs on this machine now

    python benchmarks/bench_parallel.py                       # tiny and cost-realistic pairs, both archs
    python benchmarks/bench_parallel.py --pairs tiny --streams 1,2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tools"))

from bench_tree import cost_realistic_pairs, tiny_pairs  # noqa: E402
from export_pairs import PAIRS_DIR, prompt_rows  # noqa: E402

import pydflash  # noqa: E402

ENGINES = [("plain", None), ("chain", dict(spec_mode="chain")), ("auto", dict(spec_mode="auto"))]


def run_streams(pair: dict, engine: dict | None, n_streams: int, prompts: list[str], args) -> dict:
    threads = args.threads
    first = pydflash.Model(pair["target"], n_ctx=2048, n_threads=threads,
                           draft_model_path=None if engine is None else pair["draft"], **(engine or {}))
    sessions = [first] + [first.new_session() for _ in range(n_streams - 1)]
    sampling = {} if args.temp == 0 else dict(temperature=args.temp, top_k=40, top_p=0.95, min_p=0.05)
    # warm-up (pages, graphs, auto's first measurements) on the prompt each stream runs first, so that every
    # stream starts with that prompt cached, as one stream does (stream k runs prompt k first: with the warm-up
    # on prompt 0 for all, streams 1.. paid one more prefill than stream 0, and 4 streams ran ~15% slow)
    for k, s in enumerate(sessions):
        s.generate(prompts[k % len(prompts)], max_tokens=8, seed=1, **sampling)
    results: list[list[dict]] = [[] for _ in sessions]
    barrier = threading.Barrier(n_streams + 1)

    def stream(k: int) -> None:
        barrier.wait()
        for j in range(len(prompts)):
            started = time.perf_counter()
            c = sessions[k].generate(prompts[(j + k) % len(prompts)], max_tokens=args.max_tokens, seed=100 + j,
                                     **sampling)
            results[k].append({"tokens": len(c.tokens), "s": time.perf_counter() - started, "t": c.timings})

    workers = [threading.Thread(target=stream, args=(k,)) for k in range(n_streams)]
    for w in workers:
        w.start()
    barrier.wait()
    started = time.perf_counter()
    for w in workers:
        w.join()
    wall = time.perf_counter() - started
    requests = [r for rs in results for r in rs]
    row = {"aggregate": sum(r["tokens"] for r in requests) / wall,
           "per_request": statistics.mean(r["tokens"] / r["s"] for r in requests), "threads": threads}
    t = [r["t"] for r in requests]
    if "n_rounds" in t[0]:
        rounds = sum(x["n_rounds"] for x in t)
        row["tau"] = (sum(x["draft_n_accepted"] for x in t) + rounds) / rounds if rounds else 1.0
    if "auto_chain" in t[0]:
        spec = sum(x["auto_chain"] + x["auto_tree"] for x in t)
        row["spec_rounds"] = spec / max(1, spec + sum(x["auto_plain"] + x["auto_skipped"] for x in t))
    del sessions, first
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="compute threads in all (shared by the streams)")
    ap.add_argument("--streams", default="1,2,4")
    ap.add_argument("--pairs", default="tiny,realistic")
    ap.add_argument("--archs", default="qwen3,qwen35")
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temp", type=float, default=0.0, help="0: greedy; else with top-k 40, top-p .95, min-p .05")
    ap.add_argument("--cache-dir", type=Path, default=ROOT / "build" / "inflated")
    args = ap.parse_args()
    archs, kinds = args.archs.split(","), args.pairs.split(",")
    pairs = ([p for p in tiny_pairs(archs) if "q8_0" in p["name"]] if "tiny" in kinds else []) + \
            (cost_realistic_pairs(args.cache_dir, archs) if "realistic" in kinds else [])
    prompts = [r["text"] for r in prompt_rows("code", PAIRS_DIR)[:args.n_prompts]]
    counts = [int(n) for n in args.streams.split(",")]
    print(f"{len(prompts)} held-out code prompts x {args.max_tokens} tokens per stream, T = {args.temp}, "
          f"{args.threads} threads in all")
    for pair in pairs:
        print(f"\n{pair['name']}")
        print(f"  {'streams':>7} {'engine':<7} {'thr':>3} {'aggregate':>10} {'/ plain':>8} {'per req':>8} "
              f"{'/ plain':>8} {'tau':>5} {'spec rounds':>11}")
        for n in counts:
            rows = {label: run_streams(pair, kw, n, prompts, args) for label, kw in ENGINES}
            plain = rows["plain"]
            for label, r in rows.items():
                tau = f"{r['tau']:.2f}" if "tau" in r else "-"
                spec = f"{100 * r['spec_rounds']:.0f}%" if "spec_rounds" in r else "-"
                print(f"  {n:>7} {label:<7} {r['threads']:>3} {r['aggregate']:10.1f} "
                      f"{r['aggregate'] / plain['aggregate']:8.2f} {r['per_request']:8.1f} "
                      f"{r['per_request'] / plain['per_request']:8.2f} {tau:>5} {spec:>11}", flush=True)


if __name__ == "__main__":
    main()
