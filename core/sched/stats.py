"""Numbers a scheduler reports after each step (for logs, benchmarks and /metrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0  # total since start
    prefix_cache_queries: int = 0  # prompt tokens looked up, total since start
    prefix_cache_hits: int = 0  # of those, tokens found in the cache
    num_steps: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
