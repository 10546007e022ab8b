#!/usr/bin/env python3
"""Do drafters survive quantized targets? Chain tau (block 16, greedy) of the committed trained pairs with the
target quantized by llama.cpp's `llama-quantize` (F16, Q8_0, Q5_0, Q4_K_M, Q4_0, Q2_K) and the drafter by
`pydflash-quantize` (q8_0, q4_k, q4_0; and the committed f16 drafter where there is one), against the f32 pair, on
the held-out code prompts.

Read it with its limits: the committed models are 192 wide, so k-quants fall back on every matrix whose rows are
192 long (llama-quantize's count is printed: Q4_K_M and Q2_K are mostly q5_0 / iq4_nl there); a tiny model loses
more to quantization than a large one; and a quantized target writes other text than the f32 one, so each tau is
of its own continuation.

    python benchmarks/bench_quant_tau.py              # needs llama.cpp built (peer.py build)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tools"))

import peer  # noqa: E402
from export_pairs import pair_file, prompt_rows  # noqa: E402

import pydflash  # noqa: E402
from pydflash.convert.quantize import quantize_gguf  # noqa: E402

TARGET_TYPES = ("F16", "Q8_0", "Q5_0", "Q4_K_M", "Q4_0", "Q2_K")
DRAFT_TYPES = ("q8_0", "q4_k", "q4_0")


def llama_quantize(src: Path, dst: Path, qtype: str) -> str:
    """dst from src by llama-quantize; its fallback count ('' when none)."""
    out = subprocess.run([str(peer.binary("llama-quantize")), str(src), str(dst), qtype], capture_output=True,
                         text=True, check=True)
    m = re.search(r"(\d+) of (\d+) tensor\(s\) required fallback", out.stdout + out.stderr)
    return f"{m[1]}/{m[2]} fell back" if m else ""


def chain_tau(target: Path, draft: Path, prompts: list[str], max_tokens: int) -> float:
    accepted = rounds = 0
    with pydflash.Model(target, draft_model_path=draft, n_ctx=1024, spec_mode="chain", block_size=16) as m:
        for p in prompts:
            t = m.generate(p, max_tokens=max_tokens).timings
            accepted, rounds = accepted + t["draft_n_accepted"], rounds + t["n_rounds"]
    return (accepted + rounds) / rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default="qwen3,qwen35")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--target-types", default=",".join(TARGET_TYPES), help="llama-quantize types of the target")
    ap.add_argument("--drafter", default="dflash", choices=("dflash", "dflash2"),
                    help="the pair's DFlash drafter or its DFlash2 one (tests/data/pairs/<arch>-dflash2-f32.gguf)")
    args = ap.parse_args()
    if peer.binary("llama-quantize") is None:
        raise SystemExit("llama-quantize is not built (python benchmarks/peer.py build)")
    prompts = [r["text"] for r in prompt_rows("code")[: args.n_prompts]]
    print(f"chain tau, block 16, {len(prompts)} code prompts x {args.max_tokens} tokens, greedy, {args.drafter} drafters")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for arch in args.archs.split(","):
            role = args.drafter
            # (qwen3's f16 pair is the demo pair inside the package: a DFlash drafter only)
            f16 = [("f16", pair_file(arch, role, "f16"))] if role == "dflash" and pair_file(arch, role, "f16").exists() \
                else []
            drafts = [("f32", pair_file(arch, role, "f32"))] + f16 + [
                (d, quantize_gguf(pair_file(arch, role, "f32"), tmp / f"{arch}-d-{d}.gguf", d, progress=False))
                for d in DRAFT_TYPES]
            print(f"\n{arch}: target \\ drafter  " + "  ".join(f"{d:>6}" for d, _ in drafts))
            targets = [("F32", pair_file(arch, "target", "f32"), "")]
            for t in filter(None, args.target_types.split(",")):
                dst = tmp / f"{arch}-t-{t}.gguf"
                targets.append((t, dst, llama_quantize(pair_file(arch, "target", "f32"), dst, t)))
            for name, target, note in targets:
                taus = [chain_tau(target, d, prompts, args.max_tokens) for _, d in drafts]
                print(f"  {name:<8} " + "  ".join(f"{x:6.2f}" for x in taus) + (f"   ({note})" if note else ""))


if __name__ == "__main__":
    main()
