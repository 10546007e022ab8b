"""The batch's step costs and plan (state/step_times.h, state/step_plan.h): how a batched step's time is charged to
its parts, and how the batch chooses what each auto generation verifies. Every expectation below is worked out by
hand from the rules the headers state."""

from __future__ import annotations

import pytest

from pydflash import _core


# ---- the split of a step's time among its parts ----
def test_a_plain_step_charges_each_part_alike():
    assert _core.split_step([], [1, 1], 10.0) == pytest.approx([5.0, 5.0])


def test_before_any_plain_step_is_known_the_time_goes_by_rows():
    # base = 30 * 3 / 6 = 15: each part 5, the verify's extra rows the remaining 15
    assert _core.split_step([], [1, 1, 4], 30.0) == pytest.approx([5.0, 5.0, 20.0])


def test_a_verify_pays_what_its_rows_add_to_a_plain_step():
    # a plain step of three parts took 12 ms: the verify's three extra rows added 18
    assert _core.split_step([([1, 1, 1], 12.0)], [1, 1, 4], 30.0) == pytest.approx([4.0, 4.0, 22.0])


def test_a_plain_step_measured_slower_than_this_step_caps_the_base():
    assert _core.split_step([([1, 1], 20.0)], [1, 3], 15.0) == pytest.approx([7.5, 7.5])


def test_a_shapes_time_is_the_faster_of_its_first_two_steps():
    # the first step of a shape also builds its graph: 30, then 10 -> 10
    assert _core.split_step([([1, 1], 30.0), ([1, 1], 10.0)], [1, 2], 18.0) == pytest.approx([5.0, 13.0])


def test_then_a_running_average_that_a_stall_moves_only_so_far():
    # 10, 10, then 20: 10 + 0.2 * (20 - 10) = 12; or then 100 (a stall, taken as 2 x 10): also 12
    for third in (20.0, 100.0):
        steps = [([1, 1], 10.0), ([1, 1], 10.0), ([1, 1], third)]
        assert _core.split_step(steps, [1, 2], 18.0) == pytest.approx([6.0, 12.0])


def test_steps_of_another_number_of_parts_do_not_set_the_base():
    # only a three-part step is known: the two-part step goes by rows (base 18 * 2 / 3 = 12)
    assert _core.split_step([([1, 1, 1], 9.0)], [1, 2], 18.0) == pytest.approx([6.0, 12.0])


def test_split_rejects_a_part_without_rows():
    with pytest.raises(ValueError, match="one count"):
        _core.split_step([], [1, 0], 5.0)
    with pytest.raises(ValueError, match="its ms"):
        _core.split_step([([1], 0.0)], [1], 5.0)
    with pytest.raises(ValueError, match="its ms"):
        _core.split_step([([1], 1.0, True, 0)], [1], 5.0)


# ---- the plan: what each offer verifies ----
# two-part steps measured at 2 rows (10 ms), 4 (12 ms) and 6 (20 ms): 3 rows are estimated at 11, 5 at 16
MEASURED = [([1, 1], 10.0), ([1, 3], 12.0), ([3, 3], 20.0)]


def test_the_plan_takes_the_likeliest_candidates_while_the_step_rate_grows():
    # candidates by P(reached): A 0.9, A 0.8, B 0.5, A 0.3. Rates (tokens / ms): none 2/10 = .200; 1: 2.9/11 =
    # .264; 2: 3.7/12 = .308; 3: 4.2/16 = .263; 4: 4.5/20 = .225. Best: A's first two nodes, none of B's.
    assert _core.plan_step([[0.9, 0.8, 0.3], [0.5]], 0, 0, MEASURED) == [2, 0]


def test_the_plan_decodes_plainly_when_rows_cost_more_than_they_bring():
    # 2 rows 10 ms, 4 rows 30: one node 2.9 / 20 = .145, two 3.8 / 30 = .127, both below plain's .200
    assert _core.plan_step([[0.9], [0.9]], 0, 0, [([1, 1], 10.0), ([2, 2], 30.0)]) == [0, 0]


def test_the_plan_counts_the_steps_other_parts():
    # a chain mode's verify of 3 rows (its root's token counted) and one offer: 4 rows 12 ms, 6 rows 14, 8 rows 30.
    # none: 2/12 = .167; one node 2.9/13 = .223; two 3.8/14 = .271
    assert _core.plan_step([[0.9, 0.9]], 1, 3, [([3, 1], 12.0), ([3, 3], 14.0), ([3, 5], 30.0)]) == [2]
    # the same offer beside two plain parts: 3 rows 10 ms, 5 rows 30 ms. none 3/10; two nodes 4.8/30
    assert _core.plan_step([[0.9, 0.9]], 2, 2, [([1, 1, 1], 10.0), ([1, 1, 3], 30.0)]) == [0]


def test_a_step_holding_a_prompt_micro_batch_is_not_learnt():
    # its rows cost differently, and the plans are for decoding steps. A plain step of two parts took 9 ms, then
    # a step of 3 rows 30 ms. Not learnt (it held a prompt micro-batch), 3 rows are beyond what was measured and
    # taken to cost 9: one offered node is worth it. Learnt, they cost 30: 2.9 / 30 < 2 / 9.
    assert _core.plan_step([[0.9]], 1, 1, [([1, 1], 9.0), ([1, 2], 30.0, False)]) == [1]
    assert _core.plan_step([[0.9]], 1, 1, [([1, 1], 9.0), ([1, 2], 30.0)]) == [0]


def test_the_plan_explores_at_most_twice_the_widest_step_measured():
    # only 2 rows measured (10 ms): wider steps are taken to cost the same, up to max(2 x 2, 2 + 8) = 10 rows
    assert _core.plan_step([[0.9] * 20, []], 0, 0, [([1, 1], 10.0)]) == [8, 0]


def test_on_the_cpu_a_speculative_step_verifies_whole_tiles_of_rows():
    # two-part steps measured at 2, 4, 8 and 12 rows (10, 12, 20, 30 ms; 6 rows estimated at 16), five nodes per
    # offer (0.9, 0.9, 0.5, 0.1, 0.05 each). Row by row: 4 rows 3.8/12 = .317, 5: 4.7/14 = .336, 6: 5.6/16 =
    # .350, 7: 6.1/18 = .339, 8: 6.6/20 = .330, 9: 6.7/22.5 = .298, ..., 12: 6.9/30 = .230: 6 rows, the first two
    # nodes of each. In tiles of 4: 4 rows .317, 8 rows .330, 12 rows .230: 8, the third node of each too.
    measured = [([1, 1], 10.0), ([1, 3], 12.0), ([3, 5], 20.0), ([5, 7], 30.0)]
    offers = [[0.9, 0.9, 0.5, 0.1, 0.05]] * 2
    assert _core.plan_step(offers, 0, 0, measured) == [2, 2]
    assert _core.plan_step(offers, 0, 0, measured, row_tile=4) == [3, 3]


def test_a_tile_the_candidates_cannot_fill_is_verified_as_far_as_they_go():
    # one node offered in all (3 rows, 2.9/11 = .264 against plain's .200): verified, though 3 is no whole tile;
    # plain decoding stays a choice at 3 parts, its 3 rows no tile either (3 rows 10 ms, 4 rows 40: one node
    # brings 3.9/40)
    assert _core.plan_step([[0.9], []], 0, 0, MEASURED, row_tile=4) == [1, 0]
    assert _core.plan_step([[0.9], [], []], 0, 0, [([1, 1, 1], 10.0), ([1, 1, 2], 40.0)], row_tile=4) == [0, 0, 0]
    with pytest.raises(ValueError, match="row_tile"):
        _core.plan_step([[0.9]], 0, 0, MEASURED, row_tile=0)


def test_without_a_step_of_as_many_parts_each_generation_decides_alone():
    assert _core.plan_step([[0.9], [0.9]], 0, 0, [([1, 1, 1], 9.0)]) == []
