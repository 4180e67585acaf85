"""DataParallelLLMEngine: the LLMEngine frontend over N engine replicas (parallel.data_parallel_size > 1).

Tokenizing, detokenizing and the request bookkeeping stay here, in the caller's process; the core is the
executor plugin's data-parallel core (the `ray` executor's: replicas as Ray actors behind a balancer), which
offers the EngineCore surface: add_request, abort_requests, step, has_unfinished_requests, get_stats,
shutdown. The model is never built in this process, only its config and tokenizer are read.
"""

from __future__ import annotations

from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.default_model import resolve_model_reference
from pagedllm.engine.builder import select_loader
from pagedllm.engine.input_processing import ModelLimits
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.plugin_manager import PluginManager, get_plugin_manager
from pagedllm.plugin_spec import PluginKind
from pagedllm.protocols.loader import LoadedModelInfo
from pagedllm.selector import Selection, select


def build_data_parallel_core(config: EngineConfig, pm: PluginManager) -> tuple[Any, LoadedModelInfo, Selection]:
    """The executor plugin's data-parallel core, the model's info (config, tokenizer; no weights) and the
    executor selection. Shared by the offline frontend and the server's engine-core process."""
    parallel = config.parallel
    if config.observability.otlp_traces_endpoint:
        # Replicas may run on other hosts, whose monotonic clocks a request's timeline cannot compare with the
        # frontend's (request.py EngineCoreEvent).
        raise ValueError("observability.otlp_traces_endpoint: tracing is not supported with "
                         "parallel.data_parallel_size > 1")
    selection = select(pm, PluginKind.EXECUTOR, parallel, requested=parallel.executor)
    factory = getattr(selection.load(), "data_parallel_core", None)
    if factory is None:
        raise ValueError(
            f"parallel.data_parallel_size {parallel.data_parallel_size} needs an executor that runs replicas "
            f"(ray); '{selection.winner.name}' runs one"
        )
    model_ref = resolve_model_reference(config.model)
    info = select_loader(pm, config, model_ref).load()().load_info(model_ref, config.tokenizer)
    return factory(config), info, selection


class DataParallelLLMEngine(LLMEngine):
    def __init__(self, config: EngineConfig, plugin_manager: PluginManager | None = None) -> None:
        self.config = config
        self.pm = plugin_manager or get_plugin_manager()
        self.pm.load_config(config)
        core, self.info, self.executor_selection = build_data_parallel_core(config, self.pm)
        self.parts = None  # type: ignore[assignment]  # no local model: the replicas hold the engines
        # The data-parallel core (an executor plugin's, e.g. Ray replicas): EngineCore's methods plus the
        # replicas' common max_model_len.
        self.core: Any = core
        self.tokenizer = self.info.tokenizer
        self.processor = OutputProcessor(self.tokenizer)
        self.requests = self._request_builder(ModelLimits.from_model(self.info, self.max_model_len))
        self._closed = False
        self.pm.hook.engine_started(engine=self)

    @property
    def max_model_len(self) -> int:
        return int(self.core.max_model_len)

    @property
    def kv_cache_usage(self) -> float:
        return float(self.core.get_stats().kv_cache_usage)

    def replica_core(self) -> Any:
        """The data-parallel core (balancer, replicas, per-replica counts)."""
        return self.core
