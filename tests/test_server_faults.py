"""Faults and hostile input: one request must never stall, kill or leak the server.

The numbered cases of the server's fault list, each against a real ``scripts/serve.py``
(TP 2 on CPU, tiny model, Paddle and torch): 1. huge prompts while another stream runs;
2. non-streaming clients that hang up; 3. a rank that stops answering (SIGSTOP) trips the
engine watchdog; 4./5. malformed and wrongly typed requests get OpenAI-shaped 4xx answers;
6. (stopping: /health 503 and the signal's name) is checked where test_server.py stops its
servers. A short soak mixes all of it from 64 clients. Faster in-process tests cover the
request preprocessor, the worker pool and the HTTP layer over a fake engine.

Bounds are generous (a busy 2-core machine): they catch a stalled or leaking server, not
a slow one. ``scripts/fault_check.py`` measures the real figures.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from test_server import MODEL, Server, alive, children, fake_server, metric, rank_pids  # noqa: F401

WATCHDOG_S = 6
SERVER_FLAGS = ["--watchdog-timeout", str(WATCHDOG_S), "--max-request-body-bytes", "24M"]
BIG = 20 * 2**20


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def raw_post(port: int, path: str, body: bytes, extra_headers: str = "") -> socket.socket:
    """Send a POST on a raw socket and return it unread (to hang up on it)."""
    s = socket.create_connection(("127.0.0.1", port))
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra_headers}\r\n").encode()
    s.sendall(head + body)
    return s


def wait_until(cond, timeout: float, step: float = 0.05) -> float | None:
    """Seconds until cond() holds, or None after timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if cond():
            return time.monotonic() - start
        time.sleep(step)
    return None


def idle(srv_url_or_server) -> bool:
    srv = srv_url_or_server
    return metric(srv, "num_requests_running") == 0 and metric(srv, "num_requests_waiting") == 0


class Stream(threading.Thread):
    """Streamed completions in the background, one after the other until stopped (``repeat``),
    recording when each event arrived."""

    def __init__(self, url: str, max_tokens: int = 230, repeat: bool = False):
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.repeat = url, max_tokens, repeat
        self.times: list[float] = []
        self.lines: list[str] = []
        self.error: str | None = None
        self.stop = threading.Event()

    def run(self):
        body = {"model": MODEL, "prompt": "The lighthouse", "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": True}
        try:
            while not self.stop.is_set():
                with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
                    for line in r.iter_lines():
                        if line:
                            self.times.append(time.monotonic())
                            self.lines.append(line)
                        if self.stop.is_set():
                            return
                if not self.repeat:
                    return
        except httpx.HTTPError as exc:
            self.error = repr(exc)

    def max_gap(self, start: float, end: float) -> float:
        inside = [start] + [t for t in self.times if start <= t <= end] + [end]
        return max(b - a for a, b in zip(inside, inside[1:]))


class HealthPoller(threading.Thread):
    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.latencies: list[float] = []
        self.statuses: list = []
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set():
            t = time.monotonic()
            try:
                self.statuses.append(httpx.get(f"{self.url}/health", timeout=30).status_code)
            except httpx.TransportError:
                self.statuses.append("refused")
            self.latencies.append(time.monotonic() - t)
            time.sleep(0.05)


# ---- a real server per framework -----------------------------------------------------------
@pytest.fixture(scope="module", params=["paddle", "torch"])
def faults_server(request, tmp_path_factory):
    if request.param == "torch":
        pytest.importorskip("torch")
    srv = Server(2, tmp_path_factory.mktemp(f"faults_{request.param}") / "serve.log",
                 ["--backend", request.param, *SERVER_FLAGS])
    srv.backend = request.param
    try:
        srv.wait_ready()
        srv.rank_pids = rank_pids(srv)
        yield srv
    finally:
        srv.close()


@pytest.mark.timeout(180)
def test_1_huge_prompts_do_not_stall_streams_or_health(faults_server):
    srv = faults_server
    rank0 = srv.rank_pids[0]
    rss_before = rss_mb(rank0)
    stream, health = Stream(srv.url, max_tokens=40, repeat=True), HealthPoller(srv.url)
    stream.start()
    assert wait_until(lambda: len(stream.times) >= 3, 60) is not None, stream.error
    health.start()
    start = time.monotonic()
    text = "a b " * (BIG // 4)
    cases = [  # (path, body, status, param)
        ("completions", {"model": MODEL, "prompt": text, "max_tokens": 4}, 400, "prompt"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": text}]}, 400, "messages"),
        ("completions", {"model": MODEL, "prompt": [7] * (3 * 2**20), "max_tokens": 4}, 400, "prompt"),
        ("completions", {"model": MODEL, "prompt": text + text, "max_tokens": 4}, 413, None),  # over 24M
    ]
    for path, body, status, param in cases:
        data = json.dumps(body).encode()
        t = time.monotonic()
        r = httpx.post(f"{srv.url}/v1/{path}", content=data, headers={"content-type": "application/json"},
                       timeout=120)
        assert r.status_code == status, (path, len(data), r.text[:300])
        assert r.json()["error"]["param"] == param and r.json()["error"]["message"]
        if status == 400:
            assert r.json()["error"]["code"] == "context_length_exceeded"
        print(f"{path} {len(data) / 2**20:.0f} MB: {r.status_code} in {time.monotonic() - t:.2f} s")
    end = time.monotonic()
    health.done.set()
    health.join(35)
    stream.stop.set()
    assert stream.is_alive() and stream.error is None, stream.error
    gap = stream.max_gap(start, end)
    assert gap < 5.0, f"a stream waited {gap:.1f} s for a token during the large requests"
    assert health.latencies and max(health.latencies) < 2.0, f"slowest /health {max(health.latencies):.2f} s"
    assert set(health.statuses) == {200}
    grown = rss_mb(rank0) - rss_before
    assert grown < 300, f"rank 0 kept {grown:.0f} MB after the large requests"
    stream.join(30)


@pytest.mark.timeout(120)
def test_2_abandoned_non_streaming_requests_are_aborted(faults_server):
    srv = faults_server
    # The previous test's last stream may still be ending (its client closed mid-request): count
    # from an idle server, or its abort lands inside this test's window.
    assert wait_until(lambda: idle(srv), 30) is not None
    aborts = metric(srv, "request_success_total", missing=0.0, finished_reason="abort")
    gone = metric(srv, "request_errors_total", missing=0.0, status="499")
    socks = [raw_post(srv.port, "/v1/completions",
                      json.dumps({"model": MODEL, "prompt": f"story {i}", "max_tokens": 200,
                                  "ignore_eos": True}).encode()) for i in range(8)]
    assert wait_until(lambda: metric(srv, "num_requests_running") == 8, 60) is not None
    for s in socks:
        s.close()
    took = wait_until(lambda: idle(srv), 10)
    assert took is not None, "abandoned requests still hold their slots after 10 s"
    assert metric(srv, "request_success_total", finished_reason="abort") == aborts + 8
    assert metric(srv, "request_errors_total", status="499") == gone + 8
    # The freed slots serve the next request at once.
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "next", "max_tokens": 3},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


MALFORMED = [  # (path, raw body, status, param) - the fault list's cases 4 and 5
    ("completions", b'{"model": "x", "prompt": "a', 400, None),                    # invalid JSON: no byte offset
    ("completions", b'{"prompt": "a\\ud800b", "max_tokens": 3}', 400, "prompt"),   # lone surrogate: 400, not 500
    ("chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, "messages.0.content"),
    ("completions", b'{"prompt": "a", "max_tokens": "10"}', 400, "max_tokens"),    # no coercion of strings...
    ("completions", b'{"prompt": "a", "max_tokens": true}', 400, "max_tokens"),    # ...or booleans into numbers
    ("completions", b'{"prompt": "a", "stream": "yes"}', 400, "stream"),
    ("completions", b'{"prompt": [true, false]}', 400, "prompt"),
    ("completions", b'{"prompt": "a", "top_k": -5}', 400, "top_k"),
    ("completions", b'{"prompt": "a", "temperature": NaN}', 400, None),
    ("completions", b'[1, 2]', 400, None),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
                         b'"chat_template_kwargs": {"add_generation_prompt": false}}',
     400, "chat_template_kwargs.add_generation_prompt"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}}',
     400, "chat_template_kwargs.messages"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
                         b'"chat_template_kwargs": {"tools": [{"type": "function"}]}}', 400, "chat_template_kwargs.tools"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
     400, "messages.0.content.0.text"),
    ("completions", b'{"model": "gpt-4", "prompt": "a"}', 404, "model"),
    ("nope", b"{}", 404, None),
]


@pytest.mark.timeout(120)
def test_4_5_malformed_requests_get_openai_shaped_4xx(faults_server):
    srv = faults_server
    before = {s: metric(srv, "request_errors_total", missing=0.0, status=str(s)) for s in (400, 404)}
    for path, body, status, param in MALFORMED:
        r = httpx.post(f"{srv.url}/v1/{path}", content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == status, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
        assert err["param"] == param, (body, err)
        assert err["type"] == "invalid_request_error"
    counts = {s: sum(1 for c in MALFORMED if c[2] == s) for s in (400, 404)}
    for s in (400, 404):
        assert metric(srv, "request_errors_total", status=str(s)) - before[s] == counts[s]
    # The official client sees the same shape; the server still serves; no rank restarted.
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_body={"top_k": -5})
    assert info.value.body["param"] == "top_k"
    assert client.completions.create(model=MODEL, prompt="a", max_tokens=2).usage.completion_tokens >= 1
    assert rank_pids(srv) == srv.rank_pids


@pytest.mark.timeout(180)
def test_soak_mixed_clients(faults_server):
    """64 concurrent clients for a bounded time: valid and invalid requests, streams, hang-ups
    before and during the answer, bodies over the limit. Every valid request completes with a
    finish reason, every invalid one gets a 4xx, and afterwards no slot is held and no rank
    (or preprocessing worker) was restarted."""
    srv = faults_server
    if srv.backend != "paddle":
        pytest.skip("one soak is enough: the framework is below the engine, the soak is above it")
    workers = sorted(children(srv.rank_pids[0]))
    outcomes: dict[str, int] = {}
    failures: list[str] = []

    def note(kind):
        outcomes[kind] = outcomes.get(kind, 0) + 1

    async def client(i: int, deadline: float, http: httpx.AsyncClient):
        rng = random.Random(i)
        while time.monotonic() < deadline:
            action = rng.choice(["complete", "complete", "stream", "chat", "invalid", "hang_up", "disconnect",
                                 "too_large"])
            body = {"model": MODEL, "prompt": f"client {i} says", "max_tokens": rng.randint(1, 6),
                    "temperature": rng.choice([0.0, 0.8])}
            try:
                if action in ("complete", "chat"):
                    path = "completions" if action == "complete" else "chat/completions"
                    if action == "chat":
                        body = {"model": MODEL, "messages": [{"role": "user", "content": body["prompt"]}],
                                "max_tokens": body["max_tokens"]}
                    r = await http.post(f"/v1/{path}", json=body)
                    if r.status_code != 200 or r.json()["choices"][0]["finish_reason"] not in ("stop", "length"):
                        failures.append(f"{action}: {r.status_code} {r.text[:200]}")
                elif action == "stream":
                    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                        lines = [ln async for ln in r.aiter_lines() if ln]
                    finals = [json.loads(ln[6:])["choices"][0]["finish_reason"] for ln in lines[:-1]]
                    if r.status_code != 200 or lines[-1] != "data: [DONE]" or finals[-1] not in ("stop", "length"):
                        failures.append(f"stream: {r.status_code} {lines[-2:]}")
                elif action == "invalid":
                    _, raw, status, _ = rng.choice(MALFORMED)
                    r = await http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
                    if not 400 <= r.status_code < 500 or "error" not in r.json():
                        failures.append(f"invalid: {r.status_code} {r.text[:200]}")
                elif action == "too_large":  # refused on its Content-Length, before any byte is read
                    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
                    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 30000000\r\n\r\n{")
                    status = (await reader.readline()).split()[1]
                    writer.close()
                    if status != b"413":
                        failures.append(f"too_large: {status}")
                else:  # hang up before the answer, or in the middle of a stream
                    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
                    data = json.dumps({**body, "max_tokens": 50, "stream": action == "disconnect"}).encode()
                    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
                    await writer.drain()
                    if action == "disconnect":
                        await reader.read(200)
                    else:
                        await asyncio.sleep(rng.uniform(0, 0.3))
                    writer.close()
                note(action)
            except Exception as exc:  # noqa: BLE001 - every failure is collected and shown
                failures.append(f"{action}: {exc!r}")

    async def main():
        deadline = time.monotonic() + 6
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as http:
            await asyncio.gather(*(client(i, deadline, http) for i in range(64)))

    asyncio.run(main())
    assert not failures, failures[:10]
    assert outcomes.get("complete", 0) + outcomes.get("stream", 0) + outcomes.get("chat", 0) >= 20, outcomes
    assert wait_until(lambda: idle(srv), 15) is not None, "requests still hold slots after the soak"
    assert httpx.get(f"{srv.url}/health").status_code == 200
    assert rank_pids(srv) == srv.rank_pids, "a rank was restarted"
    assert sorted(children(srv.rank_pids[0])) == workers, "a preprocessing worker was restarted"


@pytest.mark.timeout(180)
def test_3_stopped_rank_trips_the_watchdog(faults_server):
    """Last test of each server: SIGSTOP rank 1 while a request streams."""
    srv = faults_server
    tree = [srv.proc.pid, *children(srv.proc.pid)]
    stream, health = Stream(srv.url), HealthPoller(srv.url)
    stream.start()
    assert wait_until(lambda: len(stream.times) >= 3, 60) is not None, stream.error
    health.start()
    stopped_at = time.monotonic()
    os.kill(srv.rank_pids[1], signal.SIGSTOP)
    try:
        unhealthy = wait_until(lambda: any(s != 200 for s in health.statuses), WATCHDOG_S + 20)
        assert unhealthy is not None, "/health stayed 200 with a stopped rank"
        srv.proc.wait(60)
    finally:
        health.done.set()
    took = time.monotonic() - stopped_at
    stream.join(10)
    assert srv.proc.returncode != 0 and took < WATCHDOG_S + 40
    assert 503 in health.statuses, health.statuses[-10:]
    # The in-flight stream ended with an error event, not a hang.
    events = [json.loads(line[6:]) for line in stream.lines if line.startswith("data: {")]
    assert "error" in events[-1] and "rank 1" in events[-1]["error"]["message"], stream.lines[-2:]
    lines = srv.output().strip().splitlines()
    assert lines[-1].startswith("error: rank 1 (pid ") and "stopped answering" in lines[-1] \
        and "--watchdog-timeout" in lines[-1], lines[-5:]
    assert wait_until(lambda: not any(alive(p) for p in tree), 10) is not None, "processes outlived the server"


# ---- in-process: the request preprocessor, the worker pool, the HTTP layer ---------------------
@pytest.fixture(scope="module")
def preprocessor():
    from glm_fused.server.preprocess import RequestPreprocessor
    from glm_fused.tiny import ensure_tiny_checkpoint
    from glm_fused.tokenizer import Tokenizer

    return RequestPreprocessor(model_name=MODEL, max_model_len=256, vocab_size=1024,
                               tokenizer=Tokenizer(ensure_tiny_checkpoint()))


def test_preprocessor_refuses_malformed_requests(preprocessor):
    from glm_fused.server.errors import ApiError

    for path, body, status, param in MALFORMED:
        if path == "nope":
            continue
        with pytest.raises(ApiError) as info:
            preprocessor.prepare("completion" if path == "completions" else "chat", body)
        assert (info.value.status, info.value.param) == (status, param), (body, info.value.message)
    # Valid requests of every form become token ids and sampling parameters.
    for body in ({"prompt": "hello", "max_tokens": 3, "temperature": 1}, {"prompt": [1, 2, 3]},
                 {"prompt": ["hello"]}, {"prompt": [[1, 2]], "top_k": -1}):
        prep = preprocessor.prepare("completion", json.dumps(body).encode())
        assert len(prep.prompt_ids) and prep.params.max_tokens >= 1
    prep = preprocessor.prepare("chat", b'{"messages": [{"role": "user", "content": "emoji \\ud83d\\ude00"}]}')
    assert prep.prompt_ids[:2].tolist() == preprocessor.tokenizer.encode("[gMASK]<sop>")


def test_bodies_parse_as_json_loads_reads_them():
    """parse_json's fast parser gives what the standard library gives, and its refusals end
    in the standard library's message (where the body is wrong)."""
    from glm_fused.server.errors import ApiError
    from glm_fused.server.preprocess import parse_json

    valid = [b'{"a": 1, "a": 2}', b'{"x": 18446744073709551616, "y": -9223372036854775809}',
             b'{"x": 123456789012345678901234567890.5, "y": 1e400, "z": 1e-400, "w": -0.0, "v": 5e-324}',
             b'{"x": [0.1, 1E2, 1.7976931348623157e308, true, null, false]}', b' {"\xc3\xa9": "\xe2\x82\xac"}\n',
             b'{"x": "\\ud83d\\ude00 a\\u0000b", "y": {"z": [[[]]]}}',
             json.dumps({"prompt": list(range(151000, 153080)), "max_tokens": 1}).encode()]
    for body in valid:
        got = parse_json(body)
        assert repr(got) == repr(json.loads(body.decode())), body
    for body, says in ((b'{"x": 1', "line 1, column 8"), (b'{"x": [1, 2,]}', "line 1, column 13"),
                       (b'{"x": NaN}', "NaN"), (b'{"x": \xff}', "offset 6"), (b'{"x": "\\ud800"}', "surrogate")):
        with pytest.raises(ApiError) as info:
            parse_json(body)
        assert info.value.status == 400 and says in info.value.message, (body, info.value.message)


def test_text_far_beyond_the_context_is_refused_before_tokenizing(preprocessor, monkeypatch):
    from glm_fused.server.errors import ApiError

    encoded = []
    monkeypatch.setattr(preprocessor.tokenizer, "encode", lambda text, **kw: encoded.append(len(text)) or [1])
    limit = preprocessor.max_model_len * preprocessor.max_token_chars
    for kind, body in (("completion", {"prompt": "x" * limit}),
                       ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * limit}]}]})):
        with pytest.raises(ApiError) as info:
            preprocessor.prepare(kind, json.dumps(body).encode())
        assert info.value.code == "context_length_exceeded" and f"{limit} characters" in info.value.message
    assert encoded == []
    # Shorter text is tokenized as usual.
    preprocessor.prepare("completion", json.dumps({"prompt": "x" * (limit // 2)}).encode())
    assert encoded == [limit // 2]


@pytest.mark.timeout(120)
def test_preprocess_pool_restarts_a_dead_worker():
    from glm_fused.server.errors import ApiError
    from glm_fused.server.preprocess_pool import PreprocessPool
    from glm_fused.tiny import ensure_tiny_checkpoint

    pool = PreprocessPool({"model_name": MODEL, "max_model_len": 256, "vocab_size": 1024,
                           "tokenizer_dir": str(ensure_tiny_checkpoint())}, workers=1)
    pool.start()
    try:
        async def prepare(body):
            return await pool.prepare("completion", json.dumps(body).encode())

        first = asyncio.run(prepare({"prompt": "hello world"}))
        assert len(first.prompt_ids) and first.params.max_tokens == 16
        with pytest.raises(ApiError) as info:
            asyncio.run(prepare({"prompt": "hello", "max_tokens": 0}))
        assert info.value.param == "max_tokens"
        [pid] = pool.worker_pids()
        os.kill(pid, signal.SIGKILL)
        again = asyncio.run(prepare({"prompt": "hello world"}))
        assert again.prompt_ids.tolist() == first.prompt_ids.tolist() and pool.restarts == 1
        assert pool.worker_pids() != [pid]
    finally:
        pids = pool.worker_pids()
        pool.close()
    assert not any(alive(p) for p in pids)


@pytest.mark.timeout(120)
def test_token_id_completions_are_prepared_in_place():
    """A small completion of token ids is prepared on the event loop (answered while the worker
    is stopped), exactly as a worker prepares it; text still goes to the worker."""
    from glm_fused.server.errors import ApiError
    from glm_fused.server.preprocess_pool import PreprocessPool
    from glm_fused.tiny import ensure_tiny_checkpoint

    pool = PreprocessPool({"model_name": MODEL, "max_model_len": 256, "vocab_size": 1024,
                           "tokenizer_dir": str(ensure_tiny_checkpoint())}, workers=1)
    pool.start()
    ids = {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 3, "echo": True, "logprobs": 1, "stop": ["x"]}

    async def prepare(body, timeout=30.0):
        return await asyncio.wait_for(pool.prepare("completion", json.dumps(body).encode()), timeout)

    try:
        assert asyncio.run(prepare({"prompt": "hello"})).prompts  # the worker is up
        [pid] = pool.worker_pids()
        os.kill(pid, signal.SIGSTOP)
        try:
            here = asyncio.run(prepare(ids))
            with pytest.raises(ApiError) as info:
                asyncio.run(prepare({"prompt": [5, 2000]}))
            assert info.value.status == 400 and info.value.param == "prompt"
            with pytest.raises(asyncio.TimeoutError):
                asyncio.run(prepare({"prompt": "hello"}, timeout=0.5))
        finally:
            os.kill(pid, signal.SIGCONT)
        pool.inline_max_bytes = 0  # now every request goes to the worker
        assert asyncio.run(prepare(ids)).to_wire() == here.to_wire()
        assert [p.tolist() for p in here.prompts] == [[5, 6, 7], [8, 9]] and here.prompt_texts[0]
    finally:
        pool.close()


def test_a_text_completion_is_not_parsed_on_the_event_loop(monkeypatch):
    """The handler's check for a token-id prompt does not parse a text prompt's body (the
    worker parses it); ids, and prompts whose form only a parse can tell, are parsed."""
    from glm_fused.server import preprocess
    from glm_fused.server.preprocess_pool import PreprocessPool

    pool = PreprocessPool({"model_name": MODEL, "max_model_len": 256, "vocab_size": 1024}, workers=0)
    pool.start()
    parsed = []
    real = preprocess.parse_json
    monkeypatch.setattr(preprocess, "parse_json", lambda body: parsed.append(body) or real(body))
    for body in (b'{"prompt": "hello", "max_tokens": 2}', b'{"prompt"\n :\t"[1, 2]"}'):
        assert pool.prepare_now("completion", body) is None
    assert parsed == []
    assert [p.tolist() for p in pool.prepare_now("completion", b'{"prompt": [5, 6], "max_tokens": 2}').prompts] == [[5, 6]]
    # an escaped "prompt" inside another string is no key: the real prompt (ids) is still found
    tricky = json.dumps({"user": '"prompt": "x"', "prompt": [7]}).encode()
    assert [p.tolist() for p in pool.prepare_now("completion", tricky).prompts] == [[7]]
    assert len(parsed) == 2
    pool.close()


async def _slow_forward_hang_ups(url: str, n: int) -> None:
    """n non-streamed requests on raw connections, closed before any answer."""
    writers = []
    for i in range(n):
        reader, writer = await asyncio.open_connection(*url.removeprefix("http://").split(":"))
        data = json.dumps({"model": "fake", "prompt": [i + 1, 2], "max_tokens": 50, "ignore_eos": True}).encode()
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        await writer.drain()
        writers.append(writer)
    await asyncio.sleep(0.5)
    for writer in writers:
        writer.close()


async def _pass_through(request, call_next):
    return await call_next(request)  # a BaseHTTPMiddleware, as hides hang-ups from Request.is_disconnected


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fake_server", [{"middleware": [_pass_through, _pass_through]}], indirect=True)
def test_hang_up_is_seen_through_any_middleware(fake_server):
    url, bridge = fake_server
    forward = bridge.engine.runner.forward
    bridge.engine.runner.forward = lambda batch: (time.sleep(0.05), forward(batch))[1]
    asyncio.run(_slow_forward_hang_ups(url, 3))  # 2 slots: 2 running, 1 waiting
    took = wait_until(lambda: not bridge.engine.has_unfinished(), 5, step=0.01)
    assert took is not None, "abandoned requests kept running"
    srv = type("Url", (), {"url": url})
    assert metric(srv, "request_success_total", finished_reason="abort") == 3
    assert metric(srv, "request_errors_total", status="499") == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fake_server", [{"max_body_bytes": 16 * 1024}], indirect=True)
def test_body_limit_answers_413_in_openai_shape(fake_server):
    url, _ = fake_server
    big = json.dumps({"model": "fake", "prompt": [1] * 20_000}).encode()
    r = httpx.post(f"{url}/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "--max-request-body-bytes" in r.json()["error"]["message"]
    # Without Content-Length (chunked), refused while reading; the client still gets the answer.
    r = httpx.post(f"{url}/v1/completions", content=(big[i:i + 4096] for i in range(0, len(big), 4096)),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    # The official client gets a 413 error, not a reset connection it would retry.
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="fake", prompt=[1] * 20_000, max_tokens=1)
    assert info.value.status_code == 413
    assert metric(type("Url", (), {"url": url}), "request_errors_total", status="413") == 3
    assert client.completions.create(model="fake", prompt=[1, 2], max_tokens=1).usage.completion_tokens == 1
