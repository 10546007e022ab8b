"""The same request always gives the same output, whatever the prompt cache holds: repeated, interleaved with
other requests, and against a fresh model, on every committed pair, plain and speculative.

Before the prompt cache kept whole aligned micro-batches (session::prefill_marks), a repeated prompt had only its
last token re-evaluated, alone; its logits then differed in the last bits from the batched ones and 3 of the 63
held-out prompts (0, 27 and 54 of code + prose) continued differently the second time on the q8_0 Qwen3 pair."""

from __future__ import annotations

import pytest

import pydflash

from export_pairs import pair_file, prompt_rows

PAIRS = [("qwen3", "f32"), ("qwen3", "q8_0"), ("qwen3", "f16"), ("qwen35", "f32"), ("qwen35", "q8_0"),
         ("qwen35", "f16")]
ALL_PROMPTS = [r["text"] for r in prompt_rows("code") + prompt_rows("prose")]
# the three that parted on q8_0 Qwen3 (above), and others of both genres
SOME = [0, 27, 54, 5, 13, 33, 40, 61]
MAX_TOKENS = 64


def model(kind: str, outtype: str, **kw) -> pydflash.Model:
    return pydflash.Model(pair_file(kind, "target", outtype), n_ctx=1024,
                          draft_model_path=pair_file(kind, "dflash", outtype), **kw)


def check_requests(m: pydflash.Model, prompts: list[str], speculative: bool) -> list[list[int]]:
    """Each prompt 5 times in a row, then all of them again interleaved: always the first answer (returned)."""
    first = []
    for p in prompts:
        runs = [m.generate(p, max_tokens=MAX_TOKENS, speculative=speculative).tokens for _ in range(5)]
        assert all(r == runs[0] for r in runs), f"prompt {p[:40]!r}: repeated requests differ"
        first.append(runs[0])
    for p, expected in zip(reversed(prompts), reversed(first)):
        assert m.generate(p, max_tokens=MAX_TOKENS, speculative=speculative).tokens == expected, \
            f"prompt {p[:40]!r}: differs after other requests"
    return first


@pytest.mark.parametrize("kind, outtype", PAIRS)
def test_same_request_same_output(kind, outtype):
    with model(kind, outtype) as m:
        spec = check_requests(m, ALL_PROMPTS, speculative=True)
        some = [ALL_PROMPTS[i] for i in SOME]
        plain = check_requests(m, some, speculative=False)
    # and what a model that never saw another request gives
    for i, p, q in zip(SOME[:3], some, plain):
        with model(kind, outtype) as fresh:
            assert fresh.generate(p, max_tokens=MAX_TOKENS).tokens == spec[i]
            assert fresh.generate(p, max_tokens=MAX_TOKENS, speculative=False).tokens == q


@pytest.mark.parametrize("kind", ["qwen3", "qwen35"])
def test_shared_prefix_gives_a_fresh_models_output(kind):
    """With micro-batches of 16, a prompt that extends the last one (a chat's next turn) continues from the last
    whole micro-batch they share and answers as a fresh model does."""
    first, second = ALL_PROMPTS[1], ALL_PROMPTS[2]
    with model(kind, "q8_0", n_ubatch=16) as m:
        reply = m.generate(first, max_tokens=MAX_TOKENS)
        follow_up = first + reply.text + "\n" + second
        out = m.generate(follow_up, max_tokens=MAX_TOKENS)
        n_first = len(m.tokenize(first))
        assert 0 < out.timings["cached_n"] <= n_first and out.timings["cached_n"] % 16 == 0
    with model(kind, "q8_0", n_ubatch=16) as fresh:
        assert fresh.generate(follow_up, max_tokens=MAX_TOKENS).tokens == out.tokens
