"""llama-server's own completion API (`POST /completion`, also at `/completions`): its request fields and
defaults, its answer (`content`, `stop_type`, `stopping_word`, `tokens_predicted`, `completion_probabilities`
with n_probs, ...) and its stream of a `{"content", "tokens": [id], "stop": false, ...}` chunk per token ending in
that answer, over `Model.pieces(...).steps()`. The OpenAI-shaped calls are in completions.py."""

from __future__ import annotations

import codecs
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field

from .completions import stopping_word
from .grammar import grammar_of_fields

if TYPE_CHECKING:
    from .model import Completion, Model, Pieces, TokenStep


class NativeRequest(BaseModel):
    """The fields of llama-server's /completion that pydflash serves, with its defaults (unknown fields are ignored,
    as there; strictly typed, as every request here)."""
    model_config = ConfigDict(strict=True, extra="ignore")

    prompt: Union[str, list[Union[int, str]]]
    n_predict: int = Field(-1, ge=-1)  # -1: until an end-of-generation token or the context's end
    temperature: float = 0.8  # below 0: greedy, as there
    top_k: int = 40  # <= 0: off, as llama-server clamps it
    top_p: float = Field(0.95, ge=0.0, le=1.0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    typical_p: float = Field(1.0, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0)
    repeat_last_n: int = Field(64, ge=-1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1  # -1: a fresh seed
    stop: list[str] = []
    stream: bool = False
    ignore_eos: bool = False
    logit_bias: Union[dict[str, Union[float, bool]], list[list[Union[int, float, bool]]], None] = None
    n_probs: int = Field(0, ge=0)  # the n most likely tokens' log-probabilities at each token, before sampling
    post_sampling_probs: bool = False  # ... their probabilities in the draw's distribution, after every sampler
    grammar: str = ""  # GBNF (pydflash/grammar.py)
    json_schema: dict[str, Any] | None = None  # (wins over grammar, as there)
    n_cmpl: int = Field(1, ge=1)
    n: int = Field(1, ge=1)  # (llama-server's other name of n_cmpl)
    return_tokens: bool = False
    cache_prompt: bool = True  # (a slot always reuses what it can of its last prompt)
    response_fields: list[str] = []  # (the server keeps only these fields of its answer, as there)
    speculative: bool | None = None

    def check(self) -> None:
        """What /completion does not serve here, with where to get it (ValueError)."""
        if max(self.n_cmpl, self.n) > 1:
            raise ValueError(f"n_cmpl = {max(self.n_cmpl, self.n)}: /completion gives one completion here; "
                             f"/v1/completions gives several (n)")

    def prompt_tokens(self, model: "Model") -> list[int]:
        """The prompt's token ids: a text, or ids and texts mixed (a text first gets the model's BOS, as there).
        A list of texts only is several prompts there: refused here."""
        if isinstance(self.prompt, str):
            return model.tokenize(self.prompt)
        if len(self.prompt) > 1 and all(isinstance(p, str) for p in self.prompt):
            raise ValueError(f"prompt: a list of {len(self.prompt)} texts is {len(self.prompt)} prompts; /completion "
                             f"takes one (/v1/completions takes several)")
        tokens: list[int] = []
        for i, part in enumerate(self.prompt):
            tokens += model.tokenize(part, add_special=i == 0) if isinstance(part, str) else [part]
        return tokens

    def sampling(self, model: "Model") -> dict:
        """Model.pieces' sampling arguments."""
        bias = _logit_bias(self.logit_bias)
        if self.ignore_eos:
            bias.update({str(t): -math.inf for t in model.tokenizer.eog_token_ids})
        return dict(temperature=max(self.temperature, 0.0), top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                    typical_p=self.typical_p, repeat_penalty=self.repeat_penalty, repeat_last_n=self.repeat_last_n,
                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                    seed=None if self.seed == -1 else self.seed, logit_bias=bias or None,
                    logprobs=min(self.n_probs, model.n_vocab) if self.n_probs > 0 else None,
                    post_sampling_probs=self.post_sampling_probs,
                    grammar=grammar_of_fields(self.grammar, self.json_schema))


def _logit_bias(bias) -> dict[str, float]:
    """llama-server's logit_bias, {"id": bias} or [[id, bias], ...], a bias of false banning the token."""
    pairs = bias.items() if isinstance(bias, dict) else (bias or [])
    out = {}
    for pair in pairs:
        if len(pair) != 2 or isinstance(pair[0], (bool, float)):
            raise ValueError(f"logit_bias: {list(pair)!r}, expected [token id, bias or false]")
        token, value = pair
        out[str(token)] = -math.inf if value is False else float(value)
    return out


def native_completion(model: "Model", req: NativeRequest,
                      cut: Callable[[str, str, float], tuple[int, bool]] | None = None) -> dict | Iterator[dict]:
    """The answer (or with stream the chunks, the last of them the answer with empty content) of a /completion
    request on `model`. `cut(text so far, its last piece, ms generating)`: (where the text ends, whether it ends
    there), for /infill's limits; a completion it ends is aborted and answered with stop_type "limit", as there."""
    prompt = req.prompt_tokens(model)
    max_tokens = None if req.n_predict < 0 else req.n_predict
    pieces = model.pieces(prompt, max_tokens, stop=req.stop, speculative=req.speculative is not False,
                          **req.sampling(model))
    cut_short: list[int] = []  # (where cut ended the text, once it has)
    steps = _steps(model, pieces, cut, cut_short)
    if not req.stream:
        shown = list(steps)
        text = "".join(step.text for step in shown)
        return _answer(model, req, prompt, pieces, text[:cut_short[0]] if cut_short else text, bool(cut_short),
                       shown)

    def chunks() -> Iterator[dict]:
        n_decoded = 0
        for step in steps:
            n_decoded += step.token is not None
            if not step.incomplete:  # (llama-server sends nothing for a token that ends inside a character)
                yield _chunk(model, req, prompt, step, n_decoded)
        yield _answer(model, req, prompt, pieces, "", bool(cut_short))
    return chunks()


def _steps(model: "Model", pieces: "Pieces", cut, cut_short: list[int]) -> Iterator["TokenStep"]:
    """The generation token by token, its texts up to where `cut` ends them (the generation then aborted, the
    rest of its steps read and dropped, and where it ended the text put in `cut_short`: it may lie before the end
    of what was sent, as llama-server's n_indent cuts a line it has streamed)."""
    started, text = time.perf_counter(), ""
    for step in pieces.steps():
        if cut is None:
            yield step
            continue
        if cut_short:
            continue
        end, ended = cut(text + step.text, step.text, (time.perf_counter() - started) * 1000.0)
        yield step._replace(text=(text + step.text)[len(text):end])
        text += step.text
        if ended:
            cut_short.append(end)
            model.abort()


def _chunk(model: "Model", req: NativeRequest, prompt: list[int], step: "TokenStep", n_decoded: int) -> dict:
    """A streamed token: the text it released, its id, the counts so far, its probabilities with n_probs."""
    chunk = {"index": 0, "content": step.text, "tokens": [] if step.token is None else [step.token], "stop": False,
             "id_slot": -1, "tokens_predicted": n_decoded, "tokens_evaluated": len(prompt)}
    if req.n_probs > 0 and step.token is not None:
        chunk["completion_probabilities"] = [_probabilities(model, req, step)]
    return chunk


def _probabilities(model: "Model", req: NativeRequest, step: "TokenStep") -> dict:
    """llama-server's completion_probabilities entry of a token: the text it released, its log-probability, and
    the n_probs most likely tokens' (each with its own piece, a control token's empty, as there); with
    post_sampling_probs, probabilities in the draw's distribution ("prob", "top_probs")."""
    name, value = ("prob", math.exp) if req.post_sampling_probs else ("logprob", float)
    return {"id": step.token, "token": step.text, "bytes": list(step.text.encode("utf-8")), name: value(step.logprob),
            f"top_{name}s": [{"id": token, **_piece(model, token), name: value(lp)} for token, lp in step.top]}


def _piece(model: "Model", token: int) -> dict:
    """A token's text (a split character's bytes left out, as llama-server's validate_utf8 cuts them) and bytes."""
    raw = model.tokenizer.token_bytes(token, special=False)
    return {"token": codecs.getincrementaldecoder("utf-8")(errors="replace").decode(raw), "bytes": list(raw)}


def _answer(model: "Model", req: NativeRequest, prompt: list[int], pieces: "Pieces", content: str,
            cut_short: bool = False, steps: Sequence["TokenStep"] = ()) -> dict:
    """The final answer; with n_probs, the probabilities of `steps` (none in a stream's last chunk, as there)."""
    c = pieces.completion
    t = c.timings
    stop_type, word = ("limit", "") if cut_short else _how_it_stopped(model, req, c)
    limited = c.finish_reason == "length" and req.n_predict >= 0 and len(c.tokens) >= req.n_predict
    # llama-server counts the end-of-generation token it drew among the predicted ones
    predicted = len(c.tokens) + (pieces.result.get("stop_token") is not None)
    answer = {"index": 0, "content": content, "tokens": list(c.tokens) if req.return_tokens else [], "id_slot": -1,
              "stop": True, "model": model.model_path, "tokens_predicted": predicted,
              "tokens_evaluated": len(prompt), "generation_settings": _settings(model, req),
              "prompt": model.detokenize(prompt), "has_new_line": "\n" in c.text,
              "truncated": c.finish_reason == "length" and not limited, "stop_type": stop_type,
              "stopping_word": word, "tokens_cached": t.get("cached_n", 0), "timings": t}
    if req.n_probs > 0 and not req.stream:
        probs = [_probabilities(model, req, step) for step in steps if step.token is not None and not step.incomplete]
        if word:  # llama-server leaves out as many entries as the stop word has tokens
            probs = probs[:max(0, len(probs) - len(model.tokenize(word, add_special=False)))]
        answer["completion_probabilities"] = probs
    return answer


def _how_it_stopped(model: "Model", req: NativeRequest, c: "Completion") -> tuple[str, str]:
    """(stop_type, stopping_word): "limit" (n_predict or the context), "word" (which stop string) or "eos"."""
    if c.finish_reason != "stop":
        return ("limit" if c.finish_reason == "length" else "none"), ""
    word = stopping_word(model, c, req.stop)
    return ("word" if word else "eos"), word


def _settings(model: "Model", req: NativeRequest) -> dict[str, Any]:
    """generation_settings: the request's options as they were applied, with n_ctx."""
    fields = ("n_predict", "temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "repeat_last_n",
              "presence_penalty", "frequency_penalty", "seed", "stop", "ignore_eos", "stream", "n_probs",
              "post_sampling_probs")
    return {"n_ctx": model.n_ctx, **{k: getattr(req, k) for k in fields}}
