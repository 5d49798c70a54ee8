"""The OpenAI-compatible HTTP server (FastAPI on uvicorn), on rank 0.

Rank 0's process:
* the main thread loads the model like every rank, then runs the engine loop
  (``run_engine_loop``): it takes new requests and aborts from a thread-safe queue between
  steps, runs one step, and hands each request's output back to the HTTP thread;
* the HTTP thread runs uvicorn's event loop. A handler reads the body (bounded by
  ``max_body_bytes``), has a preprocessing worker process parse, validate, render and
  tokenize it (``preprocess_pool``: that work holds an interpreter lock, so it must not hold
  this one), submits the token ids to the queue, and awaits its request's ``asyncio.Queue``,
  which the engine fills through ``loop.call_soon_threadsafe``. A stream's response starts
  once the engine has run the step after taking the request: the two threads share one
  interpreter lock, and the response's start, run at once, held it while the engine admitted
  and launched the request (0.65 ms of a cached request's path to its first token on two CPU
  cores); after the launch the engine waits on the device, lock released;
* the engine watchdog thread (``watchdog``) ends the server when a step stops returning.
The engine never blocks on HTTP and the handlers never touch the model. A client that hangs
up is noticed at once (``client_watch``) and its request aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import json
import logging
import queue
import sys
import threading
import time
from typing import AsyncIterator, Callable

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from glm_fused.engine import InvalidParam, LLMEngine, RequestOutput, SamplingParams
from glm_fused.engine.sampling import derive_seed
from glm_fused.errors import UserError
from glm_fused.server import protocol as P
from glm_fused.server.access_log import ACCESS_NOTE, AccessLog
from glm_fused.server.client_watch import ClientWatch, client_gone
from glm_fused.server.errors import ApiError, install_error_handlers
from glm_fused.server.metrics import ServerMetrics
from glm_fused.server.outputs import Choice, TokenTexts, chat_logprobs
from glm_fused.server.preprocess_pool import PreprocessPool

logger = logging.getLogger("glm_fused.server")

# How long the idle engine loop waits on its inbox before it looks again (stop flag,
# heartbeat). Short on purpose: on one H200 a request arriving after a pause reached its first
# token 0.1-0.4 ms sooner with a 1 or 5 ms wait than with 0.1 s, near the runs' spread; on
# one H100 the wait made no difference (docs/speed.md, "Prefix-cache TTFT: the idle wait").
# It costs 2-3% of one core while idle (0.4% at 0.1 s).
IDLE_POLL_S = 0.005


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
        self.launches: dict[str, asyncio.Future] = {}  # likewise: resolved once the engine has run its step
        self.engine: LLMEngine | None = None           # set once every rank has loaded
        self.stop_requested = False                    # set by the signal handler
        self.failed: str | None = None

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.stop_requested and self.failed is None

    # ---- HTTP side (event loop) ------------------------------------------------------------
    def submit(self, subs: list[tuple[str, list[int], SamplingParams, object]]) -> tuple[asyncio.Queue,
                                                                                         asyncio.Future]:
        """Queue one engine request per ``(request id, prompt ids, params, grammar state)``;
        their outputs arrive, in order per request, in the one queue returned, beside a future
        that resolves once the engine has taken the last of them and run the step after (or
        failed, or stopped): it never stays pending."""
        self.loop = asyncio.get_running_loop()
        results: asyncio.Queue = asyncio.Queue()
        launched = self.loop.create_future()
        now = time.monotonic()
        for request_id, prompt_ids, params, grammar in subs:
            self.streams[request_id] = results
            self.inbox.put(("add", request_id, prompt_ids, params, now, grammar))
        self.launches[subs[-1][0]] = launched
        return results, launched

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

    def launched(self, request_ids: list[str] | None) -> None:
        """The engine ran a step after taking these requests (None: every request, it stops)."""
        if (request_ids is None or request_ids) and self.loop is not None:
            self.loop.call_soon_threadsafe(self._launched, request_ids)

    def _launched(self, request_ids: list[str] | None) -> None:
        for request_id in list(self.launches) if request_ids is None else request_ids:
            future = self.launches.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result(None)

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
        self._launched(None)


def run_engine_loop(engine: LLMEngine, bridge: EngineBridge, metrics: ServerMetrics, watchdog=None) -> None:
    """Rank 0's main loop: admit, step, deliver; until a stop is requested. ``watchdog``
    (an ``EngineWatchdog``) times every call that needs the other ranks."""
    track = watchdog.track if watchdog is not None else (lambda what: contextlib.nullcontext())
    try:
        while True:
            taken = []
            cmds = bridge.take(0 if engine.has_unfinished() else IDLE_POLL_S)
            for cmd in cmds:
                if cmd[0] == "add":
                    _, rid, prompt_ids, params, arrival, grammar = cmd
                    taken.append(rid)
                    try:
                        engine.add_request(rid, prompt_ids, params, arrival_time=arrival, grammar=grammar)
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
                bridge.launched(None)
                with track("stop message"):
                    engine.stop_workers()
                return
            if engine.has_unfinished():
                with track("step"):
                    outs = engine.step()
                bridge.deliver([(o.request_id, o) for o in outs])  # first: the event loop wakes meanwhile
                _observe(metrics, outs)
            else:
                with track("idle heartbeat"):
                    engine.heartbeat()
                if not cmds:
                    continue  # nothing changed: the gauges already hold this state
            bridge.launched(taken)
            metrics.on_engine(engine)
    except BaseException as exc:
        bridge.fail_all(f"the engine stopped: {type(exc).__name__}: {exc}")
        raise


def _response(answer: Response | dict) -> Response:
    return answer if isinstance(answer, Response) else JSONResponse(answer)


def _observe(metrics: ServerMetrics, outs: list[RequestOutput]) -> None:
    for out in outs:
        seq = out.seq
        if out.new_token_ids:
            metrics.on_tokens(len(out.new_token_ids))
            if out.completion_tokens == 1 and seq.first_token_time is not None:
                queued = None if seq.scheduled_time is None else seq.scheduled_time - seq.arrival_time
                metrics.on_first_token(seq.first_token_time - seq.arrival_time, queued)
        if out.finished:
            n = len(seq.output_token_ids)
            tpot = None
            if n > 1 and seq.first_token_time is not None and seq.last_token_time is not None:
                tpot = (seq.last_token_time - seq.first_token_time) / (n - 1)
            metrics.on_finished(out.finish_reason or "abort", time.monotonic() - seq.arrival_time, tpot)


# ---- the FastAPI app ---------------------------------------------------------------------
def create_app(bridge: EngineBridge, metrics: ServerMetrics, *, model_name: str, pool: PreprocessPool,
               max_model_len: int | None, max_body_bytes: int, api_key: str | None = None,
               info: dict | None = None, tokenizer=None, grammars: "Grammars | None" = None) -> FastAPI:
    """``pool`` prepares requests (``preprocess_pool``); bodies over ``max_body_bytes`` get 413.
    ``info``: what the server runs (backend, TP, layout, fusion...), shown in /v1/models;
    the caller may fill it in after the model has loaded. ``tokenizer``: rank 0's (token
    texts of logprobs, ``/tokenizer_info``); ``grammars``: compiles structured-output
    grammars. Serve it with ``HttpServer``, whose ``ClientWatch`` tells the handlers when a
    client hangs up. ``max_model_len``: the context limit if known before loading (None: the
    engine's, once loaded)."""
    info = {} if info is None else info
    texts = TokenTexts(tokenizer)
    tokenizer_info = _tokenizer_info(tokenizer, max_model_len) if tokenizer is not None else None
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

    @app.get("/version")
    async def version():
        from glm_fused import __version__

        return {"version": __version__}

    @app.get("/tokenizer_info")
    async def get_tokenizer_info():
        if tokenizer_info is None:
            raise ApiError(404, "this server has no tokenizer (dummy weights from a bare config)")
        return tokenizer_info

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        return await tokenizer_endpoint(raw, "tokenize")

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        return await tokenizer_endpoint(raw, "detokenize")

    async def tokenizer_endpoint(raw: Request, kind: str):
        engine_or_503()
        body = await read_body(raw)
        prep = await unless_gone(pool.prepare(kind, body), client_gone(raw.scope))
        return prep.result

    # ---- generation --------------------------------------------------------------------------
    # Plain Starlette routes: ``generate`` checks the key and reads the body itself, and a
    # FastAPI route's dependency solving and response encoding cost 0.11 ms of every request
    # (0.17 against 0.06 ms from the app's entry to a reply, two CPU cores).
    async def completions(raw: Request) -> Response:
        return _response(await generate(raw, "completion"))

    async def chat_completions(raw: Request) -> Response:
        return _response(await generate(raw, "chat"))

    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])

    async def generate(raw: Request, kind: str):
        await require_api_key(raw)
        engine_or_503()
        gone = client_gone(raw.scope)
        body = await read_body(raw)
        prep = pool.prepare_now(kind, body) or await unless_gone(pool.prepare_in_worker(kind, body), gone)
        del body
        states = None
        if prep.grammar is not None:
            if grammars is None:
                raise ApiError(400, "structured output is not available on this server", param="response_format")
            try:
                so, compiled = await unless_gone(asyncio.to_thread(grammars.compile, prep.grammar), gone)
            except (InvalidParam, UserError) as exc:  # the worker compiled it already: not expected
                raise ApiError(400, str(exc), param=getattr(exc, "param", "response_format")) from None
            states = lambda: so.state(compiled)  # noqa: E731 - one matcher per choice
        engine_or_503()  # it may have stopped meanwhile
        rid = P.new_id("cmpl" if kind == "completion" else "chatcmpl")
        choices, subs = [], []
        for i, ids in enumerate(prep.prompts):
            for j in range(prep.n):
                index = i * prep.n + j
                sub = rid if len(prep.prompts) * prep.n == 1 else f"{rid}-{index}"
                params = prep.params
                if j and params.seed is not None:  # n choices of a seeded request: seeded, not alike
                    params = dataclasses.replace(params, seed=derive_seed(params.seed, j))
                choices.append(Choice(index, sub, i, prep, texts))
                subs.append((sub, ids, params, states() if states is not None else None))
        results, launched = bridge.submit(subs)
        watcher = report_hang_up(gone, results)
        by_id = {c.request_id: c for c in choices}
        n_prompt = sum(len(p) for p in prep.prompts)
        log_line = raw.scope.setdefault("state", {})
        if prep.stream:
            try:  # see the module docstring; a hang-up meanwhile reaches the stream as ClientGone
                await launched
            except asyncio.CancelledError:  # the server stops
                watcher.cancel()
                for request_id in by_id:
                    bridge.abort(request_id)
                raise
            events = (completion_stream if kind == "completion" else chat_stream)(rid, results, by_id, prep,
                                                                                  n_prompt, log_line)
            return sse(events, rid, watcher)
        try:
            await collect(results, by_id)
        finally:
            watcher.cancel()
        log_line[ACCESS_NOTE], n_out = _note(rid, n_prompt, choices)
        if kind == "completion":
            return P.response(rid, "text_completion", model_name, [c.completion() for c in choices], n_prompt, n_out)
        return P.response(rid, "chat.completion", model_name, [c.chat() for c in choices], n_prompt, n_out)

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

    async def collect(results: asyncio.Queue, by_id: dict[str, Choice]) -> None:
        """Every choice's whole output (all aborted when the client hangs up or one fails)."""
        try:
            left = len(by_id)
            while left:
                out = await next_output(results)
                choice = by_id[out.request_id]
                choice.take(out)
                left -= out.finished
        finally:
            for request_id in by_id:
                bridge.abort(request_id)  # no-op once finished

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

    async def outputs(results: asyncio.Queue, by_id: dict[str, Choice]) -> AsyncIterator[tuple[Choice, object]]:
        """Each output with its choice, until every choice has finished; an error event (a
        dict) if the engine fails; every choice aborted if the client leaves."""
        try:
            left = len(by_id)
            while left:
                try:
                    out = await next_output(results)
                except ApiError as exc:
                    if exc.status != 499:
                        yield None, exc.body()
                    return
                choice = by_id[out.request_id]
                choice.take(out)
                left -= out.finished
                yield choice, out
        finally:
            for request_id in by_id:
                bridge.abort(request_id)

    async def completion_stream(rid, results, by_id, prep, prompt_tokens, log_line):
        created = int(time.time())
        async for choice, out in outputs(results, by_id):
            if choice is None:
                yield out
                return
            logprobs = None
            text = out.text_delta
            if not choice.started:  # echo: the prompt comes first (its logprobs are known by now)
                choice.started = True
                text = choice.echo_text() + text
                if choice.wants_logprobs and prep.echo:
                    pairs = choice.prompt_logprob_pairs()
                    logprobs = choice.completion_logprobs(pairs + choice.new_logprobs(len(out.new_token_ids)))
            if logprobs is None and choice.wants_logprobs:
                logprobs = choice.completion_logprobs(choice.new_logprobs(len(out.new_token_ids)))
            if text or out.finished or prep.return_token_ids or (logprobs and logprobs["tokens"]):
                yield P.completion_chunk(rid, model_name, created, P.completion_choice(
                    choice.index, text, out.finish_reason if out.finished else None, logprobs,
                    out.new_token_ids if prep.return_token_ids else None))
        log_line[ACCESS_NOTE], n_out = _note(rid, prompt_tokens, by_id.values())
        if prep.include_usage:
            yield P.usage_chunk(rid, model_name, created, "text_completion", prompt_tokens, n_out)

    async def chat_stream(rid, results, by_id, prep, prompt_tokens, log_line):
        created = int(time.time())
        for choice in by_id.values():
            yield P.chat_chunk(rid, model_name, created, {"role": "assistant", "content": ""}, None, choice.index)
        async for choice, out in outputs(results, by_id):
            if choice is None:
                yield out
                return
            delta = choice.parser.feed(out.text_delta, final=out.finished)
            logprobs = None
            if choice.wants_logprobs and out.new_token_ids:
                logprobs = chat_logprobs(choice.new_logprobs(len(out.new_token_ids)), texts)
            if delta or out.finished or logprobs:
                reason = choice.chat_finish_reason(out.finish_reason) if out.finished else None
                yield P.chat_chunk(rid, model_name, created, delta, reason, choice.index, logprobs)
        log_line[ACCESS_NOTE], n_out = _note(rid, prompt_tokens, by_id.values())
        if prep.include_usage:
            yield P.usage_chunk(rid, model_name, created, "chat.completion.chunk", prompt_tokens, n_out)

    return app


def _note(rid: str, prompt_tokens: int, choices) -> tuple[str, int]:
    """What the access log line says about a generation request, and its completion tokens."""
    n_out = sum(len(c.token_ids) for c in choices)
    finish = ",".join(sorted({str(c.finish_reason) for c in choices}))
    return f"{rid} prompt_tokens={prompt_tokens} completion_tokens={n_out} finish={finish}", n_out


def _tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """vLLM's ``/tokenizer_info``: the tokenizer's configuration as clients read it."""
    info = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_model_len,
            "vocab_size": tokenizer.vocab_size, "chat_template": tokenizer.chat_template}
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        info[name] = tokenizer.special_token(name)
    return info


class Grammars:
    """Rank 0's structured-output grammars: ``compile(tag_json)`` -> ``(StructuredOutputs,
    compiled)``. ``make`` builds the ``StructuredOutputs`` on first use (xgrammar reads the
    whole vocabulary: seconds for GLM's), in the thread that compiles."""

    def __init__(self, make: Callable[[], object]):
        self._make, self._so, self._lock = make, None, threading.Lock()

    def compile(self, tag_json: str):
        with self._lock:
            if self._so is None:
                self._so = self._make()
        return self._so, self._so.compile(tag_json)


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
def _importable(name: str) -> bool:
    try:  # imported, not looked up: an installed build that cannot load is as good as none
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def http_stack() -> tuple[str, str]:
    """uvicorn's HTTP parser and event loop: httptools and uvloop, both dependencies of the
    package, named rather than left to uvicorn's silent "auto". Without them uvicorn parses in
    Python (h11) on asyncio's loop: a request of 2,080 token ids took 0.08-0.12 ms more from
    send to answer on two CPU cores, and a ``/health`` round trip 0.26 against 0.33 ms
    (docs/speed.md). An install that lacks one still serves, and says so once."""
    http = "httptools" if _importable("httptools") else "h11"
    loop = "uvloop" if _importable("uvloop") else "asyncio"
    missing = [name for name, ok in (("httptools", http == "httptools"),
                                     ("uvloop", loop == "uvloop" or sys.platform == "win32")) if not ok]
    if missing:  # uvloop has no Windows build (nor is it a dependency there)
        logger.warning("%s not installed: uvicorn runs %s + %s, slower per request (pip install %s)",
                       " and ".join(missing), http, loop, " ".join(missing))
    return http, loop


class HttpServer:
    """uvicorn on a background thread (signals stay with the main thread, which owns the model),
    serving the app behind ``ClientWatch`` (and ``AccessLog``: one line per request unless
    ``log_requests`` is off)."""

    def __init__(self, app: FastAPI, host: str, port: int, log_requests: bool = True):
        self.host, self.port = host, port
        self.watch = ClientWatch(AccessLog(app, log_requests))
        self.http, self.loop = http_stack()
        config = uvicorn.Config(self.watch, host=host, port=port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=2, lifespan="off", http=self.http, loop=self.loop)
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
