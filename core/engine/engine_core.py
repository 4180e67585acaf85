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

NOTE(2) structured outputs. A request with `structured_outputs` waits aside (`_awaiting_grammar`) while its
grammar compiles on the manager's thread pool (structured_output/manager.py), and enters the scheduler when it is
ready: the batch never waits for a compiler, and scheduler plugins never see a request without its grammar.
Around each step that has grammar requests the core fills the batch bitmask after schedule() (the runner applies
it to the logits before sampling) and advances the grammars with the step's tokens after update_from_output; a
grammar that terminated finishes its request (`stop`). The manager is made with the first such request, so an
engine that never serves one pays nothing (one dict lookup per step). With async scheduling, step N+1 is
scheduled before step N's tokens reach the grammars, so its masks are filled later, by the runner, once it
holds N's ids and has launched N+1's forward (a DeferredBitmask: structured_output/manager.py NOTE 3): the
grammar work overlaps the GPU as the rest of the host work does. An executor that does not declare
`fills_deferred_masks` runs grammar steps synchronously instead.

NOTE(3) pipeline parallelism (batch_queue.py). Up to pipeline_parallel_size steps are in flight, each
holding requests whose tokens are known, so the stages work on different micro-batches at once (vLLM's
step_with_batch_queue); the last stage's samples come back through the executor (tp_worker.py NOTE 4).

Plugins that act on steps run wherever the core runs: the configured logits processors and the speculative
proposer are built with the runner (builder.py, runner_plugins.py), the `step_stats` hook is called here.
"""

from __future__ import annotations

import gc
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from pagedllm.engine.batch_queue import BatchQueue
from pagedllm.engine.builder import EngineParts
from pagedllm.engine.engine_watch import EngineSnapshot, EngineWatch
from pagedllm.engine.messages import EngineCoreOutput
from pagedllm.plugin_manager import PluginManager, get_plugin_manager
from pagedllm.request import EngineCoreEventType, Request, RequestStatus
from pagedllm.sched.stats import SchedulerStats
from pagedllm.structured_output.manager import StructuredOutputManager

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
        self._batches: BatchQueue | None = None  # pipeline parallelism's steps in flight (NOTE 3)
        self._gc_threshold = gc.get_threshold()  # the process's, put back by shutdown()
        self._structured: StructuredOutputManager | None = None  # made with the first grammar request (NOTE 2)
        self._awaiting_grammar: dict[str, tuple[Request, Future[Any]]] = {}
        # Grammar requests keep steps pipelined when the runner fills their masks itself (NOTE 2): an in-process
        # runner or rank 0 of an executor; the rest stay synchronous.
        self._pipelined_grammars = bool(getattr(parts.executor if parts.executor is not None else parts.runner,
                                                "fills_deferred_masks", False))
        # The dashboard's recorder (engine_watch.py), there only while someone watches: otherwise a step pays
        # one attribute test for it.
        self.watch: EngineWatch | None = None
        self._step_started = 0.0
        try:
            self._step_hook = self.pm.hook.step_stats
            self.async_scheduling = self._use_async_scheduling()
            self._batches = self._batch_queue()  # NOTE 3
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
            # The last stage's samples reach the first stage with the next step's message (tp_worker.py NOTE 4).
            "pipeline parallelism keeps its own batches in flight (NOTE 3)"
            if config.parallel.pipeline_parallel_size > 1 else
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
        request.record_event(EngineCoreEventType.QUEUED)
        if request.sampling_params.structured_outputs is not None:
            if request.request_id in self._awaiting_grammar:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            self._awaiting_grammar[request.request_id] = (request, self.structured_outputs.submit(request))
            return
        self.scheduler.add_request(request)

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """The grammar manager (NOTE 2), made on first use."""
        if self._structured is None:
            from pagedllm.config import validate_plugin_sections
            from pagedllm.engine.input_processing import eos_token_ids
            from pagedllm.protocols.structured_output import StructuredOutputContext

            parts, config = self.parts, self.parts.config
            ctx = StructuredOutputContext(
                tokenizer=parts.info.tokenizer,
                vocab_size=int(parts.info.hf_config.vocab_size),
                eos_token_ids=tuple(eos_token_ids(parts.info)[1]),
                num_speculative_tokens=config.speculative.num_speculative_tokens if config.speculative.method else 0,
            )
            so = config.structured_outputs
            self._structured = StructuredOutputManager(
                self.pm, ctx, default_backend=so.backend, compile_threads=so.compile_threads,
                cache_size=so.cache_size, plugin_sections=validate_plugin_sections(config, self.pm.config_models()),
            )
        return self._structured

    def _admit_compiled(self, outputs: list[EngineCoreOutput]) -> None:
        """Move requests whose grammar is ready into the scheduler; fail those whose grammar did not compile.
        With nothing else to run, wait (briefly) for a compilation rather than spin."""
        waiting = self._awaiting_grammar
        if not self.scheduler.has_unfinished_requests():
            wait([f for _, f in waiting.values()], timeout=0.05, return_when=FIRST_COMPLETED)
        for rid, (request, future) in list(waiting.items()):
            if not future.done():
                continue
            del waiting[rid]
            exc = future.exception()
            if exc is not None:
                request.status = RequestStatus.FINISHED_ERROR
                outputs.append(EngineCoreOutput(rid, [], finish_reason="error",
                                                error=f"structured_outputs: {exc}"))
                continue
            assert self._structured is not None
            self._structured.grammars[rid] = future.result()
            self.scheduler.add_request(request)

    def _grammar_step(self, scheduler_output: Any) -> None:
        """Attach this step's token masks (NOTE 2) to the scheduler's message."""
        if self._structured is not None and self._structured.grammars:
            scheduler_output.structured_output = self._structured.bitmask(scheduler_output, self.scheduler.requests)

    def _advance_grammars(self, outputs: list[EngineCoreOutput]) -> None:
        """Feed the step's tokens to the grammars; finish those they ended (NOTE 2)."""
        if self._structured is None or not self._structured.grammars:
            return
        for status, ids in _by_status(self._structured.advance(outputs, self.scheduler.requests)).items():
            self.scheduler.finish_requests(ids, status)

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
        if self.watch is not None:
            self.watch.on_abort(request_ids)
        if self._structured is not None:
            for rid in request_ids:
                entry = self._awaiting_grammar.pop(rid, None)
                if entry is not None:
                    entry[0].status = RequestStatus.FINISHED_ABORTED
            self._structured.remove(request_ids)

    def has_unfinished_requests(self) -> bool:
        return (bool(self._errors) or bool(self._awaiting_grammar) or self.scheduler.has_unfinished_requests()
                or (self._batches is not None and len(self._batches) > 0))

    def _batch_queue(self) -> BatchQueue | None:
        """NOTE 3: pipeline parallelism's batches in flight; None runs one step at a time."""
        pp = self.parts.config.parallel.pipeline_parallel_size
        if pp == 1:
            return None
        why_not = ("the executor has no launch_model / collect_model" if not hasattr(self.executor, "launch_model")
                   else f"scheduler plugin {self.parts.config.scheduler.name!r} does not declare "
                   "supports_pipeline_batches" if not getattr(self.scheduler, "supports_pipeline_batches", False)
                   else None)
        if why_not:
            logger.warning("pipeline parallelism runs one step at a time (the stages do not overlap): %s", why_not)
            return None
        return BatchQueue(self.executor, self.scheduler, pp)

    def step(self) -> list[EngineCoreOutput]:
        outputs, self._errors = self._errors, []
        self._step_started = time.time() if self.watch is not None else 0.0
        if self._awaiting_grammar:
            self._admit_compiled(outputs)
        grammars = self._structured is not None and bool(self._structured.grammars)
        if self._batches is not None:  # NOTE 3
            launched = self._batches.step(outputs, self._grammar_step, self._advance_grammars)
            if launched is not None:
                self._report(launched, outputs)
            return outputs
        if self.async_scheduling and (not grammars or self._pipelined_grammars):
            return self._step_pipelined(outputs)
        if self._in_flight is not None:
            self._drain_pipelined(outputs)  # grammar requests arrived: finish the step in flight first (NOTE 2)
        if not self.scheduler.has_unfinished_requests():
            return outputs
        scheduler_output = self.scheduler.schedule()
        if grammars:
            self._grammar_step(scheduler_output)
        runner_output = self._execute(scheduler_output)
        step_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if grammars:
            self._advance_grammars(step_outputs)
        outputs.extend(step_outputs)
        self._report(scheduler_output, outputs)
        return outputs

    def _drain_pipelined(self, outputs: list[EngineCoreOutput]) -> None:
        """Apply the pipelined step in flight (an empty step launches nothing and returns it)."""
        from pagedllm.engine.messages import SchedulerOutput

        previous = self._execute_pipelined(SchedulerOutput([], [], {}, 0))
        if previous is not None:
            outputs.extend(self.scheduler.update_from_output(self._in_flight, previous))
        self._in_flight = None

    def _step_pipelined(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Launch the next step, then apply the one before it (NOTE 1)."""
        # A request whose last token is in flight is still running, so "no unfinished requests" means the
        # step in flight (if any) only serves finished or aborted ones: it is applied, and ignored, later.
        if not self.scheduler.has_unfinished_requests():
            return outputs
        scheduler_output = self.scheduler.schedule()
        structured = self._structured
        if structured is not None and structured.grammars:  # masks filled by the runner (NOTE 2)
            scheduler_output.deferred_structured_output = structured.deferred(scheduler_output, self.scheduler.requests)
        previous = self._execute_pipelined(scheduler_output)
        if previous is not None:
            step_outputs = self.scheduler.update_from_output(self._in_flight, previous)
            self._advance_grammars(step_outputs)
            outputs.extend(step_outputs)
        self._in_flight = None if scheduler_output.is_empty else scheduler_output
        self._report(scheduler_output, outputs)
        return outputs

    def _report(self, scheduler_output: Any, outputs: list[EngineCoreOutput]) -> None:
        if self.watch is not None:
            self.watch.on_step(scheduler_output, self.scheduler.requests, self._step_started, outputs)
        if self._step_hook.get_hookimpls():  # stats cost a little: only gather them for a listener
            self._step_hook(
                stats=self.scheduler.get_stats(),
                num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
                num_requests=len(scheduler_output.num_scheduled_tokens),
            )

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def set_watching(self, on: bool) -> None:
        """Start (or stop and forget) recording for the dashboard (engine_watch.py)."""
        if not on:
            self.watch = None
        elif self.watch is None:
            self.watch = EngineWatch()

    def snapshot(self) -> EngineSnapshot | None:
        """What the dashboard shows now and since the last snapshot; None while nobody watches."""
        return self.watch.snapshot(self.scheduler) if self.watch is not None else None

    def check_health(self) -> None:
        """Raise WorkerDiedError if a tensor-parallel rank is gone (the core process asks while idle: a rank
        that dies between requests is found then, not by the next request's step)."""
        if self.executor is not None:
            self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the executor's remote ranks (a no-op for the in-process executor); safe to call twice."""
        if self.executor is not None:
            self.executor.shutdown()
        if self._structured is not None:
            self._structured.shutdown()
        release = getattr(self.runner, "release", None)  # a runner without it keeps its tensors until collected
        if release is not None:
            release()
        gc.unfreeze()  # see __init__: the engine's objects may be collected again
        gc.set_threshold(*self._gc_threshold)


def _by_status(finish: dict[str, RequestStatus]) -> dict[RequestStatus, list[str]]:
    grouped: dict[RequestStatus, list[str]] = {}
    for rid, status in finish.items():
        grouped.setdefault(status, []).append(rid)
    return grouped
