"""Which tool and reasoning parsers the server uses, and one choice's text run through them.

The parsers are plugins (`pagedllm.tool_parsers`, `pagedllm.reasoning_parsers`) found by name through the
plugin registry, once at start-up, so a misspelt name stops the server with the installed names listed.
Chosen by `--tool-call-parser` / `--reasoning-parser` / `--enable-auto-tool-choice`, or the config's
`plugins.openai` section (the flags win); without a tool parser named, the one the model's chat template
implies (tool_parser_choice.py), once the tokenizer is loaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from pagedllm.api import PluginKind
from pagedllm.api.engine import get_plugin_manager
from pagedllm.api.parsers import DeltaMessage, ReasoningParserContext, ToolCall, ToolCallDelta
from pagedllm.plugins.server.options import ServerSection
from pagedllm.plugins.server.tool_parser_choice import choose_tool_parser

logger = logging.getLogger("pagedllm.server")


def _resolve(kind: PluginKind, name: str, flag: str) -> Any:
    pm = get_plugin_manager()
    spec = pm.get(kind, name)
    if spec is None:
        names = ", ".join(sorted(c.name for c in pm.components(kind))) or "none installed"
        raise ValueError(f"{flag} {name}: no {kind.value} named {name!r} (available: {names})")
    return spec.resolve()


@dataclass(frozen=True)
class ChatParsing:
    """The server's parser choice: classes (built per request), their names, and whether "auto" is allowed."""

    tool_parser: Any = None
    tool_parser_name: str | None = None
    reasoning_parser: Any = None
    reasoning_parser_name: str | None = None
    enable_auto_tool_choice: bool = False

    @classmethod
    def from_settings(cls, options: Any, section: dict[str, Any] | None) -> ChatParsing:
        """From the serve options (flags) over the `plugins.openai` config section."""
        conf = ServerSection.model_validate(section or {})
        tool_name = getattr(options, "tool_call_parser", None) or conf.tool_call_parser
        reasoning_name = getattr(options, "reasoning_parser", None) or conf.reasoning_parser
        auto = getattr(options, "enable_auto_tool_choice", None)
        auto = conf.enable_auto_tool_choice if auto is None else bool(auto)
        return cls(
            tool_parser=_resolve(PluginKind.TOOL_PARSER, tool_name, "--tool-call-parser") if tool_name else None,
            tool_parser_name=tool_name,
            reasoning_parser=(_resolve(PluginKind.REASONING_PARSER, reasoning_name, "--reasoning-parser")
                              if reasoning_name else None),
            reasoning_parser_name=reasoning_name,
            enable_auto_tool_choice=auto,
        )

    def for_model(self, chat_template: str | dict[str, str] | None) -> ChatParsing:
        """Without --tool-call-parser, the parser the model's chat template implies (tool_parser_choice.py),
        logged with its reason. --enable-auto-tool-choice with neither a flag nor an implied parser is an
        error (stopping the server), since "auto" could not read a single call."""
        if self.tool_parser is not None:
            return self
        pm = get_plugin_manager()
        choice = choose_tool_parser(chat_template, {c.name for c in pm.components(PluginKind.TOOL_PARSER)})
        if choice.name is None:
            if self.enable_auto_tool_choice:
                raise ValueError("--enable-auto-tool-choice needs --tool-call-parser: none could be chosen from "
                                 f"the model ({choice.reason})")
            logger.info("tool_parser: none (%s; --tool-call-parser names one)", choice.reason)
            return self
        logger.info("tool_parser: %s (chosen from the model: %s; --tool-call-parser overrides)", choice.name,
                    choice.reason)
        return replace(self, tool_parser=_resolve(PluginKind.TOOL_PARSER, choice.name, "the model's tool parser"),
                       tool_parser_name=choice.name)


@dataclass
class ParsedChoice:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


@dataclass
class ChoiceParser:
    """One choice's output through the reasoning parser, then (its content) through the tool parser.

    Whole (`parse`) or fed delta by delta (`feed`); one instance per choice, since streaming parsers keep
    state. `strip_suffix`: text to drop from the very end (the EOS token's text, when special tokens are
    kept in the output for a parser whose markers are special tokens).
    """

    reasoning: Any = None  # a ReasoningParser instance, or None
    tools: Any = None  # a ToolParser instance, or None
    max_calls: int | None = None  # parallel_tool_calls=false: the first call only
    strip_suffix: str | None = None
    _text: str = ""
    _content: str = ""
    called: bool = False
    _calls_seen: set[int] = field(default_factory=set)

    @classmethod
    def build(cls, reasoning_cls: Any, tokenizer: Any, tools: Any, max_calls: int | None,
              strip_suffix: str | None) -> ChoiceParser:
        reasoning = reasoning_cls(ReasoningParserContext(tokenizer)) if reasoning_cls is not None else None
        return cls(reasoning, tools, max_calls, strip_suffix)

    def _strip(self, text: str) -> str:
        if self.strip_suffix and text.endswith(self.strip_suffix):
            return text[:-len(self.strip_suffix)]
        return text

    def parse(self, text: str) -> ParsedChoice:
        text = self._strip(text)
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.extract_reasoning_content(text)
        calls: list[ToolCall] = []
        if self.tools is not None and content is not None:
            found = self.tools.extract_tool_calls(content)
            if found.tools_called:
                calls, content = found.tool_calls[:self.max_calls], found.content
        elif content == "":
            content = None
        self.called = bool(calls)
        return ParsedChoice(reasoning, content, calls)

    def feed(self, delta_text: str, finished: bool) -> DeltaMessage | None:
        previous = self._text
        self._text = self._strip(previous + delta_text) if finished else previous + delta_text
        delta_text = self._text[len(previous):]
        if self.reasoning is not None:
            part = self.reasoning.extract_reasoning_content_streaming(previous, self._text, delta_text, finished)
            reasoning, content_delta = (part.reasoning_content, part.content or "") if part else (None, "")
        else:
            reasoning, content_delta = None, delta_text
        out = DeltaMessage(reasoning_content=reasoning)
        if self.tools is None:
            out.content = content_delta or None
        elif content_delta or finished:
            before = self._content
            self._content += content_delta
            part = self.tools.extract_tool_calls_streaming(before, self._content, content_delta, finished)
            if part is not None:
                out.content = part.content
                out.tool_calls = [d for d in part.tool_calls if self.max_calls is None or d.index < self.max_calls]
        for d in out.tool_calls:
            self._calls_seen.add(d.index)
        self.called = bool(self._calls_seen)
        return None if out.is_empty() else out


def delta_tool_call_json(d: ToolCallDelta) -> dict[str, Any]:
    """OpenAI's streamed `delta.tool_calls[i]`: index, then id/type/name on a call's first piece only."""
    out: dict[str, Any] = {"index": d.index}
    function: dict[str, Any] = {}
    if d.id is not None:
        out["id"], out["type"] = d.id, "function"
        function["name"] = d.name
    if d.arguments is not None:
        function["arguments"] = d.arguments
    out["function"] = function
    return out
