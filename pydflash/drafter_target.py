"""Whether a drafter was made for the target it is loaded onto.

A DFlash drafter is trained on one target's hidden states; on another target whose shapes happen to match it
loads and runs, and its drafts are rarely accepted (auto then quietly decodes plainly). Where the drafter's GGUF
names the model it was made for (`general.base_model.{i}.name` / `.repo_url`: llama.cpp's converter writes them
from the drafter's model card, ours from `--target-model-dir`), that is compared with the target's own names
(`general.name`, `general.basename`, and its own base models: a fine-tune of the drafter's target matches too).
"""

from __future__ import annotations

import re

from . import _core

_MAX_BASE_MODELS = 16  # (GGUFs name one or two)


def _normalized(name: str) -> str:
    """'Qwen/Qwen3.5-27B', 'https://huggingface.co/Qwen/Qwen3.5-27B' and 'Qwen3.5 27B' alike: 'qwen3527b'."""
    return re.sub(r"[^0-9a-z]", "", name.rstrip("/").rsplit("/", 1)[-1].lower())


def _base_model_keys() -> list[str]:
    return ["general.base_model.count"] + [f"general.base_model.{i}.{field}" for i in range(_MAX_BASE_MODELS)
                                           for field in ("name", "repo_url")]


def _base_models(meta: dict) -> list[str]:
    count = meta.get("general.base_model.count", (None, None, 0))[2]
    names = []
    for i in range(min(int(count), _MAX_BASE_MODELS)):
        for field in ("name", "repo_url"):
            value = meta.get(f"general.base_model.{i}.{field}", (None, None, None))[2]
            if isinstance(value, str) and value.strip():
                names.append(value.strip())
    return names


def names_match(made_for: list[str], target: list[str]) -> bool | None:
    """Whether one of the names a drafter was made for is one of the target's (or a part of one: a fine-tune's
    name holds its base's); None when either side names nothing."""
    wanted = {_normalized(n) for n in made_for} - {""}
    have = {_normalized(n) for n in target} - {""}
    if not wanted or not have:
        return None
    return any(w == h or w in h or h in w for w in wanted for h in have)


def mismatch(target_path: str, draft_path: str) -> str | None:
    """A warning naming both models when the drafter names the model it was made for and none of the target's
    names is that model (None when they match, or when either file names nothing to compare)."""
    made_for = _base_models(_core.gguf_metadata(draft_path, _base_model_keys()))
    meta = _core.gguf_metadata(target_path, ["general.name", "general.basename"] + _base_model_keys())
    target = [meta[k][2] for k in ("general.name", "general.basename")
              if k in meta and isinstance(meta[k][2], str) and meta[k][2].strip()] + _base_models(meta)
    if names_match(made_for, target) is not False:
        return None
    return (f"{draft_path}: this drafter was made for {' / '.join(made_for)} (general.base_model), but the target "
            f"{target_path} is {' / '.join(target)}: a drafter trained on another model's hidden states drafts "
            f"tokens the target rarely accepts")
