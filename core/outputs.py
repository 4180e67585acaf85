"""What users get back: RequestOutput with one CompletionOutput per sample (vLLM's shapes and names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank among the vocabulary; None when unknown
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing predicts it), then token id -> Logprob (the actual
# prompt token plus the top-N), vLLM's shape.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """A request's timeline, all `time.monotonic()` stamps (request.py EngineCoreEvent says why the core's and
    the frontend's agree):

        arrival ── queued ──────── scheduled ──────── first token ──────── last token ── finished
        (frontend) (core)  queue    (core)    prefill  (frontend)   decode  (frontend)
                                              └───────────── inference ─────────────┘

    The intervals are vLLM's (its RequestStateStats and the vllm:request_*_time_seconds histograms); each is
    None until both of its ends are known (an aborted request may have none).
    """

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Wall time of each generated token (monotonic), so inter-token latency can be derived.
    token_times: list[float] = field(default_factory=list)
    queued_time: float | None = None  # entered the engine core (the earliest of its samples')
    scheduled_time: float | None = None  # first sent to the model runner (a later re-admission is not counted)
    num_preemptions: int = 0
    # Detokenization (measured only while tracing: two clock reads per step and request): seconds spent in the
    # detokenizer, and when its last call ended.
    detokenize_seconds: float = 0.0
    detokenized_time: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return _between(self.queued_time, self.scheduled_time)

    @property
    def prefill_time(self) -> float | None:
        return _between(self.scheduled_time, self.first_token_time)

    @property
    def decode_time(self) -> float | None:
        return _between(self.first_token_time, self.last_token_time)

    @property
    def inference_time(self) -> float | None:
        return _between(self.scheduled_time, self.last_token_time)

    @property
    def e2e_time(self) -> float | None:
        return _between(self.arrival_time, self.finished_time)

    @property
    def time_per_output_token(self) -> float | None:
        """Mean decode time per token after the first (vLLM's request_time_per_output_token); None below 2."""
        decode, n = self.decode_time, len(self.token_times)
        return None if decode is None or n < 2 else decode / (n - 1)


def _between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    # With SamplingParams.prompt_logprobs set; None otherwise.
    prompt_logprobs: PromptLogprobs | None = None
