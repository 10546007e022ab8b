"""Verify costs kept across loads (pydflash/cost_cache.py): what one load of a target and drafter measured is what
the next load of the same files starts from, so its first rounds choose from measurements, not guesses."""

from __future__ import annotations

import json

import pydflash
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
