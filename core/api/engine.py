"""pagedllm.api.engine: What an entrypoint (server) or command plugin builds on: the engine config, the async and offline frontends, sampling parameters, outputs, errors.

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
from pagedllm.engine.builder import build_engine, resolve_device
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.engine.llm import LLM
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.plugin_manager import get_plugin_manager
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "AdmissionLimits",
    "EngineInfo",
    "AsyncLLM",
    "EngineConfig",
    "EngineCore",
    "EngineDeadError",
    "LLM",
    "Logprob",
    "QueueFullError",
    "RequestOutput",
    "RequestTimeoutError",
    "RequestValidationError",
    "SamplingParams",
    "StructuredOutputsParams",
    "build_engine",
    "get_plugin_manager",
    "resolve_device",
]
