#!/usr/bin/env python3
"""Parallel streams: aggregate throughput and per-stream latency at N concurrent generations, batched into one
target evaluation per step (continuous batching) or not, speculative or plain, against llama-server -np N.

Each of N streams is a session of its own over one copy of the weights (`Model.new_session()`, what
`pydflash serve --parallel N` runs), generating in a thread of its own; the sessions' generations meet at each
step in the Model's batcher (one target evaluation for all of them). "unbatched" turns the batcher off: the
sessions then take turns on the model's threads (--threads in all, as `pydflash serve -t` and llama-server's -t
mean). N x --n-prompts requests (each held-out code prompt N times, each request's made unique by a first line
of its own) of --max-tokens tokens wait in one queue, which the N streams empty together, as a server's slots
do. llama-server gets the same GGUFs, -np N slots, the same threads, and its DFlash at each --llama-n-max (the
best is its row "llama dflash"). Our engines: plain, chains (the whole block; blocks of 4 and 8, llama-server's
draft lengths 3 and 7), auto; each batched and some unbatched.

  aggregate tok/s   all streams' generated tokens / the wall time until the last stream finished
  ttft ms           mean time from a request's start to its first token
  itl p50 / p95     inter-token latency over every token of every request (a burst of k tokens arriving
                    together, as a speculative round commits them, counts its gap / k for each)
  spec rounds       auto: the share of its rounds that verified drafts

With --pairs mtp the targets are the committed qwen35 / qwen35moe ones with their trained MTP heads (inflated to
q4mix, as bench_proposers.py's), our engines draft with that head alone (no drafter file: each round's head
steps of every stream in one graph), and llama-server runs its draft-mtp at each --llama-n-max.

    python benchmarks/bench_parallel.py                      # cost-realistic pairs, 1, 2, 4 and 8 streams
    python benchmarks/bench_parallel.py --pairs tiny --streams 1,2 --no-llama
    python benchmarks/bench_parallel.py --engines plain,auto --llama-n-max 3 --rounds 2   # alternating, means
    python benchmarks/bench_parallel.py --pairs mtp --archs qwen35 --streams 1,4 --llama-n-max 2,3
    python benchmarks/bench_parallel.py --pairs mtp --archs qwen35 --decode-only --max-tokens 192
    python benchmarks/bench_parallel.py --archs qwen35 --decode-only --max-tokens 192 --warm-passes 2

Each engine starts fresh (its own empty cost cache, as a first run on a machine), unless --warm-costs; with
--warm-passes K it first runs the timed workload K times untimed, so that its rows are those of a server past its
first requests (what auto's sessions and the batch learn: verify and step times, acceptance).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tools"))

import peer  # noqa: E402
from bench_proposers import mtp_pairs  # noqa: E402
from bench_tree import add_width_argument, cost_realistic_pairs, own_cost_caches, tiny_pairs  # noqa: E402
from export_pairs import PAIRS_DIR, prompt_rows  # noqa: E402

import pydflash  # noqa: E402

# label, Model keyword arguments (None: plain decoding, no proposer), batched
# (chain: the drafter's whole block; chain 4 and 8: llama-server's lengths 3 and 7, the fixed chains to tune)
ENGINES = [("plain", None, True), ("plain unbatched", None, False), ("chain", dict(spec_mode="chain"), True),
           ("chain 4", dict(spec_mode="chain", block_size=4), True),
           ("chain 8", dict(spec_mode="chain", block_size=8), True),
           ("auto", dict(spec_mode="auto"), True), ("auto unbatched", dict(spec_mode="auto"), False)]
# on a target with an MTP head (--pairs mtp): the head drafts, no drafter file
HEAD = dict(draft_model_path=None, proposers=("mtp",))
ENGINES_MTP = [("plain", None, True), ("mtp chain", dict(HEAD, spec_mode="chain"), True),
               ("mtp auto", dict(HEAD, spec_mode="auto"), True), ("mtp auto unbatched", dict(HEAD, spec_mode="auto"),
                                                                  False)]


class Arrivals:
    """When a request's tokens arrived: (seconds since its start, tokens) per burst."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.bursts: list[tuple[float, int]] = []

    def add(self, n: int) -> None:
        now = time.perf_counter() - self.started
        if self.bursts and now - self.bursts[-1][0] < 1e-3:  # (SSE events of one round)
            self.bursts[-1] = (self.bursts[-1][0], self.bursts[-1][1] + n)
        else:
            self.bursts.append((now, n))

    def tokens(self) -> int:
        return sum(n for _, n in self.bursts)

    def gaps(self) -> list[float]:
        out = []
        for (t0, _), (t1, n) in zip(self.bursts, self.bursts[1:]):
            out += [(t1 - t0) / n] * n
        return out


def summary(requests: list[Arrivals], wall: float) -> dict:
    gaps = sorted(g for r in requests for g in r.gaps())
    pct = lambda q: 1000.0 * gaps[min(len(gaps) - 1, int(q * len(gaps)))] if gaps else 0.0  # noqa: E731
    return {"aggregate": sum(r.tokens() for r in requests) / wall,
            "ttft": 1000.0 * statistics.mean(r.bursts[0][0] for r in requests if r.bursts),
            "p50": pct(0.50), "p95": pct(0.95)}


def request_prompt(prompts: list[str], k: int, j: int) -> str:
    """stream k's j-th request: prompt (j + k) mod n, made unique by a first line of its own (no engine reuses
    another request's prompt: llama-server keeps earlier prompts in host memory, we keep each slot's last)"""
    return f"# request {k}.{j}\n" + prompts[(j + k) % len(prompts)]


def timed_streams(n_streams: int, stream) -> float:
    """stream(k) for k in 0..n_streams-1, each in a thread of its own, started together after a barrier each
    stream(k) waits at first: the seconds until the last one ends"""
    barrier = threading.Barrier(n_streams + 1)

    def released(k: int) -> None:
        barrier.wait()
        stream(k)

    workers = [threading.Thread(target=released, args=(k,)) for k in range(n_streams)]
    for w in workers:
        w.start()
    barrier.wait()
    started = time.perf_counter()
    for w in workers:
        w.join()
    return time.perf_counter() - started


def together(n_streams: int, prompts: list[str], run_one) -> dict:
    """n_streams threads, started together, taking requests from one queue until it is empty (as a server's slots
    take waiting requests: no stream idles while another still has work), each prompt n_streams times in all;
    run_one(stream, prompt text, Arrivals) runs one request on that stream's session (slot)"""
    todo = queue.SimpleQueue()
    for j in range(len(prompts)):
        for k in range(n_streams):
            todo.put(request_prompt(prompts, k, j))
    requests: list[Arrivals] = []

    def stream(k: int) -> None:
        while True:
            try:
                text = todo.get_nowait()
            except queue.Empty:
                return
            a = Arrivals()
            run_one(k, text, a)
            requests.append(a)

    wall = timed_streams(n_streams, stream)
    return summary(requests, wall)


def decoding_together(n_streams: int, prompts: list[str], run_one) -> dict:
    """--decode-only: one request per stream (stream k: prompt k mod n, made unique), its prompt evaluated first in
    an untimed request of one token, then, all streams started together, the timed request of the same prompt
    (its prompt cached): the aggregate is decoding's alone"""
    texts = [request_prompt(prompts, k, 0) for k in range(n_streams)]
    timed_streams(n_streams, lambda k: run_one(k, texts[k], None, 1))
    requests = [Arrivals() for _ in range(n_streams)]

    def stream(k: int) -> None:
        requests[k].started = time.perf_counter()
        run_one(k, texts[k], requests[k])

    wall = timed_streams(n_streams, stream)
    return summary(requests, wall)


def run_ours(pair: dict, engine: dict | None, batched: bool, n_streams: int, prompts: list[str], args,
             own=contextlib.nullcontext) -> dict:
    kw = {"draft_model_path": None, "proposers": ()} if engine is None else {"draft_model_path": pair["draft"],
                                                                                **engine}
    with own():  # (the cost cache each session restores from when it opens)
        first = pydflash.Model(pair["target"], n_ctx=2048, n_threads=args.threads, n_gpu_layers=args.n_gpu_layers,
                               **kw)
        sessions = [first] + [first.new_session() for _ in range(n_streams - 1)]
    if not batched:
        for s in sessions:
            s._batcher = None
    stops = sorted(first.tokenizer.eog_token_ids)
    timings: list[dict] = []

    def run_one(k: int, text: str, arrivals: Arrivals | None = None, max_tokens: int = args.max_tokens) -> None:
        s = sessions[k]
        r = s._session.generate(first.tokenize(text), max_tokens=max_tokens, stop_tokens=stops,
                                callback=(lambda t: arrivals.add(len(t)) or True) if arrivals else None,
                                draft=s._draft, mtp=s._mtp, batcher=s._batcher)
        timings.append(r["timings"])

    for k in range(n_streams):  # warm-up: pages, graphs, auto's first measurements
        run_one(k, prompts[k % len(prompts)], max_tokens=8)
    run = decoding_together if args.decode_only else together
    for _ in range(args.warm_passes):  # untimed: what the sessions and the batch learn stays (a server past them)
        run(n_streams, prompts, run_one)
    timings.clear()
    row = run(n_streams, prompts, run_one)
    if timings and "auto_chain" in timings[0]:
        spec = sum(t["auto_chain"] + t["auto_tree"] for t in timings)
        row["spec_rounds"] = spec / max(1, spec + sum(t["auto_plain"] + t["auto_skipped"] for t in timings))
    if timings and "n_rounds" in timings[0]:
        rounds = sum(t["n_rounds"] for t in timings)
        row["tau"] = (sum(t["draft_n_accepted"] for t in timings) + rounds) / rounds if rounds else 1.0
    first.close()
    return row


def run_llama(pair: dict, n_draft: int, n_streams: int, prompts: list[str], args, log: Path) -> dict:
    import httpx

    draft = pair["draft"] if n_draft and not pair.get("mtp") else None
    with peer.llama_server(pair["target"], n_streams, args.threads, 2048, log, draft, n_draft,
                           mtp=bool(n_draft and pair.get("mtp")), n_gpu_layers=args.n_gpu_layers) as url, \
            httpx.Client(base_url=url, timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        # (a connection per request: llama-server closes a kept-alive one after a stream, which httpx would reuse)

        def run_one(k: int, text: str, arrivals: Arrivals | None = None, max_tokens: int = args.max_tokens) -> None:
            body = {"prompt": text, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "stream": True,
                    "cache_prompt": True, "id_slot": k}
            with http.stream("POST", "/completion", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and arrivals is not None:
                        event = json.loads(line[6:])
                        if event.get("content") or event.get("tokens"):
                            arrivals.add(max(1, len(event.get("tokens") or [0])))

        for k in range(n_streams):
            run_one(k, prompts[k % len(prompts)], max_tokens=8)
        return (decoding_together if args.decode_only else together)(n_streams, prompts, run_one)


def print_row(n: int, label: str, r: dict, base: dict) -> None:
    tau = f"{r['tau']:.2f}" if "tau" in r else "-"
    spec = f"{100 * r['spec_rounds']:.0f}%" if "spec_rounds" in r else "-"
    print(f"  {n:>3} {label:<16} {r['aggregate']:9.1f} {r['aggregate'] / base['aggregate']:8.2f} "
          f"{r['ttft']:8.1f} {r['p50']:7.1f} {r['p95']:7.1f} {tau:>5} {spec:>6}", flush=True)


def run_round(pair: dict, engines: list, n: int, prompts: list[str], args, logs: Path) -> dict:
    """one run of every engine at n streams, in turn: ours, then llama-server's plain and DFlash at each n_max"""
    own = own_cost_caches(args.warm_costs)
    rows = {label: run_ours(pair, kw, batched, n, prompts, args, lambda label=label: own(f"{label} {n}"))
            for label, kw, batched in engines}
    if not args.no_llama:
        rows["llama plain"] = run_llama(pair, 0, n, prompts, args, logs / f"llama-server-{n}-plain.log")
        method = "mtp" if pair.get("mtp") else "dflash"
        for n_max in [int(x) for x in args.llama_n_max.split(",")]:
            rows[f"llama {method} {n_max}"] = run_llama(pair, n_max, n, prompts, args,
                                                        logs / f"llama-server-{n}-{method}{n_max}.log")
    return rows


def mean_row(runs: list[dict]) -> dict:
    return {key: statistics.mean(r[key] for r in runs) for key in runs[0]}


def bench_pair(pair: dict, prompts: list[str], args, logs: Path) -> None:
    print(f"\n{pair['name']}")
    print(f"  {'N':>3} {'engine':<16} {'aggregate':>9} {'/ plain':>8} {'ttft ms':>8} {'itl p50':>7} {'p95':>7} "
          f"{'tau':>5} {'spec':>6}")
    engines = [e for e in (ENGINES_MTP if pair.get("mtp") else ENGINES)
               if not args.engines or e[0] in args.engines.split(",")]
    method = "mtp" if pair.get("mtp") else "dflash"
    for n in [int(x) for x in args.streams.split(",")]:
        # --rounds R: every engine R times, alternating (the machine's speed drifts), means reported
        rounds = [run_round(pair, engines, n, prompts, args, logs) for _ in range(args.rounds)]
        rows = {label: mean_row([r[label] for r in rounds]) for label in rounds[0]}
        if not args.no_llama:
            spec = [label for label in rows if label.startswith(f"llama {method} ")]
            rows[f"llama {method}"] = max((rows[label] for label in spec), key=lambda r: r["aggregate"])
        for label, r in rows.items():
            print_row(n, label, r, rows[engines[0][0]])
        if not args.no_llama:
            print(f"  {n:>3} {against_llama(rows, engines, method)}", flush=True)


def against_llama(rows: dict, engines: list, method: str) -> str:
    """auto's aggregate, and our best batched engine's, over llama-server's best (its plain or its best draft
    length)"""
    llama = max(rows["llama plain"]["aggregate"], rows[f"llama {method}"]["aggregate"])
    batched = [label for label, _, is_batched in engines if is_batched]
    best = max(batched, key=lambda label: rows[label]["aggregate"])
    line = f"our best batched ({best}) / llama-server's best: {rows[best]['aggregate'] / llama:.2f}x"
    auto = next((label for label in batched if label.endswith("auto")), None)
    return f"{auto} / llama-server's best: {rows[auto]['aggregate'] / llama:.2f}x; {line}" if auto else line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="compute threads in all (shared by the streams)")
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--pairs", default="realistic")
    ap.add_argument("--archs", default="qwen3,qwen35")
    ap.add_argument("--kinds", default="q4mix", help="cost-realistic target types (q8_0, q4mix)")
    ap.add_argument("--n-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--llama-n-max", default="3,7", help="llama-server DFlash (MTP) draft lengths tried")
    ap.add_argument("--no-llama", action="store_true", help="ours only")
    ap.add_argument("--rounds", type=int, default=1, help="runs of every engine, alternating; means reported")
    ap.add_argument("--engines", default="", help="ours, by label (comma-separated; the first is the ratios' base); "
                    "default: all")
    ap.add_argument("--cache-dir", type=Path, default=ROOT / "build" / "inflated")
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0,
                    help="layers on the GPU, ours and llama-server's (-1: all)")
    ap.add_argument("--warm-costs", action="store_true",
                    help="every engine's sessions restore what the user's cost cache holds (default: each engine its "
                         "own, fresh: what earlier runs and other engines learnt does not steer auto)")
    ap.add_argument("--warm-passes", type=int, default=0,
                    help="untimed runs of the timed workload before it, each engine keeping what its sessions and "
                         "batch learnt (auto's costs, acceptance, the batch's step times: a server past its first "
                         "requests; default 0: a fresh one)")
    ap.add_argument("--decode-only", action="store_true", help="one request per stream, its prompt evaluated "
                    "before the clock starts: decoding's aggregate alone")
    add_width_argument(ap)
    args = ap.parse_args()
    archs, kinds = args.archs.split(","), args.pairs.split(",")
    pairs = ([p for p in tiny_pairs(archs) if "q8_0" in p["name"]] if "tiny" in kinds else []) + \
            (cost_realistic_pairs(args.cache_dir, archs, kinds=tuple(args.kinds.split(",")), n_embd=args.n_embd)
             if "realistic" in kinds else []) + \
            (mtp_pairs(args.cache_dir, archs, args.n_embd) if "mtp" in kinds else [])
    prompts = [r["text"] for r in prompt_rows("code", PAIRS_DIR)[:args.n_prompts]]
    print(f"{len(prompts)} held-out code prompts x {args.max_tokens} tokens per stream, greedy, "
          f"{args.threads} threads in all" + (" (decoding only: one request per stream, its prompt cached)"
                                              if args.decode_only else ""))
    logs = ROOT / "build" / "bench_parallel"  # llama-server's logs, kept
    logs.mkdir(parents=True, exist_ok=True)
    for pair in pairs:
        bench_pair(pair, prompts, args, logs)


if __name__ == "__main__":
    main()
