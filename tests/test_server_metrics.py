"""/metrics as Prometheus reads it: the page is parsed with prometheus_client's own parser
(free-text fallback reasons with quotes, backslashes and newlines included), names follow
vLLM's under the glm_fused: prefix, every series carries model_name, and values move with
the server's events and the engine's totals."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from glm_fused.server.metrics import ServerMetrics

MODEL = "glm-4.5-air-tiny"
REASON = 'workspace too small for 4096 tokens ("max_token_num"=2048)\nsecond line \\ end'


def fake_engine(**overrides):
    kv = {"prefix_cache_queries": 500, "prefix_cache_hits": 320, "num_preemptions": 2}
    engine = SimpleNamespace(num_running=3, num_waiting=2, kv_cache_stats=lambda: {**kv, "usage": engine.num_running / 8},
                             num_steps=11, num_forward_tokens=123, forward_seconds=0.75,
                             num_decode_steps=9, decode_device_seconds=0.25, device_seconds=0.5,
                             fusion_totals={"fused_allreduce_norm_calls": 40, "plain_allreduce_calls": 0,
                                            "fused_impl:flashinfer": 30, "fused_impl:reference": 10,
                                            f"fallback_reasons:{REASON}": 6, "fallback_reasons:tp 3": 4})
    for key, value in overrides.items():
        setattr(engine, key, value)
    return engine


def samples(metrics: ServerMetrics) -> dict[tuple, float]:
    """{(sample name, labels without model_name): value}, after checking every family's name
    and that every sample is labelled with the model."""
    out = {}
    for family in text_string_to_metric_families(metrics.render()):
        assert family.name.startswith("glm_fused:"), family.name
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name") == MODEL, s
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def test_page_parses_and_names_mirror_vllm():
    metrics = ServerMetrics(MODEL)
    metrics.on_engine(fake_engine())
    families = {f.name: f.type for f in text_string_to_metric_families(metrics.render())}
    expected = {
        "glm_fused:num_requests_running": "gauge", "glm_fused:num_requests_waiting": "gauge",
        "glm_fused:kv_cache_usage_perc": "gauge", "glm_fused:prompt_tokens": "counter",
        "glm_fused:generation_tokens": "counter", "glm_fused:request_success": "counter",
        "glm_fused:time_to_first_token_seconds": "histogram",
        "glm_fused:request_time_per_output_token_seconds": "histogram",
        "glm_fused:e2e_request_latency_seconds": "histogram", "glm_fused:request_errors": "counter",
        "glm_fused:request_queue_time_seconds": "histogram", "glm_fused:request_prefill_time_seconds": "histogram",
        "glm_fused:engine_steps": "counter", "glm_fused:engine_step_tokens": "counter",
        "glm_fused:engine_forward_seconds": "counter", "glm_fused:engine_decode_steps": "counter",
        "glm_fused:engine_decode_device_seconds": "counter", "glm_fused:engine_device_seconds": "counter",
        "glm_fused:prefix_cache_queries": "counter",
        "glm_fused:prefix_cache_hits": "counter", "glm_fused:num_preemptions": "counter", "glm_fused:fused_allreduce_calls": "counter",
        "glm_fused:plain_allreduce_calls": "counter", "glm_fused:fused_allreduce_fallbacks": "counter",
    }
    assert families == expected
    assert "_created" not in metrics.render()


def test_fallback_reason_with_quotes_and_newlines_round_trips():
    metrics = ServerMetrics(MODEL)
    metrics.on_engine(fake_engine())
    got = samples(metrics)
    assert got[("glm_fused:fused_allreduce_fallbacks_total", (("reason", REASON),))] == 6
    assert got[("glm_fused:fused_allreduce_fallbacks_total", (("reason", "tp 3"),))] == 4
    assert got[("glm_fused:fused_allreduce_calls_total", (("impl", "flashinfer"),))] == 30
    assert got[("glm_fused:fused_allreduce_calls_total", (("impl", "reference"),))] == 10
    assert got[("glm_fused:plain_allreduce_calls_total", ())] == 0
    assert got[("glm_fused:engine_steps_total", ())] == 11
    assert got[("glm_fused:engine_step_tokens_total", ())] == 123
    assert got[("glm_fused:engine_forward_seconds_total", ())] == 0.75
    assert got[("glm_fused:num_requests_running", ())] == 3
    assert got[("glm_fused:num_requests_waiting", ())] == 2
    assert got[("glm_fused:kv_cache_usage_perc", ())] == pytest.approx(3 / 8)
    # Totals are copied, not added: a second copy of the same totals changes nothing.
    metrics.on_engine(fake_engine(num_running=0))
    again = samples(metrics)
    assert again[("glm_fused:engine_steps_total", ())] == 11 and again[("glm_fused:kv_cache_usage_perc", ())] == 0


def test_request_events_move_their_series():
    metrics = ServerMetrics(MODEL)
    metrics.on_admitted(17)
    metrics.on_tokens(1)
    metrics.on_first_token(0.03, 0.012)
    metrics.on_tokens(4)
    metrics.on_finished("length", 0.9, 0.05)
    metrics.on_admitted(5)
    metrics.on_finished("abort", 0.2, None)  # aborted before a second token: no TPOT
    metrics.on_error(400)
    metrics.on_error(400)
    metrics.on_error(404)
    got = samples(metrics)
    assert got[("glm_fused:prompt_tokens_total", ())] == 22
    assert got[("glm_fused:generation_tokens_total", ())] == 5
    assert got[("glm_fused:request_success_total", (("finished_reason", "length"),))] == 1
    assert got[("glm_fused:request_success_total", (("finished_reason", "abort"),))] == 1
    assert got[("glm_fused:request_errors_total", (("status", "400"),))] == 2
    assert got[("glm_fused:request_errors_total", (("status", "404"),))] == 1
    assert got[("glm_fused:time_to_first_token_seconds_count", ())] == 1
    assert got[("glm_fused:time_to_first_token_seconds_bucket", (("le", "0.04"),))] == 1
    assert got[("glm_fused:time_to_first_token_seconds_bucket", (("le", "0.02"),))] == 0
    # the first token's time split: 12 ms waiting to be admitted, 18 ms of prompt steps
    assert got[("glm_fused:request_queue_time_seconds_sum", ())] == pytest.approx(0.012)
    assert got[("glm_fused:request_prefill_time_seconds_sum", ())] == pytest.approx(0.018)
    assert got[("glm_fused:request_prefill_time_seconds_count", ())] == 1
    assert got[("glm_fused:request_time_per_output_token_seconds_count", ())] == 1
    assert got[("glm_fused:request_time_per_output_token_seconds_sum", ())] == pytest.approx(0.05)
    assert got[("glm_fused:e2e_request_latency_seconds_count", ())] == 2
    assert got[("glm_fused:e2e_request_latency_seconds_sum", ())] == pytest.approx(1.1)
    assert got[("glm_fused:e2e_request_latency_seconds_bucket", (("le", "+Inf"),))] == 2


def test_servers_in_one_process_keep_their_own_series():
    a, b = ServerMetrics(MODEL), ServerMetrics(MODEL)
    a.on_admitted(3)
    assert samples(a)[("glm_fused:prompt_tokens_total", ())] == 3
    assert samples(b)[("glm_fused:prompt_tokens_total", ())] == 0


def test_scrapes_while_the_engine_updates_always_parse():
    metrics = ServerMetrics(MODEL)
    stop = threading.Event()

    def engine_thread():
        n = 0
        while not stop.is_set():
            n += 1
            metrics.on_tokens(1)
            metrics.on_finished("stop", 0.01, 0.001)
            metrics.on_engine(fake_engine(num_steps=n, fusion_totals={f"fallback_reasons:{REASON} {n % 5}": n}))

    worker = threading.Thread(target=engine_thread)
    worker.start()
    try:
        for _ in range(100):
            samples(metrics)
    finally:
        stop.set()
        worker.join(10)
    assert not worker.is_alive()
