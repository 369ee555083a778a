"""The engine's periodic status line: throughput since the last line, queue, KV usage and
prefix hit rate, at most once per interval, none when switched off."""
import logging

from engine import LLM, SamplingParams
from engine.core.stats_logger import StatsLogger
from engine.core_messages import SchedulerStats


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_line_reports_rates_since_the_last_line():
    clock = Clock()
    stats = StatsLogger(5.0, clock)
    snapshot = SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25,
                              prefix_cache_queries=200, prefix_cache_hits=50)
    stats.count(400, 10)
    clock.now += 4.0
    assert stats.maybe_log(lambda: snapshot) is None  # not due yet
    stats.count(100, 10)
    clock.now += 1.0
    line = stats.maybe_log(lambda: snapshot)
    assert line == ("prompt throughput: 100.0 tokens/s, generation throughput: 4.0 tokens/s, "
                    "running: 3 reqs, waiting: 2 reqs, KV cache usage: 25.0%, "
                    "prefix cache hit rate: 25.0%")
    stats.count(0, 20)
    clock.now += 10.0
    later = SchedulerStats(num_running_reqs=1, prefix_cache_queries=300, prefix_cache_hits=150)
    line = stats.maybe_log(lambda: later)
    assert "generation throughput: 2.0 tokens/s" in line
    assert "prefix cache hit rate: 100.0%" in line  # 100 more queries, all hits
    clock.now += 10.0  # the prefix cache was reset: its counters restart from 0
    line = stats.maybe_log(lambda: SchedulerStats(prefix_cache_queries=40,
                                                  prefix_cache_hits=10))
    assert "prefix cache hit rate: 25.0%" in line


def test_the_engine_logs_while_busy_and_not_when_switched_off(tiny_llama, caplog):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[100 + i for i in range(24)], [300 + i for i in range(24)]]
    with caplog.at_level(logging.INFO, logger="engine.stats"):
        LLM(str(tiny_llama), dtype="float32", log_stats_interval_s=1e-6).generate(
            prompts, params, use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.stats"]
    assert lines and all("generation throughput" in line and "KV cache usage" in line
                         for line in lines)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.stats"):
        LLM(str(tiny_llama), dtype="float32", log_stats_interval_s=0).generate(
            prompts, params, use_tqdm=False)
    assert not [r for r in caplog.records if r.name == "engine.stats"]
