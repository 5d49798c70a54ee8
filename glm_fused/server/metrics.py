"""Server metrics for Prometheus, through ``prometheus_client`` (names, types and escaping of
label values are its business: a fallback reason holding quotes or newlines is a valid label).

Names follow vLLM's under this project's prefix (``vllm:num_requests_running`` ->
``glm_fused:num_requests_running``), every series labelled ``model_name``:

* ``num_requests_running`` / ``num_requests_waiting`` / ``kv_cache_usage_perc`` (gauges;
  KV usage = the fraction of the paged KV cache's blocks held by requests);
* ``prompt_tokens_total``, ``generation_tokens_total``, ``request_success_total{finished_reason}``;
* histograms ``time_to_first_token_seconds``, ``request_time_per_output_token_seconds``
  (per request: (last token - first token) / (tokens - 1)), ``e2e_request_latency_seconds``;
* this server's own: ``request_errors_total{status}`` (refused before running),
  ``engine_steps_total``, ``engine_step_tokens_total``, ``engine_forward_seconds_total``,
  and rank 0's all-reduces: ``fused_allreduce_calls_total{impl}`` (fused with residual-add +
  RMSNorm, by implementation), ``plain_allreduce_calls_total`` (zero in the fused layout),
  ``fused_allreduce_fallbacks_total{reason}`` (calls that fell back to the reference).

Request events arrive from the engine thread; ``render`` runs on the HTTP thread. The
engine's running totals are copied by ``on_engine`` and read at scrape time.
"""

from __future__ import annotations

import threading

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

PREFIX = "glm_fused:"
# Latency buckets in seconds: CPU toy models and GPU decode steps both land inside.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = LATENCY_BUCKETS[LATENCY_BUCKETS.index(0.25):] + (160.0, 320.0, 640.0, 1280.0, 2560.0)


class _EngineTotals:
    """The engine's running totals, as counters read at scrape time (they are copied, not
    incremented, so a custom collector rather than ``Counter`` objects)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.lock = threading.Lock()
        self.steps = self.step_tokens = self.decode_steps = 0
        self.prefix_queries = self.prefix_hits = self.preemptions = 0
        self.forward_seconds = self.decode_device_seconds = self.device_seconds = 0.0
        self.fused_by_impl: dict[str, int] = {}
        self.plain = 0
        self.fallbacks: dict[str, int] = {}

    def collect(self):
        with self.lock:
            scalars = [("engine_steps", "Model forwards run by the engine.", self.steps),
                       ("engine_step_tokens", "Tokens fed to the model over all forwards.", self.step_tokens),
                       ("engine_forward_seconds", "Time rank 0's engine spent launching forwards and "
                                                  "waiting for their tokens.", self.forward_seconds),
                       ("engine_decode_steps", "Steps in which every sequence decoded one token.", self.decode_steps),
                       ("prefix_cache_queries", "Tokens of admitted requests looked up in the prefix cache.",
                        self.prefix_queries),
                       ("prefix_cache_hits", "Tokens of admitted requests found in the prefix cache.", self.prefix_hits),
                       ("num_preemptions", "Requests preempted (KV blocks given back, recomputed).", self.preemptions),
                       ("engine_decode_device_seconds", "Device time of those steps' forward and LM head "
                                                        "(the bound of the time per output token).",
                        self.decode_device_seconds),
                       ("engine_device_seconds", "Device time of every step's forward and LM head.",
                        self.device_seconds),
                       ("plain_allreduce_calls", "Plain all-reduces on rank 0 (zero in the fused layout).",
                        self.plain)]
            labelled = [("fused_allreduce_calls", "Fused all-reduce + residual-add + RMSNorm calls on rank 0, "
                                                  "by implementation.", "impl", dict(self.fused_by_impl)),
                        ("fused_allreduce_fallbacks", "Fused calls that fell back to the reference "
                                                      "implementation, by reason.", "reason", dict(self.fallbacks))]
        for name, doc, value in scalars:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        for name, doc, label, values in labelled:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", label])
            for key, value in sorted(values.items()):
                family.add_metric([self.model_name, key], value)
            yield family


class ServerMetrics:
    """The server's metrics in a registry of their own (several servers in one process, as in
    tests, never share series). ``model_name``: the served model name (the label)."""

    def __init__(self, model_name: str = "glm_fused"):
        # vLLM's choice too: no ``*_created`` timestamp series beside every counter.
        prometheus_client.disable_created_metrics()
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)

        def make(kind, name, doc, extra=(), **kwargs):
            metric = kind(PREFIX + name, doc, labelnames=["model_name", *extra], registry=self.registry, **kwargs)
            return metric if extra else metric.labels(model_name)

        self.running = make(Gauge, "num_requests_running", "Requests running (holding KV-cache blocks).")
        self.waiting = make(Gauge, "num_requests_waiting", "Requests waiting (new, or preempted to be recomputed).")
        self.kv_usage = make(Gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (0 to 1).")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = make(Counter, "generation_tokens", "Generated tokens.")
        self._success = make(Counter, "request_success", "Finished requests, by finish reason.",
                             extra=["finished_reason"])
        self._errors = make(Counter, "request_errors",
                            "Requests answered with an error, by HTTP status (499: the client hung up first).",
                            extra=["status"])
        self.ttft = make(Histogram, "time_to_first_token_seconds", "Arrival to first generated token.",
                         buckets=LATENCY_BUCKETS)
        self.tpot = make(Histogram, "request_time_per_output_token_seconds",
                         "Per request: (last token - first token) / (generated tokens - 1).",
                         buckets=LATENCY_BUCKETS)
        self.e2e = make(Histogram, "e2e_request_latency_seconds", "Arrival to finish.", buckets=E2E_BUCKETS)
        # The first token's time in two parts (vLLM's names): waiting to be admitted to a step,
        # then the prompt's steps up to the first token.
        self.queue_time = make(Histogram, "request_queue_time_seconds", "Arrival to first admitted to a step.",
                               buckets=LATENCY_BUCKETS)
        self.prefill_time = make(Histogram, "request_prefill_time_seconds",
                                 "First admitted to a step to first generated token.", buckets=LATENCY_BUCKETS)
        self._engine = _EngineTotals(model_name)
        self.registry.register(self._engine)

    # ---- updates (engine thread) -----------------------------------------------------------
    def on_admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def on_tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)

    def on_first_token(self, seconds: float, queued: float | None = None) -> None:
        """``seconds``: arrival to first token; ``queued``: how long of it the request waited
        to be admitted to a step (None: not known, only the TTFT is observed)."""
        self.ttft.observe(seconds)
        if queued is not None:
            self.queue_time.observe(queued)
            self.prefill_time.observe(seconds - queued)

    def on_finished(self, reason: str, e2e: float, tpot: float | None) -> None:
        self._success.labels(self.model_name, reason).inc()
        self.e2e.observe(e2e)
        if tpot is not None:
            self.tpot.observe(tpot)

    def on_error(self, status: int) -> None:
        self._errors.labels(self.model_name, str(status)).inc()

    def on_engine(self, engine) -> None:
        """Copy the engine's gauges and running totals (``LLMEngine``'s attributes)."""
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        kv = engine.kv_cache_stats()
        self.kv_usage.set(kv["usage"])
        fused, plain, fallbacks = {}, 0, {}
        for key, total in engine.fusion_totals.items():
            kind, _, detail = key.partition(":")
            if kind == "fused_impl":
                fused[detail] = total
            elif kind == "fallback_reasons":
                fallbacks[detail] = total
            elif kind == "plain_allreduce_calls":
                plain = total
        totals = self._engine
        with totals.lock:
            totals.steps, totals.step_tokens = engine.num_steps, engine.num_forward_tokens
            totals.forward_seconds = engine.forward_seconds
            totals.decode_steps, totals.decode_device_seconds = engine.num_decode_steps, engine.decode_device_seconds
            totals.device_seconds = engine.device_seconds
            totals.prefix_queries, totals.prefix_hits = kv["prefix_cache_queries"], kv["prefix_cache_hits"]
            totals.preemptions = kv["num_preemptions"]
            totals.fused_by_impl, totals.plain, totals.fallbacks = fused, plain, fallbacks

    # ---- exposition (HTTP thread) ----------------------------------------------------------
    def render(self) -> str:
        """The page for ``GET /metrics``."""
        return prometheus_client.generate_latest(self.registry).decode("utf-8")
