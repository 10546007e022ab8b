#!/usr/bin/env python3
"""Turn the trained pairs of tools/train_pairs.py (Hugging Face layout) into the committed GGUF fixtures.

    python tools/train_pairs.py --out build/pairs          # ~1 h on 2 cores
    python tools/export_pairs.py build/pairs               # -> tests/data/pairs/, pydflash/data/
    python tools/train_pairs.py --out build/pairs-moe --pairs qwen3moe,qwen35moe
    python tools/export_pairs.py build/pairs-moe --types q8_0   # adds the MoE pairs (q8_0 only: 32 experts
                                                                # make f32 files of ~25 MB)

Writes, with pydflash's own converter (the same path real z-lab drafts take):
    tests/data/pairs/{kind}-{target,dflash}-{type}.gguf   (qwen3, qwen35: f32, f16, q8_0; qwen3moe, qwen35moe: q8_0)
        except the qwen3 f16 pair, which ships inside the package as the `pydflash demo` default:
    pydflash/data/demo-qwen3-{target,dflash}-f16.gguf
    tests/data/pairs/prompts_{code,prose}.jsonl        held-out prompts (never seen in training): id, source, text
    tests/data/pairs/reference.json                    the reference loop's results per prompt (tools/dflash_ref.py
                                                       on the f32 PyTorch weights: tau, accept lengths, greedy tokens;
                                                       the pairs exported are replaced, the others kept)
    pydflash/data/demo-prompts.json                    the first held-out code prompts, for the demo
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAIRS_DIR = ROOT / "tests" / "data" / "pairs"
DEMO_DIR = ROOT / "pydflash" / "data"
TYPES = ("f32", "f16", "q8_0")
N_DEMO_PROMPTS = 8


def pair_file(kind: str, role: str, outtype: str, pairs_dir: Path = PAIRS_DIR) -> Path:
    """Where the committed GGUF of one pair member lives (role: target | dflash); the tests and benchmarks
    read the pairs through this too (role target-mtp: the qwen35 target with its trained MTP head; role dflash2: its
    trained DFlash2 drafter, tools/train_dflash2.py)."""
    if kind == "qwen3" and outtype == "f16":
        from pydflash.demo import DEMO_DRAFT, DEMO_TARGET  # this pair ships inside the package

        return DEMO_DIR / (DEMO_TARGET if role == "target" else DEMO_DRAFT)
    return pairs_dir / f"{kind}-{role}-{outtype}.gguf"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def prompt_rows(genre: str, pairs_dir: Path = PAIRS_DIR) -> list[dict]:
    """The committed held-out prompts of one genre (code | prose): {id, source, text} each."""
    return read_jsonl(pairs_dir / f"prompts_{genre}.jsonl")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pairs", type=Path, help="train_pairs.py output folder")
    ap.add_argument("--types", default=",".join(TYPES), help="GGUF types to write (comma-separated)")
    args = ap.parse_args(argv)

    from pydflash.convert import convert_hf_to_gguf

    results = json.loads((args.pairs / "results.json").read_text())
    for kind in results["results"]:
        target_dir, draft_dir = args.pairs / kind / "target", args.pairs / kind / "draft"
        for outtype in args.types.split(","):
            t = pair_file(kind, "target", outtype)
            d = pair_file(kind, "dflash", outtype)
            t.parent.mkdir(parents=True, exist_ok=True)
            convert_hf_to_gguf(target_dir, t, outtype=outtype, progress=False)
            convert_hf_to_gguf(draft_dir, d, outtype=outtype, target_model_dir=target_dir, progress=False)
            print(f"{t.relative_to(ROOT)} {t.stat().st_size / 1e6:.1f} MB, {d.relative_to(ROOT)} "
                  f"{d.stat().st_size / 1e6:.1f} MB")
    for genre in ("code", "prose"):
        # id, source and text; the held-out continuation ("reference", for the training log's repeat share of
        # real text) stays out of the repository
        rows = read_jsonl(args.pairs / f"prompts_{genre}.jsonl")
        (PAIRS_DIR / f"prompts_{genre}.jsonl").write_text(
            "".join(json.dumps({k: r[k] for k in ("id", "source", "text")}) + "\n" for r in rows))
        if genre == "code":
            from pydflash.demo import DEMO_PROMPTS

            demo = [r["text"] for r in rows[:N_DEMO_PROMPTS]]
            (DEMO_DIR / DEMO_PROMPTS).write_text(json.dumps(demo, indent=1))
    reference = PAIRS_DIR / "reference.json"
    kept = json.loads(reference.read_text())["results"] if reference.exists() else {}
    (PAIRS_DIR / "reference.json").write_text(json.dumps(
        {"block_size": results["block_size"], "eval_tokens": results["eval_tokens"],
         "results": {**kept, **results["results"]}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
