"""pydflash-convert for Qwen3.5-MoE (HF `Qwen3_5MoeForCausalLM` / `Qwen3_5MoeForConditionalGeneration` → arch
`qwen35moe`) against llama.cpp's own converter, key for key and tensor for tensor: both checkpoint layouts, experts
per expert and fused, MTP blocks with their MoE FFN, and `--fuse-gate-up-exps` (also on qwen3moe, where llama.cpp's
converter refuses it); the experts, the shared expert and the merged gate/up checked from the HF tensors directly;
the error paths.

Reference runs: the pinned llama.cpp `convert_hf_to_gguf.py` (tests/llama_ref.py; `--no-mtp` for checkpoints without
MTP weights). `ssm_a` may differ in the last bit (tests/test_convert_qwen35.py's module docstring).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import (checkpoint_cache, copy_checkpoint, drop_tensor, edit_config, hf_tensors,  # noqa: E402
                       make_qwen3moe_shape, make_qwen35moe_shape)
from llama_ref import assert_same_gguf, llama_convert, llama_convert_qwen35, read_gguf  # noqa: E402

from pydflash.convert import convert_hf_to_gguf  # noqa: E402
from pydflash.convert.cli import main as convert_main  # noqa: E402
from pydflash.errors import ConversionError  # noqa: E402

ULP = ("ssm_a",)


@pytest.fixture(scope="module")
def qwen35moe_checkpoint(tmp_path_factory):
    """Factory for tiny random Qwen3.5-MoE checkpoints, cached for the module: `qwen35moe_checkpoint("x4k1",
    experts="fused")` -> Path (shapes: hf_models.QWEN35MOE_SHAPES)."""
    return checkpoint_cache(make_qwen35moe_shape, tmp_path_factory)


# (shape, checkpoint overrides, --outtype, --fuse-gate-up-exps): 4 / 5 / 7 / 8 experts, top-1 to top-4, both
# layouts, experts per expert and fused, an MTP block with its MoE FFN, tied head, f32 / bf16 / f16 checkpoints,
# sharded (a layer's experts split over shards), every --outtype (q8_0 with F16 fallbacks at hidden 48 and expert
# width 24), and the merged gate/up from per-expert, fused and MTP experts
CASES = [
    pytest.param("x4k1", dict(), "f32", False, id="x4k1-f32"),
    pytest.param("vl_x5k2_mtp", dict(dtype="bfloat16"), "auto", False, id="conditional-mtp-x5k2-bf16src-auto"),
    pytest.param("x7k3_fused_tied", dict(), "q8_0", False, id="x7k3-fused-tied-q8_0-f16-fallback"),
    pytest.param("x8k4", dict(dtype="float16", max_shard_size="100KB"), "f16", False, id="x8k4-sharded-f16src-f16"),
    pytest.param("x8k4", dict(), "bf16", True, id="x8k4-fuse-gate-up-bf16"),
    pytest.param("x7k3_fused_tied", dict(), "q8_0", True, id="x7k3-fused-fuse-gate-up-q8_0"),
    pytest.param("vl_x5k2_mtp", dict(), "f32", True, id="conditional-mtp-fuse-gate-up-f32"),
]


@pytest.mark.parametrize("shape, overrides, outtype, fuse", CASES)
def test_matches_llama_cpp_converter(qwen35moe_checkpoint, llama_cpp_dir, tmp_path, shape, overrides, outtype, fuse):
    model = qwen35moe_checkpoint(shape, **overrides)
    if overrides.get("max_shard_size"):
        assert len(list(model.glob("model-*.safetensors"))) > 1
    flags = ["--fuse-gate-up-exps"] if fuse else []
    ref = llama_convert_qwen35(llama_cpp_dir, model, tmp_path / "ref.gguf", "--outtype", outtype, *flags)
    ours = convert_hf_to_gguf(model, tmp_path / "ours.gguf", outtype=outtype, fuse_gate_up_exps=fuse, progress=False)
    assert_same_gguf(ours, ref, ulp_tolerant=ULP)
    names = [t[0] for t in read_gguf(ours)[1]]
    assert ("blk.0.ffn_gate_up_exps.weight" in names) == fuse
    assert ("blk.0.ffn_gate_exps.weight" in names) == (not fuse)


def test_vocab_only_matches_llama_cpp(qwen35moe_checkpoint, llama_cpp_dir, tmp_path):
    model = qwen35moe_checkpoint("vl_x5k2_mtp")
    ref = llama_convert_qwen35(llama_cpp_dir, model, tmp_path / "ref.gguf", "--outtype", "f16", "--vocab-only")
    ours = convert_hf_to_gguf(model, tmp_path / "ours.gguf", outtype="f16", vocab_only=True, progress=False)
    assert_same_gguf(ours, ref)


def test_qwen3moe_fuse_gate_up_refused_as_llama_cpp(llama_cpp_dir, tmp_path):
    """llama.cpp's qwen3moe has no ffn_gate_up_exps: its converter fails on the flag, ours refuses it up front."""
    model = make_qwen3moe_shape(tmp_path / "hf", "x4k1")
    res = llama_convert(llama_cpp_dir, model, tmp_path / "ref.gguf", "--outtype", "f32", "--fuse-gate-up-exps",
                        expect_ok=False)
    assert res.returncode != 0 and "FFN_GATE_UP_EXP" in res.stderr and "QWEN3MOE" in res.stderr
    with pytest.raises(ConversionError, match=r"--fuse-gate-up-exps: llama\.cpp's qwen3moe has no merged "
                                              r"ffn_gate_up_exps"):
        convert_hf_to_gguf(model, tmp_path / "x.gguf", fuse_gate_up_exps=True, progress=False)
    assert not (tmp_path / "x.gguf").exists()


# --------------------------------------------------------------------------------------------------
# the contract, from the HF tensors directly


def test_qwen35moe_contract(qwen35moe_checkpoint, tmp_path):
    """The MoE keys; expert x of blk.N.ffn_{gate,up,down}_exps is the checkpoint's mlp.experts.x.*_proj of layer N
    (ggml ne = {cols, rows, experts}), the MTP block's experts included (blk.n_layer); the router and the shared
    expert's gate kept F32."""
    model = qwen35moe_checkpoint("vl_x5k2_mtp")
    cfg = json.loads((model / "config.json").read_text())["text_config"]
    hf = hf_tensors(model)
    kv, tensors = read_gguf(convert_hf_to_gguf(model, tmp_path / "m.gguf", outtype="f32", progress=False))
    by_name = {name: (shape, dtype, data) for name, shape, dtype, data in tensors}
    E, F, S, X = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"], 5
    n_layer = cfg["num_hidden_layers"]
    assert kv["general.architecture"][1] == "qwen35moe"
    assert kv["qwen35moe.block_count"] == (["UINT32"], n_layer + 1)
    assert kv["qwen35moe.nextn_predict_layers"] == (["UINT32"], 1)
    assert kv["qwen35moe.expert_count"] == (["UINT32"], X)
    assert kv["qwen35moe.expert_used_count"] == (["UINT32"], 2)
    assert kv["qwen35moe.expert_feed_forward_length"] == (["UINT32"], F)
    assert kv["qwen35moe.expert_shared_feed_forward_length"] == (["UINT32"], S)
    assert kv["qwen35moe.ssm.group_count"] == (["UINT32"], cfg["linear_num_key_heads"])
    for bid, prefix in ((1, "model.language_model.layers.1.mlp."), (n_layer, "mtp.layers.0.mlp.")):
        assert by_name[f"blk.{bid}.ffn_gate_inp.weight"][:2] == ([E, X], "F32")
        np.testing.assert_array_equal(by_name[f"blk.{bid}.ffn_gate_inp.weight"][2], hf[prefix + "gate.weight"])
        for proj, gguf_name, shape in (("gate_proj", "ffn_gate_exps", [E, F, X]),
                                       ("up_proj", "ffn_up_exps", [E, F, X]),
                                       ("down_proj", "ffn_down_exps", [F, E, X])):
            got_shape, dtype, data = by_name[f"blk.{bid}.{gguf_name}.weight"]
            assert (got_shape, dtype) == (shape, "F32")
            for x in range(X):
                np.testing.assert_array_equal(data[x], hf[f"{prefix}experts.{x}.{proj}.weight"], err_msg=gguf_name)
        for proj, gguf_name in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"),
                                ("down_proj", "ffn_down_shexp")):
            np.testing.assert_array_equal(by_name[f"blk.{bid}.{gguf_name}.weight"][2],
                                          hf[f"{prefix}shared_expert.{proj}.weight"])
        assert by_name[f"blk.{bid}.ffn_gate_inp_shexp.weight"][:2] == ([E, 1], "F32")
        np.testing.assert_array_equal(by_name[f"blk.{bid}.ffn_gate_inp_shexp.weight"][2].reshape(1, E),
                                      hf[prefix + "shared_expert_gate.weight"])
    assert not any(".experts." in n or n.endswith(("ffn_gate.weight", "ffn_up.weight")) for n in by_name)


@pytest.mark.parametrize("shape", ["x4k1", "x7k3_fused_tied"])
def test_fused_gate_up_is_gate_then_up(qwen35moe_checkpoint, tmp_path, shape):
    """--fuse-gate-up-exps: expert x of blk.N.ffn_gate_up_exps is the checkpoint's gate_proj of expert x followed by
    its up_proj along the expert-width axis (ggml ne = {hidden, 2 × width, experts}); no gate / up left."""
    model = qwen35moe_checkpoint(shape)
    cfg = json.loads((model / "config.json").read_text())
    hf = hf_tensors(model)
    _, tensors = read_gguf(convert_hf_to_gguf(model, tmp_path / "m.gguf", outtype="f32", fuse_gate_up_exps=True,
                                              progress=False))
    by_name = {name: (shape_, dtype, data) for name, shape_, dtype, data in tensors}
    E, F, X = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    for bid in range(cfg["num_hidden_layers"]):
        got_shape, dtype, data = by_name[f"blk.{bid}.ffn_gate_up_exps.weight"]
        assert (got_shape, dtype) == ([E, 2 * F, X], "F32")
        p = f"model.layers.{bid}.mlp.experts."
        for x in range(X):
            if p + "gate_up_proj" in hf:
                want = hf[p + "gate_up_proj"][x]
            else:
                want = np.concatenate([hf[f"{p}{x}.gate_proj.weight"], hf[f"{p}{x}.up_proj.weight"]])
            np.testing.assert_array_equal(data[x], want, err_msg=f"layer {bid} expert {x}")
    assert not any(n.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")) for n in by_name)


@pytest.mark.parametrize("fuse", [False, True], ids=["split", "merged-gate-up"])
def test_per_expert_and_fused_layouts_give_the_same_file(qwen35moe_checkpoint, tmp_path, fuse):
    a, b = (convert_hf_to_gguf(qwen35moe_checkpoint("x8k4", experts=experts), tmp_path / f"{experts}.gguf",
                               outtype="f16", fuse_gate_up_exps=fuse, progress=False)
            for experts in ("per_expert", "fused"))
    assert_same_gguf(a, b)


def test_cli(qwen35moe_checkpoint, tmp_path, capsys):
    assert convert_main(["--print-supported-models"]) == 0
    listed = capsys.readouterr().out.split()
    assert "Qwen3_5MoeForCausalLM" in listed and "Qwen3_5MoeForConditionalGeneration" in listed
    out = tmp_path / "m.gguf"
    assert convert_main([str(qwen35moe_checkpoint("x4k1")), "--outfile", str(out), "--outtype", "f32",
                         "--fuse-gate-up-exps", "--no-progress"]) == 0
    names = [t[0] for t in read_gguf(out)[1]]
    assert "blk.3.ffn_gate_up_exps.weight" in names and "blk.3.ffn_up_exps.weight" not in names


# --------------------------------------------------------------------------------------------------
# errors


def _experts(n: int):
    return lambda c: c.update(num_experts=n, num_experts_per_tok=1)


@pytest.mark.parametrize("shape, edit, match", [
    ("x4k1", lambda c: c.pop("num_experts"), r"config\.json: no num_experts: Qwen3\.5 MoE checkpoints"),
    ("x4k1", lambda c: c.update(num_experts_per_tok=5), r"num_experts_per_tok = 5, expected 1\.\.num_experts \(4\)"),
    ("x4k1", lambda c: c.update(num_experts_per_tok=0), r"num_experts_per_tok = 0, expected 1\.\.num_experts \(4\)"),
    # per expert, one fewer in the config than stored: the first surplus expert is named
    ("x4k1", _experts(3), r"tensor 'model\.layers\.0\.mlp\.experts\.3\.down_proj\.weight' names expert 3, but "
                          r"num_experts is 3"),
    # per expert, one more: the layer never completes; its router, read after its experts, disagrees first
    ("x4k1", _experts(5), r"router 'model\.layers\.0\.mlp\.gate\.weight' has shape \[4, 64\], expected \[5, 64\] "
                          r"\(num_experts, hidden_size\)"),
    # fused: the stacked tensors' first axis
    ("x7k3_fused_tied", _experts(6), r"tensor 'model\.layers\.0\.mlp\.experts\.down_proj' has shape \[7, 48, 24\], "
                                     r"expected \[6, 48, 24\] \(num_experts, hidden_size, moe_intermediate_size\)"),
    ("x4k1", lambda c: c.update(moe_intermediate_size=16),
     r"mlp\.experts\.0\.down_proj\.weight' has shape \[64, 32\], expected \[64, 16\] \(hidden_size, "
     r"moe_intermediate_size\)"),
], ids=["no-expert-count", "top-k-above-experts", "top-k-zero", "fewer-experts-than-stored",
        "more-experts-than-stored", "fused-experts-count", "expert-width"])
def test_config_disagrees(qwen35moe_checkpoint, tmp_path, shape, edit, match):
    model = copy_checkpoint(qwen35moe_checkpoint(shape), tmp_path / "m")
    edit_config(model, edit)
    with pytest.raises(ConversionError, match=match):
        convert_hf_to_gguf(model, tmp_path / "x.gguf", progress=False)


def test_missing_expert_of_an_mtp_block(qwen35moe_checkpoint, tmp_path):
    """The error names the checkpoint's tensors (mtp.layers.0…, not llama.cpp's renumbered layer)."""
    model = copy_checkpoint(qwen35moe_checkpoint("vl_x5k2_mtp"), tmp_path / "m")
    drop_tensor(model, "mtp.layers.0.mlp.experts.2.up_proj.weight")
    with pytest.raises(ConversionError, match=r"incomplete experts .*all 5 experts\); left over: "
                                              r"\['mtp\.layers\.0\.mlp\.experts\.0\.down_proj\.weight'"):
        convert_hf_to_gguf(model, tmp_path / "x.gguf", progress=False)
    assert not (tmp_path / "x.gguf").exists()
