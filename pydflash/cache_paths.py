"""Where pydflash keeps what it builds or measures once per machine: the demo's cost-realistic target, the measured
prefill micro-batch sizes (ubatch.json) and verify costs (verify_costs.json)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """$PYDFLASH_CACHE, else $XDG_CACHE_HOME/pydflash, else ~/.cache/pydflash."""
    if os.environ.get("PYDFLASH_CACHE"):
        return Path(os.environ["PYDFLASH_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pydflash"


def read_table(name: str) -> dict:
    """The JSON object kept in cache_dir()/name ({} when absent or unreadable: measured again)."""
    try:
        with open(cache_dir() / name) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write_entry(name: str, key: str, value: dict) -> None:
    """Set `key` in the JSON object cache_dir()/name. Best effort (a read-only home only means measuring again
    next time); the file is replaced atomically, so a reader never sees half of it."""
    try:
        data = read_table(name)
        data[key] = value
        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, folder / name)
    except OSError:
        pass
