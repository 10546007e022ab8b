"""The Qwen3.5 MoE target (arch `qwen35moe`): HF `Qwen3_5MoeForCausalLM` / `…ForConditionalGeneration` -> our
converter -> GGUF -> our engine, against transformers (4, 5, 7 and 8 experts, top-1 to top-4, a gated shared expert,
experts stored per expert or fused, routers with clear margins); llama.cpp's converter output (split and merged
gate/up experts) in our engine; per-layer expert counts; quantized; typed errors for bad files; speculative decoding
over it (equal to plain). Tree verification and commit on it are in test_tree.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gguf_edit import rewrite  # noqa: E402
from hf_models import QWEN35MOE_SHAPES, make_qwen35moe_shape  # noqa: E402
from llama_ref import llama_convert  # noqa: E402
from test_qwen3 import assert_greedy_matches_transformers, kl_divergence, ref_logits  # noqa: E402
from test_qwen3moe import (assert_sampling_equals_plain, assert_speculative_equals_plain,  # noqa: E402
                           converted_checkpoint, random_pair)

import gguf  # noqa: E402
import pydflash  # noqa: E402
from pydflash import _core  # noqa: E402
from pydflash.convert import convert_hf_to_gguf  # noqa: E402
from pydflash.convert.quantize import quantize_gguf  # noqa: E402
from pydflash.errors import GGUFFormatError  # noqa: E402

PROMPT = [3, 17, 200, 45, 9, 311, 77, 5, 128, 64, 400, 12]
LLAMA_CPP = Path(__file__).resolve().parents[1] / "vendor" / "ggml" / "llama.cpp-0c1e57098bba"


def logits_of(path, tokens=PROMPT):
    session = _core.Session(_core.Model(str(path)), n_ctx=128, type_k="f32", type_v="f32")
    return session.eval(np.array(tokens, dtype=np.int32), all_logits=True)[0]


def relative_error(ours, theirs):
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.fixture(scope="module", params=sorted(QWEN35MOE_SHAPES))
def checkpoint(request, tmp_path_factory):
    """(HF folder, f32 GGUF path, transformers model) for one tiny random Qwen3.5 MoE shape."""
    return converted_checkpoint(tmp_path_factory.mktemp(request.param), make_qwen35moe_shape, request.param)


def test_logits_match_transformers(checkpoint):
    _, gguf_path, ref = checkpoint
    assert _core.Model(str(gguf_path)).arch == "qwen35moe"
    rel = relative_error(logits_of(gguf_path), ref_logits(ref, PROMPT))
    print(f"max relative error vs transformers: {rel:.2e}")
    assert rel <= 1e-4


def test_greedy_continuation_matches_transformers(checkpoint):
    _, gguf_path, ref = checkpoint
    assert_greedy_matches_transformers(gguf_path, ref, PROMPT)


@pytest.mark.parametrize("fuse", [False, True], ids=["split-gate-up", "merged-gate-up"])
def test_llama_cpp_converter_output_runs_in_ours(checkpoint, tmp_path, fuse):
    """llama.cpp's converter (with and without --fuse-gate-up-exps: one ffn_gate_up_exps tensor) gives a file whose
    logits in our engine are transformers'."""
    hf_dir, _, ref = checkpoint
    args = ["--outtype", "f32"] + (["--fuse-gate-up-exps"] if fuse else [])
    if not (hf_dir / "model-mtp.safetensors").is_file():
        args.append("--no-nextn")  # llama.cpp's converter asserts an MTP block unless told there is none
    theirs = llama_convert(LLAMA_CPP, hf_dir, tmp_path / "llama.gguf", *args)
    names = {t.name for t in gguf.GGUFReader(theirs).tensors}
    assert ("blk.0.ffn_gate_up_exps.weight" in names) == fuse
    assert relative_error(logits_of(theirs), ref_logits(ref, PROMPT)) <= 1e-4


# --------------------------------------------------------------------------------------------------
# per-layer expert counts


@pytest.fixture(scope="module")
def x8k4(tmp_path_factory):
    """(f32 GGUF, HF folder) of the 5-layer, 8-expert, top-4 shape."""
    d = make_qwen35moe_shape(tmp_path_factory.mktemp("x8k4") / "hf", "x8k4", seed=3)
    return convert_hf_to_gguf(d, d.parent / "m.gguf", outtype="f32", progress=False), d


U32 = gguf.GGUFValueType.UINT32
ARRAY = gguf.GGUFValueType.ARRAY


def test_per_layer_expert_used_count_routes_each_layer_its_own_top_k(x8k4, tmp_path):
    """`expert_used_count` as one value per layer (llama.cpp's key-or-array form): each layer takes its own top-k,
    as transformers does with each layer's router set to that k."""
    path, hf_dir = x8k4
    per_layer = [4, 1, 8, 2, 3]
    edited = rewrite(path, tmp_path / "per-layer.gguf",
                     set_keys={"qwen35moe.expert_used_count": (per_layer, ARRAY, U32)})
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for layer, k in zip(ref.model.layers, per_layer):
        layer.mlp.gate.top_k = k
    theirs = ref_logits(ref, PROMPT)
    assert relative_error(logits_of(edited), theirs) <= 1e-4
    assert relative_error(logits_of(path), theirs) > 1e-2  # the layers' k do change the output


@pytest.mark.parametrize("edit, match", [
    (dict(set_keys={"qwen35moe.expert_used_count": (0, U32)}),
     r"key 'qwen35moe\.expert_used_count' = 0, expected a value in \[1, 8\]"),
    (dict(set_keys={"qwen35moe.expert_used_count": (9, U32)}),
     r"key 'qwen35moe\.expert_used_count' = 9, expected a value in \[1, 8\]"),
    (dict(set_keys={"qwen35moe.expert_used_count": ([4, 4, 9, 4, 4], ARRAY, U32)}),
     r"key 'qwen35moe\.expert_used_count'\[2\] \(layer 2\) = 9, expected a value in \[1, 8\]"),
    (dict(set_keys={"qwen35moe.expert_used_count": ([4, 4, 4], ARRAY, U32)}),
     r"key 'qwen35moe\.expert_used_count' is an array of 3 u32, expected one integer or an array of 5"),
    (dict(set_keys={"qwen35moe.expert_feed_forward_length": ([32, 32, 32, 16, 32], ARRAY, U32)}),
     r"tensor 'blk\.3\.ffn_gate_exps\.weight' has shape \{64, 32, 8\}, expected \{64, 16, 8\}"),
    (dict(drop_tensors=("blk.2.ffn_gate_inp.weight",)), r"blk\.2\.ffn_gate_inp\.weight"),
    (dict(drop_tensors=("blk.1.ffn_gate_inp_shexp.weight",)), r"blk\.1\.ffn_gate_inp_shexp\.weight"),
    (dict(drop_tensors=("blk.0.ffn_up_exps.weight",)), r"blk\.0\.ffn_up_exps\.weight"),
    (dict(reshape={"blk.4.ffn_down_exps.weight": (7, 64, 32)}),
     r"tensor 'blk\.4\.ffn_down_exps\.weight' has shape \{32, 64, 7\}, expected \{32, 64, 8\}"),
    (dict(reshape={"blk.0.ffn_up_shexp.weight": (16, 64)}),
     r"tensor 'blk\.0\.ffn_up_shexp\.weight' has shape \{64, 16\}, expected \{64, 32\}"),
    (dict(set_keys={"qwen35moe.expert_shared_feed_forward_length": (48, U32)}),
     r"tensor 'blk\.0\.ffn_gate_shexp\.weight' has shape \{64, 32\}, expected \{64, 48\}"),
], ids=["used-0", "used-above-count", "used-array-entry", "used-array-length", "width-array-disagrees",
        "no-router", "no-shared-gate", "no-up-experts", "fewer-down-experts", "narrower-shared-expert",
        "shared-width-disagrees"])
def test_bad_file_names_the_key_or_tensor(x8k4, tmp_path, edit, match):
    bad = rewrite(x8k4[0], tmp_path / "bad.gguf", **edit)
    with pytest.raises(GGUFFormatError, match=match):
        _core.Model(str(bad))
    with pytest.raises(GGUFFormatError, match=match):
        pydflash.plan(bad)


def test_shared_expert_width_from_feed_forward_length(x8k4, tmp_path):
    """Without expert_shared_feed_forward_length llama.cpp takes feed_forward_length."""
    path, _ = x8k4
    moved = rewrite(path, tmp_path / "m.gguf", drop_keys=("qwen35moe.expert_shared_feed_forward_length",),
                    set_keys={"qwen35moe.feed_forward_length": (32, U32)})
    assert np.array_equal(logits_of(moved), logits_of(path))


# --------------------------------------------------------------------------------------------------
# quantized


def test_q8_0_weights_stay_close_to_f32(x8k4, tmp_path):
    """Stated bound: mean KL(f32 weights || q8_0 weights) over a 64-token sequence, f32 KV on both sides, as
    test_qwen35.py states it for the dense hybrid (the routers and the shared expert's gate stay f32)."""
    path, _ = x8k4
    seq = (PROMPT * 6)[:64]
    qpath = quantize_gguf(path, tmp_path / "q8_0.gguf", "q8_0", progress=False)
    kl = kl_divergence(logits_of(path, seq), logits_of(qpath, seq))
    print(f"weights q8_0: mean KL vs f32 = {kl:.2e}")
    assert kl <= 0.3


def test_plan_counts_the_experts(x8k4):
    path, _ = x8k4
    plan = pydflash.plan(path, n_ctx=256)
    with pydflash.Model(path, n_ctx=256) as m:
        real = m.memory()
    experts = sum(t.n_bytes for t in gguf.GGUFReader(path).tensors if "_exps" in t.name or "_shexp" in t.name)
    assert plan.bytes["weights"] == real["weights"]
    assert plan.bytes["kv"] == real["kv"] and plan.bytes["recurrent"] == real["recurrent"]
    assert real["weights"]["cpu"] >= experts > 0


# --------------------------------------------------------------------------------------------------
# speculative decoding over the hybrid MoE target: a random DFlash drafter is rejected at almost every round, which
# makes these runs a rollback test of the KV cache and the recurrent state with a routed FFN


# target shape: the drafter's target_layer_ids
PAIRS = {"x4k1": [0, 2], "x8k4": [1]}


@pytest.fixture(scope="module", params=sorted(PAIRS))
def pair(request, tmp_path_factory):
    return random_pair(tmp_path_factory.mktemp("pair-" + request.param), make_qwen35moe_shape, request.param,
                       PAIRS[request.param])


@pytest.mark.parametrize("mode,budget", [("chain", None), ("tree", 15), ("tree", 63), ("auto", None)])
def test_speculative_output_equals_plain_greedy(pair, mode, budget):
    assert_speculative_equals_plain(*pair, mode, budget)


@pytest.mark.parametrize("mode,budget", [("chain", None), ("tree", 20), ("auto", None)])
def test_speculative_sampling_equals_plain_sampling(pair, mode, budget):
    assert_sampling_equals_plain(*pair, mode, budget)
