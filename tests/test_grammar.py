"""Grammars that constrain generation (pydflash/grammar.py, the core's token constraint): on the committed trained
qwen3 pair, greedy constrained decoding is the argmax over what a grammar allows, step by step, computed here from
the target's logits and a matcher of llguidance's own (the reference loop below); speculative decoding (the
pair's DFlash drafter, chain and auto) commits the same tokens, greedy and sampled; JSON schemas and
response_format give valid JSON; bad grammars and options get typed errors. The slow peer test in test_peer.py
holds GBNF grammars to llama-server's grammar sampler."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

import pydflash
from pydflash.grammar import Grammar

from export_pairs import pair_file

llguidance = pytest.importorskip("llguidance")
from llguidance.gbnf_to_lark import gbnf_to_lark  # noqa: E402

GRAMMARS = ['root ::= [0-9]+ ("," [0-9]+)* "\\n"',
            'root ::= "def " [a-z_]+ "(" [a-z_, ]* "):\\n" ("    " [^\\n]* "\\n")+',
            'root ::= ("yes" | "no" | "maybe") " because " [a-z ]{1,40} "."']
PROMPTS = ["x = ", "class Stack:\n"]


@pytest.fixture(scope="module")
def pair():
    with pydflash.Model(pair_file("qwen3", "target", "q8_0"), draft_model_path=pair_file("qwen3", "dflash", "q8_0"),
                        n_ctx=512, n_threads=2) as m:
        yield m


def _reference_matcher(model, gbnf: str):
    """llguidance's matcher of `gbnf` over the model's token bytes, built here (any tokenization allowed)."""
    tok = model.tokenizer

    class Vocabulary:
        eos_token_id = tok.eos_token_id
        bos_token_id = tok.bos_token_id
        tokens = [tok.token_bytes(i) for i in range(tok.n_vocab)]
        special_token_ids = sorted(tok.control_token_ids)

        def __call__(self, text):
            return tok.tokenize(text, add_special=False)

    vocabulary = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()))
    lark = gbnf_to_lark(gbnf).replace("%llguidance {}", '%llguidance {"no_forcing": true}')
    return llguidance.LLMatcher(vocabulary, llguidance.grammar_from("lark", lark))


def _allowed(model, matcher) -> set[int]:
    words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
    allowed = {i for i in range(model.n_vocab) if words[i >> 5] >> (i & 31) & 1}
    return allowed | (set(model.tokenizer.eog_token_ids) if matcher.is_accepting() else set())


def _reference_greedy(model, prompt: str, gbnf: str, n: int) -> list[int]:
    """Greedy constrained decoding, a token at a time: the target's log-probabilities of every token after the
    prompt and the tokens so far (plain decoding), the best the grammar allows (ties: the lower id)."""
    matcher, out = _reference_matcher(model, gbnf), []
    ids = model.tokenize(prompt)
    for _ in range(n):
        step = next(model.pieces(ids + out, 1, logprobs=model.n_vocab, speculative=False).steps())
        logprob = dict(step.top)
        best = max(_allowed(model, matcher), key=lambda i: (logprob[i], -i))
        if best in model.tokenizer.eog_token_ids:
            break
        out.append(best)
        assert matcher.consume_token(best)
    return out


@pytest.mark.parametrize("gbnf", GRAMMARS)
def test_greedy_is_the_best_token_the_grammar_allows(pair, gbnf):
    for prompt in PROMPTS:
        want = _reference_greedy(pair, prompt, gbnf, 24)
        got = pair.generate(prompt, max_tokens=24, grammar=gbnf, speculative=False)
        assert got.tokens == want, (prompt, pair.detokenize(got.tokens), pair.detokenize(want))
        for mode in ("chain", "auto"):
            with pydflash.Model(pair.model_path, draft_model_path=pair.draft_model_path, n_ctx=512, n_threads=2,
                                spec_mode=mode) as m:
                got = m.generate(prompt, max_tokens=24, grammar=gbnf)
            assert got.tokens == want, (prompt, mode, pair.detokenize(got.tokens), pair.detokenize(want))


def test_sampled_speculative_decoding_commits_constrained_plain_sampling(pair):
    """Same seed, with and without the drafter: the same tokens, each one the grammar allows there."""
    gbnf = GRAMMARS[2]
    for seed in range(4):
        plain = pair.generate(PROMPTS[0], max_tokens=40, temperature=0.9, seed=seed, grammar=gbnf, speculative=False)
        spec = pair.generate(PROMPTS[0], max_tokens=40, temperature=0.9, seed=seed, grammar=gbnf)
        assert spec.tokens == plain.tokens, seed
        matcher = _reference_matcher(pair, gbnf)
        for token in plain.tokens:
            assert token in _allowed(pair, matcher)
            matcher.consume_token(token)
        if plain.finish_reason == "stop":
            assert matcher.is_accepting() and plain.text.endswith(".")


def test_json_schema_and_response_format_give_valid_json(pair):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "mode": {"enum": ["fast", "slow"]}},
              "required": ["ok", "mode"], "additionalProperties": False}
    c = pair.generate("x = ", max_tokens=120, grammar=Grammar.from_json_schema(schema))
    assert c.finish_reason == "stop", c.text
    value = json.loads(c.text)
    assert set(value) == {"ok", "mode"} and isinstance(value["ok"], bool) and value["mode"] in ("fast", "slow")
    reply = pair.create_chat_completion(
        [{"role": "user", "content": "Answer in JSON."}], max_tokens=120, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        chat_template_kwargs={"enable_thinking": False})
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert json.loads(reply["choices"][0]["message"]["content"]).keys() == {"ok", "mode"}
    any_object = pair.create_chat_completion([{"role": "user", "content": "JSON?"}], max_tokens=8, temperature=0.0,
                                             response_format={"type": "json_object"},
                                             chat_template_kwargs={"enable_thinking": False})
    assert any_object["choices"][0]["message"]["content"].lstrip().startswith("{")


def test_completion_calls_take_a_grammar(pair):
    text = pair.create_completion("x = ", max_tokens=12, temperature=0.0, grammar='root ::= "a" | "b"')
    assert text["choices"][0]["text"] in ("a", "b") and text["choices"][0]["finish_reason"] == "stop"
    streamed = "".join(pair.stream("x = ", max_tokens=30, grammar=GRAMMARS[0]))
    assert streamed == pair.generate("x = ", max_tokens=30, grammar=GRAMMARS[0]).text
    assert all(ch.isdigit() or ch in ",\n" for ch in streamed)


@pytest.mark.parametrize("call, error, match", [
    (lambda m: m.generate("x", grammar="root ::= (("), ValueError, r"grammar 'root ::= \(\(': Expected"),
    (lambda m: m.generate("x", grammar=3), TypeError, "grammar must be a pydflash.Grammar or GBNF text, got int"),
    (lambda m: Grammar.from_json_schema("{not json"), ValueError, "json_schema is not JSON"),
    (lambda m: Grammar.from_json_schema([1]), TypeError, "json_schema must be a JSON schema"),
    (lambda m: m.create_chat_completion([{"role": "user", "content": "x"}], response_format={"type": "xml"}),
     ValueError, "response_format type 'xml' is not one of"),
    (lambda m: m.create_chat_completion([{"role": "user", "content": "x"}], response_format={"type": "json_schema"}),
     ValueError, "expected {'type': 'json_schema', 'json_schema': {'schema'"),
    (lambda m: m.create_chat_completion([{"role": "user", "content": "x"}], response_format={"type": "json_object"},
                                        grammar='root ::= "a"'), ValueError, "give one of them"),
])
def test_bad_grammars_and_options_raise_naming_them(pair, call, error, match):
    with pytest.raises(error, match=match):
        call(pair)


def test_a_thinking_template_is_refused_a_constrained_reply(pair, qwen35_template):
    """A template that opens the reply inside <think> (Qwen3.5's) cannot take a grammar over the whole reply."""
    with pytest.raises(ValueError, match="starts inside a <think> block: turn thinking off"):
        pair.create_chat_completion([{"role": "user", "content": "x"}], chat_template=qwen35_template,
                                    response_format={"type": "json_object"}, max_tokens=4)


def test_without_llguidance_a_grammar_says_what_to_install(pair, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    monkeypatch.setitem(sys.modules, "llguidance.gbnf_to_lark", None)
    with pytest.raises(ImportError, match="needs llguidance: pip install llguidance"):
        Grammar.from_gbnf('root ::= "a"')
    with pytest.raises(ImportError, match="needs llguidance: pip install llguidance"):
        Grammar.from_json_schema({"type": "object"})
    assert len(pair.generate("x", max_tokens=2).tokens) == 2  # (without a grammar, no llguidance is needed)


def test_the_hybrid_target_in_every_mode_commits_constrained_plain_sampling():
    """qwen35 (gated delta net: trees verified level by level), sampled under a grammar: chain, tree and auto
    commit plain decoding's tokens for the seed."""
    target, draft = pair_file("qwen35", "target", "q8_0"), pair_file("qwen35", "dflash", "q8_0")
    outputs = {}
    for mode in ("plain", "chain", "tree", "auto"):
        kwargs = {} if mode == "plain" else {"draft_model_path": draft, "spec_mode": mode}
        with pydflash.Model(target, n_ctx=512, n_threads=2, **kwargs) as m:
            c = m.generate(PROMPTS[1], max_tokens=40, grammar=GRAMMARS[1], temperature=0.7, seed=3)
        outputs[mode] = c.tokens
        assert mode == "plain" or mode == "auto" or c.timings["n_rounds"] > 0
    assert all(tokens == outputs["plain"] for tokens in outputs.values()), outputs


def test_batched_generations_each_follow_their_grammar_as_alone():
    """generate_batch (sessions stepped together, one batched target evaluation per step; each session's grammar
    asked from its own thread): each output is its generation alone, sampled under the grammar."""
    with pydflash.Model(pair_file("qwen35", "target", "q8_0"), draft_model_path=pair_file("qwen35", "dflash", "q8_0"),
                        n_ctx=512, n_threads=2) as m:
        prompts = [*PROMPTS, "def f(a):\n", "y = "]
        alone = [m.generate(p, max_tokens=30, grammar=GRAMMARS[1], temperature=0.8, seed=5).tokens for p in prompts]
        batch = m.generate_batch(prompts, max_tokens=30, grammar=GRAMMARS[1], temperature=0.8, seed=5)
        assert [c.tokens for c in batch] == alone


class _Blind:
    """A grammar's matcher that cannot say which drafts it allows (no valid_prefix): every draft is verified."""

    def __init__(self, matcher):
        self.allowed, self.accept = matcher.allowed, matcher.accept


class _BlindGrammar(Grammar):
    def __init__(self, grammar: Grammar):
        self.__dict__.update(grammar.__dict__)

    def matcher(self, model):
        return _Blind(super().matcher(model))


@pytest.mark.parametrize("arch", ["qwen3", "qwen35"])
def test_rounds_verify_no_draft_the_grammar_forbids(arch):
    """A round's tree is cut before the first draft the grammar forbids: chains of 15 drafts, greedy, the same
    tokens and accepted drafts as verifying them all, for fewer verified tokens (a forbidden draft is never
    accepted: the target chooses among what the grammar allows)."""
    with pydflash.Model(pair_file(arch, "target", "q8_0"), draft_model_path=pair_file(arch, "dflash", "q8_0"),
                        n_ctx=512, n_threads=2, spec_mode="chain") as m:
        verified = blind_verified = 0
        for gbnf in GRAMMARS:
            for prompt in PROMPTS:
                grammar = Grammar.from_gbnf(gbnf)
                cut = m.generate(prompt, max_tokens=40, grammar=grammar)
                every = m.generate(prompt, max_tokens=40, grammar=_BlindGrammar(grammar))
                assert cut.tokens == every.tokens, (gbnf, prompt)
                assert cut.timings["draft_n_accepted"] == every.timings["draft_n_accepted"]
                assert cut.timings["verify_n"] <= every.timings["verify_n"]
                verified += cut.timings["verify_n"]
                blind_verified += every.timings["verify_n"]
        assert verified < blind_verified / 2, (verified, blind_verified)
