"""Grammars that constrain generation, as llama.cpp's `grammar` (GBNF), `json_schema` and OpenAI's `response_format`
do: compiled by llguidance (the grammar engine llama.cpp builds with LLAMA_LLGUIDANCE, which reads GBNF, JSON
schemas, Lark and regular expressions) against the model's vocabulary. Each generation gets a matcher that the core
asks, at each position of the target's path, which tokens may come next (decode/token_constraint.h), and how many of
a round's drafts it allows (none after the first it forbids is verified); speculative decoding commits what
constrained plain decoding does. The end-of-generation tokens are allowed where the grammar may end (and only they,
once it must).

llguidance is an optional dependency (`pip install llguidance`, or the `grammar` extra)."""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING, Mapping

import numpy as np

from ._arguments import str_arg

if TYPE_CHECKING:
    from .model import Model
    from .tokenizer import Tokenizer


# llama.cpp's json-schema-to-grammar SPACE_RULE: | " " | "\n"{1,2} [ \t]{0,20}
LLAMA_CPP_SPACE = r"(?: |\n{1,2}[ \t]{0,20})?"
LLGUIDANCE_OPTIONS = '%llguidance {"no_forcing": true}\n'


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ImportError("constrained generation (grammar, json_schema, response_format) needs llguidance: "
                          "pip install llguidance") from None
    return llguidance


class Grammar:
    """A grammar to constrain generation with (generate(grammar=...), create_completion(grammar=...), ...). Any
    tokenization of the text it allows is allowed, as llama.cpp's grammar sampler allows it (llguidance's own
    default takes only the canonical tokens of text the grammar forces: "no_forcing" turns that off), so the
    output is the target's own choice among what the grammar allows."""

    def __init__(self, lark: str, source: str):
        """`lark`: the grammar in llguidance's Lark syntax (the from_* constructors write it); `source`: what it
        was made from, for messages."""
        body = re.sub(r"\A\s*%llguidance\s*\{[^\n]*\}\s*\n", "", lark)  # (our options replace any given)
        try:
            self._spec = _llguidance().grammar_from("lark", LLGUIDANCE_OPTIONS + body)
        except ValueError as e:
            raise ValueError(f"grammar {source[:80]!r}: {e}") from None
        self.source = source

    @classmethod
    def from_gbnf(cls, text: str) -> "Grammar":
        """A grammar in llama.cpp's GBNF (its `root` rule the whole output; llguidance's Lark syntax is read too)."""
        _llguidance()  # (installed, or the ImportError that says so)
        from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

        try:
            return cls(gbnf_to_lark(str_arg("grammar", text)), text)
        except GbnfToLarkError as e:
            raise ValueError(f"grammar {text[:80]!r}: {e}") from None

    from_string = from_gbnf  # (llama-cpp-python's LlamaGrammar.from_string)

    @classmethod
    def from_json_schema(cls, schema: Mapping | str) -> "Grammar":
        """Output that is a JSON value valid under `schema` (a dict, or its JSON text), with the whitespace
        llama.cpp's json-schema-to-grammar allows between its tokens (none, a space, or one or two newlines and up to
        20 spaces or tabs) unless the schema's llguidance options ("x-guidance") say otherwise."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not JSON: {e}") from None
        if not isinstance(schema, Mapping):
            raise TypeError(f"json_schema must be a JSON schema (a dict), got {type(schema).__name__}")
        text = json.dumps({"x-guidance": {"whitespace_pattern": LLAMA_CPP_SPACE}, **schema})
        return cls(f"start: %json {text}\n", f"json_schema {text}")

    @classmethod
    def json_object(cls) -> "Grammar":
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls.from_json_schema({"type": "object"})

    def __repr__(self) -> str:
        return f"Grammar({self.source[:60]!r})"

    def matcher(self, model: "Model") -> "GrammarMatcher":
        """A fresh matcher for one generation on `model`."""
        return GrammarMatcher(self, model.tokenizer)


@functools.lru_cache(maxsize=4)
def _vocabulary(tokenizer: "Tokenizer"):
    """llguidance's view of the vocabulary: each token's bytes, control tokens as special (no text matches them)."""
    llg = _llguidance()

    class Vocabulary:
        eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(tokenizer.eog_token_ids)
        bos_token_id = tokenizer.bos_token_id
        tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.n_vocab)]
        special_token_ids = sorted(tokenizer.control_token_ids)

        def __call__(self, text: bytes) -> list[int]:
            return tokenizer.tokenize(text, add_special=False)

    return llg.LLTokenizer(llg.TokenizerWrapper(Vocabulary()))


class GrammarMatcher:
    """One generation's grammar state, as the core asks it: allowed() the next position's tokens (uint32 words, a
    bit per token id), accept(token) the token chosen there, valid_prefix(drafts) how many drafts it allows."""

    def __init__(self, grammar: Grammar, tokenizer: "Tokenizer"):
        llg = _llguidance()
        self._matcher = llg.LLMatcher(_vocabulary(tokenizer), grammar._spec)
        if self._matcher.is_error():
            raise ValueError(f"{grammar!r}: {self._matcher.get_error()}")
        self._grammar, self._n_vocab, self._eog = grammar, tokenizer.n_vocab, tokenizer.eog_token_ids

    def _may_end(self) -> bool:
        return self._matcher.is_accepting() or self._matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        words = np.zeros((self._n_vocab + 31) // 32, dtype=np.uint32)
        if not self._matcher.is_stopped():
            mask = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint32)
            words[:] = mask[:len(words)]
        if self._may_end():
            for token in self._eog:
                words[token >> 5] |= np.uint32(1 << (token & 31))
        if not words.any():
            raise ValueError(f"{self._grammar!r} allows no token here: {self._matcher.get_error() or 'a dead end'}")
        return words

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of a round's drafted `tokens` the grammar takes in turn from here (an end-of-generation token
        ends them): the core verifies no draft after them."""
        end = next((i for i, t in enumerate(tokens) if t in self._eog), len(tokens))
        return self._matcher.validate_tokens(tokens[:end])

    def accept(self, token: int) -> None:
        if token in self._eog and self._may_end():
            return
        if not self._matcher.consume_token(token):
            raise ValueError(f"{self._grammar!r} does not allow token {token} here: {self._matcher.get_error()}")


def grammar_arg(grammar) -> Grammar | None:
    """A Grammar, or GBNF text as one (llama-cpp-python's and llama-server's `grammar`), or None."""
    if grammar is None or isinstance(grammar, Grammar):
        return grammar
    if isinstance(grammar, str):
        return Grammar.from_gbnf(grammar)
    raise TypeError(f"grammar must be a pydflash.Grammar or GBNF text, got {type(grammar).__name__}")


def grammar_of_fields(grammar: str | None, json_schema: Mapping | None) -> Grammar | str | None:
    """llama-server's request fields `grammar` (GBNF text; "" is none) and `json_schema` (which wins) as
    generate's grammar argument."""
    if json_schema is not None:
        return Grammar.from_json_schema(json_schema)
    return grammar or None


def response_format_grammar(response_format) -> Grammar | None:
    """OpenAI's response_format as a grammar: {"type": "text"} none, {"type": "json_object"} any JSON object (an
    optional "schema" key: that schema, as llama-server takes it), {"type": "json_schema", "json_schema":
    {"schema": ...}} that schema."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise TypeError(f"response_format must be a dict, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        return Grammar.json_object() if schema is None else Grammar.from_json_schema(schema)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
            raise ValueError(f"response_format={response_format!r}: expected {{'type': 'json_schema', "
                             f"'json_schema': {{'schema': {{...}}}}}}")
        return Grammar.from_json_schema(spec["schema"])
    raise ValueError(f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'")
