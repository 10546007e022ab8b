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
    widths = set()
    for c, rounds in _generate(True):
        produced = 1
        for r in rounds:
            # (a round near max_tokens is offered fewer nodes than the block: any width is its whole offer)
            if produced + 16 < MAX_TOKENS:
                widths.add(r["width"])
                assert r["width"] & (r["width"] - 1) == 0, r
            produced += r["committed"]
    assert len(widths - {1}) >= 1  # it speculated
