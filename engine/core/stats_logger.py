"""The engine's periodic status line, as operators know it from vLLM's logs.

While the engine steps, every `interval_s` it logs the prompt and generation
throughput since the last line (tokens/s), the running and waiting requests, KV
cache usage and the prefix cache hit rate. Counting costs two additions per step;
the line itself is written at most once per interval, and never while idle (no
step runs then).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from engine.core_messages import SchedulerStats

logger = logging.getLogger("engine.stats")


class StatsLogger:
    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._since = clock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._queries = self._hits = 0  # prefix-cache counters at the last line
        self._drafted = self._accepted = 0  # speculative decoding's, at the last line

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    def count(self, prompt_tokens: int, generation_tokens: int) -> None:
        """Tokens one step computed for prompts and sampled."""
        self._prompt_tokens += prompt_tokens
        self._generation_tokens += generation_tokens

    def maybe_log(self, stats: Callable[[], SchedulerStats]) -> str | None:
        """Write the line when an interval has passed; returns it (None if not due)."""
        now = self._clock()
        elapsed = now - self._since
        if not self.enabled or elapsed < self.interval_s:
            return None
        s = stats()
        queries, hits = s.prefix_cache_queries - self._queries, s.prefix_cache_hits - self._hits
        if queries < 0 or hits < 0:  # the prefix cache was reset, and its counters with it
            queries, hits = s.prefix_cache_queries, s.prefix_cache_hits
        line = (f"prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
                f"generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
                f"running: {s.num_running_reqs} reqs, waiting: {s.num_waiting_reqs} reqs, "
                f"KV cache usage: {100 * s.kv_cache_usage:.1f}%, "
                f"prefix cache hit rate: {100 * hits / queries if queries > 0 else 0:.1f}%")
        drafted = s.spec_num_draft_tokens - self._drafted
        accepted = s.spec_num_accepted_tokens - self._accepted
        if drafted > 0:  # speculative decoding proposed tokens in this interval
            line += (f", spec decode acceptance rate: {100 * accepted / drafted:.1f}% "
                     f"({accepted}/{drafted} tokens)")
        self._drafted, self._accepted = s.spec_num_draft_tokens, s.spec_num_accepted_tokens
        logger.info("%s", line)
        self._since, self._prompt_tokens, self._generation_tokens = now, 0, 0
        self._queries, self._hits = s.prefix_cache_queries, s.prefix_cache_hits
        return line
