"""``scripts/fault_check.py``: measure how the server holds up against faults and hostile input.

Starts ``scripts/serve.py`` (loopback, a free port), then measures, while one client streams
completions back to back and another polls ``/health`` every 50 ms:

1. huge requests: a 20 MB text prompt, a 20 MB chat message, a prompt of 3M token ids, and a
   body over ``--max-request-body-bytes``: the status each gets, how long it took, the
   longest wait between two tokens of the stream and the slowest ``/health`` meanwhile
   (targets: under 1 s each), and rank 0's memory before and after;
2. abandoned requests: ``--abandoned`` non-streamed requests whose clients hang up: the time
   until no request holds a slot (target: under 2 s), and until a new request is answered;
3. with ``--stop-rank``: rank 1 stopped (SIGSTOP) mid-stream: the time until ``/health``
   turns 503, until the stream gets its error, until the server has exited, and whether any
   process outlived it.

It is a measuring tool, not a test: it prints the figures (``--json`` writes them too) and
exits 0 unless the server failed to start.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import REPO, write_json

ROOT = REPO


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/fault_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="glm-4.5-air-tiny")
    p.add_argument("--backend", default="paddle", choices=["paddle", "torch"])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--prompt-mb", type=float, default=20, help="size of the huge prompts (default 20)")
    p.add_argument("--max-request-body-bytes", default="64M",
                   help="the server's body limit (default 64M: the huge prompts are read, parsed and "
                        "refused for their length; one body beyond it is refused with 413)")
    p.add_argument("--abandoned", type=int, default=32, help="non-streamed requests left by their clients")
    p.add_argument("--stop-rank", action="store_true", help="also stop rank 1 and time the watchdog")
    p.add_argument("--watchdog-timeout", type=float, default=20.0)
    p.add_argument("--server-args", default="--max-num-seqs 8 --max-model-len 256 --max-num-batched-tokens 48",
                   help="more flags for serve.py")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    return p


# ---- the server --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _rank_pid(server_pid: int, rank: int) -> int | None:
    for pid in _tree(server_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"GLM_FUSED_RANK={rank}".encode() in env and b"glm_fused.launcher" in cmd:
            return pid
    return server_pid if rank == 0 else None


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class _Server:
    def __init__(self, args):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="fault_check-", suffix=".log", delete=False)
        cmd = [sys.executable, str(ROOT / "scripts" / "serve.py"), "--model", args.model, "--backend", args.backend,
               "--tp", str(args.tp), "--port", str(self.port), "--max-request-body-bytes",
               args.max_request_body_bytes, "--watchdog-timeout", str(args.watchdog_timeout),
               *args.server_args.split()]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 300) -> None:
        import httpx

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise SystemExit(f"error: the server exited ({self.proc.returncode}); its log: {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise SystemExit(f"error: the server was not ready after {timeout:g} s; its log: {self.log.name}")

    def metric(self, name: str) -> float:
        import httpx

        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(f"glm_fused_{name} "):
                return float(line.split()[-1])
        return 0.0

    def close(self) -> None:
        pids = [self.proc.pid, *_tree(self.proc.pid)]
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


# ---- background clients ------------------------------------------------------------------
class _Streamer(threading.Thread):
    """Streams completions (back to back with ``repeat``); ``times``: when each event arrived."""

    def __init__(self, url: str, model: str, max_tokens: int = 40, repeat: bool = True):
        super().__init__(daemon=True)
        self.url, self.model, self.max_tokens, self.repeat = url, model, max_tokens, repeat
        self.times: list[float] = []
        self.last_line = ""
        self.stop = threading.Event()

    def run(self):
        import httpx

        body = {"model": self.model, "prompt": "The lighthouse", "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": True}
        while not self.stop.is_set():
            try:
                with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=300) as r:
                    for line in r.iter_lines():
                        if line:
                            self.times.append(time.monotonic())
                            if line != "data: [DONE]":
                                self.last_line = line
                        if self.stop.is_set():
                            return
            except httpx.HTTPError as exc:
                self.last_line = f"transport error: {exc!r}"
                return
            if not self.repeat:
                return

    def max_gap(self, start: float, end: float) -> float:
        inside = [start] + [t for t in self.times if start <= t <= end] + [end]
        return max(b - a for a, b in zip(inside, inside[1:]))


class _HealthPoller(threading.Thread):
    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.samples: list[tuple[float, float, object]] = []  # (sent at, latency, status)
        self.stop = threading.Event()

    def run(self):
        import httpx

        while not self.stop.is_set():
            t = time.monotonic()
            try:
                status: object = httpx.get(f"{self.url}/health", timeout=60).status_code
            except httpx.TransportError:
                status = "refused"
            self.samples.append((t, time.monotonic() - t, status))
            time.sleep(0.05)

    def slowest(self, start: float, end: float) -> float:
        return max((lat for t, lat, _ in self.samples if start <= t <= end), default=None)


# ---- the checks --------------------------------------------------------------------------
def check_huge_requests(srv: _Server, args) -> list[dict]:
    import httpx

    text = "a b " * int(args.prompt_mb * 2**20 / 4)
    cases = [
        ("text prompt", "completions", json.dumps({"model": args.model, "prompt": text, "max_tokens": 4})),
        ("chat message", "chat/completions",
         json.dumps({"model": args.model, "messages": [{"role": "user", "content": text}]})),
        ("3M token ids", "completions", json.dumps({"model": args.model, "prompt": [7] * (3 * 2**20)})),
    ]
    rank0 = _rank_pid(srv.proc.pid, 0)
    streamer, health = _Streamer(srv.url, args.model), _HealthPoller(srv.url)
    streamer.start()
    health.start()
    while len(streamer.times) < 3:
        time.sleep(0.05)
    rows = []
    for name, path, body in cases:
        data = body.encode()
        before = _rss_mb(rank0)
        start = time.monotonic()
        r = httpx.post(f"{srv.url}/v1/{path}", content=data, headers={"content-type": "application/json"},
                       timeout=300)
        end = time.monotonic()
        rows.append({"request": f"{name} ({len(data) / 2**20:.1f} MB)", "status": r.status_code,
                     "answered_s": end - start, "max_token_gap_s": streamer.max_gap(start, end),
                     "slowest_health_s": health.slowest(start, end), "rank0_rss_mb_before": before,
                     "rank0_rss_mb_after": _rss_mb(rank0), "error": r.json().get("error", {}).get("message", "")[:90]})
    # Over the body limit: announced by Content-Length, refused before it is read.
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000\r\n\r\n{")
        status = int(s.makefile("rb").readline().split()[1])
    end = time.monotonic()
    rows.append({"request": "1 GB announced", "status": status, "answered_s": end - start,
                 "max_token_gap_s": streamer.max_gap(start, end), "slowest_health_s": health.slowest(start, end),
                 "rank0_rss_mb_before": _rss_mb(rank0), "rank0_rss_mb_after": _rss_mb(rank0), "error": ""})
    streamer.stop.set()
    health.stop.set()
    streamer.join(30)
    health.join(30)
    return rows


def check_abandoned(srv: _Server, args) -> dict:
    socks = []
    for i in range(args.abandoned):
        body = json.dumps({"model": args.model, "prompt": f"story {i}", "max_tokens": 200, "ignore_eos": True}).encode()
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        socks.append(s)
    end = time.monotonic() + 60
    while srv.metric("num_requests_running") + srv.metric("num_requests_waiting") < args.abandoned:
        if time.monotonic() > end:
            break
        time.sleep(0.05)
    held = srv.metric("num_requests_running"), srv.metric("num_requests_waiting")
    start = time.monotonic()
    for s in socks:
        s.close()
    while srv.metric("num_requests_running") or srv.metric("num_requests_waiting"):
        time.sleep(0.01)
    freed = time.monotonic() - start
    import httpx

    t = time.monotonic()
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": args.model, "prompt": "next", "max_tokens": 1},
                   timeout=120)
    return {"abandoned": args.abandoned, "running_waiting_before": held, "all_freed_s": freed,
            "next_request_s": time.monotonic() - t, "next_status": r.status_code}


def check_stopped_rank(srv: _Server, args) -> dict:
    rank1 = _rank_pid(srv.proc.pid, 1)
    tree = [srv.proc.pid, *_tree(srv.proc.pid)]
    streamer, health = _Streamer(srv.url, args.model, max_tokens=200, repeat=False), _HealthPoller(srv.url)
    streamer.start()
    health.start()
    while len(streamer.times) < 3:
        time.sleep(0.05)
    start = time.monotonic()
    os.kill(rank1, signal.SIGSTOP)
    srv.proc.wait(args.watchdog_timeout + 60)
    exited = time.monotonic() - start
    health.stop.set()
    streamer.join(10)
    health.join(10)
    first_bad = next((t for t, _, status in health.samples if t >= start and status != 200), None)
    saw_503 = any(status == 503 for t, _, status in health.samples if t >= start)
    time.sleep(1)
    last = Path(srv.log.name).read_text(errors="replace").strip().splitlines()[-1]
    return {"health_not_200_s": None if first_bad is None else first_bad - start, "health_said_503": saw_503,
            "stream_error_s": (streamer.times[-1] - start) if streamer.times else None,
            "stream_last_event": streamer.last_line[:160], "server_exited_s": exited,
            "exit_line": last, "processes_left": [p for p in tree if _alive(p)]}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    srv = _Server(args)
    figures: dict = {"backend": args.backend, "tp": args.tp, "model": args.model}
    try:
        srv.wait_ready()
        print(f"server up ({args.backend}, tp {args.tp}); its log: {srv.log.name}", flush=True)
        figures["huge_requests"] = rows = check_huge_requests(srv, args)
        print("\nhuge requests, while one client streams and another polls /health every 50 ms:")
        print(f"{'request':28} {'status':>6} {'answered':>9} {'max token gap':>14} {'slowest /health':>16} "
              f"{'rank0 RSS MB':>15}  error")
        for r in rows:
            health = "-" if r["slowest_health_s"] is None else f"{r['slowest_health_s']:.3f}s"
            print(f"{r['request']:28} {r['status']:>6} {r['answered_s']:>8.2f}s {r['max_token_gap_s']:>13.3f}s "
                  f"{health:>16} {r['rank0_rss_mb_before']:>7.0f}->{r['rank0_rss_mb_after']:<7.0f}  {r['error']}")
        figures["abandoned"] = a = check_abandoned(srv, args)
        print(f"\n{a['abandoned']} abandoned non-streamed requests (running, waiting: {a['running_waiting_before']}): "
              f"all slots free {a['all_freed_s']:.3f} s after the hang-ups; the next request answered in "
              f"{a['next_request_s']:.2f} s ({a['next_status']})")
        if args.stop_rank:
            figures["stopped_rank"] = s = check_stopped_rank(srv, args)
            print(f"\nrank 1 stopped (SIGSTOP) mid-stream, --watchdog-timeout {args.watchdog_timeout:g}: /health not 200 "
                  f"after {s['health_not_200_s']:.1f} s (503 seen: {s['health_said_503']}), the stream's last event "
                  f"after {s['stream_error_s']:.1f} s, server exited after {s['server_exited_s']:.1f} s, "
                  f"processes left: {s['processes_left']}")
            print(f"  stream's last event before [DONE]: {s['stream_last_event']}")
            print(f"  server's last line:  {s['exit_line']}")
    finally:
        srv.close()
    if args.json:
        write_json(args.json, figures, indent=2)
    return 0
