"""`pydflash serve`: an OpenAI-compatible HTTP server (FastAPI, uvicorn, sse-starlette: `pip install
"pydflash[server]"`).

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health. `--parallel N` slots are
N sessions (`Model.new_session`) over one copy of the weights; a request takes a free slot (the one whose last
request shares the longest prefix with it, so multi-turn chats reuse their cached prompt), else waits in a
queue of at most `max_queue` requests, past which it gets 503. Each generation runs on a thread of its own (the
core releases the GIL), and the generations running at the same time meet at each step in one batched target
evaluation (continuous batching: `Model.new_session`); a client that disconnects aborts its generation within
one round and frees the slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Union

try:
    import anyio
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, Field, ValidationError
    from sse_starlette.sse import EventSourceResponse
    from starlette.background import BackgroundTask
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"pydflash serve needs the server extra: pip install \"pydflash[server]\" ({e})") from e

from .model import Model

__all__ = ["create_app", "serve"]

logger = logging.getLogger("pydflash.server")

MAX_BODY_BYTES = 8 * 2**20  # a chat of a 128K-token context is well under this
READ_TIMEOUT_S = 30.0  # for a request body to arrive (a client trickling it holds no slot, but is cut off)


class RequestError(Exception):
    """A request the server answers with `status` and an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


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
    top_k: int | None = Field(None, ge=0)
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
    n: Literal[1] = 1  # one choice per request
    speculative: bool | None = None

    def sampling(self) -> dict:
        names = ("temperature", "top_p", "top_k", "min_p", "typical_p", "presence_penalty", "frequency_penalty",
                 "repeat_penalty", "repeat_last_n", "logit_bias", "seed", "stop", "stream", "stream_options",
                 "speculative")
        return {k: getattr(self, k) for k in names if k in self.model_fields_set and getattr(self, k) is not None}


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def kwargs(self) -> dict:
        kw = self.sampling()
        for k in ("logprobs", "top_logprobs", "response_format", "tools", "tool_choice", "chat_template_kwargs"):
            if getattr(self, k) is not None:
                kw[k] = getattr(self, k)
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        kw["max_tokens"] = max_tokens  # None: until the end of the reply (or the context)
        return kw


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False

    def kwargs(self) -> dict:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise RequestError(400, f"prompt: a list of {len(prompt)} strings; one prompt per request")
            prompt = prompt[0]
        kw = self.sampling()
        kw.update(prompt=prompt, max_tokens=self.max_tokens, echo=self.echo)
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


# ---- slots ----
@dataclass
class Slot:
    index: int
    model: Model
    last_key: str = ""  # what its last request's prompt was made of (for prefix reuse)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotPool:
    """N slots, FIFO waiters bounded by max_queue. Used from the event loop only (no locks needed)."""

    def __init__(self, slots: list[Slot], max_queue: int):
        self.slots = slots
        self._free = list(slots)
        self._waiters: deque[asyncio.Future] = deque()
        self.max_queue = max_queue

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    async def acquire(self, key: str) -> Slot:
        if self._free:
            best = max(self._free, key=lambda s: _common_prefix(s.last_key, key))
            self._free.remove(best)
            return best
        if self.n_waiting >= self.max_queue:
            raise RequestError(503, f"all {len(self.slots)} slots are busy and {self.max_queue} requests are "
                                    f"waiting; retry later", "server_overloaded")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(waiter.result())  # handed over just as the client went away
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def release(self, slot: Slot) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(slot)
                return
        self._free.append(slot)


class Job:
    """One request's generation on a slot, run on a thread: items go to the event loop through a queue.
    close() aborts it if it still runs, waits for the thread to let go of the slot and releases the slot."""

    _END = object()

    def __init__(self, pool: SlotPool, slot: Slot, produce: Callable[[Model], Any]):
        self.pool, self.slot = pool, slot
        self.loop = asyncio.get_running_loop()
        self.items: asyncio.Queue = asyncio.Queue()
        self.finished = self.loop.create_future()
        self.cancelled = threading.Event()
        self._closed = False
        self.thread = threading.Thread(target=self._work, args=(produce,), daemon=True,
                                       name=f"pydflash-slot-{slot.index}")
        self.thread.start()

    def _post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the loop is gone (shutdown)
            self.cancelled.set()

    def _work(self, produce) -> None:
        try:
            out = produce(self.slot.model)
            if isinstance(out, Iterator):
                try:
                    for item in out:
                        self._post(("item", item))
                        if self.cancelled.is_set():
                            break
                finally:
                    out.close()  # aborts the generation if it was cut short
            else:
                self._post(("item", out))
        except BaseException as e:  # re-raised on the event loop
            self._post(("error", e))
        finally:
            self._post(("end", None))
            try:
                self.loop.call_soon_threadsafe(lambda: self.finished.done() or self.finished.set_result(None))
            except RuntimeError:
                pass

    async def next(self):
        """The next item, Job._END when done; the producer's exception is raised here."""
        kind, value = await self.items.get()
        if kind == "error":
            raise value
        return self._END if kind == "end" else value

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # shielded: this runs as a disconnected client's task is being cancelled, and the slot must come back
        with anyio.CancelScope(shield=True):
            if not self.finished.done():
                self.cancelled.set()
                self.slot.model.abort()
                await self.finished
            self.pool.release(self.slot)


def _public_error(e: BaseException) -> RequestError:
    """The HTTP status for an error raised by the model's API."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, (ValueError, TypeError)):  # bad parameters, a prompt over the context, a template error
        return RequestError(400, str(e))
    return RequestError(500, f"{type(e).__name__}: {e}", "server_error")


# ---- the app ----
@dataclass
class ServerState:
    pool: SlotPool
    slots: list[Slot]
    alias: str
    api_key: str | None
    max_body: int
    read_timeout: float
    chat_options: dict  # the server's chat_template or chat_format, passed to every chat completion
    created: int = field(default_factory=lambda: int(time.time()))


def create_app(model: Model, *, parallel: int = 1, api_key: str | None = None, alias: str | None = None,
               max_queue: int = 16, max_body: int = MAX_BODY_BYTES, read_timeout: float = READ_TIMEOUT_S,
               chat_template: str | None = None, chat_format: str | None = None) -> FastAPI:
    """The FastAPI app serving `model` (and parallel - 1 more sessions over its weights). `chat_template` (a
    Jinja template's text) or `chat_format` (a name, e.g. "chatml") renders every chat instead of the GGUF's
    own template, as llama-server's --chat-template-file and llama-cpp-python's chat_format do."""
    state = _server_state(model, parallel, api_key, alias, max_queue, max_body, read_timeout,
                          _chat_options(model, chat_template, chat_format))
    app = FastAPI(title="pydflash", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.pydflash = state
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestError, _request_error)
    _add_info_routes(app, state, model)
    _add_completion_routes(app, state)
    _add_token_routes(app, state, model)
    return app


def _server_state(model: Model, parallel, api_key, alias, max_queue, max_body, read_timeout,
                  chat_options: dict) -> ServerState:
    """The options checked, and the slots: `model` and parallel - 1 more sessions over its weights."""
    if not isinstance(parallel, int) or parallel < 1:
        raise ValueError(f"parallel = {parallel!r}, expected an int >= 1")
    if not isinstance(max_queue, int) or max_queue < 0:
        raise ValueError(f"max_queue = {max_queue!r}, expected an int >= 0")
    slots = [Slot(0, model)] + [Slot(i, model.new_session()) for i in range(1, parallel)]
    return ServerState(SlotPool(slots, max_queue), slots, alias or os.path.basename(model.model_path), api_key,
                       max_body, read_timeout, chat_options)


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
    return _error(exc.status, exc.message, exc.kind)


def _authorize(request: Request, state: ServerState) -> None:
    if state.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), state.api_key.encode()):
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
        batched = model._batcher.stats if model._batcher is not None else {"batches": 0, "batched_parts": 0}
        return {"status": "ok", "slots_idle": state.pool.n_free,
                "slots_processing": len(state.slots) - state.pool.n_free, "requests_waiting": state.pool.n_waiting,
                "batched_steps": batched["batches"], "batched_evaluations": batched["batched_parts"]}

    @app.get("/v1/models")
    @app.get("/models")
    async def models(request: Request):
        _authorize(request, state)
        meta = {"arch": model.arch, "n_ctx": model.n_ctx, "n_vocab": model.n_vocab, "parallel": len(state.slots),
                "draft": os.path.basename(model.draft_model_path) if model.draft_model_path else None,
                "spec_mode": model.spec_mode if model.draft_model_path else None}
        return {"object": "list", "data": [{"id": state.alias, "object": "model", "created": state.created,
                                            "owned_by": "pydflash", "meta": meta}]}


def _add_completion_routes(app: FastAPI, state: ServerState) -> None:
    """/v1/chat/completions (also at /chat/completions, as llama-server) and /v1/completions."""
    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(request, "chat", state)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(request, "completion", state)


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
        from .completions import chat_template

        _authorize(request, state)
        req = _validated(ChatRequest, await _read_json(request, state))
        options = state.chat_options
        template = chat_template(model, options.get("chat_template"), options.get("chat_format"))
        try:
            text = template.render(req.messages, tools=None if req.tool_choice == "none" else req.tools,
                                   add_generation_prompt=True, **(req.chat_template_kwargs or {}))
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


def _parse_request(payload: Any, kind: str, state: ServerState) -> tuple[bool, str, Callable[[Model], Any]]:
    """(stream?, the slot-affinity key, what to run on a slot's Model) for a request body."""
    req = _validated(ChatRequest if kind == "chat" else CompletionRequest, payload)
    kwargs = req.kwargs()
    key = json.dumps(req.messages if kind == "chat" else req.prompt)
    if kind == "chat":
        kwargs.update(messages=req.messages, **state.chat_options)
        return req.stream, key, lambda m: m.create_chat_completion(**kwargs)
    return req.stream, key, lambda m: m.create_completion(**kwargs)


async def _complete(request: Request, kind: str, state: ServerState):
    """A completion request: on the first free slot (the one that last served the same prompt, if free), answered
    at once or streamed as server-sent events."""
    _authorize(request, state)
    started = time.perf_counter()
    stream, key, produce = _parse_request(await _read_json(request, state), kind, state)
    slot = await state.pool.acquire(key)
    slot.last_key = key
    job = Job(state.pool, slot, produce)
    log = _RequestLog(state, request, kind, slot.index, started)
    if not stream:
        return await _respond_once(request, job, state, log)
    try:
        first = await job.next()  # argument errors (a prompt over the context ...) come before any chunk
    except BaseException as e:
        await job.close()
        raise _public_error(e) from None
    return EventSourceResponse(_events(job, first, state, log), background=BackgroundTask(job.close),
                               ping=15, sep="\n")


class _RequestLog:
    """One log line per request: endpoint, slot, status, tokens, tok/s, tau and acceptance."""

    def __init__(self, state: ServerState, request: Request, kind: str, slot: int, started: float):
        self.state, self.kind, self.slot, self.started = state, kind, slot, started
        self.client = f"{request.client.host}:{request.client.port}" if request.client else "-"

    def write(self, status: str, result: dict | None) -> None:
        wall = time.perf_counter() - self.started
        parts = [f"{self.client} {self.kind} slot {self.slot} {status} in {wall:.2f} s"]
        t = (result or {}).get("timings")
        if t:
            parts.append(f"prompt {t['prompt_n']} tok (cached {t.get('cached_n', 0)}), "
                         f"{t['predicted_n']} tok at {t['predicted_per_second']:.1f} tok/s")
            if "tau" in t:
                parts.append(f"tau {t['tau']:.2f}, acceptance {t['draft_acceptance_rate']:.2f}")
        logger.info("; ".join(parts))


def _public(chunk: dict, state: ServerState) -> dict:
    return {**chunk, "model": state.alias} if "model" in chunk else chunk


async def _respond_once(request: Request, job: Job, state: ServerState, log: _RequestLog):
    """A non-streamed answer; a client that goes away meanwhile aborts the generation."""
    try:
        getter = asyncio.ensure_future(job.next())
        while True:
            done, _ = await asyncio.wait({getter}, timeout=0.25)
            if done:
                break
            if await request.is_disconnected():
                getter.cancel()
                log.write("client gone", None)
                return _error(499, "client closed the request")
        try:
            result = getter.result()
        except BaseException as e:
            err = _public_error(e)
            log.write(f"{err.status}", None)
            raise err from None
        log.write(f"200 {result['choices'][0]['finish_reason']}", result)
        return _public(result, state)
    finally:
        await job.close()


async def _events(job: Job, first, state: ServerState, log: _RequestLog):
    """SSE events of a streamed answer, then [DONE]; closed early when the client disconnects."""
    last: dict | None = None
    status = "200 client gone"
    try:
        item = first
        while item is not Job._END:
            if item.get("choices") and item["choices"][0].get("finish_reason"):
                last = item
            elif item.get("usage") and last is not None:
                last = {**last, "usage": item["usage"]}
            yield {"data": json.dumps(_public(item, state))}
            item = await job.next()
        yield {"data": "[DONE]"}
        status = f"200 {last['choices'][0]['finish_reason']} (stream)" if last else "200 (stream)"
    except Exception as e:  # after the response started: reported in the stream, as llama-server does
        err = _public_error(e)
        status = f"{err.status} in stream"
        yield {"data": json.dumps({"error": {"message": err.message, "type": err.kind, "code": err.status}})}
    finally:
        log.write(status, last)
        await job.close()


def serve(model: Model, *, host: str = "127.0.0.1", port: int = 8080, parallel: int = 1,
          api_key: str | None = None, alias: str | None = None, max_queue: int = 16,
          read_timeout: float = READ_TIMEOUT_S, log_level: str = "info", chat_template: str | None = None,
          chat_format: str | None = None) -> None:
    """Run the server until interrupted (arguments as for `create_app`)."""
    app = create_app(model, parallel=parallel, api_key=api_key, alias=alias, max_queue=max_queue,
                     read_timeout=read_timeout, chat_template=chat_template, chat_format=chat_format)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(log_level.upper())
    logger.info("serving %s on http://%s:%d/v1 with %d slot(s)%s", app.state.pydflash.alias, host, port, parallel,
                ", API key required" if api_key else "")
    # the access log would be a second line per request: ours carries the tokens and speeds
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False, timeout_graceful_shutdown=5)
