"""Hybrid trees without a state per node (issue 27). A Qwen3.5 verify keeps each node's delta-rule inputs (q, k,
v, gate, beta) instead of its 3 MB-per-layer state, and the commit recomputes the accepted path's state from the
committed one (state/recurrent_state.h).

References: the state the tree's own graph computed for the accepted node (traced from the level-by-level op),
which the commit must reproduce bit for bit; plain decoding, which speculation at budgets 22 to 255 must equal
(greedy and one seed of sampling). A fresh session fed only the accepted tokens is compared in test_tree.py
(300 random rounds, also for these checkpoints)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hf_models import make_qwen35_shape, make_qwen35moe_shape  # noqa: E402

import pydflash  # noqa: E402
from pydflash import _core  # noqa: E402
from pydflash.convert import convert_hf_to_gguf  # noqa: E402

from export_pairs import pair_file, prompt_rows  # noqa: E402
from near_ties import TIE, first_difference, tie_gap  # noqa: E402

HYBRIDS = {
    # name: (maker, shape)
    "qwen35": (make_qwen35_shape, "k2v4_hd32"),
    "qwen35_gdn_last": (make_qwen35_shape, "k8v32_hd8"),
    "qwen35moe": (make_qwen35moe_shape, "x8k4"),
}


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def hybrid(request, tmp_path_factory):
    maker, shape = HYBRIDS[request.param]
    d = maker(tmp_path_factory.mktemp(request.param) / "hf", shape, seed=11)
    return _core.Model(str(convert_hf_to_gguf(d, d.parent / "model-f32.gguf", outtype="f32", progress=False)))


def _random_tree(rng, n_nodes: int, max_depth: int, n_vocab: int):
    """(tokens, parents, depths) of a random tree with parents before children, never a plain chain."""
    while True:
        parents, depth = [-1], [0]
        while len(parents) < n_nodes:
            p = int(rng.integers(-1, len(parents)))
            if p < 0 or depth[p] < max_depth:
                parents.append(p)
                depth.append(0 if p < 0 else depth[p] + 1)
        if any(p != i - 1 for i, p in enumerate(parents)):
            return [int(t) for t in rng.integers(n_vocab, size=n_nodes)], parents, depth


def _gdn_layers(session, n_layer: int) -> list[int]:
    layers = []
    for il in range(n_layer):
        try:
            session.ssm_state(il)
            layers.append(il)
        except IndexError:
            pass
    return layers


def test_commit_recomputes_the_bits_the_tree_computed(hybrid):
    """80 random trees (2-40 nodes, forests too, up to 10 deep), each committing a random node's path: every
    gated-delta-net layer's committed state equals, bit for bit, the state the tree's level-by-level op computed
    for that node inside the verify graph (no per-node state is kept; the commit reruns the delta rule over the
    path's kept inputs)."""
    rng = np.random.default_rng(27)
    s = _core.Session(hybrid, n_ctx=1024, type_k="f32", type_v="f32", n_rollback=40)
    s.eval(np.array([3, 17, 200, 45, 9], dtype=np.int32))
    s.commit(5)
    layers = _gdn_layers(s, hybrid.n_layer)
    assert layers
    s.trace_nodes("gdn_tree-")
    checked = 0
    for _ in range(80):
        n = int(rng.integers(2, 41))
        tokens, parents, depth = _random_tree(rng, n, 10, hybrid.n_vocab)
        s.eval(np.array(tokens, dtype=np.int32), parents=np.array(parents, dtype=np.int32))
        traced = s.take_trace()
        node = int(rng.integers(n))
        levels = np.bincount(depth)
        d = depth[node]
        in_level = s.eval_slot(node) - int(levels[:d].sum())
        path = []
        i = node
        while i >= 0:
            path.append(i)
            i = parents[i]
        s.commit(path[::-1])
        for il in layers:
            committed = s.ssm_state(il)
            op = traced[f"gdn_tree-{il}-{d}"].reshape(-1)  # [nd outputs | nd states] of the level
            out_width = (op.size - int(levels[d]) * committed.size) // int(levels[d])  # S * Hv
            start = int(levels[d]) * out_width + in_level * committed.size
            assert np.array_equal(committed, op[start:start + committed.size]), (il, d, in_level)
            checked += 1
    s.trace_nodes("")
    assert checked >= 80 * len(layers)


def test_chain_commits_of_every_length_continue_like_the_whole_chain(hybrid):
    """A chain verify keeps its inputs too: committing i of its n tokens then evaluating the rest equals (to f32
    rounding of batched matmuls) committing all n at once; committing all keeps the state the verify wrote."""
    rng = np.random.default_rng(5)
    tokens = [int(t) for t in rng.integers(hybrid.n_vocab, size=12)]
    whole = _core.Session(hybrid, n_ctx=256, type_k="f32", type_v="f32", n_rollback=12)
    whole.eval(np.array(tokens, dtype=np.int32))
    whole.commit(12)
    layers = _gdn_layers(whole, hybrid.n_layer)
    for i in range(0, 13, 3):
        s = _core.Session(hybrid, n_ctx=256, type_k="f32", type_v="f32", n_rollback=12)
        s.eval(np.array(tokens, dtype=np.int32))
        s.commit(i)
        if i < 12:
            s.eval(np.array(tokens[i:], dtype=np.int32))
            s.commit(12 - i)
        for il in layers:
            a, b = s.ssm_state(il), whole.ssm_state(il)
            if i in (0, 12):
                assert np.array_equal(a, b), (i, il)  # no recompute, or the same single evaluation
            else:
                assert np.abs(a - b).max() <= 1e-4 * max(np.abs(b).max(), 1e-6), (i, il)


def test_recurrent_memory_does_not_hold_a_state_per_node(hybrid):
    """What a session keeps grows by one node's delta-rule and conv inputs per n_rollback, not by a state."""
    small = _core.Session(hybrid, n_ctx=64, n_rollback=16)
    big = _core.Session(hybrid, n_ctx=64, n_rollback=255)
    s0 = big.ssm_state(_gdn_layers(big, hybrid.n_layer)[0]).size * 4  # one layer's state, bytes
    per_node = (big.recurrent_bytes - small.recurrent_bytes) / (255 - 16)
    n_gdn = len(_gdn_layers(big, hybrid.n_layer))
    assert per_node < s0 * n_gdn, (per_node, s0 * n_gdn)
    # (the engine's estimate, which sizes auto's default budget, is the buffers' bytes but their alignment)
    assert 0 <= big.recurrent_bytes - hybrid.recurrent_bytes_for(255) < 64 * 8 * n_gdn
    assert big.measure_commit() > 0


@pytest.mark.parametrize("mode,budget", [("tree", 22), ("tree", 127), ("tree", 255), ("auto", 255)])
def test_speculative_equals_plain_at_large_tree_budgets(mode, budget):
    """Tree mode on the trained qwen35 pair at budgets 22, 127 and 255 (63 is in test_pairs.py), and auto free to
    choose up to 255: greedy output equals plain decoding's up to near-ties of q8_0 logits, and one seed of
    sampling equals plain sampling."""
    target, draft = pair_file("qwen35", "target", "q8_0"), pair_file("qwen35", "dflash", "q8_0")
    texts = [r["text"] for r in prompt_rows("code")[:3]]
    with pydflash.Model(target, n_ctx=1024) as plain:
        greedy = [plain.generate(t, max_tokens=48).tokens for t in texts]
        sampled = plain.generate(texts[0], max_tokens=48, temperature=0.8, seed=9).tokens
    with pydflash.Model(target, draft_model_path=draft, n_ctx=1024, spec_mode=mode, tree_budget=budget) as m:
        assert m.tree_budget == budget
        for text, expected in zip(texts, greedy):
            c = m.generate(text, max_tokens=48)
            if c.tokens != expected:
                k = first_difference(c.tokens, expected)
                assert tie_gap(m, m.tokenize(text), c.tokens, expected, k) < TIE, (text[:40], k)
            assert c.timings["draft_n_accepted"] > 0 or mode == "auto"  # (auto may find drafting does not pay)
        assert m.generate(texts[0], max_tokens=48, temperature=0.8, seed=9).tokens == sampled
