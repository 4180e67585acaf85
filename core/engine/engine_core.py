"""EngineCore: the inner loop — schedule, run the model, apply the results. Knows nothing of text.

It takes `Request`s and gives back `EngineCoreOutput`s (token ids, finish reasons), so the same core can run
in-process (offline `LLM`) or behind a socket in its own process (the server), as in vLLM V1.
"""

from __future__ import annotations

import logging

from pagedllm.engine.builder import EngineParts
from pagedllm.engine.messages import EngineCoreOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sched.stats import SchedulerStats

logger = logging.getLogger("pagedllm")


class EngineCore:
    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self._errors: list[EngineCoreOutput] = []

    def add_request(self, request: Request) -> None:
        """Queue a request; one that can never run is failed alone (reported by the next step)."""
        problem = self._reject_reason(request)
        if problem:
            request.status = RequestStatus.FINISHED_ERROR
            self._errors.append(EngineCoreOutput(request.request_id, [], finish_reason="error", error=problem))
            return
        self.scheduler.add_request(request)

    def _reject_reason(self, request: Request) -> str | None:
        max_len = self.parts.max_model_len
        if not request.prompt_token_ids:
            return "the prompt is empty"
        if request.num_prompt_tokens >= max_len:
            return (
                f"the prompt has {request.num_prompt_tokens} tokens but the context holds {max_len} "
                f"(max_model_len); shorten the prompt"
            )
        vocab = self.parts.info.hf_config.vocab_size
        bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            return f"prompt token ids out of range [0, {vocab}): {bad[:5]}"
        return None

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self._errors) or self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        outputs, self._errors = self._errors, []
        if not self.scheduler.has_unfinished_requests():
            return outputs
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        outputs.extend(self.scheduler.update_from_output(scheduler_output, runner_output))
        return outputs

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()
