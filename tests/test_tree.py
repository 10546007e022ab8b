"""DDTree tree verification (../shared/reference/dflash-algorithm.md §5): one batched target evaluation of a
tree of drafts, in which every node sees only its ancestors (on Qwen3.5 also through the conv window and the
gated-delta-net state, which follow parent links; on Qwen3.5 MoE every node is also routed to its own experts),
and the commit of any accepted path: KV rows compacted to consecutive slots and the recurrent state of the path's
last node, with no replay.

References: transformers run on each node's own path (logits, KV cache, recurrent and conv state), a fresh
session fed only the accepted tokens (hundreds of random rounds, no drift), and the DDTree construction
written here from the paper's description."""

from __future__ import annotations

import heapq
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import make_qwen3_shape, make_qwen35_shape, make_qwen35moe_shape  # noqa: E402

from pydflash import _core  # noqa: E402
from pydflash.convert import convert_hf_to_gguf  # noqa: E402

PROMPT = [3, 17, 200, 45, 9, 311, 77, 5, 128, 64, 400, 12]
TOL = 1e-4  # f32 weights and cache, relative to the largest |value|
TARGETS = {
    # name: (arch, shape)
    "qwen3": ("qwen3", "gqa4x2_hd64"),
    "qwen35": ("qwen35", "k2v4_hd32"),
    "qwen35_gdn_last": ("qwen35", "k8v32_hd8"),  # 5 layers: the last one is a gated delta net
    "qwen35moe": ("qwen35moe", "x8k4"),  # the hybrid with a routed FFN: every node routed on its own
}
MAKERS = {"qwen3": make_qwen3_shape, "qwen35": make_qwen35_shape, "qwen35moe": make_qwen35moe_shape}


@pytest.fixture(scope="module", params=sorted(TARGETS))
def target(request, tmp_path_factory):
    arch, shape = TARGETS[request.param]
    d = MAKERS[arch](tmp_path_factory.mktemp(request.param) / "hf", shape, seed=11)
    path = convert_hf_to_gguf(d, d.parent / "model-f32.gguf", outtype="f32", progress=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return _core.Model(str(path)), ref


def session(model, n_rollback=64):
    return _core.Session(model, n_ctx=512, type_k="f32", type_v="f32", n_rollback=n_rollback)


def random_tree(rng, n_nodes, max_depth, n_vocab):
    """[root, nodes...] with parents before children; siblings carry distinct tokens."""
    parents, depth, tokens = [-1], [0], [int(rng.integers(n_vocab))]
    while len(parents) < n_nodes:
        p = int(rng.integers(len(parents)))
        if depth[p] >= max_depth:
            continue
        taken = {tokens[i] for i in range(len(parents)) if parents[i] == p}
        tok = int(rng.integers(n_vocab))
        if tok in taken:
            continue
        parents.append(p)
        depth.append(depth[p] + 1)
        tokens.append(tok)
    return tokens, parents, depth


def path_to(parents, i):
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def close(a, b, tol=TOL):
    scale = max(float(np.abs(b).max()), 1e-6)
    return float(np.abs(np.asarray(a) - np.asarray(b)).max()) <= tol * scale


def hf_run(ref, tokens):
    with torch.no_grad():
        return ref(torch.tensor([tokens]), use_cache=True)


def assert_nodes_match_transformers(model, ref, tokens, parents):
    """One tree evaluation after PROMPT: each node's logits equal transformers' on the node's own path."""
    s = session(model)
    s.eval(np.array(PROMPT, dtype=np.int32))
    s.commit(len(PROMPT))
    logits, _ = s.eval(np.array(tokens, dtype=np.int32), parents=np.array(parents, dtype=np.int32))
    for i in range(len(tokens)):
        theirs = hf_run(ref, PROMPT + [tokens[j] for j in path_to(parents, i)]).logits[0, -1].numpy()
        assert close(logits[i], theirs), i


def test_tree_logits_match_transformers_per_node(target):
    model, ref = target
    tokens, parents, _ = random_tree(np.random.default_rng(0), 24, 6, model.n_vocab)
    assert_nodes_match_transformers(model, ref, tokens, parents)


def test_last_row_of_a_tree_is_the_last_batch_row(target):
    """Reading only the last row (as prefill does) gives batch row n-1's logits, however a recurrent target
    orders the nodes inside the evaluation (depth by depth)."""
    model, ref = target
    tokens, parents = [40, 41, 42, 43, 44], [-1, 0, 1, 2, 0]  # row 4 (depth 1) is not the deepest
    s = session(model)
    s.eval(np.array(PROMPT, dtype=np.int32))
    s.commit(len(PROMPT))
    last, _ = s.eval(np.array(tokens, dtype=np.int32), parents=np.array(parents, dtype=np.int32), all_logits=False)
    assert last.shape[0] == 1
    theirs = hf_run(ref, PROMPT + [tokens[j] for j in path_to(parents, 4)]).logits[0, -1].numpy()
    assert close(last[0], theirs)


def test_forest_rows_start_from_the_committed_state(target):
    """Several depth-0 rows (parent -1) each continue the committed past on their own."""
    model, ref = target
    assert_nodes_match_transformers(model, ref, [40, 41, 42, 43, 44], [-1, -1, 0, 1, 3])


def hf_state(ref, out, n_layer):
    """transformers' cache as ours reads it: per attention layer K, V [T, Hkv*hd]; per recurrent layer the
    state [Hv, S_v, S_k] (ours keeps each head's matrix transposed) and the last d_conv-1 conv inputs [W, C],
    value heads in GGUF order (the converter's grouped -> tiled reorder)."""
    cfg = ref.config.get_text_config()
    cache = out.past_key_values
    k, v, ssm, conv = [], [], [], []
    for il in range(n_layer):
        layer = cache.layers[il]
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            k.append(layer.keys[0].permute(1, 0, 2).reshape(layer.keys.shape[2], -1).numpy())
            v.append(layer.values[0].permute(1, 0, 2).reshape(layer.values.shape[2], -1).numpy())
            continue
        from pydflash.convert.qwen35 import reorder_v_heads

        nk, nv, hd = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
        state = cache.get_recurrent_state(il)[0].transpose(-1, -2).numpy()  # [Hv, S_v, S_k]
        ssm.append(reorder_v_heads(state, 0, nk, nv // nk, 1))
        window = cache.get_conv_state(il)[0, :, 1:].numpy()  # [C, W]: the last d_conv-1 inputs
        qk = 2 * nk * cfg.linear_key_head_dim
        window = np.concatenate([window[:qk], reorder_v_heads(window[qk:], 0, nk, nv // nk, hd)])
        conv.append(window.T)
    return k, v, ssm, conv


@pytest.mark.parametrize("seed", [1, 2])
def test_commit_of_any_path_equals_transformers(target, seed):
    """After committing a path (leaves and inner nodes, reached through any sibling), the session's KV rows,
    recurrent and conv state and its next logits equal transformers' on prefix + path."""
    model, ref = target
    rng = np.random.default_rng(seed)
    tokens, parents, depth = random_tree(rng, 20, 5, model.n_vocab)
    chosen = sorted({int(i) for i in rng.choice(len(tokens), 6, replace=False)} | {max(range(len(tokens)),
                                                                                      key=lambda i: depth[i])})
    for node in chosen:
        rows = path_to(parents, node)
        s = session(model)
        s.eval(np.array(PROMPT, dtype=np.int32))
        s.commit(len(PROMPT))
        s.eval(np.array(tokens, dtype=np.int32), parents=np.array(parents, dtype=np.int32))
        s.commit(rows)
        assert s.n_past == len(PROMPT) + len(rows)
        kept = PROMPT + [tokens[j] for j in rows]
        assert s.tokens == kept
        ours = s.read_state()
        k, v, ssm, conv = hf_state(ref, hf_run(ref, kept), model.n_layer)
        for a, b in zip(ours["k"], k):
            assert close(a.view(np.float32), b), node
        for a, b in zip(ours["v"], v):
            assert close(a.view(np.float32), b), node
        for a, b in zip(ours["ssm"], ssm):
            assert close(a, b.reshape(-1)), node
        for a, b in zip(ours["conv"], conv):
            assert close(a, b), node
        # the next token from the committed state (8-wide gated-delta-net heads carry batched-vs-single
        # rounding into it: measured up to 2.6e-4 on k8v32_hd8, as in test_qwen35)
        nxt, _ = s.eval(np.array([7], dtype=np.int32))
        assert close(nxt[0], hf_run(ref, kept + [7]).logits[0, -1].numpy(), 3 * TOL), node


def test_injected_trees_commit_like_a_fresh_session_without_drift(target):
    """300 rounds of random trees (up to 24 nodes, paths through any sibling at every depth), each committing a
    random root path: the logits of the kept nodes, the KV rows and the recurrent/conv state equal a session
    that was only ever fed the kept tokens, and the difference does not grow with the rounds."""
    model, _ = target
    rng = np.random.default_rng(3)
    spec, plain = session(model), session(model)
    for s in (spec, plain):
        s.eval(np.array(PROMPT[:4], dtype=np.int32))
        s.commit(4)
    errors, non_first = [], 0
    for _ in range(300):
        if spec.n_past > 480:
            break
        n = int(rng.integers(1, 25))
        tokens, parents, depth = random_tree(rng, n, 8, model.n_vocab)
        logits, _ = spec.eval(np.array(tokens, dtype=np.int32), parents=np.array(parents, dtype=np.int32))
        rows = path_to(parents, int(rng.integers(n)))
        non_first += any(parents[r] == parents[r - 1] for r in rows[1:] if r > 0)
        spec.commit(rows)
        expected, _ = plain.eval(np.array([tokens[r] for r in rows], dtype=np.int32))
        plain.commit(len(rows))
        scale = np.abs(expected).max()
        errors.append(max(np.abs(logits[r] - expected[j]).max() for j, r in enumerate(rows)) / scale)
        a, b = spec.read_state(), plain.read_state()
        for x, y in zip(a["k"] + a["v"], b["k"] + b["v"]):
            errors[-1] = max(errors[-1], np.abs(x.view(np.float32) - y.view(np.float32)).max() /
                             max(np.abs(y.view(np.float32)).max(), 1e-6))
        for x, y in zip(a["ssm"] + a["conv"], b["ssm"] + b["conv"]):
            errors[-1] = max(errors[-1], np.abs(x - y).max() / max(np.abs(y).max(), 1e-6))
    assert spec.n_past == plain.n_past and spec.tokens == plain.tokens
    assert non_first > 20  # acceptance through siblings that were not the first child
    # a batched tree and single chains round differently (matmul kernels), and a gated delta net carries that in
    # its state (as in test_qwen35's many-rollbacks test); a commit bug is O(1), drift would grow with the rounds
    errors = np.array(errors)
    assert errors.max() <= 5 * TOL, errors.max()
    assert errors[-50:].max() <= 2 * errors[:50].max() + 1e-5, (errors[:50].max(), errors[-50:].max())


def test_tree_and_commit_errors(target):
    model, _ = target
    s = session(model, n_rollback=8)
    s.eval(np.array(PROMPT[:4], dtype=np.int32))
    s.commit(4)
    toks = np.array([1, 2, 3], dtype=np.int32)
    with pytest.raises(ValueError, match=r"parents\[1\] = 1; a parent must be an earlier row or -1"):
        s.eval(toks, parents=np.array([-1, 1, 0], dtype=np.int32))
    with pytest.raises(ValueError, match="a mask or parents, not both"):
        s.eval(toks, parents=np.array([-1, 0, 0], dtype=np.int32), mask=np.ones((3, 3), dtype=np.uint8))
    # rows whose positions continue the past but that do not form a path: a recurrent model follows parents
    # (row 2 hangs below row 1, not row 0), an attention-only one needs increasing rows
    if model.is_recurrent:
        s.eval(toks, parents=np.array([-1, -1, 1], dtype=np.int32))
        bad = [0, 2]
    else:
        s.eval(toks, positions=np.array([4, 6, 5], dtype=np.int32), mask=np.tril(np.ones((3, 3), dtype=np.uint8)))
        bad = [0, 2, 1]
    with pytest.raises(ValueError, match="path from a depth-0 row"):
        s.commit(bad)
    # rows evaluated as a tree hold for a path only, on any target: row 2 hangs below row 0, not row 1
    s.eval(np.array([1, 2, 3, 4], dtype=np.int32), parents=np.array([-1, 0, 0, 2], dtype=np.int32))
    with pytest.raises(ValueError, match="path from a depth-0 row"):
        s.commit([0, 1, 3])
    s.eval(toks, parents=np.array([-1, 0, 0], dtype=np.int32))
    with pytest.raises(ValueError, match="would be committed at"):
        s.commit([1])  # a depth-1 node cannot be the first committed token
    with pytest.raises(IndexError, match="outside the last eval"):
        s.commit([0, 7])
    s.commit([0, 2])
    assert s.tokens[-2:] == [1, 3]
    if model.is_recurrent:
        with pytest.raises(ValueError, match="a recurrent model's batch is a chain or a tree"):
            s.eval(toks, mask=np.ones((3, 3), dtype=np.uint8))
        big = np.arange(1, 11, dtype=np.int32)
        with pytest.raises(ValueError, match="a tree of 10 nodes needs n_rollback >= 10"):
            s.eval(big, parents=np.array([-1] + [0] * 9, dtype=np.int32))


# ---- the tree the loop verifies: DDTree's best-first construction, written here from the paper ----

def ddtree_reference(ids, logprobs, budget, max_depth):
    """DDTree (arXiv:2604.12989, §5.2 of the algorithm reference): the `budget` prefixes of highest
    Q = prod of per-position marginals, found best first; returns the chosen (depth, rank path) prefixes in order."""
    depth_limit = min(max_depth, len(ids))
    heap = [(-logprobs[0][0], 1, (0,))]
    chosen = []
    while heap and len(chosen) < budget:
        neg, d, ranks = heapq.heappop(heap)
        chosen.append((-neg, ranks))
        r = ranks[-1]
        if r + 1 < len(ids[d - 1]):  # next sibling
            heapq.heappush(heap, (neg + logprobs[d - 1][r] - logprobs[d - 1][r + 1], d, ranks[:-1] + (r + 1,)))
        if d < depth_limit:  # first child
            heapq.heappush(heap, (neg - logprobs[d][0], d + 1, ranks + (0,)))
    return chosen


@pytest.mark.parametrize("budget,max_depth,k", [(1, 15, 8), (4, 15, 8), (15, 15, 1), (32, 15, 8), (63, 15, 8),
                                                (63, 3, 8), (10, 15, 2)])
def test_tree_construction_equals_the_ddtree_reference(budget, max_depth, k):
    rng = np.random.default_rng(budget * 31 + max_depth + k)
    n_pos, vocab = 15, 50
    ids = np.stack([rng.choice(vocab, k, replace=False) for _ in range(n_pos)]).astype(np.int32)
    raw = rng.normal(size=(n_pos, vocab)) * rng.uniform(0.5, 4.0, size=(n_pos, 1))
    lse = np.log(np.exp(raw).sum(1))
    lps = np.sort(raw, axis=1)[:, ::-1][:, :k] - lse[:, None]  # most likely first
    tokens, parents, depth, logq = _core.build_draft_tree(ids, lps.astype(np.float32), 999, budget, max_depth)
    ref = ddtree_reference(ids.tolist(), lps.tolist(), budget, max_depth)
    assert len(tokens) == 1 + len(ref) and tokens[0] == 999 and parents[0] == -1
    # the same prefixes (as rank paths), each with its Q, in the same order
    ranks_of = {0: ()}
    for i in range(1, len(tokens)):
        p = parents[i]
        assert p < i
        d = depth[i]
        r = list(ids[d - 1]).index(tokens[i])
        ranks_of[i] = ranks_of[p] + (r,)
        assert ranks_of[i] == ref[i - 1][1], i
        assert math.isclose(logq[i], ref[i - 1][0], rel_tol=1e-5, abs_tol=1e-5)


def test_chain_seed_takes_the_top1_chain_first():
    rng = np.random.default_rng(5)
    ids = np.stack([rng.choice(100, 8, replace=False) for _ in range(15)]).astype(np.int32)
    lps = np.sort(np.log(rng.dirichlet(np.ones(100) * 0.3, size=15)), axis=1)[:, ::-1][:, :8].astype(np.float32)
    tokens, parents, depth, _ = _core.build_draft_tree(ids, lps, 7, 24, 15, seed="chain")
    assert tokens[1:16] == ids[:, 0].tolist() and parents[:16] == list(range(-1, 15))
    assert len(tokens) == 25 and all(parents[i] < i for i in range(1, 25))
    short, _, _, _ = _core.build_draft_tree(ids, lps, 7, 5, 15, seed="chain")
    assert short[1:] == ids[:5, 0].tolist()  # a budget below the depth: the chain, cut
