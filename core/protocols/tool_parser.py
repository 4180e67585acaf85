"""Tool-parser protocol: turns a chat model's text into OpenAI `tool_calls` (vLLM's ToolParser, by text).

Light (no torch): the API process builds one parser per chat request, `cls(ToolParserContext)`, and calls
either `extract_tool_calls` once on the whole output or `extract_tool_calls_streaming` once per streamed step
(a parser is stateful while streaming: it remembers what it already sent). The deltas a stream returns must
concatenate to what `extract_tool_calls` gives for the same text; `pagedllm.testing.check_tool_parser`
checks that on a corpus, at every split point. `pagedllm.api.parsers.IncrementalToolParser` gives both
methods from one prefix parse.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from pagedllm.parsers.messages import DeltaMessage, ExtractedToolCalls


@dataclass(frozen=True)
class ToolParserContext:
    """What a tool parser is built with: the model's tokenizer (None when it has none) and the request's tools.

    `tools` are OpenAI tool objects as the client sent them: `{"type": "function", "function": {"name",
    "description", "parameters"}}`.
    """

    tokenizer: Any
    tools: list[dict[str, Any]] = field(default_factory=list)


class ToolParser(Protocol):
    """What a tool-parser registration's `load()` returns: a class built as `cls(ToolParserContext)`."""

    # True when the markers it reads are special tokens (Mistral's [TOOL_CALLS]): the server then keeps
    # special tokens in the text of requests that carry tools.
    keep_special_tokens: ClassVar[bool]

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        """Split a whole output into tool calls (each with its `arguments` as JSON text) and content.

        An output that holds no call, or a malformed one, is all content (`tools_called` False).
        """
        ...

    def extract_tool_calls_streaming(
        self, previous_text: str, current_text: str, delta_text: str, finished: bool = False
    ) -> DeltaMessage | None:
        """What this step adds: content, and tool-call pieces (a call's `id` and name first, then arguments).

        `current_text` is `previous_text + delta_text`, the output so far; `finished` is True on the last
        call of the request (send what was held back). None when this step adds nothing yet.
        """
        ...
