"""Where pydflash keeps what it builds or measures once per machine: the demo's cost-realistic target, the measured
prefill micro-batch sizes (ubatch.json)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$PYDFLASH_CACHE, else $XDG_CACHE_HOME/pydflash, else ~/.cache/pydflash."""
    if os.environ.get("PYDFLASH_CACHE"):
        return Path(os.environ["PYDFLASH_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pydflash"
