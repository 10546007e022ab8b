"""A numpy reference of llama.cpp's default sampler chain (src/llama-sampler.cpp, common/sampling.cpp), written
from llama.cpp's source for the tests, independently of ours: logit bias -> penalties -> top-k -> typical-p ->
top-p -> min-p -> temperature. Ties between equal logits go to the lower token id (llama.cpp leaves their order
to std::partial_sort; ours fixes it)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

NEUTRAL = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_penalty=1.0,
               presence_penalty=0.0, frequency_penalty=0.0, repeat_last_n=64, logit_bias={})


def _softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    if m == -np.inf:
        return np.full(len(x), 1.0 / len(x))
    e = np.exp(x - m)
    return e / e.sum()


def _best_first(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Positions into `ids`, higher logit first, ties to the lower id."""
    return np.lexsort((ids, -logits))


def distribution(logits, history=(), **params) -> tuple[np.ndarray, np.ndarray]:
    """(ids in id order, probabilities) that the chain leaves to draw from."""
    p = {**NEUTRAL, **params}
    lg = np.where(np.isnan(logits), -np.inf, np.asarray(logits, dtype=np.float32)).astype(np.float32)
    for token, bias in p["logit_bias"].items():
        lg[int(token)] += np.float32(bias)
    n = p["repeat_last_n"]
    window = list(history) if n == -1 else list(history)[-n:] if n > 0 else []
    if window and (p["repeat_penalty"] != 1 or p["presence_penalty"] != 0 or p["frequency_penalty"] != 0):
        for token, count in Counter(window).items():
            x = lg[token]
            x = x * np.float32(p["repeat_penalty"]) if x <= 0 else x / np.float32(p["repeat_penalty"])
            lg[token] = x - np.float32(count * p["frequency_penalty"] + p["presence_penalty"])
    ids = np.arange(len(lg))
    l64 = lg.astype(np.float64)
    if 0 < p["top_k"] < len(ids):
        keep = _best_first(l64, ids)[: p["top_k"]]
        ids, l64 = ids[keep], l64[keep]
    if p["typical_p"] < 1:
        q = _softmax(l64)
        with np.errstate(divide="ignore"):
            surprise = -np.log(q)
        entropy = -np.sum(np.where(q > 0, q * np.log(np.where(q > 0, q, 1)), 0))
        order = np.lexsort((ids, np.abs(surprise - entropy)))
        cum = np.cumsum(q[order])
        cut = np.nonzero(cum > p["typical_p"])[0]
        order = order[: cut[0] + 1] if len(cut) else order
        ids, l64 = ids[order], l64[order]
    if p["top_p"] < 1:
        q = _softmax(l64)
        order = _best_first(l64, ids)
        cum = np.cumsum(q[order])
        cut = np.nonzero(cum >= p["top_p"])[0]
        order = order[: cut[0] + 1] if len(cut) else order
        ids, l64 = ids[order], l64[order]
    if p["min_p"] > 0 and l64.max() > -np.inf:
        keep = l64 >= np.float32(l64.max() + np.log(np.float32(p["min_p"])))
        ids, l64 = ids[keep], l64[keep]
    if p["temperature"] <= 0:
        best = _best_first(l64, ids)[0]
        return ids[best:best + 1], np.ones(1)
    order = np.argsort(ids)
    ids, l64 = ids[order], l64[order]
    return ids, _softmax(l64 / p["temperature"])


MASK64 = (1 << 64) - 1
BLOCK_BITS = 8
BLOCK_KEY = 1 << 40


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def draw_key(seed: int, t: int) -> int:
    return splitmix64(splitmix64(seed & MASK64) ^ t)


def uniform(key: int, index: int) -> float:
    return ((splitmix64(key ^ index) >> 11) + 0.5) * 2.0**-53


def gumbel(key: int, index: int) -> float:
    return -math.log(-math.log(uniform(key, index)))


def _top_two(scores: dict) -> tuple:
    ranked = sorted(scores.items(), key=lambda kv: -kv[1])
    gap = ranked[0][1] - ranked[1][1] if len(ranked) > 1 else math.inf
    return ranked[0][0], gap


def draw(ids: np.ndarray, probs: np.ndarray, seed: int, t: int) -> tuple[int, float]:
    """The draw of output position t: Gumbel-max over the blocks of 256 ids by mass, then within the block
    (src: csrc/decode/sampler.h). Returns the token and the smaller of the two levels' winning margins (in
    log-probability: noise of that size can change the draw)."""
    key = draw_key(seed, t)
    blocks = ids >> BLOCK_BITS
    block_scores = {}
    for b in np.unique(blocks):
        mass = float(probs[blocks == b].sum())
        if mass > 0:
            block_scores[int(b)] = math.log(mass) + gumbel(key, BLOCK_KEY + int(b))
    block, gap1 = _top_two(block_scores)
    scores = {int(i): math.log(float(p)) + gumbel(key, int(i)) for i, p, b in zip(ids, probs, blocks)
              if b == block and p > 0}
    token, gap2 = _top_two(scores)
    return token, min(gap1, gap2)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())
