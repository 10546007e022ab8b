"""The Qwen3 MoE target (arch `qwen3moe`) end to end: HF `Qwen3MoeForCausalLM` -> our converter -> GGUF -> our engine,
against transformers (4, 5, 7 and 8 experts, top-1 to top-4, routers with clear margins), quantized, the experts'
placement and memory plan, typed errors for bad files, and speculative decoding over it (equal to plain)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gguf_edit import rewrite  # noqa: E402
from hf_models import QWEN3MOE_SHAPES, make_dflash_checkpoint, make_qwen3moe_shape  # noqa: E402
from near_ties import draw_is_fragile, first_difference, moe_experts, routes_at_a_tie_before  # noqa: E402
from test_qwen3 import assert_greedy_matches_transformers, kl_divergence, ref_logits  # noqa: E402

import gguf  # noqa: E402
import pydflash  # noqa: E402
from pydflash import _core  # noqa: E402
from pydflash.convert import convert_hf_to_gguf  # noqa: E402
from pydflash.convert.quantize import quantize_gguf  # noqa: E402
from pydflash.errors import GGUFFormatError  # noqa: E402

PROMPT = [3, 17, 200, 45, 9, 311, 77, 5, 128, 64, 400, 12]


def converted_checkpoint(root, make_shape, shape: str) -> tuple:
    """(HF folder, f32 GGUF path, transformers model) for one tiny random checkpoint of make_shape's family."""
    d = make_shape(root / "hf", shape, seed=7)
    gguf_path = convert_hf_to_gguf(d, d.parent / "model-f32.gguf", outtype="f32", progress=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return d, gguf_path, ref


@pytest.fixture(scope="module", params=sorted(QWEN3MOE_SHAPES))
def checkpoint(request, tmp_path_factory):
    """(HF folder, f32 GGUF path, transformers model) for one tiny random Qwen3 MoE shape."""
    return converted_checkpoint(tmp_path_factory.mktemp(request.param), make_qwen3moe_shape, request.param)


def test_logits_match_transformers(checkpoint):
    _, gguf_path, ref = checkpoint
    model = _core.Model(str(gguf_path))
    assert model.arch == "qwen3moe"
    session = _core.Session(model, n_ctx=128, type_k="f32", type_v="f32")
    ours, _ = session.eval(np.array(PROMPT, dtype=np.int32), all_logits=True)
    theirs = ref_logits(ref, PROMPT)
    rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"max relative error vs transformers: {rel:.2e}")
    assert rel <= 1e-4


def test_greedy_continuation_matches_transformers(checkpoint):
    _, gguf_path, ref = checkpoint
    assert_greedy_matches_transformers(gguf_path, ref, PROMPT)


def test_tree_batch_matches_transformers(checkpoint):
    """Two sibling branches in one batch (a DDTree verify: every token routed on its own) and the last token only."""
    _, gguf_path, ref = checkpoint
    model = _core.Model(str(gguf_path))
    s = _core.Session(model, n_ctx=64, type_k="f32", type_v="f32")
    prefix = PROMPT[:5]
    s.eval(np.array(prefix, dtype=np.int32))
    s.commit(len(prefix))
    p = len(prefix)
    r, a, b, c = 40, 41, 42, 43  # root r, children a and b of r, c child of b
    tokens = np.array([r, a, b, c], dtype=np.int32)
    positions = np.array([p, p + 1, p + 1, p + 2], dtype=np.int32)
    mask = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=np.uint8)
    logits, _ = s.eval(tokens, positions=positions, mask=mask)
    path_a = ref_logits(ref, prefix + [r, a])
    path_bc = ref_logits(ref, prefix + [r, b, c])
    scale = np.abs(path_bc).max()
    assert np.abs(logits[1] - path_a[-1]).max() <= 1e-4 * scale
    assert np.abs(logits[2] - path_bc[-2]).max() <= 1e-4 * scale
    assert np.abs(logits[3] - path_bc[-1]).max() <= 1e-4 * scale
    s.truncate(0)
    last, _ = s.eval(np.array(prefix + [r, b, c], dtype=np.int32), all_logits=False)
    assert np.abs(last[0] - path_bc[-1]).max() <= 1e-4 * scale


def dequantized_copy(src, dst):
    """`src` with every quantized tensor dequantized to f32 by gguf-py (the same weights, in plain matmuls)."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, f in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for t in reader.tensors:
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        data = gguf.quants.dequantize(t.data, qtype) if qtype not in (gguf.GGMLQuantizationType.F32,) else t.data
        writer.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_q8_0_weights_stay_close_to_f32(checkpoint, tmp_path):
    """Stated bound: mean KL(f32 weights || q8_0 weights) over a 64-token sequence, f32 KV on both sides, as
    test_qwen3.py states it for the dense target (the router stays f32: ffn_gate_inp is never quantized)."""
    _, gguf_path, _ = checkpoint
    seq = np.array((PROMPT * 6)[:64], dtype=np.int32)
    base, _ = _core.Session(_core.Model(str(gguf_path)), n_ctx=128, type_k="f32", type_v="f32").eval(seq)
    qpath = quantize_gguf(gguf_path, tmp_path / "q8_0.gguf", "q8_0", progress=False)
    logits, _ = _core.Session(_core.Model(str(qpath)), n_ctx=128, type_k="f32", type_v="f32").eval(seq)
    kl = kl_divergence(base, logits)
    print(f"weights q8_0: mean KL vs f32 = {kl:.2e}")
    assert kl <= 0.08


def test_repacked_q4_0_experts_compute_their_weights(checkpoint, tmp_path):
    """q4_0 experts go to the CPU's repacking buffer type wherever this CPU repacks q4_0 matmul weights (chosen by
    probing ggml_mul_mat_id), and compute what the same weights dequantized by gguf-py compute in f32 (up to the
    q8_0 rounding of the activations that q4_0 matmuls on the CPU do: the bound is the q8_0 weights' below; measured
    4e-4 to 2e-2, where experts misread would be several nats)."""
    _, gguf_path, _ = checkpoint
    seq = np.array((PROMPT * 6)[:64], dtype=np.int32)
    qpath = quantize_gguf(gguf_path, tmp_path / "q4_0.gguf", "q4_0", progress=False)
    quant = _core.Model(str(qpath))
    logits, _ = _core.Session(quant, n_ctx=128, type_k="f32", type_v="f32").eval(seq)
    plain = _core.Model(str(dequantized_copy(qpath, tmp_path / "dequantized.gguf")))
    base, _ = _core.Session(plain, n_ctx=128, type_k="f32", type_v="f32").eval(seq)
    kl = kl_divergence(base, logits)
    print(f"q4_0 vs its weights dequantized: mean KL = {kl:.2e}")
    assert kl <= 0.08
    placed = {name: buft for name, _, buft in quant.placement}
    types = {t.name: gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(qpath).tensors}
    if any("REPACK" in placed[n].upper() for n in placed if n.endswith("attn_q.weight") and types[n] == "Q4_0"):
        for name, buft in placed.items():
            if name.endswith("_exps.weight") and types[name] == "Q4_0":
                assert "REPACK" in buft.upper(), (name, buft)
    assert "REPACK" not in placed["blk.0.ffn_gate_inp.weight"].upper()


def test_greedy_q8_0_gguf_from_the_converter(checkpoint, tmp_path):
    """A q8_0 file straight from pydflash-convert: greedy decoding keeps to the f32 file's until a near-tie."""
    hf_dir, gguf_path, _ = checkpoint
    q8 = convert_hf_to_gguf(hf_dir, tmp_path / "q8_0.gguf", outtype="q8_0", progress=False)
    with pydflash.Model(gguf_path, n_ctx=256, kv_type="f32") as m:
        exact = m._session.generate(PROMPT, max_tokens=32, stop_tokens=[])["tokens"]
        session = _core.Session(m._model, n_ctx=256, type_k="f32", type_v="f32")
        logits, _ = session.eval(np.array(PROMPT + exact[:-1], dtype=np.int32), all_logits=True)
        logits = logits[len(PROMPT) - 1:]
    with pydflash.Model(q8, n_ctx=256, kv_type="f32") as m:
        quant = m._session.generate(PROMPT, max_tokens=32, stop_tokens=[])["tokens"]
    for step, (a, b) in enumerate(zip(exact, quant)):
        if a != b:
            gap = float(np.sort(logits[step])[-1] - np.sort(logits[step])[-2])
            # q8_0 moves logits by ~1e-2 relative on these toys: the step where they part is a near-tie at that scale
            assert gap < 0.05 * np.abs(logits[step]).max(), f"parted at step {step} with a top-2 gap of {gap}"
            break


# --------------------------------------------------------------------------------------------------
# placement and memory plan


def test_plan_counts_the_experts(checkpoint):
    _, gguf_path, _ = checkpoint
    plan = pydflash.plan(gguf_path, n_ctx=256)
    with pydflash.Model(gguf_path, n_ctx=256) as m:
        real = m.memory()
        experts = sum(t.n_bytes for t in gguf.GGUFReader(gguf_path).tensors if t.name.endswith("_exps.weight"))
    assert plan.bytes["weights"] == real["weights"]
    assert plan.bytes["kv"] == real["kv"]
    assert real["weights"]["cpu"] >= experts > 0


# --------------------------------------------------------------------------------------------------
# bad files


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    d = make_qwen3moe_shape(tmp_path_factory.mktemp("bad") / "hf", "x4k1", seed=3)
    return convert_hf_to_gguf(d, d.parent / "m.gguf", outtype="f32", progress=False)


U32 = gguf.GGUFValueType.UINT32


@pytest.mark.parametrize("edit, match", [
    (dict(set_keys={"qwen3moe.expert_used_count": (0, U32)}),
     r"key 'qwen3moe\.expert_used_count' = 0, expected a value in \[1, 4\]"),
    (dict(set_keys={"qwen3moe.expert_used_count": (5, U32)}),
     r"key 'qwen3moe\.expert_used_count' = 5, expected a value in \[1, 4\]"),
    (dict(set_keys={"qwen3moe.expert_count": (0, U32)}),
     r"key 'qwen3moe\.expert_count' = 0, expected a value in \[1, "),
    (dict(drop_keys=("qwen3moe.expert_count",)), r"qwen3moe\.expert_count"),
    (dict(drop_tensors=("blk.1.ffn_gate_inp.weight",)), r"blk\.1\.ffn_gate_inp\.weight"),
    (dict(drop_tensors=("blk.0.ffn_down_exps.weight",)), r"blk\.0\.ffn_down_exps\.weight"),
    (dict(reshape={"blk.1.ffn_up_exps.weight": (3, 64, 64)}),
     r"tensor 'blk\.1\.ffn_up_exps\.weight' has shape \{64, 64, 3\}, expected \{64, 64, 4\}"),
    (dict(reshape={"blk.0.ffn_gate_exps.weight": (4, 32, 64)}),
     r"tensor 'blk\.0\.ffn_gate_exps\.weight' has shape \{64, 32, 4\}, expected \{64, 64, 4\}"),
    (dict(set_keys={"qwen3moe.expert_feed_forward_length": (32, U32)}),
     r"tensor 'blk\.0\.ffn_gate_exps\.weight' has shape \{64, 64, 4\}, expected \{64, 32, 4\}"),
], ids=["used-0", "used-above-count", "count-0", "no-count", "no-router", "no-down-experts", "fewer-up-experts",
        "narrower-gate-experts", "width-key-disagrees"])
def test_bad_file_names_the_key_or_tensor(small_gguf, tmp_path, edit, match):
    bad = rewrite(small_gguf, tmp_path / "bad.gguf", **edit)
    with pytest.raises(GGUFFormatError, match=match):
        _core.Model(str(bad))
    with pytest.raises(GGUFFormatError, match=match):
        pydflash.plan(bad)


def test_expert_width_from_feed_forward_length(small_gguf, tmp_path):
    """Without expert_feed_forward_length llama.cpp takes feed_forward_length / expert_used_count."""
    ref = _core.Session(_core.Model(str(small_gguf)), n_ctx=64).eval(np.array(PROMPT, dtype=np.int32))[0]
    moved = rewrite(small_gguf, tmp_path / "m.gguf", drop_keys=("qwen3moe.expert_feed_forward_length",),
                    set_keys={"qwen3moe.feed_forward_length": (64, U32)})
    assert np.array_equal(_core.Session(_core.Model(str(moved)), n_ctx=64).eval(np.array(PROMPT, dtype=np.int32))[0],
                          ref)


# --------------------------------------------------------------------------------------------------
# speculative decoding over the MoE target: a random DFlash drafter is rejected at almost every round, which makes
# these runs a rollback test of the target's cache with a routed FFN


# target shape: the drafter's target_layer_ids
PAIRS = {"x5k2_tied": [0, 1], "x8k4": [0]}


def random_pair(root, make_shape, shape: str, target_layer_ids: list[int]) -> tuple:
    """(f32 target GGUF, f32 GGUF of a random DFlash drafter over it) in `root`: the tiny MoE `shape` made by
    `make_shape` (hf_models)."""
    target_dir = make_shape(root / "target", shape, seed=5)
    target = convert_hf_to_gguf(target_dir, root / "target.gguf", outtype="f32", progress=False)
    draft_dir = make_dflash_checkpoint(root / "draft", target_dir, target_layer_ids=target_layer_ids, seed=1)
    draft = convert_hf_to_gguf(draft_dir, root / "draft.gguf", outtype="f32", target_model_dir=target_dir,
                               progress=False)
    return target, draft


@pytest.fixture(scope="module", params=sorted(PAIRS))
def pair(request, tmp_path_factory):
    return random_pair(tmp_path_factory.mktemp("pair-" + request.param), make_qwen3moe_shape, request.param,
                       PAIRS[request.param])


def generate(model_path, prompt, n, draft=None, **spec):
    with pydflash.Model(model_path, n_ctx=512, draft_model_path=draft, **spec) as m:
        return m.generate(prompt, max_tokens=n)


def assert_speculative_equals_plain(target, draft, mode: str, budget) -> None:
    """Greedy: speculative decoding's tokens and finish are plain decoding's, on two prompts; every round verifies
    once (auto may decode plainly)."""
    for prompt in ([5, 9, 33, 100, 7], list(range(40, 90))):
        plain = generate(target, prompt, 64)
        spec = generate(target, prompt, 64, draft=draft, spec_mode=mode, tree_budget=budget)
        assert spec.tokens == plain.tokens
        assert spec.finish_reason == plain.finish_reason
        if mode != "auto":
            assert spec.timings["n_rounds"] > 0 and spec.timings["n_target_evals"] == spec.timings["n_rounds"]


@pytest.mark.parametrize("mode,budget", [("chain", None), ("tree", 15), ("tree", 63), ("auto", None)])
def test_speculative_output_equals_plain_greedy(pair, mode, budget):
    assert_speculative_equals_plain(*pair, mode, budget)


SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, typical_p=1.0, repeat_penalty=1.0,
                presence_penalty=0.0, frequency_penalty=0.0, repeat_last_n=64)


def assert_sampling_equals_plain(target, draft, mode: str, budget) -> None:
    """Same seed, same tokens: or else they part at a draw that logit noise of near_ties.TIE could change, or
    after a token a verify reaching the parting evaluated whose router nearly ties (near_ties.CPU_ROUTER_TIE)."""
    prompt = [5, 9, 33, 100, 7]
    with pydflash.Model(target, n_ctx=512, draft_model_path=draft, spec_mode=mode, tree_budget=budget) as m:
        for seed in (1, 77):
            plain = m.generate(prompt, max_tokens=48, seed=seed, speculative=False, **SAMPLING).tokens
            spec = m.generate(prompt, max_tokens=48, seed=seed, **SAMPLING).tokens
            if spec != plain:
                k = first_difference(spec + [-1], plain + [-2])
                assert k < min(len(spec), len(plain)), k
                assert (draw_is_fragile(m, prompt, plain, k, {**SAMPLING, "seed": seed}) or
                        routes_at_a_tie_before(m, prompt, plain, k, moe_experts(target)[1], m._draft.block_size)), k


@pytest.mark.parametrize("mode,budget", [("chain", None), ("tree", 20), ("auto", None)])
def test_speculative_sampling_equals_plain_sampling(pair, mode, budget):
    assert_sampling_equals_plain(*pair, mode, budget)


def test_traced_routing_is_transformers_routing(checkpoint):
    """The experts each token is routed to, read from the engine's `ffn_moe_topk-<layer>` nodes (Session.trace_nodes,
    what benchmarks/bench_moe.py counts), are those of transformers' routers: the top k of each row of its router
    logits, most probable first."""
    _, gguf_path, ref = checkpoint
    session = _core.Session(_core.Model(str(gguf_path)), n_ctx=128, type_k="f32", type_v="f32")
    session.trace_nodes("ffn_moe_topk-")
    session.eval(np.array(PROMPT, dtype=np.int32))
    traced = session.take_trace()
    with torch.no_grad():
        router_logits = ref(torch.tensor([PROMPT]), output_router_logits=True).router_logits
    k = ref.config.num_experts_per_tok
    assert sorted(traced) == [f"ffn_moe_topk-{il}" for il in range(len(router_logits))]
    for il, logits in enumerate(router_logits):
        expected = torch.topk(logits.reshape(len(PROMPT), -1), k).indices.numpy()
        assert np.array_equal(traced[f"ffn_moe_topk-{il}"], expected), il
    session.eval(np.array([7], dtype=np.int32))
    assert session.take_trace()["ffn_moe_topk-0"].shape == (1, k)
    session.trace_nodes("")
    session.eval(np.array([8], dtype=np.int32))
    assert session.take_trace() == {}
