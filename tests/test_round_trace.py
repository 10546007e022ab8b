"""The decode loop's per-round trace (decode/round_trace.h, pydflash._core.trace_rounds) and auto's verify widths
on a GPU (decode/cost_model.h, grid widths), forced here on the CPU: every round auto verifies is a grid width
(1, 2, 4, 8, ...) or everything its proposer offered."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import pydflash
from pydflash import _core

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from export_pairs import pair_file, prompt_rows  # noqa: E402

MAX_TOKENS = 96


@pytest.fixture
def tracing():
    _core.traced_rounds()  # whatever an earlier test left
    _core.trace_rounds(True)
    yield
    _core.trace_rounds(False)
    _core.force_grid_widths(None)
    _core.traced_rounds()


def _generate(grid_widths):
    """auto on the trained qwen3 pair (its drafter's block: 16) over three prompts: [(tokens, rounds)]"""
    _core.force_grid_widths(grid_widths)
    out = []
    with pydflash.Model(pair_file("qwen3", "target", "q8_0"), draft_model_path=pair_file("qwen3", "dflash", "q8_0"),
                        n_ctx=1024, spec_mode="auto") as m:
        for row in prompt_rows("code")[:3]:
            c = m.generate(row["text"], max_tokens=MAX_TOKENS)
            out.append((c, _core.traced_rounds()))
    return out


def test_traced_rounds_account_for_every_token(tracing):
    for c, rounds in _generate(None):
        # the first token comes from the prefill; each round commits its accepted path and a bonus token, the
        # last round up to max_tokens
        assert sum(r["committed"] for r in rounds) >= len(c.tokens) - 1 > sum(r["committed"] for r in rounds[:-1])
        assert len(rounds) == c.timings["n_target_evals"]
        assert all(r["width"] >= 1 and r["verify_ms"] > 0 for r in rounds)
        drafted = [r for r in rounds if r["width"] > 1]
        assert sum(r["width"] for r in drafted) == c.timings["verify_n"]


def test_grid_widths_verify_powers_of_two_or_the_whole_block(tracing):
    # (near max_tokens too: a round there drafts as deep as a grid width allows, decode/stream.cpp depth_cap)
    widths = set()
    for c, rounds in _generate(True):
        for r in rounds:
            widths.add(r["width"])
            assert r["width"] & (r["width"] - 1) == 0, r
        assert len(c.tokens) == MAX_TOKENS
    assert len(widths - {1}) >= 1  # it speculated


def test_a_long_cool_down_captures_features_only_for_its_last_rounds(tracing):
    """auto decoding plainly through a cool-down (as restored from a cost cache where speculation stopped paying)
    evaluates without the drafter's feature capture until its last 256 rounds; the drafter then drafts around the
    skipped positions (DraftSession skip; its drafts against the reference: test_dflash). The output stays plain
    decoding's, the probes' drafts are accepted, and the prompt cache is reused as before."""
    import near_ties

    cool_len, n = 450, 500
    target, draft = pair_file("qwen3", "target", "q8_0"), pair_file("qwen3", "dflash", "q8_0")
    accepted = 0
    with pydflash.Model(target, n_ctx=1024) as plain:
        for row in prompt_rows("code")[:3]:
            prompt = row["text"]
            expected = plain.generate(prompt, max_tokens=n).tokens
            with pydflash.Model(target, draft_model_path=draft, n_ctx=1024, spec_mode="auto") as m:
                # (the widths measured: the probes verify what pays rather than exploring wide trees)
                m._draft.restore_costs({1: 0.2, 2: 0.25, 4: 0.3, 8: 0.4, 16: 0.6}, {}, cool_len=cool_len)
                _core.traced_rounds()  # (plain's)
                c = m.generate(prompt, max_tokens=n)
                rounds = _core.traced_rounds()
                again = m.generate(prompt, max_tokens=8)
            if c.tokens != expected:
                k, tie = near_ties.parts_at_a_near_tie(plain, plain.tokenize(prompt), expected, c.tokens)
                assert tie, f"auto parted from plain decoding at output {k}, not at a near-tie"
            # round k (from 1) sits out with cool_len - k plain rounds still to come; the last 256 capture
            assert not any(r["drafted"] for r in rounds[:cool_len]) and rounds[cool_len]["drafted"]
            assert [r["captured"] for r in rounds[:cool_len]] == [False] * (cool_len - 256) + [True] * 256
            accepted += c.timings["draft_n_accepted"]
            assert again.timings["cached_n"] == len(plain.tokenize(prompt))
    assert accepted > 0


@pytest.mark.parametrize("arch,least", [("qwen3", 7), ("qwen3moe", 3)])
def test_auto_drafts_as_deep_as_its_cuts_reach(tracing, tmp_path, monkeypatch, arch, least):
    """auto alone drafts `least` positions past the anchor first (a DFlash draft's time grows with its positions):
    3, or 7 where the target takes rows in tiles of four (a dense target on the CPU: a block of 4 would offer a
    verify of one tile or none; a MoE target's time grows row by row), then a block of a power of two covering
    twice the depth its last cut kept: where the drafts are accepted (a continuation that repeats the prompt) it
    reaches the drafter's whole block, 15 (on the dense pair); after a round whose cut kept nothing (the drafter's fc scrambled: none
    is accepted, once that is learnt) it drafts `least` again. Either way the output is plain decoding's. On a GPU
    (grid widths) it drafts the whole block."""
    import near_ties
    from gguf_edit import scrambled

    target, draft = pair_file(arch, "target", "q8_0"), pair_file(arch, "dflash", "q8_0")
    useless = scrambled(draft, tmp_path / "useless.gguf", "fc.weight")
    text = prompt_rows("code")[1]["text"]
    prompt = text + text[:300]  # the continuation repeats what the prompt holds
    with pydflash.Model(target, n_ctx=1024) as plain:
        expected = plain.generate(prompt, max_tokens=MAX_TOKENS).tokens
        depths = {}
        for name, drafter in (("trained", draft), ("useless", useless)):
            # (a cost cache of its own: another test's run may have left a cool-down for this pair in the shared
            # one, where speculation stopped paying on this tiny pair)
            monkeypatch.setenv("PYDFLASH_CACHE", str(tmp_path / f"{name}-cache"))
            with pydflash.Model(target, draft_model_path=drafter, n_ctx=1024, spec_mode="auto") as m:
                _core.traced_rounds()
                c = m.generate(prompt, max_tokens=MAX_TOKENS)
                rounds = _core.traced_rounds()
            if c.tokens != expected:
                k, tie = near_ties.parts_at_a_near_tie(plain, plain.tokenize(prompt), expected, c.tokens)
                assert tie, f"auto ({name} drafter) parted from plain decoding at output {k}, not at a near-tie"
            # near max_tokens a round drafts at most the tokens left but one (the prefill gave the first token)
            made = 1
            for r in rounds:
                r["cap"], made = MAX_TOKENS - made - 1, made + r["committed"]
            drafted = [r for r in rounds if r["drafted"]]
            depths[name] = [r["depth"] for r in drafted]
            assert all(r["depth"] == 0 for r in rounds if not r["drafted"])
            assert drafted and drafted[0]["depth"] == least, (name, depths[name])
            assert all(r["depth"] in (least, 7, 15) or r["depth"] == r["cap"] < 15 for r in drafted), (name, drafted)
            # (width 1: the cut kept no draft)
            assert all(b["depth"] == min(least, b["cap"]) for a, b in zip(drafted, drafted[1:]) if a["width"] == 1), \
                (name, drafted)
    if arch == "qwen3":
        # (on the tiny MoE pair a wider verify reads more experts: how deep its cuts go, and so its drafts, follows
        # the costs measured in the run; there only the rule above is checked)
        assert 15 in depths["trained"]
    assert any(r == least for r in depths["useless"][1:]), depths["useless"]
    # with grid widths (a GPU's: decode/cost_model.h) every draft covers the whole block
    monkeypatch.setenv("PYDFLASH_CACHE", str(tmp_path / "grid-widths-cache"))
    _core.force_grid_widths(True)
    with pydflash.Model(target, draft_model_path=draft, n_ctx=1024, spec_mode="auto") as m:
        _core.traced_rounds()
        m.generate(prompt, max_tokens=MAX_TOKENS)
        drafted = [r["depth"] for r in _core.traced_rounds() if r["drafted"]]
    assert drafted and drafted[0] == 15, drafted


@pytest.mark.parametrize("proposer", ["dflash", "mtp"])
def test_traced_depth_of_a_chain(tracing, proposer):
    """A chain verifies every draft: each drafted round's width is its traced depth (the drafter's positions, the
    head's runs) plus the anchor, block_size - 1 of them but near max_tokens."""
    kw = {"draft_model_path": pair_file("qwen35", "dflash", "q8_0")} if proposer == "dflash" else {}
    with pydflash.Model(pair_file("qwen35", "target-mtp", "q8_0"), n_ctx=1024, proposers=(proposer,),
                        spec_mode="chain", block_size=4, **kw) as m:
        _core.traced_rounds()
        m.generate(prompt_rows("code")[0]["text"], max_tokens=48)
        drafted = [r for r in _core.traced_rounds() if r["drafted"]]
    assert drafted and all(r["width"] == r["depth"] + 1 for r in drafted), drafted
    assert all(r["depth"] == 3 for r in drafted[:-2]), drafted


@pytest.mark.parametrize("proposers", [("dflash",), ("mtp",), ("dflash", "ngram", "mtp")])
def test_on_a_gpu_auto_verifies_chains(tracing, tmp_path, monkeypatch, proposers):
    """With grid widths (a GPU's: decode/cost_model.h) auto's proposer offers a chain, never a tree (each tree
    shape is a graph of its own there), merged proposers their best path; without them, on the CPU, the same
    prompts verify trees too: the drafter's (5-7 in 8 prompts) and the merged proposers' (5-9). The head's alone
    are a near thing on this tiny pair, where a tree costs at least the chain of its width and auto drafts in few
    rounds (none in 32 prompts in 3 of 10 runs), so its CPU run is no control; its chains under grid widths are
    the same candidates() the merged run draws on."""
    kw = {"draft_model_path": pair_file("qwen35", "dflash", "q8_0")} if "dflash" in proposers else {}
    rounds = {}
    for grid in (False, True):
        monkeypatch.setenv("PYDFLASH_CACHE", str(tmp_path / f"cache-{grid}"))
        _core.force_grid_widths(grid)
        with pydflash.Model(pair_file("qwen35", "target-mtp", "q8_0"), n_ctx=1024, proposers=proposers,
                            spec_mode="auto", **kw) as m:
            cs = [m.generate(row["text"], max_tokens=MAX_TOKENS) for row in prompt_rows("code")[:8]]
        rounds[grid] = {k: sum(c.timings[f"auto_{k}"] for c in cs) for k in ("chain", "tree")}
    if proposers != ("mtp",):
        assert rounds[False]["tree"] > 0, rounds
    assert rounds[True]["tree"] == 0 and rounds[True]["chain"] > 0, rounds
