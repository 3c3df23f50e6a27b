"""``specgraph serve``: an OpenAI-compatible HTTP server on an :class:`AsyncEngine`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text, every name prefixed
``specgraph_``). Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:
400 for a bad request (a request the KV pool can never hold included), 404 for an unknown model,
429 when ``max_pending`` requests are already queued, 500 if a step failed.

    app = build_app(engine, model_name="smollm2-135m-instruct", max_pending=256)
    uvicorn.run(app, host="127.0.0.1", port=8000)
"""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .async_engine import AsyncEngine, FinishEvent, QueueFullError, RequestStream, TokenEvent
from .engine import Engine
from .openai_protocol import ChatCompletionRequest, CompletionRequest, error_body, new_id, now, usage
from .text_stream import TextStream

DEFAULT_CHAT_MAX_TOKENS = 512
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


# ------------------------------------------------------------------------------ metrics
class _EngineCollector:
    """Figures read from the engine at scrape time."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        s, sched = self.engine.stats, self.engine.scheduler
        for name, doc, value in (
                ("specgraph_kv_pool_usage", "Fraction of KV blocks held by live requests", s["kv_pool_usage"]),
                ("specgraph_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens",
                 s["prefix_cache_hit_rate"]),
                ("specgraph_spec_acceptance_rate", "Accepted draft tokens / drafted tokens",
                 s.get("acceptance_rate", 0.0)),
                ("specgraph_requests_running", "Requests in the running batch", len(sched.running)),
                ("specgraph_requests_waiting", "Requests waiting for admission", len(sched.waiting))):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
                ("specgraph_preemptions", "Running requests preempted for lack of KV blocks", s["preemptions"]),
                ("specgraph_kv_evictions", "Cached KV blocks evicted", s["evictions"]),
                ("specgraph_target_forwards", "Target model forwards (engine steps)", s["target_forwards"])):
            yield CounterMetricFamily(name, doc, value=value)


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self):
        r = self.registry
        self.requests = Counter("specgraph_requests", "HTTP generation requests", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("specgraph_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("specgraph_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("specgraph_time_to_first_token_seconds", "Submission to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specgraph_inter_token_latency_seconds", "Time between tokens of one sample",
                             buckets=_LATENCY_BUCKETS, registry=r)


# ----------------------------------------------------------------------------- helpers
@dataclass
class _Sample:
    """What has been produced and shown of one sample."""

    text: TextStream
    logprobs: list[tuple[float, list]] = field(default_factory=list)
    finish_reason: str | None = None
    last_token_at: float | None = None


class _Generation:
    """One HTTP request: its streams (one per prompt) and the incremental text of every sample."""

    def __init__(self, server: "Server", streams: list[RequestStream], n: int, stops: list[str], prompt_tokens: int):
        self.server, self.streams, self.n, self.stops = server, streams, n, stops
        self.samples = [_Sample(TextStream(server.tokenizer, stops)) for _ in range(len(streams) * n)]
        self.prompt_tokens = prompt_tokens
        self.created = now()

    async def events(self, http: Request, poll_disconnect: bool) -> AsyncIterator[tuple[int, str, str | None]]:
        """Yields ``(choice index, new text, finish_reason or None)``.

        The requests are aborted (blocks freed) when the consumer stops early: a streaming
        response is cancelled by the ASGI server when its client goes away; a plain response
        polls ``is_disconnected`` (``poll_disconnect``) every half second.
        """
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream):
            async for event in stream:
                await merged.put((i, event))

        async def next_event():
            if not poll_disconnect:
                return await merged.get()
            while True:
                try:
                    return await asyncio.wait_for(merged.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        return None

        pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        open_samples = len(self.samples)
        try:
            while open_samples:
                got = await next_event()
                if got is None:  # the client went away
                    return
                i, event = got
                choice = i * self.n + event.index
                out = self._apply(choice, event)
                if out is not None:
                    if out[2] is not None:
                        open_samples -= 1
                    yield out
        finally:
            for p in pumps:
                p.cancel()
            if any(not s.finished for s in self.streams):
                # not awaited here: this may run while the response task is being cancelled
                self.server.abort_later(self.streams)
                self.server.metrics.requests.labels(self.server.endpoint_of(http), "aborted").inc()

    def _apply(self, choice: int, event) -> tuple[int, str, str | None] | None:
        sample = self.samples[choice]
        if sample.finish_reason is not None:
            return None
        metrics = self.server.metrics
        if isinstance(event, TokenEvent):
            t = time.perf_counter()
            if sample.last_token_at is None:
                request = self.streams[choice // self.n].requests[event.index]
                metrics.ttft.observe(t - request.arrival_time)
            else:
                metrics.itl.observe(t - sample.last_token_at)
            sample.last_token_at = t
            sample.logprobs.append((event.logprob, event.top_logprobs))
            metrics.generation_tokens.inc()
            new = sample.text.add(event.token_id)
        else:
            new = sample.text.finish()
        if sample.text.stopped or isinstance(event, FinishEvent):
            sample.finish_reason = "stop" if sample.text.stopped else event.finish_reason
        return choice, new, sample.finish_reason

    def completion_tokens(self) -> int:
        return sum(len(s.text.tokens) for s in self.samples)


class Server:
    """Holds the engine, the tokenizer and the metrics behind one FastAPI app."""

    def __init__(self, engine: Engine, model_name: str, max_pending: int = 256):
        if engine.tokenizer is None:
            raise ValueError("serving needs an Engine with a tokenizer (text in and out)")
        self.engine = AsyncEngine(engine, max_pending=max_pending)
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.metrics = Metrics()
        self.metrics.registry.register(_EngineCollector(engine))
        self._background: set[asyncio.Task] = set()

    def abort_later(self, streams: list[RequestStream]) -> None:
        for s in streams:
            task = asyncio.get_running_loop().create_task(self.engine.abort(s))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    @staticmethod
    def endpoint_of(http: Request) -> str:
        return "chat" if http.url.path.endswith("chat/completions") else "completions"

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise HTTPError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                            "invalid_request_error", "model")

    def encode(self, prompt) -> list[int]:
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) else prompt
        if not ids:
            raise HTTPError(400, "prompt is empty", param="prompt")
        return list(ids)

    async def submit(self, prompts: list[list[int]], body, max_new_tokens: int, logprobs: int | None
                     ) -> list[RequestStream]:
        spec = body.speculation
        draft_cap = None if spec is None else (0 if not spec.enabled else spec.num_draft_tokens)
        streams = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(await self.engine.submit(
                    ids, n=body.n, logprobs=logprobs, max_new_tokens=max_new_tokens, temperature=body.temperature,
                    top_p=body.top_p, top_k=body.top_k, seed=(body.seed or 0) * 1_000_003 + i * body.n,
                    stop=body.stop, num_draft_tokens=draft_cap))
        except QueueFullError as e:
            for s in streams:
                await self.engine.abort(s)
            raise HTTPError(429, str(e), "rate_limit_error") from e
        except ValueError as e:
            for s in streams:
                await self.engine.abort(s)
            raise HTTPError(400, str(e)) from e
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        return streams

    def chat_prompt(self, body: ChatCompletionRequest) -> str:
        try:
            messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                        for m in body.messages]
        except ValueError as e:
            raise HTTPError(400, str(e), param="messages") from e
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    # ------------------------------------------------------------------ responses
    def _completion_logprobs(self, tokens: list[int], logprobs: list) -> dict:
        tok = self.tokenizer
        pieces = [tok.decode([t]) for t in tokens]
        offsets, pos = [], 0
        for p in pieces:
            offsets.append(pos)
            pos += len(p)
        return {"tokens": pieces, "token_logprobs": [lp for lp, _ in logprobs],
                "top_logprobs": [{tok.decode([t]): v for t, v in top} for _, top in logprobs],
                "text_offset": offsets}

    def _chat_logprobs(self, tokens: list[int], logprobs: list) -> dict:
        tok = self.tokenizer

        def entry(t, v):
            s = tok.decode([t])
            return {"token": s, "logprob": v, "bytes": list(s.encode())}

        return {"content": [dict(entry(t, lp), top_logprobs=[entry(a, b) for a, b in top])
                            for t, (lp, top) in zip(tokens, logprobs)]}

    async def completions(self, body: CompletionRequest, http: Request):
        self.check_model(body.model)
        prompts = [self.encode(p) for p in body.prompts()]
        streams = await self.submit(prompts, body, body.max_tokens, body.logprobs)
        gen = _Generation(self, streams, body.n, body.stop, sum(len(p) for p in prompts))
        want_lp = body.logprobs is not None

        def stream_choice(i: int, text: str, finish: str | None) -> dict:
            s = gen.samples[i]
            lp = self._completion_logprobs(s.text.tokens[-1:], s.logprobs[-1:]) \
                if want_lp and finish is None and text else None
            return {"text": text, "index": i, "logprobs": lp, "finish_reason": finish}

        def final_choice(i: int, text: str, s: _Sample) -> dict:
            return {"text": text, "index": i, "finish_reason": s.finish_reason,
                    "logprobs": self._completion_logprobs(s.text.tokens, s.logprobs) if want_lp else None}

        return await self._respond(gen, body, http, "completions", ("cmpl", "text_completion", "text_completion"),
                                   [], stream_choice, final_choice)

    async def chat(self, body: ChatCompletionRequest, http: Request):
        self.check_model(body.model)
        prompt = self.encode(self.chat_prompt(body))
        top = (body.top_logprobs or 0) if body.logprobs else None
        streams = await self.submit([prompt], body, body.max_new_tokens(DEFAULT_CHAT_MAX_TOKENS), top)
        gen = _Generation(self, streams, body.n, body.stop, len(prompt))

        def stream_choice(i: int, text: str, finish: str | None) -> dict:
            s = gen.samples[i]
            lp = self._chat_logprobs(s.text.tokens[-1:], s.logprobs[-1:]) if top is not None and finish is None \
                and text else None
            delta = {"content": text} if text or finish is None else {}
            return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}

        def final_choice(i: int, text: str, s: _Sample) -> dict:
            return {"index": i, "message": {"role": "assistant", "content": text},
                    "logprobs": self._chat_logprobs(s.text.tokens, s.logprobs) if top is not None else None,
                    "finish_reason": s.finish_reason}

        prelude = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for i in range(len(gen.samples))]
        return await self._respond(gen, body, http, "chat", ("chatcmpl", "chat.completion", "chat.completion.chunk"),
                                   prelude, stream_choice, final_choice)

    async def _respond(self, gen: _Generation, body, http: Request, endpoint: str, kinds: tuple[str, str, str],
                       prelude: list[dict], stream_choice, final_choice):
        """A streaming (SSE) or a whole response; ``kinds`` = (id prefix, object, streamed chunk object)."""
        rid = new_id(kinds[0])

        def envelope(choices: list[dict], obj: str, usage_: dict | None = None) -> dict:
            out = {"id": rid, "object": obj, "created": gen.created, "model": self.model_name, "choices": choices}
            if usage_ is not None:
                out["usage"] = usage_
            return out

        if body.stream:
            async def sse():
                for c in prelude:
                    yield _sse(envelope([c], kinds[2]))
                async for choice, text, finish in gen.events(http, poll_disconnect=False):
                    yield _sse(envelope([stream_choice(choice, text, finish)], kinds[2]))
                if body.stream_options and body.stream_options.include_usage:
                    yield _sse(envelope([], kinds[2], usage(gen.prompt_tokens, gen.completion_tokens())))
                yield "data: [DONE]\n\n"
                self.metrics.requests.labels(endpoint, "ok").inc()
            return StreamingResponse(sse(), media_type="text/event-stream")

        texts = [""] * len(gen.samples)
        async for choice, text, _ in gen.events(http, poll_disconnect=True):
            texts[choice] += text
        self.metrics.requests.labels(endpoint, "ok").inc()
        return envelope([final_choice(i, texts[i], s) for i, s in enumerate(gen.samples)], kinds[1],
                        usage(gen.prompt_tokens, gen.completion_tokens()))


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def build_app(engine: Engine, model_name: str, max_pending: int = 256, shutdown_timeout: float = 10.0) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``model_name``; its lifespan runs the step loop."""
    server = Server(engine, model_name, max_pending)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.engine.start()
        yield
        await server.engine.shutdown(timeout=shutdown_timeout)

    app = FastAPI(title="specgraph", lifespan=lifespan)
    app.state.server = server

    def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        return JSONResponse(error_body(message, kind, param), status_code=status)

    @app.exception_handler(HTTPError)
    async def _http_error(http: Request, e: HTTPError):
        server.metrics.requests.labels(server.endpoint_of(http), "rejected" if e.status == 429 else "error").inc()
        return error(e.status, e.message, e.kind, e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(http: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        server.metrics.requests.labels(server.endpoint_of(http), "error").inc()
        return error(400, f"{where}: {first.get('msg', 'invalid request')}" if where else str(e), param=where or None)

    @app.get("/health")
    async def health():
        if server.engine.step_error is not None:
            return error(500, f"engine step failed: {server.engine.step_error!r}", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": now(),
                                            "owned_by": "specgraph"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(server.metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        return await server.completions(body, http)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: Request):
        return await server.chat(body, http)

    return app
