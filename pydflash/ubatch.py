"""The prefill micro-batch chosen by measurement (Model(n_ubatch="auto"), the default).

How many prompt tokens one target evaluation should take depends on the model and the machine: a CPU's
batched matmuls stop gaining past a few hundred rows while each row's attention over the growing window
costs more, and lucebox measured 16 for short prompts and 192 for long ones on its RTX 3090. So the first prefill long enough to need more than one micro-batch times one evaluation of each
candidate size on the session itself (uncommitted: the session is unchanged), takes the size with the
lowest cost per token (the smaller one when two are within 3%), and keeps it for the session. The answer
is cached on disk per model file, drafter, machine, thread count and offload, so a model measures once.
"""

from __future__ import annotations

import os
import platform

from . import _core, cache_paths

__all__ = ["choose", "cache_key", "calibrate"]

# (The candidate sizes are the engine's, decode/engine_params.h: it sizes the feature ring and the compute buffer
# for the largest until the choice is made.)
# a larger micro-batch must be at least this much cheaper per token to be preferred
TIE = 0.03
CACHE_FILE = "ubatch.json"


def choose(ms_per_token: dict[int, float]) -> int:
    """The size with the lowest cost per token; a larger size only where it is more than TIE cheaper."""
    best = None
    for size in sorted(ms_per_token):
        if best is None or ms_per_token[size] < ms_per_token[best] * (1 - TIE):
            best = size
    return best


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = _core.device_memory().get("gpu_name", "")
    return f"{cpu}|{gpu}"


def cache_key(model_path: str, draft_path: str | None, n_threads: int, placement: str, sizes) -> str:
    """The key of these files on this machine with these threads, this placement of the layers (`ngl=N`, then
    `,ncmoe=N` when experts stay on the CPU) and these micro-batch sizes."""
    def file_id(path):
        st = os.stat(path)
        return f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}"

    return "|".join([file_id(model_path), file_id(draft_path) if draft_path else "-", _machine(),
                     f"threads={n_threads}", placement, "sizes=" + ",".join(map(str, sizes))])


def calibrate(session, draft, tokens: list[int], sizes, key: str) -> tuple[int, dict[int, float]]:
    """The micro-batch for `session` (and the DraftSession `draft` capturing from it, or None): from the disk
    cache under `key`, else timed on `tokens` (repeated to the largest size when shorter), which leaves the
    session empty. Returns the size and the measured milliseconds per token by size (empty when it came from
    the cache)."""
    cached = cache_paths.read_table(CACHE_FILE).get(key)
    if isinstance(cached, dict) and type(cached.get("n_ubatch")) is int and cached["n_ubatch"] in sizes:
        return cached["n_ubatch"], {}
    longest = max(sizes)
    tokens = list(tokens) or [0]
    tokens = (tokens * (longest // len(tokens) + 1))[:longest]
    measured = dict(zip(sizes, session.time_prefill(tokens, sizes, draft)))
    size = choose(measured)
    cache_paths.write_entry(CACHE_FILE, key,
                            {"n_ubatch": size, "ms_per_token": {str(k): v for k, v in measured.items()}})
    return size, measured
