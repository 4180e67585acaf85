"""Numbers a scheduler reports after each step (for logs, benchmarks and /metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0  # total since start
    prefix_cache_queries: int = 0  # prompt tokens looked up, total since start
    prefix_cache_hits: int = 0  # of those, tokens found in the cache
    num_steps: int = 0
    # Speculative decoding, totals since start: verifications (a request's drafts checked in one step),
    # draft tokens checked, drafts accepted, and accepted counts by draft position (index 0 = first draft).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    # The KV connector's counters since start (hit tokens per tier, bytes moved): its stats(); empty without one.
    kv_connector: dict[str, int] = field(default_factory=dict)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def kv_connector_hit_rates(self) -> dict[str, float]:
        """Per tier of the KV connector (`<tier>_hit_tokens` in its counters): prompt tokens it served / prompt
        tokens looked up. The denominator is the device prefix cache's, so the device rate and these add up
        to the share of prompt tokens not computed."""
        q = self.prefix_cache_queries
        return {key.removesuffix("_hit_tokens"): (n / q if q else 0.0)
                for key, n in self.kv_connector.items() if key.endswith("_hit_tokens")}

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted drafts / drafts checked (0.0 before any verification)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Drafts accepted per verification (excluding the token every step emits anyway)."""
        return self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def spec_position_acceptance(self) -> list[float]:
        """Per draft position j: the fraction of verifications that accepted drafts 0..j."""
        return [n / self.spec_num_drafts for n in self.spec_accepted_per_position] if self.spec_num_drafts else []

    def record_spec_decode(self, num_drafts: int, num_accepted: int) -> None:
        """Count one request's verification: `num_drafts` checked, the first `num_accepted` accepted."""
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += num_accepted
        per_pos = self.spec_accepted_per_position
        if len(per_pos) < num_drafts:
            per_pos.extend([0] * (num_drafts - len(per_pos)))
        for j in range(num_accepted):
            per_pos[j] += 1
