"""The server's slots (`pydflash serve --parallel N`): N sessions over one copy of the weights, handed to requests
first come first served (the one whose last prompt shares the longest prefix with the request's, when several are
free), and a Job: one generation on a slot, run on a thread of its own, its items handed to the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

from .model import Model


class RequestError(Exception):
    """A request the server answers with `status` and an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", **details):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.details = details  # more fields of the error object (llama-server's n_prompt_tokens, n_ctx)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "code": self.status, **self.details}}


@dataclass
class Slot:
    index: int
    model: Model
    last_key: str = ""  # what its last request's prompt was made of (for prefix reuse)
    last_timings: dict | None = None  # its last finished generation's (GET /slots)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotPool:
    """N slots, FIFO waiters bounded by max_queue. Used from the event loop only (no locks needed)."""

    def __init__(self, slots: list[Slot], max_queue: int, on_finished: Callable[[dict], None] | None = None):
        self.slots = slots
        self.on_finished = on_finished  # called with each finished generation's timings
        self._free = list(slots)
        self._waiters: deque[asyncio.Future] = deque()
        self.max_queue = max_queue

    @property
    def n_free(self) -> int:
        return len(self._free)

    def is_free(self, slot: Slot) -> bool:
        return slot in self._free

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
        self._closing: asyncio.Future | None = None
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
        if kind == "item" and isinstance(value, dict) and "timings" in value:  # the answer, or a stream's last chunk
            self.slot.last_timings = value["timings"]
            if self.pool.on_finished is not None:
                self.pool.on_finished(value["timings"])
        return self._END if kind == "end" else value

    async def close(self) -> None:
        """Aborts the generation if it still runs, waits for its thread to let go of the slot and releases it. A
        cancelled caller (a disconnected client's task: an anyio cancel scope, or asyncio's Task.cancel, which
        anyio's shield does not hold off) stops waiting at once, and the closing goes on in a task of its own."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        if not self.finished.done():
            self.cancelled.set()
            self.slot.model.abort()
            await self.finished
        self.pool.release(self.slot)
