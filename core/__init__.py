"""pagedllm: a paged-KV-cache LLM inference engine built from plugins.

The public API is small and imported lazily, so `import pagedllm` (and `pagedllm plugins`) stays fast and
never pulls in torch until an engine is actually built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.hookspecs import hookimpl

__version__ = "0.1.0"
# The plugin API's version (semver over pagedllm.api; plugins declare the majors they support).
from pagedllm.api import API_VERSION, PLUGIN_API_VERSION  # noqa: E402

__all__ = ["LLM", "SamplingParams", "EngineConfig", "LLMEngine", "RequestOutput", "hookimpl", "PLUGIN_API_VERSION", "API_VERSION"]

_LAZY = {
    "LLM": "pagedllm.engine.llm",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "SamplingParams": "pagedllm.sampling_params",
    "EngineConfig": "pagedllm.config",
    "RequestOutput": "pagedllm.outputs",
}

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm import LLM
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.outputs import RequestOutput
    from pagedllm.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
