#!/usr/bin/env python3
"""What to verify per round: plain decoding, DFlash chains, DDTree trees and auto, against llama.cpp's DFlash,
on the same GGUFs and machine.

Pairs:
- cost-realistic: each committed trained target (tests/data/pairs, f32) inflated to a ~0.3B-parameter model's
  cost with exactly the same function (pydflash.convert.inflate: FFNs widened to 32768 units and 12 layers
  appended, all with zero output projections), in q8_0 and in "q4mix" (q4_0 appended layers, q8_0 trained
  ones), with the committed q8_0 drafter; built once into --cache-dir;
- tiny: the committed f16 and q8_0 pairs themselves (overhead-bound: a 2-6M-parameter model).

Engines, one row each: pydflash plain, chain at blocks 4/8/16, tree at budgets 4/8/16/32/63 (DDTree's
best-first order; at 16 and 63 also with the drafter's top-1 chain inserted first, as lucebox does), auto; llama.cpp
plain (`llama-completion`) and DFlash (`llama-speculative-simple --spec-type draft-dflash`) at draft lengths
3/7/15. Prompts are the held-out code prompts; for each prompt every pydflash engine runs in turn (interleaved,
so that this VM's slow and fast moments spread over all of them).

Columns: decode tokens/s (prefill excluded; pydflash: (tokens - 1) / decode time, the first token coming from
the prefill pass; llama.cpp: its "decoded N tokens in S seconds" and "eval time ... runs"), tau (tokens
committed per verify round, bonus included), verified tokens per committed token (the verify work), and the
ratio to our plain decoding and to llama.cpp's best DFlash row of the same pair.

    python benchmarks/bench_tree.py                        # all pairs, 8 prompts x 96 tokens
    python benchmarks/bench_tree.py --pairs realistic --n-prompts 4
    python benchmarks/bench_tree.py --skip-peer            # pydflash rows only
    python benchmarks/bench_tree.py --pairs tiny --archs qwen35 --budgets 22,63,127,255 --skip-peer
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tools"))

import peer  # noqa: E402
from export_pairs import PAIRS_DIR, pair_file, prompt_rows  # noqa: E402

import gguf  # noqa: E402

import pydflash  # noqa: E402
from pydflash import _core  # noqa: E402
from pydflash.convert.inflate import inflate_gguf  # noqa: E402

# (label, Model keyword arguments); None = plain decoding
OURS = [("plain", None),
        ("chain 4", dict(spec_mode="chain", block_size=4)),
        ("chain 8", dict(spec_mode="chain", block_size=8)),
        ("chain 16", dict(spec_mode="chain")),
        *[(f"tree {b}", dict(spec_mode="tree", tree_budget=b)) for b in (4, 8, 16, 32, 63)],
        # the drafter's top-1 chain inserted first (lucebox's pre-seed) instead of DDTree's own order
        *[(f"tree {b} chain-seed", dict(spec_mode="tree", tree_budget=b, tree_seed="chain")) for b in (16, 63)],
        ("auto", dict(spec_mode="auto"))]
LLAMA_DRAFT = (3, 7, 15)


def cost_realistic_pairs(cache: Path, archs, kinds=("q8_0", "q4mix"), source: str = "f32",
                         label: str = "0.3B cost", n_embd: int | None = None) -> list[dict]:
    """Each arch's committed target (in `source`) inflated into each of `kinds` (built once into `cache`), with the
    committed q8_0 drafter; n_embd: at that hidden width, the drafter widened with it (inflated())."""
    pairs = []
    for arch in archs:
        width = hidden_width(pair_file(arch, "target", source), n_embd)
        for kind in kinds:
            pairs.append({"name": f"{arch} {kind} ({label}{f', width {width}' if width else ''})", "arch": arch,
                          "target": inflated(cache, pair_file(arch, "target", source), f"{arch}-inflated", kind,
                                             width),
                          "draft": drafter_of(cache, arch, "dflash", width), "n_embd": width})
    return pairs


def embedding_length(path: Path) -> int:
    fields = gguf.GGUFReader(path).fields
    return int(fields[f"{fields['general.architecture'].contents()}.embedding_length"].contents())


def hidden_width(path: Path, n_embd: int | None) -> int | None:
    """n_embd, or None where it is the model's own (or None)."""
    return None if n_embd in (None, embedding_length(path)) else n_embd


def inflated(cache: Path, source: Path, name: str, kind: str, n_embd: int | None) -> Path:
    """`source` (a target) inflated to `kind` (built once into `cache`); n_embd: at that hidden width
    (hidden_width()), its FFN units scaled down as the width grows (the cost stays ~0.3B, as at its own width)."""
    target = cache / (f"{name}-{kind}.gguf" if n_embd is None else f"{name}-w{n_embd}-{kind}.gguf")
    if not target.exists():
        print(f"building {target.name} (once) ...", flush=True)
        kw = {}
        if n_embd is not None:
            width = embedding_length(source)
            kw = dict(n_embd=n_embd, n_ff=32768 * width // n_embd, n_ff_exp=8192 * width // n_embd,
                      n_ff_shexp=8192 * width // n_embd)
        inflate_gguf(source, target, kind, **kw)
    return target


def drafter_of(cache: Path, arch: str, drafter: str, n_embd: int | None) -> Path:
    """The committed q8_0 drafter (`drafter`: dflash or dflash2) of `arch`; n_embd: widened to that hidden width
    (hidden_width(); built once into `cache`), as its inflated target."""
    committed = pair_file(arch, drafter, "q8_0")
    if n_embd is None:
        return committed
    path = cache / f"{arch}-{drafter}-w{n_embd}-q8_0.gguf"
    if not path.exists():
        print(f"building {path.name} (once) ...", flush=True)
        inflate_gguf(committed, path, "q8_0", n_embd=n_embd)
    return path


def add_width_argument(ap) -> None:
    ap.add_argument("--n-embd", type=int, default=768,
                    help="the cost-realistic targets' hidden width, a multiple of the trained pairs' 192 (default "
                         "768: the stream in whole copies, the FFN units scaled to keep ~0.3B cost, the drafters "
                         "widened with them; 192: the trained width, whose cost per verified row on a CPU is not a "
                         "real model's: docs/benchmarks.md)")


def tiny_pairs(archs) -> list[dict]:
    return [{"name": f"{arch} {t} (tiny)", "arch": arch, "target": pair_file(arch, "target", t),
             "draft": pair_file(arch, "dflash", t)} for arch in archs for t in ("f16", "q8_0")]


def own_cost_caches(warm: bool):
    """A context per engine label in which pydflash reads and writes its cost cache (cost_cache.py): each engine's
    own, empty at the start of the run, so that what one engine (or an earlier run) measured does not steer
    another's auto; warm: the user's cache, shared (what a machine's second run sees)."""
    root = Path(tempfile.mkdtemp(prefix="pydflash-costs-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)

    @contextlib.contextmanager
    def own(label: str):
        if warm:
            yield
            return
        before = os.environ.get("PYDFLASH_CACHE")
        os.environ["PYDFLASH_CACHE"] = str(root / label.replace(" ", "_"))
        try:
            yield
        finally:
            if before is None:
                del os.environ["PYDFLASH_CACHE"]
            else:
                os.environ["PYDFLASH_CACHE"] = before
    return own


def measured_widths(traced: list[dict]) -> dict:
    """Traced rounds' mean verify ms by chain width (trees apart, as "<w>t"): what the cost model's learnt times
    should come near."""
    by = {}
    for r in traced:
        by.setdefault(f"{r['width']}{'t' if r['tree'] else ''}", []).append(r["verify_ms"])
    return {w: (sum(v) / len(v), len(v)) for w, v in sorted(by.items(), key=lambda kv: int(kv[0].rstrip("t")))}


def run_ours(pair: dict, prompts: list[str], args, engines=OURS, generate_kwargs=lambda i: {}) -> dict:
    """Each engine (label, Model keyword arguments, with the pair's drafter unless they say draft_model_path; the
    first: plain) over the prompts, interleaved; generate_kwargs(i): what prompt i's generate() takes besides the
    prompt and max_tokens."""
    models = {}
    own = own_cost_caches(getattr(args, "warm_costs", False))
    for label, kw in engines:
        # (plain: no proposer at all, not even a target's own MTP head)
        kw = {"draft_model_path": None, "proposers": ()} if kw is None else {"draft_model_path": pair["draft"], **kw}
        with own(label):
            models[label] = pydflash.Model(pair["target"], n_ctx=2048, n_threads=args.threads,
                                           n_gpu_layers=getattr(args, "n_gpu_layers", 0), **kw)
            # warm-up: pages, graphs, auto's calibration
            models[label].generate(prompts[0], max_tokens=8, **generate_kwargs(0))
    for _ in range(getattr(args, "warm_passes", 0)):  # untimed: what auto learns over them stays in its Model
        for i, text in enumerate(prompts):
            for label, _ in engines:
                with own(label):
                    models[label].generate(text, max_tokens=args.max_tokens, **generate_kwargs(i))
    totals = {label: {"tokens": 0, "ms": 0.0, "committed": 0, "rounds": 0, "verified": 0, "draft_ms": 0.0,
                      "verify_ms": 0.0, "outputs": [], "traced": []} for label, _ in engines}
    _core.trace_rounds(True)  # every round's width, verify time and graph builds (decode/round_trace.h)
    _core.traced_rounds()
    for i, text in enumerate(prompts):
        for label, _ in engines:  # interleaved
            with own(label):
                c = models[label].generate(text, max_tokens=args.max_tokens, **generate_kwargs(i))
            t, acc = c.timings, totals[label]
            acc["traced"] += _core.traced_rounds()
            acc["tokens"] += max(0, len(c.tokens) - 1)
            acc["ms"] += t["predicted_ms"]
            acc["outputs"].append(c.tokens)
            if "n_rounds" in t:
                acc["committed"] += t["draft_n_accepted"] + t["n_rounds"]
                acc["rounds"] += t["n_rounds"]
                acc["verified"] += t["verify_n"]
                acc["draft_ms"] += t["draft_ms"]
                acc["verify_ms"] += t["verify_ms"]
            if "auto" in label.split():
                acc.setdefault("auto", {})
                for k in ("auto_skipped", "auto_plain", "auto_chain", "auto_tree"):
                    acc["auto"][k] = acc["auto"].get(k, 0) + t[k]
            for name, by in t.get("by_proposer", {}).items():  # merged proposers: the rounds each drafted in
                acc.setdefault("ran", {})
                acc["ran"][name] = acc["ran"].get(name, 0) + by["ran"]
    _core.trace_rounds(False)
    rows = {}
    plain_out = totals[engines[0][0]]["outputs"]
    for label, acc in totals.items():
        row = {"tok_s": 1000.0 * acc["tokens"] / acc["ms"] if acc["ms"] else 0.0}
        if acc["rounds"]:
            row["tau"] = acc["committed"] / acc["rounds"]
            row["verified_per_token"] = acc["verified"] / acc["committed"]
            # a speculative round's drafting and verify (the rest of the time: plain steps, commits, the walk)
            row["round_ms"] = {"draft": acc["draft_ms"] / acc["rounds"], "verify": acc["verify_ms"] / acc["rounds"]}
        row["same_as_plain"] = sum(a == b for a, b in zip(acc["outputs"], plain_out))
        if acc["traced"]:
            row["builds_per_eval"] = sum(r["builds"] for r in acc["traced"]) / len(acc["traced"])
        if "auto" in acc:
            row["auto"] = acc["auto"]
            row["measured_verify_ms"] = measured_widths(acc["traced"])
        if "ran" in acc:
            row["ran"] = acc["ran"]
        rows[label] = row
    for label, m in models.items():
        if m._draft is not None and "auto" in label.split():
            # what auto learnt a verify costs, by width (ms): the times its choices rest on
            rows[label]["learnt_verify_ms"] = {w: round(ms, 3) for w, ms in m._draft.costs()["verify_ms"].items()}
        m.close()
    return rows


def run_llama(pair: dict, prompts: list[str], args, tmp: Path) -> dict:
    files = [peer.prompt_file(tmp / f"p{i}.txt", t) for i, t in enumerate(prompts)]
    ngl = getattr(args, "n_gpu_layers", 0)
    rows = {}
    try:
        ar = [peer.llama_ar(pair["target"], f, args.max_tokens, args.threads, 2048, n_gpu_layers=ngl)
              for f in files]
        rows["llama.cpp plain"] = {"tok_s": 1000.0 * sum(r["tokens"] for r in ar) / sum(r["ms"] for r in ar)}
    except peer.PeerError as e:
        rows["llama.cpp plain"] = {"error": str(e)}
    for n in LLAMA_DRAFT:
        label = f"llama.cpp dflash {n}"
        try:
            rs = [peer.llama_dflash(pair["target"], pair["draft"], f, args.max_tokens, args.threads, 2048, n,
                                    n_gpu_layers=ngl) for f in files]
        except peer.PeerError as e:
            rows[label] = {"error": str(e)}
            continue
        n_predict = sum(r["n_predict"] for r in rs)
        rounds = sum(r["rounds"] for r in rs)
        rows[label] = {"tok_s": 1000.0 * sum(r["tokens"] for r in rs) / sum(r["ms"] for r in rs),
                       "tau": n_predict / rounds, "verified_per_token": (rounds + sum(r["n_drafted"] for r in rs))
                       / n_predict}
    return rows


def print_pair(name: str, rows: dict, best_of: str = "llama.cpp dflash") -> None:
    """The rows of one pair, with the ratio to our plain decoding and to the best llama.cpp row whose label starts
    with `best_of`."""
    plain = rows["plain"]["tok_s"]
    llama = [r["tok_s"] for k, r in rows.items() if k.startswith(best_of) and "tok_s" in r]
    best_llama = max(llama) if llama else 0.0
    w = max(22, *(len(label) for label in rows))
    print(f"\n{name}")
    print(f"  {'engine':<{w}} {'tok/s':>8} {'tau':>6} {'verif/tok':>10} {'/ plain':>8} {'/ llama best':>13}  notes")
    for label, r in rows.items():
        if "error" in r:
            print(f"  {label:<{w}} {'-':>8}  ({r['error']})")
            continue
        tau = f"{r['tau']:.2f}" if "tau" in r else "-"
        vpt = f"{r['verified_per_token']:.2f}" if "verified_per_token" in r else "-"
        vs_llama = f"{r['tok_s'] / best_llama:.2f}" if best_llama else "-"
        notes = []
        if "same_as_plain" in r and label != "plain":
            notes.append(f"same output {r['same_as_plain']}/{rows['plain']['same_as_plain']}")
        if "auto" in r:
            notes.append(" ".join(f"{k[5:]} {v}" for k, v in r["auto"].items()))
        if "round_ms" in r:
            notes.append(f"per round draft {r['round_ms']['draft']:.2f} + verify {r['round_ms']['verify']:.2f} ms")
        if "learnt_verify_ms" in r:
            notes.append("learnt verify ms " + " ".join(f"{w}:{ms:.2f}" for w, ms in r["learnt_verify_ms"].items()))
        if "measured_verify_ms" in r:  # width: mean ms (rounds)
            notes.append("measured " + " ".join(f"{w}:{ms:.2f}({n})" for w, (ms, n) in r["measured_verify_ms"].items()))
        if r.get("builds_per_eval"):
            notes.append(f"graph builds/eval {r['builds_per_eval']:.2f}")
        if "ran" in r:  # the share of its rounds each merged proposer drafted in
            n = sum(r["auto"].values())
            notes.append("drafted in " + ", ".join(f"{k} {v / n:.0%}" for k, v in r["ran"].items()))
        print(f"  {label:<{w}} {r['tok_s']:8.1f} {tau:>6} {vpt:>10} {r['tok_s'] / plain:8.2f} {vs_llama:>13}  "
              f"{'; '.join(notes)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default="realistic,tiny", help="realistic, tiny or both (comma-separated)")
    ap.add_argument("--archs", default="qwen3,qwen35")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0,
                    help="layers on the GPU (-1: all), ours and llama.cpp's alike (a GPU build of each)")
    ap.add_argument("--cache-dir", type=Path, default=ROOT / "build" / "inflated")
    ap.add_argument("--skip-peer", action="store_true", help="pydflash rows only")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--warm-costs", action="store_true",
                    help="every engine reads and writes the user's cost cache (default: each its own, fresh: what "
                         "earlier runs and other engines measured does not steer auto)")
    ap.add_argument("--warm-passes", type=int, default=0,
                    help="untimed passes over the prompts before the timed one, each engine keeping what it learnt "
                         "(auto's costs and cool-down: a process past its first tokens; default 0: a fresh one)")
    ap.add_argument("--budgets", default=None,
                    help="only plain and tree mode at these budgets, e.g. 22,63,127,255 (tau by budget)")
    ap.add_argument("--engines", default=None, help="comma-separated labels of ours to run (default: all; plain "
                                                      "always)")
    ap.add_argument("--auto-budgets", default=None,
                    help="also auto with these tree budgets, e.g. 127,255 (rows 'auto 127', ...: what the cost model "
                         "takes when a larger budget is allowed)")
    ap.add_argument("--kinds", default="q8_0,q4mix", help="the cost-realistic pairs' types")
    ap.add_argument("--draft", type=Path, default=None, help="this drafter GGUF for every pair (e.g. a DFlash2 one)")
    add_width_argument(ap)
    args = ap.parse_args()
    engines = OURS if args.budgets is None else [("plain", None)] + [
        (f"tree {b}", dict(spec_mode="tree", tree_budget=int(b))) for b in args.budgets.split(",")]
    if args.auto_budgets:
        engines = engines + [(f"auto {b}", dict(spec_mode="auto", tree_budget=int(b)))
                             for b in args.auto_budgets.split(",")]
    if args.engines:
        engines = [e for e in engines if e[0] == "plain" or e[0] in args.engines.split(",")]
    archs = args.archs.split(",")
    kinds = args.pairs.split(",")
    pairs = (cost_realistic_pairs(args.cache_dir, archs, kinds=tuple(args.kinds.split(",")), n_embd=args.n_embd)
             if "realistic" in kinds else []) + (tiny_pairs(archs) if "tiny" in kinds else [])
    for pair in pairs if args.draft else []:
        pair["draft"], pair["name"] = args.draft, f"{pair['name']}, drafter {args.draft.name}"
    prompts = [r["text"] for r in prompt_rows("code", PAIRS_DIR)[:args.n_prompts]]
    print(f"{len(prompts)} held-out code prompts x {args.max_tokens} tokens, greedy, {args.threads} threads")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in pairs:
            rows = run_ours(pair, prompts, args, engines)
            if not args.skip_peer:
                rows.update(run_llama(pair, prompts, args, Path(tmp)))
            results[pair["name"]] = rows
            print_pair(pair["name"], rows)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
