"""A drafter loaded onto a target it was not made for: our converter names the drafter's target
(general.base_model.0.name), and a load onto a target of other names warns, then reports the drafts' acceptance
after the first generation that drafted (pydflash/drafter_target.py)."""

from __future__ import annotations

import logging
import shutil

import pytest

import hf_models
import pydflash
from llama_ref import read_gguf
from pydflash import drafter_target
from pydflash.convert import convert_hf_to_gguf
from export_pairs import pair_file

MASK_ID = 790  # inside the 800-row target embedding


@pytest.fixture(scope="module")
def converted(qwen3_checkpoint, tmp_path_factory):
    """{"target": its GGUF, "other": a GGUF of the same weights under another model's name, "draft": a drafter
    converted with the first as --target-model-dir}"""
    tmp = tmp_path_factory.mktemp("drafter_target")
    target_dir = qwen3_checkpoint("gqa4x2_hd64", hidden=64, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=16,
                                  vocab_size=800)
    other_dir = tmp / "Other-Model-7B"
    shutil.copytree(target_dir, other_dir)
    draft_dir = hf_models.make_dflash_checkpoint(tmp / "draft", target_dir, n_layers=2, mask_token_id=MASK_ID)
    return {"target": convert_hf_to_gguf(target_dir, tmp / "target.gguf", outtype="f32", progress=False),
            "other": convert_hf_to_gguf(other_dir, tmp / "other.gguf", outtype="f32", progress=False),
            "draft": convert_hf_to_gguf(draft_dir, tmp / "draft.gguf", outtype="f32", target_model_dir=target_dir,
                                        progress=False)}


def test_converter_names_the_drafters_target(converted):
    draft, _ = read_gguf(converted["draft"])
    target, _ = read_gguf(converted["target"])
    assert draft["general.base_model.count"][1] == 1
    assert draft["general.base_model.0.name"][1] == target["general.name"][1]
    other, _ = read_gguf(converted["other"])
    assert other["general.name"][1] != target["general.name"][1]


def test_loaded_onto_its_target_no_warning(converted, caplog):
    with caplog.at_level(logging.WARNING, logger="pydflash"):
        with pydflash.Model(converted["target"], draft_model_path=converted["draft"], n_ctx=256,
                            spec_mode="chain") as m:
            m.generate("hello", max_tokens=8)
    assert not [r for r in caplog.records if "made for" in r.getMessage() or "drafts were accepted" in r.getMessage()]


def test_loaded_onto_another_target_warns_then_reports_acceptance(converted, caplog):
    other_name = read_gguf(converted["other"])[0]["general.name"][1]
    made_for = read_gguf(converted["draft"])[0]["general.base_model.0.name"][1]
    with caplog.at_level(logging.WARNING, logger="pydflash"):
        with pydflash.Model(converted["other"], draft_model_path=converted["draft"], n_ctx=256,
                            spec_mode="chain") as m:
            load_warnings = [r.getMessage() for r in caplog.records]
            assert len(load_warnings) == 1, load_warnings
            assert f"made for {made_for}" in load_warnings[0] and other_name in load_warnings[0]
            assert str(converted["draft"]) in load_warnings[0] and str(converted["other"]) in load_warnings[0]
            c = m.generate("hello", max_tokens=8)
            m.generate("hello again", max_tokens=8)
    reports = [r.getMessage() for r in caplog.records if "drafts were accepted" in r.getMessage()]
    accepted, drafted = c.timings["draft_n_accepted"], c.timings["draft_n"]
    assert reports == [f"{converted['draft']}: {accepted} of its {drafted} drafts were accepted "
                       f"({100 * accepted / drafted:.0f}%) in its first generation here"]


def test_files_that_name_nothing_are_not_compared():
    """The committed pairs were converted before drafters named their target: nothing to compare, no warning."""
    assert drafter_target.mismatch(str(pair_file("qwen3", "target", "q8_0")),
                                   str(pair_file("qwen35", "dflash", "q8_0"))) is None


@pytest.mark.parametrize("made_for,target,same", [
    (["Qwen/Qwen3.5-27B"], ["Qwen3.5 27B"], True),  # a repo id, a general.name
    (["https://huggingface.co/Qwen/Qwen3.5-27B/"], ["unsloth", "qwen3.5-27b"], True),  # a repo url; any name
    (["Qwen3-30B-A3B"], ["Qwen3 30B A3B Instruct 2507"], True),  # a fine-tune's name holds its base's
    (["Qwen3.5-35B-A3B"], ["Qwen3.6-35B-A3B"], False),
    (["Qwen3.5-2B"], ["Qwen3.5-27B"], False),
    (["qwen35-target"], ["qwen3-target"], False),
    ([], ["Qwen3.5 27B"], None), (["Qwen3.5-27B"], [" "], None)])
def test_names_compared(made_for, target, same):
    assert drafter_target.names_match(made_for, target) is same
