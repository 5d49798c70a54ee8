"""The OpenAI-compatible server, end to end: scripts/serve.py as a subprocess on the tiny
default at TP 2 and TP 4 on CPU, driven by the official ``openai`` client and raw HTTP.

One server start per TP size is shared by the tests of that size (each start costs about
10 s on 2 cores); the last test of each size stops it with SIGTERM and checks that no
process is left. A separate TP 2 start checks that a killed rank takes the server down.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL = "glm-4.5-air-tiny"
# --device cpu: the same run on a machine with a GPU (where --backend auto would take it).
ENGINE_FLAGS = ["--max-num-seqs", "8", "--max-model-len", "256", "--max-num-batched-tokens", "48", "--device", "cpu"]
START_TIMEOUT_S = 150
PROMPTS = ["The lighthouse stands at the end of", "A river begins as rain", "To bake a simple loaf",
           "Numbers have patterns that are", "The city library opens at nine", "In the mountains the weather",
           "When you ask a question, a good answer", "Sailors who come home late watch for"]


# ---- processes -------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Every live descendant of pid (each rank has a process group of its own, so walk the tree)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Server:
    def __init__(self, tp: int, log_path: Path, extra: list[str] | None = None, engine_flags: list[str] | None = None,
                 model_args: list[str] | None = None, host: str = "127.0.0.1"):
        self.tp, self.port, self.log_path = tp, free_port(), log_path
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}"
        cmd = [sys.executable, str(ROOT / "scripts" / "serve.py"), *(model_args or ["--model", MODEL]),
               "--tp", str(tp), "--port", str(self.port), *(ENGINE_FLAGS if engine_flags is None else engine_flags),
               *(["--host", host] if host != "127.0.0.1" else []), *(extra or [])]
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.ranks: list[int] = []

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        end = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.ranks = [p for p in children(self.proc.pid)]
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"server not ready after {START_TIMEOUT_S}s:\n{self.output()}")

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60, **kwargs)

    def close(self) -> None:
        pids = [self.proc.pid, *children(self.proc.pid)]
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        for pid in pids:  # never leave anything behind, even after a failure
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def server(request, tmp_path_factory):
    srv = Server(request.param, tmp_path_factory.mktemp(f"serve_tp{request.param}") / "serve.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.close()


def rank_pids(srv: Server) -> dict[int, int]:
    """rank -> pid of the server's ranks."""
    out = {}
    for pid in children(srv.proc.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ranks = [e.split(b"=", 1)[1] for e in env if e.startswith(b"GLM_FUSED_RANK=")]
        if ranks and b"glm_fused.launcher" in Path(f"/proc/{pid}/cmdline").read_bytes():
            out[int(ranks[0])] = pid
    return out


def stop_watching_health(srv: Server, signum=signal.SIGTERM, timeout=20) -> tuple[list, float]:
    """Send ``signum`` and poll /health until the server exits: the statuses seen in order
    ("refused" once it no longer listens), and how long the exit took."""
    seen: list = []
    done = threading.Event()

    def poll():
        while not done.is_set():
            try:
                seen.append(httpx.get(f"{srv.url}/health", timeout=2).status_code)
            except httpx.TransportError:
                seen.append("refused")
            time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.1)
    start = time.monotonic()
    try:
        srv.proc.send_signal(signum)
        srv.proc.wait(timeout)
    finally:
        done.set()
        poller.join(5)
    return seen, time.monotonic() - start


def check_stop_answers_503(seen: list, output: str, name: str) -> None:
    """From the moment a stop begins /health says 503, until the server stops listening;
    the stop line names the signal that was sent."""
    assert 503 in seen, seen
    after_stop = seen[seen.index(503):]
    assert set(after_stop) <= {503, "refused"} and after_stop == sorted(after_stop, key=lambda x: x == "refused"), \
        seen
    assert f"{name}: stopping..." in output, output[-2000:]


def complete(srv: Server, prompt, max_tokens=8, **extra) -> tuple[str, list[int], str, dict]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True, **extra}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    c = data["choices"][0]
    return c["text"], c["token_ids"], c["finish_reason"], data["usage"]


def metric(srv: Server, name: str, missing: float | None = None, **labels: str) -> float:
    """The sum of the ``glm_fused:NAME`` samples with these labels, read with Prometheus' parser.

    No such sample fails the test (a renamed or dropped series must not read as 0), unless
    ``missing`` is given: the value of a labelled counter that nothing has incremented yet (it
    has no sample until then), for a reading taken before the increments."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    values = [s.value for family in text_string_to_metric_families(text) for s in family.samples
              if s.name == f"glm_fused:{name}" and labels.items() <= s.labels.items()]
    if not values:
        assert missing is not None, f"/metrics has no glm_fused:{name} sample with labels {labels}"
        return missing
    return sum(values)


# ---- the API ---------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_health_and_models(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    info = card["glm_fused"]
    assert info["tp"] == server.tp and info["layout"] == "fused" and info["fusion"] == "reference"
    assert info["http"] == "uvicorn (httptools, uvloop)"  # the package's dependencies, named to uvicorn
    # CPU default: room for --max-num-seqs 8 sequences of --max-model-len 256, in blocks of 16.
    assert card["max_model_len"] == 256
    kv = info["kv_cache"]
    assert (kv["num_blocks"], kv["block_size"], kv["prefix_caching"]) == (128, 16, True)
    assert 0.0 <= kv["usage"] <= 1.0 and kv["prefix_cache_hits"] <= kv["prefix_cache_queries"]
    log = server.output()
    for word in ("backend=paddle", f"tp={server.tp}", "dtype=float32", "fusion=reference",
                 "KV cache 128 blocks x 16 tokens = 2048 tokens", "max-model-len 256", "prefix caching on"):
        assert word in log, f"start-up log lacks {word!r}:\n{log}"


@pytest.mark.timeout(120)
def test_openai_completion_and_chat(server):
    from glm_fused.tokenizer import Tokenizer
    from glm_fused.tiny import ensure_tiny_checkpoint

    tok = Tokenizer(ensure_tiny_checkpoint())
    client = server.client()
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok.encode(PROMPTS[0], add_special_tokens=True))
    assert r.usage.completion_tokens == 6 and r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert isinstance(r.choices[0].text, str) and r.choices[0].text

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the lighthouse?"}]
    for thinking in (True, False):
        c = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=thinking)
        assert rendered.startswith("[gMASK]<sop>") and rendered.endswith("<|assistant|>" if thinking else "</think>")
        assert c.usage.prompt_tokens == len(tok.encode(rendered))
        assert c.choices[0].message.role == "assistant" and c.choices[0].finish_reason in ("stop", "length")
        assert 1 <= c.usage.completion_tokens <= 5


@pytest.mark.timeout(120)
def test_streaming_matches_non_streaming(server):
    client = server.client()
    full = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}],
                                          max_tokens=10, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}],
                                            max_tokens=10, temperature=0, stream=True)
    parts = list(stream)
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == chat.choices[0].finish_reason

    # Raw SSE: events are `data: {json}` lines and the stream ends with [DONE].
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 3, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)


@pytest.mark.timeout(120)
def test_sampling_seed_and_stop_strings(server):
    client = server.client()
    kwargs = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=12, temperature=1.0, top_p=0.9,
                  extra_body={"top_k": 50, "ignore_eos": True})
    a = client.completions.create(seed=7, **kwargs).choices[0].text
    b = client.completions.create(seed=7, **kwargs).choices[0].text
    assert a == b  # same seed, same tokens (each request owns its generator)

    text, _, _, _ = complete(server, PROMPTS[4], max_tokens=16, ignore_eos=True)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), f"no usable stop string in {text!r}"
    cut, _, reason, _ = complete(server, PROMPTS[4], max_tokens=16, ignore_eos=True, stop=[stop])
    assert reason == "stop" and cut == text[:text.index(stop)]


@pytest.mark.timeout(240)
def test_32_concurrent_requests_none_lost_and_greedy_unchanged(server, tmp_path):
    """32 concurrent requests over 8 slots: all answered, each exactly as when run alone,
    and as scripts/generate.py makes them."""
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]
    alone = {i: complete(server, prompts[i], ignore_eos=True)[1] for i in (0, 5, 13, 31)}
    before = metric(server, "request_success_total", missing=0.0, finished_reason="length")

    def one(i):
        return complete(server, prompts[i], ignore_eos=True)

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert len(results) == 32
    assert all(len(ids) == 8 and reason == "length" for _, ids, reason, _ in results)
    for i, ids in alone.items():
        assert results[i][1] == ids, f"prompt {i}: alone {ids} vs in a busy batch {results[i][1]}"
    assert metric(server, "request_success_total", finished_reason="length") - before == 32

    picked = [0, 5, 13, 31]
    cmd = [sys.executable, str(ROOT / "scripts" / "generate.py"), "--model", MODEL, "--tp", str(server.tp),
           *ENGINE_FLAGS, "--max-new-tokens", "8", "--ignore-eos", "--json"]
    for i in picked:
        cmd += ["--prompt", prompts[i]]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    offline = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [o["token_ids"] for o in offline] == [results[i][1] for i in picked]
    assert [o["text"] for o in offline] == [results[i][0] for i in picked]


@pytest.mark.timeout(300)
def test_64_concurrent_requests_sharing_a_long_system_prompt_all_complete(server):
    """64 requests at once behind one 150-token system prompt (8 run at a time): every one
    answered in full, none lost; the prefix cache serves the shared blocks to nearly all of them."""
    system = [(7 * i + 3) % 900 for i in range(150)]  # 9 full blocks of 16, and 6 tokens more
    prompts = [system + [10 + i, 20 + i % 7, 30 + i % 5] for i in range(64)]
    hits_before = metric(server, "prefix_cache_hits_total")

    def one(i):
        return complete(server, prompts[i], max_tokens=4, ignore_eos=True)

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    assert len(results) == 64
    assert all(len(ids) == 4 and reason == "length" and usage["prompt_tokens"] == 153
               for _, ids, reason, usage in results)
    # The first request computes the system prompt; (nearly) every later one finds its 144
    # tokens of full blocks cached. Requests admitted in the same step as the one that computes
    # them cannot: allow a few.
    assert metric(server, "prefix_cache_hits_total") - hits_before >= 56 * 144
    text = httpx.get(f"{server.url}/metrics").text
    assert "# TYPE glm_fused:kv_cache_usage_perc gauge" in text and "glm_fused:num_preemptions_total" in text
    assert metric(server, "num_requests_running") == 0 and metric(server, "kv_cache_usage_perc") == 0.0
    kv = httpx.get(f"{server.url}/v1/models").json()["data"][0]["glm_fused"]["kv_cache"]
    assert kv["prefix_cache_hits"] >= 56 * 144 and kv["usage"] == 0.0


@pytest.mark.timeout(120)
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    client = server.client()
    cases = [
        (dict(model="no-such-model"), 404, "model"),
        (dict(max_tokens=0), 400, "max_tokens"),
        (dict(temperature=-0.5), 400, "temperature"),
        (dict(top_p=0.0), 400, "top_p"),
        (dict(n=0), 400, "n"),
        (dict(max_tokens=10_000), 400, "max_tokens"),
        (dict(prompt="word " * 400), 400, "prompt"),
        (dict(prompt=[5, 10**6]), 400, "prompt"),
        (dict(prompt=[-1], echo=True, logprobs=1), 400, "prompt"),  # checked before it is echoed as text
        (dict(extra_body={"logprobs": 21}), 400, "logprobs"),  # over --max-logprobs (20)
    ]
    before = metric(server, "request_errors_total", missing=0.0, status="400")
    for kwargs, status, param in cases:
        args = dict(model=MODEL, prompt="hello", max_tokens=4) | kwargs
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(**args)
        assert info.value.status_code == status, (kwargs, info.value.body)
        assert info.value.body["param"] == param and info.value.body["message"], info.value.body
    assert metric(server, "request_errors_total", status="400") - before == 9
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    assert info.value.body["param"].startswith("messages")
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    # Still serving.
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1


@pytest.mark.timeout(120)
def test_metrics_move(server):
    keys = [("request_success_total", {"finished_reason": "length"}), ("prompt_tokens_total", {}),
            ("generation_tokens_total", {}), ("time_to_first_token_seconds_count", {}),
            ("request_time_per_output_token_seconds_count", {}), ("engine_steps_total", {}),
            ("time_to_first_token_seconds_sum", {}), ("request_queue_time_seconds_count", {}),
            ("request_queue_time_seconds_sum", {}), ("request_prefill_time_seconds_sum", {})]
    before = {name: metric(server, name, missing=0.0 if labels else None, **labels) for name, labels in keys}
    complete(server, PROMPTS[5], max_tokens=5, ignore_eos=True)
    after = {name: metric(server, name, **labels) for name, labels in keys}
    assert after["request_success_total"] == before["request_success_total"] + 1
    assert after["generation_tokens_total"] == before["generation_tokens_total"] + 5
    assert after["prompt_tokens_total"] > before["prompt_tokens_total"]
    assert after["time_to_first_token_seconds_count"] == before["time_to_first_token_seconds_count"] + 1
    assert (after["request_time_per_output_token_seconds_count"]
            == before["request_time_per_output_token_seconds_count"] + 1)
    assert after["engine_steps_total"] >= before["engine_steps_total"] + 5
    # the first token's time, split into waiting to be admitted and the prompt's steps
    assert after["request_queue_time_seconds_count"] == before["request_queue_time_seconds_count"] + 1
    delta = {k: after[k] - before[k] for k in ("time_to_first_token_seconds_sum", "request_queue_time_seconds_sum",
                                                "request_prefill_time_seconds_sum")}
    assert delta["request_queue_time_seconds_sum"] >= 0 and delta["request_prefill_time_seconds_sum"] > 0
    assert (delta["request_queue_time_seconds_sum"] + delta["request_prefill_time_seconds_sum"]
            == pytest.approx(delta["time_to_first_token_seconds_sum"], abs=1e-6))
    text = httpx.get(f"{server.url}/metrics").text
    assert "# TYPE glm_fused:num_requests_running gauge" in text
    assert "# TYPE glm_fused:num_requests_waiting gauge" in text
    # Fused layout at TP > 1: rank 0 made only fused all-reduce + norm calls, no plain ones.
    assert metric(server, "fused_allreduce_calls_total") > 0
    assert metric(server, "plain_allreduce_calls_total") == 0


@pytest.mark.timeout(120)
def test_client_disconnect_frees_its_sequence(server):
    before = metric(server, "request_success_total", missing=0.0, finished_reason="abort")
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": PROMPTS[6], "max_tokens": 200, "ignore_eos": True,
                            "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break  # leave mid-stream
    end = time.monotonic() + 20
    while time.monotonic() < end:
        if (metric(server, "request_success_total", missing=0.0, finished_reason="abort") == before + 1
                and metric(server, "num_requests_running") == 0):
            break
        time.sleep(0.2)
    assert metric(server, "request_success_total", finished_reason="abort") == before + 1
    assert metric(server, "num_requests_running") == 0
    assert metric(server, "generation_tokens_total") < 1e9  # still answering


@pytest.mark.timeout(120)
def test_sigterm_cancels_in_flight_and_stops_every_rank(server):
    """Last test of each server: SIGTERM while a request streams."""
    assert len(server.ranks) >= server.tp
    events: list[str] = []

    def stream():
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": PROMPTS[7], "max_tokens": 200,
                                    "ignore_eos": True, "stream": True}) as r:
                if r.status_code != 200:
                    events.append(f"HTTP {r.status_code}: {r.read().decode()}")
                    return
                events.extend(ln for ln in r.iter_lines() if ln)
        except httpx.HTTPError as exc:
            events.append(f"transport error: {exc}")

    thread = threading.Thread(target=stream)
    thread.start()
    end = time.monotonic() + 30
    while len(events) < 3 and time.monotonic() < end and thread.is_alive():
        time.sleep(0.05)
    assert len(events) >= 3 and events[0].startswith("data: {"), events
    seen, took = stop_watching_health(server)
    thread.join(10)
    assert took < 10, f"shutdown took {took:.1f}s"
    assert not any(alive(p) for p in server.ranks), "a rank outlived the server"
    finals = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
    assert finals and finals[-1]["choices"][0]["finish_reason"] == "abort", events[-3:]
    assert events[-1] == "data: [DONE]"
    check_stop_answers_503(seen, server.output(), "SIGTERM")
    assert "every rank told to stop" in server.output()


@pytest.mark.timeout(240)
def test_killed_rank_takes_the_server_down(tmp_path):
    srv = Server(2, tmp_path / "serve.log")
    try:
        srv.wait_ready()
        ranks = srv.ranks
        rank1 = [p for p in ranks if b"\0GLM_FUSED_RANK=1\0" in b"\0" + Path(f"/proc/{p}/environ").read_bytes()]
        assert rank1, "rank 1 not found"
        os.kill(rank1[0], signal.SIGKILL)
        srv.proc.wait(30)
        assert srv.proc.returncode != 0
        assert "rank 1" in srv.output() and "SIGKILL" in srv.output()
        assert not any(alive(p) for p in ranks)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{srv.url}/health", timeout=2)
    finally:
        srv.close()


@pytest.mark.timeout(60)
def test_impossible_flags_refused_before_any_rank_starts():
    cases = [
        (["--tp", "3"], "--tp 3"),
        (["--unfused", "--enable-flashinfer-allreduce-fusion"], "--enable-flashinfer-allreduce-fusion"),
        (["--enable-flashinfer-allreduce-fusion", "--tp", "2", "--device", "cpu"], "--device gpu"),
        (["--dtype", "bfloat16", "--device", "cpu"], "--dtype bfloat16"),
        (["--max-num-seqs", "64", "--max-num-batched-tokens", "32"], "--max-num-batched-tokens"),
        (["--max-model-len", "10000000"], "--max-model-len"),
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
        (["--model", "/no/such/dir"], "--model"),
        (["--port", "0"], "--port"),
    ]
    for flags, words in cases:
        run = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve.py"), *flags], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], \
            (flags, run.stderr)


def test_uvicorn_runs_httptools_and_uvloop_and_says_when_one_is_missing(monkeypatch, caplog):
    """The package depends on both; uvicorn is told to use them, not left to its silent
    "auto", and an install without one still serves, with a warning naming it."""
    import logging

    from fastapi import FastAPI

    from glm_fused.server import app as server_app

    http = server_app.HttpServer(FastAPI(), "127.0.0.1", free_port())
    assert (http.http, http.loop) == ("httptools", "uvloop")
    http.server.config.load()
    assert http.server.config.http_protocol_class.__name__ == "HttpToolsProtocol"
    real = server_app._importable
    monkeypatch.setattr(server_app, "_importable", lambda name: name != "httptools" and real(name))
    with caplog.at_level(logging.WARNING, logger="glm_fused.server"):
        assert server_app.http_stack() == ("h11", "uvloop")
    assert "httptools not installed: uvicorn runs h11 + uvloop" in caplog.text


# ---- in-process: the HTTP layer over a fake runner (fast) ----------------------------------
@pytest.fixture
def fake_server(request):
    """create_app + the engine loop on a thread, over test_engine's fake runner; no tokenizer
    unless the test asks for the tiny one."""
    from test_engine import FakeRunner

    from glm_fused.engine import LLMEngine
    from glm_fused.engine_args import EngineArgs
    from glm_fused.server.app import EngineBridge, HttpServer, create_app, run_engine_loop
    from glm_fused.server.metrics import ServerMetrics

    from glm_fused.server.preprocess_pool import PreprocessPool

    opts = getattr(request, "param", {})
    tokenizer = None
    if opts.get("tokenizer"):
        from glm_fused.tiny import ensure_tiny_checkpoint
        from glm_fused.tokenizer import Tokenizer

        tokenizer = Tokenizer(ensure_tiny_checkpoint())
    bridge, metrics = EngineBridge(), ServerMetrics()
    pool = PreprocessPool({"model_name": "fake", "max_model_len": 64, "vocab_size": 1024,
                           "tokenizer_dir": str(tokenizer.model_dir) if tokenizer else None}, workers=0)
    app = create_app(bridge, metrics, model_name="fake", pool=pool, max_model_len=64,
                     api_key=opts.get("api_key"), max_body_bytes=opts.get("max_body_bytes", 4 * 2**20))
    pool.start()
    for middleware in opts.get("middleware", []):
        app.middleware("http")(middleware)
    port = free_port()
    http = HttpServer(app, "127.0.0.1", port)
    http.start()
    assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 503  # not loaded yet
    settings = EngineArgs(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=8)
    runner = FakeRunner(settings.slot_blocks(), settings.block_size, vocab=1024)
    bridge.engine = LLMEngine(runner, settings, vocab_size=1024, tokenizer=tokenizer)
    bridge.loop_error = None

    def engine_loop():
        try:
            run_engine_loop(bridge.engine, bridge, metrics)
        except Exception as exc:  # the failure test breaks the runner on purpose
            bridge.loop_error = exc

    loop = threading.Thread(target=engine_loop, daemon=True)
    loop.start()
    try:
        yield f"http://127.0.0.1:{port}", bridge
    finally:
        bridge.stop_requested = True
        loop.join(5)
        http.stop()
        assert not loop.is_alive() and not http.thread.is_alive()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fake_server", [{"api_key": "sesame"}], indirect=True)
def test_api_key_guards_v1_only(fake_server):
    url, _ = fake_server
    body = {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 2}
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    ok = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0).completions.create(**body)
    assert ok.usage.completion_tokens == 2
    assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200


@pytest.mark.timeout(60)
def test_without_tokenizer_token_ids_only(fake_server):
    """Dummy weights from a bare config have no tokenizer: token-id prompts work, text is
    refused by name, and the result comes back as token ids."""
    url, _ = fake_server
    r = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": [5, 6, 7], "max_tokens": 4,
                                                  "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["text"] == "" and len(choice["token_ids"]) == 4 and choice["finish_reason"] == "length"
    for path, body, param in [("completions", {"prompt": "text"}, "prompt"),
                              ("completions", {"prompt": [1], "stop": ["x"]}, "stop"),
                              ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages")]:
        r = httpx.post(f"{url}/v1/{path}", json={"model": "fake", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.timeout(60)
def test_queueing_beyond_the_slots_and_engine_failure(fake_server):
    """More requests than slots wait their turn; when the engine dies, waiting requests get
    an error (500 / an error event) instead of hanging, and /health says so."""
    url, bridge = fake_server
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)

    async def many():
        import asyncio

        calls = [client.completions.create(model="fake", prompt=[i + 1, 2, 3], max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True}) for i in range(12)]
        return await asyncio.gather(*calls)

    import asyncio

    results = asyncio.run(many())
    assert [r.usage.completion_tokens for r in results] == [6] * 12
    assert len({tuple(r.choices[0].model_extra["token_ids"]) for r in results}) == 12

    def broken(batch):
        raise RuntimeError("rank 1 is gone")

    bridge.engine.runner.forward = broken
    r = httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": [1, 2], "max_tokens": 3}, timeout=10)
    assert r.status_code == 500 and "rank 1 is gone" in r.json()["error"]["message"]
    assert isinstance(bridge.loop_error, RuntimeError)
    assert httpx.get(f"{url}/health").status_code == 503
    assert httpx.post(f"{url}/v1/completions", json={"model": "fake", "prompt": [1], "max_tokens": 1}).status_code == 503


@pytest.mark.timeout(120)
def test_generate_with_dummy_weights_and_no_tokenizer(tmp_path):
    from glm_fused.tiny import ensure_tiny_checkpoint

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((ensure_tiny_checkpoint() / "config.json").read_text())
    base = [sys.executable, str(ROOT / "scripts" / "generate.py"), "--model", str(bare), "--load-format", "dummy",
            "--max-model-len", "64", "--max-num-seqs", "2"]
    run = subprocess.run(base + ["--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--ignore-eos", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 4 and out["text"] == ""
    run = subprocess.run(base + ["--prompt", "hello"], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1].startswith("error: ") and "--prompt-ids" in run.stderr


@pytest.mark.timeout(60)
def test_stream_starts_once_the_engine_ran_its_step(fake_server):
    """A stream's response goes out only after the engine took the request and ran a step
    (the response's start would otherwise compete with the engine for the interpreter lock
    on the way to the first token): nothing while the engine is held, all of it after."""
    import asyncio

    url, bridge = fake_server
    release, step = threading.Event(), bridge.engine.step
    bridge.engine.step = lambda: (release.wait(20), step())[1]
    data = json.dumps({"model": "fake", "prompt": [1, 2], "max_tokens": 2, "stream": True}).encode()

    async def run():
        reader, writer = await asyncio.open_connection(*url.removeprefix("http://").split(":"))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        await writer.drain()
        try:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(reader.readline(), 0.5)
        finally:
            release.set()
        answer = await asyncio.wait_for(reader.read(), 20)
        writer.close()
        return answer

    try:
        answer = asyncio.run(run())
    finally:
        release.set()
    assert answer.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in answer


@pytest.mark.timeout(60)
def test_bench_serve_reports_side_by_side(fake_server, tmp_path, capsys):
    from bench import bench_serve

    url, _ = fake_server
    out = tmp_path / "bench.json"
    code = bench_serve.main(["--url", url, "--url", url, "--label", "fused", "--label", "unfused",
                             "--num-requests", "6", "--concurrency", "3", "--input-len", "5", "--output-len", "4",
                             "--rounds", "2", "--warmup", "1", "--json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "fused" in table and "unfused" in table and "TPOT p99 (ms)" in table and "unfused / fused" in table
    results = json.loads(out.read_text())["results"]
    assert [r["requests"] for r in results] == [12, 12]           # 2 rounds x 6, warm-up excluded
    assert [r["output_tokens"] for r in results] == [48, 48]      # exactly --output-len each
    assert all(r["ttft_median_ms"] > 0 and r["tpot_median_ms"] > 0 for r in results)


@pytest.mark.timeout(60)
def test_bench_serve_paged_cache_checks(fake_server, tmp_path, capsys):
    """--prefix-cache-ttft: pairs of uncached / cached prefixes, the hits seen in /metrics;
    --min-running: the most requests running at once, read from /metrics (2 = max_num_seqs)."""
    from bench import bench_serve

    url, _ = fake_server
    out = tmp_path / "prefix.json"
    code = bench_serve.main(["--url", url, "--prefix-cache-ttft", "--prefix-len", "40", "--input-len", "4",
                             "--num-requests", "3", "--warmup", "1", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "cached / uncached" in printed and "waiting to be admitted" in printed
    result = json.loads(out.read_text())["results"][0]
    assert result["pairs"] == 3 and len(result["ttft_cached_ms"]) == 3 and result["ratio"] > 0
    assert result["prefix_cache_hits"] == 3 * 32  # each cached request: the prefix's 2 full blocks of 16
    # each request's forward steps as the device ran them, from /metrics: the floor of its TTFT
    assert 0 < result["device_cached_median_ms"] <= result["ttft_cached_median_ms"]
    assert 0 < result["device_uncached_median_ms"] <= result["ttft_uncached_median_ms"]
    # the server's own TTFT (within the client's), split at the request's admission to a step
    for name in ("cached", "uncached"):
        server = result[f"server_ttft_{name}_median_ms"]
        assert 0 < server <= result[f"ttft_{name}_median_ms"]
        assert result[f"queue_{name}_median_ms"] >= 0 and 0 < result[f"prefill_{name}_median_ms"] <= server
    flags = ["--url", url, "--num-requests", "12", "--concurrency", "4", "--input-len", "5", "--output-len", "50",
             "--warmup", "0"]
    assert bench_serve.main(flags + ["--min-running", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["results"][0]["peak_running"] == 2
    assert "most running" in capsys.readouterr().out
    assert bench_serve.main(flags + ["--output-len", "4", "--min-running", "3"]) == 1
    # Every round and concurrency sends new prompts: none is served from the prefix cache
    # (prompts of 40 tokens hold two full blocks of 16 that a repeat would find cached).
    assert bench_serve.main(["--url", url, "--num-requests", "4", "--concurrency", "2,4", "--rounds", "2",
                             "--input-len", "40", "--output-len", "2", "--warmup", "1", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["requests"] for r in results] == [8, 8] and [r["prefix_cache_hits"] for r in results] == [0, 0]
    assert "prefix-cache hits" in capsys.readouterr().out


@pytest.mark.timeout(180)
def test_bench_serve_spawns_servers_in_turn(tmp_path, capsys):
    """--spawn: each server command is started on a free port, measured once it answers
    /health, and stopped before the next one starts (A, B, A, B with --rounds 2), each turn
    reported under its name; a command that dies, or never answers, ends in one line (exit 2)
    naming the server, with no process left behind."""
    import subprocess as sp

    from bench import bench_serve

    serve = f"{sys.executable} {ROOT / 'scripts' / 'serve.py'} --model glm-4.5-air-tiny --max-model-len 256 --port {{port}}"
    out = tmp_path / "spawn.json"
    code = bench_serve.main(["--prefix-cache-ttft", "--prefix-len", "40", "--input-len", "4", "--num-requests", "2",
                             "--warmup", "1", "--rounds", "2", "--spawn", f"a={serve}",
                             "--spawn", f"b={serve} --no-enable-prefix-caching", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert [line.split(":")[0] for line in printed.splitlines() if "pairs" in line] == ["a #1", "b #1", "a #2", "b #2"]
    results = json.loads(out.read_text())["results"]
    assert [r["prefix_cache_hits"] for r in results] == [2 * 32, 0, 2 * 32, 0]  # b: prefix caching off
    assert len({r["url"] for r in results}) == 4  # a fresh server (and port) every turn
    dead = f"bad={sys.executable} -c 'import sys; print(\"no model here {{port}}\"); sys.exit(3)'"
    assert bench_serve.main(["--prefix-cache-ttft", "--spawn", dead]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --spawn bad: the server exited (3)") and "no model here" in err[-1]
    silent = f"mute={sys.executable} -c 'import time; time.sleep(60)  # {{port}}'"
    assert bench_serve.main(["--prefix-cache-ttft", "--spawn", silent, "--spawn-timeout", "1"]) == 2
    assert "no 200 from /health within 1 s" in capsys.readouterr().err
    left = sp.run(["pgrep", "-f", "time.sleep\\(60\\)"], capture_output=True, text=True).stdout.split()
    assert not left, left


# ---- the torch backend behind the same server ------------------------------------------------
@pytest.mark.timeout(300)
def test_torch_backend_serves_the_same_greedy_tokens(tmp_path):
    """--backend torch at TP 2: the openai client gets answers, streamed and not, and greedy
    tokens equal the Paddle backend's (fp32 on CPU: the two differ by ~1e-6 of a logit)."""
    pytest.importorskip("torch")
    servers = {name: Server(2, tmp_path / f"{name}.log", ["--backend", name]) for name in ("torch", "paddle")}
    try:
        for srv in servers.values():
            srv.wait_ready()
        models = servers["torch"].client().models.list().data
        assert models[0].id == MODEL
        tokens = {name: [complete(srv, p, max_tokens=6)[1] for p in PROMPTS[:3]] for name, srv in servers.items()}
        assert tokens["torch"] == tokens["paddle"]
        chat = servers["torch"].client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=5, temperature=0)
        assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
        streamed = "".join(c.choices[0].text for c in servers["torch"].client().completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, stream=True))
        assert streamed == complete(servers["torch"], PROMPTS[0], max_tokens=6)[0]
        assert metric(servers["torch"], "fused_allreduce_calls_total") > 0
        assert metric(servers["torch"], "plain_allreduce_calls_total") == 0
        assert "backend=torch" in servers["torch"].output()
        # Stopping: /health says 503 from the moment it begins; the stop line names the signal.
        ranks = servers["torch"].ranks
        seen, took = stop_watching_health(servers["torch"], signal.SIGINT)
        assert servers["torch"].proc.returncode is not None and took < 10
        check_stop_answers_503(seen, servers["torch"].output(), "SIGINT")
        assert not any(alive(p) for p in ranks)
    finally:
        for srv in servers.values():
            srv.close()
    for srv in servers.values():
        assert not any(alive(pid) for pid in srv.ranks)


@pytest.mark.timeout(120)
def test_ipv6_loopback_and_the_url_it_prints(tmp_path):
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    srv = Server(1, tmp_path / "serve.log", host="::1")
    try:
        srv.wait_ready()
        assert f"serving 'glm-4.5-air-tiny' at http://[::1]:{srv.port}/v1 " in srv.output()  # was http://::1:PORT
        assert complete(srv, "The lighthouse", max_tokens=2)[2] == "length"
    finally:
        srv.close()
