"""n-gram (prompt lookup) drafting (decode/ngram_index.h, decode/ngram_proposer.h): the continuations it proposes on
hand-made contexts, and generation with it that commits exactly what plain decoding does."""

from __future__ import annotations

import pytest

import pydflash
from export_pairs import pair_file, prompt_rows
from pydflash import _core


@pytest.mark.parametrize("tokens,anchor,depth,kw,expected", [
    # the longest suffix that occurred before wins: "1 2 3" was followed by "4", then the suffix itself, which
    # repeats with the period the match implies
    ([1, 2, 3, 4, 1, 2], 3, 6, {}, [([4, 1, 2, 3, 4, 1], 3)]),
    # a run of one token: a match overlapping the suffix, period 1
    ([9, 1, 1, 1], 1, 5, {}, [([1, 1, 1, 1, 1], 3)]),
    # most recent occurrence first; distinct continuations of the same suffix
    ([1, 2, 1, 3], 1, 4, dict(n_max=1), [([3, 1, 3, 1], 1), ([2, 1, 3, 1], 1)]),
    # longer matches before shorter ones; a shorter one that repeats a longer one's continuation is dropped
    ([1, 2, 7, 5, 2, 8, 1], 2, 4, {}, [([7, 5, 2, 8], 2), ([8, 1, 2, 8], 1)]),
    # only suffixes of at least n_min tokens
    ([1, 2, 7, 5, 2, 8, 1], 2, 4, dict(n_min=2), [([7, 5, 2, 8], 2)]),
    # at most max_candidates
    ([1, 2, 1, 3, 1, 4], 1, 2, dict(n_max=1, max_candidates=2), [([4, 1], 1), ([3, 1], 1)]),
    # nothing occurred before: no draft
    ([1, 2, 3], 9, 4, {}, []),
    ([], 5, 4, {}, []),
])
def test_candidates_on_hand_made_contexts(tokens, anchor, depth, kw, expected):
    assert [(list(t), n) for t, n in _core.ngram_candidates(tokens, anchor, depth, **kw)] == expected


def test_bad_lookup_parameters():
    with pytest.raises(ValueError, match="n_min = 3, n_max = 2"):
        _core.ngram_candidates([1, 2], 1, 4, n_min=3, n_max=2)
    with pytest.raises(ValueError, match="block_size"):
        _core.NgramDrafter(block_size=1)


def _repetitive_prompt() -> str:
    text = prompt_rows("code")[0]["text"]
    return text + text[:300]  # the continuation repeats what the prompt holds


@pytest.mark.parametrize("kind", ["qwen3", "qwen35"])
@pytest.mark.parametrize("mode", ["chain", "tree", "auto"])
def test_ngram_speculation_is_lossless(kind, mode):
    """Greedy and sampled (one seed) output equal to plain decoding's; and the lookup drafts and is accepted on a
    prompt that repeats itself (a test that would pass with no drafting at all proves nothing)."""
    target = pair_file(kind, "target", "q8_0")
    text = _repetitive_prompt()
    with pydflash.Model(target, n_ctx=2048) as plain:
        greedy = plain.generate(text, max_tokens=64).tokens
        sampled = plain.generate(text, max_tokens=64, temperature=0.8, seed=7).tokens
    with pydflash.Model(target, n_ctx=2048, proposers=("ngram",), spec_mode=mode) as m:
        assert m.proposers == ("ngram",) and m.block_size == 8
        c = m.generate(text, max_tokens=64)
        assert c.tokens == greedy
        assert m.generate(text, max_tokens=64, temperature=0.8, seed=7).tokens == sampled
        assert m.generate(text, max_tokens=64, speculative=False).tokens == greedy
    if mode != "auto":  # (auto may find drafting does not pay on a model this small)
        assert c.timings["draft_n_accepted"] > 0, c.timings


def test_proposers_checked():
    target, draft = pair_file("qwen3", "target", "q8_0"), pair_file("qwen3", "dflash", "q8_0")
    with pytest.raises(ValueError, match=r"proposers=\('ngram',\) drafts by n-gram lookup, without the drafter"):
        pydflash.Model(target, draft_model_path=draft, proposers=("ngram",))
    with pytest.raises(ValueError, match=r"needs a DFlash drafter: draft_model_path"):
        pydflash.Model(target, proposers=("dflash",))
    with pytest.raises(ValueError, match=r"needs a DFlash drafter: draft_model_path"):
        pydflash.Model(target, proposers=("ngram", "dflash"))
    with pytest.raises(ValueError, match="merges both into one tree, which spec_mode='auto' cuts"):
        pydflash.Model(target, draft_model_path=draft, proposers=("dflash", "ngram"), spec_mode="chain")
    with pytest.raises(ValueError, match="'eagle' is not one of dflash, ngram, mtp"):
        pydflash.Model(target, proposers=("eagle",))
    with pytest.raises(TypeError, match="proposers must be a tuple"):
        pydflash.Model(target, proposers="ngram")
    with pydflash.Model(target, proposers=("ngram",), block_size=4, spec_mode="chain") as m:
        assert m.block_size == 4 and m.tree_budget == 3
    with pydflash.Model(target, draft_model_path=draft) as m:
        assert m.proposers == ("dflash",)
    with pydflash.Model(target, draft_model_path=draft, proposers=("ngram", "dflash")) as m:
        assert m.proposers == ("dflash", "ngram") and m.block_size == 16
    with pydflash.Model(target) as m:
        assert m.proposers == () and m.block_size is None


@pytest.mark.parametrize("kind", ["qwen3", "qwen35"])
def test_drafter_and_lookup_in_one_tree_is_lossless(kind):
    """auto over the DFlash drafter's candidates and the lookup's merged in one tree (decode/union_proposer.h):
    greedy and sampled output equal to plain decoding's, on a prompt that repeats itself and on one that does
    not; the lookup's nodes are verified and accepted."""
    target, draft = pair_file(kind, "target", "q8_0"), pair_file(kind, "dflash", "q8_0")
    prompts = [_repetitive_prompt(), prompt_rows("code")[3]["text"]]
    with pydflash.Model(target, n_ctx=2048) as plain:
        greedy = [plain.generate(p, max_tokens=64).tokens for p in prompts]
        sampled = [plain.generate(p, max_tokens=64, temperature=0.8, seed=3).tokens for p in prompts]
    with pydflash.Model(target, draft_model_path=draft, n_ctx=2048, proposers=("dflash", "ngram")) as m:
        for p, g, smp in zip(prompts, greedy, sampled):
            c = m.generate(p, max_tokens=64)
            assert c.tokens == g and c.timings["proposer"] == "dflash+ngram"
            assert m.generate(p, max_tokens=64, temperature=0.8, seed=3).tokens == smp
            # what each proposer put in the verified trees and got accepted (a node both proposed counts for both)
            by = c.timings["by_proposer"]
            assert sum(v["drafted"] for v in by.values()) >= c.timings["draft_n"] >= max(v["drafted"]
                                                                                          for v in by.values())
            assert sum(v["accepted"] for v in by.values()) >= c.timings["draft_n_accepted"]
            assert all(v["accepted"] <= v["drafted"] and v["rounds"] <= c.timings["n_rounds"] for v in by.values())
        # the lookup alone, through the same session's index: its drafts are accepted on the repeating prompt
        lookup = m._session.generate(m.tokenize(prompts[0]), max_tokens=64, stop_tokens=[], ngram=m._ngram,
                                     spec_mode="chain")
        assert lookup["tokens"] == greedy[0] and lookup["timings"]["draft_n_accepted"] > 0


@pytest.mark.parametrize("tokens,expected", [
    ([4, 9, 9, 2], 9),
    ([5, 7, 7, 5, 1], 7),  # a tie: the earliest to reach the count
    ([3], 3),
    ([], -1),
])
def test_the_guess_where_nothing_matches_is_the_most_frequent_token(tokens, expected):
    assert _core.ngram_guess(tokens) == expected


@pytest.mark.parametrize("kind", ["qwen3", "qwen35"])
@pytest.mark.parametrize("one_row_ms,two_rows_ms,first_width", [(20.0, 10.0, 2), (10.0, 20.0, 1)])
def test_auto_verifies_a_guess_where_nothing_matches_when_two_rows_cost_less(kind, one_row_ms, two_rows_ms,
                                                                           first_width):
    """A round whose context holds no earlier occurrence of its anchor: auto verifies a guess (the context's most
    frequent token) when a 2-row evaluation is measured to cost less than a plain step (the benchmarks' inflated
    Q8_0 targets on ggml's CPU kernels: 20 ms for one row, 12.7 for two) and decodes plainly when it costs more;
    the output is plain decoding's either way."""
    target = pair_file(kind, "target", "q8_0")
    text = "def area(radius):\n    return"
    with pydflash.Model(target, n_ctx=512) as plain:
        prompt = list(plain.tokenize(text))
        greedy = plain.generate(text, max_tokens=24).tokens
        assert greedy[0] not in prompt  # the first round's anchor: the lookup finds no match
        sampled = plain.generate(text, max_tokens=24, temperature=0.8, seed=7).tokens
    with pydflash.Model(target, n_ctx=512, proposers=("ngram",), spec_mode="auto") as m:
        m._ngram.restore_costs({1: one_row_ms, 2: two_rows_ms, 4: 22.0, 8: 24.0, 16: 30.0}, {})
        _core.traced_rounds()
        _core.trace_rounds(True)
        try:
            c = m.generate(text, max_tokens=24)
            rounds = _core.traced_rounds()
            m._ngram.restore_costs({1: one_row_ms, 2: two_rows_ms, 4: 22.0, 8: 24.0, 16: 30.0}, {})
            assert m.generate(text, max_tokens=24, temperature=0.8, seed=7).tokens == sampled
        finally:
            _core.trace_rounds(False)
    assert c.tokens == greedy
    assert rounds[0]["width"] == first_width and rounds[0]["drafted"], rounds[0]  # (drafted: the guess, cut or not)
