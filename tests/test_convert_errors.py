"""pydflash-convert on bad input: every case ends in a ConversionError (the CLI: one line, exit 1) that names the file,
key or tensor, and never in a traceback, a destroyed input or a GGUF pydflash cannot load (the project's rule).
The --no-nextn output is compared with llama.cpp's own converter run with the same flag."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import gguf
import pytest

from hf_models import copy_checkpoint, drop_tensor, edit_config
from llama_ref import assert_same_gguf, llama_convert
from pydflash.convert import convert_hf_to_gguf
from pydflash.convert.cli import main as convert_main
from pydflash.errors import ConversionError


@pytest.fixture
def model(qwen3_checkpoint, tmp_path) -> Path:
    """A private copy of an untied two-layer Qwen3 checkpoint (tests edit it)."""
    return copy_checkpoint(qwen3_checkpoint("gqa4x2_hd64"), tmp_path / "m")


def _convert(model: Path, out: Path | str, **kw) -> Path:
    return convert_hf_to_gguf(model, out, outtype="f16", progress=False, **kw)


def _no_partials(folder: Path) -> None:
    assert not list(folder.glob("*.partial")), list(folder.iterdir())


# --------------------------------------------------------------------------------------------------
# --outfile


def test_symlink_outfile_is_written_through(model, tmp_path):
    real = tmp_path / "elsewhere" / "real.gguf"
    real.parent.mkdir()
    real.write_bytes(b"old")
    link = tmp_path / "link.gguf"
    link.symlink_to(real)
    _convert(model, link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert gguf.GGUFReader(real).fields["general.architecture"].contents() == "qwen3"
    _no_partials(tmp_path)
    _no_partials(real.parent)


def test_non_regular_outfile_is_refused(model, tmp_path):
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ConversionError, match=r"fifo\.gguf: exists and is not a regular file"):
        _convert(model, fifo)
    assert fifo.exists() and not fifo.is_file()  # still the FIFO
    _no_partials(tmp_path)


@pytest.mark.parametrize("dry_run", [False, True])
def test_outfile_in_a_missing_folder(model, tmp_path, capsys, dry_run):
    out = tmp_path / "nope" / "x.gguf"
    with pytest.raises(ConversionError, match=r"nope/x\.gguf: .*folder .*nope does not exist") as e:
        _convert(model, out, dry_run=dry_run)
    assert ".partial" not in str(e.value)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConversionError, match=r"file/x\.gguf: .*file is not a folder"):
        _convert(model, tmp_path / "file" / "x.gguf", dry_run=dry_run)
    args = [str(model), "--outfile", str(tmp_path / "newdir") + os.sep, "--no-progress"]
    assert convert_main(args + (["--dry-run"] if dry_run else [])) == 1
    err = capsys.readouterr().err
    assert "newdir" in err and "no such folder" in err and "Traceback" not in err
    assert not (tmp_path / "newdir").exists()


def test_write_error_names_the_outfile_and_survives_a_failed_cleanup(model, tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full)
    out = tmp_path / "x.gguf"
    with pytest.raises(ConversionError, match=r"x\.gguf: cannot write the GGUF: No space left on device"):
        _convert(model, out)
    _no_partials(tmp_path)
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: full())
    with pytest.raises(ConversionError, match="No space left on device"):  # the first error, not the unlink's
        _convert(model, out)
    assert not out.exists()


@pytest.mark.parametrize("victim", ["config.json", "tokenizer.json", "model.safetensors", "hardlink", "symlink"])
def test_outfile_that_is_an_input_is_refused(model, tmp_path, victim):
    if victim == "hardlink":
        out = tmp_path / "h.gguf"
        os.link(model / "model.safetensors", out)
    elif victim == "symlink":
        out = tmp_path / "s.gguf"
        out.symlink_to(model / "tokenizer.json")
    else:
        out = model / victim
    before = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
    with pytest.raises(ConversionError, match="an input of the conversion; refusing to overwrite it"):
        _convert(model, out)
    assert {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()} == before


# --------------------------------------------------------------------------------------------------
# safetensors data


def _edit_safetensors_header(file: Path, fn) -> None:
    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    fn(header)
    new = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def test_tensor_span_that_disagrees_with_its_shape(model, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"

    def shorten(h):
        start, end = h[name]["data_offsets"]
        h[name]["data_offsets"] = [start, end - 2]

    _edit_safetensors_header(model / "model.safetensors", shorten)
    with pytest.raises(ConversionError, match=rf"model\.safetensors: tensor '{name}' needs \d+ bytes at offset \d+"):
        _convert(model, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_truncated_safetensors(model, tmp_path):
    file = model / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(ConversionError, match=rf"tensor '.+' needs \d+ bytes at offset \d+ .*the file has "
                                              rf"{file.stat().st_size}"):
        _convert(model, tmp_path / "x.gguf")
    _no_partials(tmp_path)


# --------------------------------------------------------------------------------------------------
# GGUFs pydflash would refuse


def test_missing_untied_lm_head(model, tmp_path):
    drop_tensor(model, "lm_head.weight")
    with pytest.raises(ConversionError, match=r"missing tensor 'lm_head\.weight'.*tie_word_embeddings = false"):
        _convert(model, tmp_path / "x.gguf")


def test_missing_projection_fails_the_test_load(model, tmp_path):
    pytest.importorskip("pydflash._core")
    drop_tensor(model, "model.layers.1.self_attn.q_proj.weight")
    assert convert_main([str(model), "--outfile", str(tmp_path / "x.gguf"), "--no-progress"]) == 1
    with pytest.raises(ConversionError, match=r"would not load: .*x\.gguf.*blk\.1\.attn_q\.weight"):
        _convert(model, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
    _no_partials(tmp_path)


def test_heads_inconsistent_with_tensors_fails_the_test_load(model, tmp_path):
    pytest.importorskip("pydflash._core")
    edit_config(model, lambda c: c.update(num_key_value_heads=4))  # the k/v projections hold 2 heads
    with pytest.raises(ConversionError, match=r"would not load: .*attn_k"):
        _convert(model, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


# --------------------------------------------------------------------------------------------------
# config.json types


@pytest.mark.parametrize("key, value", [
    ("intermediate_size", "big"), ("num_hidden_layers", None), ("num_hidden_layers", 2.5),
    ("num_attention_heads", True), ("num_key_value_heads", "two"), ("max_position_embeddings", 2**40),
    ("rope_theta", "1e6"), ("rms_norm_eps", -1e-6), ("vocab_size", 0)])
def test_config_value_of_the_wrong_type(model, tmp_path, capsys, key, value):
    edit_config(model, lambda c: c.update({key: value}))
    assert convert_main([str(model), "--outfile", str(tmp_path / "x.gguf"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"config.json: {key} = {value!r}, expected a positive" in err and "Traceback" not in err
    assert not (tmp_path / "x.gguf").exists()


# --------------------------------------------------------------------------------------------------
# other malformed files


def test_tokenizer_json_not_an_object(model, tmp_path):
    (model / "tokenizer.json").write_text("[1, 2]")
    with pytest.raises(ConversionError, match=r"tokenizer\.json: expected a JSON object, got list"):
        _convert(model, tmp_path / "x.gguf")


def test_index_with_a_non_string_shard(qwen3_checkpoint, tmp_path):
    model = copy_checkpoint(qwen3_checkpoint("mha2x2_hd128", max_shard_size="300KB"), tmp_path / "m")
    index = json.loads((model / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = 3
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match=rf"index\.json: weight_map\['{name}'\] = 3, expected the file name"):
        _convert(model, tmp_path / "x.gguf")


def test_generation_config_of_the_wrong_type(model, tmp_path):
    (model / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ConversionError, match=r"generation_config\.json: temperature = 'hot', expected a number"):
        _convert(model, tmp_path / "x.gguf")


def test_model_card_with_broken_front_matter(model, tmp_path):
    (model / "README.md").write_text("---\nlicense: [apache\ntags: x\n---\n# card\n")
    with pytest.raises(ConversionError, match=r"README\.md: the model card's YAML front matter cannot be read"):
        _convert(model, tmp_path / "x.gguf")


# --------------------------------------------------------------------------------------------------
# Qwen3.5: linear-attention shapes, MTP


@pytest.mark.parametrize("name, cut", [("model.layers.0.linear_attn.in_proj_qkv.weight", (slice(0, -1),)),
                                       ("model.layers.0.linear_attn.out_proj.weight", (slice(None), slice(0, -1))),
                                       ("model.layers.0.linear_attn.A_log", (slice(0, -1),))])
def test_linear_attention_tensor_of_the_wrong_shape(qwen35_checkpoint, tmp_path, name, cut):
    from safetensors.numpy import load_file, save_file

    model = copy_checkpoint(qwen35_checkpoint("k2v4_hd32"), tmp_path / "m")
    file = next(f for f in sorted(model.glob("model*.safetensors")) if name in load_file(f))
    state = load_file(file)
    state[name] = state[name][cut].copy()
    save_file(state, file, metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=rf"tensor '{name}' has shape .*expected"):
        _convert(model, tmp_path / "x.gguf")
    _no_partials(tmp_path)


def test_no_nextn_matches_llama_cpp(qwen35_checkpoint, llama_cpp_dir, tmp_path):
    model = qwen35_checkpoint("k1v3_tied_mtp")
    ref = llama_convert(llama_cpp_dir, model, tmp_path / "ref.gguf", "--outtype", "f16", "--no-nextn")
    assert convert_main([str(model), "--outfile", str(tmp_path / "ours.gguf"), "--outtype", "f16",
                         "--no-nextn", "--no-progress"]) == 0
    assert_same_gguf(tmp_path / "ours.gguf", ref, ulp_tolerant=("ssm_a",))
    assert convert_main([str(model), "--outfile", str(tmp_path / "alias.gguf"), "--outtype", "f16",
                         "--no-mtp", "--no-progress"]) == 0


def test_no_nextn_refused_where_there_is_no_mtp(qwen3_checkpoint, tmp_path, capsys):
    args = [str(qwen3_checkpoint("gqa4x2_hd64")), "--outfile", str(tmp_path / "x.gguf"), "--no-nextn"]
    assert convert_main(args) == 1
    assert "--no-nextn is not supported for Qwen3ForCausalLM" in capsys.readouterr().err


def test_incomplete_mtp_head(qwen35_checkpoint, tmp_path):
    model = copy_checkpoint(qwen35_checkpoint("k1v3_tied_mtp"), tmp_path / "m")
    drop_tensor(model, "mtp.fc.weight")
    with pytest.raises(ConversionError, match=r"missing tensor 'mtp\.fc\.weight'.*--no-nextn"):
        _convert(model, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
    assert _convert(model, tmp_path / "x.gguf", no_mtp=True).is_file()


# --------------------------------------------------------------------------------------------------
# DFlash drafts (not test-loadable alone: they load onto their target's GGUF)


@pytest.fixture
def draft(qwen3_checkpoint, tmp_path):
    import hf_models

    target = qwen3_checkpoint("gqa4x2_hd64", hidden=64, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=16,
                              vocab_size=800)
    return hf_models.make_dflash_checkpoint(tmp_path / "draft", target, mask_token_id=799), target


def test_draft_outfile_that_is_a_target_input_is_refused(draft):
    model, target = draft
    before = (target / "config.json").read_bytes()
    with pytest.raises(ConversionError, match="an input of the conversion"):
        _convert(model, target / "config.json", target_model_dir=target)
    assert (target / "config.json").read_bytes() == before


def test_draft_missing_projection(draft, tmp_path):
    model, target = draft
    drop_tensor(model, next(n for n in _tensor_names(model) if n.endswith("layers.0.self_attn.q_proj.weight")))
    with pytest.raises(ConversionError, match=r"missing tensor 'layers\.0\.self_attn\.q_proj\.weight'"):
        _convert(model, tmp_path / "x.gguf", target_model_dir=target)
    assert not (tmp_path / "x.gguf").exists()


def _tensor_names(model: Path) -> list[str]:
    from hf_models import hf_tensors

    return list(hf_tensors(model))
