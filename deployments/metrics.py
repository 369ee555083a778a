"""Prometheus metrics of an ingress replica, under vLLM's names (existing vLLM
dashboards work) plus flotilla:* for the time-to-first-token split.

Request metrics are recorded as requests finish; engine gauges and counters are
read from the EngineClient at scrape time (the engines' last reported stats and
their READY values), labelled by engine rank.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.outputs import RequestMetrics
from engine.wire.core_client import EngineClient

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


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
        }
        families = {name: GaugeMetricFamily(name, doc, labels=labels)
                    for name, (doc, _) in gauges.items()}
        families.update({name: CounterMetricFamily(name, doc, labels=labels)
                         for name, (doc, _) in counters.items()})
        info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration of the engine",
                                 labels=["model_name", "engine", "block_size", "num_gpu_blocks"])
        for e in client.engines:
            values = [self.model, str(e.index)]
            info.add_metric(values + [str(e.ready.block_size), str(e.ready.num_gpu_blocks)], 1)
            if e.stats is None:
                continue
            for name, (_, field) in {**gauges, **counters}.items():
                families[name].add_metric(values, float(getattr(e.stats, field)))
        yield from families.values()
        yield info


class IngressMetrics:
    def __init__(self, model: str, get_client: Callable[[], EngineClient | None]) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens", ["model_name"],
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens",
                                         ["model_name"], registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests",
                                       ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                              ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Mean time between tokens",
                             ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency",
                             ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_frontend = Histogram(
            "flotilla:time_to_first_token_frontend_seconds",
            "Part of the time to first token spent in the frontend (ingress, transport)",
            ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_engine = Histogram(
            "flotilla:time_to_first_token_engine_seconds",
            "Part of the time to first token spent in the engine (queue, prefill)",
            ["model_name"], buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(model, get_client))

    def record(self, m: RequestMetrics | None, prompt_tokens: int,
               finish_reasons: list[str | None]) -> None:
        """Account one finished request (all its sequences)."""
        label = self.model
        self.prompt_tokens.labels(label).inc(prompt_tokens)
        for reason in finish_reasons:
            self.request_success.labels(label, reason or "abort").inc()
        if m is None:
            return
        self.generation_tokens.labels(label).inc(m.num_generation_tokens)
        if m.first_token_time is not None:
            ttft = m.first_token_time - m.arrival_time
            self.ttft.labels(label).observe(ttft)
            if m.engine_submit_time and m.engine_first_token_time:
                engine = max(0.0, m.engine_first_token_time - m.engine_submit_time)
                self.ttft_engine.labels(label).observe(engine)
                self.ttft_frontend.labels(label).observe(max(0.0, ttft - engine))
            if m.last_token_time and m.num_generation_tokens > 1:
                self.itl.labels(label).observe(
                    (m.last_token_time - m.first_token_time) / (m.num_generation_tokens - 1))
        end = m.finished_time or m.last_token_time
        if end is not None:
            self.e2e.labels(label).observe(end - m.arrival_time)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
