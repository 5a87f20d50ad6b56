"""The periodic statistics line a serving engine logs while it works (vLLM's, turned off by
--disable-log-stats): so that a long request on a slow machine shows signs of life in the
log, and throughput can be read without a dashboard."""

from __future__ import annotations

import logging
import time

from typing import Callable

logger = logging.getLogger("jaxserve.engine.stats")

LOG_STATS_INTERVAL_S = 10.0     # vLLM's default interval


class StatsLogger:
    """Call `maybe_log()` after every step: every `interval` seconds in which the engine did
    some work it logs one line of throughputs since the last line, queue lengths, cache use.
    read_metrics: the engine's get_metrics (a data-parallel engine's sums its replicas)."""

    def __init__(self, read_metrics: Callable[[], dict[str, float]],
                 interval: float = LOG_STATS_INTERVAL_S, clock=time.monotonic):
        self.read_metrics, self.interval, self.clock = read_metrics, interval, clock
        self._last_time = clock()
        self._last = read_metrics()

    def maybe_log(self) -> str | None:
        """The line logged now (None: not yet time, or nothing happened since the last)."""
        now = self.clock()
        elapsed = now - self._last_time
        if elapsed < self.interval:
            return None
        stats = self.read_metrics()
        line = self.format(stats, elapsed)
        self._last_time, self._last = now, stats
        if line is not None:
            logger.info("%s", line)
        return line

    def format(self, stats: dict[str, float], elapsed: float) -> str | None:
        def delta(name: str) -> float:
            return stats[name] - self._last[name]

        prompt, generated = delta("prompt_tokens_total"), delta("generation_tokens_total")
        running, waiting = stats["num_requests_running"], stats["num_requests_waiting"]
        if not (prompt or generated or running or waiting):
            return None       # an idle server stays quiet
        queries = delta("prefix_cache_queries_total")
        hits = delta("prefix_cache_hits_total") / queries if queries else 0.0
        line = (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {generated / elapsed:.1f} tokens/s, "
                f"Running: {running:.0f} reqs, Waiting: {waiting:.0f} reqs, "
                f"KV cache usage: {100 * stats['kv_cache_usage_perc']:.1f}%, "
                f"Prefix cache hit rate: {100 * hits:.1f}%")
        drafts = delta("spec_decode_num_draft_tokens_total")
        if drafts:
            accepted = delta("spec_decode_num_accepted_tokens_total")
            line += f", Draft acceptance rate: {100 * accepted / drafts:.1f}%"
        return line
