"""AsyncEngine: one background step loop over an :class:`Engine`, for many concurrent callers.

Requests join and leave between steps (continuous batching across callers). The Engine is not
thread-safe, so it has one owner at a time: an ``asyncio.Lock`` is held while a step runs (in one
dedicated worker thread, so the event loop stays responsive and torch keeps one OpenMP team) and
while a request is submitted or aborted.
Tokens come out of the step thread through ``loop.call_soon_threadsafe`` into one
``asyncio.Queue`` per request.

    engine = AsyncEngine(Engine(model, tokenizer=tok), max_pending=64)
    await engine.start()
    stream = await engine.submit(prompt_ids, max_new_tokens=64)   # QueueFullError, ValueError
    async for event in stream:                                   # TokenEvent / FinishEvent
        ...
    await engine.shutdown()

A caller that stops iterating (client gone) calls ``await engine.abort(stream)``: the request
leaves the scheduler and its KV blocks are released before the next step.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .engine import Engine
from .scheduler import Request


class QueueFullError(RuntimeError):
    """More requests are pending than ``max_pending`` allows (HTTP 429)."""


@dataclass
class TokenEvent:
    index: int  # which of the n samples
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class FinishEvent:
    index: int
    finish_reason: str


@dataclass
class RequestStream:
    """The events of one submitted prompt (``n`` samples) in order; iterate with ``async for``."""

    requests: list[Request]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.requests)

    def __aiter__(self):
        return self._events()

    async def _events(self):
        open_samples = len(self.requests)
        while open_samples:
            event = await self.queue.get()
            if isinstance(event, FinishEvent):
                open_samples -= 1
            yield event


class AsyncEngine:
    """Drives ``engine`` from an asyncio program (see the module docstring).

    ``max_pending`` bounds the requests (samples) not yet finished, waiting or running; beyond it
    :meth:`submit` raises :class:`QueueFullError`.
    """

    def __init__(self, engine: Engine, max_pending: int = 256):
        self.engine, self.max_pending = engine, max_pending
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._streams: dict[int, RequestStream] = {}  # request id -> its stream
        self._closing = False
        self.step_error: BaseException | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specgraph-step")

    @property
    def num_pending(self) -> int:
        return len(self._streams)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="specgraph-step-loop")

    async def submit(self, prompt_ids: list[int], *, n: int = 1, logprobs: int | None = None,
                     **sampling: Any) -> RequestStream:
        """Queue one prompt; ``sampling`` takes :meth:`Engine.submit`'s keywords. Raises ``ValueError``
        for a bad request (one that can never fit the KV pool included) and :class:`QueueFullError`."""
        if self._closing:
            raise QueueFullError("the server is shutting down")
        if n > self.max_pending:
            raise ValueError(f"n={n} samples can never be pending at once (max_pending={self.max_pending})")
        if self.num_pending + n > self.max_pending:
            raise QueueFullError(f"{self.num_pending} requests pending (limit {self.max_pending}); retry later")
        stream = RequestStream([])
        async with self._lock:
            requests = self.engine.submit(prompt_ids, n=n, logprobs=logprobs, **sampling)
            for index, r in enumerate(requests):
                r.on_token = self._token_callback(stream, index, r)
                self._streams[r.request_id] = stream
            stream.requests = requests
        self._wake.set()
        return stream

    async def abort(self, stream: RequestStream) -> None:
        """Cancel every unfinished sample of ``stream``; their blocks are released at once."""
        async with self._lock:
            for index, r in enumerate(stream.requests):
                if not r.finished:
                    self.engine.abort(r)
                    stream.queue.put_nowait(FinishEvent(index, "abort"))
                self._streams.pop(r.request_id, None)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop accepting requests, let in-flight ones finish for ``timeout`` s, abort the rest."""
        self._closing = True
        deadline = time.perf_counter() + timeout
        while self._streams and time.perf_counter() < deadline:
            await asyncio.sleep(0.02)
        for stream in {id(s): s for s in self._streams.values()}.values():
            await self.abort(stream)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    # ---------------------------------------------------------------- internals
    def _token_callback(self, stream: RequestStream, index: int, r: Request):
        def on_token(token: int) -> None:  # runs in the step thread
            lp, top = r.output_logprobs[-1] if r.logprobs is not None else (None, None)
            events = [TokenEvent(index, token, lp, top)]
            if r.finished:
                events.append(FinishEvent(index, r.finish_reason))
            self._loop.call_soon_threadsafe(self._deliver, stream, events, r.request_id if r.finished else None)

        return on_token

    def _deliver(self, stream: RequestStream, events: list, finished_id: int | None) -> None:
        for event in events:
            stream.queue.put_nowait(event)
        if finished_id is not None:
            self._streams.pop(finished_id, None)

    async def _run(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._lock:
                try:
                    await self._loop.run_in_executor(self._executor, self.engine.step)
                except Exception as e:  # a broken step must not hang every client: fail them all
                    self.step_error = e
                    for r in list(self.engine.scheduler.running) + list(self.engine.scheduler.waiting):
                        self.engine.abort(r)
                        stream = self._streams.pop(r.request_id, None)
                        if stream is not None:
                            stream.queue.put_nowait(FinishEvent(stream.requests.index(r), "error"))
                    continue
            await asyncio.sleep(0)  # let handlers submit/abort between steps
