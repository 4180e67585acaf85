"""AdmissionLimits: what the async frontend refuses up front, so overload shows as a fast, clear error.

    waiting bound   sequences in flight beyond max_num_seqs; more is QueueFullError (HTTP 429, Retry-After)
    max_tokens      a ceiling on one request's completion length; above it RequestValidationError (HTTP 400),
                    and a request that names none gets min(ceiling, rest of the context)
    request timeout arrival to last output; past it the request is aborted in the core (its KV blocks freed)
                    and RequestTimeoutError is raised to the caller

NOTE(1): the default waiting bound comes from the KV cache, not a constant: a queue longer than what the
cache can hold at once only turns into time to first token (a 300-request burst on an unbounded queue
measured a 60 s p50 TTFB). We allow one batch of waiting sequences (`max_num_seqs`), or more when the cache
holds more full-length sequences than that: max(max_num_seqs, kv_tokens // max_model_len).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionLimits:
    """`max_waiting`: None = sized from the KV cache (NOTE 1) unless scheduler.max_waiting is set; 0 = unbounded.
    `max_tokens`, `request_timeout_s`: None = no ceiling / no timeout."""

    max_waiting: int | None = None
    max_tokens: int | None = None
    request_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 (0 = unbounded), got {self.max_waiting}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens ceiling must be >= 1, got {self.max_tokens}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request timeout must be > 0 seconds, got {self.request_timeout_s}")


def default_max_waiting(max_num_seqs: int, num_blocks: int, block_size: int, max_model_len: int) -> int:
    """NOTE 1: one batch of waiting sequences, or as many full-length ones as the KV cache holds."""
    return max(max_num_seqs, num_blocks * block_size // max(1, max_model_len))


def resolve_max_waiting(
    limits: AdmissionLimits, configured: int | None, max_num_seqs: int, num_blocks: int, block_size: int,
    max_model_len: int,
) -> int | None:
    """The waiting bound in force (None: unbounded): the explicit limit, else scheduler.max_waiting, else NOTE 1."""
    if limits.max_waiting is not None:
        return limits.max_waiting or None
    if configured is not None:
        return configured
    return default_max_waiting(max_num_seqs, num_blocks, block_size, max_model_len)
