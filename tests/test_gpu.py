"""`pytest -m gpu`: the GPU build on a machine with a GPU (CUDA, HIP, Vulkan, Metal: ggml's first GPU device).
Skipped where pydflash was built without a GPU backend or no device is usable, which is every CI run; ready for
the day one is there (docs/building.md has the CUDA and HIP builds).

- CPU vs GPU: logits of both archs and the drafter's proposals, within f32 tolerance;
- speculative == plain on the GPU for chain, tree and auto (greedy: the output must be the target's own);
- sessions batched on the GPU (one target evaluation, drafter or MTP head graph per step) commit what they do alone;
- placement: what the load allocates on the GPU is what pydflash.plan says;
- MoE targets (qwen3moe, qwen35moe): logits and speculative == plain with the experts on the device or kept in
  system memory (n_cpu_moe);
- a speed table (printed; run with -s): plain tok/s, the cost of a verify of 16 over one decode step, and
  speculative tok/s on cost-realistic pairs (timings are reported, never asserted).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import pydflash
from pydflash import _core

from export_pairs import pair_file, prompt_rows  # noqa: E402
from near_ties import (ROUTER_TIE, TIE, first_difference, moe_experts, router_flips, router_gap,  # noqa: E402
                        routing_parts_at_a_tie, tie_gap, traced_routers)

pytestmark = pytest.mark.gpu

KINDS = ["qwen3", "qwen35"]


@pytest.fixture(scope="module", autouse=True)
def gpu():
    # tests/test_rpc.py runs this suite against an RPC device served by a CPU process (a device whose memory is
    # not the host's, as a GPU's): the process that registers it offloads every later model to it
    if os.environ.get("PYDFLASH_TEST_RPC"):
        _core.rpc_add_server(os.environ["PYDFLASH_TEST_RPC"])
    memory = _core.device_memory()
    if "gpu_free" not in memory:
        pytest.skip("no GPU device (a CPU-only build, or no usable device)")
    return memory


def _prompt() -> np.ndarray:
    tok = pydflash.Tokenizer.from_gguf(str(pair_file("qwen3", "target", "f32")))
    return np.array(tok.tokenize(prompt_rows("code")[0]["text"], add_special=False)[:48], dtype=np.int32)


@pytest.mark.parametrize("kind", KINDS)
def test_target_logits_cpu_vs_gpu(kind):
    path = str(pair_file(kind, "target", "f32"))
    tokens = _prompt()
    logits = {}
    for ngl in (0, -1):
        s = _core.Session(_core.Model(path, n_gpu_layers=ngl), n_ctx=256)
        logits[ngl], _ = s.eval(tokens)
    scale = np.abs(logits[0]).max()
    assert np.abs(logits[0] - logits[-1]).max() <= 2e-3 * scale


@pytest.mark.parametrize("kind", KINDS)
def test_draft_proposals_cpu_vs_gpu(kind):
    target, draft = str(pair_file(kind, "target", "f32")), str(pair_file(kind, "dflash", "f32"))
    tokens = _prompt()
    out = {}
    for ngl in (0, -1):
        m = _core.Model(target, n_gpu_layers=ngl)
        s = _core.Session(m, n_ctx=256)
        ds = _core.DraftSession(s, _core.DraftModel(m, draft), n_ctx=256, top_k=4)
        _, captured = s.eval(tokens, capture_layers=ds.capture_layers)
        feats = np.concatenate(captured, axis=1)
        out[ngl] = ds.draft(feats, np.arange(len(tokens), dtype=np.int32), int(tokens[-1]), len(tokens),
                            with_logprobs=True)
    ids0, lp0 = out[0]
    ids1, lp1 = out[-1]
    for pos in range(len(ids0)):
        # the same candidates, up to near-ties. Not f32 agreement: CUDA's flash attention rounds Q, K and V to f16
        # (seen on an H100: log-probabilities 2.8e-3 and 3.3e-3 apart), within the near-tie bound TIE = 1e-2 that
        # the CPU's batched and single-token evaluations are held to (tests/near_ties.py)
        gap = lp0[pos][0] - lp0[pos][1]
        assert ids0[pos][0] == ids1[pos][0] or gap < 1e-2, pos
        np.testing.assert_allclose(lp0[pos][0], lp1[pos][0], atol=1e-2)


@pytest.mark.parametrize("kind", KINDS)
def test_plain_decoding_over_long_windows_cpu_vs_gpu(kind):
    # One-token steps over windows of 256 slots and more, each step replaying the captured decode graph: CUDA's
    # flash-attention vector kernel runs there (a window a multiple of 256, one query). With Q placed right
    # before attention in the graph, an H100 decoded qwen3's greedy tokens wrong from the third on, right with
    # GGML_CUDA_DISABLE_GRAPHS=1 or a 200-slot window (models/attention.cpp: read from ggml's code, the kernel
    # loaded a stale Q).
    path = str(pair_file(kind, "target", "f32"))
    text = prompt_rows("code")[0]["text"]
    out = {}
    for ngl in (0, -1):
        with pydflash.Model(path, n_ctx=1024, n_gpu_layers=ngl, draft_model_path=None, proposers=()) as m:
            out[ngl] = m.generate(text, max_tokens=400, speculative=False).tokens
            prompt = m.tokenize(text)
    assert len(prompt) + len(out[-1]) > 256 + 64  # through the 256-slot window and past it
    if out[0] != out[-1]:
        k = first_difference(out[0], out[-1])
        with pydflash.Model(path, n_ctx=1024, draft_model_path=None, proposers=()) as cpu:
            assert tie_gap(cpu, prompt, out[0], out[-1], k) < TIE, k


@pytest.mark.parametrize("ngl,step,builds", [(-1, 256, 2), (0, 64, 5)])
def test_decode_graph_rebuilt_once_per_window_step(ngl, step, builds):
    # a rebuilt graph loses its CUDA graph (captured at its second run, replayed from its third), so on a GPU the
    # attended window grows in llama.cpp's 256-slot KV padding; on the CPU in 64-slot steps (state/session.cpp)
    path = str(pair_file("qwen3", "target", "f32"))
    s = _core.Session(_core.Model(path, n_gpu_layers=ngl), n_ctx=1024)
    assert s.kv_window_step == step
    s.eval(_prompt()[:40])
    s.commit(40)
    before = _core.graph_counters()["builds"]
    for _ in range(40, 300):  # one-token steps over windows of 256 then 512 slots (or 64, 128, ..., 320)
        s.eval(np.array([7], dtype=np.int32))
        s.commit(1)
    assert _core.graph_counters()["builds"] - before == builds


def _speculative_equals_plain(m, rows, max_tokens: int) -> None:
    for row in rows:
        plain = m.generate(row["text"], max_tokens=max_tokens, speculative=False)
        spec = m.generate(row["text"], max_tokens=max_tokens)
        if spec.tokens != plain.tokens:
            # a GPU's matmul kernels depend on the batch width (one token vs a verify), so a parting is allowed at
            # a near-tie of the target's logits only, as on the CPU (tests/near_ties.py). Seen on an H100: qwen3,
            # the first prompt's 4th token, 364 against 366 with logits 0.0093 apart (on the CPU too), where plain
            # single-token decoding took 366 and every speculative mode 364
            k = first_difference(spec.tokens, plain.tokens)
            assert tie_gap(m, m.tokenize(row["text"]), spec.tokens, plain.tokens, k) < TIE, k


@pytest.mark.parametrize("mode", ["chain", "tree", "auto"])
@pytest.mark.parametrize("kind", KINDS)
def test_speculative_equals_plain_on_the_gpu(kind, mode):
    target, draft = pair_file(kind, "target", "q8_0"), pair_file(kind, "dflash", "q8_0")
    with pydflash.Model(target, draft_model_path=draft, n_ctx=1024, n_gpu_layers=-1, spec_mode=mode) as m:
        _speculative_equals_plain(m, prompt_rows("code")[:4], 64)


@pytest.mark.parametrize("kind", ["qwen35", "qwen35moe"])
def test_every_proposer_merged_equals_plain_on_the_gpu(kind):
    """The drafter, the MTP head and n-gram lookup in one tree each round (decode/union_proposer.h), all layers on
    the GPU: plain decoding's output but at a near-tie, and each model drafts."""
    target, draft = pair_file(kind, "target-mtp", "q8_0"), pair_file(kind, "dflash", "q8_0")
    with pydflash.Model(target, draft_model_path=draft, n_ctx=1024, n_gpu_layers=-1,
                        proposers=("dflash", "ngram", "mtp")) as m:
        # a fresh model's first drafting rounds are probes: every model drafts
        by = m.generate(prompt_rows("code")[3]["text"], max_tokens=64).timings["by_proposer"]
        _speculative_equals_plain(m, prompt_rows("code")[:3], 64)
    assert by["dflash"]["ran"] > 0 and by["mtp"]["ran"] > 0, by


@pytest.mark.parametrize("proposer", ["dflash", "mtp"])
def test_batched_generations_equal_alone_on_the_gpu(proposer):
    """Four chain and tree generations of the qwen35 pair in threads, all layers on the GPU, batched at each step
    (one target evaluation, and one drafter graph or one MTP head graph per step, with the rings, caches and the
    head's carried states on the device): each commits what it commits alone (a GPU's kernels depend on the
    batch's width, so a parting is allowed at a near-tie of the target's logits only, as above), and its drafts
    are accepted. On the RPC device (the CPU's kernels: tests/test_rpc.py) each drafts exactly what it drafts
    alone: the same rounds, drafted and accepted counts."""
    from concurrent.futures import ThreadPoolExecutor
    import threading

    draft = pair_file("qwen35", "dflash", "q8_0") if proposer == "dflash" else None
    with pydflash.Model(pair_file("qwen35", "target-mtp", "q8_0"), draft_model_path=draft, n_ctx=512,
                        n_gpu_layers=-1, proposers=(proposer,)) as m:
        jobs = [(m.tokenize(r["text"])[:40], "chain" if i % 2 else "tree")
                for i, r in enumerate(prompt_rows("code")[:4])]

        def generate(s, job, batcher=None):
            return s._session.generate(job[0], max_tokens=32, stop_tokens=[], draft=s._draft, mtp=s._mtp,
                                       spec_mode=job[1], tree_budget=6, batcher=batcher)

        alone = [generate(m.new_session(), job) for job in jobs]
        sessions = [m.new_session() for _ in jobs]
        batcher = _core.EvalBatcher(m._model)
        barrier = threading.Barrier(len(jobs))

        def released(k: int):  # all at once, so that they batch from the start
            barrier.wait()
            return generate(sessions[k], jobs[k], batcher)

        with ThreadPoolExecutor(len(jobs)) as pool:
            together = list(pool.map(released, range(len(jobs))))
        counts = ("n_rounds", "draft_n", "draft_n_accepted")
        for k, (a, t) in enumerate(zip(alone, together)):
            assert t["timings"]["draft_n_accepted"] > 0, f"job {k}"
            if os.environ.get("PYDFLASH_TEST_RPC"):
                assert t["tokens"] == a["tokens"], f"job {k}"
                assert [t["timings"][x] for x in counts] == [a["timings"][x] for x in counts], f"job {k}"
            elif t["tokens"] != a["tokens"]:
                at = first_difference(t["tokens"], a["tokens"])
                assert tie_gap(m, jobs[k][0], t["tokens"], a["tokens"], at) < TIE, f"job {k}, output {at}"
        stats = batcher.stats
        assert batcher.row_tile == 1  # (a GPU's step costs the same at any rows: models/model.h verify_row_tile)
    assert stats["batches"] > 0 and (stats["draft_batches"] if proposer == "dflash" else stats["head_batches"]) > 0


@pytest.mark.parametrize("n_gpu_layers", [2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_partial_offload(kind, n_gpu_layers):
    """The last layers and the head on the GPU, the first on the CPU (as a model too large for the card is run):
    the graph crosses devices inside the layer stack, the drafter reads features captured on both into a ring
    on the GPU. Logits as the CPU's; speculative == plain for chain and tree (a parting at a near-tie only)."""
    tokens = _prompt()
    f32 = str(pair_file(kind, "target", "f32"))
    logits = {}
    for ngl in (0, n_gpu_layers):
        logits[ngl], _ = _core.Session(_core.Model(f32, n_gpu_layers=ngl), n_ctx=256).eval(tokens)
    assert np.abs(logits[0] - logits[n_gpu_layers]).max() <= 2e-3 * np.abs(logits[0]).max()
    target, draft = pair_file(kind, "target", "q8_0"), pair_file(kind, "dflash", "q8_0")
    for mode in ("chain", "tree"):
        with pydflash.Model(target, draft_model_path=draft, n_ctx=1024, n_gpu_layers=n_gpu_layers,
                            spec_mode=mode) as m:
            placed = {d for _, d, _ in m._model.placement}
            assert placed == {"cpu", "gpu"}, placed
            _speculative_equals_plain(m, prompt_rows("code")[:2], 48)


@pytest.mark.parametrize("kind", KINDS)
def test_gpu_allocations_are_the_plan(kind):
    target, draft = pair_file(kind, "target", "q8_0"), pair_file(kind, "dflash", "q8_0")
    config = dict(n_ctx=512, n_ubatch=128, n_gpu_layers=-1, spec_mode="chain")
    plan = pydflash.plan(target, draft, **config)
    with pydflash.Model(target, draft_model_path=draft, **config) as m:
        real = m.memory()
    for c in ("weights", "kv", "recurrent", "ring", "draft"):
        assert real[c] == plan.bytes[c], c
    assert real["weights"]["gpu"] > 0 and real["kv"]["gpu"] > 0


# --------------------------------------------------------------------------------------------------
# MoE targets, their experts on the device or kept in system memory (n_cpu_moe, llama.cpp's --n-cpu-moe)

MOE_ARCHS = ["qwen3moe", "qwen35moe"]


@pytest.fixture(scope="module")
def moe_pairs(tmp_path_factory):
    """{arch: (f32 target, q8_0 target, q8_0 drafter)}: the committed trained MoE pairs (32 experts, top 4), the
    target also dequantized to f32. Trained, not random, routers and weights: an H200 ran these tests on tiny
    random MoE checkpoints first, whose near-uniform routers and untrained layers amplified the device's rounding
    (2e-3 relative at layer 0's output in a batch) about fivefold per layer, to 10% of the logits by
    the fifth, with one expert swapped in 36 tokens x 5 layers (docs/benchmarks.md, "On an H200")."""
    from test_qwen3moe import dequantized_copy

    out = {}
    for arch in MOE_ARCHS:
        target = pair_file(arch, "target", "q8_0")
        f32 = dequantized_copy(target, tmp_path_factory.mktemp(arch) / "target-f32.gguf")
        out[arch] = (f32, target, pair_file(arch, "dflash", "q8_0"))
    return out


@pytest.mark.parametrize("n_cpu_moe", [0, 2, -1])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_logits_with_experts_on_either_side(moe_pairs, arch, n_cpu_moe):
    """Every layer on the device, the experts of the first n_cpu_moe layers in system memory (the graph goes to
    the CPU for those mul_mat_ids and back): the all-CPU logits up to the first token the two route to other
    experts, which they may only at a router near-tie (tests/near_ties.py); layer 0's output on every token it
    routes alike; the experts' buffers where asked, as planned."""
    target, _, _ = moe_pairs[arch]
    _, k = moe_experts(target)
    tokens = _prompt()
    model = _core.Model(str(target), n_gpu_layers=-1, n_cpu_moe=n_cpu_moe)
    # f32 K/V: closer to the CPU's f32 path (CUDA's flash attention still rounds Q, K and V to f16)
    sessions = [_core.Session(m, n_ctx=256, type_k="f32", type_v="f32") for m in (_core.Model(str(target)), model)]
    (cpu, cpu_routers), (dev, dev_routers) = (traced_routers(s, tokens) for s in sessions)
    flips = router_flips(cpu_routers, dev_routers, k)
    for layer, t in flips:
        assert router_gap(cpu_routers[layer], k)[t] < ROUTER_TIE, (layer, t)
    first = min((t for _, t in flips), default=len(tokens))
    assert np.abs(cpu[:first] - dev[:first]).max(initial=0.0) <= 2e-3 * np.abs(cpu).max()
    # layer 0's output of a token depends on layer 0's routing of that token only
    same = [t for t in range(len(tokens)) if (0, t) not in flips]
    for s in sessions:
        s.truncate(0)
    (_, cpu_l0), (_, dev_l0) = (traced_routers(s, tokens, "l_out-0") for s in sessions)
    assert len(same) >= len(tokens) // 2
    assert np.abs(cpu_l0[0][same] - dev_l0[0][same]).max() <= 2e-3 * np.abs(cpu_l0[0]).max()
    kept = model.n_layer if n_cpu_moe < 0 else n_cpu_moe
    for name, device, _ in model.placement:
        if "_exps" in name:
            assert device == ("cpu" if int(name.split(".")[1]) < kept else "gpu"), name
        elif name.startswith("blk."):
            assert device == "gpu", name
    plan = pydflash.plan(target, n_ctx=256, n_gpu_layers=-1, n_cpu_moe=n_cpu_moe, sweep=False)
    assert tuple(plan.experts.values()) == model.expert_memory


@pytest.mark.parametrize("n_cpu_moe", [0, 2])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_speculative_equals_plain_on_the_gpu(moe_pairs, arch, n_cpu_moe):
    """Greedy speculation's tokens are plain decoding's, or part from them at a near-tie: of the target's logits,
    or of a router that a verify's batch then routes otherwise than a decode step (tests/near_ties.py)."""
    _, target, draft = moe_pairs[arch]
    _, k_used = moe_experts(target)
    for mode in ("chain", "tree", "auto"):
        with pydflash.Model(target, draft_model_path=draft, n_ctx=1024, n_gpu_layers=-1, n_cpu_moe=n_cpu_moe,
                            spec_mode=mode) as m:
            for row in prompt_rows("code")[:3]:
                prompt = m.tokenize(row["text"])
                plain = m.generate(prompt, max_tokens=64, speculative=False).tokens
                spec = m.generate(prompt, max_tokens=64).tokens
                if spec != plain:  # the device's rounding may part them at a near-tie only
                    k = first_difference(spec, plain)
                    assert (tie_gap(m, prompt, spec, plain, k) < TIE
                            or routing_parts_at_a_tie(m, prompt, plain, k, k_used)), (mode, k)


def test_speed_table(tmp_path):
    """Printed, not asserted: plain decode, verify(16)/decode cost, speculative tok/s on cost-realistic pairs."""
    from pydflash.convert.inflate import inflate_gguf

    print(f"\n{'pair':10} {'plain tok/s':>12} {'verify16/AR':>12} {'chain tok/s':>12} {'auto tok/s':>11}")
    for kind in KINDS:
        big = inflate_gguf(pair_file(kind, "target", "f32"), tmp_path / f"{kind}.gguf", "q4mix", n_ff=8192,
                           extra_layers=8, progress=False)
        draft = pair_file(kind, "dflash", "q8_0")
        m = _core.Model(str(big), n_gpu_layers=-1)
        s = _core.Session(m, n_ctx=512)
        tokens = np.arange(1, 17, dtype=np.int32)
        timings = {}
        for n in (1, 16):
            s.eval(tokens[:n])  # graph built
            t0 = time.perf_counter()
            for _ in range(20):
                s.eval(tokens[:n])
            timings[n] = (time.perf_counter() - t0) / 20
        rates = {}
        with pydflash.Model(big, draft_model_path=draft, n_ctx=1024, n_gpu_layers=-1) as model:
            text = prompt_rows("code")[0]["text"]
            for mode in ("plain", "chain", "auto"):
                model.spec_mode = "chain" if mode == "plain" else mode
                c = model.generate(text, max_tokens=128, speculative=mode != "plain")
                rates[mode] = c.timings["predicted_n"] / (c.timings["predicted_ms"] / 1000)
        print(f"{kind:10} {rates['plain']:12.1f} {timings[16] / timings[1]:12.2f} {rates['chain']:12.1f} "
              f"{rates['auto']:11.1f}")
