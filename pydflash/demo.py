"""The embedded demo pair and `pydflash demo`.

The package ships one small *trained* pair (tools/train_pairs.py: a 2.4M-parameter Qwen3 target trained on
Python standard-library sources and offline prose, and its DFlash drafter trained on the target's own greedy
continuations), so a fresh install shows speculative decoding without any download. The prompts are
held-out code never seen in training.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

DEMO_TARGET = "demo-qwen3-target-f16.gguf"
DEMO_DRAFT = "demo-qwen3-dflash-f16.gguf"
DEMO_PROMPTS = "demo-prompts.json"


def demo_paths() -> tuple[Path, Path]:
    """(target GGUF, draft GGUF) of the embedded demo pair."""
    data = Path(str(resources.files("pydflash") / "data"))
    return data / DEMO_TARGET, data / DEMO_DRAFT


def demo_prompts() -> list[str]:
    """Held-out code prompts (from files kept out of the pair's training data)."""
    return json.loads((resources.files("pydflash") / "data" / DEMO_PROMPTS).read_text(encoding="utf-8"))


def run_demo(prompts: list[str] | None = None, max_tokens: int = 128, n_threads: int | None = None,
             block_size: int | None = None, show: int = 1, out=print) -> dict:
    """Generate each prompt (default: the embedded held-out ones) with the target alone and with DFlash, check
    the outputs agree, print speeds; `show` prompts are printed with their continuation, through `out`.

    Returns the totals: {"ar_tokens_per_s", "dflash_tokens_per_s", "speedup", "tau", "identical"}."""
    from .model import Model

    if prompts is None:
        prompts = demo_prompts()
    if not prompts:
        raise ValueError("run_demo: no prompts")
    target, draft = demo_paths()
    with Model.demo(n_ctx=2048, n_threads=n_threads, block_size=block_size) as model:
        out(f"pydflash demo: {target.name} + {draft.name} (block {model.block_size}, {model.n_threads} threads)")
        model.generate(prompts[0], max_tokens=8, speculative=False)      # warm up: graphs, caches, pages
        model.generate(prompts[0], max_tokens=8)
        ar_tokens = dflash_tokens = rounds = committed = 0
        ar_s = dflash_s = 0.0
        draft_ms = verify_ms = 0.0
        identical = True
        for i, prompt in enumerate(prompts):
            ar = model.generate(prompt, max_tokens=max_tokens, speculative=False)
            spec = model.generate(prompt, max_tokens=max_tokens)
            same = ar.tokens == spec.tokens
            identical &= same
            ar_tokens += len(ar.tokens)
            ar_s += ar.timings["predicted_ms"] / 1e3
            dflash_tokens += len(spec.tokens)
            dflash_s += spec.timings["predicted_ms"] / 1e3
            rounds += spec.timings["n_rounds"]
            committed += spec.timings["draft_n_accepted"] + spec.timings["n_rounds"]
            draft_ms += spec.timings["draft_ms"]
            verify_ms += spec.timings["verify_ms"]
            if i < show:
                out("")
                out(prompt.rstrip("\n")[-300:] + "\033[1m" + spec.text + "\033[0m")
                out("")
            out(f"prompt {i + 1}/{len(prompts)}: {len(spec.tokens)} tokens, tau {spec.timings['tau']:.2f}, "
                f"AR {ar.timings['predicted_per_second']:.0f} tok/s, DFlash {spec.timings['predicted_per_second']:.0f} tok/s "
                f"(decoding, prompt excluded), same output as AR: {'yes' if same else 'NO'}")
        ar_tps = ar_tokens / max(ar_s, 1e-9)
        dflash_tps = dflash_tokens / max(dflash_s, 1e-9)
        tau = committed / max(rounds, 1)
        out("")
        out(f"{'':8} {'tokens':>7} {'tok/s':>9} {'target passes/token':>20}")
        out(f"{'AR':8} {ar_tokens:7d} {ar_tps:9.1f} {1.0:20.2f}")
        out(f"{'DFlash':8} {dflash_tokens:7d} {dflash_tps:9.1f} {1 / max(tau, 1e-9):20.2f}")
        out(f"tau (tokens per target pass) {tau:.2f}, speed-up {dflash_tps / max(ar_tps, 1e-9):.2f}x, "
            f"outputs identical: {'yes' if identical else 'NO'}")
        ar_ms = 1000.0 / max(ar_tps, 1e-9)
        out(f"one round = draft {draft_ms / max(rounds, 1):.2f} ms + verify of {model.block_size} tokens "
            f"{verify_ms / max(rounds, 1):.2f} ms = {(draft_ms + verify_ms) / max(rounds, 1) / ar_ms:.1f} AR steps "
            f"({ar_ms:.2f} ms); speculative decoding pays off once tau exceeds that. On a CPU the verify of 16 "
            f"tokens is compute-bound and costs several AR steps (about 5 even for a 0.6B model on a 2-core "
            f"machine); on a GPU it costs about one (benchmarks/bench_dflash.py).")
        return {"ar_tokens_per_s": ar_tps, "dflash_tokens_per_s": dflash_tps, "speedup": dflash_tps / max(ar_tps, 1e-9),
                "tau": tau, "identical": identical}
