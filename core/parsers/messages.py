"""The values parsers return: whole tool calls, streamed tool-call deltas, and a streamed message delta.

Shaped after OpenAI's chat objects (`message.tool_calls[i].function.{name, arguments}`; streamed
`delta.tool_calls[i]` with `index`, the `id` and name once, then `arguments` fragments), but plain dataclasses:
the server turns them into its wire models.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


def new_tool_call_id() -> str:
    """A fresh OpenAI-style tool call id (`call_` and 24 hex digits, as vLLM makes them)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One complete call: `arguments` is the JSON text of the arguments object (what OpenAI sends)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_tool_call_id)
    type: str = "function"


@dataclass
class ExtractedToolCalls:
    """A whole output split into tool calls and the text around them (`content`, None when there is none)."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass
class ToolCallDelta:
    """One streamed piece of call `index`: its first piece has `id` and `name`, later ones `arguments` text.

    Concatenating a call's `arguments` pieces gives the whole call's `arguments`.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None
    type: str | None = None


@dataclass
class DeltaMessage:
    """What one streamed step adds to the message: content, reasoning text, tool-call pieces (any may be empty)."""

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.content and not self.reasoning_content and not self.tool_calls
