"""Verify costs kept across loads (pydflash/cost_cache.py): what one load of a target and drafter measured is what
the next load of the same files starts from, so its first rounds choose from measurements, not guesses."""

from __future__ import annotations

import json

import pytest

import pydflash
from conftest import forget_learnt_costs
from export_pairs import pair_file
from pydflash import cache_paths, cost_cache

TARGET, DRAFT = str(pair_file("qwen3", "target", "q8_0")), str(pair_file("qwen3", "dflash", "q8_0"))
PROMPT = "def fibonacci(n):\n"


def test_a_second_load_starts_from_what_the_first_measured():
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2, spec_mode="chain") as m:
        m.generate(PROMPT, max_tokens=48)
        learnt = m._draft.costs()["measured"]
    assert learnt[0], "chain rounds measured no verify width"
    table = cache_paths.read_table(cost_cache.CACHE_FILE)
    assert len(table) == 1
    (saved,) = table.values()
    assert {int(w): ms for w, ms in saved["verify_ms"].items()} == learnt[0]

    cost_cache._saved.clear()  # as a new process
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2) as again:
        restored = again._draft.costs()["measured"]  # before any generation
    # the same widths; a time may come back lower, where the widths around it bound it (a stall: cost_model.h)
    for now, before in zip(restored, learnt):
        assert now.keys() == before.keys()
        assert all(0 < now[w] <= before[w] for w in now)


def test_no_table_is_kept_for_other_threads_or_without_a_drafter():
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2, spec_mode="chain") as m:
        m.generate(PROMPT, max_tokens=32)
    cost_cache._saved.clear()
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=1) as other:
        assert other._draft.costs()["measured"] == ({}, {})
    with pydflash.Model(TARGET, n_ctx=512, n_threads=2) as plain:
        plain.generate(PROMPT, max_tokens=8)
    assert len(json.loads((cache_paths.cache_dir() / cost_cache.CACHE_FILE).read_text())) == 1


def _drafting_rounds(timings: dict) -> int:
    return timings["auto_plain"] + timings["auto_chain"] + timings["auto_tree"]


def test_auto_resumes_its_cool_down():
    """auto's cool-down length (speculation had stopped paying) is kept with the costs: the next load decodes
    plainly from its first round for that long instead of probing its way there again."""
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2) as fresh:
        # control: with nothing learnt, auto drafts once it knows a plain step (its second round)
        assert _drafting_rounds(fresh.generate(PROMPT, max_tokens=32).timings) > 0
    (cache_paths.cache_dir() / cost_cache.CACHE_FILE).unlink()
    cost_cache._saved.clear()
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2) as m:
        m._draft.restore_costs({}, {}, cool_len=64)  # as a load after speculation stopped paying
        c = m.generate(PROMPT, max_tokens=32)
        assert _drafting_rounds(c.timings) == 0 and c.timings["auto_skipped"] > 0
        assert m._draft.costs()["cool_len"] == 64
    (saved,) = cache_paths.read_table(cost_cache.CACHE_FILE).values()
    assert saved["cool_len"] == 64

    cost_cache._saved.clear()  # as a new process
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2) as again:
        assert again._draft.costs()["cool_len"] == 64
        assert _drafting_rounds(again.generate(PROMPT, max_tokens=32).timings) == 0


def test_the_mtp_heads_costs_are_kept_too():
    """A target's own MTP head keeps what verifying cost under its own key (the file and "mtp"), as a drafter does."""
    target = str(pair_file("qwen35", "target-mtp", "q8_0"))
    with pydflash.Model(target, n_ctx=512, n_threads=2, spec_mode="chain") as m:
        m.generate(PROMPT, max_tokens=48)
        learnt = m._mtp.costs()["measured"]
    assert learnt[0], "chain rounds measured no verify width"
    (key,) = cache_paths.read_table(cost_cache.CACHE_FILE)
    assert key.endswith("|mtp")
    cost_cache._saved.clear()  # as a new process
    with pydflash.Model(target, n_ctx=512, n_threads=2) as again:
        restored = again._mtp.costs()["measured"]
    assert restored[0].keys() == learnt[0].keys()
    with pydflash.Model(target, n_ctx=512, n_threads=2, proposers=()) as plain:
        assert plain._mtp is None


def test_a_table_no_run_wrote_is_measured_again():
    """Widths and times that no run here writes (hand-edited, another version's, damaged) are dropped with their
    table: the load decodes as a fresh one. Before, a width past a C int or a time past a double made every later
    load of the pair raise TypeError / OverflowError from inside the cost cache."""
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2, spec_mode="chain") as m:
        m.generate(PROMPT, max_tokens=48)
    path = cache_paths.cache_dir() / cost_cache.CACHE_FILE
    (key,) = json.loads(path.read_text())
    for bad in ({"2147483648": 1.0}, {"-5": 1.0}, {"1": 10**400}, {"1": "fast"}, [1.0]):
        path.write_text(json.dumps({key: {"verify_ms": bad, "tree_verify_ms": {}, "cool_len": 0}}))
        cost_cache._saved.clear()
        with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2, spec_mode="chain") as again:
            assert again._draft.costs()["measured"] == ({}, {}), bad
            assert again.generate(PROMPT, max_tokens=4).finish_reason == "length"


def test_a_micro_batch_no_run_chose_is_measured_again():
    """ubatch.json's n_ubatch 64.0 (a float equal to a size): the first long prompt raised TypeError in the core"""
    from pydflash import ubatch

    long_prompt = "word " * 200
    with pydflash.Model(TARGET, n_ctx=512, n_threads=2) as m:
        m.generate(long_prompt, max_tokens=1)
        chosen = m.n_ubatch
    path = cache_paths.cache_dir() / ubatch.CACHE_FILE
    table = json.loads(path.read_text())
    for entry in table.values():
        entry["n_ubatch"] = float(entry["n_ubatch"])
    path.write_text(json.dumps(table))
    with pydflash.Model(TARGET, n_ctx=512, n_threads=2) as again:
        assert again.generate(long_prompt, max_tokens=1).finish_reason == "length"
        assert type(again.n_ubatch) is int and again.n_ubatch in again._ubatch_sizes
    assert chosen in again._ubatch_sizes


def _rates(tried: list[float], accepted: list[float]) -> list[float | None]:
    return [a / t if t > 0 else None for t, a in zip(tried, accepted)]


def test_a_second_load_starts_from_what_the_target_accepted():
    """The acceptance model's counts (csrc/decode/acceptance_model.h) are kept with the costs: a new load starts
    from each cell's learnt rate, weighted as at most RESTORED_TRIED trials, not from the drafter's own
    probabilities."""
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2, spec_mode="chain") as m:
        for prompt in (PROMPT, "class Stack:\n", "import os\n"):
            m.generate(prompt, max_tokens=48)
        tried, accepted = m._draft.costs()["acceptance"]
    (saved,) = cache_paths.read_table(cost_cache.CACHE_FILE).values()
    # written when they last moved by ACCEPTANCE_MOVED trials: within that of the last generation's
    assert sum(abs(a - b) for a, b in zip(saved["acceptance"]["tried"], tried)) < cost_cache.ACCEPTANCE_MOVED
    assert max(tried) > 32, "the test wants a cell past the restored weight"

    cost_cache._saved.clear()  # as a new process
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2) as again:
        now_tried, now_accepted = again._draft.costs()["acceptance"]
    s_tried, s_accepted = saved["acceptance"]["tried"], saved["acceptance"]["accepted"]
    assert now_tried == pytest.approx([min(t, 32.0) for t in s_tried])
    assert _rates(now_tried, now_accepted) == pytest.approx(_rates(s_tried, s_accepted))


def test_a_restored_acceptance_decides_the_first_rounds():
    """A table saying the target never accepts this drafter's tokens: the next load's auto verifies no draft from
    its first rounds (it drafts, and cuts every draft), where a fresh load trusts the drafter's probabilities and
    verifies drafts."""
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2) as fresh:
        t = fresh.generate(PROMPT, max_tokens=32).timings
        assert t["auto_chain"] + t["auto_tree"] > 0  # control
        n_cells = len(fresh._draft.costs()["acceptance"][0])
    key = next(iter(cache_paths.read_table(cost_cache.CACHE_FILE)))
    never = {"verify_ms": {}, "tree_verify_ms": {}, "cool_len": 0,
             "acceptance": {"tried": [32.0] * n_cells, "accepted": [0.0] * n_cells}}
    (cache_paths.cache_dir() / cost_cache.CACHE_FILE).write_text(json.dumps({key: never}))
    cost_cache._saved.clear()
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2) as again:
        t = again.generate(PROMPT, max_tokens=32).timings
    assert t["auto_chain"] + t["auto_tree"] == 0 and t["auto_plain"] > 0


@pytest.mark.parametrize("bad", [
    {"tried": [1.0] * 3, "accepted": [0.0] * 3},             # another shape
    {"tried": [1.0] * 80, "accepted": [2.0] + [0.0] * 79},   # more accepted than tried
    {"tried": [-1.0] * 80, "accepted": [0.0] * 80},
    {"tried": [float("nan")] * 80, "accepted": [0.0] * 80},  # (json.dumps writes NaN)
    {"tried": ["many"] * 80, "accepted": [0.0] * 80},
    {"tried": [1.0] * 80},
    [1.0, 2.0],
])
def test_acceptance_counts_no_run_wrote_are_learnt_again(bad):
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2, spec_mode="chain") as m:
        m.generate(PROMPT, max_tokens=48)
    path = cache_paths.cache_dir() / cost_cache.CACHE_FILE
    ((key, entry),) = json.loads(path.read_text()).items()
    path.write_text(json.dumps({key: dict(entry, acceptance=bad)}))
    cost_cache._saved.clear()
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2) as again:
        costs = again._draft.costs()
        assert costs["measured"] == ({}, {}) and not any(costs["acceptance"][0]), bad  # the whole table dropped
        assert again.generate(PROMPT, max_tokens=4).finish_reason == "length"


def test_restore_costs_names_counts_of_another_shape():
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2) as m:
        with pytest.raises(ValueError, match="expected 80 cells, got 3 tried and 3 accepted"):
            m._draft.restore_costs({}, {}, acceptance=([1.0] * 3, [0.0] * 3))
        with pytest.raises(ValueError, match="cell 5 has 2.0+ accepted of 1.0+ tried"):
            m._draft.restore_costs({}, {}, acceptance=([1.0] * 80, [0.0] * 5 + [2.0] + [0.0] * 74))
        assert not any(m._draft.costs()["acceptance"][0])  # nothing changed


PROMPTS = [PROMPT, "class Stack:\n", "import os\n", "def parse(line):\n"]


def _verify_shapes(table: dict) -> dict:
    """the step shapes of a batch's step times where generations verified drafts (more rows than parts)"""
    return {(p, r): ms for p, by in table.items() for r, ms in by.items() if r > p}


def test_a_second_load_batches_from_the_step_times_the_first_measured():
    """Sessions generating together plan each step from the times of the step shapes measured so far
    (csrc/state/step_times.h); they are kept under the key with "|batch", and a new load's batch starts from
    them (before any step)."""
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2) as m:
        m.generate_batch(PROMPTS, max_tokens=64)
        measured = m._batcher.step_times()
    assert _verify_shapes(measured), measured  # batched verifies
    table = cache_paths.read_table(cost_cache.CACHE_FILE)
    (key,) = [k for k in table if k.endswith("|batch")]
    saved = {int(p): {int(r): ms for r, ms in by.items()} for p, by in table[key]["step_ms"].items()}
    assert saved.keys() == measured.keys() and all(saved[p].keys() == measured[p].keys() for p in saved)

    cost_cache._saved.clear()  # as a new process
    cost_cache._saved_steps.clear()
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2) as again:
        again.new_session()
        assert again._batcher.step_times() == saved  # (JSON keeps a float exactly)


def test_restored_step_times_decide_the_batched_steps():
    """Saved step times saying that every step past a row per generation costs a second: the next load's batch
    never plans a verify (no step of more rows than parts is measured, the restored ones stay as they were),
    where a fresh load's (control) verifies drafts in batched steps. (A generation running alone for a while,
    its thread started early or its answer ended late, decides alone: not what this test looks at.)"""
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2) as fresh:
        fresh.generate_batch(PROMPTS, max_tokens=64)
        assert _verify_shapes(fresh._batcher.step_times())  # control
        key = fresh._cost_key + "|batch"
    dear = {p: {p: 0.2 * p, **{r: 1000.0 for r in range(p + 1, 8 * p + 1)}} for p in range(2, 5)}
    (cache_paths.cache_dir() / cost_cache.CACHE_FILE).write_text(json.dumps({key: {"step_ms": dear}}))
    cost_cache._saved.clear()
    cost_cache._saved_steps.clear()
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2) as again:
        again.generate_batch(PROMPTS, max_tokens=64)
        assert _verify_shapes(again._batcher.step_times()) == _verify_shapes(dear)


def test_the_batch_weighs_plain_steps_part_by_part_where_that_is_cheaper():
    """The batch's plan weighs a verify against plain decoding at its cheaper way to run (state/step_times.h
    plain_step): a plain step of 2 parts together at 10 ms, every verify step of 2 parts at 5 ms, and a part alone
    at 0.1 ms: plain decoding part by part (0.2 ms for 2 tokens) beats any verify, so none is planned and the
    plain steps run part by part. Control: a part alone at 100 ms, and every verify step is cheaper than the
    plain one: the batch verifies."""
    dear_plain = {2: {2: 10.0, **{r: 5.0 for r in range(3, 17)}}}
    for alone, verifies in ((100.0, True), (0.1, False)):
        forget_learnt_costs()  # (the loop's first load keeps its step times for the next)
        with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2) as m:
            m.new_session()
            m._batcher.restore_step_times({**dear_plain, 1: {1: alone}})
            m.generate_batch(PROMPTS[:2], max_tokens=48)
            measured, stats = m._batcher.step_times(), m._batcher.stats
        new_verifies = {s for s in _verify_shapes(measured) if s[0] == 2} - {(2, r) for r in range(3, 17)}
        assert bool(stats["planned"] > 0 and (new_verifies or measured[2] != dear_plain[2])) == verifies, (alone, stats)
        assert (stats["one_by_one"] > 0) == (not verifies), stats


@pytest.mark.parametrize("bad", [{"2": {"1": 5.0}}, {"0": {"1": 5.0}}, {"2": {"3": -1.0}}, {"2": {"3": "slow"}},
                                 {"2": {"3": float("inf")}}, {"2": {"70000": 5.0}}, {"2": [5.0]}, [1.0]])
def test_step_times_no_run_wrote_are_measured_again(bad):
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2) as m:
        key = m._cost_key + "|batch"
    table = {"step_ms": {"3": {"4": 9.0}, **bad} if isinstance(bad, dict) else bad}
    (cache_paths.cache_dir() / cost_cache.CACHE_FILE).write_text(json.dumps({key: table}))
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2) as again:
        again.new_session()
        assert again._batcher.step_times() == {}, bad  # the whole table dropped
        assert all(c.finish_reason == "length" for c in again.generate_batch(PROMPTS[:2], max_tokens=4))
    # control: the same table without the bad shape is restored
    (cache_paths.cache_dir() / cost_cache.CACHE_FILE).write_text(json.dumps({key: {"step_ms": {"3": {"4": 9.0}}}}))
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2) as ok:
        ok.new_session()
        assert ok._batcher.step_times() == {3: {4: 9.0}}


def test_restore_step_times_names_a_shape_no_step_has():
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2) as m:
        m.new_session()
        with pytest.raises(ValueError, match="a step of 3 parts and 2 rows taking 5.0+ ms"):
            m._batcher.restore_step_times({2: {3: 7.0}, 3: {2: 5.0}})
        assert m._batcher.step_times() == {}  # nothing restored


def test_nothing_new_is_known_without_waiting_for_a_step():
    """remember_steps writes only when the batcher holds a step shape the saved table lacks, which it tells from
    the batcher's count of shapes (stats, no wait for a running step): the count is what step_times() lists, and
    remembering again after the generation's own write writes nothing."""
    with pydflash.Model(TARGET, draft_model_path=DRAFT, n_ctx=512, n_threads=2) as m:
        m.generate_batch(PROMPTS, max_tokens=48)
        table = m._batcher.step_times()
        assert m._batcher.stats["step_shapes"] == sum(len(by) for by in table.values()) > 0
        path = cache_paths.cache_dir() / cost_cache.CACHE_FILE
        written = path.stat().st_mtime_ns
        path.write_text(path.read_text())  # (a write would change this file's time again)
        before = path.stat().st_mtime_ns
        cost_cache.remember_steps(m._batcher, m._cost_key)
        assert path.stat().st_mtime_ns == before >= written
