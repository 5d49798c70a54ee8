"""``scripts/bench_serve.py``: load a running server (or two, side by side) with concurrent clients.

Each request streams ``/v1/completions`` with a random token-id prompt of ``--input-len``
tokens and ``ignore_eos`` so it generates exactly ``--output-len`` tokens (token-id prompts
work even on a server without a tokenizer). Reported per server and concurrency:
requests/s, output tokens/s, time to first token and time per output token (median and
p99), and beside the TPOT its bound, measured by the server in the same run: the device
time of its decode steps' forward and LM head (CUDA-graph replay at the batch sizes that
ran, with the routing these requests produced), per step, from ``/metrics``
(``engine_decode_device_seconds_total / engine_decode_steps_total``), and their ratio.
Servers are measured one after another, never at the same time.

    python scripts/bench_serve.py --url http://127.0.0.1:8000 --url http://127.0.0.1:8001
    python scripts/bench_serve.py --url http://127.0.0.1:8000 --concurrency 1,8,32,64
    python scripts/bench_serve.py --prefix-cache-ttft --rounds 2 \
        --spawn "old=python ../old/scripts/serve.py --model air20 --load-format dummy --port {port}" \
        --spawn "new=python scripts/serve.py --model air20 --load-format dummy --port {port}"

``--spawn`` starts each server itself, one at a time (A, B, A, B with ``--rounds 2``), for
servers too large to run side by side, as two builds of one model on one GPU.

From /metrics polled during each round it also reports the most requests running at once,
the peak KV-cache usage and the preemptions. Two checks for the paged KV cache:

* ``--min-running N``: exit 1 unless at least N requests ran at once (e.g. 256 clients of
  ~1,000 tokens in a cache of 262,144 positions: ``--min-running 240``);
* ``--prefix-cache-ttft``: one client sends ``--num-requests`` pairs of requests, each pair a
  fresh random prefix of ``--prefix-len`` tokens plus ``--input-len`` new tokens, first with
  the prefix uncached, then again (other new tokens) with the prefix cached; prints the median
  time to first token of both and their ratio (``--max-ttft-ratio R``: exit 1 above R), and
  beside each the device time of its request's forward steps (``/metrics``), its floor, and
  the server's own TTFT split at the request's admission to a step (waiting, then its steps),
  the rest being the HTTP path, parsing and the response.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

from bench.common import int_list, write_json
from glm_fused.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/bench_serve.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", action="append", default=None,
                   help="server base URL, e.g. http://127.0.0.1:8000 (repeat to compare servers)")
    p.add_argument("--spawn", action="append", default=None, metavar="NAME=COMMAND",
                   help="instead of --url: start the server COMMAND (with {port} where its port goes), measure "
                        "it, stop it; repeat to compare servers that cannot run at once (each turn a fresh "
                        "process; --rounds R: they take turns R times, each turn reported on its own)")
    p.add_argument("--spawn-timeout", type=float, default=900.0,
                   help="--spawn: seconds a server may take to answer /health with 200")
    p.add_argument("--label", action="append", default=None, help="column name per --url (default: from the server)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int_list, default=[8],
                   help="clients sending at once; a list (1,8,64) measures each in turn")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=32, help="generated tokens per request")
    p.add_argument("--warmup", type=int, default=2, help="requests sent (one at a time) before measuring")
    p.add_argument("--rounds", type=int, default=1,
                   help="servers take turns this many times; samples are pooled per server")
    p.add_argument("--vocab-limit", type=int, default=900,
                   help="prompt ids are drawn from 0..N-1 (ordinary tokens of any GLM vocabulary)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the random prompts (default: new ones each run, so that a server's prefix "
                        "cache holds none of them from an earlier run)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--min-running", type=int, default=None,
                   help="exit 1 unless at least this many requests ran at once (read from /metrics)")
    p.add_argument("--prefix-cache-ttft", action="store_true",
                   help="measure time to first token with a cached vs an uncached prefix (see above)")
    p.add_argument("--prefix-len", type=int, default=2048, help="--prefix-cache-ttft: shared prefix tokens")
    p.add_argument("--max-ttft-ratio", type=float, default=None,
                   help="--prefix-cache-ttft: exit 1 if cached / uncached median TTFT is above this")
    return p


async def _one(client, url: str, model: str, prompt: list[int], args) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "return_token_ids": True}).encode()
    start = time.perf_counter()  # the body is encoded: its time is the client's, not the server's
    first = last = None
    tokens = 0
    async with client.post(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            text = (await resp.read()).decode(errors="replace")
            raise RuntimeError(f"{url}: HTTP {resp.status}: {text[:300]}")
        async for raw in resp.content:  # one line at a time
            if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(raw[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error'].get('message')}")
            n = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
            if n:
                now = time.perf_counter()
                first = first or now
                last = now
                tokens += n
    end = time.perf_counter()
    return {"ttft": (first or end) - start, "tpot": (last - first) / (tokens - 1) if tokens > 1 else None,
            "tokens": tokens, "latency": end - start}


async def _model_card(client, url: str) -> dict:
    async with client.get(f"{url}/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]


# The server copies the engine's counters into /metrics between steps, so a response can
# arrive before the step that produced it is counted: read the last sample after a pause.
METRICS_SETTLE_S = 0.5


async def _metrics(client, url: str) -> dict[str, float]:
    """The server's Prometheus samples summed over labels, by name without the project prefix."""
    from prometheus_client.parser import text_string_to_metric_families

    async with client.get(f"{url}/metrics") as resp:
        if resp.status != 200:
            return {}
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.split(":", 1)[-1].removeprefix("glm_fused_")
            out[name] = out.get(name, 0.0) + sample.value
    return out


class MetricsWatch:
    """Polls /metrics while a round runs: the most requests running at once, the peak KV-cache
    usage, and counter differences (preemptions, prefix-cache lookups, decode steps and their
    device time, which give the TPOT bound)."""

    def __init__(self, client, url: str, every_s: float = 0.1):
        self.client, self.url, self.every_s = client, url, every_s
        self.peak_running = self.peak_usage = 0.0
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self._stop = asyncio.Event()

    async def poll(self) -> None:
        while True:
            sample = await _metrics(self.client, self.url)
            self.first = self.first or sample
            self.last = sample or self.last
            self.peak_running = max(self.peak_running, sample.get("num_requests_running", 0.0))
            self.peak_usage = max(self.peak_usage, sample.get("kv_cache_usage_perc", 0.0))
            if self._stop.is_set():
                return
            try:
                await asyncio.wait_for(self._stop.wait(), self.every_s)
            except asyncio.TimeoutError:
                pass

    def stop(self) -> None:
        self._stop.set()

    def result(self) -> dict:
        def delta(name):
            return self.last.get(name, 0.0) - self.first.get(name, 0.0)

        has_bound = "engine_decode_steps_total" in self.last
        return {"peak_running": int(self.peak_running), "peak_kv_usage": self.peak_usage,
                "preemptions": int(delta("num_preemptions_total")),
                "prefix_cache_hits": int(delta("prefix_cache_hits_total")),
                "prefix_cache_queries": int(delta("prefix_cache_queries_total")),
                "decode": (delta("engine_decode_steps_total"), delta("engine_decode_device_seconds_total"))
                if has_bound else None}


def _client(args, connections: int, timeout: float | None = None):
    """aiohttp, as vLLM's serving benchmark: its time per streamed request is a fraction of
    httpx's (a cached 2,080-token request's TTFT on two CPU cores: 37 ms, 44 ms through httpx),
    and a TTFT measured here should be the server's, not the client's."""
    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout or args.timeout),
                                 connector=aiohttp.TCPConnector(limit=connections + 2))


async def run_round(url: str, args, warmup: list[list[int]], prompts: list[list[int]]) -> tuple[list[dict], float,
                                                                                                dict]:
    """The warm-up prompts one at a time, then the measured ones from --concurrency clients
    (with /metrics watched meanwhile)."""
    async with _client(args, args.concurrency) as client:
        model = (await _model_card(client, url))["id"]
        for prompt in warmup:
            await _one(client, url, model, prompt, args)
        todo: asyncio.Queue = asyncio.Queue()
        for prompt in prompts:
            todo.put_nowait(prompt)
        results: list[dict] = []

        async def client_loop():
            while not todo.empty():
                results.append(await _one(client, url, model, todo.get_nowait(), args))

        watch = MetricsWatch(client, url)
        poller = asyncio.create_task(watch.poll())
        start = time.perf_counter()
        await asyncio.gather(*[client_loop() for _ in range(args.concurrency)])
        wall = time.perf_counter() - start
        await asyncio.sleep(METRICS_SETTLE_S)
        watch.stop()
        await poller
        return results, wall, watch.result()


async def prefix_cache_round(url: str, args, rng: np.random.Generator) -> dict:
    """Pairs of one-token requests: a fresh prefix uncached, then the same prefix cached."""
    one_token = argparse.Namespace(**{**vars(args), "output_len": 1})

    def draw(n):
        return rng.integers(0, args.vocab_limit, size=n).tolist()

    async with _client(args, 1) as client:
        model = (await _model_card(client, url))["id"]
        for _ in range(args.warmup):
            await _one(client, url, model, draw(args.prefix_len + args.input_len), one_token)
        before = marks = await _metrics(client, url)
        uncached, cached = [], []
        # Per request, from the server's counters: its steps as the device ran them, and its
        # first token's time as the server saw it, split at its admission to a step (s).
        series = {"device": "engine_device_seconds_total", "server_ttft": "time_to_first_token_seconds_sum",
                  "queue": "request_queue_time_seconds_sum", "prefill": "request_prefill_time_seconds_sum"}
        per = {key: {"uncached": [], "cached": []} for key in series}
        for _ in range(args.num_requests):
            prefix = draw(args.prefix_len)
            for name, times in (("uncached", uncached), ("cached", cached)):
                times.append((await _one(client, url, model, prefix + draw(args.input_len), one_token))["ttft"])
                await asyncio.sleep(METRICS_SETTLE_S)
                after = await _metrics(client, url)
                for key, metric in series.items():
                    if metric in after:
                        per[key][name].append(after[metric] - marks.get(metric, 0.0))
                marks = after
    u, c = float(np.median(uncached)) * 1e3, float(np.median(cached)) * 1e3
    hits = marks.get("prefix_cache_hits_total", 0.0) - before.get("prefix_cache_hits_total", 0.0)
    out = {"url": url, "model": model, "pairs": args.num_requests, "prefix_len": args.prefix_len,
           "new_len": args.input_len, "ttft_uncached_median_ms": u, "ttft_cached_median_ms": c,
           "ratio": c / u if u else None, "ttft_uncached_ms": [t * 1e3 for t in uncached],
           "ttft_cached_ms": [t * 1e3 for t in cached], "prefix_cache_hits": int(hits)}
    device = per["device"]
    if all(device.values()) and min(min(t) for t in device.values()) > 0:
        # The floor of each TTFT: its request's forward steps as the device ran them; a TTFT
        # near its floor leaves only the forward itself to make faster.
        out.update({f"device_{name}_median_ms": float(np.median(t)) * 1e3 for name, t in device.items()})
    for key in ("server_ttft", "queue", "prefill"):  # where the rest goes (servers that export them)
        if all(len(t) == args.num_requests for t in per[key].values()):
            out.update({f"{key}_{name}_median_ms": float(np.median(t)) * 1e3 for name, t in per[key].items()})
    return out


async def server_card(url: str, args) -> dict:
    async with _client(args, 1, timeout=30) as client:
        return await _model_card(client, url)


def summarize(url: str, card: dict, results: list[dict], wall: float, concurrency: int,
              watched: list[dict]) -> dict:
    """``watched``: what /metrics showed during each measured round (MetricsWatch.result)."""
    decoded = [w["decode"] for w in watched]
    decode = None if any(d is None for d in decoded) else (sum(d[0] for d in decoded), sum(d[1] for d in decoded))
    ttft = np.array([r["ttft"] for r in results]) * 1e3
    tpot = np.array([r["tpot"] for r in results if r["tpot"] is not None]) * 1e3
    out_tokens = sum(r["tokens"] for r in results)
    bound = decode[1] / decode[0] * 1e3 if decode and decode[0] else None
    median = float(np.median(tpot)) if len(tpot) else None
    return {
        "url": url, "model": card["id"], "server": card.get("glm_fused", {}), "concurrency": concurrency,
        "tpot_bound_ms": bound, "tpot_over_bound": median / bound if bound and median else None,
        "decode_steps": decode[0] if decode else None,
        "peak_running": max(w["peak_running"] for w in watched),
        "peak_kv_usage": max(w["peak_kv_usage"] for w in watched),
        "preemptions": sum(w["preemptions"] for w in watched),
        "prefix_cache_hits": sum(w["prefix_cache_hits"] for w in watched),
        "requests": len(results), "wall_s": wall,
        "requests_per_s": len(results) / wall, "output_tokens_per_s": out_tokens / wall,
        "ttft_median_ms": float(np.median(ttft)), "ttft_p99_ms": float(np.percentile(ttft, 99)),
        "tpot_median_ms": median,
        "tpot_p99_ms": float(np.percentile(tpot, 99)) if len(tpot) else None,
        "output_tokens": out_tokens,
    }


def bench(urls: list[str], args) -> list[dict]:
    """Every server gets the same prompts, at each concurrency. With --rounds R, servers take
    turns R times (A B A B ...) and each one's samples are pooled, so a slow spell on a shared
    machine hits both sides alike. Each concurrency and round draws new prompts: a prompt sent
    again would be served from the prefix cache (its time to first token would measure the
    cache, not the prefill)."""
    rng = np.random.default_rng(args.seed)

    def draw(n: int) -> list[list[int]]:
        return [rng.integers(0, args.vocab_limit, size=args.input_len).tolist() for _ in range(n)]

    first_warmup = draw(args.warmup)
    cards = [asyncio.run(server_card(url, args)) for url in urls]
    out = []
    for concurrency in args.concurrency:
        run_args = argparse.Namespace(**{**vars(args), "concurrency": concurrency})
        samples: list[list[dict]] = [[] for _ in urls]
        walls = [0.0] * len(urls)
        watched: list[list[dict]] = [[] for _ in urls]
        for r in range(args.rounds):
            prompts = draw(args.num_requests)
            for i, url in enumerate(urls):
                print(f"round {r + 1}/{args.rounds}: {url}: {args.num_requests} requests, concurrency "
                      f"{concurrency}, {args.input_len} in / {args.output_len} out tokens",
                      file=sys.stderr, flush=True)
                warmup = first_warmup if r == 0 and concurrency == args.concurrency[0] else []
                results, wall, watch = asyncio.run(run_round(url, run_args, warmup, prompts))
                samples[i] += results
                walls[i] += wall
                watched[i].append(watch)
        out += [summarize(url, card, s, w, concurrency, m)
                for url, card, s, w, m in zip(urls, cards, samples, walls, watched)]
    return out


def _label(result: dict, several: bool) -> str:
    info = result["server"]
    name = result["url"] if not info else (
        f"tp{info.get('tp')} {info.get('layout')}" + (f" ({info['fusion']})" if info.get("layout") == "fused" else ""))
    return f"{name} c={result['concurrency']}" if several else name


def format_table(results: list[dict], labels: list[str]) -> str:
    rows = [("requests/s", "requests_per_s", "{:.2f}"), ("output tokens/s", "output_tokens_per_s", "{:.1f}"),
            ("TTFT median (ms)", "ttft_median_ms", "{:.1f}"), ("TTFT p99 (ms)", "ttft_p99_ms", "{:.1f}"),
            ("TPOT median (ms)", "tpot_median_ms", "{:.2f}"), ("TPOT p99 (ms)", "tpot_p99_ms", "{:.2f}"),
            ("TPOT bound (ms)", "tpot_bound_ms", "{:.2f}"), ("TPOT / bound", "tpot_over_bound", "{:.3f}"),
            ("most running", "peak_running", "{:d}"), ("peak KV usage", "peak_kv_usage", "{:.1%}"),
            ("preemptions", "preemptions", "{:d}"), ("prefix-cache hits", "prefix_cache_hits", "{:d}")]
    width = max(18, *(len(lb) + 2 for lb in labels))
    lines = ["".ljust(18) + "".join(lb.rjust(width) for lb in labels)]
    for name, key, fmt in rows:
        cells = ["-" if r[key] is None else fmt.format(r[key]) for r in results]
        lines.append(name.ljust(18) + "".join(c.rjust(width) for c in cells))
    if len(results) == 2 and results[0]["output_tokens_per_s"] and results[0]["concurrency"] == results[1]["concurrency"]:
        ratio = results[1]["output_tokens_per_s"] / results[0]["output_tokens_per_s"]
        lines.append(f"output tokens/s, {labels[1]} / {labels[0]}: {ratio:.3f}x")
    return "\n".join(lines)


def format_prefix_table(results: list[dict], labels: list[str]) -> str:
    lines = []
    for r, label in zip(results, labels):
        lines.append(f"{label}: {r['pairs']} pairs, prefix {r['prefix_len']} + {r['new_len']} new tokens: "
                     f"TTFT median uncached {r['ttft_uncached_median_ms']:.1f} ms, cached "
                     f"{r['ttft_cached_median_ms']:.1f} ms, cached / uncached {r['ratio']:.3f}x "
                     f"(prefix-cache hits {r['prefix_cache_hits']} tokens)")
        if "device_cached_median_ms" in r:
            dc, du = r["device_cached_median_ms"], r["device_uncached_median_ms"]
            lines.append(f"  the requests' forward steps on the device: uncached {du:.1f} ms, cached {dc:.1f} ms; "
                         f"TTFT / device time: uncached {r['ttft_uncached_median_ms'] / du:.3f}x, cached "
                         f"{r['ttft_cached_median_ms'] / dc:.3f}x")
        if "server_ttft_cached_median_ms" in r and "queue_cached_median_ms" in r:
            for name in ("uncached", "cached"):
                ttft, server = r[f"ttft_{name}_median_ms"], r[f"server_ttft_{name}_median_ms"]
                lines.append(f"  {name}, medians: the server's TTFT {server:.2f} ms = waiting to be admitted "
                             f"{r[f'queue_{name}_median_ms']:.2f} + admitted to first token "
                             f"{r[f'prefill_{name}_median_ms']:.2f}; outside it (HTTP, parsing, the response) "
                             f"{ttft - server:.2f} ms")
    return "\n".join(lines)


def parse_spawn(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        name, sep, command = item.partition("=")
        name = name.strip()
        if not sep or not name or not command.strip():
            raise UserError(f"--spawn {item!r}: NAME=COMMAND")
        if "{port}" not in command:
            raise UserError(f"--spawn {name}: the command must put the server's port where {{port}} stands")
        if name in (n for n, _ in out):
            raise UserError(f"--spawn {name}: the name is given twice")
        try:
            shlex.split(command)
        except ValueError as exc:  # an unclosed quote
            raise UserError(f"--spawn {name}: {exc}") from None
        out.append((name, command))
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def spawned(name: str, command: str, timeout_s: float):
    """The server ``command`` started with a free port in its own process group, its URL once
    /health answers 200; stopped (SIGTERM, then SIGKILL after 30 s) on the way out."""
    port = _free_port()
    log = tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen(shlex.split(command.replace("{port}", str(port))), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        log.close()
        raise UserError(f"--spawn {name}: {exc}") from None

    def last_line() -> str:
        log.seek(0)
        lines = [ln for ln in log.read().decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1].strip() if lines else "(no output)"

    url, start = f"http://127.0.0.1:{port}", time.monotonic()
    try:
        while True:
            if proc.poll() is not None:
                raise UserError(f"--spawn {name}: the server exited ({proc.returncode}) before it answered "
                                f"/health: {last_line()}")
            if time.monotonic() - start > timeout_s:
                raise UserError(f"--spawn {name}: no 200 from /health within {timeout_s:.0f} s "
                                f"(--spawn-timeout): {last_line()}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:  # not listening yet, or 503 while loading
                pass
            time.sleep(0.5)
        print(f"{name}: answering after {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def measure_spawned(spawns: list[tuple[str, str]], args) -> tuple[list[dict], list[str]]:
    """Each server in turn, --rounds times: started, measured, stopped. Every turn is a result
    of its own (labelled NAME #turn), the same prompts for every turn of the throughput
    benchmark (each server starts with an empty prefix cache), new prefixes each pair with
    --prefix-cache-ttft."""
    rng = np.random.default_rng(args.seed)
    one_round = argparse.Namespace(**{**vars(args), "rounds": 1})
    results, labels = [], []
    several = len(args.concurrency) > 1
    for r in range(args.rounds):
        for name, command in spawns:
            with spawned(name, command, args.spawn_timeout) as url:
                if args.prefix_cache_ttft:
                    got = [asyncio.run(prefix_cache_round(url, args, rng))]
                else:
                    got = bench([url], one_round)
            results += got
            labels += [f"{name} #{r + 1}" + (f" c={g['concurrency']}" if several else "") for g in got]
    return results, labels


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if bool(args.url) == bool(args.spawn):
            raise UserError("give the servers as --url (running) or as --spawn (started here), one of the two")
        if args.spawn and args.label:
            raise UserError("--label: with --spawn the names label the columns")
        spawns = parse_spawn(args.spawn) if args.spawn else None
        if args.label and len(args.label) != len(args.url):
            raise UserError("--label: give one per --url")
        for name in ("num_requests", "input_len", "output_len", "rounds", "prefix_len"):
            if getattr(args, name) < 1:
                raise UserError(f"--{name.replace('_', '-')}: must be at least 1")
        if not args.concurrency or min(args.concurrency) < 1:
            raise UserError("--concurrency: give positive numbers (1 or 1,8,64)")
        urls = [url.rstrip("/") for url in args.url or ()]
        if args.seed is None:  # drawn here, so that the JSON report says which prompts were sent
            args.seed = int(np.random.SeedSequence().entropy % 2**32)
        labels = args.label
        where = "--spawn" if spawns else "--url"  # what a connection error names
        try:
            if spawns:
                results, labels = measure_spawned(spawns, args)
            elif args.prefix_cache_ttft:
                rng = np.random.default_rng(args.seed)
                results = [asyncio.run(prefix_cache_round(url, args, rng)) for url in urls]
            else:
                results = bench(urls, args)
        except (OSError, RuntimeError) as exc:
            raise UserError(f"{where}: {exc}") from None
        except Exception as exc:  # aiohttp's connection and status errors
            if type(exc).__module__.startswith("aiohttp"):
                raise UserError(f"{where}: {type(exc).__name__}: {exc}") from None
            raise
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results}, indent=2)
    if args.prefix_cache_ttft:
        print(format_prefix_table(results, labels or [r["url"] for r in results]))
        if args.max_ttft_ratio is not None and any(r["ratio"] > args.max_ttft_ratio for r in results):
            print(f"FAILED: cached / uncached TTFT above --max-ttft-ratio {args.max_ttft_ratio}", file=sys.stderr)
            return 1
        return 0
    several = len(args.concurrency) > 1
    if not spawns:
        labels = ([f"{lb} c={c}" if several else lb for c in args.concurrency for lb in args.label] if args.label
                  else [_label(r, several) for r in results])
    print(format_table(results, labels))
    if args.min_running is not None and any(r["peak_running"] < args.min_running for r in results):
        print(f"FAILED: fewer than --min-running {args.min_running} requests ran at once", file=sys.stderr)
        return 1
    return 0
