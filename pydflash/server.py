"""`pydflash serve`: an OpenAI-compatible HTTP server (FastAPI, uvicorn, sse-starlette: `pip install
"pydflash[server]"`).

Endpoints: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (OpenAI's Responses API), POST
/v1/messages (Anthropic's), GET /v1/models, GET /health, and llama-server's /completion (its own API), /infill,
/tokenize, /detokenize, /apply-template, GET /props, /slots and /metrics (with `metrics=True`). `--parallel N` slots
are N sessions (`Model.new_session`) over one copy of the weights; a request takes a free slot (the one whose last
request shares the longest prefix with it, so multi-turn chats reuse their cached prompt), else waits in a queue of
at most `max_queue` requests, past which it gets 503. Each generation runs on a thread of its own (the core releases
the GIL), and the generations running at the same time meet at each step in one batched target evaluation (continuous
batching: `Model.new_session`); a client that disconnects aborts its generation within one round and frees the slot.
A request for several choices (`n`, or a list of prompts to /v1/completions) runs each as a generation of its own on
a slot, at most as many at once as there are slots, in one batch where they meet (choice k of a prompt samples with
seed + k, as llama-server's).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, Union

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse
    from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
    from sse_starlette.sse import EventSourceResponse
    from starlette.background import BackgroundTask
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"pydflash serve needs the server extra: pip install \"pydflash[server]\" ({e})") from e

from . import anthropic_messages, openai_responses
from .errors import ContextLengthExceededError
from .grammar import grammar_of_fields
from .model import Model
from .infill import N_BATCH, InfillRequest, InfillUnsupported, fim_token_ids, infill
from .native_completion import NativeRequest, native_completion
from .server_metrics import ServerMetrics
from .server_slots import Job, RequestError, Slot, SlotPool

__all__ = ["create_app", "serve"]

logger = logging.getLogger("pydflash.server")

MAX_BODY_BYTES = 8 * 2**20  # a chat of a 128K-token context is well under this
READ_TIMEOUT_S = 30.0  # for a request body to arrive (a client trickling it holds no slot, but is cut off)
MAX_CHOICES = 64  # choices in one request (prompts x n)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


# ---- request bodies (strict types: "5" is not a number, 1 is not a bool; unknown fields are ignored) ----
StrList = Union[str, list[str]]


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = None  # <= 0: off, as llama-server clamps it
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    typical_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = Field(None, gt=0.0)
    repeat_last_n: int | None = Field(None, ge=-1)
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: StrList | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices per prompt
    speculative: bool | None = None

    def sampling(self) -> dict:
        names = ("temperature", "top_p", "top_k", "min_p", "typical_p", "presence_penalty", "frequency_penalty",
                 "repeat_penalty", "repeat_last_n", "logit_bias", "seed", "stop", "stream", "stream_options",
                 "speculative")
        return {k: getattr(self, k) for k in names if k in self.model_fields_set and getattr(self, k) is not None}

    def api_kwargs(self, names: Sequence[str]) -> dict:
        """For another API than OpenAI's chat (no stop, no stream_options): sampling() and the fields `names`
        that are set."""
        kw = {k: v for k, v in self.sampling().items() if k not in ("stop", "stream_options")}
        return kw | {k: getattr(self, k) for k in names if getattr(self, k) is not None}


class _Constrained(BaseModel):
    """llama-server's grammar fields (on its OpenAI routes too): GBNF text, or a JSON schema (which wins)."""
    model_config = ConfigDict(strict=True, extra="ignore")

    grammar: str | None = None
    json_schema: dict[str, Any] | None = None

    def grammar_kwargs(self) -> dict:
        grammar = grammar_of_fields(self.grammar, self.json_schema)
        return {} if grammar is None else {"grammar": grammar}


class ChatRequest(_Constrained, _Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def kwargs(self) -> dict:
        kw = self.sampling() | self.grammar_kwargs()
        for k in ("logprobs", "top_logprobs", "response_format", "tools", "tool_choice", "chat_template_kwargs"):
            if getattr(self, k) is not None:
                kw[k] = getattr(self, k)
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        kw["max_tokens"] = max_tokens  # None: until the end of the reply (or the context)
        return kw


class MessagesRequest(_Common):
    """Anthropic's Messages API request (POST /v1/messages): its fields, the sampling ones _Common shares with
    OpenAI's (temperature, top_p, top_k, ...: Anthropic's names too), and chat_template_kwargs (llama-server's)."""
    messages: list[Any] = Field(min_length=1)
    system: Union[str, list[Any]] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("n")
    @classmethod
    def _one(cls, value: int) -> int:
        if value != 1:
            raise ValueError("Anthropic's Messages API has no n: one reply a request")
        return value

    def kwargs(self) -> dict:
        return self.api_kwargs(("system", "tools", "tool_choice", "thinking", "stop_sequences",
                                "chat_template_kwargs")) | {"max_tokens": self.max_tokens}


class ResponsesRequest(_Common):
    """OpenAI's Responses API request (POST /v1/responses): its fields, the sampling ones of _Common, and
    chat_template_kwargs (llama-server's)."""
    input: Union[str, list[Any]]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Union[str, dict[str, Any]] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=0)
    previous_response_id: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("n", "previous_response_id")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name == "n" and value != 1:
            raise ValueError("the Responses API has no n: one reply a request")
        if info.field_name == "previous_response_id" and value:
            raise ValueError("previous_response_id is not supported (nothing is stored): send the conversation "
                             "in input")
        return value

    def kwargs(self) -> dict:
        limit = self.max_output_tokens if self.max_output_tokens is not None else self.max_tokens
        return self.api_kwargs(("instructions", "tools", "tool_choice", "text", "reasoning",
                                "chat_template_kwargs")) | {"max_output_tokens": limit}


class CompletionRequest(_Constrained, _Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    # OpenAI's, refused as llama-server refuses them ("Unsupported param"): no fill-in-the-middle, no ranking
    suffix: Any = None
    best_of: Any = None

    @field_validator("suffix", "best_of")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not (info.field_name == "best_of" and value == 1):
            what = "fill-in-the-middle completion" if info.field_name == "suffix" else "ranking candidates"
            raise ValueError(f"{info.field_name} is not supported ({what})")
        return value

    def prompts(self) -> list:
        """The prompts: a list of strings or of token-id lists is one prompt each (a list of ints is one prompt's
        token ids), as OpenAI's API takes them."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            return list(self.prompt)
        return [self.prompt]

    def kwargs(self) -> dict:
        kw = self.sampling() | self.grammar_kwargs()
        kw.update(max_tokens=self.max_tokens, echo=self.echo)
        if self.logprobs is not None:
            kw["logprobs"] = self.logprobs
        return kw


class TokenizeRequest(BaseModel):
    """llama-server's /tokenize: text, or a list of texts and token ids (the ids kept as they are)."""
    model_config = ConfigDict(strict=True, extra="ignore")

    content: Union[str, list[Union[int, str]]] = ""
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    tokens: list[int] = []


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        where = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']} (got {err.get('input')!r:.60})")
    return "; ".join(parts)


def _public_error(e: BaseException) -> RequestError:
    """The HTTP status for an error raised by the model's API."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, ContextLengthExceededError) and e.n_tokens is not None:  # llama-server's type and fields
        return RequestError(400, str(e), "exceed_context_size_error", n_prompt_tokens=e.n_tokens, n_ctx=e.n_ctx)
    if isinstance(e, (ValueError, TypeError)):  # bad parameters, a template error
        return RequestError(400, str(e))
    return RequestError(500, f"{type(e).__name__}: {e}", "server_error")


# ---- the app ----
@dataclass
class ServerState:
    pool: SlotPool
    slots: list[Slot]
    alias: str
    api_keys: list[str]  # any of them authorizes (none: no key needed)
    max_body: int
    read_timeout: float
    chat_options: dict  # the server's chat_template or chat_format, passed to every chat completion
    metrics: ServerMetrics | None = None  # GET /metrics (None: not served)
    n_batch: int = N_BATCH  # llama-server's -b: what /infill's prefix and suffix are cut to
    slots_endpoint: bool = True  # GET /slots
    # what a request that does not set them gets (serve's -n, sampling flags, --chat-template-kwargs)
    defaults: dict = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(model: Model, *, parallel: int = 1, api_key: str | Sequence[str] | None = None,
               alias: str | None = None, max_queue: int = 16, max_body: int = MAX_BODY_BYTES,
               read_timeout: float = READ_TIMEOUT_S, chat_template: str | None = None, chat_format: str | None = None,
               metrics: bool = False, slots_endpoint: bool = True, defaults: dict | None = None,
               n_batch: int = N_BATCH) -> FastAPI:
    """The FastAPI app serving `model` (and parallel - 1 more sessions over its weights). `api_key`: a key, or a
    list of keys any of which authorizes. `chat_template` (a Jinja template's text) or `chat_format` (a name,
    e.g. "chatml") renders every chat instead of the GGUF's own template, as llama-server's
    --chat-template-file and llama-cpp-python's chat_format do. `metrics` serves GET /metrics, `slots_endpoint`
    GET /slots (llama-server's --metrics and --no-slots). `defaults`: create_completion's and
    create_chat_completion's arguments for requests that do not set them (max_tokens, the sampling parameters,
    chat_template_kwargs: merged under a request's), as llama-server's -n, --temp, ... set its requests'.
    `n_batch`: llama-server's -b, what /infill cuts the prefix and suffix to."""
    state = _server_state(model, parallel, api_key, alias, max_queue, max_body, read_timeout,
                          _chat_options(model, chat_template, chat_format))
    state.slots_endpoint = slots_endpoint
    if isinstance(n_batch, bool) or not isinstance(n_batch, int) or n_batch < 1:
        raise ValueError(f"n_batch = {n_batch!r}, expected an int >= 1")
    state.n_batch = n_batch
    state.defaults = _checked_defaults(defaults)
    if metrics:
        state.metrics = ServerMetrics()
        state.pool.on_finished = state.metrics.record
    app = FastAPI(title="pydflash", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.pydflash = state
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestError, _request_error)
    _add_info_routes(app, state, model)
    _add_completion_routes(app, state)
    _add_token_routes(app, state, model)
    _add_monitor_routes(app, state, model)
    return app


def _server_state(model: Model, parallel, api_key, alias, max_queue, max_body, read_timeout,
                  chat_options: dict) -> ServerState:
    """The options checked, and the slots: `model` and parallel - 1 more sessions over its weights."""
    if not isinstance(parallel, int) or parallel < 1:
        raise ValueError(f"parallel = {parallel!r}, expected an int >= 1")
    if not isinstance(max_queue, int) or max_queue < 0:
        raise ValueError(f"max_queue = {max_queue!r}, expected an int >= 0")
    if isinstance(read_timeout, bool) or not isinstance(read_timeout, (int, float)) or not read_timeout > 0:
        raise ValueError(f"read_timeout = {read_timeout!r}, expected seconds > 0")
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if not all(isinstance(k, str) and k for k in keys):
        raise ValueError(f"api_key = {api_key!r}, expected a non-empty string or a list of them")
    slots = [Slot(0, model)] + [Slot(i, model.new_session()) for i in range(1, parallel)]
    return ServerState(SlotPool(slots, max_queue), slots, alias or os.path.basename(model.model_path), keys,
                       max_body, read_timeout, chat_options)


# the create_* arguments a server's defaults may set (each a request field of the same name)
_DEFAULTABLE = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty",
                "presence_penalty", "frequency_penalty", "repeat_last_n", "seed", "chat_template_kwargs")


def _checked_defaults(defaults: dict | None) -> dict:
    """The server's request defaults, each checked as a request's field would be (a ValueError naming it)."""
    defaults = dict(defaults or {})
    unknown = sorted(set(defaults) - set(_DEFAULTABLE))
    if unknown:
        raise ValueError(f"defaults: {', '.join(unknown)} cannot be set (expected some of {', '.join(_DEFAULTABLE)})")
    try:
        ChatRequest.model_validate({"messages": [{}], **defaults}, strict=False)
    except ValidationError as e:
        raise ValueError(f"defaults: {_validation_message(e)}") from None
    return defaults


def _chat_options(model: Model, chat_template: str | None, chat_format: str | None) -> dict:
    """The chat completion arguments that choose the server's template, checked now (a template that does not
    compile, an unknown format) rather than at the first request."""
    options = {k: v for k, v in (("chat_template", chat_template), ("chat_format", chat_format)) if v is not None}
    if options:
        from .completions import chat_template as resolve

        resolve(model, chat_template, chat_format)
    elif not model.tokenizer.chat_template:
        logger.warning("%s has no tokenizer.chat_template: /v1/chat/completions will refuse requests (pass "
                       "--chat-template-file or --chat-format)", model.model_path)
    return options


async def _http_error(request: Request, exc: StarletteHTTPException):  # 404, 405 in OpenAI's shape
    return _error(exc.status_code, str(exc.detail))


async def _request_error(request: Request, exc: RequestError):
    return JSONResponse(exc.body(), status_code=exc.status)


def _authorize(request: Request, state: ServerState) -> None:
    """Any of the server's keys, as `Authorization: Bearer KEY` or `X-Api-Key: KEY` (llama-server takes both)."""
    if not state.api_keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "").strip()
    # every key compared, in constant time each
    if not sum(secrets.compare_digest(given.encode(), key.encode()) for key in state.api_keys):
        raise RequestError(401, "invalid or missing API key (Authorization: Bearer KEY)", "authentication_error")


async def _read_json(request: Request, state: ServerState) -> Any:
    """The request body as JSON: at most state.max_body bytes, arriving within state.read_timeout."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > state.max_body:
        raise RequestError(413, f"the request body has {declared} bytes; at most {state.max_body} are accepted")
    body = bytearray()

    async def receive_all() -> None:
        async for part in request.stream():
            body.extend(part)
            if len(body) > state.max_body:
                raise RequestError(413, f"the request body exceeds {state.max_body} bytes")

    try:
        await asyncio.wait_for(receive_all(), state.read_timeout)
    except asyncio.TimeoutError:
        raise RequestError(408, f"the request body did not arrive within {state.read_timeout:g} s") from None
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(400, f"the request body is not valid JSON: {e}") from None


def _add_info_routes(app: FastAPI, state: ServerState, model: Model) -> None:
    """/health and /v1/models."""
    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        batched = (model._batcher.stats if model._batcher is not None
                   else {"batches": 0, "batched_parts": 0, "one_by_one": 0})
        return {"status": "ok", "slots_idle": state.pool.n_free,
                "slots_processing": len(state.slots) - state.pool.n_free, "requests_waiting": state.pool.n_waiting,
                "batched_steps": batched["batches"], "batched_evaluations": batched["batched_parts"],
                "steps_part_by_part": batched["one_by_one"]}

    @app.get("/v1/models")
    @app.get("/models")
    async def models(request: Request):
        _authorize(request, state)
        meta = {"arch": model.arch, "n_ctx": model.n_ctx, "n_vocab": model.n_vocab, "parallel": len(state.slots),
                "draft": os.path.basename(model.draft_model_path) if model.draft_model_path else None,
                "proposers": list(model.proposers), "spec_mode": model.spec_mode if model.proposers else None}
        return {"object": "list", "data": [{"id": state.alias, "object": "model", "created": state.created,
                                            "owned_by": "pydflash", "meta": meta}]}


def _add_monitor_routes(app: FastAPI, state: ServerState, model: Model) -> None:
    """llama-server's GET /props (the server's settings), /slots (each slot's state and its last request) and
    /metrics (Prometheus text), in its names; an endpoint turned off answers 501, as llama-server's."""
    @app.get("/props")
    async def props(request: Request):
        _authorize(request, state)
        template = _template_source(model, state.chat_options)
        texts = {"chat_template": template.source, "bos_token": template.bos_token,
                 "eos_token": template.eos_token} if template else dict.fromkeys(("chat_template", "bos_token",
                                                                                   "eos_token"), "")
        return {"default_generation_settings": {"n_ctx": model.n_ctx}, "total_slots": len(state.slots),
                "model_alias": state.alias, "model_path": os.path.basename(model.model_path),
                "modalities": {"vision": False, "video": False, "audio": False},
                "endpoint_slots": state.slots_endpoint, "endpoint_metrics": state.metrics is not None, **texts}

    @app.get("/slots")
    async def slots(request: Request):
        _authorize(request, state)
        if not state.slots_endpoint:
            raise RequestError(501, "this server does not serve /slots (started with --no-slots)",
                               "not_supported_error")
        if request.query_params.get("fail_on_no_slot") and state.pool.n_free == 0:  # (for load balancers)
            raise RequestError(503, "no slot available", "unavailable_error")
        return [_slot_state(slot, state, model) for slot in state.slots]

    @app.get("/metrics")
    async def metrics(request: Request):
        _authorize(request, state)
        if state.metrics is None:
            raise RequestError(501, "this server does not serve /metrics: start it with --metrics",
                               "not_supported_error")
        stats = model._batcher.stats if model._batcher is not None else {"batches": 0}
        per_step = stats["batched_parts"] / stats["batches"] if stats["batches"] else 1.0
        text = state.metrics.prometheus(len(state.slots) - state.pool.n_free, state.pool.n_waiting, per_step)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4",
                                 headers={"Process-Start-Time-Unix": str(int(state.metrics.started))})


def _template_source(model: Model, chat_options: dict):
    """The chat template the server renders with (its override, else the GGUF's), or None without one."""
    from .completions import chat_template

    try:
        return chat_template(model, chat_options.get("chat_template"), chat_options.get("chat_format"))
    except ValueError:  # (ChatTemplateError: the GGUF has none)
        return None


def _slot_state(slot: Slot, state: ServerState, model: Model) -> dict:
    """A slot in llama-server's /slots names: its state, and its last finished request's token counts (and our
    timings of it)."""
    out = {"id": slot.index, "n_ctx": model.n_ctx, "speculative": bool(model.proposers),
           "is_processing": not state.pool.is_free(slot)}
    t = slot.last_timings
    if t is not None:
        out.update(n_prompt_tokens=t["prompt_n"] + t.get("cached_n", 0), n_prompt_tokens_processed=t["prompt_n"],
                   n_prompt_tokens_cache=t.get("cached_n", 0), next_token=[{"n_decoded": t["predicted_n"]}],
                   timings=t)
    return out


def _add_completion_routes(app: FastAPI, state: ServerState) -> None:
    """/v1/chat/completions (also at /chat/completions, as llama-server), /v1/completions, llama-server's own
    /completion (also at /completions) and /infill, OpenAI's /v1/responses (also at /responses), and Anthropic's
    /v1/messages and /v1/messages/count_tokens (errors in Anthropic's shape there)."""
    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(request, "chat", state)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(request, "completion", state)

    @app.post("/completion")
    @app.post("/completions")
    async def native(request: Request):  # llama-server's own API (pydflash/native_completion.py)
        return await _complete(request, "native", state)

    @app.post("/infill")
    async def fill_in_the_middle(request: Request):  # llama-server's /infill (pydflash/infill.py)
        return await _complete(request, "infill", state)

    @app.post("/v1/responses")
    @app.post("/responses")
    async def responses(request: Request):  # OpenAI's Responses API (pydflash/openai_responses.py)
        return await _complete(request, "responses", state)

    @app.post("/v1/messages")
    async def messages(request: Request):  # Anthropic's Messages API (pydflash/anthropic_messages.py)
        try:
            return await _complete(request, "messages", state)
        except RequestError as e:  # (in Anthropic's shape)
            return JSONResponse(anthropic_messages.error_body(e.status, e.message), status_code=e.status)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        try:
            _authorize(request, state)
            req = _validated(MessagesRequest, await _read_json(request, state))
            model = state.slots[0].model
            kwargs = {k: v for k, v in _with_defaults(req, state.defaults).items()
                      if k in ("system", "tools", "tool_choice", "thinking", "chat_template_kwargs")}
            return anthropic_messages.count_tokens(model, req.messages, **kwargs, **state.chat_options)
        except RequestError as e:
            return JSONResponse(anthropic_messages.error_body(e.status, e.message), status_code=e.status)
        except (ValueError, TypeError) as e:
            return JSONResponse(anthropic_messages.error_body(400, str(e)), status_code=400)


def _add_token_routes(app: FastAPI, state: ServerState, model: Model) -> None:
    """llama-server's /tokenize, /detokenize and /apply-template, in its shapes (its defaults: no BOS added, control
    tokens' text parsed as those tokens; a piece that is not valid UTF-8 as its byte values)."""
    def piece(token: int):
        raw = model.tokenizer.token_bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return list(raw)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        _authorize(request, state)
        req = _validated(TokenizeRequest, await _read_json(request, state))
        parts = req.content if isinstance(req.content, list) else [req.content]
        tokens: list[int] = []
        for i, part in enumerate(parts):  # BOS (where the model adds one) before a first text only
            tokens += model.tokenize(part, add_special=req.add_special and i == 0, parse_special=req.parse_special) \
                if isinstance(part, str) else [_token_id(part, model.n_vocab, f"content[{i}]")]
        return {"tokens": [{"id": t, "piece": piece(t)} for t in tokens] if req.with_pieces else tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        _authorize(request, state)
        req = _validated(DetokenizeRequest, await _read_json(request, state))
        ids = [_token_id(t, model.n_vocab, f"tokens[{i}]") for i, t in enumerate(req.tokens)]
        return {"content": model.detokenize(ids)}

    @app.post("/apply-template")
    async def apply_template(request: Request):
        """The prompt a chat completion of these messages would continue (the server's template)."""
        from .chat_messages import prepare
        from .completions import chat_template

        _authorize(request, state)
        req = _validated(ChatRequest, await _read_json(request, state))
        options = state.chat_options
        template = chat_template(model, options.get("chat_template"), options.get("chat_format"))
        kwargs = _with_defaults(req, state.defaults).get("chat_template_kwargs") or {}
        try:
            text = template.render(prepare(req.messages, template), add_generation_prompt=True,
                                   tools=None if req.tool_choice == "none" else req.tools, **kwargs)
        except ValueError as e:  # (ChatTemplateError: the template raised, or a message it cannot render)
            raise RequestError(400, str(e)) from None
        return {"prompt": text}


def _validated(cls: type[BaseModel], payload: Any) -> Any:
    """A request body as `cls`, or a 400 naming what is wrong with it."""
    if not isinstance(payload, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(payload).__name__}")
    try:
        return cls.model_validate(payload)
    except ValidationError as e:
        raise RequestError(400, _validation_message(e)) from None


def _token_id(value: int, n_vocab: int, where: str) -> int:
    if not 0 <= value < n_vocab:
        raise RequestError(400, f"{where}: token id {value} is outside the vocabulary [0, {n_vocab})")
    return value


@dataclass
class _Choice:
    """One generation a request asks for: its slot-affinity key (its prompt), what to run on a slot's Model, and
    whether it is the first of its prompt (the one whose prompt tokens the request's usage counts)."""
    key: str
    produce: Callable[[Model], Any]
    first_of_prompt: bool
    response_fields: Sequence[str] = ()  # (llama-server's: the fields of its own answer a client asks for)


def _parse_request(payload: Any, kind: str, state: ServerState) -> tuple[bool, list[_Choice]]:
    """(stream?, the choices) for a request body: n of each prompt, choice k of a prompt sampling with seed + k
    (the request's seed, else the model's; neither: each draws its own), as llama-server's n; llama-server's own
    /completion ("native"): one."""
    if kind in ("native", "infill"):
        return _parse_native(payload, kind, state)
    req = _validated({"chat": ChatRequest, "messages": MessagesRequest, "responses": ResponsesRequest}.get(
        kind, CompletionRequest), payload)
    prompts = [req.messages] if kind in ("chat", "messages") else [req.input] if kind == "responses" else \
        req.prompts()
    if len(prompts) * req.n > MAX_CHOICES:
        raise RequestError(400, f"{len(prompts)} prompts x n = {req.n} ask for {len(prompts) * req.n} choices; at "
                                f"most {MAX_CHOICES} in one request")
    seed = req.seed if req.seed is not None else state.defaults.get("seed", state.slots[0].model.seed)
    choices = []
    for prompt in prompts:
        for k in range(req.n):
            kwargs = _with_defaults(req, state.defaults)
            if k > 0 and seed is not None:
                kwargs["seed"] = seed + k
            choices.append(_Choice(json.dumps(prompt), _producer(kind, prompt, kwargs, state), k == 0))
    return req.stream, choices


def _parse_native(payload: Any, kind: str, state: ServerState) -> tuple[bool, list[_Choice]]:
    """llama-server's own /completion or /infill request: (stream?, its one choice)."""
    if isinstance(payload, dict):  # the server's defaults under the request's own fields
        payload = {**{"n_predict" if k == "max_tokens" else k: v for k, v in state.defaults.items()
                      if k != "chat_template_kwargs"}, **payload}
    native = _validated(InfillRequest if kind == "infill" else NativeRequest, payload)
    try:
        native.check()
        if kind == "native":
            return native.stream, [_Choice(json.dumps(native.prompt), lambda m: native_completion(m, native), True,
                                           native.response_fields)]
        fim_token_ids(state.slots[0].model)
    except InfillUnsupported as e:
        raise RequestError(501, str(e), "not_supported_error") from None
    except ValueError as e:
        raise RequestError(400, str(e)) from None
    server_n_predict = state.defaults.get("max_tokens")
    key = json.dumps([c.text for c in native.input_extra] + [native.input_prefix])
    return native.stream, [_Choice(key, lambda m: infill(m, native, state.n_batch, (
        -1 if server_n_predict is None else server_n_predict)), True, native.response_fields)]


def _with_defaults(req: ChatRequest | CompletionRequest | MessagesRequest | ResponsesRequest, defaults: dict) -> dict:
    """The request's create_* arguments, the server's defaults where it sets none."""
    kwargs = req.kwargs()
    for name, value in defaults.items():
        if name == "chat_template_kwargs":
            if isinstance(req, (ChatRequest, MessagesRequest, ResponsesRequest)):
                kwargs[name] = {**value, **(req.chat_template_kwargs or {})}
        elif name == "max_tokens":
            if not req.model_fields_set & {"max_tokens", "max_completion_tokens", "max_output_tokens"}:
                kwargs["max_output_tokens" if isinstance(req, ResponsesRequest) else name] = value
        elif getattr(req, name) is None:  # not given, or given as null
            kwargs[name] = value
    return kwargs


# the Model call and its conversation's argument that answer each kind of chat request
_CHAT_CALLS = {"chat": ("create_chat_completion", "messages"), "messages": ("create_message", "messages"),
               "responses": ("create_response", "input")}


def _producer(kind: str, prompt, kwargs: dict, state: ServerState) -> Callable[[Model], Any]:
    if kind not in _CHAT_CALLS:
        completion = dict(kwargs, prompt=prompt)
        return lambda m: m.create_completion(**completion)
    call, conversation = _CHAT_CALLS[kind]
    chat = dict(kwargs, **{conversation: prompt}, **state.chat_options)
    return lambda m: getattr(m, call)(**chat)


async def _complete(request: Request, kind: str, state: ServerState):
    """A completion request: each of its choices (one, unless n or a list of prompts asks for more) on the first
    free slot (the one that last served the same prompt, if free), answered at once or streamed as server-sent
    events."""
    _authorize(request, state)
    started = time.perf_counter()
    stream, choices = _parse_request(await _read_json(request, state), kind, state)
    runs = _ChoiceRuns(state, choices)
    log = _RequestLog(state, request, kind, runs.where, started)
    if not stream:
        return await _respond(request, runs, state, log)
    try:
        first = await runs.next()  # argument errors (a prompt over the context ...) come before any chunk
    except Exception as e:
        await runs.close()
        err = _public_error(e)
        log.write(f"{err.status}", None)  # (as a request that is not streamed logs it)
        raise err from None
    return EventSourceResponse(_events(runs, first, state, log), background=BackgroundTask(runs.close),
                               ping=15, sep="\n")


def _fields(answer: dict, paths: Sequence[str]) -> dict:
    """llama-server's response_fields: only the fields named ("a/b" a nested one, kept under that name), where
    a request names any (its json_get_nested_values)."""
    if not paths:
        return answer
    out = {}
    for path in paths:
        value: Any = answer
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


def _named_event(item: dict, state: ServerState) -> tuple[dict, str | None]:
    """An Anthropic or Responses event with the server's model name, and how the reply ended where it says so."""
    if "message" in item:  # (Anthropic's message_start)
        return {**item, "message": _public(item["message"], state)}, None
    if "response" in item:
        item = {**item, "response": _public(item["response"], state)}
        return item, item["response"]["status"] if item["type"] in ("response.completed", "response.incomplete") \
            else None
    return item, item["delta"]["stop_reason"] if item["type"] == "message_delta" else None


class _RequestLog:
    """One log line per request: endpoint, slot (or its choices), status, tokens, tok/s, tau and acceptance."""

    def __init__(self, state: ServerState, request: Request, kind: str, where: Callable[[], str], started: float):
        self.state, self.kind, self.where, self.started = state, kind, where, started
        self.client = f"{request.client.host}:{request.client.port}" if request.client else "-"

    def write(self, status: str, result: dict | None) -> None:
        wall = time.perf_counter() - self.started
        parts = [f"{self.client} {self.kind} {self.where()} {status} in {wall:.2f} s"]
        t = (result or {}).get("timings")
        if t:
            parts.append(f"prompt {t['prompt_n']} tok (cached {t.get('cached_n', 0)}), "
                         f"{t['predicted_n']} tok at {t['predicted_per_second']:.1f} tok/s")
            if t.get("n_rounds"):
                parts.append(f"tau {t['tau']:.2f}, acceptance {t['draft_acceptance_rate']:.2f}")
            elif "n_rounds" in t:  # (a speculative model that decoded it plainly: auto chose to, or one token)
                parts.append("no speculative round")
        logger.info("; ".join(parts))


def _public(chunk: dict, state: ServerState) -> dict:
    return {**chunk, "model": state.alias} if "model" in chunk else chunk


class _ChoiceRuns:
    """A request's choices on the slots, each in a task of its own that takes a slot when one is free (at most as
    many at once as there are slots, so that one request never queues more than that for them) and runs its Job;
    their items come out of one queue as (choice, item), in the order they are made."""

    _ENDED = object()

    def __init__(self, state: ServerState, choices: list[_Choice]):
        self.choices = choices
        self.slot_of: dict[int, int] = {}  # choice -> the slot it ran on
        self._queue: asyncio.Queue = asyncio.Queue()
        self._running = len(choices)
        gate = asyncio.Semaphore(len(state.slots))
        self._tasks = [asyncio.ensure_future(self._run(k, c, state.pool, gate)) for k, c in enumerate(choices)]

    def where(self) -> str:
        """For the log: the slot of a lone choice, else how many choices."""
        if len(self.choices) > 1:
            return f"{len(self.choices)} choices"
        return f"slot {self.slot_of[0]}" if 0 in self.slot_of else "no slot"

    async def _run(self, k: int, choice: _Choice, pool: SlotPool, gate: asyncio.Semaphore) -> None:
        try:
            async with gate:
                slot = await pool.acquire(choice.key)
                slot.last_key, self.slot_of[k] = choice.key, slot.index
                job = Job(pool, slot, choice.produce)
                try:
                    while (item := await job.next()) is not Job._END:
                        self._queue.put_nowait((k, item))
                finally:
                    await job.close()
            self._queue.put_nowait((k, self._ENDED))
        except Exception as e:  # the generation's (or the pool's 503), raised by next()
            self._queue.put_nowait((k, e))

    async def next(self) -> tuple[int, Any] | None:
        """The next (choice, item); None once every choice has ended. A choice's error is raised here."""
        while self._running:
            k, item = await self._queue.get()
            if item is self._ENDED:
                self._running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                return k, item
        return None

    async def close(self) -> None:
        """Every choice's generation aborted if it still runs, and its slot back in the pool."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


_GONE = object()


async def _unless_gone(request: Request, awaitable):
    """What `awaitable` returns, or _GONE when the client disconnects first (it is cancelled then)."""
    task = asyncio.ensure_future(awaitable)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            return _GONE


async def _respond(request: Request, runs: _ChoiceRuns, state: ServerState, log: _RequestLog):
    """A non-streamed answer of the request's choices; a client that goes away meanwhile aborts them all."""
    results: list[Any] = [None] * len(runs.choices)
    try:
        while True:
            try:
                got = await _unless_gone(request, runs.next())
            except Exception as e:
                err = _public_error(e)
                log.write(f"{err.status}", None)
                raise err from None
            if got is _GONE:
                log.write("client gone", None)
                return _error(499, "client closed the request")
            if got is None:
                break
            results[got[0]] = got[1]
    finally:
        await runs.close()
    if results[0].get("type") == "message":  # Anthropic's
        log.write(f"200 {results[0]['stop_reason']}", results[0])
        return _public(results[0], state)
    if results[0].get("object") == "response":  # OpenAI's Responses
        log.write(f"200 {results[0]['status']}", results[0])
        return _public(results[0], state)
    if "choices" not in results[0]:  # llama-server's own answer: as it is, with the slot that served it
        log.write(f"200 {results[0]['stop_type']}", results[0])
        return _fields(_public({**results[0], "id_slot": runs.slot_of[0]}, state), runs.choices[0].response_fields)
    answer = {**results[0], "choices": [{**r["choices"][0], "index": k} for k, r in enumerate(results)],
              "usage": _summed_usage({k: r["usage"] for k, r in enumerate(results)}, runs.choices)}
    log.write("200 " + ",".join(c["finish_reason"] for c in answer["choices"]), answer)
    return _public(answer, state)  # (id and timings: the first choice's, as llama-server keeps its first result's)


def _summed_usage(usages: dict[int, dict], choices: list[_Choice]) -> dict:
    """Usage of several choices: their completion tokens summed, each prompt's tokens once (as OpenAI counts n)."""
    firsts = [u for k, u in usages.items() if choices[k].first_of_prompt]
    prompt = sum(u["prompt_tokens"] for u in firsts)
    completion = sum(u["completion_tokens"] for u in usages.values())
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in firsts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _events(runs: _ChoiceRuns, first: tuple[int, dict], state: ServerState, log: _RequestLog):
    """SSE events of the choices' streams, then [DONE]: interleaved as they are made, each chunk with its
    choice's index and the request's one id; their usage chunks (stream_options.include_usage) summed into one
    at the end. llama-server's own chunks (/completion) pass as they are, with the slot that served them, and no
    [DONE], as there. An error after the first chunk is reported in the stream, as llama-server does; a client
    that disconnects closes it early."""
    request_id, usages, usage_chunk, finished, last = first[1].get("id"), {}, None, [], None
    status = "200 client gone"
    try:
        got = first
        while got is not None:
            k, item = got
            if log.kind in ("messages", "responses"):  # Anthropic's or OpenAI's Responses events, named by type
                item, ended = _named_event(item, state)
                if ended is not None:
                    finished.append(ended)
                    last = item
                yield {"event": item["type"], "data": json.dumps(item)}
            elif "choices" not in item and "usage" not in item:  # llama-server's own chunks, as they are
                chunk = item
                if chunk["stop"]:  # (the slot is named in the answer only, as there)
                    chunk = last = {**item, "id_slot": runs.slot_of[k]}
                    finished.append(chunk["stop_type"])
                    chunk = _fields(chunk, runs.choices[k].response_fields)
                yield {"data": json.dumps(_public(chunk, state))}
            elif item.get("usage") and not item.get("choices"):
                usages[k], usage_chunk = item["usage"], item
            else:
                chunk = {**item, "id": request_id, "choices": [{**c, "index": k} for c in item.get("choices", [])]}
                if chunk["choices"] and chunk["choices"][0].get("finish_reason"):
                    finished.append(chunk["choices"][0]["finish_reason"])
                    last = chunk
                yield {"data": json.dumps(_public(chunk, state))}
            got = await runs.next()
        if usage_chunk is not None:
            summed = {**usage_chunk, "id": request_id, "usage": _summed_usage(usages, runs.choices)}
            yield {"data": json.dumps(_public(summed, state))}
        if "choices" in first[1]:
            yield {"data": "[DONE]"}
        status = f"200 {','.join(finished)} (stream)"
    except Exception as e:
        err = _public_error(e)
        status = f"{err.status} in stream"
        if log.kind == "messages":
            yield {"event": "error", "data": json.dumps(anthropic_messages.error_body(err.status, err.message))}
        elif log.kind == "responses":  # (the Responses API's error event)
            yield {"event": "error", "data": json.dumps({"type": "error", "code": err.kind, "message": err.message,
                                                         "param": None, "sequence_number": -1})}
        else:
            yield {"data": json.dumps(err.body())}
    finally:
        log.write(status, last)
        await runs.close()


def serve(model: Model, *, host: str = "127.0.0.1", port: int = 8080, parallel: int = 1,
          api_key: str | Sequence[str] | None = None, alias: str | None = None, max_queue: int = 16,
          read_timeout: float = READ_TIMEOUT_S, log_level: str = "info", chat_template: str | None = None,
          chat_format: str | None = None, metrics: bool = False, slots_endpoint: bool = True,
          defaults: dict | None = None, n_batch: int = N_BATCH) -> None:
    """Run the server until interrupted (arguments as for `create_app`)."""
    app = create_app(model, parallel=parallel, api_key=api_key, alias=alias, max_queue=max_queue,
                     read_timeout=read_timeout, chat_template=chat_template, chat_format=chat_format,
                     metrics=metrics, slots_endpoint=slots_endpoint, defaults=defaults, n_batch=n_batch)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # (the command's handler for the library's lines would print each again)
    logger.setLevel(log_level.upper())
    logger.info("serving %s on http://%s:%d/v1 with %d slot(s)%s", app.state.pydflash.alias, host, port, parallel,
                ", API key required" if api_key else "")
    # the access log would be a second line per request: ours carries the tokens and speeds
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False, timeout_graceful_shutdown=5)
