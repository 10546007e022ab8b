"""auto's per-round choice of what to verify (decode/proposer.h, choose_verify_budget): the number of tree nodes b
that maximises  1 + sum of P(the target accepts each chosen node's path) - R * t_verify(1 + b),  with R the best
rate reachable (tokens per ms: plain decoding's, or speculation's so far). Checked here on hand-made costs and
trees, with the untrained acceptance model, whose P(accepted | parent accepted) is the drafter's probability
rounded to the centre of its tenth (0.95 -> 0.95, 0.55 -> 0.55, 0.15 -> 0.15)."""

from __future__ import annotations

import math

import pytest

from pydflash import _core

GRID = (1, 2, 4, 8, 16, 32, 64)


def chain(q: float, n: int):
    """[root, n drafts], each the drafter's first choice with probability q"""
    return list(range(-1, n)), [0] * (n + 1), [0.0] + [math.log(q)] * n


def costs(f):
    return {w: f(w) for w in GRID}


def test_no_batching_gain_means_plain_decoding():
    # a verify of w tokens costs w plain steps (a compute-bound CPU with nothing to amortise): no draft can
    # pay for itself, however sure the drafter is
    parents, rank, logp = chain(0.95, 15)
    assert _core.choose_verify_budget(parents, rank, logp, costs(lambda w: 10.0 * w)) == 0


def test_cheap_extra_tokens_verify_what_is_likely():
    # t(w) = 10 + 2 (w - 1): each further token costs 0.2 plain steps; with R = 1/10 a node is worth it while
    # its path's probability exceeds 0.2: 0.95^d always (d <= 5), 0.15 never
    verify = costs(lambda w: 10.0 + 2.0 * (w - 1))
    assert _core.choose_verify_budget(*chain(0.95, 5), verify) == 5
    assert _core.choose_verify_budget(*chain(0.15, 5), verify) == 0
    # 0.55^d: 0.55 and 0.3025 clear 0.2, 0.166 does not
    assert _core.choose_verify_budget(*chain(0.55, 5), verify) == 2


def test_a_higher_reachable_rate_asks_more_of_each_node():
    # once speculation reaches 0.2 tokens/ms, a node must bring 0.2 * 2 ms = 0.4 tokens: 0.55 yes, 0.3025 no
    verify = costs(lambda w: 10.0 + 2.0 * (w - 1))
    assert _core.choose_verify_budget(*chain(0.55, 5), verify, spec_rate=0.2) == 1


def test_flat_costs_take_the_whole_tree():
    # a GPU-like verify (the same time for 1 or 64 tokens): every node with any chance is worth verifying
    parents = [-1, 0, 0, 1, 1, 3, 2]
    rank = [0, 0, 1, 0, 1, 0, 0]
    logp = [0.0] + [math.log(p) for p in (0.6, 0.3, 0.7, 0.2, 0.9, 0.5)]
    assert _core.choose_verify_budget(parents, rank, logp, costs(lambda w: 10.0)) == 6


def test_on_a_gpu_rounds_verify_grid_widths_or_every_node():
    # On a GPU each verify width is a captured graph (decode/cost_model.h): a round verifies 1, 2, 4, 8, ... tokens
    # or all it was offered. Costs 10 + 2 (w - 1), R = 1/10, chain of 0.55 (module docstring): the gain of b
    # drafts, 1 + sum_{d<=b} 0.55^d - (10 + 2 b) / 10, is 0.35, 0.4525, 0.4189, 0.3104, 0.1607 for b = 1..5.
    verify = costs(lambda w: 10.0 + 2.0 * (w - 1))
    assert _core.choose_verify_budget(*chain(0.55, 5), verify) == 2  # 3 tokens: off the grid
    assert _core.choose_verify_budget(*chain(0.55, 5), verify, grid_widths=True) == 3  # 4 tokens
    # b = 5 (all six tokens) is offered whatever its width: with 0.95 it is the best
    assert _core.choose_verify_budget(*chain(0.95, 5), verify, grid_widths=True) == 5
    # nothing worth a draft stays plain
    assert _core.choose_verify_budget(*chain(0.15, 5), verify, grid_widths=True) == 0


def test_on_the_cpu_rounds_verify_whole_row_tiles():
    # A dense target on the CPU takes rows four at a time (models/model.h verify_row_tile): a round verifies 4,
    # 8, ... tokens, all it was offered, or the root alone. Same costs and chain as above (gains for b = 1..5:
    # 0.35, 0.4525, 0.4189, 0.3104, 0.1607): b = 2 (3 tokens) is off the tile, b = 3 (4 tokens) the best on it
    verify = costs(lambda w: 10.0 + 2.0 * (w - 1))
    assert _core.choose_verify_budget(*chain(0.55, 5), verify, row_tile=4) == 3
    # all eight tokens of a sure chain (gain 1 + sum 0.95^d, d <= 7, - 2.4 = 4.08; four tokens: 2.11)
    assert _core.choose_verify_budget(*chain(0.95, 7), verify, row_tile=4) == 7
    # a chain of 3 drafts offered whole, 4 tokens; one of 2, whole or plain (gain 0.4525 against 0)
    assert _core.choose_verify_budget(*chain(0.55, 2), verify, row_tile=4) == 2
    assert _core.choose_verify_budget(*chain(0.15, 5), verify, row_tile=4) == 0
    with pytest.raises(ValueError, match="row_tile"):
        _core.choose_verify_budget(*chain(0.55, 5), verify, row_tile=0)


def test_recurrent_trees_cost_their_own_time():
    # on a hybrid target a branching tree runs another graph (depth by depth): when that is dear, the chain
    # prefix (node 1) is kept and the sibling (node 2) with all that follows it is left out
    parents, rank = [-1, 0, 0, 1], [0, 0, 1, 0]
    logp = [0.0, math.log(0.95), math.log(0.35), math.log(0.95)]
    chain_ms = costs(lambda w: 10.0)
    assert _core.choose_verify_budget(parents, rank, logp, chain_ms, costs(lambda w: 10.0), recurrent=True) == 3
    assert _core.choose_verify_budget(parents, rank, logp, chain_ms, costs(lambda w: 30.0), recurrent=True) == 1
    # an attention-only target verifies a tree with the chain's graph: the tree's times do not apply
    assert _core.choose_verify_budget(parents, rank, logp, chain_ms, costs(lambda w: 30.0), recurrent=False) == 3


def test_a_tree_is_no_wider_than_a_chain_measured():
    # A tree wider than every chain measured would be priced on two guesses (the chain's time there, itself
    # extrapolated, in the ratio measured at the widest tree): a tree is verified no wider than the widest chain
    # measured, or 8 nodes while none that wide is (decode/proposer.cpp). The tree: node 1 and its sibling 2 at
    # depth 1, four nodes (3-6) at depth 2, five (7-11) at depth 3, every draft at 0.95 (module docstring): P(reach)
    # 0.95, 0.9025, 0.857 by depth. R = 1/10.
    parents = [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5]
    rank = [0, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0]
    logp = [0.0] + [math.log(0.95)] * 11
    # chains measured up to 16 at 10 ms each: every node's row is free, all 11 are verified
    flat = {1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0, 16: 10.0}
    assert _core.choose_verify_budget(parents, rank, logp, flat) == 11
    # chains measured up to 8 only: 12 nodes would be guessed at 10 sqrt(12 / 8) = 12.2 ms, far less than nodes
    # 8-11 bring (4 x 0.857 tokens against 0.22), yet the tree stops at 8 nodes: the root and 7
    up_to_8 = {w: ms for w, ms in flat.items() if w <= 8}
    assert _core.choose_verify_budget(parents, rank, logp, up_to_8, max_width=16) == 7
    # plain steps alone measured: 8 nodes still (gain 1 + 6.37 - 10 sqrt(8) / 10 = 4.54, the best of b <= 7),
    # where the chain prefix alone (node 1) would gain 0.54
    assert _core.choose_verify_budget(parents, rank, logp, {1: 10.0}, max_width=16) == 7


# auto's cool-down (decode/proposer.h judge_speculation): a plain step costs 10 ms here (0.1 tokens/ms)
PLAIN_MS = {1: 10.0, 2: 12.0, 4: 16.0}
PLAIN = (1, False, 1, 10.0)
BAD = (2, True, 1, 30.0)  # a drafted round at a third of plain's rate
PROBE = 3  # a fresh run of speculation is judged on its first 3 rounds together (decode/proposer.cpp)


def after_a_bad_run(probe):
    """(plain rounds left, next cool-down length) from a state whose next cool-down is 1024 rounds long (as
    failures earlier in the process, or a cost cache, left it), after a bad run of speculation, the cool-down it
    set off, then the rounds `probe`"""
    cooldown, cool_len = _core.judge_rounds([BAD] * PROBE, PLAIN_MS, cool_len=1024)[-1]
    assert cooldown == 1024 and cool_len == 2048  # the bad run cools down; the next one longer, to the cap
    return _core.judge_rounds([BAD] * PROBE + [PLAIN] * cooldown + probe, PLAIN_MS, cool_len=1024)[-1]


def test_a_probe_that_clearly_wins_ends_a_long_cool_down():
    # the probe commits 4 tokens in 25 ms a round (1.6x plain): no cool-down follows, and the next one (kept
    # across processes) is the shortest again, whatever the running rate was before the cool-down
    assert after_a_bad_run([(4, True, 4, 25.0)] * PROBE) == (0, 4)


def test_a_probe_is_judged_on_its_first_rounds_together():
    # its first round falls at a hard spot (16 rows verified, 2 tokens in 33 ms: 0.6x plain, far behind) and
    # the next two commit 8 tokens in 30 ms each: 18 tokens in 93 ms, 1.9x plain, a clear win. Judged on the
    # first round alone, the cool-down grew 8x and the next probe fell in the same hard stretch (decode/
    # proposer.cpp: auto decoded a whole prompt plainly where speculation ran at 1.6x plain)
    hard, good = (16, True, 2, 33.0), (8, True, 8, 30.0)
    assert after_a_bad_run([hard]) == (0, 2048)  # not judged yet
    assert after_a_bad_run([hard, good, good]) == (0, 4)
    # control: a probe whose rounds are all hard cools down again, far behind: the cap
    assert after_a_bad_run([hard] * PROBE) == (2048, 2048)


def test_a_probe_no_faster_than_plain_keeps_the_cool_down_length():
    # a probe at plain's rate (2 tokens in 20 ms) ends no failure; one as bad as the stretch before cools down
    # again, for the length reached
    even = after_a_bad_run([(2, True, 2, 20.0)] * PROBE)
    assert even[1] >= 2048
    assert after_a_bad_run([BAD] * PROBE) == (2048, 2048)


def test_rounds_chosen_before_acceptance_is_learnt_set_off_no_cool_down():
    # a fresh process's first rounds follow the drafter's own probabilities (the acceptance model still at its
    # prior): bad as they are, they start no cool-down, which would otherwise grow 8x a failure before auto has
    # learnt what to verify; once it has tried enough nodes, the same round does
    def cooled_after(k):
        return _core.judge_rounds([BAD] * k, PLAIN_MS, learnt=False)[-1][0] > 0

    first = next(k for k in range(1, 65) if cooled_after(k))
    assert 4 <= first <= 32
    assert _core.judge_rounds([BAD] * PROBE, PLAIN_MS, learnt=True)[-1][0] > 0  # control: learnt, the first do


def test_drafting_to_verify_nothing_is_judged_while_acceptance_is_learnt():
    # rounds that draft and then verify no draft (width 1: the drafter's prior says none is worth it) teach the
    # acceptance model nothing, so they would never end its learning: past the first 64 (left out as the prior's
    # doubts, not auto's choices), their cost, the drafting, is judged (here 1 token in 15 ms against 10 ms a
    # plain step; the first rounds judged together); control: learnt, the first are
    nothing = (1, True, 1, 15.0)
    judged = _core.judge_rounds([nothing] * (64 + PROBE), PLAIN_MS, learnt=False)
    assert [cooldown for cooldown, _ in judged] == [0] * (64 + PROBE - 1) + [4]
    assert _core.judge_rounds([nothing] * PROBE, PLAIN_MS, learnt=True)[-1][0] == 4


def test_a_round_that_explores_a_width_not_measured_counts():
    # rounds of 8 drafts verified (a width never measured: its cost was a guess) that commit 8 tokens in
    # 30 ms, 2.7x plain, after a bad run's cool-down: they count as speculation, and a clear win makes the next
    # cool-down the shortest again (it was 32 after the bad run, far behind). (Left out, only rounds at measured
    # widths, and those that verify nothing, would be judged.)
    bad = [(1, True, 1, 15.0)] * PROBE
    assert _core.judge_rounds(bad, PLAIN_MS)[-1] == (4, 32)
    assert _core.judge_rounds(bad + [PLAIN] * 4 + [(8, True, 8, 30.0)] * PROBE, PLAIN_MS)[-1] == (0, 4)


def test_speculation_is_judged_on_tokens_over_time_not_on_a_mean_of_round_rates():
    # a wide round commits 16 tokens in 100 ms, then ten rounds draft and verify nothing (1 token in 12 ms):
    # 26 tokens in 220 ms, 1.18x plain decoding's 0.1 tokens/ms, so no cool-down; a mean of the rounds' own
    # rates, where each 12 ms round weighs as much as the 100 ms one, falls below plain by the eighth
    verify_ms = {1: 10.0, 2: 12.0, 4: 16.0, 8: 24.0, 16: 40.0}
    rounds = [(16, True, 16, 100.0)] + [(1, True, 1, 12.0)] * 10
    assert all(cooldown == 0 for cooldown, _ in _core.judge_rounds(rounds, verify_ms))
    # control: where the short rounds go on, speculation does fall behind plain, and a cool-down starts
    rounds = [(16, True, 16, 100.0)] + [(1, True, 1, 12.0)] * 40
    first = next((k for k in range(2, 42) if _core.judge_rounds(rounds[:k], verify_ms)[-1][0] > 0), None)
    assert first is not None and first > 11


def test_on_the_cpu_each_width_up_to_16_is_learnt_on_its_own():
    # A CPU verify's time grows in steps: ggml's repacked matmul kernels take rows four at a time, so 3 rows cost
    # about what 4 do and 5 rows far more (decode/cost_model.h). Each width up to 16 keeps its own time: 4 rows
    # stay at what they measured beside 3 and 5, where kept at powers of two only they were a line bent by both
    rounds = [(1, 10.0)] * 3 + [(3, 20.0)] * 2 + [(4, 21.0)] * 2 + [(5, 30.0)] * 2 + [(3, 20.0), (5, 30.0)]
    learnt = _core.learnt_verify_ms(rounds, 16)
    assert (learnt[3], learnt[4], learnt[5]) == (20.0, 21.0, 30.0)
    # so a round can see that a third draft costs next to nothing once a second is verified: drafts of 0.95,
    # 0.55 and 0.55 (paths 0.95, 0.52, 0.29), R = 1/10: 2 drafts gain 1 + 1.47 - 2.0, 3 drafts 1 + 1.76 - 2.1
    verify = {1: 10.0, 2: 14.0, 3: 20.0, 4: 21.0, 8: 40.0}
    parents, rank, _ = chain(0.5, 3)
    logp = [0.0, math.log(0.95), math.log(0.55), math.log(0.55)]
    assert _core.choose_verify_budget(parents, rank, logp, verify, max_width=8) == 3


def test_a_guessed_shape_does_not_move_a_measured_width():
    # Plain steps at 10 ms and 16-token verifies at 40 ms measured, then 24-token verifies at 62 ms while width
    # 32 is not measured yet: the shape between 16 and 32 is unknown, so the 24-token times bound width 32 from
    # below (62 ms, optimistic) and leave width 16 as measured. (Carried flat onto width 16, they would raise
    # it to 62 ms's side: on the CPU a width-4 verify measured at 25 ms was once learnt as 36.6 ms that way, from
    # 6-token verifies, and no longer chosen.)
    learnt = _core.learnt_verify_ms([(1, 10.0)] * 3 + [(16, 40.0)] * 3 + [(24, 62.0)] * 2, 64)
    assert learnt[1] == 10.0 and learnt[16] == 40.0 and learnt[32] == 62.0
    # once both are measured, later 24-token times move both through the shape between them (linear: 51 ms at
    # 24 tokens, so 62 ms is 22% above it): each by half, as 24 tokens lie midway
    learnt = _core.learnt_verify_ms([(1, 10.0)] * 3 + [(16, 40.0)] * 3 + [(24, 62.0)] * 3, 64)
    assert learnt[16] == pytest.approx(40.0 + 0.2 * 0.5 * (62.0 * 40.0 / 51.0 - 40.0))
    assert learnt[32] == pytest.approx(62.0 + 0.2 * 0.5 * (62.0 * 62.0 / 51.0 - 62.0))


def test_an_unmeasured_narrower_width_gets_its_share_by_width():
    # nothing measured between plain steps and 24 tokens: width 16 is bounded below by 16/24 of a 24-token
    # verify, width 32 by all of it; both optimistic, to be measured when a round explores them
    learnt = _core.learnt_verify_ms([(1, 10.0)] * 3 + [(24, 48.0)] * 2, 64)
    assert learnt[16] == pytest.approx(32.0) and learnt[32] == pytest.approx(48.0)


def test_on_the_cpu_a_width_past_the_widest_measured_costs_more_with_the_width():
    # Only plain steps measured (10 ms). On the CPU a wider verify is taken to cost 10 ms x sqrt(width / 1) until
    # a round measures it; on a GPU the same as the widest measured (decode/cost_model.h)
    learnt = _core.learnt_verify_ms([(1, 10.0)] * 3, 16)
    assert learnt == pytest.approx({w: 10.0 * math.sqrt(w) for w in range(1, 17)})
    assert _core.learnt_verify_ms([(1, 10.0)] * 3, 16, grid_widths=True) == {w: 10.0 for w in range(1, 17)}
    # from the widest measured one: width 4 at 16 ms makes 8 cost 16 sqrt(2) and 16 cost 32
    learnt = _core.learnt_verify_ms([(1, 10.0)] * 3 + [(4, 16.0)] * 3, 16)
    assert learnt[8] == pytest.approx(16.0 * math.sqrt(2)) and learnt[16] == pytest.approx(32.0)
    # what a round then chooses: 15 drafts of 0.55 each (module docstring), R = 1/10; the gain of b drafts,
    # 1 + sum_{d<=b} 0.55^d - sqrt(1 + b), is 0.136, 0.120, 0.019 for b = 1..3 and falls after: one draft. Taken
    # flat, the whole chain (1.55 tokens more for a plain step's time), as on a GPU
    assert _core.choose_verify_budget(*chain(0.55, 15), {1: 10.0}, max_width=16) == 1
    assert _core.choose_verify_budget(*chain(0.55, 15), {1: 10.0}, max_width=16, grid_widths=True) == 15


def test_the_head_drafts_on_where_the_next_drafts_together_pay():
    # Step-shaped costs (3 rows 20 ms, 4 rows 20.5), R = 1/10, a further draft 1 ms. After drafts of 0.9 and 0.6
    # the best cut verifies one draft (gain 1 + 0.9 - 1.4 = 0.5; two: 1 + 1.44 - 2.0 = 0.44), so the second is not
    # worth its own width; but a third as likely as the second (path 0.32) makes the cut of three gain
    # 1 + 1.76 - 2.05 - 0.1 = 0.61: the head drafts on. After 0.9 and 0.2 (a third at 0.04) nothing further can
    # pay: it stops; and never past its block (max_more 0)
    verify = {1: 10.0, 2: 14.0, 3: 20.0, 4: 20.5}
    assert _core.worth_drafting_on([0.9, 0.6], verify, 1.0, 2)
    assert not _core.worth_drafting_on([0.9, 0.2], verify, 1.0, 2)
    assert not _core.worth_drafting_on([0.9, 0.6], verify, 1.0, 0)
    # the drafting's own time counts: at 8 ms a step the third no longer pays (0.61 - 0.7 < 0.5)
    assert not _core.worth_drafting_on([0.9, 0.6], verify, 8.0, 1)


def test_on_a_gpu_a_width_is_measured_once_its_graph_replays():
    # A CUDA graph is captured at its second identical evaluation and replayed from the third (ggml-cuda); on an
    # H200 a verify of 4 took 6.0, 9.9, then 2.0 ms. On a GPU (grid widths) a width's time is the fastest of its
    # first three evaluations; on the CPU of its first two, the third moving a running average
    rounds = [(1, 2.0)] * 3 + [(4, 6.0), (4, 9.9), (4, 2.0)]
    assert _core.learnt_verify_ms(rounds, 16, grid_widths=True)[4] == pytest.approx(2.0)
    assert _core.learnt_verify_ms(rounds, 16)[4] > 4.0


def test_a_tree_costs_no_less_than_the_chain_of_its_width():
    # A recurrent target verifies a tree level by level: the chain's work and more. With trees measured only at
    # 16 nodes (40 ms, proportional below it: 3 nodes at 7.5 ms) and chains of 3 at 20 ms, two sibling drafts
    # (0.55 and 0.45) are not worth a tree: it is taken at the chain's 20 ms (1 + 1.0 - 2.0 against one draft's
    # 1 + 0.55 - 1.4), not at 7.5 ms (which made it gain 1.25)
    chain_ms = {1: 10.0, 2: 14.0, 3: 20.0, 4: 20.5, 16: 60.0}
    parents, rank, logp = [-1, 0, 0], [0, 0, 1], [0.0, math.log(0.55), math.log(0.45)]
    assert _core.choose_verify_budget(parents, rank, logp, chain_ms, tree_verify_ms={16: 40.0}, recurrent=True) == 1
