"""pagedllm's conformance kit: ready-made checks a plugin author runs against their component.

Each check is a plain function that drives one component -- reached through the plugin manager by kind and
registered name, exactly as the engine reaches it -- and raises AssertionError with a message saying what is
wrong. They can be called from any test (pytest, unittest, a script)::

    from pagedllm.testing import check_attention_backend
    check_attention_backend("my_backend")

A component that cannot run on this machine (its registration check refuses every case) raises
`NotApplicable`, a `unittest.SkipTest`, which pytest and unittest report as a skip.

Installing pagedllm also installs a pytest plugin (`pagedllm.testing.pytest_plugin`, entry point group
`pytest11`) with fixtures for these checks; see docs/plugins/conformance.md.

Light on purpose: this module and the pytest plugin import no torch; each check module imports it when used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.testing.attention import AttentionCase, AttentionReport, check_attention_backend
    from pagedllm.testing.components import NotApplicable
    from pagedllm.testing.engine_kinds import (
        ExecutorReport,
        LogitsProcessorReport,
        ProposerReport,
        check_command,
        check_entrypoint,
        check_executor,
        check_logits_processor,
        check_proposer,
    )
    from pagedllm.testing.kv_manager import KVManagerReport, check_kv_manager
    from pagedllm.testing.loader import LoaderReport, check_loader
    from pagedllm.testing.model import ModelReport, check_model_architecture
    from pagedllm.testing.parsers import (
        ParserReport,
        ReasoningParserCase,
        ToolParserCase,
        check_reasoning_parser,
        check_tool_parser,
    )
    from pagedllm.testing.quantization import QuantizationReport, check_quantization_method
    from pagedllm.testing.scheduler import SchedulerReport, check_scheduler
    from pagedllm.testing.structured_output import (
        StructuredOutputReport,
        check_structured_output_backend,
        small_tokenizer,
    )
    from pagedllm.testing.tiny import save_tiny_model, tiny_hf_config

__all__ = [
    "AttentionCase",
    "AttentionReport",
    "ExecutorReport",
    "KVManagerReport",
    "LoaderReport",
    "LogitsProcessorReport",
    "ModelReport",
    "NotApplicable",
    "ParserReport",
    "ProposerReport",
    "QuantizationReport",
    "ReasoningParserCase",
    "SchedulerReport",
    "StructuredOutputReport",
    "ToolParserCase",
    "check_attention_backend",
    "check_command",
    "check_entrypoint",
    "check_executor",
    "check_kv_manager",
    "check_loader",
    "check_logits_processor",
    "check_model_architecture",
    "check_proposer",
    "check_quantization_method",
    "check_reasoning_parser",
    "check_scheduler",
    "check_structured_output_backend",
    "check_tool_parser",
    "save_tiny_model",
    "small_tokenizer",
    "tiny_hf_config",
]

# Public name -> the module holding it; imported on first access (PEP 562), so `import pagedllm.testing`
# costs nothing in a pytest run that never calls a check.
_LAZY = {
    "AttentionCase": "attention",
    "AttentionReport": "attention",
    "check_attention_backend": "attention",
    "NotApplicable": "components",
    "ExecutorReport": "engine_kinds",
    "LogitsProcessorReport": "engine_kinds",
    "ProposerReport": "engine_kinds",
    "check_command": "engine_kinds",
    "check_entrypoint": "engine_kinds",
    "check_executor": "engine_kinds",
    "check_logits_processor": "engine_kinds",
    "check_proposer": "engine_kinds",
    "KVManagerReport": "kv_manager",
    "check_kv_manager": "kv_manager",
    "LoaderReport": "loader",
    "check_loader": "loader",
    "ModelReport": "model",
    "check_model_architecture": "model",
    "ParserReport": "parsers",
    "ReasoningParserCase": "parsers",
    "ToolParserCase": "parsers",
    "check_reasoning_parser": "parsers",
    "check_tool_parser": "parsers",
    "QuantizationReport": "quantization",
    "check_quantization_method": "quantization",
    "SchedulerReport": "scheduler",
    "check_scheduler": "scheduler",
    "StructuredOutputReport": "structured_output",
    "check_structured_output_backend": "structured_output",
    "small_tokenizer": "structured_output",
    "save_tiny_model": "tiny",
    "tiny_hf_config": "tiny",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pagedllm.testing.{module}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
