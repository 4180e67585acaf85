"""LLMEngine: the synchronous frontend — tokenize, hand requests to the core, turn outputs into text.

Shaped like vLLM's: add_request / step / abort_request / has_unfinished_requests.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from pagedllm.config import EngineConfig, flat_overrides
from pagedllm.default_model import DEFAULT_MODEL_ALIAS
from pagedllm.engine.builder import EngineParts, build_engine
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.input_processing import ModelLimits, PromptType, RequestBuilder
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.outputs import RequestOutput
from pagedllm.plugin_manager import PluginManager, get_plugin_manager
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.stats import SchedulerStats
from pagedllm.structured_output.selection import structured_outputs_check
from pagedllm.tracing import make_request_tracer


class LLMEngine:
    def __init__(self, config: EngineConfig, plugin_manager: PluginManager | None = None) -> None:
        self.config = config
        self.pm = plugin_manager or get_plugin_manager()
        # Plugin sections are validated (and `config_loaded` fires) before anything heavy is built.
        sections = self.pm.load_config(config)
        # Before the build: a missing OpenTelemetry install fails at once, not after the model has loaded.
        tracer = make_request_tracer(config.observability.otlp_traces_endpoint, config.model or DEFAULT_MODEL_ALIAS)
        self.parts: EngineParts = build_engine(config, self.pm, plugin_sections=sections)
        self.core = EngineCore(self.parts, self.pm)
        self.tokenizer = self.parts.info.tokenizer
        self.processor = OutputProcessor(self.tokenizer, tracer)
        self.requests = self._request_builder(ModelLimits.from_model(self.parts.info, self.parts.max_model_len))
        self._closed = False
        self.pm.hook.engine_started(engine=self)

    @classmethod
    def from_kwargs(cls, model: str | None = None, config: EngineConfig | str | None = None, **kwargs: Any) -> LLMEngine:
        """Build from a config object or file, with vLLM-style flat keyword overrides on top."""
        overrides = flat_overrides(**kwargs)
        if model is not None:
            overrides["model"] = model
        if isinstance(config, EngineConfig):
            # Not model_dump(): that would make every key look set, so none would be sized from the machine.
            cfg = EngineConfig.from_dict(config.to_process_dict(), overrides)
        elif config is not None:
            cfg = EngineConfig.from_file(config, overrides)
        else:
            cfg = EngineConfig.from_dict({}, overrides)
        if cfg.parallel.data_parallel_size > 1 and cls is LLMEngine:
            from pagedllm.engine.dp_engine import DataParallelLLMEngine  # imports this module

            return DataParallelLLMEngine(cfg)
        return cls(cfg)

    @property
    def max_model_len(self) -> int:
        return self.parts.max_model_len

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends a sequence unless ignore_eos (input_processing.py NOTE 1)."""
        return set(self.requests.limits.eos_token_ids)

    def _request_builder(self, limits: ModelLimits) -> RequestBuilder:
        # input_processing.py NOTE 2: a request the core can never run is accepted and fails alone.
        return RequestBuilder(self.tokenizer, limits, reject_unrunnable=False,
                              check_structured_outputs=structured_outputs_check(self.pm, self.config))

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.requests.tokenize(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request. Malformed prompts (and ids in use) raise RequestValidationError, a ValueError; ones
        the core can never run (too long for the context) are accepted and then finish with finish_reason
        "error" and a message, alone (input_processing.py NOTE 2)."""
        if self._closed:
            raise RuntimeError("this engine was shut down; build a new LLM / LLMEngine to run more requests")
        prepared = self.requests.build(
            request_id, prompt, params, in_use=self.processor.requests, arrival_time=arrival_time, priority=priority
        )
        self.processor.add_request(
            request_id, prepared.prompt, prepared.prompt_token_ids, prepared.samples, prepared.arrival_time
        )
        for request in prepared.core_requests:
            self.pm.hook.request_added(request=request)
            self.core.add_request(request)

    def step(self) -> list[RequestOutput]:
        outputs, to_abort = self.processor.process(self.core.step())
        if to_abort:
            self.core.abort_requests(to_abort)
        for out in outputs:
            if out.finished:
                self.pm.hook.request_finished(output=out)
        return outputs

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            core_ids = self.processor.core_ids(rid)
            self.core.abort_requests(core_ids)
            out = self.processor.abort(rid)
            if out is not None:
                self.pm.hook.request_finished(output=out)

    def has_unfinished_requests(self) -> bool:
        return self.processor.has_unfinished() or self.core.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.core.get_stats()

    @property
    def kv_cache_usage(self) -> float:
        return self.parts.kv_cache_manager.usage

    def shutdown(self) -> None:
        """Fire engine_stopped, stop the core and free the model's device memory (the runner drops its model,
        KV cache and graphs; `parts.model` goes too), even while this object is still referenced."""
        if not self._closed:
            self._closed = True
            self.pm.hook.engine_stopped(engine=self)
            self.core.shutdown()
            if self.processor.tracer is not None:
                self.processor.tracer.shutdown()  # what is still batched goes out now
            if self.parts is None:  # a data-parallel front end: the replicas hold the models
                return
            self.parts.model = None
            gc.collect()  # the model's reference cycles (modules <-> hooks) hold its tensors otherwise
            if self.parts.device.type == "cuda":
                torch.cuda.empty_cache()
