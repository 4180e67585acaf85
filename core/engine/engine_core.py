"""EngineCore: the inner loop — schedule, run the model, apply the results. Knows nothing of text.

It takes `Request`s and gives back `EngineCoreOutput`s (token ids, finish reasons), so the same core can run
in-process (offline `LLM`) or behind a socket in its own process (the server), as in vLLM V1.

NOTE(1) async scheduling (`scheduler.async_scheduling`). A synchronous step leaves the GPU idle while the host
applies the step's tokens, schedules the next one and lays out its inputs (~6 ms per step at 256 requests on
the H200 host, against ~9 ms of GPU work). Pipelined, step() schedules N+1 and launches it *before* applying
step N's output (model_runner.py NOTE 1), so that work overlaps N+1 on the GPU. The scheduler counts each
request's in-flight sample as a placeholder token (Request.num_output_placeholders): N+1 schedules its
position, and a request whose in-flight tokens reach max_tokens is not scheduled again. What a request
stopping on EOS or a stop string costs is one extra token computed and dropped. Outputs reach the caller
one step later than they are computed. With tensor parallelism the executor sends each step to the remote
ranks and does not wait for them; every rank runs it pipelined, and rank 0's sampled ids reach the others by
a broadcast on the device (model_runner.py NOTE 2), so all ranks feed the model rank 0's tokens.

Plugins that act on steps run wherever the core runs: the configured logits processors and the speculative
proposer are built with the runner (builder.py, runner_plugins.py), the `step_stats` hook is called here.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

from pagedllm.engine.builder import EngineParts
from pagedllm.engine.messages import EngineCoreOutput
from pagedllm.plugin_manager import PluginManager, get_plugin_manager
from pagedllm.request import Request, RequestStatus
from pagedllm.sched.stats import SchedulerStats

logger = logging.getLogger("pagedllm")


class EngineCore:
    def __init__(
        self,
        parts: EngineParts,
        plugin_manager: PluginManager | None = None,
    ) -> None:
        """The plugins that need the config's `plugins.*` sections (logits processors, the speculator) come
        built with the runner (build_engine)."""
        self.parts = parts
        self.pm = plugin_manager or get_plugin_manager()
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.logits_processors = list(parts.logits_processors)  # the runner's sampler's (runner_plugins.py)
        # The executor runs every tensor-parallel rank; uniproc hands back runner.execute itself (no extra hop).
        self.executor = parts.executor
        self._execute = parts.executor.execute_model if parts.executor is not None else parts.runner.execute
        self._execute_pipelined: Any = getattr(parts.executor if parts.executor is not None else parts.runner,
                                               "execute_pipelined", None)
        self._errors: list[EngineCoreOutput] = []
        self._in_flight: Any = None  # the SchedulerOutput of the launched, not yet applied step (NOTE 1)
        self._gc_threshold = gc.get_threshold()  # the process's, put back by shutdown()
        try:
            self._step_hook = self.pm.hook.step_stats
            self.async_scheduling = self._use_async_scheduling()
        except BaseException:
            # The executor's remote ranks (processes, Ray actors) are already running: a config refused here
            # must not leave them holding their GPUs or the cluster's resources.
            self.shutdown()
            raise
        # NOTE: everything built so far (model, tokenizer, plugin registries) lives as long as the engine. Move
        # it out of the cyclic GC's generations, as vLLM does after start-up: otherwise every full collection
        # walks it again, and the many small objects each step makes trigger those collections often
        # (measured: 4.6 -> 1.1 ms of update_from_output per step at 256 requests, -20 % wall on a tiny model).
        # Frozen objects are still freed by reference counting; shutdown() unfreezes so that reference cycles
        # among the engine's objects become collectable again.
        gc.collect()
        gc.freeze()
        # NOTE: and collect the young generation less often while the engine runs. At Python's default (700
        # allocations) a 500-request step triggered ~4 young collections and, every ~40 steps, a full one
        # (~20 ms on the 2-core CPU machine), during which the GPU waited for the next step (W2 / W5 traces on
        # the H200: 2-4 % of the wall time idle). `gc_threshold` null keeps Python's; shutdown() restores it.
        if parts.config.gc_threshold is not None:
            gc.set_threshold(parts.config.gc_threshold, *self._gc_threshold[1:])

    def _use_async_scheduling(self) -> bool:
        config = self.parts.config
        wanted = config.scheduler.async_scheduling
        why_not = (
            "speculative decoding verifies drafts against known tokens" if config.speculative.method else
            "the executor has no pipelined step (execute_pipelined)" if self._execute_pipelined is None else
            "the model runner has no pipelined step" if not hasattr(self.runner, "execute_pipelined") else
            f"scheduler plugin {config.scheduler.name!r} does not declare supports_async_scheduling"
            if not getattr(self.scheduler, "supports_async_scheduling", False) else None
        )
        if wanted is None:
            return why_not is None and self.parts.device.type == "cuda"
        if wanted and why_not:
            raise ValueError(f"scheduler.async_scheduling: cannot be true here: {why_not}")
        return wanted

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
        if self.async_scheduling:
            return self._step_pipelined(outputs)
        if not self.scheduler.has_unfinished_requests():
            return outputs
        scheduler_output = self.scheduler.schedule()
        runner_output = self._execute(scheduler_output)
        outputs.extend(self.scheduler.update_from_output(scheduler_output, runner_output))
        self._report(scheduler_output)
        return outputs

    def _step_pipelined(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Launch the next step, then apply the one before it (NOTE 1)."""
        # A request whose last token is in flight is still running, so "no unfinished requests" means the
        # step in flight (if any) only serves finished or aborted ones: it is applied, and ignored, later.
        if not self.scheduler.has_unfinished_requests():
            return outputs
        scheduler_output = self.scheduler.schedule()
        previous = self._execute_pipelined(scheduler_output)
        if previous is not None:
            outputs.extend(self.scheduler.update_from_output(self._in_flight, previous))
        self._in_flight = None if scheduler_output.is_empty else scheduler_output
        self._report(scheduler_output)
        return outputs

    def _report(self, scheduler_output: Any) -> None:
        if self._step_hook.get_hookimpls():  # stats cost a little: only gather them for a listener
            self._step_hook(
                stats=self.scheduler.get_stats(),
                num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
                num_requests=len(scheduler_output.num_scheduled_tokens),
            )

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def shutdown(self) -> None:
        """Stop the executor's remote ranks (a no-op for the in-process executor); safe to call twice."""
        if self.executor is not None:
            self.executor.shutdown()
        release = getattr(self.runner, "release", None)  # a runner without it keeps its tensors until collected
        if release is not None:
            release()
        gc.unfreeze()  # see __init__: the engine's objects may be collected again
        gc.set_threshold(*self._gc_threshold)
