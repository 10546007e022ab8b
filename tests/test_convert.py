"""pydflash-convert against llama.cpp's own converter, plus its error paths.

The reference is the pinned llama.cpp tree's `convert_hf_to_gguf.py`, run in a subprocess with its
own gguf-py. Both converters get the same tiny random checkpoint (tests/hf_models.py); the files must
agree key for key (name, type, value, order) and tensor for tensor (name, ggml shape, type, bytes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from pydflash.convert import convert_hf_to_gguf, detect_pre_tokenizer, load_gpt2_vocab
from pydflash.convert.cli import main as convert_main
from pydflash.convert.vocab import PRE_TOKENIZER_REGEXES
from pydflash.errors import ConversionError

# llama.cpp's converter refuses tokenizers whose pre-tokenizer hash it does not know
# (`get_vocab_base_pre`: it hashes the token ids of a probe string, and our test tokenizer is new).
# The wrapper replaces only that lookup with the answer for Qwen's Split regex ("qwen2"), which is
# what the test tokenizer uses. It also stands in for a missing `sentencepiece`: Qwen2Model.set_vocab
# tries SentencePiece first and falls back to BPE on FileNotFoundError when there is no
# tokenizer.model; without the package the import fails before that check, so the wrapper raises
# the same FileNotFoundError. Everything else is the unmodified script.
_LLAMA_WRAPPER = r'''
import importlib.util, runpy, sys
llama_dir = sys.argv[1]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
if importlib.util.find_spec("sentencepiece") is None:
    _create = base.TextModel._create_vocab_sentencepiece
    def _create_vocab_sentencepiece(self):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
        return _create(self)
    base.TextModel._create_vocab_sentencepiece = _create_vocab_sentencepiece
sys.argv = [llama_dir + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''

MODEL_CARD = """---
license: apache-2.0
language:
- en
tags:
- text-generation
---
# Tiny Qwen3 test model
"""


def llama_convert(llama_cpp_dir: Path, model_dir: Path, outfile: Path, *args: str) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    script = outfile.parent / "run_llama_convert.py"
    script.write_text(_LLAMA_WRAPPER, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    env["PYTHONPATH"] = os.pathsep.join([str(llama_cpp_dir), str(llama_cpp_dir / "gguf-py")])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    res = subprocess.run([sys.executable, str(script), str(llama_cpp_dir), str(model_dir), "--outfile", str(outfile),
                          *args], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"llama.cpp converter failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    return outfile


def read_gguf(path: Path):
    r = gguf.GGUFReader(path)
    kv = {k: ([gguf.GGUFValueType(t).name for t in f.types], f.contents())
          for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = [(t.name, [int(n) for n in t.shape], gguf.GGMLQuantizationType(t.tensor_type).name, t.data)
               for t in r.tensors]
    return kv, tensors


def assert_same_gguf(ours: Path, ref: Path) -> None:
    kv_a, t_a = read_gguf(ours)
    kv_b, t_b = read_gguf(ref)
    diff = {k: (kv_a.get(k), kv_b.get(k)) for k in kv_a.keys() | kv_b.keys() if kv_a.get(k) != kv_b.get(k)}
    assert not diff, f"metadata differs (ours, llama.cpp): {str(diff)[:3000]}"
    assert list(kv_a) == list(kv_b), "same keys, different order"
    assert [t[:3] for t in t_a] == [t[:3] for t in t_b]
    for (name, _, _, a), (_, _, _, b) in zip(t_a, t_b):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"tensor {name} data differs"


# (shape, checkpoint overrides, --outtype): GQA 4:2 / 4:1 / 2:2, head_dim 64 / 128, tied / untied,
# f32 / bf16 / f16 checkpoints, sharded, padded vocabulary, every --outtype, a Q8_0 row fallback.
CASES = [
    pytest.param("gqa4x2_hd64", dict(vocab_size=800), "f16", id="gqa4x2-hd64-f32src-f16-padded-vocab"),
    pytest.param("gqa4x2_hd64", dict(vocab_size=800), "bf16", id="gqa4x2-hd64-f32src-bf16"),
    pytest.param("gqa4x1_hd64_tied", dict(dtype="bfloat16", model_card=MODEL_CARD,
                                          generation=dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.8,
                                                          repetition_penalty=1.05)),
                 "auto", id="gqa4x1-tied-bf16src-auto-card"),
    pytest.param("mha2x2_hd128", dict(max_shard_size="300KB"), "f32", id="mha2x2-hd128-sharded-f32"),
    pytest.param("gqa4x2_hd128_tied", dict(dtype="float16", intermediate=200), "q8_0", id="gqa4x2-hd128-tied-f16src-q8_0"),
]


@pytest.mark.parametrize("shape, overrides, outtype", CASES)
def test_matches_llama_cpp_converter(qwen3_checkpoint, llama_cpp_dir, tmp_path, shape, overrides, outtype):
    model = qwen3_checkpoint(shape, **overrides)
    if overrides.get("max_shard_size"):
        assert (model / "model.safetensors.index.json").is_file()
    ref = llama_convert(llama_cpp_dir, model, tmp_path / "ref.gguf", "--outtype", outtype)
    ours = convert_hf_to_gguf(model, tmp_path / "ours.gguf", outtype=outtype, progress=False)
    assert_same_gguf(ours, ref)


def test_legacy_config_matches_llama_cpp(qwen3_checkpoint, llama_cpp_dir, tmp_path):
    """A transformers-4 style config.json (top-level rope_theta, YaRN rope_scaling, torch_dtype), as
    Qwen3 checkpoints on the Hub ship it; llama.cpp reads it through AutoConfig, we read it raw."""
    model = _copy(qwen3_checkpoint("gqa4x2_hd64"), tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    del cfg["rope_parameters"], cfg["dtype"]
    cfg.update(rope_theta=500000.0, torch_dtype="float32", max_position_embeddings=16384,
               rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096})
    (model / "config.json").write_text(json.dumps(cfg, indent=2))
    tj = json.loads((model / "tokenizer.json").read_text(encoding="utf-8"))
    tj["model"]["merges"] = [" ".join(pair) for pair in tj["model"]["merges"]]  # pre-4.45 "a b" strings
    (model / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    ref = llama_convert(llama_cpp_dir, model, tmp_path / "ref.gguf", "--outtype", "f16")
    ours = convert_hf_to_gguf(model, tmp_path / "ours.gguf", outtype="f16", progress=False)
    assert_same_gguf(ours, ref)
    kv, _ = read_gguf(ours)
    assert kv["qwen3.rope.scaling.type"][1] == "yarn"
    assert kv["qwen3.rope.freq_base"][1] == 500000.0


def test_vocab_only_matches_llama_cpp(qwen3_checkpoint, llama_cpp_dir, tmp_path):
    """--vocab-only, with the chat template in chat_template.jinja (transformers-5 layout)."""
    model = _copy(qwen3_checkpoint("gqa4x2_hd64"), tmp_path / "m")
    tc = json.loads((model / "tokenizer_config.json").read_text())
    (model / "chat_template.jinja").write_text(tc.pop("chat_template") + "{# from chat_template.jinja #}")
    (model / "tokenizer_config.json").write_text(json.dumps(tc))
    ref = llama_convert(llama_cpp_dir, model, tmp_path / "ref.gguf", "--outtype", "f16", "--vocab-only")
    ours = convert_hf_to_gguf(model, tmp_path / "ours.gguf", outtype="f16", vocab_only=True, progress=False)
    assert_same_gguf(ours, ref)
    assert read_gguf(ours)[0]["tokenizer.chat_template"][1].endswith("{# from chat_template.jinja #}")


def test_qwen3_contract(qwen3_checkpoint, tmp_path):
    """gguf-formats.md §2 and §5 without llama.cpp: keys, ggml shapes, dtypes, tied head."""
    model = qwen3_checkpoint("gqa4x1_hd64_tied")
    cfg = json.loads((model / "config.json").read_text())
    kv, tensors = read_gguf(convert_hf_to_gguf(model, tmp_path / "m.gguf", outtype="f16", progress=False))
    assert kv["general.architecture"][1] == "qwen3"
    assert kv["qwen3.attention.key_length"] == (["UINT32"], 64)
    assert kv["qwen3.attention.head_count_kv"] == (["UINT32"], 1)
    assert kv["qwen3.attention.layer_norm_rms_epsilon"][0] == ["FLOAT32"]
    assert kv["tokenizer.ggml.pre"][1] == "qwen2"
    assert kv["tokenizer.ggml.add_bos_token"] == (["BOOL"], False)
    assert kv["tokenizer.ggml.eos_token_id"][1] == cfg["eos_token_id"]
    types = kv["tokenizer.ggml.token_type"][1]
    tokens = kv["tokenizer.ggml.tokens"][1]
    assert types[tokens.index("<|im_end|>")] == gguf.TokenType.CONTROL
    assert types[tokens.index("<think>")] == gguf.TokenType.USER_DEFINED
    by_name = {name: (shape, dtype) for name, shape, dtype, _ in tensors}
    assert "output.weight" not in by_name  # tied
    n_embd, n_vocab = cfg["hidden_size"], cfg["vocab_size"]
    assert by_name["token_embd.weight"] == ([n_embd, n_vocab], "F16")
    assert by_name["blk.0.attn_q.weight"] == ([n_embd, 64 * 4], "F16")
    assert by_name["blk.0.attn_k.weight"] == ([n_embd, 64 * 1], "F16")
    assert by_name["blk.0.attn_output.weight"] == ([64 * 4, n_embd], "F16")
    assert by_name["blk.0.attn_q_norm.weight"] == ([64], "F32")
    assert by_name["blk.2.ffn_down.weight"] == ([cfg["intermediate_size"], n_embd], "F16")
    assert by_name["output_norm.weight"] == ([n_embd], "F32")


def test_conversion_needs_no_torch(qwen3_checkpoint, tmp_path):
    model = qwen3_checkpoint("gqa4x2_hd64")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import conftest\n"
        "from pydflash.convert import convert_hf_to_gguf\n"
        "convert_hf_to_gguf(sys.argv[2], sys.argv[3], outtype='q8_0', progress=False)\n"
        "bad = [m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    res = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(model), str(tmp_path / "m.gguf")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


def test_cli_lists_the_supported_models_without_a_model(capsys):
    assert convert_main(["--print-supported-models"]) == 0
    assert "Qwen3ForCausalLM" in capsys.readouterr().out.split()
    with pytest.raises(SystemExit) as e:
        convert_main([])
    assert e.value.code == 2 and "required: model" in capsys.readouterr().err


def test_cli(qwen3_checkpoint, tmp_path, capsys):
    model = qwen3_checkpoint("gqa4x2_hd64")
    out = tmp_path / "cli-{ftype}.gguf"
    assert convert_main([str(model), "--outfile", str(out), "--outtype", "f16", "--no-progress"]) == 0
    assert (tmp_path / "cli-f16.gguf").is_file()  # {ftype} filled like llama.cpp
    assert convert_main([str(model), "--outfile", str(tmp_path / "dry.gguf"), "--dry-run"]) == 0
    assert not (tmp_path / "dry.gguf").exists()
    assert convert_main([str(tmp_path / "nowhere"), "--outfile", str(tmp_path / "x.gguf")]) == 1
    assert "not a directory" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


# --------------------------------------------------------------------------------------------------
# errors


def test_missing_config(tmp_path):
    with pytest.raises(ConversionError, match="missing config.json"):
        convert_hf_to_gguf(tmp_path, tmp_path / "x.gguf")


def test_not_a_directory(tmp_path):
    with pytest.raises(ConversionError, match="not a directory"):
        convert_hf_to_gguf(tmp_path / "absent", tmp_path / "x.gguf")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}))
    with pytest.raises(ConversionError, match=r"unsupported architecture 'LlamaForCausalLM'.*Qwen3ForCausalLM"):
        convert_hf_to_gguf(tmp_path, tmp_path / "x.gguf")


def test_config_without_architectures(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(ConversionError, match="no 'architectures' list"):
        convert_hf_to_gguf(tmp_path, tmp_path / "x.gguf")


def _copy(model: Path, dst: Path) -> Path:
    return Path(shutil.copytree(model, dst))


def test_unknown_pre_tokenizer_regex(qwen3_checkpoint, tmp_path):
    import hf_models

    model = _copy(qwen3_checkpoint("gqa4x2_hd64"), tmp_path / "m")
    gpt2_regex = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    hf_models.write_qwen_tokenizer(model, split_regex=gpt2_regex)
    with pytest.raises(ConversionError, match="unknown pre-tokenizer regex") as e:
        convert_hf_to_gguf(model, tmp_path / "x.gguf", progress=False)
    assert "tokenizer.json" in str(e.value) and "qwen35" in str(e.value)
    assert not (tmp_path / "x.gguf").exists()


def test_unsupported_pre_tokenizer_shape(qwen3_checkpoint, tmp_path):
    model = _copy(qwen3_checkpoint("gqa4x2_hd64"), tmp_path / "m")
    tj = json.loads((model / "tokenizer.json").read_text(encoding="utf-8"))
    tj["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    (model / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    with pytest.raises(ConversionError, match=r"unsupported pre_tokenizer \(ByteLevel\)"):
        load_gpt2_vocab(model)


def test_detect_pre_tokenizer_qwen35():
    def tokenizer(regex):
        return {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}}

    assert detect_pre_tokenizer(tokenizer(PRE_TOKENIZER_REGEXES["qwen35"])) == "qwen35"
    assert detect_pre_tokenizer(tokenizer(PRE_TOKENIZER_REGEXES["qwen2"])) == "qwen2"
    with pytest.raises(ConversionError, match="unknown pre-tokenizer regex"):
        detect_pre_tokenizer(tokenizer(PRE_TOKENIZER_REGEXES["qwen2"] + "|x"))


def test_shard_index_mismatch(qwen3_checkpoint, tmp_path):
    model = _copy(qwen3_checkpoint("mha2x2_hd128", max_shard_size="300KB"), tmp_path / "m")
    index = json.loads((model / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"].values()))
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = first
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match="weight_map and shards disagree"):
        convert_hf_to_gguf(model, tmp_path / "x.gguf", progress=False)


def test_unmappable_tensor(qwen3_checkpoint, tmp_path):
    model = _copy(qwen3_checkpoint("gqa4x2_hd64"), tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    cfg["num_hidden_layers"] = 1  # the checkpoint has two
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=r"cannot map tensor 'model\.layers\.1\."):
        convert_hf_to_gguf(model, tmp_path / "x.gguf", progress=False)


def test_missing_tokenizer(qwen3_checkpoint, tmp_path):
    model = _copy(qwen3_checkpoint("gqa4x2_hd64"), tmp_path / "m")
    (model / "tokenizer.json").unlink()
    with pytest.raises(ConversionError, match="missing tokenizer.json"):
        convert_hf_to_gguf(model, tmp_path / "x.gguf", progress=False)
