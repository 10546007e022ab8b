"""The Qwen3.5 hybrid target: logits against transformers, and rollback of the recurrent state to any verified
token without re-running the target (the reference is a fresh session that only saw the kept tokens:
transformers' cache crop() does not roll back recurrent state)."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_models import QWEN35_SHAPES, final_pre_norm_hidden, make_qwen35_shape  # noqa: E402

import pydflash  # noqa: E402
from pydflash import _core  # noqa: E402
from pydflash.convert import convert_hf_to_gguf  # noqa: E402

PROMPT = [3, 17, 200, 45, 9, 311, 77, 5, 128, 64, 400, 12]
TOL = 1e-4  # f32 weights and cache: relative to the largest |logit|; measured ~1e-6..1e-5


@pytest.fixture(scope="module", params=sorted(QWEN35_SHAPES))
def checkpoint(request, tmp_path_factory):
    d = make_qwen35_shape(tmp_path_factory.mktemp(request.param) / "hf", request.param, seed=3)
    gguf_path = convert_hf_to_gguf(d, d.parent / "model-f32.gguf", outtype="f32", progress=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return d, gguf_path, ref


def session(gguf_path, n_rollback=16):
    return _core.Session(_core.Model(str(gguf_path)), n_ctx=512, type_k="f32", type_v="f32", n_rollback=n_rollback)


def close(a, b, scale=None):
    scale = np.abs(b).max() if scale is None else scale
    return np.abs(a - b).max() <= TOL * scale


def test_logits_match_transformers(checkpoint):
    _, gguf_path, ref = checkpoint
    ours, _ = session(gguf_path).eval(np.array(PROMPT, dtype=np.int32))
    with torch.no_grad():
        theirs = ref(torch.tensor([PROMPT])).logits[0].numpy()
    print(f"max relative error vs transformers: {np.abs(ours - theirs).max() / np.abs(theirs).max():.2e}")
    assert close(ours, theirs)


def test_hidden_state_capture_matches_transformers(checkpoint):
    _, gguf_path, ref = checkpoint
    s = session(gguf_path)
    n_layer = _core.Model(str(gguf_path)).n_layer
    _, captured = s.eval(np.array(PROMPT, dtype=np.int32), capture_layers=list(range(n_layer)))
    with torch.no_grad():
        hs = ref(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    for il, ours in enumerate(captured):
        assert close(ours, hs[il][0].numpy()), il


def test_last_token_only_prefill_matches_transformers(checkpoint):
    """all_logits=False runs the last layer (attention or GDN) past its K/V and state writes for the last token
    only; the next token still reads every token's K/V and state, and capturing the final hidden state keeps
    the layer whole."""
    _, gguf_path, ref = checkpoint
    s = session(gguf_path)
    n_layer = _core.Model(str(gguf_path)).n_layer
    with torch.no_grad():
        theirs = ref(torch.tensor([PROMPT + [7]])).logits[0].numpy()
    scale = np.abs(theirs).max()
    last, _ = s.eval(np.array(PROMPT, dtype=np.int32), all_logits=False)
    assert last.shape == (1, theirs.shape[1])
    assert close(last[0], theirs[-2], scale)
    s.commit(len(PROMPT))
    nxt, _ = s.eval(np.array([7], dtype=np.int32), all_logits=False)
    assert close(nxt[0], theirs[-1], scale)

    s.truncate(0)
    last, (final,) = s.eval(np.array(PROMPT, dtype=np.int32), all_logits=False, capture_layers=[n_layer])
    assert close(last[0], theirs[-2], scale)
    pre_norm = final_pre_norm_hidden(ref, PROMPT)
    assert final.shape == pre_norm.shape
    assert close(final, pre_norm)


def test_greedy_continuation_matches_transformers(checkpoint):
    from test_qwen3 import assert_greedy_matches_transformers

    _, gguf_path, ref = checkpoint
    assert_greedy_matches_transformers(gguf_path, ref, PROMPT)


def test_batched_eval_equals_single_steps(checkpoint):
    _, gguf_path, _ = checkpoint
    batched, _ = session(gguf_path).eval(np.array(PROMPT, dtype=np.int32))
    s = session(gguf_path)
    rows = []
    for t in PROMPT:
        logits, _ = s.eval(np.array([t], dtype=np.int32))
        s.commit(1)
        rows.append(logits[0])
    assert close(np.array(rows), batched)


def test_commit_at_every_token_equals_a_fresh_session(checkpoint):
    """Evaluate N tokens, keep the first i (0..N), continue: same logits as a session that saw only those."""
    _, gguf_path, _ = checkpoint
    prefix, block, after = PROMPT[:4], [21, 22, 23, 24, 25, 26, 27, 28], 99
    for i in range(len(block) + 1):
        s = session(gguf_path)
        s.eval(np.array(prefix, dtype=np.int32))
        s.commit(len(prefix))
        s.eval(np.array(block, dtype=np.int32))
        s.commit(i)
        ours, _ = s.eval(np.array([after], dtype=np.int32))

        fresh = session(gguf_path)
        kept = prefix + block[:i]
        fresh.eval(np.array(kept, dtype=np.int32))
        fresh.commit(len(kept))
        theirs, _ = fresh.eval(np.array([after], dtype=np.int32))
        assert close(ours, theirs), i


def test_uncommitted_eval_leaves_the_state_untouched(checkpoint):
    _, gguf_path, _ = checkpoint
    s = session(gguf_path)
    s.eval(np.array(PROMPT[:5], dtype=np.int32))
    s.commit(5)
    s.eval(np.array([30, 31, 32], dtype=np.int32))  # never committed
    ours, _ = s.eval(np.array([PROMPT[5]], dtype=np.int32))
    theirs, _ = session(gguf_path).eval(np.array(PROMPT[:6], dtype=np.int32))
    assert close(ours[0], theirs[-1])


def test_many_rollbacks_do_not_drift(checkpoint):
    """A random drafter: every round verifies up to 16 tokens and keeps a random prefix, 200+ rounds; the
    logits of every kept token must equal plain one-token-at-a-time decoding of the kept sequence."""
    _, gguf_path, _ = checkpoint
    rng = np.random.default_rng(0)
    n_vocab = _core.Model(str(gguf_path)).n_vocab
    spec, plain = session(gguf_path), session(gguf_path)
    spec.eval(np.array(PROMPT[:3], dtype=np.int32))
    spec.commit(3)
    plain.eval(np.array(PROMPT[:3], dtype=np.int32))
    plain.commit(3)
    errors = []
    for _ in range(210):
        n = int(rng.integers(1, 17))
        block = rng.integers(0, n_vocab, n).astype(np.int32)
        logits, _ = spec.eval(block)
        keep = int(rng.integers(1, n + 1))
        spec.commit(keep)
        for j in range(keep):
            expected, _ = plain.eval(block[j:j + 1])
            plain.commit(1)
            errors.append(np.abs(logits[j] - expected[0]).max() / np.abs(expected[0]).max())
        if spec.n_past > 400:
            break
    assert spec.n_past == plain.n_past
    # A batched evaluation rounds differently from single tokens (tinyBLAS vs gemv matmuls), and a gated
    # delta net carries that into its state: measured max relative error 1.4e-4 on k8v32_hd8 (many 8-wide
    # heads), <= 2.5e-5 on the other shapes. A rollback bug is O(1); drift would grow with the rounds.
    errors = np.array(errors)
    assert errors.max() <= 3 * TOL, errors.max()
    assert errors[-50:].max() <= 2 * errors[:50].max() + 1e-5, (errors[:50].max(), errors[-50:].max())


def test_a_whole_eval_keeps_only_the_final_state(checkpoint):
    """A prefill micro-batch (whole=True) writes no per-token states: committed whole it continues exactly as
    an eval that kept them (the same kernel, bit for bit); a partial commit of it is a typed error, and an
    uncommitted one still rolls back."""
    _, gguf_path, _ = checkpoint
    results = []
    for whole in (False, True):
        s = session(gguf_path)
        first, _ = s.eval(np.array(PROMPT, dtype=np.int32), whole=whole)
        s.commit(len(PROMPT))
        nxt, _ = s.eval(np.array([7, 8], dtype=np.int32))
        results.append((first, nxt))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
    s = session(gguf_path)
    s.eval(np.array(PROMPT, dtype=np.int32), whole=True)
    with pytest.raises(IndexError, match="cannot keep 5 of 12"):
        s.commit(5)
    s.eval(np.array(PROMPT[:5], dtype=np.int32))  # the whole eval was never committed: rolled back
    s.commit(5)
    ours, _ = s.eval(np.array([PROMPT[5]], dtype=np.int32))
    theirs, _ = session(gguf_path).eval(np.array(PROMPT[:6], dtype=np.int32))
    assert close(ours[0], theirs[-1])


def test_rollback_limits_are_typed_errors(checkpoint):
    _, gguf_path, _ = checkpoint
    s = session(gguf_path, n_rollback=4)
    s.eval(np.arange(1, 9, dtype=np.int32))  # 8 tokens > n_rollback: only the last 4 can be committed
    with pytest.raises(IndexError, match="only for the last 4 tokens"):
        s.commit(2)
    s.commit(5)
    with pytest.raises(ValueError, match="cannot be cut back"):
        s.truncate(3)
    s.truncate(0)  # a reset is fine
    assert s.n_past == 0
    # also straight after an uncommitted eval longer than the snapshots reach, and the state is the empty one
    fresh_logits, _ = session(gguf_path, n_rollback=4).eval(np.arange(3, 6, dtype=np.int32))
    s.eval(np.arange(1, 9, dtype=np.int32))
    s.truncate(0)
    logits, _ = s.eval(np.arange(3, 6, dtype=np.int32))
    np.testing.assert_array_equal(logits, fresh_logits)


def test_generate_with_prompt_cache(checkpoint):
    """The prompt cache of a hybrid model: the recurrent state is kept where the last prompt's last whole
    micro-batch ended and at its end; a prompt continues from one of them or starts over, and gives what a
    fresh model gives."""
    _, gguf_path, _ = checkpoint
    opts = dict(n_ctx=256, kv_type="f32", n_ubatch=4)
    assert len(PROMPT) % 4 == 0
    with pydflash.Model(gguf_path, **opts) as m:
        a = m.generate(PROMPT, max_tokens=8)
        again = m.generate(PROMPT, max_tokens=8)  # the same prompt: nothing evaluated
        assert again.timings["cached_n"] == len(PROMPT) and again.tokens == a.tokens
        b = m.generate(PROMPT[:6], max_tokens=8)  # no state kept at 4: starts over
        assert b.timings["cached_n"] == 0
        c = m.generate(PROMPT[:6] + b.tokens, max_tokens=8)  # from the state after 4 tokens
        assert c.timings["cached_n"] == 4
        d = m.generate(PROMPT[:6] + b.tokens, max_tokens=8)
        assert d.timings["cached_n"] == 6 + len(b.tokens) and d.tokens == c.tokens
    for prompt, expected in [(PROMPT, a.tokens), (PROMPT[:6], b.tokens), (PROMPT[:6] + b.tokens, c.tokens)]:
        with pydflash.Model(gguf_path, **opts) as fresh:
            assert fresh.generate(prompt, max_tokens=8).tokens == expected


@pytest.mark.parametrize("weights, kv, bound", [("q8_0", "f32", 0.3), ("q4_0", "f32", 5.0), ("f32", "q8_0", 0.05),
                                                ("f32", "q4_0", 2.0), ("q4_k_m", "q8_0", 2.0)])
def test_quantized_weights_and_kv_stay_close_to_f32(checkpoint, tmp_path, weights, kv, bound):
    """Mean KL(f32 run || quantized run) over 64 tokens; bounds stated as in test_qwen3 (random toys are
    sensitive; measured values are printed)."""
    from test_qwen3 import kl_divergence

    from pydflash.convert.quantize import quantize_gguf

    _, gguf_path, _ = checkpoint
    seq = np.array((PROMPT * 6)[:64], dtype=np.int32)
    base, _ = session(gguf_path).eval(seq)
    path = gguf_path if weights == "f32" else quantize_gguf(gguf_path, tmp_path / f"{weights}.gguf", weights,
                                                            progress=False)
    model = _core.Model(str(path))
    config = json.loads((checkpoint[0] / "config.json").read_text())
    head_dim = config.get("text_config", config)["head_dim"]
    if kv != "f32" and head_dim % 32:
        with pytest.raises(ValueError, match="need head sizes divisible by 32"):
            _core.Session(model, n_ctx=128, type_k=kv, type_v=kv)
        return
    s = _core.Session(model, n_ctx=128, type_k=kv, type_v=kv)
    rows = []
    for i in range(0, len(seq), 16):
        logits, _ = s.eval(seq[i:i + 16])
        s.commit(16)
        rows.append(logits)
    kl = kl_divergence(base, np.concatenate(rows))
    print(f"weights {weights}, kv {kv}: mean KL vs f32 = {kl:.2e}")
    assert kl <= bound


@pytest.mark.parametrize("n", [64, 150, 333])
def test_chunked_delta_rule_matches_the_fused_one(checkpoint, n):
    """A prefill micro-batch in the chunked form of the delta rule (models/delta_net.h: chunks of 64 tokens
    as matmuls and a triangular solve, the last one padded) against ggml's fused token-by-token op: the
    state it leaves in every recurrent layer within 1e-4 of the state's largest entry (f32 models), the logits
    of its last token and of the tokens after it within the tolerance used against transformers."""
    _, gguf_path, _ = checkpoint
    rng = np.random.default_rng(n)
    tokens = rng.integers(1, 400, size=n).astype(np.int32)
    runs = {}
    for form in ("fused", "chunked"):
        s = _core.Session(_core.Model(str(gguf_path), delta_net=form), n_ctx=1024, n_rollback=16)
        last, _ = s.eval(tokens, whole=True, all_logits=False)
        s.commit(n)
        states = {}
        for il in range(64):  # (the shapes have fewer layers; attention layers have no state)
            try:
                states[il] = s.ssm_state(il)
            except IndexError:
                continue
        after, _ = s.eval(np.array([7, 8, 9], dtype=np.int32))
        runs[form] = (last, states, after)
    (f_last, f_states, f_after), (c_last, c_states, c_after) = runs["fused"], runs["chunked"]
    assert f_states.keys() == c_states.keys() and f_states
    for il in f_states:
        scale = np.abs(f_states[il]).max()
        assert np.abs(f_states[il] - c_states[il]).max() <= 1e-4 * scale, il
    assert close(c_last[-1], f_last[-1])
    assert close(c_after, f_after)


def test_generation_after_a_chunked_prefill_is_the_same():
    """On the trained f32 Qwen3.5 pair, a long prompt prefilled in 128-token micro-batches: greedy generation
    after the chunked prefill equals generation after the fused one, plain and speculative."""
    from export_pairs import pair_file, prompt_rows

    target, draft = pair_file("qwen35", "target", "f32"), pair_file("qwen35", "dflash", "f32")
    prompt = "\n".join(r["text"] for r in prompt_rows("code")[:6])
    outs = {}
    for form in ("fused", "chunked"):
        with pydflash.Model(target, draft_model_path=draft, n_ctx=2048, n_ubatch=128, delta_net=form) as m:
            assert len(m.tokenize(prompt)) > 3 * 128
            outs[form] = (m.generate(prompt, max_tokens=48, speculative=False).tokens,
                          m.generate(prompt, max_tokens=48).tokens)
    assert outs["chunked"] == outs["fused"]
