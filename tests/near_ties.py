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
