"""DFlash2 drafters (issue 25): the grouped dynamic causal convolutions around each draft layer's attention and MLP,
and the candidate selector that picks the drafted path among each position's top-k. Reference: z-lab's own
DFlash2DraftModel (dflash 0.1.0, installed --no-deps by the test command), fed the target's features from
transformers, on tiny random drafts (tests/hf_models.py make_dflash2_checkpoint) converted by pydflash-convert
(which matches llama.cpp's converter: tests/test_convert_dflash.py)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dflash = pytest.importorskip("dflash")

from hf_models import make_dflash2_checkpoint, make_qwen3_shape  # noqa: E402

import pydflash  # noqa: E402
from pydflash import _core  # noqa: E402
from pydflash.convert import convert_hf_to_gguf  # noqa: E402
from pydflash.errors import GGUFFormatError  # noqa: E402

PROMPTS = [[5, 9, 33, 100, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], list(range(40, 90))]
SIZES = dict(conv_kernel_size=4, conv_group_size=16, selector_rank=8, selector_top_k=6)


def _pair(root, sizes):
    target_dir = make_qwen3_shape(root / "target", "gqa4x2_hd64", seed=5)
    target = convert_hf_to_gguf(target_dir, root / "target.gguf", outtype="f32", progress=False)
    draft_dir = make_dflash2_checkpoint(root / "draft", target_dir, target_layer_ids=[0], seed=3, weight_std=0.3,
                                        **sizes)
    draft = convert_hf_to_gguf(draft_dir, root / "draft.gguf", outtype="f32", target_model_dir=target_dir,
                               progress=False)
    ref_target = __import__("transformers").AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    ref_draft = dflash.DFlash2DraftModel.from_pretrained(draft_dir, dtype=torch.float32).eval()
    return target, draft, ref_target.eval(), ref_draft


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _pair(tmp_path_factory.mktemp("dflash2"), SIZES)


# odd shapes: a kernel of 1 and of 7 (longer than some blocks' reach), groups of 1, 8 and the whole width, ranks of
# 1 and 5, top-k of 1 (the selector only confirms the argmax) and 13
ODD_SIZES = [dict(conv_kernel_size=1, conv_group_size=128, selector_rank=1, selector_top_k=13),
             dict(conv_kernel_size=7, conv_group_size=1, selector_rank=5, selector_top_k=1),
             dict(conv_kernel_size=3, conv_group_size=8, selector_rank=3, selector_top_k=5)]


@pytest.mark.parametrize("sizes", ODD_SIZES, ids=lambda s: "k{conv_kernel_size}g{conv_group_size}r{selector_rank}"
                                                         "t{selector_top_k}".format(**s))
def test_odd_shapes_draft_zlabs_path_and_candidates(tmp_path, sizes):
    """Kernel, group, rank and top-k sizes unlike the usual ones: the path is z-lab's, and so is each position's
    candidate set (the logits' top-k)."""
    target, draft, ref_target, ref_draft = _pair(tmp_path, sizes)
    for prompt in PROMPTS[:2]:
        path, cand, _, feats, anchor = _reference(ref_target, ref_draft, prompt, 15)
        k = sizes["selector_top_k"]
        ids, _ = _ours(target, draft, feats, anchor, top_k=max(k, 2))
        assert ids[:, 0].tolist() == path
        for t in range(15):
            assert sorted(ids[t, :k].tolist()) == sorted(cand[t])


def _reference(ref_target, ref_draft, prompt, n, *, convs=True):
    """z-lab's drafted path for one block after `prompt` (its propose(), greedy), its candidates per position
    (top-k of the logits) and the plain argmax of the logits, and the inputs our drafter takes."""
    from dflash_ref import extract_features

    with torch.no_grad():
        out = ref_target(torch.tensor([prompt]), output_hidden_states=True)
        feats = extract_features(out.hidden_states, ref_draft.target_layer_ids)
        anchor = int(out.logits[0, -1].argmax())
        block = torch.tensor([[anchor] + [ref_draft.mask_token_id] * n])
        saved = [(l.attention_conv, l.mlp_conv) for l in ref_draft.layers]
        if not convs:
            for l in ref_draft.layers:
                l.attention_conv = l.mlp_conv = None
        try:
            h = ref_draft(position_ids=torch.arange(0, len(prompt) + n + 1)[None],
                          noise_embedding=ref_target.get_input_embeddings()(block), target_hidden=feats)[:, 1:]
        finally:
            for l, (a, m) in zip(ref_draft.layers, saved):
                l.attention_conv, l.mlp_conv = a, m
        path, cand, _ = ref_draft.propose(h, block[:, 0], ref_target.get_output_embeddings(), 0.0)
        logits = ref_draft.compute_logits(h, ref_target.get_output_embeddings())[0]
    return path[0].tolist(), cand[0].tolist(), logits.argmax(-1).tolist(), feats, anchor


def _ours(target, draft, feats, anchor, top_k=1):
    P = feats.shape[1]
    s = _core.DraftSession(_core.Model(str(target)), str(draft), n_ctx=256, top_k=top_k, with_logprobs=top_k > 1)
    return s.draft(feats[0].numpy(), np.arange(P, dtype=np.int32), anchor, P, with_logprobs=top_k > 1)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_drafted_path_is_zlabs(pair, prompt):
    """One block of 15: our proposals are z-lab's propose() path, token for token; the same reference without its
    convolutions, or without its selector (the logits' argmax), drafts another path, so both are being matched."""
    target, draft, ref_target, ref_draft = pair
    path, cand, argmax, feats, anchor = _reference(ref_target, ref_draft, prompt, 15)
    ours = _ours(target, draft, feats, anchor)
    assert list(ours) == path
    no_conv, _, _, _, _ = _reference(ref_target, ref_draft, prompt, 15, convs=False)
    assert no_conv != path and argmax != path


def test_candidates_are_the_selectors(pair):
    """With log-probabilities: each position's candidates are the logits' top-k (z-lab's), the path's token
    first, ordered by the selector's score given the path's previous token, log-probabilities normalised over
    the k."""
    target, draft, ref_target, ref_draft = pair
    path, cand, _, feats, anchor = _reference(ref_target, ref_draft, PROMPTS[2], 15)
    ids, logprobs = _ours(target, draft, feats, anchor, top_k=SIZES["selector_top_k"])
    assert ids.shape == (15, SIZES["selector_top_k"])
    for t in range(15):
        assert sorted(ids[t].tolist()) == sorted(cand[t])
        assert ids[t, 0] == path[t]
        assert np.all(np.diff(logprobs[t]) <= 0)
        assert np.exp(logprobs[t]).sum() == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("mode", ["chain", "tree", "auto"])
def test_dflash2_speculation_is_lossless(pair, mode):
    """A DFlash2 drafter through Model: greedy output equals plain decoding's in every mode, and so does one seed of
    sampling; chain and tree draft,
    and the tree's candidates are accepted now and then (a random drafter's top-1 path seldom is)."""
    target, draft, _, _ = pair
    with pydflash.Model(target, n_ctx=512) as plain:
        expected = [plain.generate(p, max_tokens=40).tokens for p in PROMPTS]
        sampled = plain.generate(PROMPTS[0], max_tokens=40, temperature=0.8, seed=4).tokens
    with pydflash.Model(target, draft_model_path=draft, n_ctx=512, spec_mode=mode) as m:
        drafted = accepted = 0
        for p, e in zip(PROMPTS, expected):
            c = m.generate(p, max_tokens=40)
            assert c.tokens == e
            drafted, accepted = drafted + c.timings["draft_n"], accepted + c.timings["draft_n_accepted"]
        assert m.generate(PROMPTS[0], max_tokens=40, temperature=0.8, seed=4).tokens == sampled
    if mode != "auto":  # (auto may find drafting does not pay with a random drafter)
        assert drafted > 0 and (accepted > 0 or mode == "chain"), (drafted, accepted)


@pytest.mark.parametrize("change, match", [
    (dict(drop_keys=("dflash.selector_top_k",)), r"needs all of .* 'dflash.selector_top_k' is missing"),
    (dict(drop_keys=("dflash.conv_kernel_size", "dflash.conv_group_size", "dflash.selector_rank",
                     "dflash.selector_top_k")), r"tensor 'selector_hidden.weight' is a DFlash2 selector's, but the "
                                                r"file has no dflash.conv_kernel_size"),
    (dict(set_keys={"dflash.conv_group_size": (24, __import__("gguf").GGUFValueType.UINT32)}),
     r"dflash.conv_group_size = 24 does not divide the hidden size 128"),
    (dict(drop_tensors=("blk.1.ffn_conv_base",)), r"blk.1.ffn_conv_base"),
    (dict(drop_tensors=("selector_successor.weight",)), r"selector_successor.weight"),
])
def test_bad_dflash2_files_are_typed_errors(pair, tmp_path, change, match):
    from gguf_edit import rewrite

    target, draft, _, _ = pair
    bad = rewrite(draft, tmp_path / "bad.gguf", **change)
    with pytest.raises(GGUFFormatError, match=match):
        _core.DraftModel(_core.Model(str(target)), str(bad))


def test_a_neutral_dflash2_drafts_as_the_dflash_drafter_it_was_made_from(tmp_path):
    """The trained qwen35 DFlash drafter given identity convolutions and zero selector codebooks
    (tests/gguf_edit.py dflash_to_dflash2): the same tokens and the same acceptance, round for round, in chain
    mode; with small noise on those weights it drafts otherwise (tau moves) and stays lossless."""
    from export_pairs import pair_file, prompt_rows
    from gguf_edit import dflash_to_dflash2

    target, dflash1 = pair_file("qwen35", "target", "f32"), pair_file("qwen35", "dflash", "f32")
    neutral = dflash_to_dflash2(dflash1, tmp_path / "neutral.gguf")
    noisy = dflash_to_dflash2(dflash1, tmp_path / "noisy.gguf", noise=0.02, seed=1)
    texts = [r["text"] for r in prompt_rows("code")[:3]]
    runs = {}
    for name, path in (("dflash", dflash1), ("neutral", neutral), ("noisy", noisy)):
        with pydflash.Model(target, draft_model_path=path, n_ctx=1024, spec_mode="chain") as m:
            runs[name] = [(c.tokens, c.timings["n_rounds"], c.timings["draft_n_accepted"])
                          for c in (m.generate(t, max_tokens=64) for t in texts)]
    assert runs["neutral"] == runs["dflash"]
    assert [r[0] for r in runs["noisy"]] == [r[0] for r in runs["dflash"]]
    assert [r[1:] for r in runs["noisy"]] != [r[1:] for r in runs["dflash"]]


def test_trees_rank_each_nodes_children_given_its_own_token():
    """The tree builder with a selector's conditional ranks, on a hand-made block of two positions: position 0 has
    A (p 0.6) and B (0.4); at position 1, after A the selector ranks C (0.9) before D (0.1), after B D (0.8)
    before C (0.2). Best first by path probability: A 0.6, B 0.4, A-C 0.54, B-D 0.32, A-D 0.06, B-C 0.08."""
    A, B, C, D = 10, 11, 12, 13
    lp = np.log
    ids = np.array([[A, B], [C, D]], dtype=np.int32)  # given the drafted path (A, then C first)
    logprobs = np.array([[lp(0.6), lp(0.4)], [lp(0.9), lp(0.1)]], dtype=np.float32)
    all_ids = ids.copy()
    # [position, previous candidate's rank, r]: the rank at this position of its r-th best
    child_rank = np.array([[[0, 1], [0, 1]], [[0, 1], [1, 0]]], dtype=np.int32)
    child_logprob = np.array([[[lp(0.6), lp(0.4)]] * 2, [[lp(0.9), lp(0.1)], [lp(0.8), lp(0.2)]]], dtype=np.float32)
    tokens, parents, depth, logq = _core.build_draft_tree(ids, logprobs, 1, 6, 2, all_ids=all_ids,
                                                          child_rank=child_rank, child_logprob=child_logprob)
    assert tokens == [1, A, C, B, D, C, D] and parents == [-1, 0, 1, 0, 3, 3, 1]
    np.testing.assert_allclose(np.exp(logq), [1, 0.6, 0.54, 0.4, 0.32, 0.08, 0.06], rtol=1e-6)
    # without them every node's children are ranked as the path's are
    tokens, parents, _, _ = _core.build_draft_tree(ids, logprobs, 1, 6, 2)
    assert tokens == [1, A, C, B, C, D, D] and parents == [-1, 0, 1, 0, 3, 1, 3]


def test_the_training_definition_is_zlabs(pair):
    """tools/dflash_ref.py's DFlash2DraftModel, which tools/train_dflash2.py trains, given z-lab's weights: the same
    block hidden states, and its selector's scores give z-lab's path (so what training learns means the same thing
    to z-lab, llama.cpp and us)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import dflash_ref as R

    target, draft, ref_target, ref_draft = pair
    ours = R.DFlash2DraftModel(ref_draft.config).eval()
    state = {k.replace(".weight", "") if "codebook" in k else k: v for k, v in ref_draft.state_dict().items()
             if not k.startswith("rotary_emb")}
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("rotary_emb") for k in missing), (missing, unexpected)
    prompt, n = PROMPTS[2], 15
    path, _, _, feats, anchor = _reference(ref_target, ref_draft, prompt, n)
    block = torch.tensor([[anchor] + [ref_draft.mask_token_id] * n])
    noise = ref_target.get_input_embeddings()(block)
    positions = torch.arange(0, len(prompt) + n + 1)[None]
    with torch.no_grad():
        theirs = ref_draft(position_ids=positions, noise_embedding=noise, target_hidden=feats)
        mine = ours(noise, feats, positions)
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
        h = mine[:, 1:]
        unary = h @ ref_target.get_output_embeddings().weight.T
        sel, tok = ours.candidate_selector, anchor
        greedy = []
        for t in range(n):
            cand = unary[0, t].topk(sel.top_k).indices
            scores = sel.scores(unary[0, t], h[0, t], torch.tensor(tok), cand)
            tok = int(cand[scores.argmax()])
            greedy.append(tok)
    assert greedy == path


def test_train_dflash2_writes_a_drafter_we_run(tmp_path):
    """tools/train_dflash2.py end to end in miniature (8 sequences, 3 steps): the GGUF it writes loads next to its
    target as a DFlash2 drafter and speculation with it equals plain decoding."""
    import subprocess
    import sys
    from pathlib import Path

    from export_pairs import pair_file

    root = Path(__file__).resolve().parents[1]
    target, template = pair_file("qwen35", "target", "f32"), pair_file("qwen35", "dflash", "f32")
    out = tmp_path / "d2.gguf"
    proc = subprocess.run([sys.executable, str(root / "tools" / "train_dflash2.py"), str(target), str(template),
                           str(out), "--sequences", "8", "--seq-len", "160", "--steps", "3", "--anchors", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = _core.gguf_metadata(str(out), ["dflash.selector_top_k", "dflash.target_layers"])
    assert meta["dflash.selector_top_k"][2] == 8 and list(meta["dflash.target_layers"][2]) == [1, 2, 3]
    with pydflash.Model(target, n_ctx=512) as plain:
        expected = plain.generate(PROMPTS[1], max_tokens=24).tokens
    with pydflash.Model(target, draft_model_path=out, n_ctx=512, spec_mode="chain") as m:
        assert m.generate(PROMPTS[1], max_tokens=24).tokens == expected


@pytest.mark.parametrize("ranking", ["per_node", "path", "unary"])
def test_each_tree_ranking_is_lossless_and_keeps_the_selectors_path(pair, ranking):
    """_core.DraftSession(dflash2_tree=...) (benchmarks/bench_dflash2.py compares them): trees built from each ranking
    decode as plain decoding does, and the drafted path (rank 0 at every position) is the selector's in all three."""
    target, draft, ref_target, ref_draft = pair
    with pydflash.Model(target, n_ctx=512) as plain:
        expected = plain.generate(PROMPTS[2], max_tokens=40).tokens
    with pydflash.Model(target, draft_model_path=draft, n_ctx=512, spec_mode="tree") as m:
        m._draft = _core.DraftSession(m._session, m._draft_model, **{**m._draft_config, "dflash2_tree": ranking})
        assert m.generate(PROMPTS[2], max_tokens=40).tokens == expected
    path, _, _, feats, anchor = _reference(ref_target, ref_draft, PROMPTS[2], 15)
    P = feats.shape[1]
    s = _core.DraftSession(_core.Model(str(target)), str(draft), n_ctx=256, top_k=4, dflash2_tree=ranking)
    ids, _ = s.draft(feats[0].numpy(), np.arange(P, dtype=np.int32), anchor, P, with_logprobs=True)
    assert ids[:, 0].tolist() == path


def test_the_trained_dflash2_drafter_beats_the_dflash_one():
    """The committed DFlash2 drafter of the qwen35 pair (tools/train_dflash2.py, trained as the DFlash one was, plus
    the selector's objective): on held-out code prompts its chain accepts at least 1.15x the committed DFlash
    drafter's tau (measured over 8 prompts x 96 tokens: 9.62 against 6.03), its tree at least its chain's, and
    speculation with it (q8_0, chain / tree / auto) equals plain decoding up to near-ties."""
    from export_pairs import pair_file, prompt_rows
    from near_ties import TIE, first_difference, tie_gap

    target = pair_file("qwen35", "target", "f32")
    texts = [r["text"] for r in prompt_rows("code")[:4]]

    def tau(draft, **options):
        accepted = rounds = 0
        with pydflash.Model(target, draft_model_path=draft, n_ctx=1024, **options) as m:
            for t in texts:
                c = m.generate(t, max_tokens=96).timings
                accepted, rounds = accepted + c["draft_n_accepted"], rounds + c["n_rounds"]
        return (accepted + rounds) / rounds

    dflash2 = pair_file("qwen35", "dflash2", "f32")
    chain1, chain2 = tau(pair_file("qwen35", "dflash", "f32"), spec_mode="chain"), tau(dflash2, spec_mode="chain")
    assert chain2 >= 1.15 * chain1, (chain2, chain1)
    assert tau(dflash2, spec_mode="tree", tree_budget=22) >= chain2
    q8_target, q8_draft = pair_file("qwen35", "target", "q8_0"), pair_file("qwen35", "dflash2", "q8_0")
    with pydflash.Model(q8_target, n_ctx=1024) as plain:
        expected = [plain.generate(t, max_tokens=64).tokens for t in texts]
    for mode in ("chain", "tree", "auto"):
        with pydflash.Model(q8_target, draft_model_path=q8_draft, n_ctx=1024, spec_mode=mode) as m:
            for t, e in list(zip(texts, expected))[:2]:
                got = m.generate(t, max_tokens=64).tokens
                if got != e:
                    k = first_difference(got, e)
                    assert tie_gap(m, m.tokenize(t), got, e, k) < TIE, (mode, t[:30], k)


@pytest.mark.parametrize("kind", ["qwen3moe", "qwen35moe"])
def test_the_moe_targets_dflash2_drafter(kind):
    """The committed MoE pair's DFlash2 drafter (q8_0, tools/train_dflash2.py): speculation with it equals plain
    decoding (chain and tree) and its chain accepts more than the pair's DFlash drafter (measured over 8 prompts x 96
    tokens: qwen35moe 8.26 against 4.84, qwen3moe 4.90
    against 2.48)."""
    from export_pairs import pair_file, prompt_rows
    from near_ties import TIE, first_difference, tie_gap

    target = pair_file(kind, "target", "q8_0")
    texts = [r["text"] for r in prompt_rows("code")[:3]]
    with pydflash.Model(target, n_ctx=1024) as plain:
        expected = [plain.generate(t, max_tokens=64).tokens for t in texts]
    taus = {}
    for role in ("dflash", "dflash2"):
        for mode in ("chain", "tree"):
            accepted = rounds = 0
            with pydflash.Model(target, draft_model_path=pair_file(kind, role, "q8_0"), n_ctx=1024,
                                spec_mode=mode) as m:
                for t, e in zip(texts, expected):
                    c = m.generate(t, max_tokens=64)
                    if c.tokens != e:
                        k = first_difference(c.tokens, e)
                        assert tie_gap(m, m.tokenize(t), c.tokens, e, k) < TIE, (role, mode, k)
                    accepted, rounds = accepted + c.timings["draft_n_accepted"], rounds + c.timings["n_rounds"]
            taus[role, mode] = (accepted + rounds) / rounds
    assert taus["dflash2", "chain"] > 1.15 * taus["dflash", "chain"], taus
