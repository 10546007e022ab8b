"""Near-ties: where two tokens' logits are so close that batched and single-token evaluations may pick either.

Batched (verify, prefill) and single-token evaluations round differently (matmul kernels tile by batch width,
f16 KV rounding); where two tokens' logits are closer than TIE, either is the target's greedy choice (measured:
2e-3, 8e-3 on the q8_0 qwen3 pair; tests/test_peer.py uses it for llama-simple vs ours)."""

from __future__ import annotations

import numpy as np

from pydflash import _core

TIE = 1e-2


def tie_gap(model, prompt_ids, tokens, other, k) -> float:
    """|logit(tokens[k]) - logit(other[k])| after prompt + tokens[:k], from one batched evaluation of ours."""
    s = _core.Session(model._model, n_ctx=model.n_ctx)
    logits, _ = s.eval(np.array(list(prompt_ids) + list(tokens[:k]), dtype=np.int32), all_logits=True)
    return float(abs(logits[-1][tokens[k]] - logits[-1][other[k]]))


def first_difference(a, b) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
