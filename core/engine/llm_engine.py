"""LLMEngine: the synchronous frontend — tokenize, hand requests to the core, turn outputs into text.

Shaped like vLLM's: add_request / step / abort_request / has_unfinished_requests.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from pagedllm.config import EngineConfig, flat_overrides
from pagedllm.engine.builder import EngineParts, build_engine
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.input_processing import PromptType, complete_params, fan_out, tokenize_prompt
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.outputs import RequestOutput
from pagedllm.plugin_manager import PluginManager, get_plugin_manager
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.stats import SchedulerStats


class LLMEngine:
    def __init__(self, config: EngineConfig, plugin_manager: PluginManager | None = None) -> None:
        self.config = config
        self.pm = plugin_manager or get_plugin_manager()
        # Plugin sections are validated (and `config_loaded` fires) before anything heavy is built.
        sections = self.pm.load_config(config)
        self.parts: EngineParts = build_engine(config, self.pm)
        self.core = EngineCore(self.parts, self.pm, sections)
        self.tokenizer = self.parts.info.tokenizer
        self.processor = OutputProcessor(self.tokenizer)
        self.eos_token_ids = self._eos_ids()
        self._closed = False
        self.pm.hook.engine_started(engine=self)

    @classmethod
    def from_kwargs(cls, model: str | None = None, config: EngineConfig | str | None = None, **kwargs: Any) -> LLMEngine:
        """Build from a config object or file, with vLLM-style flat keyword overrides on top."""
        overrides = flat_overrides(**kwargs)
        if model is not None:
            overrides["model"] = model
        if isinstance(config, EngineConfig):
            cfg = EngineConfig.from_dict(config.model_dump(), overrides)
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

    def _eos_ids(self) -> set[int]:
        ids = set(self.parts.info.eos_token_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None:
            ids.add(int(eos))
        return ids

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request. Malformed prompts raise ValueError; ones the core can never run (too long for the
        context) are accepted and then finish with finish_reason "error" and a message, alone."""
        if self._closed:
            raise RuntimeError("this engine was shut down; build a new LLM / LLMEngine to run more requests")
        if request_id in self.processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text, prompt_ids = self.tokenize(prompt)
        params = complete_params(params, len(prompt_ids), self.max_model_len, self.eos_token_ids)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        samples = fan_out(request_id, params)
        self.processor.add_request(request_id, prompt_text, prompt_ids, samples, arrival)
        for core_id, child in samples:
            request = Request(core_id, prompt_ids, child, arrival_time=arrival, priority=priority,
                              eos_token_id=next(iter(self.eos_token_ids), None))
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
            if self.parts is None:  # a data-parallel front end: the replicas hold the models
                return
            self.parts.model = None
            gc.collect()  # the model's reference cycles (modules <-> hooks) hold its tensors otherwise
            if self.parts.device.type == "cuda":
                torch.cuda.empty_cache()
