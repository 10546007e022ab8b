#!/usr/bin/env python3
"""DFlash2 against DFlash on the trained pairs (issue 25): chain tau at 7 and 15 drafts, tree tau at budgets 22 and
63 with each way of ranking a DFlash2 drafter's candidates in a tree (per_node: the selector given each node's token;
path: given the drafted path's; unary: the drafter's logits), auto's tau, and llama.cpp's draft-dflash chain tau on
the same files (counted as ours: verify passes for the same tokens). Greedy, held-out code prompts.

    python benchmarks/bench_dflash2.py --arch qwen35 build/dflash2/qwen35-dflash1-f32.gguf \\
        build/dflash2/qwen35-dflash2-f32.gguf
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tools"))

import peer  # noqa: E402
from export_pairs import pair_file, prompt_rows  # noqa: E402

import pydflash  # noqa: E402
from pydflash import _core  # noqa: E402

ROWS = [("chain 8", dict(spec_mode="chain", block_size=8), None), ("chain 16", dict(spec_mode="chain"), None),
        *[(f"tree {b} {v}", dict(spec_mode="tree", tree_budget=b), v) for b in (22, 63)
          for v in ("per_node", "path", "unary")],
        ("auto", dict(spec_mode="auto"), None)]


def tau(target, draft, prompts, n, options, ranking) -> float:
    """tokens committed per verify, bonus included: (accepted + rounds) / rounds over the prompts"""
    accepted = rounds = 0
    with pydflash.Model(target, draft_model_path=draft, n_ctx=1024, **options) as m:
        if ranking is not None:
            m._draft = _core.DraftSession(m._session, m._draft_model, **{**m._draft_config, "dflash2_tree": ranking})
        for p in prompts:
            t = m.generate(p, max_tokens=n).timings
            accepted, rounds = accepted + t["draft_n_accepted"], rounds + t["n_rounds"]
    return (accepted + rounds) / rounds


def llama_tau(target, draft, prompts, n, n_draft, tmp: Path) -> float:
    """llama.cpp's chain, counted over the same n tokens as ours: n / verify passes"""
    passes = 0
    for i, p in enumerate(prompts):
        r = peer.llama_dflash(target, draft, peer.prompt_file(tmp / f"p{i}.txt", p), n, threads=2, n_ctx=1024,
                              n_draft=n_draft, per_round=True)
        passes += peer.rounds_to(n, [a + 1 for a in r["accepted_per_round"]])
    return len(prompts) * n / passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafters", nargs="+", type=Path)
    ap.add_argument("--arch", default="qwen35")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--skip-peer", action="store_true")
    args = ap.parse_args()
    target = pair_file(args.arch, "target", "f32")
    prompts = [r["text"] for r in prompt_rows("code")[:args.n_prompts]]
    drafters = [pair_file(args.arch, "dflash", "f32")] + args.drafters
    print(f"{args.arch}: tau, {len(prompts)} code prompts x {args.max_tokens} tokens, greedy")
    print(f"{'engine':<22}" + "".join(f"{d.stem[:24]:>26}" for d in drafters))
    with tempfile.TemporaryDirectory() as tmp:
        for label, options, ranking in ROWS:
            cells = [tau(target, d, prompts, args.max_tokens, options, ranking) for d in drafters]
            print(f"{label:<22}" + "".join(f"{c:26.2f}" for c in cells), flush=True)
        if not args.skip_peer:
            for n_draft in (7, 15):
                cells = [llama_tau(target, d, prompts, args.max_tokens, n_draft, Path(tmp)) for d in drafters]
                print(f"{f'llama.cpp chain {n_draft + 1}':<22}" + "".join(f"{c:26.2f}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
