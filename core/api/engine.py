"""pagedllm.api.engine: What an entrypoint (server) plugin builds on: the engine config, the async frontend, outputs, errors.

Part of the plugin API (docs/plugins/api.md): covered by PLUGIN_API_VERSION.
"""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError, RequestValidationError
from pagedllm.engine.builder import build_engine, resolve_device
from pagedllm.engine.engine_core import EngineCore
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.plugin_manager import get_plugin_manager

__all__ = [
    "AsyncLLM",
    "EngineConfig",
    "EngineCore",
    "EngineDeadError",
    "Logprob",
    "QueueFullError",
    "RequestOutput",
    "RequestValidationError",
    "build_engine",
    "get_plugin_manager",
    "resolve_device",
]
