"""Turning a chat model's text into OpenAI message parts: tool calls and reasoning, whole or while streaming.

The protocols live in pagedllm.protocols.tool_parser / reasoning_parser; this package holds the value types
they exchange (messages.py), a scanner for JSON that may still be arriving (json_scan.py), base classes that
derive the streaming deltas from one prefix parse so streamed and whole results agree (incremental.py), and
what `tool_choice` "required" or a named function needs (tool_choice.py). Light: no torch.
"""
