"""What verifying costs, kept across processes (the speculation cost model, csrc/decode/cost_model.h).

auto chooses each round how much to verify from the measured time of a target evaluation per width. Those
times are learnt in the rounds that use them, from plain decoding up, so a fresh process answers at once; this
module saves what was measured, per model file, drafter, machine, thread count and offload (as ubatch.py keys
the prefill micro-batch), and gives it to the next load, which then chooses as well from its first round and
goes on refining the times as it decodes. A table is written when it holds a width the saved one lacks. With the
times goes auto's cool-down length, so that where speculation had stopped paying (a target too small for its
drafter) the next process decodes plainly from its first round instead of probing its way there again (a few
percent of a short benchmark's time on the tiny pairs). And with them what the target accepted of the drafts
(the acceptance model's counts, csrc/decode/acceptance_model.h), so that a new session (a fresh process, a
server's slot) chooses its first rounds from what this pair reaches rather than from the drafter's own
probabilities, which it learns to correct only over its first rounds. All are rewritten when the widths or the
cool-down change, or when the acceptance counts have moved by ACCEPTANCE_MOVED trials since the last write.

Sessions generating together (continuous batching, csrc/state/eval_batcher.h) plan each step from the measured time
of every step shape (parts, rows) so far; those times are kept too, under the key with "|batch", and written when
a shape is measured that the saved table lacks: a restarted server's batch plans from its first step.
"""

from __future__ import annotations

import math
import threading

from . import cache_paths, ubatch

__all__ = ["cache_key", "restore", "remember", "restore_steps", "remember_steps"]

# Sessions of one Model (a server's slots) finish generations in threads of their own: a lock makes each one's
# comparison with what was saved and its write one step, so that a thread holding older times cannot write over a
# newer table after the newer one was recorded as saved (the later shapes were then never written).
_lock = threading.Lock()
# (the widths each key's saved table holds, auto's cool-down length, the acceptance counts' tried), as this process
# last wrote or read them
_saved: dict[str, tuple[frozenset, int, list[float]]] = {}
CACHE_FILE = "verify_costs.json"
MAX_WIDTH = 1 << 16  # (wider than any verify: the core's widths are C ints)
# trials (summed over the acceptance model's cells) that its counts move by before they are written again: about
# what a session tries before its model counts as learnt (acceptance_model.cpp LEARNT_TRIED)
ACCEPTANCE_MOVED = 16.0


def cache_key(model_path: str, draft_path: str | None, n_threads: int, placement: str, mtp: bool = False) -> str | None:
    """The key of a target and drafter and / or (mtp) the target's own MTP head on this machine with these threads
    and placement (ubatch.cache_key; None: neither). The head drafting with a drafter is a key of its own: auto's
    cool-down there follows what the two reach together."""
    if draft_path is None and not mtp:
        return None
    return ubatch.cache_key(model_path, draft_path, n_threads, placement, ()) + ("|mtp" if mtp else "")


def _widths(chain: dict, tree: dict) -> frozenset:
    return frozenset([(int(w), False) for w in chain] + [(int(w), True) for w in tree])


def _times(saved: dict) -> dict[int, float]:
    """A saved {width: ms} table as the core takes it; a width or time no run here measured raises ValueError."""
    times = {int(w): float(ms) for w, ms in saved.items()}
    if not all(1 <= w <= MAX_WIDTH and math.isfinite(ms) for w, ms in times.items()):
        raise ValueError("not a measured width or time")
    return times


# what reading a table that no run of this version wrote raises (hand-edited, another version's, damaged): it is
# then measured again
_UNREADABLE = (AttributeError, KeyError, TypeError, ValueError, OverflowError)


def _entry(key: str) -> dict | None:
    saved = cache_paths.read_table(CACHE_FILE).get(key)
    return saved if isinstance(saved, dict) else None


def restore(draft, key: str | None) -> None:
    """Give the DraftSession (or MtpDrafter) `draft` the verify times saved under `key`, if any."""
    if draft is None or key is None or (saved := _entry(key)) is None:
        return
    try:
        chain, tree = _times(saved.get("verify_ms", {})), _times(saved.get("tree_verify_ms", {}))
        cool_len = min(max(int(saved.get("cool_len", 0)), 0), 1 << 20)
        acceptance = _acceptance(saved.get("acceptance"))
        draft.restore_costs(chain, tree, cool_len=cool_len, acceptance=acceptance)
    except _UNREADABLE:
        return  # (the core checks the counts before it changes anything)
    _saved[key] = (_widths(chain, tree), cool_len, list(acceptance[0]) if acceptance else [])


def _acceptance(saved) -> tuple[list[float], list[float]] | None:
    """Saved acceptance counts as the core takes them ((tried, accepted) lists; None: none saved)."""
    if saved is None:
        return None
    tried, accepted = saved["tried"], saved["accepted"]
    return [float(x) for x in tried], [float(x) for x in accepted]


def _moved(tried: list[float], saved: list[float]) -> bool:
    if len(tried) != len(saved):
        return True
    return sum(abs(a - b) for a, b in zip(tried, saved)) >= ACCEPTANCE_MOVED


def remember(draft, key: str | None) -> None:
    """After a generation: save the verify times `draft` has measured when they cover a width not saved yet,
    auto's cool-down length when it changed, or the acceptance counts when they moved (ACCEPTANCE_MOVED)."""
    if draft is None or key is None:
        return
    with _lock:
        costs = draft.costs()
        chain, tree = costs["measured"]
        widths, cool_len = _widths(chain, tree), costs["cool_len"]
        tried, accepted = (list(x) for x in costs["acceptance"])
        saved_widths, saved_cool_len, saved_tried = _saved.get(key, (frozenset(), 0, []))
        if widths <= saved_widths and cool_len == saved_cool_len and not _moved(tried, saved_tried):
            return
        _saved[key] = (widths | saved_widths, cool_len, tried)
        cache_paths.write_entry(CACHE_FILE, key, {"verify_ms": {str(w): ms for w, ms in chain.items()},
                                                  "tree_verify_ms": {str(w): ms for w, ms in tree.items()},
                                                  "cool_len": cool_len,
                                                  "acceptance": {"tried": tried, "accepted": accepted}})


# the step shapes ((parts, rows)) each batch key's saved table holds, as this process last wrote or read them
_saved_steps: dict[str, frozenset] = {}


def _steps_key(key: str | None) -> str | None:
    return None if key is None else key + "|batch"


def _shapes(table: dict) -> frozenset:
    return frozenset((p, r) for p, by in table.items() for r in by)


def restore_steps(batcher, key: str | None) -> None:
    """Give the EvalBatcher `batcher` the step times saved under `key` (cache_key's), if any."""
    key = _steps_key(key)
    if batcher is None or key is None or (saved := _entry(key)) is None:
        return
    try:
        table = {int(p): {int(r): float(ms) for r, ms in by.items()} for p, by in saved["step_ms"].items()}
        batcher.restore_step_times(table)
    except _UNREADABLE:
        return  # (the core checks it before it changes anything)
    _saved_steps[key] = _shapes(table)


def remember_steps(batcher, key: str | None) -> None:
    """After a generation beside others: save the batch's step times when they hold a shape not saved yet."""
    key = _steps_key(key)
    if batcher is None or key is None:
        return
    with _lock:
        saved = _saved_steps.get(key, frozenset())
        # a Model's batcher holds every shape saved under its key (it restored them, or they were written from it)
        # and what it measured since: no more of them means nothing new, known without step_times(), which waits
        # for a running step to end (delaying the end of a server's request). (Another Model of the same files
        # batching in the same process has its new shapes written once it holds more than were saved.)
        if batcher.stats["step_shapes"] <= len(saved):
            return
        table = batcher.step_times()
        shapes = _shapes(table)
        if shapes <= saved:
            return
        _saved_steps[key] = shapes | saved
        cache_paths.write_entry(CACHE_FILE, key, {"step_ms": {str(p): {str(r): ms for r, ms in by.items()}
                                                              for p, by in table.items()}})
