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

import sys
import textwrap
from pathlib import Path

from .cache_paths import cache_dir
from .demo_pair import DEMO_DRAFT, DEMO_PROMPTS, DEMO_TARGET, demo_paths, demo_prompts  # noqa: F401 (their old home)
from .style import Style

INFLATED = "demo-qwen3-inflated-q8_0.gguf"


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


def _measure(models: dict, prompts: list[str], max_tokens: int, show: int, out, style: Style) -> dict:
    """Each prompt in every mode, in turn: {label: totals (tokens, ms, committed, rounds, outputs)}; the first
    `show` prompts are printed with auto's continuation in bold."""
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
                out(prompt.rstrip("\n")[-300:] + style.bold(c.text))
                out("")
    return totals


def _check_outputs(plain_model, prompts: list[str], totals: dict) -> None:
    """Each mode's partings from plain decoding, each at a near-tie or not: identical, near_ties, lossless."""
    plain_out = totals["plain"]["outputs"]
    for t in totals.values():
        gaps = [_parting_gap(plain_model, p, a, b) if a[:len(b)] != b[:len(a)] else float("inf")
                for p, a, b in zip(prompts, t["outputs"], plain_out) if a != b]
        t["identical"] = not gaps
        t["near_ties"] = sum(g < NEAR_TIE for g in gaps)
        t["lossless"] = all(g < NEAR_TIE for g in gaps)


def _print_table(totals: dict, out) -> None:
    """Speeds against plain decoding (adds tokens_per_s, speedup, tau to each mode's totals) and each mode's
    agreement with plain."""
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


def _compare(target: Path, draft: Path, prompts: list[str], max_tokens: int, n_threads: int | None,
             block_size: int | None, show: int, out, style: Style) -> dict:
    """Each prompt in every mode, in turn; prints a table, returns {label: totals}."""
    from .model import Model

    models = {label: Model(target, n_ctx=2048, n_threads=n_threads, block_size=block_size, draft_model_path=draft,
                           **kw) for label, kw, _ in MODES}
    try:
        totals = _measure(models, prompts, max_tokens, show, out, style)
        _check_outputs(models["plain"], prompts, totals)
    finally:
        for m in models.values():
            m.close()
    _print_table(totals, out)
    return totals


# a speed-up of at least PAYS is "faster", at most 1 / PAYS "slower", between them "as fast" (timing noise)
PAYS = 1.05


def _pace(speedup: float) -> str:
    if speedup >= PAYS:
        return f"{speedup:.2f}x as fast as plain decoding"
    if speedup > 1 / PAYS:
        return f"about as fast as plain decoding ({speedup:.2f}x)"
    return f"slower than plain decoding ({speedup:.2f}x)"


def tiny_verdict(chain: float, auto: float) -> str:
    """What the tiny pair's run showed, given the measured speed-ups of DFlash chains and of auto over plain."""
    if chain >= PAYS:
        return f"Even a model this small gains here: DFlash chains run {_pace(chain)}, auto {_pace(auto)}."
    if chain > 1 / PAYS:
        return f"At this size DFlash chains run {_pace(chain)}; auto runs {_pace(auto)}."
    why = ("A model this small costs almost nothing per token: drafting and verifying a block cost several of its "
           f"steps, so DFlash chains are {_pace(chain)}.")
    if auto >= PAYS:
        return f"{why} Auto, which measures that, still found rounds worth a draft: it runs {_pace(auto)}."
    if auto > 1 / PAYS:
        return (f"{why} Auto, which measures that, falls back to plain decoding and runs {_pace(auto)}; its first "
                f"rounds, and a probe now and then to notice text turning predictable, cost a few percent.")
    return (f"{why} Auto, which measures that and should fall back to plain decoding, was {_pace(auto)} on this "
            f"run: its measurements of each verify width are noisy on a loaded machine.")


def realistic_verdict(auto: float) -> str:
    """What the cost-realistic run showed, given auto's measured speed-up over plain decoding."""
    how = ("choosing every round what to verify (nothing, a chain or a tree) from the drafter's confidence and the "
           "measured cost of each verify width (benchmarks/bench_tree.py compares it with llama.cpp)")
    if auto >= PAYS:
        return f"Here speculation pays: auto runs {_pace(auto)}, {how}."
    return (f"Here speculation did not pay on this run: auto ran {_pace(auto)}, {how}. A verify costs more than a "
            f"single step when other programs share the cores: on a busy machine, run it again when it is idle, or "
            f"with fewer threads (-t).")


def run_demo(prompts: list[str] | None = None, max_tokens: int = 128, n_threads: int | None = None,
             block_size: int | None = None, show: int = 1, out=print, realistic: bool = True,
             cache: Path | None = None, style: Style | None = None) -> dict:
    """Generate each prompt (default: the embedded held-out ones) plainly, with DFlash chains and with auto
    (chain, tree or plain per round, by measured cost), first on the tiny embedded pair, then on its
    cost-realistic copy; check the outputs agree, print speeds and what they show. `style`: bold text where it
    writes to a terminal (default: sys.stdout's; never with NO_COLOR).

    Returns {"tiny": totals, "realistic": totals} (totals per mode: tokens_per_s, speedup, tau, identical)."""
    if prompts is None:
        prompts = demo_prompts()
    if not prompts:
        raise ValueError("run_demo: no prompts")
    style = style or Style(sys.stdout)
    target, draft = demo_paths()
    out(f"pydflash demo: {len(prompts)} held-out code prompts x {max_tokens} tokens, greedy "
        f"(tok/s counts decoding, prompt excluded)")
    out("")
    out(f"1. the embedded trained pair: {target.name} (2.4M parameters) + {draft.name}")
    result = {"tiny": _compare(target, draft, prompts, max_tokens, n_threads, block_size, show, out, style)}
    tiny = result["tiny"]
    out(_indented(tiny_verdict(tiny["DFlash chain"]["speedup"], tiny["DFlash auto"]["speedup"])))
    if realistic:
        out("")
        big = inflated_demo_target(cache, out)
        out(f"2. the same pair at a realistic cost: {big.name}. This target computes exactly the small trained")
        out("   model (its FFNs are widened and 12 layers appended, all with zero output projections), at the cost")
        out("   of a ~0.3B-parameter q8_0 model; the drafter is the same.")
        result["realistic"] = _compare(big, draft, prompts, max_tokens, n_threads, block_size, 0, out, style)
        out(_indented(realistic_verdict(result["realistic"]["DFlash auto"]["speedup"])))
    _print_identity(result, out)
    return result


def _indented(text: str, width: int = 110) -> str:
    return textwrap.fill(text, width, initial_indent="   ", subsequent_indent="   ")


def _print_identity(result: dict, out) -> None:
    identical = all(t["identical"] for part in result.values() for t in part.values())
    lossless = all(t["lossless"] for part in result.values() for t in part.values())
    out("")
    if identical or not lossless:
        out(f"outputs identical to plain decoding: {'yes' if identical else 'NO'}")
    else:
        out(f"outputs identical to plain decoding: yes, up to near-ties (two tokens within {NEAR_TIE} in logit, "
            f"which a batched verify and a single-token step may round either way, as in llama.cpp)")
