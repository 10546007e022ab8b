"""DFlash speculative decoding (chain, DDTree tree, auto): lossless against plain greedy decoding of the same GGUF,
on Qwen3 and Qwen3.5 targets, and typed errors for every pair mismatch. A random drafter is rejected at almost
every round, which makes these runs the rollback stress test of the target's KV and recurrent state."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_models import make_dflash_checkpoint, make_qwen3_shape, make_qwen35_shape  # noqa: E402
from near_ties import TIE, first_difference, rounding_spread, tie_gap  # noqa: E402

import pydflash  # noqa: E402
from pydflash import _core  # noqa: E402
from pydflash.convert import convert_hf_to_gguf  # noqa: E402
from pydflash.convert.quantize import quantize_gguf  # noqa: E402
from pydflash.errors import GGUFFormatError, UnsupportedModelError  # noqa: E402

PAIRS = {
    # name: (arch, target shape, draft target_layer_ids)
    "qwen3": ("qwen3", "gqa4x2_hd64", [0]),
    "qwen3_tied": ("qwen3", "gqa4x1_hd64_tied", [0, 1]),
    "qwen35": ("qwen35", "k2v4_hd32", [0, 2]),
    "qwen35_k1v3": ("qwen35", "k1v3_tied_mtp", [1, 2]),
}
PROMPTS = [[5, 9, 33, 100, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [300] * 3, list(range(40, 90))]


@pytest.fixture(scope="module", params=sorted(PAIRS))
def pair(request, tmp_path_factory):
    """(target GGUF, draft GGUF, HF target dir) of a random pair, f32."""
    arch, shape, ids = PAIRS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    make = make_qwen3_shape if arch == "qwen3" else make_qwen35_shape
    target_dir = make(root / "target", shape, seed=5)
    target = convert_hf_to_gguf(target_dir, root / "target.gguf", outtype="f32", progress=False)
    draft_dir = make_dflash_checkpoint(root / "draft", target_dir, target_layer_ids=ids, seed=1)
    draft = convert_hf_to_gguf(draft_dir, root / "draft.gguf", outtype="f32", target_model_dir=target_dir,
                               progress=False)
    return target, draft, target_dir


def generate(model_path, prompt, n, draft=None, block_size=None, kv_type="f16", **spec):
    with pydflash.Model(model_path, n_ctx=512, kv_type=kv_type, draft_model_path=draft,
                        block_size=block_size, **spec) as m:
        return m.generate(prompt, max_tokens=n)


# (spec_mode, tree_budget, block_size): the chain at the trained and a shorter block, DDTree at several budgets
# (1 and 4: shallower than the block; 15: the chain seed fills it; 32, 63: siblings at many depths), auto
MODES = [("chain", None, None), ("chain", None, 4), ("tree", 1, None), ("tree", 4, None), ("tree", 15, None),
         ("tree", 32, None), ("tree", 63, None), ("tree", 20, 5), ("auto", None, None)]


@pytest.mark.parametrize("mode,budget,block_size", MODES)
def test_speculative_output_equals_plain_greedy(pair, mode, budget, block_size):
    target, draft, _ = pair
    for prompt in PROMPTS:
        plain = generate(target, prompt, 96)
        spec = generate(target, prompt, 96, draft=draft, block_size=block_size, spec_mode=mode, tree_budget=budget)
        assert spec.tokens == plain.tokens
        assert spec.finish_reason == plain.finish_reason
        t = spec.timings
        assert len(t["acceptance_by_position"]) == (block_size or 16) - 1
        if mode == "auto":
            # auto verifies drafts only in rounds it expects to pay: the others are plain target steps
            assert t["n_target_evals"] >= t["n_rounds"]
            assert t["auto_skipped"] + t["auto_plain"] + t["auto_chain"] + t["auto_tree"] >= t["n_rounds"]
            continue
        # one target pass per round, a round commits accepted drafts + 1: passes per token = 1 / tau
        assert t["n_target_evals"] == t["n_rounds"]
        assert t["draft_n_accepted"] + t["n_rounds"] >= len(spec.tokens) - 1
        if t["n_rounds"]:  # (none when the first token already ends generation)
            assert t["tau"] >= 1.0
            # a round verifies its root and at most `budget` drafts (fewer at the end of the generation)
            nodes = budget if mode == "tree" else (block_size or 16) - 1
            assert t["n_rounds"] < t["verify_n"] <= t["n_rounds"] * (1 + nodes)


@pytest.mark.parametrize("mode,budget", [("chain", None), ("tree", 15), ("tree", 24), ("auto", 24)])
def test_wrapping_feature_ring_and_draft_window_stay_lossless(pair, mode, budget):
    """A small feature ring (n_ubatch 16: the 50-token prompt is prefilled in 4 chunks; a chain's ring holds 16
    rows, a tree's its verify width) and a 24-position draft window, generating 160 tokens: both wrap many times
    over."""
    target, draft, _ = pair
    plain = generate(target, PROMPTS[3], 160)
    with pydflash.Model(target, n_ctx=512, n_ubatch=16, draft_model_path=draft, draft_window=24, spec_mode=mode,
                        tree_budget=budget) as m:
        assert m._draft.ring_capacity == (16 if mode == "chain" else 1 + budget) and m._draft.window == 24
        spec = m.generate(PROMPTS[3], max_tokens=160)
        assert spec.tokens == plain.tokens
        # the prompt cache is reused across calls; a shorter prompt cuts the drafter's rows back too
        assert m.generate(PROMPTS[3][:30], max_tokens=100).tokens == generate(target, PROMPTS[3][:30], 100).tokens


def test_quantized_target_and_draft_stay_lossless(pair, tmp_path):
    target, draft, _ = pair
    qt = quantize_gguf(target, tmp_path / "t.gguf", "q8_0", progress=False)
    qd = quantize_gguf(draft, tmp_path / "d.gguf", "q4_0", progress=False)
    for prompt in PROMPTS[:2]:
        plain = generate(qt, prompt, 64).tokens
        for mode, budget in (("chain", None), ("tree", 32)):
            spec = generate(qt, prompt, 64, draft=qd, spec_mode=mode, tree_budget=budget).tokens
            if spec != plain:
                # q8_0 weights: the CPU's kernels round a verify's batched matmuls and a single-token step apart,
                # on a random checkpoint by more than TIE (an AVX2-only EPYC: qwen3_tied chain parts at output 50,
                # its two tokens 0.16 apart where the evaluations differ by 0.48): a parting only where the two
                # tokens are closer than the evaluations' own spread (tests/near_ties.py)
                k = first_difference(spec, plain)
                with pydflash.Model(qt, n_ctx=512) as m:
                    spread = rounding_spread(m, prompt, spec, k)
                    assert tie_gap(m, prompt, spec, plain, k) < max(TIE, spread), (mode, k, spread)


def test_speculative_false_and_streaming(pair):
    target, draft, _ = pair
    with pydflash.Model(target, n_ctx=256, draft_model_path=draft) as m:
        spec = m.generate(PROMPTS[0], max_tokens=40)
        plain = m.generate(PROMPTS[0], max_tokens=40, speculative=False)
        assert "n_rounds" in spec.timings and "n_rounds" not in plain.timings
        assert spec.tokens == plain.tokens
        assert "".join(m.stream(PROMPTS[0], max_tokens=40)) == spec.text
        # prompt cache shared by both modes: a follow-up call stays lossless
        assert m.generate(PROMPTS[0] + spec.tokens, max_tokens=20).tokens == \
            m.generate(PROMPTS[0] + spec.tokens, max_tokens=20, speculative=False).tokens


def test_stop_and_context_limits(pair):
    target, draft, _ = pair
    model = _core.Model(str(target))
    raw = dict(stop_tokens=[])  # no end-of-generation ids: compare raw greedy streams
    plain = _core.Session(model, n_ctx=512).generate(PROMPTS[1], max_tokens=60, **raw)["tokens"]
    ds = _core.DraftSession(model, str(draft), n_ctx=512)
    s = _core.Session(model, n_ctx=512)
    for spec in (dict(spec_mode="chain"), dict(spec_mode="tree", tree_budget=20)):
        # a stop token ends generation at the same token as plain decoding
        stop_at = plain[25]
        ours = s.generate(PROMPTS[1], max_tokens=60, stop_tokens=[stop_at], draft=ds, **spec)
        assert ours["tokens"] == plain[:plain.index(stop_at)] and ours["finish_reason"] == "stop"
        # max_tokens inside a round
        for n in (1, 2, 17, 33):
            assert s.generate(PROMPTS[1], max_tokens=n, draft=ds, **raw, **spec)["tokens"] == plain[:n]
        # the context (40 tokens) ends generation
        small = _core.Session(model, n_ctx=40, n_rollback=32)
        small_draft = _core.DraftSession(model, str(draft), n_ctx=40, top_k=4)
        r = small.generate(PROMPTS[1], max_tokens=100, draft=small_draft, **raw, **spec)
        assert r["finish_reason"] == "length"
        assert r["tokens"] == plain[:len(r["tokens"])]
        assert len(PROMPTS[1]) + len(r["tokens"]) == 40 + 1


# ---- pair mismatches: typed errors naming the field and both values ----

def test_hidden_size_mismatch(pair, tmp_path):
    target, _, _ = pair
    other_target = make_qwen3_shape(tmp_path / "other", "mha2x2_hd128", seed=2)  # hidden 256
    d = make_dflash_checkpoint(tmp_path / "d", other_target, target_layer_ids=[0], seed=1)
    draft = convert_hf_to_gguf(d, tmp_path / "d.gguf", outtype="f32", target_model_dir=other_target, progress=False)
    with pytest.raises(GGUFFormatError, match=r"dflash\.embedding_length = 256 but the target's .* hidden size is"):
        pydflash.Model(target, draft_model_path=draft)


def test_target_passed_as_draft(pair):
    target, _, _ = pair
    with pytest.raises(UnsupportedModelError, match="expected 'dflash'"):
        pydflash.Model(target, draft_model_path=target)


def test_block_size_beyond_training(pair):
    target, draft, _ = pair
    with pytest.raises(ValueError, match=r"block_size = 17 must be in \[2, 16\]"):
        pydflash.Model(target, draft_model_path=draft, block_size=17)
    # (proposers=(): no proposer at all; a target with an MTP head would draft with it, tests/test_mtp.py)
    with pytest.raises(ValueError, match="need a proposer: a draft model"):
        pydflash.Model(target, block_size=4, proposers=())
    with pytest.raises(ValueError, match="need a proposer: a draft model"):
        pydflash.Model(target, tree_budget=4, proposers=())
    with pytest.raises(ValueError, match=r"tree_budget = 256, expected a value in \[1, 255\]"):
        pydflash.Model(target, draft_model_path=draft, tree_budget=256)
    with pytest.raises(ValueError, match="spec_mode='beam' is not one of auto, tree, chain"):
        pydflash.Model(target, draft_model_path=draft, spec_mode="beam")


def test_ring_and_window_limits(pair):
    target, draft, _ = pair
    model = _core.Model(str(target))
    small_ring = _core.DraftSession(model, str(draft), n_ctx=256, ring_capacity=8)
    assert small_ring.ring_capacity == 16  # never below the block
    session = _core.Session(model, n_ctx=256, n_ubatch=64)
    with pytest.raises(ValueError, match="n_ubatch = 64 exceeds the feature ring's 16 rows"):
        session.generate(PROMPTS[0], max_tokens=4, draft=small_ring)
    with pytest.raises(ValueError, match=r"window = 0, expected a value in \[1, "):
        _core.DraftSession(model, str(draft), n_ctx=256, window=0)
    with pytest.raises(ValueError, match="feats rows have 3 floats"):
        small_ring.draft(np.zeros((2, 3), dtype=np.float32), np.arange(2, dtype=np.int32), 5, 2)


def test_draft_keys_out_of_range(pair, tmp_path):
    from gguf_edit import rewrite

    import gguf

    target, draft, _ = pair
    n_vocab = _core.Model(str(target)).n_vocab
    bad_mask = rewrite(draft, tmp_path / "mask.gguf",
                       set_keys={"tokenizer.ggml.mask_token_id": (n_vocab + 5, gguf.GGUFValueType.UINT32)})
    with pytest.raises(GGUFFormatError, match=r"mask_token_id = %d is outside the target's vocabulary" % (n_vocab + 5)):
        pydflash.Model(target, draft_model_path=bad_mask)
    bad_layers = rewrite(draft, tmp_path / "layers.gguf",
                         set_keys={"dflash.target_layers": ([1, 99], gguf.GGUFValueType.ARRAY)})
    with pytest.raises(GGUFFormatError, match=r"dflash\.target_layers\[1\] = 99 is outside the target's layers"):
        pydflash.Model(target, draft_model_path=bad_layers)
    no_mask = rewrite(draft, tmp_path / "nomask.gguf", drop_keys=["tokenizer.ggml.mask_token_id"])
    with pytest.raises(GGUFFormatError, match="mask_token_id"):
        pydflash.Model(target, draft_model_path=no_mask)


@pytest.mark.parametrize("window,ring,skipped", [(4096, 512, ()), (16, 8, ()), (16, 512, ()), (4096, 512, (10, 30)),
                                                 (4096, 8, (20, 50)), (16, 8, (40, 45)), (16, 512, (20, 30))])
def test_draft_proposals_match_the_pytorch_reference(pair, window, ring, skipped):
    """One draft call of ours against the reference drafter (tools/dflash_ref.py, written from the algorithm
    reference) on the same HF weights and the transformers target's features. With a sliding window shorter
    than the prompt (and a feature ring and draft cache that wrap around), the reference is given only the
    last `window` context positions (a ring that holds the whole prompt: rows a cache slot apart are queued
    together, and each must land alone). With positions skipped (evaluated without capture: auto's plain rounds
    far from a draft, DraftSession skip), only the others, at their positions."""
    import torch
    import transformers

    from dflash_ref import DFlashDraftModel, extract_features

    target_gguf, draft_gguf, target_dir = pair
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_pretrained(target_dir.parent / "draft", dtype=torch.float32).eval()
    prompt = PROMPTS[3]
    P, n = len(prompt), 15
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
        feats = extract_features(out.hidden_states, draft.target_layer_ids)  # [1, P, n_ext*E]
        anchor = int(out.logits[0, -1].argmax())
        block = torch.tensor([[anchor] + [draft.mask_token_id] * n])
        kept = [p for p in range(P) if not (skipped and skipped[0] <= p < skipped[1])]
        seen = [p for p in kept if p >= P - window]
        positions = torch.tensor([seen + list(range(P, P + n + 1))])
        h = draft(target.get_input_embeddings()(block), feats[:, seen], positions)
        ref_logits = target.get_output_embeddings()(h)[0, 1:]  # slots 1..n
    ours = _core.DraftSession(_core.Model(str(target_gguf)), str(draft_gguf), n_ctx=256, window=window,
                              ring_capacity=ring).draft(feats[0, kept].numpy(), np.array(kept, dtype=np.int32),
                                                        anchor, P)
    top2 = torch.topk(ref_logits, 2).values
    for k, (a, b) in enumerate(zip(ours, ref_logits.argmax(-1).tolist())):
        # a different choice only where the reference itself is tied
        assert a == b or float(top2[k, 0] - top2[k, 1]) < 1e-3, (k, a, b)


def test_draft_top_k_logprobs_match_the_pytorch_reference(pair):
    """What trees are built from: per drafted position the k most likely tokens and their log-probabilities
    (log-softmax over the target's head), most likely first, against the reference drafter."""
    import torch
    import transformers

    from dflash_ref import DFlashDraftModel, extract_features

    target_gguf, draft_gguf, target_dir = pair
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_pretrained(target_dir.parent / "draft", dtype=torch.float32).eval()
    prompt = PROMPTS[3]
    P, n, k = len(prompt), 15, 8
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
        feats = extract_features(out.hidden_states, draft.target_layer_ids)
        anchor = int(out.logits[0, -1].argmax())
        block = torch.tensor([[anchor] + [draft.mask_token_id] * n])
        h = draft(target.get_input_embeddings()(block), feats, torch.arange(0, P + n + 1)[None])
        ref_lp = torch.log_softmax(target.get_output_embeddings()(h)[0, 1:], dim=-1)
    ds = _core.DraftSession(_core.Model(str(target_gguf)), str(draft_gguf), n_ctx=256, top_k=k)
    assert ds.top_k == k
    ids, lps = ds.draft(feats[0].numpy(), np.arange(P, dtype=np.int32), anchor, P, with_logprobs=True)
    assert ids.shape == lps.shape == (n, k)
    for pos in range(n):
        assert np.all(np.diff(lps[pos]) <= 0)  # most likely first
        ref_vals, ref_ids = torch.topk(ref_lp[pos], k + 1)
        np.testing.assert_allclose(lps[pos], ref_lp[pos][ids[pos]].numpy(), atol=1e-4)
        np.testing.assert_allclose(lps[pos], ref_vals[:k].numpy(), atol=1e-4)
        # the same set, up to entries the reference itself cannot tell apart
        for tok, lp in zip(ids[pos], lps[pos]):
            assert tok in ref_ids[:k].tolist() or abs(float(lp) - float(ref_vals[k - 1])) < 1e-4


@pytest.fixture(scope="module")
def swa_pair(tmp_path_factory):
    """A qwen3 target and a drafter whose first layer attends a sliding window of 6 positions (z-lab config:
    use_sliding_window, sliding_window, layer_types), f32."""
    root = tmp_path_factory.mktemp("swa")
    target_dir = make_qwen3_shape(root / "target", "gqa4x2_hd64", seed=5)
    target = convert_hf_to_gguf(target_dir, root / "target.gguf", outtype="f32", progress=False)
    draft_dir = make_dflash_checkpoint(root / "draft", target_dir, target_layer_ids=[0], seed=3, extra_config={
        "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 0,
        "layer_types": ["sliding_attention", "full_attention"]})
    draft = convert_hf_to_gguf(draft_dir, root / "draft.gguf", outtype="f32", target_model_dir=target_dir,
                               progress=False)
    return target, draft, target_dir, draft_dir


def _reference_block_logits(target_dir, draft_model, prompt, n):
    import torch
    import transformers

    from dflash_ref import extract_features

    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
        feats = extract_features(out.hidden_states, draft_model.target_layer_ids)
        anchor = int(out.logits[0, -1].argmax())
        block = torch.tensor([[anchor] + [draft_model.mask_token_id] * n])
        return target, feats, anchor, block


def _assert_draft_matches(target_gguf, draft_gguf, feats, anchor, ref):
    """Our one draft call over the context features `feats` [1, P, n_ext*E] against reference logits `ref`
    [B-1, V]: the same greedy proposals, but where the reference itself is tied."""
    import torch

    P = feats.shape[1]
    ours = _core.DraftSession(_core.Model(str(target_gguf)), str(draft_gguf), n_ctx=256).draft(
        feats[0].numpy(), np.arange(P, dtype=np.int32), anchor, P)
    top2 = torch.topk(ref, 2).values
    for k, (a, b) in enumerate(zip(ours, ref.argmax(-1).tolist())):
        assert a == b or float(top2[k, 0] - top2[k, 1]) < 1e-3, (k, a, b)


def test_sliding_window_draft_follows_its_metadata(swa_pair):
    """dflash.attention.sliding_window + sliding_window_pattern: the sliding layer's block queries see the last
    6 positions, causally (z-lab's default for sliding layers), the full layer everything. Our proposals
    against the reference drafter given the same config; the same reference run with the window switched off
    proposes differently, so the window is what is being matched."""
    import torch

    from dflash_ref import DFlashDraftModel

    target_gguf, draft_gguf, target_dir, draft_dir = swa_pair
    meta = _core.gguf_metadata(str(draft_gguf), ["dflash.attention.sliding_window",
                                                 "dflash.attention.sliding_window_pattern"])
    assert meta["dflash.attention.sliding_window"][2] == 6
    assert list(meta["dflash.attention.sliding_window_pattern"][2]) == [True, False]
    prompt, n = PROMPTS[3], 15
    P = len(prompt)
    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32).eval()
    target, feats, anchor, block = _reference_block_logits(target_dir, draft, prompt, n)
    positions = torch.arange(0, P + n + 1)[None]
    with torch.no_grad():
        emb = target.get_input_embeddings()(block)
        ref = target.get_output_embeddings()(draft(emb, feats, positions))[0, 1:]
        draft.config.use_sliding_window = False
        full = DFlashDraftModel(draft.config)
        full.load_state_dict(draft.state_dict())
        unwindowed = target.get_output_embeddings()(full.eval()(emb, feats, positions))[0, 1:]
    assert ref.argmax(-1).tolist() != unwindowed.argmax(-1).tolist()
    _assert_draft_matches(target_gguf, draft_gguf, feats, anchor, ref)


def test_sliding_window_draft_against_zlab_dflash(swa_pair):
    """The same against z-lab's own drafter (dflash 0.1.0 from PyPI, which the test command installs --no-deps: its
    dependencies pin datasets/requests/tqdm, and its model needs only torch and transformers)."""
    dflash = pytest.importorskip("dflash")
    import torch

    target_gguf, draft_gguf, target_dir, draft_dir = swa_pair
    zlab = dflash.DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32).eval()
    prompt, n = PROMPTS[3], 15
    P = len(prompt)
    target, feats, anchor, block = _reference_block_logits(target_dir, zlab, prompt, n)
    with torch.no_grad():
        h = zlab(position_ids=torch.arange(0, P + n + 1)[None], noise_embedding=target.get_input_embeddings()(block),
                 target_hidden=feats)
        ref = target.get_output_embeddings()(h)[0, 1:]
    _assert_draft_matches(target_gguf, draft_gguf, feats, anchor, ref)


def test_sliding_window_draft_stays_lossless(swa_pair):
    target_gguf, draft_gguf, _, _ = swa_pair
    for mode in ("chain", "tree"):
        for prompt in PROMPTS:
            assert generate(target_gguf, prompt, 40, draft=draft_gguf, spec_mode=mode).tokens == \
                generate(target_gguf, prompt, 40).tokens
