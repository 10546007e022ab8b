"""The committed trained pairs (tools/train_pairs.py -> tools/export_pairs.py): our engine's acceptance equals
the reference loop's (tools/dflash_ref.py on the PyTorch weights, recorded in tests/data/pairs/reference.json),
speculative output stays identical to plain decoding on f16 and q8_0 weights, and stop tokens / max_tokens
that fall inside an accepted block end generation at the right token."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import pydflash
from pydflash.demo import demo_paths
from pydflash.model import _timings

from export_pairs import PAIRS_DIR, pair_file, prompt_rows
from near_ties import TIE, first_difference, tie_gap

REFERENCE = json.loads((PAIRS_DIR / "reference.json").read_text())
KINDS = sorted(REFERENCE["results"])
GENRES = ("code", "prose")
# issue 3: mean acceptance length of the reference loop on held-out code, greedy, block 16 (the MoE pairs of issue
# 24: what their training reached, 2.74 and 5.95, with a margin)
TAU_CODE_MIN = {"qwen3": 4.0, "qwen35": 3.0, "qwen3moe": 2.5, "qwen35moe": 4.5}
# the MoE pairs are committed in q8_0 only (32 experts make an f32 target of ~25 MB)
COMMITTED = {kind: [t for t in ("f32", "f16", "q8_0") if pair_file(kind, "target", t).exists()] for kind in KINDS}


def pair_of(kind: str, outtype: str) -> tuple:
    """(target, drafter) of `kind` in `outtype`, or in the pair's finest committed type where that one is not."""
    if outtype not in COMMITTED[kind]:
        outtype = COMMITTED[kind][0]
    return pair_file(kind, "target", outtype), pair_file(kind, "dflash", outtype)


def pair_model(kind: str, outtype: str, **options) -> pydflash.Model:
    target, draft = pair_of(kind, outtype)
    return pydflash.Model(target, draft_model_path=draft, **options)


def prompts(genre: str) -> dict[str, str]:
    return {r["id"]: r["text"] for r in prompt_rows(genre)}


@pytest.fixture(scope="module", params=KINDS)
def kind(request):
    return request.param


def test_reference_fixtures_clear_the_thresholds(kind):
    """What the fixtures issue asks of the trained pairs, as measured by the reference loop: tau on code, and
    DFlash clearly beating a prompt-lookup drafter there (the targets' continuations are not dominated by
    loops). Prose is kept as it came out (lower, about even with lookup: see docs/benchmarks.md, "The trained
    pairs' acceptance")."""
    res = REFERENCE["results"][kind]
    assert res["code"]["tau_dflash"] >= TAU_CODE_MIN[kind]
    assert res["code"]["tau_dflash"] > 1.25 * res["code"]["tau_lookup"], res["code"]
    for genre in GENRES:
        assert all(p["dflash_equals_greedy"] for p in res[genre]["per_prompt"])


@pytest.mark.parametrize("genre", GENRES)
def test_tau_equals_the_reference_loop(kind, genre):
    """f32 pair, block 16, the reference's prompts and length: same greedy tokens as transformers, and the same
    acceptance length per prompt (rounds end the same way), so the same tau."""
    if "f32" not in COMMITTED[kind]:
        pytest.skip(f"{kind} is committed in q8_0 only: test_q8_0_tau_is_the_reference_loop_s")
    res = REFERENCE["results"][kind][genre]
    texts = prompts(genre)
    n_tokens = REFERENCE["eval_tokens"]
    ours_lengths, ref_lengths, differing, n_rounds_total = [], [], [], [0, 0]
    with pydflash.Model(pair_file(kind, "target", "f32"), draft_model_path=pair_file(kind, "dflash", "f32"),
                        n_ctx=1024) as m:
        assert m.block_size == REFERENCE["block_size"]
        (eot,) = m.tokenize("<|endoftext|>", add_special=False, parse_special=True)
        for row in res["per_prompt"]:
            ids = m.tokenize(texts[row["id"]], add_special=False)
            r = m._session.generate(ids, max_tokens=n_tokens, stop_tokens=[eot], draft=m._draft, spec_mode="chain")
            c = _timings(r["timings"])
            ref = row["greedy_tokens"]
            if ref and ref[-1] == eot:
                ref = ref[:-1]  # the reference keeps the end-of-text token it stopped at; ours does not
            if r["tokens"] != ref:
                # f32 GGUF vs f32 PyTorch (and, for qwen35, a recurrent vs a chunked delta rule): a different
                # greedy token only at a near-tie
                k = first_difference(r["tokens"], ref)
                assert tie_gap(m, ids, r["tokens"], ref, k) < TIE, (row["id"], k)
                differing.append(row["id"])
                continue
            ours_lengths.append(c["draft_n_accepted"] + c["n_rounds"])
            ref_lengths.append(sum(row["accept_lengths"]))
            assert c["n_rounds"] == len(row["accept_lengths"]), row["id"]
            n_rounds_total[0] += c["n_rounds"]
            n_rounds_total[1] += len(row["accept_lengths"])
            assert c["tau"] == pytest.approx(row["tau_dflash"], abs=5e-3), row["id"]
    print(f"{kind} {genre}: tau ours {sum(ours_lengths) / n_rounds_total[0]:.3f}, reference "
          f"{sum(ref_lengths) / n_rounds_total[1]:.3f} over {len(ours_lengths)} prompts; {len(differing)} "
          f"prompts part at a near-tie: {differing}")
    assert len(differing) <= len(res["per_prompt"]) // 4, differing
    assert sum(ours_lengths) == sum(ref_lengths)


@pytest.mark.parametrize("genre", GENRES)
def test_q8_0_tau_is_the_reference_loop_s(kind, genre):
    """The q8_0-only pairs (MoE): q8_0 weights move greedy tokens off the f32 reference's now and then, so the
    acceptance is compared in all (the reference's prompts and length, block 16): within 15% of the reference
    loop's tau on the f32 PyTorch weights. Measured on code: qwen3moe 2.63 against 2.74, qwen35moe 5.43 against
    5.95 (6 prompts; llama.cpp's DFlash on the same files: 2.58 and 5.61)."""
    if "f32" in COMMITTED[kind]:
        pytest.skip("compared token for token in test_tau_equals_the_reference_loop")
    res = REFERENCE["results"][kind][genre]
    texts = prompts(genre)
    committed = rounds = 0
    with pair_model(kind, "q8_0", n_ctx=1024, spec_mode="chain") as m:
        (eot,) = m.tokenize("<|endoftext|>", add_special=False, parse_special=True)
        for row in res["per_prompt"]:
            ids = m.tokenize(texts[row["id"]], add_special=False)
            c = _timings(m._session.generate(ids, max_tokens=REFERENCE["eval_tokens"], stop_tokens=[eot],
                                             draft=m._draft, spec_mode="chain")["timings"])
            committed += c["draft_n_accepted"] + c["n_rounds"]
            rounds += c["n_rounds"]
    print(f"{kind} {genre}: tau ours (q8_0) {committed / rounds:.3f}, reference (f32) {res['tau_dflash']:.3f}")
    assert committed / rounds == pytest.approx(res["tau_dflash"], rel=0.15)


# (spec_mode, tree_budget): the published chain, DDTree's largest tree, and auto's per-round choice
SPEC_MODES = [("chain", None), ("tree", 63), ("auto", None)]


@pytest.mark.parametrize("mode,budget", SPEC_MODES)
@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
def test_speculative_equals_plain_on_committed_pairs(kind, outtype, mode, budget):
    if outtype not in COMMITTED[kind]:
        pytest.skip(f"{kind} is not committed in {outtype}")
    texts = list(prompts("code").values())[:6] + list(prompts("prose").values())[:6]
    with pair_model(kind, outtype, n_ctx=1024, spec_mode=mode, tree_budget=budget) as m:
        taus = []
        ties = 0
        for text in texts:
            spec = m.generate(text, max_tokens=96)
            plain = m.generate(text, max_tokens=96, speculative=False)
            if spec.tokens != plain.tokens:
                k = first_difference(spec.tokens, plain.tokens)
                assert tie_gap(m, m.tokenize(text), spec.tokens, plain.tokens, k) < TIE, (text[:40], k)
                ties += 1
                continue
            assert spec.finish_reason == plain.finish_reason
            if mode != "auto":
                assert spec.timings["n_target_evals"] == spec.timings["n_rounds"]
                taus.append(spec.timings["tau"])
        # each parting was checked above to be a near-tie; with an f16 cache they are not rare on q8_0 weights
        # (measured over 16 prompts x 128 tokens: 3 on the qwen3 pair, 1 with an f32 cache), more so with the
        # 64-token verifies of a tree (here 5 of 12 on the qwen3 pair: wider batches tile the matmuls otherwise)
        print(f"{kind} {outtype} {mode}: {ties} of {len(texts)} part at a near-tie")
        assert ties <= len(texts) // (2 if outtype == "q8_0" else 3)
        if taus:
            assert sum(taus) / len(taus) > 2.0  # trained drafts are accepted, so rollback is exercised mid-block


def test_tree_accepts_more_per_round_than_the_chain(kind):
    """DDTree's point: verifying a tree of 63 drafts commits more tokens per round than the chain of 15 (the
    issues' goals: >= 1.2x on the qwen3 pair, >= 1.1x on qwen35 and qwen35moe; qwen3moe held to 1.1x too), with
    the same output (f32 pairs; on the q8_0-only MoE pairs the outputs may part at near-ties, checked by
    test_speculative_equals_plain_on_committed_pairs). Measured on the MoE pairs: qwen3moe 2.60 -> 4.01 (1.54x),
    qwen35moe 5.14 -> 6.83 (1.33x)."""
    texts = list(prompts("code").values())[:12]
    tau = {}
    outputs = {}
    for mode, budget in (("chain", None), ("tree", 63)):
        with pair_model(kind, "f32", n_ctx=1024, spec_mode=mode, tree_budget=budget) as m:
            runs = [m.generate(text, max_tokens=96) for text in texts]
        outputs[mode] = [r.tokens for r in runs]
        committed = sum(r.timings["draft_n_accepted"] + r.timings["n_rounds"] for r in runs)
        tau[mode] = committed / sum(r.timings["n_rounds"] for r in runs)
    print(f"{kind}: tau chain {tau['chain']:.2f}, tree(63) {tau['tree']:.2f}: {tau['tree'] / tau['chain']:.2f}x")
    if "f32" in COMMITTED[kind]:
        assert outputs["tree"] == outputs["chain"]
    assert tau["tree"] >= {"qwen3": 1.2, "qwen35": 1.1, "qwen3moe": 1.1, "qwen35moe": 1.1}[kind] * tau["chain"]


@pytest.mark.parametrize("mode,budget", [("chain", None), ("tree", 40)])
def test_stop_token_and_max_tokens_inside_accepted_blocks(kind, mode, budget):
    """Stop tokens and max_tokens spread over a generation whose drafts are mostly accepted, so that most of
    them fall inside accepted blocks (chains) or paths (trees): the speculative loop must end exactly where plain
    decoding does."""
    target, draft = pair_of(kind, "f16")
    spec_args = dict(draft=None, spec_mode=mode, tree_budget=budget or 0)
    with pydflash.Model(target, draft_model_path=draft, n_ctx=1024, spec_mode=mode, tree_budget=budget) as m:
        spec_args["draft"] = m._draft
        ids = m.tokenize(list(prompts("code").values())[0], add_special=False)
        full = m._session.generate(ids, max_tokens=96, **spec_args)
        seen = set()
        checked = 0
        for k, tok in enumerate(full["tokens"][1:], start=1):
            if tok in seen or k % 3:
                continue
            seen.add(tok)
            first = full["tokens"].index(tok)
            spec = m._session.generate(ids, max_tokens=96, stop_tokens=[tok], **spec_args)
            plain = m._session.generate(ids, max_tokens=96, stop_tokens=[tok])
            assert spec["tokens"] == plain["tokens"] == full["tokens"][:first]
            assert spec["finish_reason"] == plain["finish_reason"] == "stop"
            checked += 1
        assert checked >= 5
        accepted = full["timings"]["draft_n_accepted"]
        assert accepted > 10  # the blocks above really were accepted drafts
        for n in (1, 2, 5, 17, 18, 31, 50):
            spec = m._session.generate(ids, max_tokens=n, **spec_args)
            assert spec["tokens"] == full["tokens"][:n] and spec["finish_reason"] == "length"


@pytest.mark.parametrize("mode,budget", SPEC_MODES)
def test_small_draft_window_stays_lossless_and_keeps_drafting(kind, mode, budget):
    """A 32-position draft window over a 300-token generation: lossless, and the drafter still works."""
    target, draft = pair_of(kind, "f16")
    text = list(prompts("code").values())[1]
    with pydflash.Model(target, n_ctx=1024) as m:
        plain = m.generate(text, max_tokens=300)
    with pydflash.Model(target, draft_model_path=draft, n_ctx=1024, draft_window=32, n_ubatch=64, spec_mode=mode,
                        tree_budget=budget) as m:
        spec = m.generate(text, max_tokens=300)
        if spec.tokens != plain.tokens:
            # auto's rounds depend on measured times, so which tokens a batched verify decides varies from run to
            # run, and the CPU's kernels round batched and single-token matmuls apart (q8_0 weights, the MoE
            # pairs, in any mode; f16 ones on an AVX2-only EPYC): a parting is allowed at a near-tie only (seen:
            # qwen35 auto at token 149, a gap of 4e-5, and tree 63 there on that EPYC, 3e-5; qwen3moe q8_0 chain
            # at token 40, 5.9e-3)
            k = first_difference(spec.tokens, plain.tokens)
            assert tie_gap(m, m.tokenize(text), spec.tokens, plain.tokens, k) < TIE, k
    if mode != "auto" and "f16" in COMMITTED[kind]:
        assert spec.timings["tau"] > 1.5


@pytest.mark.parametrize("mode,budget", [("chain", None), ("tree", 20)])
def test_acceptance_holds_past_the_draft_window(kind, mode, budget):
    """Past the drafter's window its oldest context rows leave its attention (the feature ring and the draft KV
    cache wrap): acceptance must not collapse. 4 held-out code prompts, 300 tokens each (the context passes the
    32-position window within the prompt): tau with the window keeps at least 60% of the whole context's gain
    over plain decoding (tau - 1). Measured: qwen3 chain 2.58 against 3.26 (70% of the gain), tree 3.56 against
    4.17 (81%); qwen35 chain 4.20 / 4.23 (99%), tree 5.11 / 5.38 (94%); a window of 1 leaves qwen3's chain at
    1.37. The fixed share is what `collapse` means here: a window that broke the drafter's positions or features
    would leave tau near 1."""
    target, draft = pair_of(kind, "f16")
    texts = list(prompts("code").values())[:4]
    tau = {}
    for window in (32, 1024):  # 1024 = n_ctx: the whole context
        with pydflash.Model(target, draft_model_path=draft, n_ctx=1024, draft_window=window, n_ubatch=64,
                            spec_mode=mode, tree_budget=budget) as m:
            assert m._draft.window == window
            runs = [m.generate(text, max_tokens=300).timings for text in texts]
        tau[window] = sum(t["predicted_n"] for t in runs) / sum(t["n_target_evals"] for t in runs)
    assert tau[1024] > 2.0, tau
    assert tau[32] - 1 >= 0.6 * (tau[1024] - 1), tau


def test_demo_model_and_command(tmp_path):
    target, draft = demo_paths()
    assert target.is_file() and draft.is_file()
    with pydflash.Model.demo(n_ctx=512) as m:
        assert m.arch == "qwen3" and m.block_size == 16
        c = m.generate("def main():\n", max_tokens=24)
        assert c.tokens == m.generate("def main():\n", max_tokens=24, speculative=False).tokens
    # outside the source tree, so that the installed package (with its compiled core) is the one imported; the
    # cost-realistic copy of the pair is built into tmp_path (pydflash.convert.inflate, tested in test_inflate)
    out = subprocess.run([sys.executable, "-m", "pydflash.cli", "demo", "-n", "32", "-p", "2", "--cache-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "outputs identical to plain decoding: yes" in out.stdout and "tau" in out.stdout
    assert "at a realistic cost" in out.stdout and (tmp_path / "demo-qwen3-inflated-q8_0.gguf").is_file()
