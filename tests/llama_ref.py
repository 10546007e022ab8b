"""Run the pinned llama.cpp tree's own `convert_hf_to_gguf.py` (the reference converter) and read GGUFs
for comparison. Shared by tests/test_convert_qwen35.py and tests/test_convert_dflash.py.

The converter runs in a subprocess with its own gguf-py on PYTHONPATH. Two things are patched, nothing
else:

- `TextModel.get_vocab_base_pre` recognises a BPE pre-tokenizer by hashing the token ids of a probe
  string against a table of known tokenizers; the tiny test tokenizers are new, so the hash is unknown.
  The patch answers from the Split regex in the model's tokenizer.json instead, and only for the two Qwen
  regexes whose llama.cpp names are fixed (`qwen2`, `qwen35`; src/llama-vocab.cpp); any other regex
  fails as the hash lookup would.
- Without the `sentencepiece` package, `Qwen2Model.set_vocab`'s SentencePiece attempt fails at the import
  instead of with the FileNotFoundError (no tokenizer.model) that sends it to the BPE path; the patch
  raises that FileNotFoundError.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

_WRAPPER = r'''
import importlib.util, json, runpy, sys
llama_dir = sys.argv[1]
from conversion import base
QWEN_REGEXES = {
    "qwen2": %(qwen2)r,
    "qwen35": %(qwen35)r,
}
def get_vocab_base_pre(self, tokenizer):
    tj = json.loads((self.dir_model / "tokenizer.json").read_text(encoding="utf-8"))
    pre = tj.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    regexes = [(s.get("pattern") or {}).get("Regex") for s in steps if s.get("type") == "Split"]
    for name, regex in QWEN_REGEXES.items():
        if regexes == [regex]:
            return name
    raise NotImplementedError("BPE pre-tokenizer was not recognized (test wrapper)")
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
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

QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def llama_convert(llama_cpp_dir: Path, model_dir: Path, outfile: Path, *args: str, expect_ok: bool = True):
    """Run llama.cpp's converter; returns `outfile` (or the CompletedProcess when `expect_ok` is False)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    script = outfile.parent / "run_llama_convert.py"
    script.write_text(_WRAPPER % {"qwen2": QWEN2_REGEX, "qwen35": QWEN35_REGEX}, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    env["PYTHONPATH"] = os.pathsep.join([str(llama_cpp_dir), str(llama_cpp_dir / "gguf-py")])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    res = subprocess.run([sys.executable, str(script), str(llama_cpp_dir), str(model_dir), "--outfile", str(outfile),
                          *args], env=env, capture_output=True, text=True, timeout=600)
    if not expect_ok:
        return res
    assert res.returncode == 0, f"llama.cpp converter failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    return outfile


def llama_convert_qwen35(llama_cpp_dir: Path, model_dir: Path, outfile: Path, *args: str) -> Path:
    """`llama_convert` for a Qwen3.5 / Qwen3.5-MoE checkpoint: with `--no-mtp` when it holds no MTP weights (without
    it, that converter asserts on `mtp_num_hidden_layers`; see tests/test_convert_qwen35.py)."""
    has_mtp = (model_dir / "model-mtp.safetensors").is_file()
    return llama_convert(llama_cpp_dir, model_dir, outfile, *args, *([] if has_mtp else ["--no-mtp"]))


def read_gguf(path: Path):
    """(kv, tensors): kv = {key: ([value type names], value)} in file order; tensors = [(name, ggml shape,
    type name, data)] in file order."""
    r = gguf.GGUFReader(path)
    kv = {k: ([gguf.GGUFValueType(t).name for t in f.types], f.contents())
          for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = [(t.name, [int(n) for n in t.shape], gguf.GGMLQuantizationType(t.tensor_type).name, t.data)
               for t in r.tensors]
    return kv, tensors


def assert_same_gguf(ours: Path, ref: Path, *, ulp_tolerant: tuple[str, ...] = (), ignore_keys: tuple[str, ...] = (),
                     only_ours: tuple[str, ...] = ()):
    """Same keys (name, type, value, order) and tensors (name, shape, type, bytes). Tensors whose name
    ends with one of `ulp_tolerant` (F32 only) may differ by one unit in the last place; keys in
    `ignore_keys` may differ in value (not in presence, type or position); keys starting with one of
    `only_ours` are ours alone (at least one of them present, none in llama.cpp's)."""
    kv_a, t_a = read_gguf(ours)
    kv_b, t_b = read_gguf(ref)
    if only_ours:
        extra = [k for k in kv_a if k.startswith(only_ours)]
        assert extra and not any(k.startswith(only_ours) for k in kv_b), (extra, list(kv_b))
        kv_a = {k: v for k, v in kv_a.items() if k not in extra}
    diff = {k: (kv_a.get(k), kv_b.get(k)) for k in kv_a.keys() | kv_b.keys()
            if kv_a.get(k) != kv_b.get(k) and not (k in ignore_keys and k in kv_a and k in kv_b
                                                     and kv_a[k][0] == kv_b[k][0])}
    assert not diff, f"metadata differs (ours, llama.cpp): {str(diff)[:3000]}"
    assert list(kv_a) == list(kv_b), f"same keys, different order:\n{list(kv_a)}\n{list(kv_b)}"
    assert [t[:3] for t in t_a] == [t[:3] for t in t_b], \
        f"tensor lists differ:\n{[t[:3] for t in t_a]}\n{[t[:3] for t in t_b]}"
    for (name, _, dtype, a), (_, _, _, b) in zip(t_a, t_b):
        if name.endswith(ulp_tolerant) and dtype == "F32":
            a32, b32 = np.asarray(a, np.float32).ravel(), np.asarray(b, np.float32).ravel()
            ulps = np.abs(a32.view(np.int32).astype(np.int64) - b32.view(np.int32).astype(np.int64))
            assert ulps.max(initial=0) <= 1, f"tensor {name} differs by {ulps.max()} ulp"
        else:
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"tensor {name} data differs"
