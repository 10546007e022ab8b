"""pydflash-convert for Qwen3.5 (arch `qwen35`) against llama.cpp's own converter, the transforms of
gguf-formats.md §3.3 checked from the HF tensors directly, and the error paths.

Reference runs (tests/llama_ref.py): the pinned llama.cpp `convert_hf_to_gguf.py`. Two limits of that
converter shape how it is called here:

- A checkpoint without MTP weights whose config has no `mtp_num_hidden_layers` (anything written by
  transformers' `save_pretrained`) makes it fail (`assert self.opt_num_mtp_layers != 0` in
  `_QwenMtpMixin.__init__`) unless `--no-mtp` is passed. For such checkpoints `--no-mtp` is exactly the
  right reference (no MTP tensors to drop; block_count = num_hidden_layers). Checkpoints with MTP
  weights run without flags.
- It reads config.json through transformers' AutoConfig. When a config has no `layer_types`,
  `Qwen3_5TextConfig` consumes `full_attention_interval` to build them and drops the field, so
  llama.cpp writes `full_attention_interval = 4` whatever the config says; pydflash writes the config's
  value (the key only matters to loaders when `attention.recurrent_layers` is absent, and both files
  carry the same recurrent_layers). `test_interval_from_config` pins that difference.

`ssm_a = −exp(A_log)`: llama.cpp evaluates exp with torch (SLEEF, vectorised, ≤1 ulp), pydflash in
float64 rounded once, so `ssm_a` may differ in the last bit; it is compared with a 1-ulp tolerance.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from hf_models import copy_checkpoint, edit_config, hf_tensors
from llama_ref import assert_same_gguf, llama_convert, llama_convert_qwen35, read_gguf
from pydflash.convert import convert_hf_to_gguf
from pydflash.convert.cli import main as convert_main
from pydflash.errors import ConversionError

ULP = ("ssm_a",)


# (shape, checkpoint overrides, --outtype). K:V linear heads 2:4, 2:2, 1:3, 8:32; partial rotary 0.25 / 0.5;
# explicit and default M-RoPE sections; tied head; f32 / bf16 / f16 checkpoints; 0 / 1 / 2 MTP blocks; the
# ConditionalGeneration layout; sharded; every --outtype (q8_0 with F16 row fallbacks at hidden 48).
CASES = [
    pytest.param("k2v4_hd32", {}, "f32", id="k2v4-f32"),
    pytest.param("k2v4_hd32", dict(dtype="bfloat16", max_shard_size="60KB"), "auto", id="k2v4-bf16src-sharded-auto"),
    pytest.param("k2v2_prf05_nomrope", dict(vocab_size=800), "bf16", id="k2v2-prf05-default-sections-padded-vocab"),
    pytest.param("k1v3_tied_mtp", dict(dtype="float16"), "q8_0", id="k1v3-tied-mtp1-f16src-q8_0"),
    pytest.param("k8v32_hd8", {}, "f16", id="k8v32-f16"),
    pytest.param("vl_k2v4_mtp2", dict(dtype="bfloat16"), "bf16", id="conditional-generation-mtp2-bf16"),
]


@pytest.mark.parametrize("shape, overrides, outtype", CASES)
def test_matches_llama_cpp_converter(qwen35_checkpoint, llama_cpp_dir, tmp_path, shape, overrides, outtype):
    model = qwen35_checkpoint(shape, **overrides)
    if overrides.get("max_shard_size"):
        assert len(list(model.glob("model-*.safetensors"))) > 1
    ref = llama_convert_qwen35(llama_cpp_dir, model, tmp_path / "ref.gguf", "--outtype", outtype)
    ours = convert_hf_to_gguf(model, tmp_path / "ours.gguf", outtype=outtype, progress=False)
    assert_same_gguf(ours, ref, ulp_tolerant=ULP)


def test_vocab_only_matches_llama_cpp(qwen35_checkpoint, llama_cpp_dir, tmp_path):
    """--vocab-only of a checkpoint with MTP: block_count still counts the MTP blocks."""
    model = qwen35_checkpoint("k1v3_tied_mtp")
    ref = llama_convert_qwen35(llama_cpp_dir, model, tmp_path / "ref.gguf", "--outtype", "f16", "--vocab-only")
    ours = convert_hf_to_gguf(model, tmp_path / "ours.gguf", outtype="f16", vocab_only=True, progress=False)
    assert_same_gguf(ours, ref)
    kv, tensors = read_gguf(ours)
    assert not tensors
    assert kv["qwen35.block_count"][1] == 5 and kv["qwen35.nextn_predict_layers"][1] == 1
    assert kv["tokenizer.ggml.pre"][1] == "qwen35"


def test_mtp_in_config_but_not_in_checkpoint(qwen35_checkpoint, llama_cpp_dir, tmp_path, caplog):
    """transformers' save_pretrained drops `mtp.*` but keeps `mtp_num_hidden_layers`. llama.cpp would
    then declare MTP blocks it has no tensors for (a file its loader rejects); pydflash follows the
    weights, says so, and writes what `--no-mtp` writes."""
    model = copy_checkpoint(qwen35_checkpoint("k2v4_hd32"), tmp_path / "m")
    edit_config(model, lambda c: c.update(mtp_num_hidden_layers=1))
    ref = llama_convert(llama_cpp_dir, model, tmp_path / "ref.gguf", "--outtype", "f16", "--no-mtp")
    with caplog.at_level(logging.WARNING, logger="pydflash.convert"):
        ours = convert_hf_to_gguf(model, tmp_path / "ours.gguf", outtype="f16", progress=False)
    assert_same_gguf(ours, ref, ulp_tolerant=ULP)
    assert "mtp_num_hidden_layers = 1 but the checkpoint holds 0" in caplog.text
    kv, _ = read_gguf(ours)
    assert kv["qwen35.block_count"][1] == 4 and "qwen35.nextn_predict_layers" not in kv


def test_interval_from_config(qwen35_checkpoint, llama_cpp_dir, tmp_path):
    """No layer_types, full_attention_interval 2: same recurrent_layers as llama.cpp; the interval key
    carries the config's value where llama.cpp writes its default 4 (see the module docstring)."""
    model = qwen35_checkpoint("k2v2_prf05_nomrope", layer_types=None, full_attention_interval=2)
    assert "layer_types" in json.loads((model / "config.json").read_text())  # save_pretrained writes them...
    model = copy_checkpoint(model, tmp_path / "m")
    edit_config(model, lambda c: c.pop("layer_types"))  # ...the Hub configs of some fine-tunes do not
    ref = llama_convert_qwen35(llama_cpp_dir, model, tmp_path / "ref.gguf", "--outtype", "f32")
    ours = convert_hf_to_gguf(model, tmp_path / "ours.gguf", outtype="f32", progress=False)
    assert_same_gguf(ours, ref, ulp_tolerant=ULP, ignore_keys=("qwen35.full_attention_interval",))
    kv_ours, kv_ref = read_gguf(ours)[0], read_gguf(ref)[0]
    assert kv_ours["qwen35.attention.recurrent_layers"][1] == [True, False, True]
    assert kv_ours["qwen35.full_attention_interval"][1] == 2
    assert kv_ref["qwen35.full_attention_interval"][1] == 4


# --------------------------------------------------------------------------------------------------
# the contract (gguf-formats.md §3), without llama.cpp


def _tiled(a: np.ndarray, n_k: int, r: int, head_dim: int) -> np.ndarray:
    """Grouped → tiled V-head order along axis 0, written out index by index: tiled row block
    (j·n_k + g) is grouped row block (g·r + j)."""
    blocks = a.reshape(n_k * r, head_dim, *a.shape[1:])
    return np.concatenate([blocks[g * r + j] for j in range(r) for g in range(n_k)], axis=0).reshape(a.shape)


@pytest.mark.parametrize("shape", ["k2v4_hd32", "k1v3_tied_mtp"])
def test_qwen35_contract(qwen35_checkpoint, tmp_path, shape):
    model = qwen35_checkpoint(shape)
    cfg = json.loads((model / "config.json").read_text())
    hf = hf_tensors(model)
    kv, tensors = read_gguf(convert_hf_to_gguf(model, tmp_path / "m.gguf", outtype="f32", progress=False))
    g = {name: (shape_, dtype, data) for name, shape_, dtype, data in tensors}

    n_layer, n_embd, hd = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["head_dim"]
    nk, nv, dk = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"]
    r, key_dim, value_dim = nv // nk, dk * nk, dk * nv
    n_mtp = cfg.get("mtp_num_hidden_layers", 0)
    rope = cfg["rope_parameters"]

    # §3.1 keys
    assert kv["general.architecture"][1] == "qwen35"
    assert kv["qwen35.block_count"] == (["UINT32"], n_layer + n_mtp)
    if n_mtp:
        assert kv["qwen35.nextn_predict_layers"] == (["UINT32"], n_mtp)
    assert kv["qwen35.ssm.conv_kernel"] == (["UINT32"], cfg["linear_conv_kernel_dim"])
    assert kv["qwen35.ssm.state_size"] == (["UINT32"], dk)
    assert kv["qwen35.ssm.group_count"] == (["UINT32"], nk)
    assert kv["qwen35.ssm.time_step_rank"] == (["UINT32"], nv)
    assert kv["qwen35.ssm.inner_size"] == (["UINT32"], value_dim)
    recurrent = [t == "linear_attention" for t in cfg["layer_types"]] + [False] * n_mtp
    assert kv["qwen35.attention.recurrent_layers"] == (["ARRAY", "BOOL"], recurrent)
    assert kv["qwen35.full_attention_interval"] == (["UINT32"], 4)
    assert kv["qwen35.rope.dimension_count"] == (["UINT32"], int(hd * rope["partial_rotary_factor"]))
    assert kv["qwen35.rope.dimension_sections"] == (["ARRAY", "INT32"], rope["mrope_section"] + [0])
    assert kv["qwen35.attention.key_length"] == (["UINT32"], hd)
    assert kv["qwen35.attention.layer_norm_rms_epsilon"][0] == ["FLOAT32"]
    assert kv["tokenizer.ggml.pre"][1] == "qwen35"

    # §3.2 / §3.3 tensors
    assert ("output.weight" in g) == (not cfg["tie_word_embeddings"])
    lin = cfg["layer_types"].index("linear_attention")
    att = cfg["layer_types"].index("full_attention")
    p = f"model.layers.{lin}.linear_attn."

    def get(name):
        shape_, dtype, data = g[name]
        return shape_, dtype, np.asarray(data).reshape(list(reversed(shape_)))

    shape_, dtype, qkv = get(f"blk.{lin}.attn_qkv.weight")
    assert shape_ == [n_embd, 2 * key_dim + value_dim] and dtype == "F32"
    w = hf[p + "in_proj_qkv.weight"]
    np.testing.assert_array_equal(qkv, np.concatenate([w[:2 * key_dim], _tiled(w[2 * key_dim:], nk, r, dk)]))
    np.testing.assert_array_equal(get(f"blk.{lin}.attn_gate.weight")[2], _tiled(hf[p + "in_proj_z.weight"], nk, r, dk))
    np.testing.assert_array_equal(get(f"blk.{lin}.ssm_beta.weight")[2], _tiled(hf[p + "in_proj_b.weight"], nk, r, 1))
    np.testing.assert_array_equal(get(f"blk.{lin}.ssm_alpha.weight")[2], _tiled(hf[p + "in_proj_a.weight"], nk, r, 1))
    np.testing.assert_array_equal(get(f"blk.{lin}.ssm_dt.bias")[2], _tiled(hf[p + "dt_bias"], nk, r, 1))
    shape_, dtype, ssm_a = get(f"blk.{lin}.ssm_a")
    assert shape_ == [nv] and dtype == "F32"
    np.testing.assert_allclose(ssm_a, _tiled(-np.exp(hf[p + "A_log"].astype(np.float64)), nk, r, 1), rtol=1e-7)
    assert (ssm_a < 0).all()
    shape_, dtype, conv = get(f"blk.{lin}.ssm_conv1d.weight")
    assert shape_ == [cfg["linear_conv_kernel_dim"], 2 * key_dim + value_dim] and dtype == "F32"
    c = hf[p + "conv1d.weight"][:, 0, :]
    np.testing.assert_array_equal(conv, np.concatenate([c[:2 * key_dim], _tiled(c[2 * key_dim:], nk, r, dk)]))
    out = hf[p + "out_proj.weight"]
    np.testing.assert_array_equal(get(f"blk.{lin}.ssm_out.weight")[2], _tiled(out.T, nk, r, dk).T)
    np.testing.assert_array_equal(get(f"blk.{lin}.ssm_norm.weight")[2], hf[p + "norm.weight"])  # no +1
    # +1 on the zero-centred norms
    for gguf_name, hf_name in [(f"blk.{lin}.attn_norm.weight", f"model.layers.{lin}.input_layernorm.weight"),
                               (f"blk.{lin}.post_attention_norm.weight",
                                f"model.layers.{lin}.post_attention_layernorm.weight"),
                               (f"blk.{att}.attn_q_norm.weight", f"model.layers.{att}.self_attn.q_norm.weight"),
                               (f"blk.{att}.attn_k_norm.weight", f"model.layers.{att}.self_attn.k_norm.weight"),
                               ("output_norm.weight", "model.norm.weight")]:
        np.testing.assert_array_equal(get(gguf_name)[2], hf[hf_name] + np.float32(1))
    assert g[f"blk.{att}.attn_q.weight"][0] == [n_embd, 2 * hd * cfg["num_attention_heads"]]
    assert f"blk.{att}.ffn_norm.weight" not in g
    if n_mtp:
        m = n_layer
        assert g[f"blk.{m}.nextn.eh_proj.weight"][0] == [2 * n_embd, n_embd]
        np.testing.assert_array_equal(get(f"blk.{m}.nextn.eh_proj.weight")[2], hf["mtp.fc.weight"])
        for gguf_name, hf_name in [("nextn.enorm", "mtp.pre_fc_norm_embedding"),
                                   ("nextn.hnorm", "mtp.pre_fc_norm_hidden"), ("nextn.shared_head_norm", "mtp.norm"),
                                   ("attn_norm", "mtp.layers.0.input_layernorm")]:
            np.testing.assert_array_equal(get(f"blk.{m}.{gguf_name}.weight")[2],
                                          hf[hf_name + ".weight"] + np.float32(1))
        assert f"blk.{m}.ssm_a" not in g


def test_same_tensors_in_both_layouts(qwen35_checkpoint, tmp_path):
    """The ConditionalGeneration layout converts to the same tensors as the CausalLM one (vision tower
    dropped, `model.language_model.` stripped, top-level `mtp.*` appended)."""
    a = convert_hf_to_gguf(qwen35_checkpoint("k2v4_hd32", mtp_layers=2), tmp_path / "a.gguf", outtype="f32",
                           progress=False)
    b = convert_hf_to_gguf(qwen35_checkpoint("vl_k2v4_mtp2"), tmp_path / "b.gguf", outtype="f32", progress=False)
    ta, tb = read_gguf(a)[1], read_gguf(b)[1]
    assert sorted(t[0] for t in ta) == sorted(t[0] for t in tb)
    by_name = {t[0]: t for t in tb}
    for name, shape_, dtype, data in ta:
        assert by_name[name][1:3] == (shape_, dtype)
        np.testing.assert_array_equal(data, by_name[name][3], err_msg=name)


def test_cli_logs_mtp(qwen35_checkpoint, tmp_path, caplog):
    model = qwen35_checkpoint("k1v3_tied_mtp")
    with caplog.at_level(logging.INFO, logger="pydflash.convert"):
        assert convert_main([str(model), "--outfile", str(tmp_path / "q35-{ftype}.gguf"), "--outtype", "bf16",
                             "--no-progress"]) == 0
    assert (tmp_path / "q35-bf16.gguf").is_file()
    assert "MTP: appending 1 multi-token-prediction block(s) as blk.4..blk.4" in caplog.text


# --------------------------------------------------------------------------------------------------
# errors


def test_unknown_layer_type(qwen35_checkpoint, tmp_path):
    model = copy_checkpoint(qwen35_checkpoint("k2v4_hd32"), tmp_path / "m")
    edit_config(model, lambda c: c.update(layer_types=["linear_attention", "sliding_attention",
                                                        "linear_attention", "full_attention"]))
    with pytest.raises(ConversionError, match=r"unknown layer type\(s\) \['sliding_attention'\]"):
        convert_hf_to_gguf(model, tmp_path / "x.gguf", progress=False)
    assert not (tmp_path / "x.gguf").exists()


def test_layer_types_length(qwen35_checkpoint, tmp_path):
    model = copy_checkpoint(qwen35_checkpoint("k2v4_hd32"), tmp_path / "m")
    edit_config(model, lambda c: c.update(layer_types=["linear_attention", "full_attention"]))
    with pytest.raises(ConversionError, match=r"layer_types has 2 entries, expected num_hidden_layers \(4\)"):
        convert_hf_to_gguf(model, tmp_path / "x.gguf", progress=False)


def test_layer_type_disagrees_with_tensors(qwen35_checkpoint, tmp_path):
    model = copy_checkpoint(qwen35_checkpoint("k2v4_hd32"), tmp_path / "m")
    edit_config(model, lambda c: c.update(layer_types=["full_attention"] + c["layer_types"][1:]))
    with pytest.raises(ConversionError, match=r"does not belong in layer 0, which layer_types declares 'full_attent"):
        convert_hf_to_gguf(model, tmp_path / "x.gguf", progress=False)


def test_unequal_linear_head_dims(qwen35_checkpoint, tmp_path):
    model = copy_checkpoint(qwen35_checkpoint("k2v4_hd32"), tmp_path / "m")
    edit_config(model, lambda c: c.update(linear_value_head_dim=32))
    with pytest.raises(ConversionError, match=r"linear_key_head_dim \(16\) != linear_value_head_dim \(32\)"):
        convert_hf_to_gguf(model, tmp_path / "x.gguf", progress=False)


def test_value_heads_not_a_multiple(qwen35_checkpoint, tmp_path):
    model = copy_checkpoint(qwen35_checkpoint("k2v4_hd32"), tmp_path / "m")
    edit_config(model, lambda c: c.update(linear_num_key_heads=3))
    with pytest.raises(ConversionError, match=r"linear_num_value_heads \(4\) must be a multiple of linear_num_key_h"):
        convert_hf_to_gguf(model, tmp_path / "x.gguf", progress=False)


def test_dense_checkpoint_labelled_moe_is_refused(qwen35_checkpoint, tmp_path):
    """A dense Qwen3.5 config under the MoE class has no expert count: refused, naming what is missing (llama.cpp's
    converter would assume transformers' default of 256 experts and fail later on the tensors)."""
    model = copy_checkpoint(qwen35_checkpoint("k2v4_hd32"), tmp_path / "m")
    edit_config(model, lambda c: c.update(architectures=["Qwen3_5MoeForCausalLM"]))
    with pytest.raises(ConversionError, match=r"no num_experts: Qwen3.5 MoE checkpoints \(arch qwen35moe\) are not "
                                              r"supported without their expert count"):
        convert_hf_to_gguf(model, tmp_path / "x.gguf", progress=False)


def test_unmappable_mtp_tensor(qwen35_checkpoint, tmp_path):
    import torch
    from safetensors.torch import save_file

    model = copy_checkpoint(qwen35_checkpoint("k1v3_tied_mtp"), tmp_path / "m")
    index = json.loads((model / "model.safetensors.index.json").read_text())
    save_file({"mtp.extra_proj.weight": torch.zeros(4, 4)}, str(model / "model-zz.safetensors"))
    index["weight_map"]["mtp.extra_proj.weight"] = "model-zz.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match=r"cannot map MTP tensor 'mtp.extra_proj.weight'"):
        convert_hf_to_gguf(model, tmp_path / "x.gguf", progress=False)
