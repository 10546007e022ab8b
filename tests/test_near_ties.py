"""The MoE router near-tie helpers of tests/near_ties.py, which the GPU suite's MoE tests rest on (their swaps only
happen on a device): the gap and the swaps on hand-made router logits, and the traced routers of a trained MoE
target on the CPU, batched and in one-token steps."""

from __future__ import annotations

import numpy as np
import pytest

import pydflash
from pydflash import _core

from export_pairs import pair_file, prompt_rows  # noqa: E402
from near_ties import (ROUTER_TIE, TIE, moe_experts, rounding_spread, router_flips, router_gap,  # noqa: E402
                       routing_parts_at_a_tie, stepped_routers, traced_routers)


def test_router_gap_is_the_kth_margin_over_the_largest_logit():
    z = np.array([[4.0, -1.0, 3.0, 2.5],     # sorted 4, 3, 2.5, -1: k=2 gap 0.5, k=1 gap 1
                  [0.5, 0.5, -2.0, 0.1]],    # a tie at k=1 (gap 0); k=2 gap 0.4 over |-2|
                 dtype=np.float32)
    np.testing.assert_allclose(router_gap(z, 2), [0.5 / 4.0, 0.4 / 2.0])
    np.testing.assert_allclose(router_gap(z, 1), [1.0 / 4.0, 0.0])


def test_router_flips_compare_sets_not_order():
    a = {0: np.array([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]]), 1: np.array([[1.0, 0.0, 2.0, 3.0]] * 2)}
    b = {0: np.array([[2.0, 3.0, 1.0, 0.0],    # the same two experts, in the other order: no swap
                      [0.0, 2.5, 2.0, 3.0]]),  # expert 1 in place of expert 2: a swap
         1: np.array([[1.0, 0.0, 2.0, 3.0], [3.5, 0.0, 2.0, 3.0]])}
    assert router_flips(a, b, 2) == [(0, 1), (1, 1)]
    assert router_flips(a, a, 2) == []


@pytest.fixture(scope="module")
def moe_model():
    path = pair_file("qwen35moe", "target", "q8_0")
    with pydflash.Model(path, n_ctx=512, n_threads=2) as m:
        prompt = m.tokenize(prompt_rows("code")[0]["text"])[:40]
        yield m, prompt, m.generate(prompt, max_tokens=12).tokens, moe_experts(path)


def test_traced_routers_batched_and_stepped_agree_on_the_cpu(moe_model):
    """The router logits of every MoE layer, traced in one batch and in committed one-token steps after the
    prompt: one row per token and expert, the same up to the CPU's rounding between batch widths."""
    m, prompt, tokens, (n_expert, k) = moe_model
    sessions = []
    for _ in range(2):
        s = _core.Session(m._model, n_ctx=512)
        s.eval(np.array(prompt, dtype=np.int32), all_logits=False)
        s.commit(len(prompt))
        sessions.append(s)
    logits, batched = traced_routers(sessions[0], tokens)
    stepped = stepped_routers(sessions[1], tokens)
    assert logits.shape[0] == len(tokens) and sorted(batched) == sorted(stepped) == list(range(m._model.n_layer))
    for layer, z in batched.items():
        assert z.shape == stepped[layer].shape == (len(tokens), n_expert)
        assert np.abs(z - stepped[layer]).max() <= 1e-3 * np.abs(z).max()
    # a swap between the two can only be at a near-tie, and the helper finds what this test finds
    swaps = router_flips(batched, stepped, k)
    assert all(router_gap(stepped[layer], k)[t] < ROUTER_TIE for layer, t in swaps)
    assert routing_parts_at_a_tie(m, prompt, tokens, len(tokens), k) is bool(swaps)
    assert routing_parts_at_a_tie(m, prompt, tokens, 0, k) is False  # the first token: the prompt's pass


def test_rounding_spread_of_f32_weights_is_far_below_tie():
    """rounding_spread compares a batched evaluation with one-token steps over the same tokens: with f32 weights
    the CPU's kernels differ only in summation order, far below TIE (the q8_0 random checkpoints it is for reach
    0.4-0.6 on an AVX2-only EPYC)."""
    path = pair_file("qwen3", "target", "f32")
    with pydflash.Model(path, n_ctx=512, n_threads=2) as m:
        prompt = m.tokenize(prompt_rows("code")[0]["text"])[:40]
        tokens = m.generate(prompt, max_tokens=12).tokens
        spread = rounding_spread(m, prompt, tokens, 11)
    assert 0.0 <= spread < TIE / 10, spread
