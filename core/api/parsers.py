"""pagedllm.api.parsers: What tool-call and reasoning parser plugins (and the server using them) build on.

Part of the plugin API (docs/plugins/api.md): covered by PLUGIN_API_VERSION. Light (no torch): parsers run
in the API process. The protocols, the values they return, the JSON scanner for text still arriving, the
base classes that make streamed deltas agree with the whole result, and what tool_choice "required" or a
named function needs (its JSON schema and its parser).
"""

from __future__ import annotations

from pagedllm.parsers.incremental import (
    IncrementalReasoningParser,
    IncrementalToolParser,
    PartialToolCall,
    ReasoningPrefix,
    ThinkTagReasoningParser,
    ToolPrefix,
    call_from_object,
    scan_call_objects,
)
from pagedllm.parsers.json_scan import JSONScanError, partial_suffix, scan_object, scan_value, skip_ws
from pagedllm.parsers.messages import (
    DeltaMessage,
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    new_tool_call_id,
)
from pagedllm.parsers.tool_choice import (
    NamedToolCallParser,
    RequiredToolCallsParser,
    named_schema,
    parameters_schema,
    required_schema,
)
from pagedllm.protocols.reasoning_parser import ReasoningParser, ReasoningParserContext
from pagedllm.protocols.tool_parser import ToolParser, ToolParserContext

__all__ = [
    "DeltaMessage",
    "ExtractedToolCalls",
    "IncrementalReasoningParser",
    "IncrementalToolParser",
    "JSONScanError",
    "NamedToolCallParser",
    "PartialToolCall",
    "ReasoningParser",
    "ReasoningParserContext",
    "ReasoningPrefix",
    "RequiredToolCallsParser",
    "ThinkTagReasoningParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolParserContext",
    "ToolPrefix",
    "call_from_object",
    "named_schema",
    "new_tool_call_id",
    "parameters_schema",
    "partial_suffix",
    "required_schema",
    "scan_call_objects",
    "scan_object",
    "scan_value",
    "skip_ws",
]
