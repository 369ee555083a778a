"""Prometheus metrics of an ingress replica, under vLLM's names, types and buckets
(existing vLLM dashboards work) plus flotilla:* for the time-to-first-token split.

Request metrics are recorded as requests finish, and summed over the ingress replicas
at scrape time (deployments/serve/metrics_sum.py); engine gauges and counters are read from
the EngineClient at scrape time (the engines' last reported stats, which ride on every
output, and their READY values), labelled by engine rank.
"""
from __future__ import annotations

import itertools
import math
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from deployments.serve.metrics_sum import Snapshot, SnapshotCollector, at_least, snapshot_of
from engine.core_messages import ITERATION_TOKENS_BUCKETS
from engine.outputs import RequestMetrics
from engine.wire.core_client import EngineClient

# vLLM's bucket boundaries, so that its dashboards and alerts read the same quantiles
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                       2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(cap: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to cap (vLLM's token-count buckets, cap = context)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > cap:
                return out
            out.append(float(m * scale))
        scale *= 10


class _EngineCollector:
    def __init__(self, model: str, get_client: Callable[[], EngineClient | None]) -> None:
        self.model, self.get_client = model, get_client

    def collect(self):
        client = self.get_client()
        if client is None:
            return
        labels = ["model_name", "engine"]
        gauges = {
            "vllm:num_requests_running": ("Requests running in the engine", "num_running_reqs"),
            "vllm:num_requests_waiting": ("Requests waiting in the engine", "num_waiting_reqs"),
            "vllm:kv_cache_usage_perc": ("KV cache usage (1 = full)", "kv_cache_usage"),
        }
        counters = {
            "vllm:prefix_cache_queries": ("Prefix cache queries, in tokens", "prefix_cache_queries"),
            "vllm:prefix_cache_hits": ("Prefix cache hits, in tokens", "prefix_cache_hits"),
            "vllm:num_preemptions": ("Preemptions by the scheduler", "num_preemptions"),
            "vllm:spec_decode_num_drafts": ("Speculative decoding: steps in which a "
                                            "request had proposed tokens", "spec_num_drafts"),
            "vllm:spec_decode_num_draft_tokens": ("Speculative decoding: proposed tokens",
                                                  "spec_num_draft_tokens"),
            "vllm:spec_decode_num_accepted_tokens": ("Speculative decoding: accepted tokens",
                                                     "spec_num_accepted_tokens"),
            "vllm:external_prefix_cache_queries": (
                "KV connector prefix lookups, in tokens queried", "external_prefix_cache_queries"),
            "vllm:external_prefix_cache_hits": (
                "KV connector prefix hits, in tokens it supplied", "external_prefix_cache_hits"),
            "flotilla:kv_load_failures": ("KV connector loads that failed (the request "
                                          "recomputed or failed: kv_load_failure_policy)",
                                          "kv_load_failures"),
        }
        families = {name: GaugeMetricFamily(name, doc, labels=labels)
                    for name, (doc, _) in gauges.items()}
        families.update({name: CounterMetricFamily(name, doc, labels=labels)
                         for name, (doc, _) in counters.items()})
        info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration of the engine",
                                 labels=["model_name", "engine", "block_size", "num_gpu_blocks"])
        iterations = HistogramMetricFamily("vllm:iteration_tokens_total",
                                           "Tokens computed per engine step (engine's count)",
                                           labels=labels)
        moved = {unit: CounterMetricFamily(
            f"flotilla:kv_transfer_{unit}", f"KV {unit} a connector moved, into the pool "
            "(in) or out of it (out)", labels=labels + ["connector", "direction"])
            for unit in ("blocks", "bytes")}
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: accepted tokens by position in the proposal",
            labels=labels + ["position"])
        for e in client.engines:
            values = [self.model, str(e.index)]
            info.add_metric(values + [str(e.ready.block_size), str(e.ready.num_gpu_blocks)], 1)
            if e.stats is None:
                continue
            for name, (_, field) in {**gauges, **counters}.items():
                families[name].add_metric(values, float(getattr(e.stats, field)))
            if e.stats.kv_connector:
                for unit, family in moved.items():
                    for direction in ("in", "out"):
                        family.add_metric(values + [e.stats.kv_connector, direction], float(
                            getattr(e.stats, f"kv_{unit}_{direction}")))
            for pos, count in enumerate(e.stats.spec_accepted_per_pos):
                per_pos.add_metric(values + [str(pos)], float(count))
            counts = e.stats.iteration_tokens_counts
            if counts:
                bounds = [str(float(b)) for b in ITERATION_TOKENS_BUCKETS] + ["+Inf"]
                iterations.add_metric(values, list(zip(bounds, itertools.accumulate(counts))),
                                      float(e.stats.iteration_tokens_sum))
        yield from families.values()
        yield from moved.values()
        yield iterations
        yield per_pos
        yield info


class IngressMetrics:
    """The ingress replica's request metrics (recorded as requests finish) and the
    engines' values (read at scrape time by _EngineCollector)."""

    def __init__(self, model: str, get_client: Callable[[], EngineClient | None]) -> None:
        self.model = model
        self.get_client = get_client
        self.registry = CollectorRegistry()
        r = self.registry
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", labels,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens",
                                         labels, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests",
                                       labels + ["finished_reason"], registry=r)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Time between two outputs of a request, each interval",
                             INTER_TOKEN_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "A request's decode time over its output tokens after the "
                              "first", INTER_TOKEN_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Time in the engine's waiting queue (engine clock)",
                                    REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "From first scheduled to the first token (engine clock)",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "From the first token to the last (engine clock)",
                                     REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "From first scheduled to the last token (engine "
                                        "clock)", REQUEST_LATENCY_BUCKETS)
        self.params_n = histogram("vllm:request_params_n", "The n request parameter",
                                  PARAMS_N_BUCKETS)
        self._token_histograms: dict[str, Histogram] | None = None  # once the context is known
        self.ttft_frontend = histogram(
            "flotilla:time_to_first_token_frontend_seconds",
            "Part of the time to first token spent in the frontend (ingress, transport)",
            TTFT_BUCKETS)
        self.ttft_engine = histogram(
            "flotilla:time_to_first_token_engine_seconds",
            "Part of the time to first token spent in the engine (queue, prefill)",
            TTFT_BUCKETS)
        self._last_sum: Snapshot | None = None  # the coordinator's newest answer
        self._last_sum_at = -math.inf  # and when it came (time.monotonic())
        self._reports = 0  # reports numbered as sent: an older answer never replaces a newer
        self._last_sum_report = 0
        self.engine_registry = CollectorRegistry()
        self.engine_registry.register(_EngineCollector(model, get_client))

    def _tokens(self) -> dict[str, Histogram]:
        """The token-count histograms, bucketed 1-2-5 up to the engines' context length
        (as vLLM), made on the first request: the engines report it when they connect."""
        if self._token_histograms is None:
            client = self.get_client()
            cap = client.max_model_len if client is not None and client.engines else 1 << 20
            buckets = buckets_1_2_5(cap)
            docs = {"vllm:request_prompt_tokens": "Prompt tokens of a request",
                    "vllm:request_generation_tokens": "Generated tokens of a request",
                    "vllm:request_max_num_generation_tokens":
                        "Generated tokens of a request's longest sequence",
                    "vllm:request_params_max_tokens": "The max_tokens request parameter"}
            self._token_histograms = {
                name: Histogram(name, doc, ["model_name"], buckets=buckets,
                                registry=self.registry) for name, doc in docs.items()}
        return self._token_histograms

    def record(self, m: RequestMetrics | None, prompt_tokens: int,
               finish_reasons: list[str | None]) -> None:
        """Account one finished request (all its sequences)."""
        label = self.model
        self.prompt_tokens.labels(label).inc(prompt_tokens)
        for reason in finish_reasons:
            self.request_success.labels(label, reason or "abort").inc()
        if m is None:
            return
        tokens = self._tokens()
        tokens["vllm:request_prompt_tokens"].labels(label).observe(prompt_tokens)
        tokens["vllm:request_generation_tokens"].labels(label).observe(m.num_generation_tokens)
        tokens["vllm:request_max_num_generation_tokens"].labels(label).observe(
            m.max_num_generation_tokens)
        if m.max_tokens is not None:
            tokens["vllm:request_params_max_tokens"].labels(label).observe(m.max_tokens)
        self.params_n.labels(label).observe(m.n)
        self.generation_tokens.labels(label).inc(m.num_generation_tokens)
        if m.first_token_time is not None:
            ttft = m.first_token_time - m.arrival_time
            self.ttft.labels(label).observe(ttft)
            if m.engine_submit_time and m.engine_first_token_time:
                engine = max(0.0, m.engine_first_token_time - m.engine_submit_time)
                self.ttft_engine.labels(label).observe(engine)
                self.ttft_frontend.labels(label).observe(max(0.0, ttft - engine))
        itl = self.itl.labels(label)
        for interval in m.inter_token_latencies:
            itl.observe(interval)
        if m.queue_time is not None:
            self.queue_time.labels(label).observe(m.queue_time)
            self.prefill_time.labels(label).observe(m.prefill_time)
            self.decode_time.labels(label).observe(m.decode_time)
            self.inference_time.labels(label).observe(m.prefill_time + m.decode_time)
            if m.max_num_generation_tokens > 1:
                self.tpot.labels(label).observe(
                    m.decode_time / (m.max_num_generation_tokens - 1))
        end = m.finished_time or m.last_token_time
        if end is not None:
            self.e2e.labels(label).observe(end - m.arrival_time)

    def snapshot(self) -> Snapshot:
        """This replica's request counters and histograms, for MetricsSum."""
        return snapshot_of(self.registry)

    def report(self) -> tuple[int, Snapshot]:
        """This replica's snapshot for a report to the coordinator, numbered: pass the
        number to remember_sum with the answer."""
        self._reports += 1
        return self._reports, self.snapshot()

    def remember_sum(self, summed: Snapshot, report: int) -> None:
        """The coordinator's answer to report number `report` (a scrape's or a periodic
        one): what scrapes serve, raised to this replica's counts, until a newer one
        comes. Ray does not order calls: an answer to an older report is dropped."""
        if report > self._last_sum_report:
            self._last_sum, self._last_sum_at = summed, time.monotonic()
            self._last_sum_report = report

    async def sum_over_replicas(self, control, timeout_s: float) -> None:
        """Report this replica's counts to `control` (the coordinator in Serve) and keep
        the sum it answers within timeout_s: what scrapes serve from then on."""
        report, snapshot = self.report()
        summed = await control.sum_metrics(snapshot, timeout_s)
        if summed is not None:
            self.remember_sum(summed, report)

    def sum_age(self) -> float:
        """Seconds since the coordinator last answered a sum (inf: never)."""
        return time.monotonic() - self._last_sum_at

    def exposition(self) -> bytes:
        """The scrape: the request metrics summed over the ingress replicas (the
        coordinator's newest sum raised to this replica's counts, so the scrape never
        falls below them; this replica's alone before any sum or without a
        coordinator), then the engines' values."""
        if self._last_sum is None:
            requests = generate_latest(self.registry)
        else:
            registry = CollectorRegistry()
            registry.register(SnapshotCollector(at_least(self._last_sum, self.snapshot())))
            requests = generate_latest(registry)
        return requests + generate_latest(self.engine_registry)
