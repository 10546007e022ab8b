"""Continuous batching: several sessions of one model in one target evaluation per step.

`SessionBatch` evaluates several sessions' batches (prefill micro-batches, single tokens, chains, trees) in one
graph: the weights run once over every row, each session's attention, conv and gated-delta-net state on its own
rows. `EvalBatcher` gathers the evaluations of generations running in threads of their own (what
`Model.new_session()` and `pydflash serve --parallel N` run) into such batches. Either way each session's results
must be those it gets alone: the references are the same calls made on a session of its own."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import pydflash
from pydflash import _core

from conftest import forget_learnt_costs
from near_ties import parts_at_a_near_tie

PAIRS = Path(__file__).resolve().parent / "data" / "pairs"
PROMPTS = ["def quicksort(items):\n", "class LinkedList:\n    def __init__(self):\n", "import os\n\ndef walk(",
           "def parse_args(argv):\n", "# binary search\ndef search(a, x):\n", "def merge(a, b):\n",
           "def fib(n):\n    # the n-th Fibonacci number\n", "with open(path) as f:\n"]


def _tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.RandomState(seed).randint(5, 1000, size=n)]


@pytest.fixture(scope="module", params=["qwen3", "qwen35", "qwen3moe", "qwen35moe"])
def target(request):
    with pydflash.Model(PAIRS / f"{request.param}-target-q8_0.gguf", n_ctx=256, n_threads=2) as m:
        yield m


def _sessions(model, n: int = 3) -> list:
    return [_core.Session(model._model, n_ctx=256, n_ubatch=16, n_rollback=16) for _ in range(n)]


def _step(batch, alone: list, together: list, parts: list[dict]) -> None:
    """One evaluation of `parts` (Session.eval's arguments) on each session of `alone` by itself and on those of
    `together` in one batch: the same logits, bit for bit, and the same top-k."""
    solo = [s.eval(**p) for s, p in zip(alone, parts)]
    batched = batch.eval([dict(session=s, **p) for s, p in zip(together, parts)])
    for i, (a, b) in enumerate(zip(solo, batched)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            if isinstance(x, list):
                for u, v in zip(x, y):
                    np.testing.assert_array_equal(u, v, err_msg=f"part {i}: captured")
            else:
                np.testing.assert_array_equal(x, y, err_msg=f"part {i}")


def test_a_batch_of_sessions_evaluates_each_as_alone(target):
    """Prefill micro-batches of different lengths, then a single token, a chain and a tree side by side, commits
    of a chain prefix and a tree path, and the step after: every session's logits equal its own evaluation's."""
    alone, together = _sessions(target), _sessions(target)
    batch = _core.SessionBatch(target._model)
    prompts = [_tokens(1, 10), _tokens(2, 16), _tokens(3, 5)]
    _step(batch, alone, together, [dict(tokens=p, all_logits=False, whole=True) for p in prompts])
    for s, p in [*zip(alone, prompts), *zip(together, prompts)]:
        s.commit(len(p))
    tree = [-1, 0, 0, 1, 1, 2, 3]
    _step(batch, alone, together, [dict(tokens=_tokens(4, 1)), dict(tokens=_tokens(5, 5), top_k=4),
                                   dict(tokens=_tokens(6, 7), parents=tree, top_k=4, capture_layers=[1])])
    for group in (alone, together):
        group[0].commit(1)
        group[1].commit(3)
        group[2].commit([0, 1, 3])
    _step(batch, alone, together, [dict(tokens=_tokens(7, 2)), dict(tokens=_tokens(8, 1)),
                                   dict(tokens=_tokens(9, 3), parents=[-1, 0, 0])])
    assert [s.n_past for s in together] == [s.n_past for s in alone] == [11, 19, 8]
    for group in (alone, together):
        group[0].commit(2)
        group[2].commit([0, 2])
    assert [s.tokens for s in together] == [s.tokens for s in alone]


def _same_state(alone: list, together: list) -> None:
    for i, (a, b) in enumerate(zip(alone, together)):
        sa, sb = a.read_state(), b.read_state()
        for kind in ("k", "v", "ssm", "conv"):
            for layer, (x, y) in enumerate(zip(sa[kind], sb[kind])):
                np.testing.assert_array_equal(x, y, err_msg=f"session {i}: {kind} of layer {layer}")


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_chains_of_one_length_are_each_sessions_own(arch):
    """Sessions whose rows are chains of one length (prompt micro-batches of one size, single tokens, chains of
    4 committed in part) run a hybrid target's conv and delta rule over all of them at once (one op each,
    models/delta_net_batch.h): every session's logits and committed memory (K/V, conv window, delta-net state)
    equal its own evaluation's, bit for bit, through commits of whole chains, prefixes and nothing."""
    with pydflash.Model(PAIRS / f"{arch}-target-q8_0.gguf", n_ctx=256, n_threads=2) as m:
        alone, together = _sessions(m, 4), _sessions(m, 4)
        batch = _core.SessionBatch(m._model)
        _step(batch, alone, together, [dict(tokens=_tokens(20 + i, 16), whole=True) for i in range(4)])
        for s in alone + together:
            s.commit(16)
        _step(batch, alone, together, [dict(tokens=_tokens(30 + i, 1)) for i in range(4)])
        for s in alone + together:
            s.commit(1)
        _same_state(alone, together)
        _step(batch, alone, together, [dict(tokens=_tokens(40 + i, 4), top_k=3) for i in range(4)])
        for group in (alone, together):
            for s, kept in zip(group, [4, 2, 0, 1]):
                s.commit(kept)
        _same_state(alone, together)
        _step(batch, alone, together, [dict(tokens=_tokens(50 + i, 2)) for i in range(4)])
        for s in alone + together:
            s.commit(2)
        _same_state(alone, together)
        assert [s.n_past for s in together] == [23, 21, 19, 20]


def test_rows_come_in_tiles_on_a_dense_target_on_the_cpu(target):
    """ggml's quantized CPU matmuls take rows four at a time (llama-bench on the 0.3B-cost qwen35 targets: 16
    rows cost less than 15, q8_0 and q4mix alike); a MoE target's time grows row by row (each expert takes its
    own rows: 2 rows 16.9 ms, 3 22.6, 4 28.2 on the qwen35moe q4mix target)."""
    moe = target._model.expert_memory[0] > 0
    assert _core.EvalBatcher(target._model).row_tile == (1 if moe else 4)


def test_a_batch_keeps_one_graph_whatever_order_its_parts_come_in(target):
    """The batcher's members hand in their parts in the order their threads reach the step: the same sessions'
    parts in another order are the same batch, evaluated by the graph already built and resident (before, a graph
    was kept per order: at 4 decoding streams one was made resident at 178 of 191 steps), with each session's
    results its own."""
    alone, together = _sessions(target), _sessions(target)
    batch = _core.SessionBatch(target._model)
    prompts = [_tokens(60 + i, 10) for i in range(3)]
    _step(batch, alone, together, [dict(tokens=p, whole=True) for p in prompts])
    for s in alone + together:
        s.commit(10)
    _step(batch, alone, together, [dict(tokens=_tokens(70 + i, 1)) for i in range(3)])
    for s in alone + together:
        s.commit(1)
    before = _core.graph_counters()
    order = [2, 0, 1]
    parts = [dict(tokens=_tokens(80 + i, 1)) for i in range(3)]
    solo = [alone[i].eval(**parts[i]) for i in order]
    batched = batch.eval([dict(session=together[i], **parts[i]) for i in order])
    assert _core.graph_counters() == before
    for a, b in zip(solo, batched):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_a_batch_refuses_what_it_cannot_evaluate(target):
    batch = _core.SessionBatch(target._model)
    a, b = _sessions(target, 2)
    with pytest.raises(ValueError, match="one session"):
        batch.eval([dict(session=a, tokens=[1]), dict(session=a, tokens=[2])])
    with pytest.raises(ValueError, match="unknown key 'token'"):
        batch.eval([dict(session=a, token=[1])])
    with pytest.raises(ValueError, match="needs 'session' and 'tokens'"):
        batch.eval([dict(session=a)])
    with pytest.raises(ValueError, match="top_k = 3, an earlier part 2"):
        batch.eval([dict(session=a, tokens=[1], top_k=2), dict(session=b, tokens=[1], top_k=3)])
    with pytest.raises(ValueError, match="no parts"):
        batch.eval([])
    with pytest.raises(IndexError, match="outside the vocabulary"):
        batch.eval([dict(session=a, tokens=[1]), dict(session=b, tokens=[10**6])])
    other = pydflash.Model(PAIRS / "qwen3-target-f32.gguf", n_ctx=64)
    with pytest.raises(ValueError, match="over another model"):
        batch.eval([dict(session=_core.Session(other._model, n_ctx=64), tokens=[1])])
    # nothing was left half-done: both sessions evaluate and commit as usual
    out = batch.eval([dict(session=a, tokens=[1, 2]), dict(session=b, tokens=[3])])
    a.commit(2)
    b.commit(1)
    assert (a.n_past, b.n_past) == (2, 1) and out[0][0].shape[0] == 2


# ---- generations in threads of their own, batched by an EvalBatcher ----
@pytest.fixture(scope="module", params=["qwen3", "qwen35"])
def pair(request):
    with pydflash.Model(PAIRS / f"{request.param}-target-q8_0.gguf",
                        draft_model_path=PAIRS / f"{request.param}-dflash-q8_0.gguf", n_ctx=512, n_threads=2,
                        n_ubatch=16) as m:
        yield m


MODES = [None, "chain", "tree", "auto"]  # None: plain decoding


def _jobs(model, n: int) -> list[dict]:
    """n generations of mixed prompt lengths and lengths, greedy and seeded sampling, plain and speculative
    (chain, tree, auto)"""
    jobs = []
    for i in range(n):
        sampling = {"seed": 100 + i, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05} if i % 2 else None
        jobs.append(dict(prompt=model.tokenize(PROMPTS[i % len(PROMPTS)] * (1 + i % 3)), max_tokens=8 + 5 * (i % 5),
                         mode=MODES[(i // 2) % len(MODES)], sampling=sampling))
    return jobs


def _generate(m, job: dict, batcher=None, callback=None) -> dict:
    mode = job["mode"]
    return m._session.generate(job["prompt"], max_tokens=job["max_tokens"],
                               stop_tokens=sorted(m.tokenizer.eog_token_ids), callback=callback,
                               draft=None if mode is None else m._draft, spec_mode=mode, tree_budget=6,
                               sampling=job["sampling"], batcher=batcher)


def _assert_near_tie(model, job: dict, tokens: list[int], expected: list[int]) -> None:
    at, near_tie = parts_at_a_near_tie(model, job["prompt"], tokens, expected, job["sampling"])
    assert near_tie, f"output {at}: {job}"


def _started_together(n: int, run) -> list:
    """run(k) for k in 0..n-1, each in a thread of its own, all released at once (so they batch from the start)"""
    barrier = threading.Barrier(n)

    def released(k: int):
        barrier.wait()
        return run(k)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(released, range(n)))


ROUND_COUNTS = ("n_rounds", "draft_n", "draft_n_accepted")  # equal when the drafts are


def test_sixteen_generations_in_threads_each_equal_alone(pair):
    """16 concurrent generations over 16 sessions, batched at every step, each commit what it commits alone (auto:
    up to near-ties, as its verifies are the batch's plan); chain and tree rounds draft, in the batch's drafter
    graphs, what they draft alone; the batcher really batched, planned and drafted together."""
    jobs = _jobs(pair, 16)
    sessions = [pair.new_session() for _ in jobs]
    alone = [_generate(pair.new_session(), job) for job in jobs]
    batcher = _core.EvalBatcher(pair._model)
    together = _started_together(len(jobs), lambda k: _generate(sessions[k], jobs[k], batcher))
    for k, (a, t) in enumerate(zip(alone, together)):
        if jobs[k]["mode"] == "auto" and t["tokens"] != a["tokens"]:
            # auto verifies what the batch plans, not what it chose alone: other shapes, which may round a
            # near-tie apart (tests/near_ties.py), and only there
            _assert_near_tie(pair, jobs[k], t["tokens"], a["tokens"])
            continue
        assert (t["tokens"], t["finish_reason"]) == (a["tokens"], a["finish_reason"]), f"job {k}: {jobs[k]}"
        if jobs[k]["mode"] in ("chain", "tree"):  # the same drafts (drafted in the batch's graphs): the same rounds
            assert [t["timings"][x] for x in ROUND_COUNTS] == [a["timings"][x] for x in ROUND_COUNTS], f"job {k}"
    stats = batcher.stats
    assert stats["batches"] > 0 and stats["batched_parts"] >= 2 * stats["batches"], stats
    assert sum(1 for t in together if t["timings"].get("n_rounds", 0) > 0) >= 4  # speculative rounds were batched
    assert stats["planned"] > 0, stats  # the auto generations' verifies were planned by the batch
    assert stats["batched_drafts"] >= 2 * stats["draft_batches"] > 0, stats  # and drafts drafted together


@pytest.mark.parametrize("arch,drafter", [("qwen3", "dflash"), ("qwen3", "dflash2"), ("qwen35", "dflash2")])
def test_drafts_drafted_together_are_each_sessions_own(arch, drafter):
    """Six chain and tree generations in threads: their drafts run in the batch's drafter graphs (several
    sessions' context rows and blocks in one graph; DFlash2's convolutions and selector per block), and each
    generation drafts what it drafts alone: the same tokens, rounds, drafted and accepted counts."""
    with pydflash.Model(PAIRS / f"{arch}-target-q8_0.gguf", draft_model_path=PAIRS / f"{arch}-{drafter}-q8_0.gguf",
                        n_ctx=512, n_threads=2, n_ubatch=16) as m:
        stops = sorted(m.tokenizer.eog_token_ids)
        jobs = [(m.tokenize(PROMPTS[i]), "chain" if i % 3 else "tree") for i in range(6)]

        def generate(s, job, batcher=None):
            return s._session.generate(job[0], max_tokens=24, stop_tokens=stops, draft=s._draft, spec_mode=job[1],
                                       tree_budget=6, batcher=batcher)

        alone = [generate(m.new_session(), job) for job in jobs]
        sessions = [m.new_session() for _ in jobs]
        batcher = _core.EvalBatcher(m._model)
        together = _started_together(len(jobs), lambda k: generate(sessions[k], jobs[k], batcher))
        for k, (a, t) in enumerate(zip(alone, together)):
            assert t["tokens"] == a["tokens"], f"job {k}"
            assert [t["timings"][x] for x in ROUND_COUNTS] == [a["timings"][x] for x in ROUND_COUNTS], f"job {k}"
        stats = batcher.stats
        assert stats["batched_drafts"] >= 2 * stats["draft_batches"] > 0, stats


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_mtp_steps_stepped_together_are_each_sessions_own(arch):
    """Eight generations drafting with the target's own MTP head (the trained heads), in threads: each round's
    head steps (step 0 over the queued rows and the anchor, then each next step from the carried state) run in
    the batch's head graphs, several sessions' rows in one graph with each head's attention over its own cache.
    Chain and tree generations (greedy, and one chain sampled with a seed) draft what they draft alone: the same
    tokens, rounds, drafted and accepted counts; auto generations, whose verifies the batch plans, commit the
    target's own greedy tokens (plain decoding alone) up to near-ties."""
    with pydflash.Model(PAIRS / f"{arch}-target-mtp-q8_0.gguf", n_ctx=512, n_threads=2, n_ubatch=16) as m:
        jobs = [dict(prompt=m.tokenize(PROMPTS[i]), max_tokens=40, mode=["chain", "tree", "auto", "chain"][i % 4],
                     sampling={"seed": 7, "temperature": 0.8, "top_k": 40} if i == 3 else None) for i in range(8)]

        def generate(s, job, batcher=None, mode=None):
            return s._session.generate(job["prompt"], max_tokens=job["max_tokens"],
                                       stop_tokens=sorted(m.tokenizer.eog_token_ids), mtp=s._mtp if mode else None,
                                       spec_mode=mode, tree_budget=6, sampling=job["sampling"], batcher=batcher)

        alone = [generate(m.new_session(), job, mode=job["mode"] if job["mode"] != "auto" else None)
                 for job in jobs]
        sessions = [m.new_session() for _ in jobs]
        batcher = _core.EvalBatcher(m._model)
        together = _started_together(len(jobs), lambda k: generate(sessions[k], jobs[k], batcher, jobs[k]["mode"]))
        for k, (a, t) in enumerate(zip(alone, together)):
            if jobs[k]["mode"] == "auto":
                if t["tokens"] != a["tokens"]:
                    _assert_near_tie(m, jobs[k], t["tokens"], a["tokens"])
                continue
            assert t["tokens"] == a["tokens"], f"job {k}"
            assert [t["timings"][x] for x in ROUND_COUNTS] == [a["timings"][x] for x in ROUND_COUNTS], f"job {k}"
            assert t["timings"]["draft_n_accepted"] > 0, f"job {k}"  # the trained head's drafts were accepted
        stats = batcher.stats
        assert stats["batched_head_steps"] >= 2 * stats["head_batches"] > 0, stats
        assert stats["draft_batches"] == 0 and stats["planned"] > 0, stats


def test_auto_generations_verify_what_the_batch_plans_and_commit_the_targets_tokens(pair):
    """Four greedy auto generations in one batch: after a first plain step (what a step of four parts costs),
    the batch plans their verifies together; each still commits the target's own greedy tokens (plain decoding
    of the same prompt alone), up to near-ties (tests/near_ties.py)."""
    prompts = [pair.tokenize(p) for p in PROMPTS[:4]]
    stops = sorted(pair.tokenizer.eog_token_ids)
    plain = [pair.new_session()._session.generate(p, max_tokens=40, stop_tokens=stops) for p in prompts]
    sessions = [pair.new_session() for _ in prompts]
    batcher = _core.EvalBatcher(pair._model)
    together = _started_together(len(prompts), lambda k: sessions[k]._session.generate(
        prompts[k], max_tokens=40, stop_tokens=stops, draft=sessions[k]._draft, spec_mode="auto", batcher=batcher))
    for k, (a, t) in enumerate(zip(plain, together)):
        if t["tokens"] != a["tokens"]:  # only where a batched verify and a single token round a near-tie apart
            at, near_tie = parts_at_a_near_tie(pair, prompts[k], t["tokens"], a["tokens"])
            assert near_tie, f"prompt {k}, output {at}"
    stats = batcher.stats
    assert stats["planned"] > 0, stats
    assert batcher.row_tile == 4  # (on the CPU, speculative steps in whole tiles of rows: models/model.h)


def test_a_cancelled_generation_leaves_the_others_unchanged(pair):
    jobs = _jobs(pair, 6)
    for job in jobs:
        job["max_tokens"] = 40
    alone = [_generate(pair.new_session(), job) for job in jobs]
    sessions = [pair.new_session() for _ in jobs]
    batcher = _core.EvalBatcher(pair._model)
    calls = [0]

    def stop_after_two(tokens) -> bool:  # job 1's consumer goes away after two batches of tokens
        calls[0] += 1
        return calls[0] < 2

    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda k: _generate(sessions[k], jobs[k], batcher,
                                                     stop_after_two if k == 1 else None), range(len(jobs))))
    cut = together[1]
    assert cut["finish_reason"] == "abort" and cut["tokens"] == alone[1]["tokens"][:len(cut["tokens"])]
    assert len(cut["tokens"]) < len(alone[1]["tokens"])
    for k in (0, 2, 3, 4, 5):
        assert together[k]["tokens"] == alone[k]["tokens"], k


def test_model_sessions_in_threads_batch_through_the_models_batcher(pair):
    """The Python API: Model.new_session() sessions generating in threads meet in the Model's batcher."""
    sessions = [pair.new_session() for _ in range(4)]
    alone = [pair.generate(PROMPTS[k], max_tokens=24, seed=k, temperature=0.7 * (k % 2)).tokens for k in range(4)]
    before = pair._batcher.stats["batches"]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda k: sessions[k].generate(PROMPTS[k], max_tokens=24, seed=k,
                                                                temperature=0.7 * (k % 2)).tokens, range(4)))
    for k, (t, a) in enumerate(zip(together, alone)):
        # auto's choices follow the times each session measured (`pair` has learnt, the new sessions have not), and
        # a verify of another shape rounds the logits otherwise: the runs part only at a near-tie
        if t != a:
            sampling = {"seed": k, "temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05} if k % 2 else None
            _assert_near_tie(pair, {"prompt": pair.tokenize(PROMPTS[k]), "sampling": sampling}, t, a)
    assert pair._batcher.stats["batches"] > before


def test_kept_graph_memory_counts_the_graphs_a_session_holds_while_it_lives(pair):
    """What the soak below subtracts from its resident memory: a session's graphs count while it lives, and stop
    counting when it is gone."""
    import gc

    gc.collect()  # (an earlier test's sessions in reference cycles go now, not inside the measurement)
    before = _core.kept_graph_memory()
    session = pair.new_session()
    session.generate(PROMPTS[0], max_tokens=6)  # a prefill and decode (and verify) graphs
    held = _core.kept_graph_memory()
    assert held["graphs"] > before["graphs"]
    # each graph's metadata: a ggml tensor header per node (~370 B) for a few hundred nodes at least
    assert held["bytes"] - before["bytes"] > (held["graphs"] - before["graphs"]) * 64 * 1024
    del session
    gc.collect()
    assert _core.kept_graph_memory() == before


def test_memory_stays_flat_over_a_thousand_batched_requests(pair, rss_measurable):
    import resource

    sessions = [pair.new_session() for _ in range(4)]

    def run(k: int, n: int) -> None:
        for i in range(n):
            sessions[k].generate(PROMPTS[(i + k) % len(PROMPTS)] + f"# {i}\n", max_tokens=3 + i % 4,
                                 temperature=0.5 * (i % 2), seed=i)

    def rss_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    def bounded_kib() -> tuple[int, int]:
        # what grows to a bound, not a leak: the compute buffers, to the largest graph run so far (bounded by the
        # plan), and the kept graphs' metadata, as shapes first met late (which a batch meets depends on thread
        # timing) fill empty places in each session's and batch's bounded cache of graphs (~160-270 KiB each:
        # 5.4-5.8 MiB over these requests, when RSS grew 4.4-6.8 MiB; beside them the limit below was thin)
        compute = sum(s.memory()["compute"]["cpu"] for s in sessions) + pair._batcher.compute_memory[0]
        return compute // 1024, _core.kept_graph_memory()["bytes"] // 1024

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda k: run(k, 50), range(4)))  # warm-up: graphs, allocator pools
        before, bounded_before = rss_kib(), bounded_kib()
        list(pool.map(lambda k: run(k, 250), range(4)))
        after, bounded_after = rss_kib(), bounded_kib()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0
    print(f"RSS {before / 1024:.1f} MiB after 200 requests, {after / 1024:.1f} MiB after 1200; compute buffers "
          f"{bounded_before[0] / 1024:.1f} -> {bounded_after[0] / 1024:.1f} MiB, kept graphs "
          f"{bounded_before[1] / 1024:.1f} -> {bounded_after[1] / 1024:.1f} MiB")
    grown = (after - before) - sum(max(0, a - b) for a, b in zip(bounded_after, bounded_before))
    assert grown < 8 * 1024, f"RSS grew by {grown / 1024:.1f} MiB over 1000 requests, beside the compute buffers " \
                             "and kept graphs"


def test_generate_batch_gives_each_prompt_its_own_completion(pair):
    prompts = [PROMPTS[i % len(PROMPTS)] * (1 + i % 2) for i in range(10)]
    alone = [pair.generate(p, max_tokens=20, temperature=0.7, seed=5) for p in prompts]
    before = pair._batcher.stats["batches"] if pair._batcher is not None else 0
    batched = pair.generate_batch(prompts, max_tokens=20, temperature=0.7, seed=5, parallel=4)
    assert [c.tokens for c in batched] == [c.tokens for c in alone]
    assert [c.text for c in batched] == [c.text for c in alone]
    assert [c.finish_reason for c in batched] == [c.finish_reason for c in alone]
    assert pair._batcher.stats["batches"] > before
    assert len(pair._batch_sessions) == 3  # kept for the next call
    assert [c.tokens for c in pair.generate_batch(prompts[:2], max_tokens=20, temperature=0.7, seed=5)] == \
        [c.tokens for c in alone[:2]]


@pytest.mark.parametrize("arch", ["qwen3", "qwen35"])
def test_plain_steps_run_part_by_part_where_a_part_alone_costs_less(arch):
    """Plain generations batched (a row per part): a step runs part by part, each part alone, where a part alone
    was measured to cost less than its share of a step together (state/eval_batcher.h; on a CPU at a real model's
    width two rows can cost more than two steps of one). Restored step times saying so make every step after the
    first run so (steps of 2, 3 and 4 parts); times saying the other (control) keep the steps together but for
    one check in 64. Either way each output is its own alone."""
    target = PAIRS / f"{arch}-target-q8_0.gguf"
    with pydflash.Model(target, n_ctx=256, n_threads=2) as m:
        alone = [m.generate(p, max_tokens=24).tokens for p in PROMPTS[:4]]
    for alone_ms, together_ms, part_by_part in ((0.1, 50.0, True), (50.0, 0.1, False)):
        forget_learnt_costs()  # (the loop's first load keeps its step times for the next)
        with pydflash.Model(target, n_ctx=256, n_threads=2) as m:
            m.new_session()  # (makes the model's batcher)
            m._batcher.restore_step_times({1: {1: alone_ms}, **{p: {p: together_ms} for p in (2, 3, 4)}})
            together = [c.tokens for c in m.generate_batch(PROMPTS[:4], max_tokens=24)]
            stats = m._batcher.stats
        assert together == alone, part_by_part
        if part_by_part:  # (the steps that hold a prompt have more rows than parts: together)
            assert stats["one_by_one"] >= 20 and stats["batches"] <= 3, stats
        else:
            assert stats["batches"] >= 20 and stats["one_by_one"] <= 1, stats


def test_generate_batch_checks_every_prompt_first(pair):
    from pydflash.errors import ContextLengthExceededError

    with pytest.raises(ContextLengthExceededError):
        pair.generate_batch(["def f():\n", "word " * 2000], max_tokens=4)
    with pytest.raises(ValueError, match="parallel"):
        pair.generate_batch(["a", "b"], parallel=0)
    with pytest.raises(TypeError):
        pair.generate_batch(["a", "b"], max_tokens=4, temprature=0.5)
    assert pair.generate_batch([], max_tokens=4) == []


def test_a_step_holds_at_most_two_prompt_micro_batches(pair):
    """Six long prompts arriving together (n_ubatch 16: three micro-batches each) beside short ones that decode:
    no batched step holds more than two prompt micro-batches (2 x 16 rows) besides the decoding streams' tokens
    (one each), and every generation still equals its solo output."""
    jobs = [dict(prompt=pair.tokenize(PROMPTS[i % len(PROMPTS)] * (4 if i < 6 else 1))[:44 if i < 6 else 12],
                 max_tokens=12, mode=None, sampling=None) for i in range(9)]
    alone = [_generate(pair.new_session(), job) for job in jobs]
    sessions = [pair.new_session() for _ in jobs]
    batcher = _core.EvalBatcher(pair._model)
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda k: _generate(sessions[k], jobs[k], batcher), range(len(jobs))))
    assert [t["tokens"] for t in together] == [a["tokens"] for a in alone]
    stats = batcher.stats
    # (all six first micro-batches at once would be 96 rows)
    assert stats["batches"] > 0 and 16 < stats["max_rows"] <= 2 * 16 + len(jobs), stats
