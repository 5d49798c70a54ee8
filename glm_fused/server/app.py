"""The OpenAI-compatible HTTP server (FastAPI on uvicorn), on rank 0.

Threads on rank 0:
* the main thread loads the model like every rank, then runs the engine loop
  (``run_engine_loop``): it takes new requests and aborts from a thread-safe queue between
  steps, runs one step, and hands each request's output back to the HTTP thread;
* the HTTP thread runs uvicorn's event loop. Handlers validate and tokenize, submit to the
  queue, and await their request's ``asyncio.Queue``, which the engine fills through
  ``loop.call_soon_threadsafe``.
The engine never blocks on HTTP and the handlers never touch the model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from glm_fused.engine import InvalidParam, LLMEngine, RequestOutput, SamplingParams
from glm_fused.errors import UserError
from glm_fused.server import protocol as P
from glm_fused.server.metrics import ServerMetrics

logger = logging.getLogger("glm_fused.server")

IDLE_POLL_S = 0.1          # engine loop wake-up while idle (stop flag, heartbeat)
DISCONNECT_POLL_S = 0.5    # how often a waiting non-streamed request checks its client
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


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


def run_engine_loop(engine: LLMEngine, bridge: EngineBridge, metrics: ServerMetrics) -> None:
    """Rank 0's main loop: admit, step, deliver; until a stop is requested."""
    try:
        while True:
            for cmd in bridge.take(0 if engine.has_unfinished() else IDLE_POLL_S):
                if cmd[0] == "add":
                    _, rid, prompt_ids, params, arrival = cmd
                    try:
                        engine.add_request(rid, prompt_ids, params, arrival_time=arrival)
                        metrics.on_admitted(len(prompt_ids))
                    except (InvalidParam, ValueError) as exc:
                        bridge.deliver([(rid, P.ApiError(400, str(exc), getattr(exc, "param", None),
                                                         getattr(exc, "code", None)))])
                else:
                    out = engine.abort(cmd[1])
                    if out is not None:
                        _observe(metrics, [out])
            if bridge.stop_requested:
                outs = engine.abort_all("abort")
                _observe(metrics, outs)
                bridge.deliver([(o.request_id, o) for o in outs])
                engine.stop_workers()
                return
            if engine.has_unfinished():
                outs = engine.step()
                _observe(metrics, outs)
                bridge.deliver([(o.request_id, o) for o in outs])
            else:
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
def create_app(bridge: EngineBridge, metrics: ServerMetrics, *, model_name: str, tokenizer,
               max_model_len: int | None, api_key: str | None = None, info: dict | None = None) -> FastAPI:
    """``info``: what the server runs (backend, TP, layout, fusion...), shown in /v1/models;
    the caller may fill it in after the model has loaded. ``max_model_len``: the context limit
    if known before loading (None: the engine's, once loaded)."""
    info = {} if info is None else info
    app = FastAPI(title="glm_fused", docs_url=None, redoc_url=None, openapi_url=None)

    def error_response(err: P.ApiError) -> JSONResponse:
        metrics.on_error(err.status)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(P.ApiError)
    async def _api_error(_request: Request, err: P.ApiError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        # pydantic adds the union member it tried ("str", "list[int]", "function-after[...]")
        # to the location; keep the field path only.
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and str(p) not in _TYPE_NAMES
               and "[" not in str(p)]
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request")
        return error_response(P.ApiError(400, f"{param or 'request'}: {message}", param=param))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error_response(P.ApiError(401, "missing or wrong API key (Authorization: Bearer ...)",
                                                 code="invalid_api_key"))
        return await call_next(request)

    def engine_or_503() -> LLMEngine:
        if bridge.failed:
            raise P.ApiError(503, bridge.failed)
        if bridge.stop_requested:
            raise P.ApiError(503, "the server is shutting down")
        if bridge.engine is None:
            raise P.ApiError(503, "the model is still loading; retry when GET /health answers 200")
        return bridge.engine

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise P.ApiError(404, f"The model `{name}` does not exist; this server serves `{model_name}`",
                             param="model", code="model_not_found")

    def check_fits(engine: LLMEngine, ids: list[int], params: SamplingParams, param: str,
                   max_tokens_given: bool) -> None:
        try:
            engine.check_prompt(ids, params, param=param, max_tokens_given=max_tokens_given)
        except InvalidParam as exc:
            raise P.ApiError(400, str(exc), param=exc.param, code=exc.code) from None

    # ---- plain endpoints -------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if bridge.ready:
            return {"status": "ok"}
        status = bridge.failed or ("stopping" if bridge.stop_requested else "loading")
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/v1/models")
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
    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest, raw: Request):
        engine = engine_or_503()
        check_model(req.model)
        req.check()
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            if tokenizer is None:
                raise P.ApiError(400, "this server has no tokenizer (dummy weights from a bare config): "
                                      "send prompt as a list of token ids", param="prompt")
            ids = tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = [int(t) for t in prompt]
        params = req.sampling_params(COMPLETION_DEFAULT_MAX_TOKENS)
        check_fits(engine, ids, params, "prompt", req.max_tokens is not None)
        if req.max_tokens is None:
            params.max_tokens = min(params.max_tokens, engine.max_model_len - len(ids))
        check_text_features(params)
        rid = P.new_id("cmpl")
        show_ids = req.return_token_ids or tokenizer is None
        results = bridge.submit(rid, ids, params)
        if req.stream:
            return sse(completion_stream(rid, results, len(ids), req.include_usage, show_ids), rid)
        text, token_ids, reason = await collect(rid, results, raw)
        return P.completion_response(rid, model_name, text, reason, len(ids), len(token_ids),
                                     token_ids if show_ids else None)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: P.ChatCompletionRequest, raw: Request):
        engine = engine_or_503()
        check_model(req.model)
        req.check()
        if tokenizer is None or not tokenizer.has_chat_template:
            raise P.ApiError(400, "this server has no tokenizer with a chat template; use /v1/completions",
                             param="messages")
        extra = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k != "enable_thinking"}
        try:
            text = tokenizer.apply_chat_template(req.message_dicts(), add_generation_prompt=True,
                                                 enable_thinking=req.enable_thinking, **extra)
        except UserError as exc:
            raise P.ApiError(400, str(exc), param="messages") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        params = req.sampling_params(max(1, engine.max_model_len - len(ids)))
        check_fits(engine, ids, params, "messages", req.max_tokens is not None)
        rid = P.new_id("chatcmpl")
        results = bridge.submit(rid, ids, params)
        if req.stream:
            return sse(chat_stream(rid, results, len(ids), req.include_usage), rid)
        text, token_ids, reason = await collect(rid, results, raw)
        return P.chat_response(rid, model_name, text, reason, len(ids), len(token_ids))

    def check_text_features(params: SamplingParams) -> None:
        if tokenizer is None and params.stop:
            raise P.ApiError(400, "stop strings need a tokenizer; this server has none (use stop_token_ids)",
                             param="stop")

    # ---- waiting for results -----------------------------------------------------------------
    async def next_output(results: asyncio.Queue) -> RequestOutput:
        item = await results.get()
        if isinstance(item, Exception):
            raise item
        return item

    async def collect(rid: str, results: asyncio.Queue, raw: Request) -> tuple[str, list[int], str]:
        """A non-streamed request's whole output; aborts it if the client goes away."""
        pieces, token_ids = [], []
        try:
            while True:
                try:
                    out = await asyncio.wait_for(next_output(results), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await raw.is_disconnected():
                        bridge.abort(rid)
                        raise P.ApiError(499, "client closed the request") from None
                    continue
                except EngineFailed as exc:
                    raise P.ApiError(500, str(exc)) from None
                pieces.append(out.text_delta)
                token_ids.extend(out.new_token_ids)
                if out.finished:
                    return "".join(pieces), token_ids, out.finish_reason
        finally:
            bridge.abort(rid)  # no-op once finished

    def sse(body: AsyncIterator[dict], rid: str) -> StreamingResponse:
        async def events():
            async for item in body:
                yield f"data: {json.dumps(item, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": rid})

    async def outputs(rid: str, results: asyncio.Queue) -> AsyncIterator[RequestOutput | dict]:
        """A request's outputs; an error event if the engine fails; abort if the client leaves
        (the stream is cancelled at its await, and the finally runs)."""
        try:
            while True:
                try:
                    out = await next_output(results)
                except EngineFailed as exc:
                    yield P.error_body(str(exc), "server_error")
                    return
                except P.ApiError as exc:
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


# ---- uvicorn in a thread -------------------------------------------------------------------
class HttpServer:
    """uvicorn on a background thread (signals stay with the main thread, which owns the model)."""

    def __init__(self, app: FastAPI, host: str, port: int):
        self.host, self.port = host, port
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
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

    def stop(self, timeout: float = 3.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
