"""pagedllm.api.sched: What a scheduler plugin builds on: the bookkeeping base class, requests, the step's input and output messages.

Part of the plugin API (docs/plugins/api.md): covered by PLUGIN_API_VERSION.
"""

from __future__ import annotations

from pagedllm.engine.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sample.logits_processor import LogitsBatch, LogitsProcessor, LogitsProcessorContext
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.sched.base import SchedulerBase, SchedulerContext
from pagedllm.sched.stats import SchedulerStats

__all__ = [
    "LogitsBatch",
    "LogitsProcessor",
    "LogitsProcessorContext",
    "SchedulerContext",
    "EngineCoreOutput",
    "ModelRunnerOutput",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "StructuredOutputsParams",
    "SchedulerBase",
    "SchedulerOutput",
    "SchedulerStats",
]
