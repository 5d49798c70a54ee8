"""Server metrics in the Prometheus text format (no client library needed).

Updated by the engine thread, rendered by the HTTP thread: one lock guards all of them.
"""

from __future__ import annotations

import bisect
import threading

PREFIX = "glm_fused_"
# Latency buckets in seconds: CPU toy models and GPU decode steps both land inside.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


def _labels(key: tuple[tuple[str, str], ...]) -> str:
    if not key:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in key) + "}"


def _num(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str):
        self.name, self.help = PREFIX + name, help
        self.values: dict[tuple, float] = {}

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def inc(self, amount: float = 1, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0) + amount

    def lines(self) -> list[str]:
        values = self.values or {(): 0}
        return self.header() + [f"{self.name}{_labels(k)} {_num(v)}" for k, v in sorted(values.items())]


class Gauge(_Metric):
    kind = "gauge"

    def set(self, value: float) -> None:
        self.values[()] = value

    def lines(self) -> list[str]:
        return self.header() + [f"{self.name} {_num(self.values.get((), 0))}"]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets=LATENCY_BUCKETS):
        super().__init__(name, help)
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last: above every bucket
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self) -> list[str]:
        out, running = self.header(), 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            out.append(f'{self.name}_bucket{{le="{bound}"}} {running}')
        out.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{self.name}_sum {_num(self.sum)}")
        out.append(f"{self.name}_count {self.count}")
        return out


class ServerMetrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = Counter("requests_total", "Finished requests, by finish reason.")
        self.errors = Counter("request_errors_total", "Requests refused before running, by HTTP status.")
        self.prompt_tokens = Counter("prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generation_tokens = Counter("generation_tokens_total", "Generated tokens.")
        self.ttft = Histogram("time_to_first_token_seconds", "Arrival to first generated token.")
        self.tpot = Histogram("time_per_output_token_seconds",
                              "Per request: (last token - first token) / (generated tokens - 1).")
        self.e2e = Histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self.running = Gauge("num_requests_running", "Requests running (holding KV-cache blocks).")
        self.waiting = Gauge("num_requests_waiting", "Requests waiting (new, or preempted to be recomputed).")
        self.steps = Counter("engine_steps_total", "Model forwards run by the engine.")
        self.step_tokens = Counter("engine_step_tokens_total", "Tokens fed to the model over all forwards.")
        self.forward_seconds = Counter("engine_forward_seconds_total", "Time in model forwards (rank 0).")
        self.kv_usage = Gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (0 to 1).")
        self.prefix_queries = Counter("prefix_cache_queries_total",
                                      "Tokens of admitted requests looked up in the prefix cache.")
        self.prefix_hits = Counter("prefix_cache_hits_total", "Tokens of admitted requests found in the prefix cache.")
        self.preemptions = Counter("num_preemptions_total", "Requests preempted (KV blocks given back, recomputed).")
        self.fusion = Counter("allreduce_calls_total",
                              "All-reduces on rank 0, by kind (fused with residual + RMSNorm, or plain) "
                              "and implementation.")

    # ---- updates (engine thread) -----------------------------------------------------------
    def on_admitted(self, prompt_tokens: int) -> None:
        with self.lock:
            self.prompt_tokens.inc(prompt_tokens)

    def on_tokens(self, n: int) -> None:
        with self.lock:
            self.generation_tokens.inc(n)

    def on_first_token(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def on_finished(self, reason: str, e2e: float, tpot: float | None) -> None:
        with self.lock:
            self.requests.inc(finish_reason=reason)
            self.e2e.observe(e2e)
            if tpot is not None:
                self.tpot.observe(tpot)

    def on_error(self, status: int) -> None:
        with self.lock:
            self.errors.inc(status=str(status))

    def on_engine(self, engine) -> None:
        """Copy the engine's gauges and running totals."""
        with self.lock:
            self.running.set(engine.num_running)
            self.waiting.set(engine.num_waiting)
            self.steps.values[()] = engine.num_steps
            self.step_tokens.values[()] = engine.num_forward_tokens
            self.forward_seconds.values[()] = round(engine.forward_seconds, 6)
            kv = engine.kv_cache_stats()
            self.kv_usage.set(kv["usage"])
            self.prefix_queries.values[()] = kv["prefix_cache_queries"]
            self.prefix_hits.values[()] = kv["prefix_cache_hits"]
            self.preemptions.values[()] = kv["num_preemptions"]
            for key, total in engine.fusion_totals.items():
                kind, _, impl = key.partition(":")
                labels = {"kind": kind} if not impl else {"kind": kind, "impl": impl}
                self.fusion.values[tuple(sorted(labels.items()))] = total

    # ---- exposition (HTTP thread) ----------------------------------------------------------
    def render(self) -> str:
        with self.lock:
            lines: list[str] = []
            for metric in (self.requests, self.errors, self.prompt_tokens, self.generation_tokens, self.ttft,
                           self.tpot, self.e2e, self.running, self.waiting, self.steps, self.step_tokens,
                           self.forward_seconds, self.kv_usage, self.prefix_queries, self.prefix_hits,
                           self.preemptions, self.fusion):
                lines.extend(metric.lines())
            return "\n".join(lines) + "\n"
