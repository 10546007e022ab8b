#!/usr/bin/env python3
"""DFlash speculative decoding speed: pydflash against llama.cpp built from the same pinned sdist. Three tables:

1. End to end on the committed pairs (tests/data/pairs/{qwen3,qwen35}-{target,dflash}-{type}.gguf), code and
   prose prompts: pydflash AR, pydflash DFlash, llama.cpp AR (`llama-completion`) and llama.cpp DFlash
   (`llama-speculative-simple --spec-type draft-dflash`): tokens/s, tau, target passes per generated token.
2. Cost ratios on larger random-weight GGUFs of both architectures (~0.6B Qwen3, ~0.8B Qwen3.5 hybrid, q4_0 and
   q8_0, each with a random DFlash draft; timing does not depend on the weights): t(verify B tokens) / t(AR step)
   and t(draft) / t(AR step), ours and llama.cpp's.
3. The projected speed-up tau * t_AR / (t_draft + t_verify) from those ratios, for the committed pairs' measured
   tau (table 1) and for published tau values.

    python benchmarks/bench_dflash.py                               # all three tables (2 threads)
    python benchmarks/bench_dflash.py --skip-ratios --n-prompts 2   # table 1 only, quick
    python benchmarks/bench_dflash.py --skip-e2e --ratio-shapes tiny --threads 1   # tables 2-3, tiny shapes
    python benchmarks/bench_dflash.py --skip-peer                   # pydflash columns only

How each number is taken (greedy everywhere, same GGUF files, same thread count, one run per prompt and engine):
- tokens/s counts the tokens that decode-phase work produced, over the decode-phase time (prefill excluded):
  pydflash AR: target evaluations / predicted_ms; pydflash DFlash: (predicted_n - 1) / predicted_ms (the first
  token comes from the prefill pass); llama.cpp AR: `eval time = T ms / N runs` of llama-completion (N single-token
  decodes); llama.cpp DFlash: `decoded N tokens in S seconds` (its first verify pass also evaluates the last
  prompt token, which is where the first token comes from). Totals over the prompts, then divided.
- tau = committed tokens per verify round (accepted drafts + the target's bonus token): pydflash from its timings,
  llama.cpp as n_predict / rounds with rounds = n_predict - n_accept (each round adds accepted + 1).
- target passes per token: pydflash n_target_evals / tokens; llama.cpp rounds / n_predict (one target decode per
  round; on targets that need checkpoints a partly accepted round costs a second pass, flagged in the notes).
- table 2, pydflash: from `Model.generate` timings, i.e. what the loop itself does: t_AR = predicted_ms /
  n_target_evals of a plain run, t_verify = verify_ms / n_rounds (one B-token target pass with per-token argmax
  and the draft's feature capture), t_draft = draft_ms / n_rounds (appending the new context rows to the drafter
  and drafting one block); median over --ratio-reps runs. With random weights nothing is accepted, so every round
  verifies a full block.
- table 2, llama.cpp: t_AR from `llama-bench -n G -d P` (tg at the same depth); t_verify from two
  llama-speculative-simple runs of different length with the same random pair: the difference of the target's
  `prompt eval time` (multi-token decodes = the verify batches; the prompt batch cancels) over the difference of
  rounds, so that only full (B-token, all rows output) blocks count; t_draft = dur(g) / #calls(g) of its `-lv 4`
  statistics line (one draft decode of the B-token block; the feature injection into the draft KV cache runs
  in `process()` after each verify and is *not* in it, unlike ours). `llama-bench -p B -d P` (pp B, last-row
  logits only) is printed for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tools"))

import peer  # noqa: E402
from export_pairs import PAIRS_DIR, pair_file, prompt_rows  # noqa: E402
from random_gguf import (HYBRID_SHAPES, SHAPES, default_draft_layers, write_random_dflash,  # noqa: E402
                         write_random_qwen3, write_random_qwen35)

import pydflash  # noqa: E402
from pydflash import _core  # noqa: E402

ARCHS = ("qwen3", "qwen35")
PROMPT_SETS = ("code", "prose")
# published tau (mean committed tokens per round, bonus included), from ../shared/reference/anchors.md
PUBLISHED_TAU = [
    ("L-HE", 8.31, "lucebox dflash27b, Qwen3.5-27B Q4_K_M, HumanEval, DDTree budget 22, RTX 3090 (anchors.md §3.1)"),
    ("L-HEc", 7.67, "lucebox dflash27b, Qwen3.5-27B Q4_K_M, chain DFlash (no tree), RTX 3090 (anchors.md §3.1)"),
    ("P-Q35", 9.1, "DFlash paper Tab. 11, Qwen3.5-27B, HumanEval, SGLang B200 (anchors.md §1.2)"),
    ("P-HE", 6.50, "DFlash paper Tab. 1, Qwen3-8B DFlash(16), HumanEval, T=0 (anchors.md §1.1)"),
    ("P-MT", 4.24, "DFlash paper Tab. 1, Qwen3-8B DFlash(16), MT-Bench, T=0 (anchors.md §1.1)"),
]
# prompt for the random-weight llama.cpp runs (and, tokenized, ours): any text, ~P tokens
FILLER = ("The committee met on Tuesday to review the budget for the coming year, and after a long discussion "
          "about roads, schools and the new library, it agreed to publish a summary for the residents. ")


# ---------------------------------------------------------------------------------------------------------------
# table 1: end to end on the committed pairs


def _agg(runs: list[dict], *, tau_from=None) -> dict:
    tokens = sum(r["tokens"] for r in runs)
    ms = sum(r["ms"] for r in runs)
    passes = sum(r["passes"] for r in runs)
    out = {"tokens": tokens, "ms": ms, "tok_s": 1000.0 * tokens / ms if ms > 0 else 0.0,
           "passes_per_token": passes / tokens if tokens else 0.0, "n_prompts": len(runs)}
    if tau_from is not None:
        committed, rounds = tau_from(runs)
        out["tau"] = committed / rounds if rounds else 0.0
    return out


def e2e_pair(arch: str, wtype: str, args, tmp: Path) -> list[dict]:
    """Table-1 rows for one committed pair: per prompt set, the four engines."""
    target = pair_file(arch, "target", wtype, args.pairs_dir)
    draft = pair_file(arch, "dflash", wtype, args.pairs_dir)
    missing = [p.name for p in (target, draft) if not p.exists()]
    if missing:
        print(f"{arch + ' ' + wtype:<12} (missing in {args.pairs_dir}: {', '.join(missing)})")
        return []
    n_ctx = 4096
    model = pydflash.Model(target, draft_model_path=draft, n_threads=args.threads, n_ctx=n_ctx, spec_mode="chain")
    n_draft = model.block_size - 1
    model.generate("def f(x):", max_tokens=4, speculative=True)  # warm-up: weights paged in, graphs allocated
    model.generate("def f(x):", max_tokens=4, speculative=False)
    rows = []
    for pset in PROMPT_SETS:
        pfile = args.pairs_dir / f"prompts_{pset}.jsonl"
        if not pfile.exists():
            print(f"{arch + ' ' + wtype:<12} {pset:<6} (no {pfile.name} in {args.pairs_dir})")
            continue
        prompts = prompt_rows(pset, args.pairs_dir)[:args.n_prompts]
        ours_ar, ours_df, mismatched = [], [], []
        for p in prompts:
            ar = model.generate(p["text"], max_tokens=args.max_tokens, speculative=False)
            df = model.generate(p["text"], max_tokens=args.max_tokens, speculative=True)
            t, s = ar.timings, df.timings
            ours_ar.append({"ms": t["predicted_ms"], "tokens": t["n_target_evals"], "passes": t["n_target_evals"]})
            ours_df.append({"ms": s["predicted_ms"], "tokens": max(0, s["predicted_n"] - 1),
                            "passes": s["n_target_evals"], "accepted": s["draft_n_accepted"],
                            "rounds": s["n_rounds"]})
            if ar.tokens != df.tokens:
                mismatched.append(p["id"])
        result = {"arch": arch, "type": wtype, "prompts": pset, "n_prompts": len(prompts), "engines": {}}
        eng = result["engines"]
        eng["pydflash AR"] = _agg(ours_ar)
        eng["pydflash DFlash"] = _agg(ours_df, tau_from=lambda rs: (sum(r["accepted"] + r["rounds"] for r in rs),
                                                                     sum(r["rounds"] for r in rs)))
        eng["pydflash DFlash"]["outputs_differ_from_AR"] = mismatched
        if args.skip_peer:
            eng["llama.cpp AR"] = {"error": "skipped (--skip-peer)"}
            eng["llama.cpp DFlash"] = {"error": "skipped (--skip-peer)"}
        else:
            files = [peer.prompt_file(tmp / f"{arch}-{pset}-{i}.txt", p["text"]) for i, p in enumerate(prompts)]
            for name, fn in (("llama.cpp AR",
                              lambda f: peer.llama_ar(target, f, args.max_tokens, args.threads, n_ctx)),
                             ("llama.cpp DFlash", lambda f: peer.llama_dflash(target, draft, f, args.max_tokens,
                                                                         args.threads, n_ctx, n_draft))):
                try:
                    runs = [fn(f) for f in files]
                except peer.PeerError as e:
                    eng[name] = {"error": str(e)}
                    continue
                if name == "llama.cpp AR":
                    eng[name] = _agg(runs)
                else:
                    eng[name] = _agg(runs, tau_from=lambda rs: (sum(r["n_predict"] for r in rs),
                                                                sum(r["rounds"] for r in rs)))
                    if any(r["checkpoints"] for r in runs):
                        eng[name]["note"] = ("target uses checkpoints: partly accepted rounds cost a second pass "
                                             "not counted here")
        print_e2e_rows(result)
        rows.append(result)
    model.close()
    return rows


def print_e2e_header() -> None:
    print("\n1. End to end on the committed pairs, code and prose prompts: pydflash AR, pydflash DFlash, llama.cpp AR "
          "and llama.cpp DFlash (`llama-speculative-simple --spec-type draft-dflash`, built from the pinned sdist): "
          "tokens/s, tau, target passes per generated token.")
    header = (f"{'pair':<12} {'prompts':<7} {'engine':<17} {'tokens/s':>9} {'tau':>6} {'passes/tok':>10} "
              f"{'tokens':>7}  note")
    print(header)
    print("-" * len(header))


def print_e2e_rows(r: dict) -> None:
    label = f"{r['arch']} {r['type']}"
    for name, e in r["engines"].items():
        if "error" in e:
            print(f"{label:<12} {r['prompts']:<7} {name:<17} {'-':>9} {'-':>6} {'-':>10} {'-':>7}  {e['error']}")
            continue
        tau = f"{e['tau']:6.2f}" if "tau" in e else f"{'-':>6}"
        note = e.get("note", "")
        if e.get("outputs_differ_from_AR"):
            note = f"output differs from pydflash AR on {','.join(e['outputs_differ_from_AR'])}"
        print(f"{label:<12} {r['prompts']:<7} {name:<17} {e['tok_s']:9.1f} {tau} {e['passes_per_token']:10.3f} "
              f"{e['tokens']:7d}  {note}")
    eng = r["engines"]

    def ratio(a: str, b: str) -> str:
        x, y = eng.get(a, {}), eng.get(b, {})
        return f"{x['tok_s'] / y['tok_s']:.2f}" if x.get("tok_s") and y.get("tok_s") else "-"

    r["ratios"] = {k: ratio(*ab) for k, ab in (("pydflash DFlash / pydflash AR", ("pydflash DFlash", "pydflash AR")),
                                                ("pydflash DFlash / llama.cpp DFlash",
                                                 ("pydflash DFlash", "llama.cpp DFlash")),
                                                ("llama.cpp DFlash / llama.cpp AR",
                                                 ("llama.cpp DFlash", "llama.cpp AR")))}
    print(f"{'':<12} {'':<7} ratios: " + "   ".join(f"{k} {v}" for k, v in r["ratios"].items()))
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------------------------
# table 2: cost ratios on random-weight GGUFs


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def ratio_files(arch: str, shape: str, wtype: str, args, vocab_dir: Path) -> tuple[Path, Path, int]:
    out = args.out
    target = out / f"random-{arch}-{shape}-{wtype}.gguf"
    if not target.exists():
        print(f"  (writing {target.name})", flush=True)
        if arch == "qwen3":
            write_random_qwen3(target, shape, wtype, vocab_dir / "ggml-vocab-qwen2.gguf")
        else:
            write_random_qwen35(target, shape, wtype, vocab_dir / "ggml-vocab-qwen35.gguf")
    n_target_layers = (SHAPES if arch == "qwen3" else HYBRID_SHAPES)[shape]["n_layers"]
    n_layers = args.draft_layers or default_draft_layers(n_target_layers)
    draft = out / f"random-dflash-{arch}-{shape}-{wtype}-{n_layers}L.gguf"
    if not draft.exists():
        print(f"  (writing {draft.name})", flush=True)
        write_random_dflash(draft, target, wtype, n_layers=n_layers, block_size=args.block)
    return target, draft, n_layers


def ours_ratios(target: Path, draft: Path, prompt_text: str, args) -> dict:
    model = pydflash.Model(target, draft_model_path=draft, n_threads=args.threads, n_ctx=1024, block_size=args.block,
                           spec_mode="chain")
    prompt = model.tokenize(prompt_text)
    model.generate(prompt, max_tokens=3, speculative=True)  # warm-up
    model.generate(prompt, max_tokens=3, speculative=False)
    ar, verify, drafts, rounds_ms, tau = [], [], [], [], []
    for _ in range(args.ratio_reps):
        t = model.generate(prompt, max_tokens=args.ratio_gen, speculative=False).timings
        s = model.generate(prompt, max_tokens=args.ratio_gen, speculative=True).timings
        if t["n_target_evals"] == 0 or s["n_rounds"] == 0:
            raise RuntimeError(f"pydflash generated too little ({t['n_target_evals']} evals, {s['n_rounds']} rounds)")
        ar.append(t["predicted_ms"] / t["n_target_evals"])
        verify.append(s["verify_ms"] / s["n_rounds"])
        drafts.append(s["draft_ms"] / s["n_rounds"])
        rounds_ms.append(s["predicted_ms"] / s["n_rounds"])
        tau.append(s["tau"])
    model.close()
    return {"ar_ms": _median(ar), "verify_ms": _median(verify), "draft_ms": _median(drafts),
            "round_ms": _median(rounds_ms), "tau": _median(tau), "n_prompt": len(prompt)}


def llama_ratios(target: Path, draft: Path, prompt_file: Path, n_prompt: int, args) -> dict:
    bench = peer.llama_bench(target, args.threads, args.block, args.ratio_gen, n_prompt, args.ratio_reps)
    n_ctx = n_prompt + args.ratio_gen + args.llama_spec_extra + 64
    short = peer.llama_dflash(target, draft, prompt_file, args.ratio_gen, args.threads, n_ctx, args.block - 1)
    long = peer.llama_dflash(target, draft, prompt_file, args.ratio_gen + args.llama_spec_extra, args.threads, n_ctx,
                        args.block - 1)
    d_rounds = long["rounds"] - short["rounds"]
    if d_rounds <= 0:
        raise peer.PeerError(f"the two speculative runs have {short['rounds']} and {long['rounds']} rounds")
    calls = short["draft_calls"] + long["draft_calls"]
    return {"ar_ms": bench["ar_ms"], "pp_ms": bench["pp_ms"],
            "verify_ms": (long["target_multi_ms"] - short["target_multi_ms"]) / d_rounds,
            "draft_ms": (short["draft_ms"] + long["draft_ms"]) / calls,
            "round_ms": (long["ms"] - short["ms"]) / d_rounds,
            "tau": long["n_predict"] / long["rounds"], "checkpoints": long["checkpoints"]}


def ratio_row(label: str, engine: str, r: dict) -> str:
    if "error" in r:
        return f"{label:<18} {engine:<9}  {r['error']}"
    rv, rd = r["verify_ms"] / r["ar_ms"], r["draft_ms"] / r["ar_ms"]
    r.update(verify_over_ar=rv, draft_over_ar=rd, break_even_tau=rv + rd)
    pp = f"{r['pp_ms']:8.1f}" if "pp_ms" in r else f"{'-':>8}"
    return (f"{label:<18} {engine:<9} {r['ar_ms']:8.2f} {r['verify_ms']:10.1f} {r['draft_ms']:9.1f} "
            f"{r['round_ms']:9.1f} {pp} | {rv:8.2f} {rd:8.2f} {rv + rd:8.2f}")


def run_ratios(args) -> list[dict]:
    vocab_dir = peer.source_dir() / "models"
    args.out.mkdir(parents=True, exist_ok=True)
    B = args.block
    print(f"\n2. Cost ratios on larger random-weight GGUFs of both architectures "
          f"({' and '.join(args.ratio_types.split(','))}; timing does not depend on the weights): "
          f"t(verify B={B} tokens)/t(AR step) and t(draft)/t(AR step), ours and llama.cpp's.")
    print(f"   threads={args.threads}; prompt ~{args.ratio_prompt} tokens; pydflash: median of {args.ratio_reps} runs "
          f"of {args.ratio_gen} tokens; llama.cpp: llama-bench tg{args.ratio_gen}/pp{B} at that depth, "
          f"speculative runs of {args.ratio_gen} and {args.ratio_gen + args.llama_spec_extra} tokens. Times in ms.")
    header = (f"{'model':<18} {'engine':<9} {'t_AR':>8} {'t_verify':>10} {'t_draft':>9} {'round':>9} "
              f"{'pp' + str(B):>8} | {'verify/AR':>8} {'draft/AR':>8} {'sum':>8}")
    print(header)
    print("-" * len(header))
    rows = []
    words = FILLER.split()
    prompt_text = " ".join((words * (1 + args.ratio_prompt // len(words)))[: max(1, int(args.ratio_prompt * 0.8))])
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = peer.prompt_file(Path(tmp) / "prompt.txt", prompt_text)
        for shape in args.ratio_shapes.split(","):
            for arch in ARCHS:
                if shape not in (SHAPES if arch == "qwen3" else HYBRID_SHAPES):
                    continue
                for wtype in args.ratio_types.split(","):
                    label = f"{arch} {shape} {wtype}"
                    target, draft, n_layers = ratio_files(arch, shape, wtype, args, vocab_dir)
                    meta = _core.gguf_metadata(str(draft), ["dflash.target_layers"])
                    row = {"arch": arch, "shape": shape, "type": wtype, "draft_layers": n_layers,
                           "target_layers": meta["dflash.target_layers"][2], "target": target.name,
                           "draft": draft.name}
                    try:
                        row["pydflash"] = ours_ratios(target, draft, prompt_text, args)
                    except Exception as e:  # report, do not hide: the engine failed on this file
                        row["pydflash"] = {"error": f"failed: {type(e).__name__}: {e}"}
                    print(ratio_row(label, "pydflash", row["pydflash"]), flush=True)
                    if args.skip_peer:
                        row["llama.cpp"] = {"error": "skipped (--skip-peer)"}
                    else:
                        try:
                            n_prompt = row["pydflash"].get("n_prompt", args.ratio_prompt)
                            row["llama.cpp"] = llama_ratios(target, draft, prompt_file, n_prompt, args)
                        except (peer.PeerError, StopIteration, json.JSONDecodeError) as e:
                            row["llama.cpp"] = {"error": f"llama.cpp: {e}"}
                    print(ratio_row("", "llama.cpp", row["llama.cpp"]), flush=True)
                    rows.append(row)
    depth = "--draft-layers" if args.draft_layers else "depth in the z-lab proportion, 5 layers for a 36-layer target"
    print(f"   drafts: Qwen3 layers of the target's hidden size ({depth}), "
          f"fc over target layers picked as z-lab does (build_target_layer_ids, 5 of them), block {B}, the target's "
          f"embedding and head:")
    seen = set()
    for row in rows:
        if (row["arch"], row["shape"]) not in seen:
            seen.add((row["arch"], row["shape"]))
            print(f"     {row['arch']} {row['shape']}: {row['draft_layers']} draft layer(s), dflash.target_layers "
                  f"{row['target_layers']}")
    print("   round = whole loop round (pydflash predicted_ms / rounds; llama.cpp decode time difference / rounds "
          "difference), i.e. draft + verify + the rest of the loop.")
    return rows


# ---------------------------------------------------------------------------------------------------------------
# table 3: projection


def run_projection(ratio_rows: list[dict], e2e_rows: list[dict]) -> list[dict]:
    taus: list[tuple[str, float, str]] = []
    by_pair: dict[tuple[str, str], list[float]] = {}
    for r in e2e_rows:
        e = r["engines"].get("pydflash DFlash", {})
        if e.get("tau"):
            by_pair.setdefault((r["arch"], r["prompts"]), []).append(e["tau"])
    for (arch, pset), values in by_pair.items():
        key = f"{'Q3' if arch == 'qwen3' else 'Q35'}-{pset}"
        taus.append((key, sum(values) / len(values), f"committed {arch} pair, {pset} prompts, pydflash tau (table 1, "
                                                     f"mean over weight types)"))
    taus += PUBLISHED_TAU
    print("\n3. The projected speed-up tau * t_AR / (t_draft + t_verify) from the table-2 ratios, for the committed "
          "pairs' measured tau (table 1) and for published tau values.")
    w = max([7] + [len(k) for k, _, _ in taus])
    header = f"{'model':<18} {'engine':<9} {'break-even':>10} | " + " ".join(f"{k:>{w}}" for k, _, _ in taus)
    print(header)
    print(f"{'':<18} {'':<9} {'tau':>10} | " + " ".join(f"{v:{w}.2f}" for _, v, _ in taus))
    print("-" * len(header))
    out = []
    for row in ratio_rows:
        for engine in ("pydflash", "llama.cpp"):
            r = row.get(engine, {})
            if "break_even_tau" not in r:
                continue
            be = r["break_even_tau"]
            sp = {k: v / be for k, v, _ in taus}
            label = f"{row['arch']} {row['shape']} {row['type']}"
            print(f"{label:<18} {engine:<9} {be:10.2f} | " + " ".join(f"{x:{w - 1}.2f}x" for x in sp.values()))
            out.append({"arch": row["arch"], "shape": row["shape"], "type": row["type"], "engine": engine,
                        "break_even_tau": be, "speedup": sp})
    print("   tau sources:")
    for k, v, src in taus:
        print(f"     {k:<{w}} {v:5.2f}  {src}")
    return out


# ---------------------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs-dir", type=Path, default=PAIRS_DIR)
    ap.add_argument("--types", default="f16,q8_0", help="weight types of the committed pairs (table 1)")
    ap.add_argument("--n-prompts", type=int, default=8, help="prompts per set (table 1)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per prompt (table 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ratio-shapes", default="0.6b,0.8b",
                    help="random shapes for table 2 (qwen3: tiny, 0.6b; qwen35: tiny, 0.8b); 'tiny' runs both archs")
    ap.add_argument("--ratio-types", default="q4_0,q8_0")
    ap.add_argument("--ratio-prompt", type=int, default=64, help="prompt tokens (context depth) for table 2")
    ap.add_argument("--ratio-gen", type=int, default=16, help="tokens per timed run for table 2")
    ap.add_argument("--ratio-reps", type=int, default=3)
    ap.add_argument("--llama-spec-extra", type=int, default=32,
                    help="table 2: the second llama.cpp speculative run generates this many more tokens")
    ap.add_argument("--draft-layers", type=int, default=0,
                    help="layers of the random drafts (default: z-lab proportion, 4 for 0.6b, 3 for 0.8b)")
    ap.add_argument("--block", type=int, default=16, help="block size of the random drafts")
    ap.add_argument("--skip-peer", action="store_true", help="no llama.cpp columns")
    ap.add_argument("--skip-e2e", action="store_true", help="no table 1")
    ap.add_argument("--skip-ratios", action="store_true", help="no tables 2 and 3")
    ap.add_argument("--out", type=Path, default=HERE / "out", help="random GGUFs and the JSON results go here")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    results: dict = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                     "time": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu_count": os.cpu_count(),
                     "peer_bin": str(peer.bin_dir()), "e2e": [], "ratios": [], "projection": []}
    print(f"threads={args.threads}; llama.cpp peer: "
          f"{peer.bin_dir() if peer.binary('llama-bench') and not args.skip_peer else 'not used'}")
    if not args.skip_e2e:
        print_e2e_header()
        with tempfile.TemporaryDirectory() as tmp:
            for arch in ARCHS:
                for wtype in args.types.split(","):
                    try:
                        results["e2e"] += e2e_pair(arch, wtype, args, Path(tmp))
                    except Exception as e:
                        msg = f"failed: {type(e).__name__}: {e}"
                        print(f"{arch + ' ' + wtype:<12} {msg}")
                        results["e2e"].append({"arch": arch, "type": wtype, "error": msg})
    if not args.skip_ratios:
        results["ratios"] = run_ratios(args)
        results["projection"] = run_projection(results["ratios"], [r for r in results["e2e"] if "engines" in r])
    path = args.out / "bench_dflash.json"
    path.write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
