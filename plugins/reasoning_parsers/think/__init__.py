"""Registers the `deepseek_r1` and `qwen3` reasoning parsers: `<think>reasoning</think>content`."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterReasoningParser, hookimpl


def _deepseek_r1() -> Any:
    from pagedllm.plugins.reasoning_parsers.think.parsers import DeepSeekR1ReasoningParser

    return DeepSeekR1ReasoningParser


def _qwen3() -> Any:
    from pagedllm.plugins.reasoning_parsers.think.parsers import Qwen3ReasoningParser

    return Qwen3ReasoningParser


@hookimpl
def register_reasoning_parsers(register: RegisterReasoningParser) -> None:
    register("deepseek_r1", _deepseek_r1,
             description="DeepSeek-R1: text before </think> is reasoning (the template may open <think>)")
    register("qwen3", _qwen3, description="Qwen3: <think>reasoning</think>content; no <think>: all content")
