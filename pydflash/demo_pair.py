"""The small trained pair that ships inside the package (pydflash/data/), and its held-out prompts: what
`Model.demo()`, `pydflash demo` and `pydflash bench` run without any download."""

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
