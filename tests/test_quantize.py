"""pydflash-quantize: llama.cpp's per-tensor type choice, and the files it writes.

The type planner is pure Python and always tested. Writing files needs the compiled core
(`pydflash._core.quantize`, ggml's quantizers); the byte-for-byte comparison with `llama-quantize`
also needs the llama.cpp peer build (`python benchmarks/peer.py build`).
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest

from pydflash.convert import QUANT_TYPES, convert_hf_to_gguf, quantize_gguf
from pydflash.convert.quantize import TypePlanner, main as quantize_main, tensor_order
from pydflash.errors import ConversionError

T = gguf.GGMLQuantizationType
ROOT = Path(__file__).resolve().parents[1]

LAYER_TENSORS = ("attn_k.weight", "attn_k_norm.weight", "attn_norm.weight", "attn_output.weight", "attn_q.weight",
                 "attn_q_norm.weight", "attn_v.weight", "ffn_down.weight", "ffn_gate.weight", "ffn_norm.weight",
                 "ffn_up.weight")


def qwen3_names(n_layer: int, tied: bool) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"] + ([] if tied else ["output.weight"])
    names += [f"blk.{i}.{t}" for i in range(n_layer) for t in LAYER_TENSORS]
    return tensor_order(names)


def plan(qtype: str, n_layer: int, tied: bool, n_embd: int = 256, n_ff: int = 512) -> dict[str, T]:
    names = qwen3_names(n_layer, tied)
    planner = TypePlanner(QUANT_TYPES[qtype], names, n_layer=n_layer, n_expert=0)
    out = {}
    for name in names:
        n_dims = 1 if "norm" in name else 2
        ne0 = n_ff if "ffn_down" in name else n_embd
        out[name] = planner.target(name, (ne0,) if n_dims == 1 else (ne0, 64), T.F16 if n_dims == 2 else T.F32)
    return out


def test_tensor_order_is_llama_loader_order():
    names = ["blk.10.attn_q.weight", "blk.2.attn_v.weight", "output.weight", "blk.2.attn_k.weight", "token_embd.weight"]
    assert tensor_order(names) == ["output.weight", "token_embd.weight", "blk.2.attn_k.weight", "blk.2.attn_v.weight",
                                   "blk.10.attn_q.weight"]


def test_q4_k_m_mix():
    types = plan("q4_k_m", n_layer=8, tied=False)
    more_bits = {0, 3, 6, 7}  # i < n/8, i >= 7n/8, (i - n/8) % 3 == 2 for n = 8
    for i in range(8):
        want = T.Q6_K if i in more_bits else T.Q4_K
        assert types[f"blk.{i}.attn_v.weight"] == want, i
        assert types[f"blk.{i}.ffn_down.weight"] == want, i
        assert types[f"blk.{i}.attn_q.weight"] == T.Q4_K
        assert types[f"blk.{i}.ffn_up.weight"] == T.Q4_K
        assert types[f"blk.{i}.attn_norm.weight"] == T.F32  # unchanged
    assert types["output.weight"] == T.Q6_K
    assert types["token_embd.weight"] == T.Q4_K


def test_q4_k_m_tied_embedding_takes_output_type():
    assert plan("q4_k_m", n_layer=4, tied=True)["token_embd.weight"] == T.Q6_K
    # a row length that is no multiple of 256: Q8_0 for the output tensor, Q5_0 / F16 fallbacks elsewhere
    types = plan("q4_k_m", n_layer=4, tied=True, n_embd=96, n_ff=200)
    assert types["token_embd.weight"] == T.Q8_0
    assert types["blk.1.attn_q.weight"] == T.Q5_0
    assert types["blk.0.attn_v.weight"] == T.Q5_0   # q4_k -> q5_0
    assert types["blk.3.attn_v.weight"] == T.Q8_0   # q6_k (more bits for layers 2, 3 of 4) -> q8_0
    assert types["blk.0.ffn_down.weight"] == T.F16  # 200 is not a multiple of 32


@pytest.mark.parametrize("qtype, want", [("q4_0", T.Q4_0), ("q4_k", T.Q4_K), ("q5_k", T.Q5_K), ("q6_k", T.Q6_K),
                                         ("q8_0", T.Q8_0)])
def test_pure_types(qtype, want):
    types = plan(qtype, n_layer=4, tied=False)
    assert {t for n, t in types.items() if "norm" not in n} == {want}
    fallback = plan(qtype, n_layer=4, tied=False, n_embd=96)
    assert fallback["blk.0.attn_q.weight"] == {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}.get(want, want)


# --------------------------------------------------------------------------------------------------
# files (need the compiled core)


@pytest.fixture(scope="module")
def f16_gguf(qwen3_checkpoint, tmp_path_factory):
    model = qwen3_checkpoint("mha2x2_hd128")  # hidden 256: every K-quant applies without fallback
    return convert_hf_to_gguf(model, tmp_path_factory.mktemp("q") / "m-f16.gguf", outtype="f16", progress=False)


@pytest.fixture(scope="module")
def odd_gguf(qwen3_checkpoint, tmp_path_factory):
    """Tied head, hidden 64 and n_ff 200: the type fallbacks (q5_0, q5_1, q8_0, f16) all fire."""
    model = qwen3_checkpoint("gqa4x2_hd128_tied", intermediate=200)
    return convert_hf_to_gguf(model, tmp_path_factory.mktemp("q") / "odd-f32.gguf", outtype="f32", progress=False)


# max |error| / max |x| per type, loose bounds for random normal data
_TOLERANCE = {T.Q4_0: 0.2, T.Q4_K: 0.2, T.Q5_0: 0.1, T.Q5_K: 0.1, T.Q6_K: 0.05, T.Q8_0: 0.02, T.F16: 1e-3, T.F32: 0}


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_quantized_file(f16_gguf, tmp_path, qtype):
    pytest.importorskip("pydflash._core")
    out = quantize_gguf(f16_gguf, tmp_path / f"m-{qtype}.gguf", qtype, progress=False)
    src, dst = gguf.GGUFReader(f16_gguf), gguf.GGUFReader(out)

    src_kv = {k: f.contents() for k, f in src.fields.items() if not k.startswith("GGUF.")}
    dst_kv = {k: f.contents() for k, f in dst.fields.items() if not k.startswith("GGUF.")}
    assert list(dst_kv)[-2:] == ["general.quantization_version", "general.file_type"]
    assert dst_kv["general.file_type"] == QUANT_TYPES[qtype].ftype
    for k, v in src_kv.items():
        if k != "general.file_type":
            assert dst_kv[k] == v, k

    names = tensor_order([t.name for t in src.tensors])
    assert [t.name for t in dst.tensors] == names
    planner = TypePlanner(QUANT_TYPES[qtype], names, n_layer=src_kv["qwen3.block_count"], n_expert=0)
    src_t = {t.name: t for t in src.tensors}
    for t in dst.tensors:
        s = src_t[t.name]
        want = planner.target(t.name, tuple(int(n) for n in s.shape), T(s.tensor_type))
        assert T(t.tensor_type) == want, t.name
        assert list(t.shape) == list(s.shape)
        x = gguf.quants.dequantize(s.data, T(s.tensor_type)).reshape(-1)
        y = gguf.quants.dequantize(t.data, T(t.tensor_type)).reshape(-1)
        assert np.abs(y - x).max() <= _TOLERANCE[want] * np.abs(x).max() + 1e-6, (t.name, want.name)


def test_quantize_cli_errors(f16_gguf, tmp_path, capsys):
    with pytest.raises(SystemExit):
        quantize_main([str(f16_gguf), str(tmp_path / "x.gguf"), "q3_k"])
    with pytest.raises(ConversionError, match="overwrite the input"):
        quantize_gguf(f16_gguf, f16_gguf, "q8_0")


def _llama_quantize() -> Path | None:
    spec = importlib.util.spec_from_file_location("pydflash_peer", ROOT / "benchmarks" / "peer.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    return peer.binary("llama-quantize")


# pydflash type → (llama-quantize type, extra flags)
_LLAMA_QUANTIZE = {"q4_k_m": ("Q4_K_M", []), "q8_0": ("Q8_0", ["--pure"]), "q4_0": ("Q4_0", ["--pure"]),
                   "q4_k": ("Q4_K", ["--pure"]), "q5_k": ("Q5_K", ["--pure"]), "q6_k": ("Q6_K", ["--pure"])}


@pytest.mark.slow
@pytest.mark.parametrize("source", ["f16_gguf", "odd_gguf"])
@pytest.mark.parametrize("qtype", list(_LLAMA_QUANTIZE))
def test_matches_llama_quantize(request, tmp_path, qtype, source):
    pytest.importorskip("pydflash._core")
    exe = _llama_quantize()
    if exe is None:
        pytest.skip("llama.cpp peer not built (python benchmarks/peer.py build)")
    src = request.getfixturevalue(source)
    ours = quantize_gguf(src, tmp_path / "ours.gguf", qtype, progress=False)
    name, flags = _LLAMA_QUANTIZE[qtype]
    ref = tmp_path / "ref.gguf"
    res = subprocess.run([str(exe), *flags, str(src), str(ref), name, "1"], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    a, b = gguf.GGUFReader(ours), gguf.GGUFReader(ref)
    kv_a = {k: ([int(t) for t in f.types], f.contents()) for k, f in a.fields.items() if not k.startswith("GGUF.")}
    kv_b = {k: ([int(t) for t in f.types], f.contents()) for k, f in b.fields.items() if not k.startswith("GGUF.")}
    assert kv_a == kv_b and list(kv_a) == list(kv_b)
    assert [(t.name, list(t.shape), int(t.tensor_type)) for t in a.tensors] == \
           [(t.name, list(t.shape), int(t.tensor_type)) for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert np.array_equal(ta.data.view(np.uint8), tb.data.view(np.uint8)), ta.name


# --------------------------------------------------------------------------------------------------
# MoE tensors (llama.cpp src/llama-quant.cpp: tensor_allows_quantization, llama_tensor_get_type_impl)


def _moe_plan(qtype: str, n_layer: int, n_embd: int = 256, n_ff: int = 256, n_expert: int = 8) -> dict[str, T]:
    ne = {"ffn_gate_inp.weight": (n_embd, n_expert), "ffn_gate_inp_shexp.weight": (n_embd, 1),
          "ffn_gate_exps.weight": (n_embd, n_ff, n_expert), "ffn_up_exps.weight": (n_embd, n_ff, n_expert),
          "ffn_gate_up_exps.weight": (n_embd, 2 * n_ff, n_expert), "ffn_down_exps.weight": (n_ff, n_embd, n_expert),
          "ffn_gate_shexp.weight": (n_embd, n_ff), "ffn_up_shexp.weight": (n_embd, n_ff),
          "ffn_down_shexp.weight": (n_ff, n_embd)}
    names = tensor_order(["token_embd.weight", "output.weight"] + [f"blk.{i}.{t}" for i in range(n_layer) for t in ne])
    planner = TypePlanner(QUANT_TYPES[qtype], names, n_layer=n_layer, n_expert=n_expert)
    return {n: planner.target(n, ne[n.split(".", 2)[2]] if n.startswith("blk.") else (n_embd, 64), T.F16)
            for n in names}


def test_moe_tensors_pure():
    """Experts (3-D, the merged gate/up too) and the shared expert quantize like any matrix; the router stays (by
    name), and so does the shared expert's gate: [n_embd, 1] is 1-D to ggml_n_dims, so llama-quantize keeps it."""
    types = _moe_plan("q4_0", n_layer=2)
    for i in range(2):
        assert types[f"blk.{i}.ffn_gate_inp.weight"] == T.F16
        assert types[f"blk.{i}.ffn_gate_inp_shexp.weight"] == T.F16
        for t in ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps", "ffn_down_exps", "ffn_gate_shexp",
                  "ffn_up_shexp", "ffn_down_shexp"):
            assert types[f"blk.{i}.{t}.weight"] == T.Q4_0, t


def test_moe_q4_k_m_ffn_down_by_layer_name():
    """With experts, q4_k_m gives ffn_down (routed and shared) q6_k in the "use more bits" layers, the layer read from
    the tensor's name (llama.cpp's layer_info)."""
    types = _moe_plan("q4_k_m", n_layer=8)
    more_bits = {0, 3, 6, 7}
    for i in range(8):
        want = T.Q6_K if i in more_bits else T.Q4_K
        assert types[f"blk.{i}.ffn_down_exps.weight"] == want, i
        assert types[f"blk.{i}.ffn_down_shexp.weight"] == want, i
        assert types[f"blk.{i}.ffn_gate_up_exps.weight"] == T.Q4_K


@pytest.mark.parametrize("fuse", [False, True], ids=["split", "merged-gate-up"])
def test_quantized_qwen35moe_file(tmp_path, fuse):
    pytest.importorskip("pydflash._core")
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_models import make_qwen35moe_shape

    model = make_qwen35moe_shape(tmp_path / "hf", "x8k4")  # every row a multiple of 32: no fallbacks
    src_path = convert_hf_to_gguf(model, tmp_path / "m-f16.gguf", outtype="f16", fuse_gate_up_exps=fuse,
                                  progress=False)
    out = quantize_gguf(src_path, tmp_path / "m-q8_0.gguf", "q8_0", progress=False)
    src = {t.name: t for t in gguf.GGUFReader(src_path).tensors}
    dst = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert sorted(dst) == sorted(src)
    kept = [n for n in dst if n.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))]
    experts = [n for n in dst if n.endswith(("_exps.weight", "_shexp.weight")) and "ffn_gate_inp" not in n]
    assert len(kept) == 2 * 5 and len(experts) == 5 * (5 if fuse else 6)
    for n in kept:
        assert T(dst[n].tensor_type) == T.F32 and np.array_equal(dst[n].data, src[n].data), n
    for n in experts:
        assert T(dst[n].tensor_type) == T.Q8_0 and list(dst[n].shape) == list(src[n].shape), n
        x = gguf.quants.dequantize(src[n].data, T(src[n].tensor_type)).reshape(-1)
        y = gguf.quants.dequantize(dst[n].data, T.Q8_0).reshape(-1)
        assert np.abs(y - x).max() <= _TOLERANCE[T.Q8_0] * np.abs(x).max(), n


@pytest.mark.parametrize("qtype", ["q4_0", "q4_k"])
def test_quantized_drafters_stay_lossless_and_keep_their_acceptance(tmp_path, qtype):
    """pydflash-quantize on a DFlash drafter (the trained qwen35 pair's f32 one): every matrix quantized (rows of
    192 are not a multiple of q4_k's 256, so those fall back to q5_0 as llama-quantize does), the drafter loads
    next to its f32 target, speculation still equals plain decoding, and chain tau keeps at least 85% of the f32
    drafter's (benchmarks/bench_quant_tau.py measures 97-100% for q4_0)."""
    pytest.importorskip("pydflash._core")
    import pydflash
    from export_pairs import pair_file, prompt_rows

    target, f32_draft = pair_file("qwen35", "target", "f32"), pair_file("qwen35", "dflash", "f32")
    draft = quantize_gguf(f32_draft, tmp_path / f"dflash-{qtype}.gguf", qtype, progress=False)
    types = {T(t.tensor_type) for t in gguf.GGUFReader(draft).tensors if len(t.shape) > 1 and t.shape[1] > 1}
    assert types <= {T.Q4_0, T.Q4_K, T.Q5_0} and (T.Q4_0 if qtype == "q4_0" else T.Q5_0) in types, types
    texts = [r["text"] for r in prompt_rows("code")[:4]]
    taus = {}
    with pydflash.Model(target, n_ctx=1024) as plain:
        greedy = [plain.generate(t, max_tokens=64).tokens for t in texts]
    for name, path in (("f32", f32_draft), (qtype, draft)):
        accepted = rounds = 0
        with pydflash.Model(target, draft_model_path=path, n_ctx=1024, spec_mode="chain") as m:
            for text, expected in zip(texts, greedy):
                c = m.generate(text, max_tokens=64)
                assert c.tokens == expected
                accepted, rounds = accepted + c.timings["draft_n_accepted"], rounds + c.timings["n_rounds"]
        taus[name] = (accepted + rounds) / rounds
    assert taus[qtype] >= 0.85 * taus["f32"], taus
