"""The `<think>...</think>` reasoning parsers of DeepSeek-R1 and Qwen3 (vLLM's deepseek_r1 and qwen3).

They differ on an output without the start tag. DeepSeek-R1's newer chat templates end the prompt with
`<think>\\n`, so the model's text starts inside the reasoning: everything before `</think>` is reasoning, and
an output that never closes it is all reasoning. Qwen3 writes `<think>` itself when it thinks (and nothing
when thinking is switched off), so an output not starting with it is all content.
"""

from __future__ import annotations

from typing import ClassVar

from pagedllm.api.parsers import ThinkTagReasoningParser


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    start_optional: ClassVar[bool] = True


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    start_optional: ClassVar[bool] = False
