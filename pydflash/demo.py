"""The embedded demo pair and `pydflash demo`.

The package ships one small *trained* pair (tools/train_pairs.py: a 2.4M-parameter Qwen3 target trained on
Python standard-library sources and offline prose, and its DFlash drafter trained on the target's own greedy
continuations), so a fresh install shows speculative decoding without any download. The prompts are
held-out code never seen in training.

A 2.4M-parameter target is so cheap that on a CPU drafting costs about as much as decoding, so the demo also
builds (once, into a cache folder) a cost-realistic copy of it: every FFN widened to 32768 units and 12
layers appended, all with zero output projections (pydflash.convert.inflate). It computes exactly the small
model's function, so the same drafter fits, at the cost of a ~0.3B-parameter model.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

DEMO_TARGET = "demo-qwen3-target-f16.gguf"
DEMO_DRAFT = "demo-qwen3-dflash-f16.gguf"
DEMO_PROMPTS = "demo-prompts.json"
INFLATED = "demo-qwen3-inflated-q8_0.gguf"


def demo_paths() -> tuple[Path, Path]:
    """(target GGUF, draft GGUF) of the embedded demo pair."""
    data = Path(str(resources.files("pydflash") / "data"))
    return data / DEMO_TARGET, data / DEMO_DRAFT


def demo_prompts() -> list[str]:
    """Held-out code prompts (from files kept out of the pair's training data)."""
    return json.loads((resources.files("pydflash") / "data" / DEMO_PROMPTS).read_text(encoding="utf-8"))


def cache_dir() -> Path:
    """Where the demo keeps what it builds: $PYDFLASH_CACHE, else $XDG_CACHE_HOME/pydflash, else ~/.cache/pydflash."""
    if os.environ.get("PYDFLASH_CACHE"):
        return Path(os.environ["PYDFLASH_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pydflash"


def inflated_demo_target(cache: Path | None = None, out=print) -> Path:
    """The cost-realistic demo target (built on first use, with a progress bar)."""
    from .convert.inflate import inflate_gguf

    path = (cache or cache_dir()) / INFLATED
    if not path.exists():
        out(f"building {path} once: the demo target widened to a ~0.3B-parameter model's cost (q8_0, ~320 MB) ...")
        inflate_gguf(demo_paths()[0], path, "q8_0")
    return path


# the decoding modes the demo compares: (label, Model keyword arguments, generate keyword arguments)
MODES = [("plain", {}, {"speculative": False}),
         ("DFlash chain", {"spec_mode": "chain"}, {}),
         ("DFlash auto", {"spec_mode": "auto"}, {})]


# where two tokens' logits are closer than this, batched (verify) and single-token evaluations may pick either:
# the engine's greedy output is exact up to such near-ties (tests/test_pairs.py holds it to the same bound)
NEAR_TIE = 1e-2


def _parting_gap(model, prompt: str, ours: list[int], plain: list[int]) -> float:
    """|logit gap| of the two tokens where `ours` first parts from `plain` (one batched evaluation)."""
    import numpy as np

    from . import _core

    k = next(i for i, (a, b) in enumerate(zip(ours, plain)) if a != b)  # callers pass outputs that part
    ids = model.tokenize(prompt)
    session = _core.Session(model._model, n_ctx=len(ids) + k + 1)
    logits, _ = session.eval(np.array(ids + plain[:k], dtype=np.int32), all_logits=False)
    return float(abs(logits[-1][ours[k]] - logits[-1][plain[k]]))


def _compare(target: Path, draft: Path, prompts: list[str], max_tokens: int, n_threads: int | None,
             block_size: int | None, show: int, out) -> dict:
    """Each prompt in every mode, in turn; prints a table, returns {label: totals}."""
    from .model import Model

    models = {label: Model(target, n_ctx=2048, n_threads=n_threads, block_size=block_size, draft_model_path=draft,
                           **kw) for label, kw, _ in MODES}
    try:
        for label, _, gen in MODES:  # warm up: graphs, caches, pages; auto measures its verify costs here
            models[label].generate(prompts[0], max_tokens=8, **gen)
        totals = {label: {"tokens": 0, "ms": 0.0, "committed": 0, "rounds": 0, "outputs": []} for label, _, _ in MODES}
        for i, prompt in enumerate(prompts):
            for label, _, gen in MODES:
                c = models[label].generate(prompt, max_tokens=max_tokens, **gen)
                t = totals[label]
                t["tokens"] += max(0, len(c.tokens) - 1)  # the first token comes from the prompt's pass
                t["ms"] += c.timings["predicted_ms"]
                t["outputs"].append(c.tokens)
                if "n_rounds" in c.timings:
                    t["committed"] += c.timings["draft_n_accepted"] + c.timings["n_rounds"]
                    t["rounds"] += c.timings["n_rounds"]
                if i < show and label == "DFlash auto":
                    out("")
                    out(prompt.rstrip("\n")[-300:] + "\033[1m" + c.text + "\033[0m")
                    out("")
        # partings from plain decoding, each at a near-tie or not
        plain_out = totals["plain"]["outputs"]
        for t in totals.values():
            gaps = [_parting_gap(models["plain"], p, a, b) if a[:len(b)] != b[:len(a)] else float("inf")
                    for p, a, b in zip(prompts, t["outputs"], plain_out) if a != b]
            t["identical"] = not gaps
            t["near_ties"] = sum(g < NEAR_TIE for g in gaps)
            t["lossless"] = all(g < NEAR_TIE for g in gaps)
    finally:
        for m in models.values():
            m.close()
    plain = totals["plain"]
    plain_tps = 1000.0 * plain["tokens"] / max(plain["ms"], 1e-9)
    out(f"  {'':14} {'tok/s':>8} {'speed-up':>9} {'tau':>6}  output")
    for label, t in totals.items():
        tps = 1000.0 * t["tokens"] / max(t["ms"], 1e-9)
        t["tokens_per_s"] = tps
        t["speedup"] = tps / max(plain_tps, 1e-9)
        t["tau"] = t["committed"] / t["rounds"] if t["rounds"] else 0.0
        tau = f"{t['tau']:.2f}" if t["rounds"] else "-"
        if label == "plain":
            same = ""
        elif t["identical"]:
            same = "identical to plain"
        elif t["lossless"]:
            same = f"identical to plain but at {t['near_ties']} near-tie(s)"
        else:
            same = "DIFFERS from plain"
        out(f"  {label:14} {tps:8.1f} {t['speedup']:8.2f}x {tau:>6}  {same}")
    return totals


def run_demo(prompts: list[str] | None = None, max_tokens: int = 128, n_threads: int | None = None,
             block_size: int | None = None, show: int = 1, out=print, realistic: bool = True,
             cache: Path | None = None) -> dict:
    """Generate each prompt (default: the embedded held-out ones) plainly, with DFlash chains and with auto
    (chain, tree or plain per round, by measured cost), first on the tiny embedded pair, then on its
    cost-realistic copy; check the outputs agree, print speeds.

    Returns {"tiny": totals, "realistic": totals} (totals per mode: tokens_per_s, speedup, tau, identical)."""
    if prompts is None:
        prompts = demo_prompts()
    if not prompts:
        raise ValueError("run_demo: no prompts")
    target, draft = demo_paths()
    out(f"pydflash demo: {len(prompts)} held-out code prompts x {max_tokens} tokens, greedy "
        f"(tok/s counts decoding, prompt excluded)")
    out("")
    out(f"1. the embedded trained pair: {target.name} (2.4M parameters) + {draft.name}")
    result = {"tiny": _compare(target, draft, prompts, max_tokens, n_threads, block_size, show, out)}
    out("   A model this small costs almost nothing per token: drafting and verifying a block cost several of its")
    out("   steps, so speculation loses on a CPU, and auto, which measures that, falls back to plain decoding")
    out("   (its first rounds, and a probe now and then to notice text turning predictable, cost a few percent).")
    if realistic:
        out("")
        big = inflated_demo_target(cache, out)
        out(f"2. the same pair at a realistic cost: {big.name}. This target computes exactly the small trained")
        out("   model (its FFNs are widened and 12 layers appended, all with zero output projections), at the cost")
        out("   of a ~0.3B-parameter q8_0 model; the drafter is the same.")
        result["realistic"] = _compare(big, draft, prompts, max_tokens, n_threads, block_size, 0, out)
        r = result["realistic"]
        out(f"   Here speculation pays: auto runs {r['DFlash auto']['speedup']:.2f}x plain decoding, choosing every "
            f"round what to verify (nothing, a chain or a tree) from the drafter's confidence and the measured cost "
            f"of each verify width (benchmarks/bench_tree.py compares it with llama.cpp).")
    identical = all(t["identical"] for part in result.values() for t in part.values())
    lossless = all(t["lossless"] for part in result.values() for t in part.values())
    out("")
    if identical or not lossless:
        out(f"outputs identical to plain decoding: {'yes' if identical else 'NO'}")
    else:
        out(f"outputs identical to plain decoding: yes, up to near-ties (two tokens within {NEAR_TIE} in logit, "
            f"which a batched verify and a single-token step may round either way, as in llama.cpp)")
    return result
