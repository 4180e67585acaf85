"""AsyncLLM: the asyncio frontend of an engine core that runs in its own process (vLLM V1's serving shape).

    generate(prompt, params, id) ──▶ tokenize, validate, fan out n samples ──▶ EngineCoreClient (ZMQ)
            ▲                                                                          │
            └── per-request OutputCollector ◀── OutputProcessor (detokenize, stops) ◀──┘ Outputs per step

The tokenizer, chat template and detokenizer live here, in the API process; the core only sees token ids.
`generate` yields *deltas*: each RequestOutput carries, per sample that changed, only the new text, token
ids and logprobs, so a streaming server writes them straight out and a non-streaming one concatenates them
(streamed and non-streamed text are then equal by construction). Deltas a slow consumer has not yet taken are
merged into one (output_collector.py).

NOTE(1): leaving the `async for` early (a client disconnect cancels the task) aborts the request in the core,
which frees its KV blocks.
NOTE(2): the waiting-queue bound is enforced here, where it can be answered at once: sequences in flight
beyond `max_num_seqs` are the ones waiting, and more than the bound (admission.py) of them is QueueFullError.
NOTE(3): supervision. A dead core fails every pending request at once (EngineDeadError), zeroes the stats
(nothing runs any more, and frozen gauges would say otherwise) and calls `death_listeners`; what happens next
is the entrypoint's policy: `restart()` spawns a fresh core (new sockets, new folder), or the process exits.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.default_model import DEFAULT_MODEL_ALIAS, resolve_model_reference
from pagedllm.engine.admission import AdmissionLimits, resolve_max_waiting
from pagedllm.engine.core_client import EngineCoreClient, EngineDeadError
from pagedllm.engine.encoder_decoder_prompt import ENCODER_IDS_KEY
from pagedllm.engine.engine_watch import EngineSnapshot
from pagedllm.engine.input_processing import ModelLimits, PromptType, RequestBuilder, RequestValidationError
from pagedllm.engine.output_collector import OutputCollector
from pagedllm.engine.output_processor import IterationStats, OutputProcessor
from pagedllm.engine.serialization import Outputs, Ready
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.plugin_manager import PluginManager, get_plugin_manager
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.stats import SchedulerStats
from pagedllm.structured_output.selection import structured_outputs_check
from pagedllm.tracing import make_request_tracer

logger = logging.getLogger("pagedllm")


__all__ = ["AdmissionLimits", "AsyncLLM", "EngineDeadError", "QueueFullError", "RequestTimeoutError",
           "RequestValidationError"]


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound (admission.py); retry later."""


class RequestTimeoutError(RuntimeError):
    """The request ran past `AdmissionLimits.request_timeout_s`; it was aborted in the core."""


@dataclass
class _Stream:
    """One request's queue and how much of each sample has been handed out already."""

    request_id: str
    samples: list[Any]  # the OutputProcessor's _Sample objects, by index
    # Deltas not yet taken by generate()'s caller, merged while it is behind (output_collector.py).
    output: OutputCollector = field(default_factory=OutputCollector)
    sent_tokens: list[int] = field(default_factory=list)
    sent_logprobs: list[int] = field(default_factory=list)
    reported_finish: list[bool] = field(default_factory=list)
    finished: bool = False


class AsyncLLM:
    def __init__(
        self, config: EngineConfig, plugin_manager: PluginManager | None = None, served_model_name: str | None = None,
        limits: AdmissionLimits | None = None,
    ) -> None:
        from pagedllm.engine.builder import select_loader

        self.config = config
        self.pm = plugin_manager or get_plugin_manager()
        # Validated here too, so a bad plugin section fails before the engine-core process is spawned.
        self.pm.load_config(config)
        self.model_name = served_model_name or config.model or DEFAULT_MODEL_ALIAS
        # First: a missing OpenTelemetry install fails before anything is loaded or spawned.
        tracer = make_request_tracer(config.observability.otlp_traces_endpoint, self.model_name)
        model_ref = resolve_model_reference(config.model)
        # The same loader plugin the core uses, but only for config and tokenizer: no weights here.
        loader = select_loader(self.pm, config, model_ref).load()()
        self.model_info = loader.load_info(model_ref, config.tokenizer)
        self.tokenizer = self.model_info.tokenizer
        # A chat template replacing the model's own for every request (vLLM's --chat-template); None: the model's.
        self.chat_template: str | None = None
        self.processor = OutputProcessor(self.tokenizer, tracer)
        self.client = EngineCoreClient(config, self._on_outputs, self._on_death)
        self.limits = limits or AdmissionLimits()
        self.max_waiting: int | None = None  # resolved once the core has said its KV capacity
        self.max_num_seqs = config.scheduler.max_num_seqs  # the core's, once it has said (start())
        self.restarts = 0  # engine-core processes spawned after the first (NOTE 3)
        # Called with the reason when the core dies (NOTE 3); the entrypoint decides: restart or exit.
        self.death_listeners: list[Callable[[str], None]] = []
        self.stats = SchedulerStats()
        self.stats_time = 0.0
        # The core's latest dashboard snapshot (engine_watch.py), while watch_engine() asked for them.
        self.snapshot: EngineSnapshot | None = None
        self._watch_interval = 0.0
        # Called with the final cumulative RequestOutput of every request (finished, aborted or failed).
        self.finished_listeners: list[Callable[[RequestOutput], None]] = []
        # Called after each engine-core step that produced outputs, with its tokens (vllm:iteration_tokens_total).
        self.iteration_listeners: list[Callable[[IterationStats], None]] = []
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._ready: Ready | None = None
        self._requests: RequestBuilder | None = None  # built once the core has said its max_model_len

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> Ready:
        self._ready = await self.client.start()
        # input_processing.py NOTE 2: the server answers a request the core could never run at once.
        limits = ModelLimits.from_model(self.model_info, self._ready.max_model_len)
        self._requests = RequestBuilder(self.tokenizer, limits, reject_unrunnable=True,
                                        check_structured_outputs=structured_outputs_check(self.pm, self.config))
        sched = self.config.scheduler
        # The core's own batch limit: on the CPU it may be sized from the machine there (Ready.max_num_seqs).
        self.max_num_seqs = self._ready.max_num_seqs or sched.max_num_seqs
        self.max_waiting = resolve_max_waiting(
            self.limits, sched.max_waiting, self.max_num_seqs, self._ready.num_blocks, self._ready.block_size,
            self._ready.max_model_len,
        )
        self.pm.hook.engine_started(engine=self)
        return self._ready

    async def restart(self) -> Ready:
        """A fresh engine-core process after the last one died (NOTE 3); raises EngineDeadError if it fails."""
        if self.client.dead_reason is None:
            raise RuntimeError("restart() is for a dead engine core; this one is running")
        await self.client.shutdown()  # the dead one's sockets and ipc folder
        self.client = EngineCoreClient(self.config, self._on_outputs, self._on_death)
        self._ready = await self.client.start()
        self.restarts += 1
        if self._watch_interval:  # a dashboard was watching the core that died: the new one is watched too
            self.client.watch(self._watch_interval)
        return self._ready

    def watch_engine(self, interval_s: float) -> None:
        """Have the core attach an EngineSnapshot to its outputs at most every `interval_s` (kept in
        `snapshot`); 0 stops it, and the core then records nothing for it (engine_watch.py)."""
        self._watch_interval = interval_s
        if not interval_s:
            self.snapshot = None
        self.client.watch(interval_s)

    async def shutdown(self) -> None:
        if self._ready is not None and not self.client._closed:
            self.pm.hook.engine_stopped(engine=self)
        # Nothing may wait on a core that is going away: pending requests end now, with a clear error.
        self.fail_all(lambda: EngineDeadError("the engine core was shut down"))
        await self.client.shutdown()
        if self.processor.tracer is not None:
            self.processor.tracer.shutdown()  # what is still batched goes out now

    def fail_all(self, make_error: Callable[[], BaseException]) -> int:
        """End every pending request with a fresh `make_error()` (raised from its generate(); one object per
        request, since each raise writes its own traceback into it), aborting it in the core. Returns how
        many requests were pending."""
        pending = list(self._streams)
        for rid in pending:
            stream = self._streams[rid]
            stream.output.put(make_error())
            self.abort(rid)
        return len(pending)

    @property
    def ready(self) -> Ready:
        if self._ready is None:
            raise EngineDeadError("the engine core has not started")
        return self._ready

    @property
    def healthy(self) -> bool:
        return self._ready is not None and self.client.alive

    @property
    def dead_reason(self) -> str | None:
        return self.client.dead_reason

    @property
    def max_model_len(self) -> int:
        return self.ready.max_model_len

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    @property
    def num_unfinished_sequences(self) -> int:
        return sum(1 for s in self._streams.values() for x in s.samples if x.finish_reason is None)

    # -- prompts -------------------------------------------------------------------------------------------

    @property
    def requests(self) -> RequestBuilder:
        """The request builder shared with LLMEngine (input_processing.py); there once the core is ready."""
        if self._requests is None:
            raise EngineDeadError("the engine core has not started")
        return self._requests

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids) for a string, a list of ids or {"prompt_token_ids": [...]}."""
        return self.requests.tokenize(prompt)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None, *, continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of `messages` through the chat template; `tools` (OpenAI tool objects) are handed to the
        template, which renders them as the model was trained to see them (a template without tool support
        ignores them, as transformers does). `continue_final_message` leaves the last message open, so the
        model continues it; `template_kwargs` are extra template variables (vLLM's chat_template_kwargs)."""
        if self.tokenizer is None:
            raise RequestValidationError("this model has no tokenizer, so it has no chat template", "messages")
        if continue_final_message and add_generation_prompt:
            raise RequestValidationError(
                "continue_final_message and add_generation_prompt cannot both be true (set add_generation_prompt "
                "to false to continue the last message)", "continue_final_message")
        reserved = sorted(set(template_kwargs or {}) & {"messages", "tools", "add_generation_prompt", "tokenize",
                                                         "chat_template", "continue_final_message"})
        if reserved:
            raise RequestValidationError(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                chat_template=chat_template or self.chat_template, tools=tools,
                continue_final_message=continue_final_message, **(template_kwargs or {}),
            )
        except Exception as exc:  # a template error is the caller's messages (roles, content) being off
            raise RequestValidationError(f"the chat template could not be applied: {exc}", "messages") from exc
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    # -- requests ---------------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        prompt_param: str = "prompt",
        trace_headers: Mapping[str, str] | None = None,
    ) -> _Stream:
        """Tokenize, validate and queue; raises at once (RequestValidationError, QueueFullError, EngineDeadError).
        `trace_headers` (W3C traceparent / tracestate) make the request's trace a child of the caller's."""
        if self.client.dead_reason is not None:
            raise EngineDeadError(self.client.dead_reason)
        bound = self.max_waiting
        if bound is not None and self.num_unfinished_sequences + params.n > self.max_num_seqs + bound:
            raise QueueFullError(f"the waiting queue is full ({bound} requests waiting); retry later")
        if self.limits.max_tokens is not None:
            prompt, params = self._within_max_tokens(prompt, params, self.limits.max_tokens)
        prepared = self.requests.build(
            request_id, prompt, params, in_use=self._streams, priority=priority, prompt_param=prompt_param
        )
        num_samples = len(prepared.samples)
        self.processor.add_request(
            request_id, prepared.prompt, prepared.prompt_token_ids, prepared.samples, prepared.arrival_time,
            trace_headers=trace_headers,
        )
        state = self.processor.requests[request_id]
        stream = _Stream(request_id, sorted(state.samples.values(), key=lambda s: s.index))
        stream.sent_tokens = [0] * num_samples
        stream.sent_logprobs = [0] * num_samples
        stream.reported_finish = [False] * num_samples
        self._streams[request_id] = stream
        try:
            for request in prepared.core_requests:
                self._notify_added(request)
                self.client.add_request(request)
        except EngineDeadError:
            self._streams.pop(request_id, None)
            self.processor.abort(request_id)
            raise
        return stream

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str | None = None, priority: int = 0,
        prompt_param: str = "prompt", trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's deltas until it finishes. Errors (validation, queue full, engine dead) are raised
        on the first iteration; a failed request raises EngineDeadError or ends with `error` set."""
        rid = request_id or f"req-{next(self._ids)}"
        stream = self.add_request(rid, prompt, params, priority, prompt_param, trace_headers)
        timeout = self.limits.request_timeout_s
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        try:
            while True:
                try:
                    # Only the wait is timed, never the consumer's work between items (a generator's caller).
                    async with asyncio.timeout_at(deadline):
                        item = await stream.output.get()
                except TimeoutError:
                    raise RequestTimeoutError(
                        f"the request did not finish within the server's {timeout:g}s request timeout"
                    ) from None
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(rid)

    def _within_max_tokens(
        self, prompt: PromptType, params: SamplingParams, ceiling: int
    ) -> tuple[PromptType, SamplingParams]:
        """An explicit max_tokens above the ceiling is the caller's error; an absent one becomes the ceiling,
        or the rest of the context if that is less (the prompt is tokenized once, here, to know)."""
        if params.max_tokens is not None:
            if params.max_tokens > ceiling:
                raise RequestValidationError(
                    f"max_tokens ({params.max_tokens}) exceeds this server's limit of {ceiling} tokens per request",
                    "max_tokens",
                )
            return prompt, params
        decoder_prompt, encoder_ids = self.requests.split_prompt(prompt)  # (prompt, None): decoder-only
        text, ids = self.requests.tokenize(decoder_prompt)
        params = params.clone()
        params.max_tokens = max(1, min(ceiling, self.ready.max_model_len - len(ids)))
        if encoder_ids is not None:
            return {"prompt": text, "prompt_token_ids": ids, ENCODER_IDS_KEY: encoder_ids}, params
        return {"prompt": text, "prompt_token_ids": ids}, params

    def abort(self, request_id: str) -> None:
        """Abort a request in the core (its blocks are freed) and forget it here."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.finished = True
        self.client.abort(self.processor.core_ids(request_id))
        out = self.processor.abort(request_id)
        if out is not None:
            self._notify_finished(out)

    # -- from the engine core ----------------------------------------------------------------------------------

    def _on_outputs(self, msg: Outputs) -> None:
        if msg.stats is not None:
            self.stats, self.stats_time = msg.stats, time.monotonic()
        if msg.snapshot is not None and self._watch_interval:
            self.snapshot = msg.snapshot
        if not msg.outputs:
            return
        outputs, to_abort = self.processor.process(msg.outputs)
        if to_abort:  # stop strings found here end sequences the core still runs
            self.client.abort(to_abort)
        for iteration_listener in self.iteration_listeners:
            try:
                iteration_listener(self.processor.last_iteration)
            except Exception:  # metrics must never break serving
                logger.exception("iteration listener failed")
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.output.put(self._delta(stream, out))
            if out.finished:
                stream.finished = True
                del self._streams[out.request_id]
                self._notify_finished(out)

    def _on_death(self, reason: str) -> None:
        for rid, stream in list(self._streams.items()):
            stream.finished = True
            stream.output.put(EngineDeadError(f"the engine core died: {reason}"))
            out = self.processor.abort(rid)
            if out is not None:
                self._notify_finished(out)
        self._streams.clear()
        self.stats, self.stats_time = SchedulerStats(), time.monotonic()
        self.snapshot = None
        for listener in self.death_listeners:
            try:
                listener(reason)
            except Exception:  # one listener's bug must not stop the others (the restart policy among them)
                logger.exception("engine death listener failed")

    def _notify_added(self, request: Request) -> None:
        try:
            self.pm.hook.request_added(request=request)
        except Exception:  # a plugin's hook must never break serving
            logger.exception("request_added hook failed")

    def _notify_finished(self, out: RequestOutput) -> None:
        try:
            self.pm.hook.request_finished(output=out)
        except Exception:  # a plugin's hook must never break serving
            logger.exception("request_finished hook failed")
        for listener in self.finished_listeners:
            try:
                listener(out)
            except Exception:  # metrics must never break serving
                logger.exception("finished listener failed")

    @staticmethod
    def _delta(stream: _Stream, out: RequestOutput) -> RequestOutput:
        """The part of `out` not yet handed out: per changed sample, new text / ids / logprobs."""
        deltas = []
        for i, s in enumerate(stream.samples):
            done = s.finish_reason is not None
            text = s.detokenizer.get_next_output_text(done, delta=True)
            ids = s.token_ids[stream.sent_tokens[i]:]
            stream.sent_tokens[i] = len(s.token_ids)
            lps = None
            if s.logprobs is not None:
                lps = s.logprobs[stream.sent_logprobs[i]:]
                stream.sent_logprobs[i] = len(s.logprobs)
            newly_done = done and not stream.reported_finish[i]
            if text or ids or newly_done:
                stream.reported_finish[i] = done
                deltas.append(
                    CompletionOutput(s.index, text, ids, s.cumulative_logprob, lps, s.finish_reason, s.stop_reason)
                )
        return RequestOutput(
            out.request_id, out.prompt, out.prompt_token_ids, deltas, out.finished, out.num_cached_tokens,
            out.metrics, out.error, out.prompt_logprobs,
        )


