"""A load builds its model once: the memory plan a load checks first builds the target and the drafter from the
GGUFs' metadata (planned buffers, nothing read), and the load moves those same objects into real buffers and
reads their weights (`_core.Model.load_weights`, `_core.DraftModel.load_weights`)."""

from __future__ import annotations

import pytest

import pydflash
from export_pairs import PAIRS_DIR, pair_file, prompt_rows
from model_shapes import write_qwen3_8b
from pydflash import _core
from pydflash.errors import ModelLoadError
from pydflash.tokenizer import Tokenizer

TARGET, DRAFT = str(pair_file("qwen3", "target", "q8_0")), str(pair_file("qwen3", "dflash", "q8_0"))
PROMPT = Tokenizer.from_gguf(TARGET).tokenize(prompt_rows("code", PAIRS_DIR)[0]["text"])


def _greedy(core_model, n=24) -> list[int]:
    session = _core.Session(core_model, n_ctx=256)
    return list(session.generate(PROMPT, n)["tokens"])


def test_a_planned_model_loaded_decodes_as_a_model_loaded_directly():
    planned = _core.Model(TARGET, n_threads=2, plan_only=True)
    assert planned.plan_only
    planned.load_weights(n_threads=2)
    assert not planned.plan_only and planned.n_threads == 2
    direct = _core.Model(TARGET, n_threads=2)
    assert planned.weight_memory == direct.weight_memory
    assert [p[2] for p in planned.placement] == [p[2] for p in direct.placement]
    assert _greedy(planned) == _greedy(direct)


def test_a_planned_drafter_loads_after_its_target_only():
    target = _core.Model(TARGET, plan_only=True)
    draft = _core.DraftModel(target, DRAFT)
    with pytest.raises(ValueError, match="still a plan's model"):
        draft.load_weights()
    target.load_weights(n_threads=2)
    draft.load_weights()
    session = _core.Session(target, n_ctx=256)
    drafter = _core.DraftSession(session, draft, n_ctx=256, spec_mode="chain")
    out = session.generate(PROMPT, 24, draft=drafter)
    assert list(out["tokens"]) == _greedy(_core.Model(TARGET, n_threads=2))
    assert out["timings"]["draft_n_accepted"] > 0  # the drafter's weights were read: it drafts what the target says


def test_loading_twice_or_elsewhere_is_refused():
    loaded = _core.Model(TARGET)
    with pytest.raises(ValueError, match="loaded already"):
        loaded.load_weights()
    planned = _core.Model(TARGET, plan_only=True, n_gpu_layers=-1)  # a plan may place layers on an absent GPU
    if _core.usable_gpu_layers(-1) == 0:
        with pytest.raises(ValueError, match=r"n_gpu_layers = -1 puts 0 of the \d+ layers and head on the GPU here, "
                                             r"but the plan placed \d+"):
            planned.load_weights(n_gpu_layers=-1)
        assert planned.plan_only  # left as it was


def test_a_file_without_tensor_data_plans_but_does_not_load(tmp_path):
    path, _ = write_qwen3_8b(tmp_path / "qwen3-8b.gguf")  # metadata only: what a plan reads
    planned = _core.Model(str(path), plan_only=True)
    with pytest.raises(ModelLoadError, match=r"qwen3-8b.gguf: truncated: tensor '.*' needs bytes up to \d+ but "
                                             r"the file has \d+"):
        planned.load_weights()
    assert planned.plan_only


def test_model_builds_its_target_and_drafter_once(monkeypatch):
    made = {"Model": 0, "DraftModel": 0}
    for name in made:
        real = getattr(_core, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            made[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(_core, name, counting)
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=256, n_threads=2) as m:
        assert m.generate(PROMPT, max_tokens=8).tokens
    assert made == {"Model": 1, "DraftModel": 1}
