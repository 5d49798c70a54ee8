"""The OpenAI-compatible HTTP server (FastAPI on uvicorn), on rank 0.

Rank 0's process:
* the main thread loads the model like every rank, then runs the engine loop
  (``run_engine_loop``): it takes new requests and aborts from a thread-safe queue between
  steps, runs one step, and hands each request's output back to the HTTP thread;
* the HTTP thread runs uvicorn's event loop. A handler reads the body (bounded by
  ``max_body_bytes``), has a preprocessing worker process parse, validate, render and
  tokenize it (``preprocess_pool``: that work holds an interpreter lock, so it must not hold
  this one), submits the token ids to the queue, and awaits its request's ``asyncio.Queue``,
  which the engine fills through ``loop.call_soon_threadsafe``;
* the engine watchdog thread (``watchdog``) ends the server when a step stops returning.
The engine never blocks on HTTP and the handlers never touch the model. A client that hangs
up is noticed at once (``client_watch``) and its request aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import threading
import time
from typing import AsyncIterator

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from glm_fused.engine import InvalidParam, LLMEngine, RequestOutput, SamplingParams
from glm_fused.errors import UserError
from glm_fused.server import protocol as P
from glm_fused.server.client_watch import ClientWatch, client_gone
from glm_fused.server.errors import ApiError, install_error_handlers
from glm_fused.server.metrics import ServerMetrics
from glm_fused.server.preprocess_pool import PreprocessPool

logger = logging.getLogger("glm_fused.server")

IDLE_POLL_S = 0.1          # engine loop wake-up while idle (stop flag, heartbeat)


class ClientGone(Exception):
    """Put in a request's results queue when its client hangs up."""


class EngineFailed(Exception):
    """The engine loop died; every waiting request gets this instead of an output."""


class EngineBridge:
    """The two-thread handshake between the HTTP handlers and the engine loop."""

    def __init__(self):
        self.inbox: queue.Queue = queue.Queue()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.streams: dict[str, asyncio.Queue] = {}   # touched on the event loop only
        self.engine: LLMEngine | None = None           # set once every rank has loaded
        self.stop_requested = False                    # set by the signal handler
        self.failed: str | None = None

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.stop_requested and self.failed is None

    # ---- HTTP side (event loop) ------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        self.loop = asyncio.get_running_loop()
        results: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = results
        self.inbox.put(("add", request_id, prompt_ids, params, time.monotonic()))
        return results

    def abort(self, request_id: str) -> None:
        if self.streams.pop(request_id, None) is not None:
            self.inbox.put(("abort", request_id))

    # ---- engine side -----------------------------------------------------------------------
    def take(self, timeout: float) -> list[tuple]:
        cmds = []
        try:
            cmds.append(self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait())
            while True:
                cmds.append(self.inbox.get_nowait())
        except queue.Empty:
            return cmds

    def deliver(self, items: list[tuple[str, object]]) -> None:
        if items and self.loop is not None:
            self.loop.call_soon_threadsafe(self._dispatch, items)

    def _dispatch(self, items: list[tuple[str, object]]) -> None:
        for request_id, item in items:
            results = self.streams.get(request_id)
            if results is None:
                continue  # the client left; its abort is on the way
            results.put_nowait(item)
            if isinstance(item, Exception) or item.finished:
                self.streams.pop(request_id, None)

    def fail_all(self, message: str) -> None:
        self.failed = message
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._fail_streams, message)

    def _fail_streams(self, message: str) -> None:
        for results in self.streams.values():
            results.put_nowait(EngineFailed(message))
        self.streams.clear()


def run_engine_loop(engine: LLMEngine, bridge: EngineBridge, metrics: ServerMetrics, watchdog=None) -> None:
    """Rank 0's main loop: admit, step, deliver; until a stop is requested. ``watchdog``
    (an ``EngineWatchdog``) times every call that needs the other ranks."""
    track = watchdog.track if watchdog is not None else (lambda what: contextlib.nullcontext())
    try:
        while True:
            for cmd in bridge.take(0 if engine.has_unfinished() else IDLE_POLL_S):
                if cmd[0] == "add":
                    _, rid, prompt_ids, params, arrival = cmd
                    try:
                        engine.add_request(rid, prompt_ids, params, arrival_time=arrival)
                        metrics.on_admitted(len(prompt_ids))
                    except (InvalidParam, ValueError) as exc:
                        bridge.deliver([(rid, ApiError(400, str(exc), getattr(exc, "param", None),
                                                       getattr(exc, "code", None)))])
                else:
                    out = engine.abort(cmd[1])
                    if out is not None:
                        _observe(metrics, [out])
            if bridge.stop_requested:
                outs = engine.abort_all("abort")
                _observe(metrics, outs)
                bridge.deliver([(o.request_id, o) for o in outs])
                with track("stop message"):
                    engine.stop_workers()
                return
            if engine.has_unfinished():
                with track("step"):
                    outs = engine.step()
                _observe(metrics, outs)
                bridge.deliver([(o.request_id, o) for o in outs])
            else:
                with track("idle heartbeat"):
                    engine.heartbeat()
            metrics.on_engine(engine)
    except BaseException as exc:
        bridge.fail_all(f"the engine stopped: {type(exc).__name__}: {exc}")
        raise


def _observe(metrics: ServerMetrics, outs: list[RequestOutput]) -> None:
    for out in outs:
        seq = out.seq
        if out.new_token_ids:
            metrics.on_tokens(len(out.new_token_ids))
            if out.completion_tokens == 1 and seq.first_token_time is not None:
                metrics.on_first_token(seq.first_token_time - seq.arrival_time)
        if out.finished:
            n = len(seq.output_token_ids)
            tpot = None
            if n > 1 and seq.first_token_time is not None and seq.last_token_time is not None:
                tpot = (seq.last_token_time - seq.first_token_time) / (n - 1)
            metrics.on_finished(out.finish_reason or "abort", time.monotonic() - seq.arrival_time, tpot)


# ---- the FastAPI app ---------------------------------------------------------------------
def create_app(bridge: EngineBridge, metrics: ServerMetrics, *, model_name: str, pool: PreprocessPool,
               max_model_len: int | None, max_body_bytes: int, api_key: str | None = None,
               info: dict | None = None) -> FastAPI:
    """``pool`` prepares requests (``preprocess_pool``); bodies over ``max_body_bytes`` get 413.
    ``info``: what the server runs (backend, TP, layout, fusion...), shown in /v1/models;
    the caller may fill it in after the model has loaded. Serve it with ``HttpServer``, whose
    ``ClientWatch`` tells the handlers when a client hangs up. ``max_model_len``: the context
    limit if known before loading (None: the engine's, once loaded)."""
    info = {} if info is None else info
    app = FastAPI(title="glm_fused", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app, metrics.on_error)

    async def require_api_key(request: Request) -> None:
        if api_key and request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", code="invalid_api_key")

    v1 = [Depends(require_api_key)]

    def engine_or_503() -> LLMEngine:
        if bridge.failed:
            raise ApiError(503, bridge.failed)
        if bridge.stop_requested:
            raise ApiError(503, "the server is shutting down")
        if bridge.engine is None:
            raise ApiError(503, "the model is still loading; retry when GET /health answers 200")
        return bridge.engine

    # ---- plain endpoints -------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if bridge.ready:
            return {"status": "ok"}
        status = bridge.failed or ("stopping" if bridge.stop_requested else "loading")
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/v1/models", dependencies=v1)
    async def models():
        engine = bridge.engine
        card = P.model_card(model_name, engine.max_model_len if engine is not None else max_model_len)
        if info:
            card["glm_fused"] = info
            if engine is not None:
                card["glm_fused"] = {**info, "kv_cache": {**info.get("kv_cache", {}), **engine.kv_cache_stats()}}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    # ---- generation --------------------------------------------------------------------------
    @app.post("/v1/completions", dependencies=v1)
    async def completions(raw: Request):
        return await generate(raw, "completion")

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(raw: Request):
        return await generate(raw, "chat")

    async def generate(raw: Request, kind: str):
        engine_or_503()
        gone = client_gone(raw.scope)
        body = await read_body(raw)
        prep = await unless_gone(pool.prepare(kind, body), gone)
        del body
        engine_or_503()  # it may have stopped meanwhile
        rid = P.new_id("cmpl" if kind == "completion" else "chatcmpl")
        results = bridge.submit(rid, prep.prompt_ids, prep.params)
        watcher = report_hang_up(gone, results)
        n_prompt = len(prep.prompt_ids)
        if prep.stream:
            if kind == "completion":
                events = completion_stream(rid, results, n_prompt, prep.include_usage, prep.return_token_ids)
            else:
                events = chat_stream(rid, results, n_prompt, prep.include_usage)
            return sse(events, rid, watcher)
        try:
            text, token_ids, reason = await collect(rid, results)
        finally:
            watcher.cancel()
        if kind == "completion":
            return P.completion_response(rid, model_name, text, reason, n_prompt, len(token_ids),
                                         token_ids if prep.return_token_ids else None)
        return P.chat_response(rid, model_name, text, reason, n_prompt, len(token_ids))

    async def read_body(raw: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to exceed the limit (from
        Content-Length before reading, else while reading). uvicorn reads and drops what the
        client still sends, so it gets the 413 rather than a reset connection.

        By hand rather than FastAPI's ``max_body_size``: that needs fastapi >= 0.164 (starlette
        >= 1.6), and it turns any answer that starts before the body is read (a 401, a 404)
        into a plain-text 413, outside OpenAI's error shape."""
        declared = raw.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise body_too_large(f"{int(declared)} bytes")
        chunks, size = [], 0
        try:
            async for chunk in raw.stream():
                size += len(chunk)
                if size > max_body_bytes:
                    raise body_too_large(f"over {max_body_bytes} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError(499, "client closed the request") from None
        return b"".join(chunks)

    def body_too_large(size: str) -> ApiError:
        return ApiError(413, f"the request body ({size}) exceeds this server's limit of {max_body_bytes} bytes "
                             f"(--max-request-body-bytes)", code="request_too_large")

    # ---- waiting for results -----------------------------------------------------------------
    async def next_output(results: asyncio.Queue) -> RequestOutput:
        item = await results.get()
        if isinstance(item, ClientGone):
            raise ApiError(499, "client closed the request")
        if isinstance(item, EngineFailed):
            raise ApiError(500, str(item))
        if isinstance(item, Exception):
            raise item
        return item

    async def collect(rid: str, results: asyncio.Queue) -> tuple[str, list[int], str]:
        """A non-streamed request's whole output (aborted when its client hangs up)."""
        pieces, token_ids = [], []
        try:
            while True:
                out = await next_output(results)
                pieces.append(out.text_delta)
                token_ids.extend(out.new_token_ids)
                if out.finished:
                    return "".join(pieces), token_ids, out.finish_reason
        finally:
            bridge.abort(rid)  # no-op once finished

    def sse(body: AsyncIterator[dict], rid: str, watcher: asyncio.Future) -> StreamingResponse:
        async def events():
            try:
                async for item in body:
                    yield f"data: {json.dumps(item, ensure_ascii=False)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                watcher.cancel()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": rid})

    async def outputs(rid: str, results: asyncio.Queue) -> AsyncIterator[RequestOutput | dict]:
        """A request's outputs; an error event if the engine fails; abort if the client leaves."""
        try:
            while True:
                try:
                    out = await next_output(results)
                except ApiError as exc:
                    if exc.status != 499:
                        yield exc.body()
                    return
                yield out
                if out.finished:
                    return
        finally:
            bridge.abort(rid)

    async def completion_stream(rid, results, prompt_tokens, include_usage, show_ids):
        created, n = int(time.time()), 0
        async for out in outputs(rid, results):
            if isinstance(out, dict):
                yield out
                return
            n = out.completion_tokens
            if out.text_delta or out.finished or show_ids:
                yield P.completion_chunk(rid, model_name, created, out.text_delta,
                                         out.finish_reason if out.finished else None,
                                         out.new_token_ids if show_ids else None)
        if include_usage:
            yield P.usage_chunk(rid, model_name, created, "text_completion", prompt_tokens, n)

    async def chat_stream(rid, results, prompt_tokens, include_usage):
        created, n = int(time.time()), 0
        yield P.chat_chunk(rid, model_name, created, {"role": "assistant", "content": ""}, None)
        async for out in outputs(rid, results):
            if isinstance(out, dict):
                yield out
                return
            n = out.completion_tokens
            if out.text_delta or out.finished:
                delta = {"content": out.text_delta} if out.text_delta else {}
                yield P.chat_chunk(rid, model_name, created, delta, out.finish_reason if out.finished else None)
        if include_usage:
            yield P.usage_chunk(rid, model_name, created, "chat.completion.chunk", prompt_tokens, n)

    return app


async def unless_gone(awaitable, gone: asyncio.Event | None):
    """``await awaitable``, or a 499 (and the awaitable cancelled) once the client hangs up."""
    task = asyncio.ensure_future(awaitable)
    if gone is None:
        return await task
    waiter = asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise ApiError(499, "client closed the request")


def report_hang_up(gone: asyncio.Event | None, results: asyncio.Queue) -> asyncio.Future:
    """Put ``ClientGone`` in ``results`` when the client hangs up; cancel the returned
    future once the request is over."""
    if gone is None:
        future = asyncio.get_running_loop().create_future()
        return future
    waiter = asyncio.ensure_future(gone.wait())
    waiter.add_done_callback(lambda w: None if w.cancelled() else results.put_nowait(ClientGone()))
    return waiter


# ---- uvicorn in a thread -------------------------------------------------------------------
class HttpServer:
    """uvicorn on a background thread (signals stay with the main thread, which owns the model),
    serving the app behind ``ClientWatch``."""

    def __init__(self, app: FastAPI, host: str, port: int):
        self.host, self.port = host, port
        self.watch = ClientWatch(app)
        config = uvicorn.Config(self.watch, host=host, port=port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=2, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="http", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        self.thread.start()
        end = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > end:
                raise UserError(f"--host {self.host} --port {self.port}: cannot listen there "
                                f"(address in use, or not an address of this machine)")
            time.sleep(0.02)

    def drain(self, min_s: float = 0.0, max_s: float = 2.0) -> None:
        """Keep answering (``/health``: 503) until no POST is in flight: at least ``min_s``,
        at most ``max_s``. The engine has ended every request by then; this lets the last
        answers and stream endings out before the connections close."""
        start = time.monotonic()
        while time.monotonic() - start < max_s:
            if self.watch.open_posts == 0 and time.monotonic() - start >= min_s:
                return
            time.sleep(0.02)

    def stop(self, timeout: float = 3.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
