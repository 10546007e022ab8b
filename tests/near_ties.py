"""Near-ties: where two tokens' logits are so close that batched and single-token evaluations may pick either.

Batched (verify, prefill) and single-token evaluations round differently (matmul kernels tile by batch width,
f16 KV rounding); where two tokens' logits are closer than TIE, either is the target's greedy choice (measured:
2e-3, 8e-3 on the q8_0 qwen3 pair; tests/test_peer.py uses it for llama-simple vs ours)."""

from __future__ import annotations

import numpy as np

from pydflash import _core

import sampling_ref as ref

TIE = 1e-2


def tie_gap(model, prompt_ids, tokens, other, k) -> float:
    """|logit(tokens[k]) - logit(other[k])| after prompt + tokens[:k], from one batched evaluation of ours."""
    s = _core.Session(model._model, n_ctx=model.n_ctx)
    logits, _ = s.eval(np.array(list(prompt_ids) + list(tokens[:k]), dtype=np.int32), all_logits=True)
    return float(abs(logits[-1][tokens[k]] - logits[-1][other[k]]))


def rounding_spread(model, prompt_ids, tokens, k) -> float:
    """How far the CPU's kernels round output position k's logits apart: the largest |difference| over the vocabulary
    between one batched evaluation of prompt + tokens[:k] (as a verify sees them) and the same tokens decoded one at
    a time after the prompt (as plain decoding does). Random q8_0 checkpoints reach 0.4-0.6 on an AVX2-only EPYC
    (logits up to ~34), far above TIE: a parting there is a near-tie of those two evaluations, not of TIE."""
    if k == 0:  # the first token comes from the prompt's pass in both
        return 0.0
    s = _core.Session(model._model, n_ctx=model.n_ctx)
    batched, _ = s.eval(np.array(list(prompt_ids) + list(tokens[:k]), dtype=np.int32), all_logits=True)
    s = session_after(model, prompt_ids)
    for t in tokens[:k]:
        row, _ = s.eval(np.array([t], dtype=np.int32), all_logits=False)
        s.commit(1)
    return float(np.abs(np.asarray(batched[-1]) - np.asarray(row[-1])).max())


def first_difference(a, b) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def draw_is_fragile(model, prompt_ids, tokens, k, sampling: dict) -> bool:
    """Whether the draw of output position k after prompt + tokens[:k] (batched logits of ours) is a near-tie:
    logit noise of TIE can change it, either the candidates the chain keeps or the Gumbel-max that picks among
    them (its winning margin, in log-probability, under 2 * TIE / temperature). The sampling counterpart of
    tie_gap (tests/sampling_ref.py is the reference)."""
    history = list(prompt_ids) + list(tokens[:k])
    s = _core.Session(model._model, n_ctx=model.n_ctx)
    logits, _ = s.eval(np.array(history, dtype=np.int32), all_logits=False)
    row = np.asarray(logits[-1], dtype=np.float32)
    params = {key: v for key, v in sampling.items() if key != "seed"}
    ids, probs = ref.distribution(row, history, **params)
    _, margin = ref.draw(ids, probs, sampling["seed"], k)
    temperature = params.get("temperature", 1.0)
    if temperature > 0 and margin < 2 * TIE / temperature:
        return True
    rng = np.random.default_rng(k)
    for _ in range(16):  # the candidate set (top-k / top-p / min-p / typical boundaries, greedy near-ties)
        noisy = row + rng.uniform(-TIE / 2, TIE / 2, size=row.shape).astype(np.float32)
        noisy_ids, _ = ref.distribution(noisy, history, **params)
        if not np.array_equal(noisy_ids, ids):
            return True
    return False


def parts_at_a_near_tie(model, prompt_ids, tokens, other, sampling: dict | None = None) -> tuple[int, bool]:
    """(k, whether it is a near-tie) for the first output position k where tokens and other differ: greedy
    (sampling None) by tie_gap < TIE, sampled (generate()'s sampling keywords, seed included) by
    draw_is_fragile."""
    k = first_difference(tokens, other)
    if sampling is None:
        return k, tie_gap(model, prompt_ids, tokens, other, k) < TIE
    return k, draw_is_fragile(model, prompt_ids, tokens, k, sampling)


# MoE routers: a token's k-th and (k+1)-th experts whose router logits nearly tie may swap under the same rounding
# differences (the device's f16 flash attention, a verify's batched kernels against a decode step's), and the
# token then takes another expert: its hidden state, and every later token's, changes by far more than TIE.
# Tiny random checkpoints' routers are near-uniform, so such ties are common there (relative gaps down to 3e-4 in
# 36 tokens x 3 layers; an H200 swapped experts at 3e-4 and 2e-3 against the CPU, docs/benchmarks.md).
ROUTER_TIE = 1e-2  # relative to the token's largest |router logit|


def moe_experts(path) -> tuple[int, int]:
    """(experts, experts each token takes) of a MoE GGUF, from its metadata."""
    import gguf

    fields = gguf.GGUFReader(path).fields
    arch = fields["general.architecture"].contents()
    return int(fields[f"{arch}.expert_count"].contents()), int(fields[f"{arch}.expert_used_count"].contents())


def traced_routers(session, tokens, prefix: str = "ffn_moe_logits-") -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """(every token's logits, {layer: traced node [n, ...]}) of evaluating tokens in one batch after what the
    session holds. The router logits are traced before the routing nodes, so that a fused routing kernel
    (CUDA's top-k MoE) still runs whole."""
    session.trace_nodes(prefix)
    session.take_trace()
    logits, _ = session.eval(np.asarray(tokens, dtype=np.int32), all_logits=True)
    trace = session.take_trace()
    session.trace_nodes("")
    return logits, {int(name.rsplit("-", 1)[1]): node for name, node in trace.items()}


def session_after(model, prompt_ids):
    """A fresh session of the Model's weights holding the prompt, committed."""
    s = _core.Session(model._model, n_ctx=model.n_ctx)
    s.eval(np.array(prompt_ids, dtype=np.int32), all_logits=False)
    s.commit(len(prompt_ids))
    return s


def stepped_routers(session, tokens) -> dict[int, np.ndarray]:
    """{layer: router logits [n, X]} of evaluating tokens one at a time (decode steps), each committed."""
    rows: dict[int, list] = {}
    session.trace_nodes("ffn_moe_logits-")
    for t in tokens:
        session.take_trace()
        session.eval(np.array([t], dtype=np.int32), all_logits=True)
        session.commit(1)
        for name, z in session.take_trace().items():
            rows.setdefault(int(name.rsplit("-", 1)[1]), []).append(z.reshape(1, -1))
    session.trace_nodes("")
    return {layer: np.concatenate(z) for layer, z in rows.items()}


def router_gap(z: np.ndarray, k: int) -> np.ndarray:
    """Per token (row of router logits z [n, X]): the gap between its k-th and (k+1)-th logits over its largest
    |logit|."""
    s = -np.sort(-z, axis=-1)
    return (s[:, k - 1] - s[:, k]) / np.abs(z).max(axis=-1)


def router_flips(a: dict, b: dict, k: int) -> list[tuple[int, int]]:
    """(layer, token) where router logits a and b pick different top-k sets of experts."""
    flips = []
    for layer in sorted(a):
        top_a, top_b = np.argsort(-a[layer], axis=-1)[:, :k], np.argsort(-b[layer], axis=-1)[:, :k]
        flips += [(layer, t) for t in range(len(top_a)) if set(top_a[t]) != set(top_b[t])]
    return flips


def routing_parts_at_a_tie(model, prompt_ids, tokens, k: int, n_expert_used: int) -> bool:
    """The MoE counterpart of tie_gap: whether one batched evaluation of tokens[:k] after the prompt (as a verify
    sees them) routes some token to other experts than one-token steps do (as plain decoding sees them), at a
    router near-tie (its gap, in the steps' logits, under ROUTER_TIE)."""
    if k == 0:  # the first token comes from the prompt's pass in both
        return False
    routes = []
    for steps in (False, True):
        s = session_after(model, prompt_ids)
        routes.append(stepped_routers(s, tokens[:k]) if steps else traced_routers(s, tokens[:k])[1])
    return any(router_gap(routes[1][layer], n_expert_used)[t] < ROUTER_TIE
               for layer, t in router_flips(routes[0], routes[1], n_expert_used))


# A verify's batch and decode steps round a router's logits apart (other kernels, the cache's f16 rows read by
# another attention path): slightly, but a random checkpoint's near-uniform router can tie closer still. The
# qwen3moe x5k2_tied pair's sampled continuation (seed 1) routes token 29 (0-based) at a relative gap of 1e-4, and
# an auto run whose verify covered it parted at the next draw on the CPU; the threshold is ten times that gap.
CPU_ROUTER_TIE = 1e-3


def routes_at_a_tie_before(model, prompt_ids, tokens, k: int, n_expert_used: int, window: int) -> bool:
    """Whether one of the `window` tokens before tokens[k] (those a verify reaching k evaluates in one batch)
    routes at a router near-tie (under CPU_ROUTER_TIE) in some layer, as decode steps evaluate them."""
    routes = stepped_routers(session_after(model, prompt_ids), tokens[:k])
    first = max(0, k - window)
    return any(router_gap(z, n_expert_used)[first:k].min() < CPU_ROUTER_TIE for z in routes.values() if k > first)
