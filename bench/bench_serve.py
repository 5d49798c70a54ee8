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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import numpy as np

from bench.common import int_list, write_json
from glm_fused.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/bench_serve.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", action="append", required=True,
                   help="server base URL, e.g. http://127.0.0.1:8000 (repeat to compare servers)")
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p


async def _one(client, url: str, model: str, prompt: list[int], args) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {text[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
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
    resp = await client.get(f"{url}/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]


async def run_round(url: str, args, warmup: list[list[int]], prompts: list[list[int]]) -> tuple[list[dict], float]:
    """The warm-up prompts one at a time, then the measured ones from --concurrency clients."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 2)
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as client:
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

        start = time.perf_counter()
        await asyncio.gather(*[client_loop() for _ in range(args.concurrency)])
        return results, time.perf_counter() - start


async def decode_totals(url: str, args) -> tuple[float, float] | None:
    """(decode steps, their device seconds) from the server's /metrics; None if it has none."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=30, headers=headers) as client:
        resp = await client.get(f"{url}/metrics")
    if resp.status_code != 200:
        return None
    found = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            if sample.name.endswith(("engine_decode_steps_total", "engine_decode_device_seconds_total")):
                found[sample.name.rsplit(":", 1)[-1]] = sample.value
    if len(found) < 2:
        return None
    return found["engine_decode_steps_total"], found["engine_decode_device_seconds_total"]


async def server_card(url: str, args) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=30, headers=headers) as client:
        return await _model_card(client, url)


def summarize(url: str, card: dict, results: list[dict], wall: float, concurrency: int,
              decode: tuple[float, float] | None = None) -> dict:
    """``decode``: (decode steps, device seconds) the server ran during the measured requests."""
    ttft = np.array([r["ttft"] for r in results]) * 1e3
    tpot = np.array([r["tpot"] for r in results if r["tpot"] is not None]) * 1e3
    out_tokens = sum(r["tokens"] for r in results)
    bound = decode[1] / decode[0] * 1e3 if decode and decode[0] else None
    median = float(np.median(tpot)) if len(tpot) else None
    return {
        "url": url, "model": card["id"], "server": card.get("glm_fused", {}), "concurrency": concurrency,
        "tpot_bound_ms": bound, "tpot_over_bound": median / bound if bound and median else None,
        "decode_steps": decode[0] if decode else None,
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
    machine hits both sides alike."""
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, args.vocab_limit, size=args.input_len).tolist()
               for _ in range(args.num_requests + args.warmup)]
    cards = [asyncio.run(server_card(url, args)) for url in urls]
    out = []
    for concurrency in args.concurrency:
        run_args = argparse.Namespace(**{**vars(args), "concurrency": concurrency})
        samples: list[list[dict]] = [[] for _ in urls]
        walls = [0.0] * len(urls)
        decode: list[list[float] | None] = [[0.0, 0.0] for _ in urls]
        for r in range(args.rounds):
            for i, url in enumerate(urls):
                print(f"round {r + 1}/{args.rounds}: {url}: {args.num_requests} requests, concurrency "
                      f"{concurrency}, {args.input_len} in / {args.output_len} out tokens",
                      file=sys.stderr, flush=True)
                warmup = prompts[:args.warmup] if r == 0 and concurrency == args.concurrency[0] else []
                if warmup:
                    asyncio.run(run_round(url, run_args, warmup, []))
                before = asyncio.run(decode_totals(url, args))
                results, wall = asyncio.run(run_round(url, run_args, [], prompts[args.warmup:]))
                after = asyncio.run(decode_totals(url, args))
                samples[i] += results
                walls[i] += wall
                if before is None or after is None or decode[i] is None:
                    decode[i] = None
                else:
                    decode[i] = [decode[i][0] + after[0] - before[0], decode[i][1] + after[1] - before[1]]
        out += [summarize(url, card, s, w, concurrency, d)
                for url, card, s, w, d in zip(urls, cards, samples, walls, decode)]
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
            ("TPOT bound (ms)", "tpot_bound_ms", "{:.2f}"), ("TPOT / bound", "tpot_over_bound", "{:.3f}")]
    width = max(18, *(len(lb) + 2 for lb in labels))
    lines = ["".ljust(18) + "".join(lb.rjust(width) for lb in labels)]
    for name, key, fmt in rows:
        cells = ["-" if r[key] is None else fmt.format(r[key]) for r in results]
        lines.append(name.ljust(18) + "".join(c.rjust(width) for c in cells))
    if len(results) == 2 and results[0]["output_tokens_per_s"] and results[0]["concurrency"] == results[1]["concurrency"]:
        ratio = results[1]["output_tokens_per_s"] / results[0]["output_tokens_per_s"]
        lines.append(f"output tokens/s, {labels[1]} / {labels[0]}: {ratio:.3f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.label and len(args.label) != len(args.url):
            raise UserError("--label: give one per --url")
        for name in ("num_requests", "input_len", "output_len", "rounds"):
            if getattr(args, name) < 1:
                raise UserError(f"--{name.replace('_', '-')}: must be at least 1")
        if not args.concurrency or min(args.concurrency) < 1:
            raise UserError("--concurrency: give positive numbers (1 or 1,8,64)")
        urls = [url.rstrip("/") for url in args.url]
        try:
            results = bench(urls, args)
        except (OSError, RuntimeError) as exc:
            raise UserError(f"--url: {exc}") from None
        except Exception as exc:  # httpx's connection and status errors
            if type(exc).__module__.startswith("httpx"):
                raise UserError(f"--url: {type(exc).__name__}: {exc}") from None
            raise
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    several = len(args.concurrency) > 1
    labels = ([f"{lb} c={c}" if several else lb for c in args.concurrency for lb in args.label] if args.label
              else [_label(r, several) for r in results])
    print(format_table(results, labels))
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results}, indent=2)
    return 0
