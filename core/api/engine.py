"""pagedllm.api.engine: What an entrypoint (server) or command plugin builds on: the engine config, the async and offline frontends, sampling parameters, outputs, errors, the CPU's features.

Part of the plugin API (docs/plugins/api.md): covered by PLUGIN_API_VERSION.
"""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.engine.async_llm import (
    AdmissionLimits,
    AsyncLLM,
    EngineDeadError,
    QueueFullError,
    RequestTimeoutError,
    RequestValidationError,
)
from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchSequence, beam_search_async
from pagedllm.engine.builder import build_engine, resolve_device
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.engine.engine_watch import EngineSnapshot, RequestTimeline, StepRecord
from pagedllm.engine.llm import LLM
from pagedllm.engine.output_processor import IterationStats
from pagedllm.kv_cache.pool_snapshot import KVPoolSnapshot
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.platform.cpu_features import CPUFeatures, cpu_features
from pagedllm.plugin_manager import get_plugin_manager
from pagedllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__all__ = [
    "AdmissionLimits",
    "EngineInfo",
    "AsyncLLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CPUFeatures",
    "EngineConfig",
    "EngineCore",
    "EngineDeadError",
    "EngineSnapshot",
    "IterationStats",
    "KVPoolSnapshot",
    "LLM",
    "Logprob",
    "QueueFullError",
    "RequestOutput",
    "RequestTimeline",
    "RequestTimeoutError",
    "RequestValidationError",
    "SamplingParams",
    "StepRecord",
    "StructuredOutputsParams",
    "beam_search_async",
    "build_engine",
    "cpu_features",
    "get_plugin_manager",
    "resolve_device",
]
