"""pydflash-convert for DFlash drafts (arch `dflash`) against llama.cpp's own converter, the contract of
gguf-formats.md §4 checked directly, and the error paths.

Drafts are tiny random z-lab-layout checkpoints (tests/hf_models.py `make_dflash_checkpoint`) for tiny
Qwen3 and Qwen3.5 targets; both converters get `--target-model-dir`. The reference is the pinned
llama.cpp `convert_hf_to_gguf.py` run by tests/llama_ref.py (same vocab-hash substitute as
tests/test_convert.py, answered from the target's tokenizer.json).

Where pydflash deliberately differs from llama.cpp's converter (no reference comparison possible, the
behaviour is checked against the reference documents instead):
- missing `--target-model-dir`: both refuse; pydflash before reading any tensor, with ConversionError;
- missing `target_layer_ids`: llama.cpp writes no `dflash.target_layers` (its loader then refuses the
  file); pydflash writes z-lab's default (`build_target_layer_ids`, dflash-algorithm.md §1.2) + 1;
- inputs llama.cpp converts into files its runtime rejects (hidden size or vocab size unlike the
  target's, `target_layer_ids` the target graph does not fill, a mask id outside the vocabulary,
  DFlash2 / DSpark tensors in a DFlashDraftModel checkpoint) raise ConversionError here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import hf_models
from llama_ref import assert_same_gguf, llama_convert, read_gguf
from pydflash.convert import convert_hf_to_gguf
from pydflash.convert.cli import main as convert_main
from pydflash.convert.dflash import default_target_layer_ids
from pydflash.errors import ConversionError

MASK_ID = 790  # past the 768-token test tokenizer, inside the 800-row target embedding (like Qwen's 151669)


@pytest.fixture(scope="module")
def targets(qwen3_checkpoint, qwen35_checkpoint):
    """{"qwen3": Qwen3 target (6 layers), "qwen35": Qwen3.5 target (8 layers, M-RoPE)}, hidden 64, vocab 800."""
    return {
        "qwen3": qwen3_checkpoint("gqa4x2_hd64", hidden=64, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=16,
                                  vocab_size=800),
        "qwen35": qwen35_checkpoint("k2v4_hd32", n_layers=8, vocab_size=800),
    }


def _draft(tmp_path: Path, target: Path, name: str = "draft", **kw) -> Path:
    kw.setdefault("mask_token_id", MASK_ID)
    return hf_models.make_dflash_checkpoint(tmp_path / name, target, **kw)


def _edit_config(model: Path, fn) -> None:
    cfg = json.loads((model / "config.json").read_text())
    fn(cfg)
    (model / "config.json").write_text(json.dumps(cfg, indent=2))


# (target, draft options, --outtype)
CASES = [
    pytest.param("qwen3", dict(n_layers=2), "f16", id="qwen3-target-zlab-f16"),
    pytest.param("qwen35", dict(n_layers=3, head_dim=32, is_causal=False, dtype="bfloat16"), "auto",
                 id="qwen35-target-mrope-noncausal-bf16src-auto"),
    pytest.param("qwen3", dict(n_layers=2, prefix="model.", with_lm_head=True, is_causal=True, block_size=None,
                               target_layer_ids=[0, 4],
                               extra_config=dict(dflash_config=dict(mask_token_id=MASK_ID, target_layer_ids=[0, 4],
                                                                    block_size=8),
                                                 partial_rotary_factor=0.5, output_multiplier=0.5,
                                                 input_embedding_scale=2.0, final_logit_softcapping=30.0)),
                 "q8_0", id="qwen3-target-model-prefix-lm_head-causal-scales-q8_0"),
    pytest.param("qwen35", dict(n_layers=2, head_dim=32, dtype="float16",
                                extra_config=dict(use_sliding_window=True, sliding_window=64)),
                 "bf16", id="qwen35-target-swa-config-f16src-bf16"),
]


@pytest.mark.parametrize("target, opts, outtype", CASES)
def test_matches_llama_cpp_converter(targets, llama_cpp_dir, tmp_path, target, opts, outtype):
    draft = _draft(tmp_path, targets[target], **opts)
    ref = llama_convert(llama_cpp_dir, draft, tmp_path / "ref.gguf", "--outtype", outtype,
                        "--target-model-dir", str(targets[target]))
    ours = convert_hf_to_gguf(draft, tmp_path / "ours.gguf", outtype=outtype, target_model_dir=targets[target],
                              progress=False)
    # general.base_model.*: the target the drafter is for (llama.cpp's converter writes them from a model card)
    assert_same_gguf(ours, ref, only_ours=("general.base_model.",))


def test_vocab_only_matches_llama_cpp(targets, llama_cpp_dir, tmp_path):
    draft = _draft(tmp_path, targets["qwen35"], head_dim=32)
    ref = llama_convert(llama_cpp_dir, draft, tmp_path / "ref.gguf", "--outtype", "f16", "--vocab-only",
                        "--target-model-dir", str(targets["qwen35"]))
    ours = convert_hf_to_gguf(draft, tmp_path / "ours.gguf", outtype="f16", vocab_only=True,
                              target_model_dir=targets["qwen35"], progress=False)
    assert_same_gguf(ours, ref, only_ours=("general.base_model.",))


def test_missing_target_dir_both_refuse(targets, llama_cpp_dir, tmp_path, capsys):
    draft = _draft(tmp_path, targets["qwen3"])
    res = llama_convert(llama_cpp_dir, draft, tmp_path / "ref.gguf", "--outtype", "f16", expect_ok=False)
    assert res.returncode != 0 and "requires --target-model-dir" in res.stderr
    with pytest.raises(ConversionError, match=r"pass the target model folder with --target-model-dir"):
        convert_hf_to_gguf(draft, tmp_path / "x.gguf", progress=False)
    assert convert_main([str(draft), "--outfile", str(tmp_path / "x.gguf"), "--no-progress"]) == 1
    assert "--target-model-dir" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


# --------------------------------------------------------------------------------------------------
# the contract (gguf-formats.md §4, §5), without llama.cpp


@pytest.mark.parametrize("target", ["qwen3", "qwen35"])
def test_dflash_contract(targets, tmp_path, target):
    tdir = targets[target]
    draft = _draft(tmp_path, tdir, n_layers=3, head_dim=32, n_heads=4, n_kv_heads=2, target_layer_ids=[1, 2, 4])
    cfg = json.loads((draft / "config.json").read_text())
    kv, tensors = read_gguf(convert_hf_to_gguf(draft, tmp_path / "d.gguf", outtype="f32", target_model_dir=tdir,
                                               progress=False))
    g = {name: (shape, dtype, data) for name, shape, dtype, data in tensors}

    assert kv["general.architecture"][1] == "dflash"
    assert kv["dflash.target_layers"] == (["ARRAY", "INT32"], [2, 3, 5])  # HF ids + 1 (§4.3)
    assert kv["dflash.block_size"] == (["UINT32"], 16)
    assert kv["tokenizer.ggml.mask_token_id"] == (["UINT32"], MASK_ID)
    assert "dflash.attention.causal" not in kv  # the config does not state it
    assert kv["dflash.embedding_length"] == (["UINT32"], 64)
    assert kv["dflash.block_count"] == (["UINT32"], 3)
    assert kv["dflash.attention.key_length"] == (["UINT32"], 32)
    if target == "qwen35":
        assert kv["dflash.rope.dimension_sections"] == (["ARRAY", "INT32"], [16, 0, 0, 0])
    else:
        assert "dflash.rope.dimension_sections" not in kv
    assert kv["dflash.rope.freq_base"][1] == cfg["rope_theta"]

    # the tokenizer keys are the target's, as its own conversion writes them
    tkv, _ = read_gguf(convert_hf_to_gguf(tdir, tmp_path / "t.gguf", outtype="f32", vocab_only=True, progress=False))
    tok_keys = [k for k in tkv if k.startswith("tokenizer.")]
    assert tok_keys and all(kv[k] == tkv[k] for k in tok_keys)
    assert kv["tokenizer.ggml.pre"][1] == ("qwen35" if target == "qwen35" else "qwen2")

    # tensors: no token_embd / output (borrowed from the target)
    assert "token_embd.weight" not in g and "output.weight" not in g
    assert g["fc.weight"][:2] == ([3 * 64, 64], "F32")
    assert g["enc.output_norm.weight"][:2] == ([64], "F32")
    assert g["output_norm.weight"][:2] == ([64], "F32")
    assert g["blk.0.attn_q.weight"][:2] == ([64, 4 * 32], "F32")
    assert g["blk.2.attn_k.weight"][:2] == ([64, 2 * 32], "F32")
    assert g["blk.1.attn_q_norm.weight"][:2] == ([32], "F32")
    assert g["blk.1.ffn_norm.weight"][:2] == ([64], "F32")
    assert "blk.3.attn_norm.weight" not in g
    from safetensors.numpy import load_file

    hf = load_file(draft / "model.safetensors")
    for gguf_name, hf_name in [("fc.weight", "fc.weight"), ("enc.output_norm.weight", "hidden_norm.weight"),
                               ("output_norm.weight", "norm.weight"),  # plain weights: no +1 in a draft
                               ("blk.1.ffn_norm.weight", "layers.1.post_attention_layernorm.weight"),
                               ("blk.2.attn_output.weight", "layers.2.self_attn.o_proj.weight")]:
        shape, _, data = g[gguf_name]
        np.testing.assert_array_equal(np.asarray(data).reshape(list(reversed(shape))), hf[hf_name], err_msg=gguf_name)


def test_default_target_layers(targets, tmp_path, caplog):
    """No target_layer_ids: z-lab's build_target_layer_ids(num_target_layers, n_draft_layers) + 1."""
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab/Qwen3-4B-DFlash-b16
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # Qwen3.5-27B
    assert default_target_layer_ids(32, 1) == [16]
    draft = _draft(tmp_path, targets["qwen35"], n_layers=3, head_dim=32)
    _edit_config(draft, lambda c: c["dflash_config"].pop("target_layer_ids"))
    kv, _ = read_gguf(convert_hf_to_gguf(draft, tmp_path / "d.gguf", outtype="f16", target_model_dir=targets["qwen35"],
                                         progress=False))
    assert kv["dflash.target_layers"][1] == [i + 1 for i in default_target_layer_ids(8, 3)] == [2, 4, 6]
    assert "no target_layer_ids" in caplog.text


def test_causal_only_when_stated(targets, tmp_path):
    for is_causal, dflash_causal, expect in [(None, None, None), (True, None, True), (False, None, False),
                                             (None, True, True)]:
        draft = _draft(tmp_path, targets["qwen3"], name=f"d-{is_causal}-{dflash_causal}", is_causal=is_causal)
        if dflash_causal is not None:
            _edit_config(draft, lambda c: c["dflash_config"].update(causal=dflash_causal))
        kv, _ = read_gguf(convert_hf_to_gguf(draft, tmp_path / "d.gguf", outtype="f16",
                                             target_model_dir=targets["qwen3"], progress=False))
        assert kv.get("dflash.attention.causal", (None, None))[1] == expect


# --------------------------------------------------------------------------------------------------
# errors


def test_hidden_size_mismatch(targets, tmp_path):
    draft = _draft(tmp_path, targets["qwen3"], hidden=32)
    with pytest.raises(ConversionError, match=r"draft hidden_size 32 != target hidden_size 64"):
        convert_hf_to_gguf(draft, tmp_path / "x.gguf", target_model_dir=targets["qwen3"], progress=False)
    assert not (tmp_path / "x.gguf").exists()


def test_vocab_size_mismatch(targets, tmp_path):
    draft = _draft(tmp_path, targets["qwen3"])
    _edit_config(draft, lambda c: c.update(vocab_size=1024))
    with pytest.raises(ConversionError, match=r"draft vocab_size 1024 != target vocab_size 800"):
        convert_hf_to_gguf(draft, tmp_path / "x.gguf", target_model_dir=targets["qwen3"], progress=False)


@pytest.mark.parametrize("tensor, variant", [
    ("candidate_selector.hidden_projection.weight", "DFlash2"),
    ("layers.0.attention_conv.base_kernel", "DFlash2"),
    ("markov_head.markov_w1.weight", "DSpark"),
])
def test_variant_tensors_rejected(targets, tmp_path, tensor, variant):
    draft = _draft(tmp_path, targets["qwen3"], extra_tensors={tensor: (8, 64)})
    with pytest.raises(ConversionError, match=rf"tensor '{tensor}' belongs to a {variant} draft"):
        convert_hf_to_gguf(draft, tmp_path / "x.gguf", target_model_dir=targets["qwen3"], progress=False)
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("arch, what", [("DSparkDraftModel", "DSpark")])
def test_variant_architectures_rejected(targets, tmp_path, arch, what):
    draft = _draft(tmp_path, targets["qwen3"])
    _edit_config(draft, lambda c: c.update(architectures=[arch]))
    with pytest.raises(ConversionError, match=rf"{arch}: a {what} draft"):
        convert_hf_to_gguf(draft, tmp_path / "x.gguf", target_model_dir=targets["qwen3"], progress=False)


def test_dflash2_config_rejected(targets, tmp_path):
    draft = _draft(tmp_path, targets["qwen3"])
    _edit_config(draft, lambda c: c["dflash_config"].update(conv_kernel_size=4, conv_group_size=8, selector_rank=16,
                                                            selector_top_k=4))
    with pytest.raises(ConversionError, match=r"this is a DFlash2 draft \(conv_kernel_size"):
        convert_hf_to_gguf(draft, tmp_path / "x.gguf", target_model_dir=targets["qwen3"], progress=False)


def test_unknown_layer_type(targets, tmp_path):
    draft = _draft(tmp_path, targets["qwen3"])
    _edit_config(draft, lambda c: c.update(layer_types=["full_attention", "linear_attention"]))
    with pytest.raises(ConversionError, match=r"unknown layer type\(s\) \['linear_attention'\]"):
        convert_hf_to_gguf(draft, tmp_path / "x.gguf", target_model_dir=targets["qwen3"], progress=False)


def test_target_layer_out_of_range(targets, tmp_path):
    """Id 5 of a 6-layer target would be read as the input of layer 6, which the graph never fills (§4.3)."""
    draft = _draft(tmp_path, targets["qwen3"], target_layer_ids=[1, 5])
    with pytest.raises(ConversionError, match=r"target_layer_ids \[5\] out of range for a 6-layer target"):
        convert_hf_to_gguf(draft, tmp_path / "x.gguf", target_model_dir=targets["qwen3"], progress=False)


def test_fc_shape_mismatch(targets, tmp_path):
    draft = _draft(tmp_path, targets["qwen3"], target_layer_ids=[1, 2])
    _edit_config(draft, lambda c: c["dflash_config"].update(target_layer_ids=[1, 2, 3]))
    with pytest.raises(ConversionError, match=r"fc.weight is \[64, 128\], expected \[64, 192\]"):
        convert_hf_to_gguf(draft, tmp_path / "x.gguf", target_model_dir=targets["qwen3"], progress=False)


@pytest.mark.parametrize("mask, match", [(None, "no dflash_config.mask_token_id"),
                                         (800, "mask_token_id 800 is not a token of the target vocabulary")])
def test_bad_mask_token(targets, tmp_path, mask, match):
    draft = _draft(tmp_path, targets["qwen3"])
    _edit_config(draft, lambda c: c["dflash_config"].update(mask_token_id=mask) if mask is not None
                 else c["dflash_config"].pop("mask_token_id"))
    with pytest.raises(ConversionError, match=match):
        convert_hf_to_gguf(draft, tmp_path / "x.gguf", target_model_dir=targets["qwen3"], progress=False)


def test_target_is_a_draft_or_unsupported(targets, tmp_path):
    draft = _draft(tmp_path, targets["qwen3"])
    with pytest.raises(ConversionError, match=r"points at another DFlash draft"):
        convert_hf_to_gguf(draft, tmp_path / "x.gguf", target_model_dir=draft, progress=False)
    other = Path(shutil.copytree(targets["qwen3"], tmp_path / "llama"))
    _edit_config(other, lambda c: c.update(architectures=["LlamaForCausalLM"]))
    with pytest.raises(ConversionError, match=r"unsupported architecture 'LlamaForCausalLM'"):
        convert_hf_to_gguf(draft, tmp_path / "x.gguf", target_model_dir=other, progress=False)


def test_unmappable_tensor(targets, tmp_path):
    draft = _draft(tmp_path, targets["qwen3"], extra_tensors={"layers.0.self_attn.extra.weight": (4, 64)})
    with pytest.raises(ConversionError, match=r"cannot map tensor 'layers.0.self_attn.extra.weight'"):
        convert_hf_to_gguf(draft, tmp_path / "x.gguf", target_model_dir=targets["qwen3"], progress=False)


# --------------------------------------------------------------------------------------------------
# DFlash2 drafts (issue 25): converted as llama.cpp's converter writes them (run: tests/test_dflash2.py)

DFLASH2 = dict(conv_kernel_size=4, conv_group_size=16, selector_rank=8, selector_top_k=4)


def _draft2(tmp_path: Path, target: Path, name: str = "draft2", **kw) -> Path:
    kw.setdefault("mask_token_id", MASK_ID)
    return hf_models.make_dflash2_checkpoint(tmp_path / name, target, **{**DFLASH2, **kw})


@pytest.mark.parametrize("target, outtype, suffix", [("qwen3", "f16", ""), ("qwen35", "q8_0", ".weight")])
def test_dflash2_matches_llama_cpp_converter(targets, llama_cpp_dir, tmp_path, target, outtype, suffix):
    """Both converters on one DFlash2 checkpoint (codebooks stored without and with a .weight suffix): the same
    keys (dflash.conv_kernel_size ... selector_top_k) and tensors (blk.N.attn_conv_base ..., selector_*)."""
    draft = _draft2(tmp_path, targets[target], head_dim=16 if target == "qwen3" else 32, codebook_suffix=suffix)
    ref = llama_convert(llama_cpp_dir, draft, tmp_path / "ref.gguf", "--outtype", outtype,
                        "--target-model-dir", str(targets[target]))
    ours = convert_hf_to_gguf(draft, tmp_path / "ours.gguf", outtype=outtype, target_model_dir=targets[target],
                              progress=False)
    assert_same_gguf(ours, ref, only_ours=("general.base_model.",))
    kv, tensors = read_gguf(ours)
    assert {k: kv[f"dflash.{k}"] for k in DFLASH2} == {k: (["UINT32"], v) for k, v in DFLASH2.items()}
    assert {"blk.1.attn_conv_base", "blk.1.ffn_conv_proj.weight", "selector_hidden.weight"} <= {t[0] for t in tensors}


def test_dflash2_checkpoint_is_zlabs_and_converts_its_values(targets, tmp_path):
    """The test checkpoint is what z-lab's own DFlash2DraftModel loads (no missing or unexpected weight), and the
    f32 GGUF holds its parameters unchanged under llama.cpp's names."""
    dflash = pytest.importorskip("dflash")
    import torch

    draft = _draft2(tmp_path, targets["qwen3"], head_dim=16)
    model, info = dflash.DFlash2DraftModel.from_pretrained(draft, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours = convert_hf_to_gguf(draft, tmp_path / "ours.gguf", outtype="f32", target_model_dir=targets["qwen3"],
                              progress=False)
    tensors = {t[0]: t[3] for t in read_gguf(ours)[1]}
    params = dict(model.named_parameters())
    pairs = {"blk.0.attn_conv_base": "layers.0.attention_conv.base_kernel",
             "blk.1.ffn_conv_proj.weight": "layers.1.mlp_conv.kernel_projection.weight",
             "selector_predecessor.weight": "candidate_selector.predecessor_codebook.weight",
             "selector_successor.weight": "candidate_selector.successor_codebook.weight",
             "selector_hidden.weight": "candidate_selector.hidden_projection.weight"}
    for gguf_name, hf_name in pairs.items():
        np.testing.assert_array_equal(np.asarray(tensors[gguf_name]).reshape(params[hf_name].shape),
                                      params[hf_name].detach().numpy(), err_msg=gguf_name)


@pytest.mark.parametrize("edit, match", [
    (lambda c: c["dflash_config"].pop("selector_top_k"), r"dflash_config.selector_top_k = None; a DFlash2 draft "
                                                         r"needs a positive integer"),
    (lambda c: c["dflash_config"].update(conv_group_size=24), r"hidden_size 64 is not a multiple of "
                                                              r"conv_group_size 24"),
    (lambda c: c["dflash_config"].update(selector_rank=16), r"tensor 'candidate_selector.hidden_projection.weight' "
                                                            r"is \[8, 64\], expected \[16, 64\]"),
])
def test_dflash2_bad_config(targets, tmp_path, edit, match):
    draft = _draft2(tmp_path, targets["qwen3"], head_dim=16)
    _edit_config(draft, edit)
    with pytest.raises(ConversionError, match=match):
        convert_hf_to_gguf(draft, tmp_path / "x.gguf", target_model_dir=targets["qwen3"], progress=False)
    assert not (tmp_path / "x.gguf").exists()


def test_dflash2_missing_conv_tensor(targets, tmp_path):
    from safetensors.numpy import load_file, save_file

    draft = _draft2(tmp_path, targets["qwen3"], head_dim=16)
    state = load_file(str(draft / "model.safetensors"))
    del state["layers.1.mlp_conv.base_kernel"]
    save_file(state, str(draft / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"needs tensor 'layers.1.mlp_conv.base_kernel', which is missing"):
        convert_hf_to_gguf(draft, tmp_path / "x.gguf", target_model_dir=targets["qwen3"], progress=False)
