"""pydflash-convert for Qwen3 MoE (HF `Qwen3MoeForCausalLM` → arch `qwen3moe`) against llama.cpp's own converter,
key for key and tensor for tensor, with the experts stored per expert (what save_pretrained writes) or fused
(`mlp.experts.gate_up_proj` / `down_proj`); the stacking checked from the HF tensors directly; the error paths.

Reference runs: the pinned llama.cpp `convert_hf_to_gguf.py` (tests/llama_ref.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import checkpoint_cache, copy_checkpoint, edit_config, make_qwen3moe_shape  # noqa: E402
from llama_ref import assert_same_gguf, llama_convert, read_gguf  # noqa: E402

from pydflash.convert import convert_hf_to_gguf  # noqa: E402
from pydflash.convert.cli import main as convert_main  # noqa: E402
from pydflash.errors import ConversionError  # noqa: E402


@pytest.fixture(scope="module")
def qwen3moe_checkpoint(tmp_path_factory):
    """Factory for tiny random Qwen3 MoE checkpoints, cached for the module: `qwen3moe_checkpoint("x8k4",
    experts="fused")` -> Path (shapes: hf_models.QWEN3MOE_SHAPES)."""
    return checkpoint_cache(make_qwen3moe_shape, tmp_path_factory)


# (shape, checkpoint overrides, --outtype): 4 / 5 / 7 / 8 experts, top-1 to top-4, tied and untied heads, experts per
# expert and fused, f32 / bf16 / f16 checkpoints, sharded (a layer's experts split over shards), every --outtype
# (q8_0 with F16 fallbacks where an expert's rows are not a multiple of 32 wide)
CASES = [
    pytest.param("x4k1", dict(), "f32", id="x4k1-f32"),
    pytest.param("x5k2_tied", dict(dtype="bfloat16"), "auto", id="x5k2-tied-bf16src-auto"),
    pytest.param("x8k4", dict(experts="fused"), "q8_0", id="x8k4-fused-q8_0"),
    pytest.param("x7k3", dict(dtype="float16", experts="fused"), "f16", id="x7k3-fused-f16src-f16"),
    pytest.param("x7k3", dict(max_shard_size="60KB"), "bf16", id="x7k3-sharded-bf16"),
    pytest.param("x5k2_tied", dict(), "q8_0", id="x5k2-tied-q8_0-f16-fallback"),
]


@pytest.mark.parametrize("shape, overrides, outtype", CASES)
def test_matches_llama_cpp_converter(qwen3moe_checkpoint, llama_cpp_dir, tmp_path, shape, overrides, outtype):
    model = qwen3moe_checkpoint(shape, **overrides)
    if overrides.get("max_shard_size"):
        assert (model / "model.safetensors.index.json").is_file()
    ref = llama_convert(llama_cpp_dir, model, tmp_path / "ref.gguf", "--outtype", outtype)
    ours = convert_hf_to_gguf(model, tmp_path / "ours.gguf", outtype=outtype, progress=False)
    assert_same_gguf(ours, ref)


def test_qwen3moe_contract(qwen3moe_checkpoint, tmp_path):
    """The MoE keys and the stacked experts read from the HF tensors directly: expert x of blk.N.ffn_gate_exps is
    the checkpoint's mlp.experts.x.gate_proj of layer N (ggml ne = {hidden, expert width, experts})."""
    from safetensors.numpy import load_file

    model = qwen3moe_checkpoint("x5k2_tied")
    cfg = json.loads((model / "config.json").read_text())
    kv, tensors = read_gguf(convert_hf_to_gguf(model, tmp_path / "m.gguf", outtype="f32", progress=False))
    assert kv["general.architecture"][1] == "qwen3moe"
    assert kv["qwen3moe.expert_count"] == (["UINT32"], 5)
    assert kv["qwen3moe.expert_used_count"] == (["UINT32"], 2)
    assert kv["qwen3moe.expert_feed_forward_length"] == (["UINT32"], 96)
    assert kv["qwen3moe.feed_forward_length"] == (["UINT32"], cfg["intermediate_size"])
    assert kv["qwen3moe.attention.key_length"] == (["UINT32"], 32)
    hf = load_file(str(model / "model.safetensors"))
    by_name = {name: (shape, dtype, data) for name, shape, dtype, data in tensors}
    E, F, X = cfg["hidden_size"], 96, 5
    assert by_name["blk.1.ffn_gate_inp.weight"][:2] == ([E, X], "F32")
    for proj, gguf_name, shape in (("gate_proj", "ffn_gate_exps", [E, F, X]), ("up_proj", "ffn_up_exps", [E, F, X]),
                                   ("down_proj", "ffn_down_exps", [F, E, X])):
        got_shape, dtype, data = by_name[f"blk.2.{gguf_name}.weight"]
        assert (got_shape, dtype) == (shape, "F32")
        for x in range(X):
            assert np.array_equal(data[x], hf[f"model.layers.2.mlp.experts.{x}.{proj}.weight"]), (gguf_name, x)
    assert "output.weight" not in by_name  # tied
    assert not any(".experts." in n or "ffn_gate." in n for n in by_name)


def test_per_expert_and_fused_layouts_give_the_same_file(qwen3moe_checkpoint, tmp_path):
    per_expert = convert_hf_to_gguf(qwen3moe_checkpoint("x8k4"), tmp_path / "a.gguf", outtype="f16", progress=False)
    fused = convert_hf_to_gguf(qwen3moe_checkpoint("x8k4", experts="fused"), tmp_path / "b.gguf", outtype="f16",
                               progress=False)
    _, a = read_gguf(per_expert)
    _, b = read_gguf(fused)
    assert sorted(t[:3] for t in a) == sorted(t[:3] for t in b)
    data_b = {t[0]: t[3] for t in b}
    for name, _, _, data in a:
        assert np.array_equal(data, data_b[name]), name


def test_cli_lists_qwen3moe(capsys):
    assert convert_main(["--print-supported-models"]) == 0
    assert "Qwen3MoeForCausalLM" in capsys.readouterr().out.split()


# --------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(norm_topk_prob=False), r"norm_topk_prob is false.*expected true"),
    (lambda c: c.pop("norm_topk_prob"), r"norm_topk_prob is false \(or absent"),
    (lambda c: c.update(mlp_only_layers=[1]), r"mlp_only_layers = \[1\].*expected \[\] and 1"),
    (lambda c: c.update(decoder_sparse_step=2), r"decoder_sparse_step = 2.*expected \[\] and 1"),
    (lambda c: c.update(num_experts_per_tok=5), r"num_experts_per_tok = 5, expected 1\.\.num_experts \(4\)"),
], ids=["no-renormalisation", "renormalisation-default", "dense-layers", "sparse-step", "top-k-above-experts"])
def test_config_llama_cpp_cannot_run(qwen3moe_checkpoint, tmp_path, edit, match):
    model = copy_checkpoint(qwen3moe_checkpoint("x4k1"), tmp_path / "m")
    edit_config(model, edit)
    with pytest.raises(ConversionError, match=match):
        convert_hf_to_gguf(model, tmp_path / "x.gguf", progress=False)
    assert not (tmp_path / "x.gguf").exists()


def test_expert_width_disagrees_with_config(qwen3moe_checkpoint, tmp_path):
    model = copy_checkpoint(qwen3moe_checkpoint("x4k1"), tmp_path / "m")
    edit_config(model, lambda c: c.update(moe_intermediate_size=48))
    with pytest.raises(ConversionError, match=r"mlp\.experts\.\d+\.\w+_proj\.weight' has shape \[\d+, \d+\], "
                                              r"expected \[(48, 64|64, 48)\]"):
        convert_hf_to_gguf(model, tmp_path / "x.gguf", progress=False)


def test_fused_experts_of_the_wrong_shape(qwen3moe_checkpoint, tmp_path):
    model = copy_checkpoint(qwen3moe_checkpoint("x4k1", experts="fused"), tmp_path / "m")
    edit_config(model, lambda c: c.update(num_local_experts=3, num_experts_per_tok=1))
    with pytest.raises(ConversionError, match=r"mlp\.experts\.(gate_up|down)_proj' has shape \[4, \d+, \d+\], "
                                              r"expected \[3, "):
        convert_hf_to_gguf(model, tmp_path / "x.gguf", progress=False)


def test_missing_expert(qwen3moe_checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    model = copy_checkpoint(qwen3moe_checkpoint("x4k1"), tmp_path / "m")
    state = load_file(str(model / "model.safetensors"))
    del state["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(state, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"incomplete experts.*model\.layers\.1\.mlp\.experts\.0\."):
        convert_hf_to_gguf(model, tmp_path / "x.gguf", progress=False)
