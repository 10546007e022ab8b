"""What verifying costs, kept across processes (the speculation cost model, csrc/decode/cost_model.h).

auto chooses each round how much to verify from the measured time of a target evaluation per width. Those
times are learnt in the rounds that use them, from plain decoding up, so a fresh process answers at once; this
module saves what was measured, per model file, drafter, machine, thread count and offload (as ubatch.py keys
the prefill micro-batch), and gives it to the next load, which then chooses as well from its first round and
goes on refining the times as it decodes. A table is written when it holds a width the saved one lacks.
"""

from __future__ import annotations

import json
import os
import tempfile

from . import ubatch

__all__ = ["cache_key", "restore", "remember"]

# the widths each key's saved table holds, as this process last wrote or read it
_saved: dict[str, frozenset] = {}


def _cache_path() -> str:
    from .demo import cache_dir  # ($PYDFLASH_CACHE, else $XDG_CACHE_HOME/pydflash, else ~/.cache/pydflash)

    return os.path.join(cache_dir(), "verify_costs.json")


def cache_key(model_path: str, draft_path: str | None, n_threads: int, n_gpu_layers: int) -> str | None:
    """The key of a target and drafter on this machine with these threads and offload (None: no drafter)."""
    return None if draft_path is None else ubatch.cache_key(model_path, draft_path, n_threads, n_gpu_layers, ())


def _read() -> dict:
    try:
        with open(_cache_path()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(key: str, value: dict) -> None:
    # best effort (a read-only home only means measuring again next time); replaced atomically
    try:
        data = _read()
        data[key] = value
        path = _cache_path()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def _widths(chain: dict, tree: dict) -> frozenset:
    return frozenset([(int(w), False) for w in chain] + [(int(w), True) for w in tree])


def restore(draft, key: str | None) -> None:
    """Give the DraftSession `draft` the verify times saved under `key`, if any."""
    if draft is None or key is None:
        return
    saved = _read().get(key)
    if not isinstance(saved, dict):
        return
    try:
        chain = {int(w): float(ms) for w, ms in saved.get("verify_ms", {}).items()}
        tree = {int(w): float(ms) for w, ms in saved.get("tree_verify_ms", {}).items()}
    except (AttributeError, TypeError, ValueError):
        return  # not a table this version wrote: measured again
    draft.restore_costs(chain, tree)
    _saved[key] = _widths(chain, tree)


def remember(draft, key: str | None) -> None:
    """After a generation: save the verify times `draft` has measured when they cover a width not saved yet."""
    if draft is None or key is None:
        return
    chain, tree = draft.costs()["measured"]
    widths = _widths(chain, tree)
    if widths <= _saved.get(key, frozenset()):
        return
    _saved[key] = widths
    _write(key, {"verify_ms": {str(w): ms for w, ms in chain.items()},
                 "tree_verify_ms": {str(w): ms for w, ms in tree.items()}})
