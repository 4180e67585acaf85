"""The in-tree tool-call and reasoning parsers on realistic model outputs, whole and streamed at every split.

The outputs are written the way each model family's chat template teaches it to call tools (Hermes 2 Pro /
Qwen2.5, Llama 3.1 JSON, Mistral before and after tokenizer v11, Llama 3.2 pythonic). Every case runs through
the conformance kit (pagedllm.testing.check_tool_parser), which also streams it split at every character
boundary and one character at a time and checks the deltas reassemble to the whole result.
"""

from __future__ import annotations

import json

import pytest

from pagedllm.api import PluginKind
from pagedllm.api.engine import get_plugin_manager
from pagedllm.api.parsers import (
    NamedToolCallParser,
    RequiredToolCallsParser,
    ToolParserContext,
    named_schema,
    required_schema,
)
from pagedllm.testing import (
    ReasoningParserCase,
    ToolParserCase,
    check_reasoning_parser,
    check_tool_parser,
)

WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
NESTED = ("search", {"query": "a \"quoted\" } brace", "filters": {"tags": ["x", "y"], "max": 3.5}, "exact": True})
EMPTY = ("get_time", {})

HERMES = [
    ToolParserCase('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                   "</tool_call>", calls=[WEATHER]),
    ToolParserCase("Let me check that for you.\n<tool_call>\n"
                   + json.dumps({"name": NESTED[0], "arguments": NESTED[1]}) + "\n</tool_call>\n<tool_call>\n"
                   '{"name": "get_time", "arguments": {}}\n</tool_call>',
                   calls=[NESTED, EMPTY], content="Let me check that for you."),
    ToolParserCase('<tool_call>{"arguments": {"city": "Paris", "unit": "celsius"}, "name": "get_weather"}'
                   "</tool_call>", calls=[WEATHER]),  # arguments before the name
    ToolParserCase('<tool_call>\n{"name": "get_time"}\n</tool_call>', calls=[EMPTY]),  # no arguments at all
    ToolParserCase("I use <tool_call> tags only when calling."),  # a tag that opens no JSON: plain text
]

LLAMA3 = [
    ToolParserCase('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', calls=[WEATHER]),
    ToolParserCase('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                   '{"name": "get_time", "parameters": {}}', calls=[WEATHER, EMPTY]),
    ToolParserCase(" " + json.dumps({"name": NESTED[0], "parameters": NESTED[1]}), calls=[NESTED]),
    ToolParserCase("Sure: the weather in Paris is mild."),
]

MISTRAL = [
    ToolParserCase('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                   '{"name": "get_time", "arguments": {}}]', calls=[WEATHER, EMPTY]),
    ToolParserCase('Checking. [TOOL_CALLS] [{"name": "search", "arguments": '
                   + json.dumps(NESTED[1]) + "}]", calls=[NESTED], content="Checking."),
    ToolParserCase('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{}',
                   calls=[WEATHER, EMPTY]),
    ToolParserCase("No tools needed: [brackets] stay content."),
]

PYTHONIC = [
    ToolParserCase('[get_weather(city="Paris", unit="celsius")]', calls=[WEATHER]),
    ToolParserCase("[search(query='a \"quoted\" } brace', filters={'tags': ['x', 'y'], 'max': 3.5}, exact=True), "
                   "get_time()]", calls=[NESTED, EMPTY]),
    ToolParserCase('<|python_start|>[get_weather(city="Paris", unit="celsius")]<|python_end|>', calls=[WEATHER]),
    ToolParserCase("[1, 2, 3] is a list, not a call."),
    ToolParserCase('[get_weather(city="Paris", unit=celsius)]'),  # a name, not a literal: not a call
]


@pytest.mark.parametrize(("name", "cases"), [("hermes", HERMES), ("llama3_json", LLAMA3), ("mistral", MISTRAL),
                                             ("pythonic", PYTHONIC)])
def test_tool_parser_whole_and_streamed(name: str, cases: list[ToolParserCase]) -> None:
    report = check_tool_parser(name, cases)
    assert report.cases == len(cases) + 1 and report.streams > 50 * len(cases)


def test_every_tool_parser_is_registered_by_name() -> None:
    names = {c.name for c in get_plugin_manager().components(PluginKind.TOOL_PARSER)}
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= names
    names = {c.name for c in get_plugin_manager().components(PluginKind.REASONING_PARSER)}
    assert {"deepseek_r1", "qwen3"} <= names


def test_the_check_catches_a_stream_that_disagrees(fake_distribution) -> None:  # type: ignore[no-untyped-def]
    """A parser whose stream drops a character must fail the kit (so the kit can fail at all)."""
    source = '''
from pagedllm.api import hookimpl
from pagedllm.api.parsers import DeltaMessage, ExtractedToolCalls, ToolCall

class Lossy:
    def __init__(self, context):
        pass
    def extract_tool_calls(self, text):
        return ExtractedToolCalls(False, [], text or None)
    def extract_tool_calls_streaming(self, previous_text, current_text, delta_text, finished=False):
        return DeltaMessage(content=delta_text[1:])

@hookimpl
def register_tool_parsers(register):
    register("lossy", lambda: Lossy)
'''
    fake_distribution("lossy-parser", {"pagedllm.tool_parsers": {"lossy": "lossy_parser"}},
                      {"lossy_parser.py": source})
    from pagedllm.plugin_manager import PluginManager

    with pytest.raises(AssertionError, match="content"):
        check_tool_parser("lossy", [], pm=PluginManager())


def test_a_call_cut_short_is_content_in_the_whole_result() -> None:
    """As in vLLM: max_tokens cut the call, so its arguments do not parse; the whole result is plain content.

    (A stream has sent the call's name by then and cannot take it back: the one place the two differ.)
    """
    cls = get_plugin_manager().get(PluginKind.TOOL_PARSER, "hermes").resolve()  # type: ignore[union-attr]
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": '
    whole = cls(ToolParserContext(None, [])).extract_tool_calls(text)
    assert not whole.tools_called and whole.content == text


REASONING_R1 = [
    ReasoningParserCase("<think>The user wants 2+2. That is 4.</think>\n\nThe answer is 4.",
                        "The user wants 2+2. That is 4.", "\n\nThe answer is 4."),
    ReasoningParserCase("The template opened the tag already.</think>Four.",
                        "The template opened the tag already.", "Four."),
    ReasoningParserCase("Still thinking when max_tokens ran out", "Still thinking when max_tokens ran out", None),
]
REASONING_QWEN3 = [
    ReasoningParserCase("<think>\nLet me add: 2+2=4.\n</think>\n\n4", "\nLet me add: 2+2=4.\n", "\n\n4"),
    ReasoningParserCase("4, without thinking (enable_thinking=False).", None,
                        "4, without thinking (enable_thinking=False)."),
    ReasoningParserCase("<think></think>Straight to it.", None, "Straight to it."),
    ReasoningParserCase("<think>cut off mid-thou", "cut off mid-thou", None),
]


@pytest.mark.parametrize(("name", "cases"), [("deepseek_r1", REASONING_R1), ("qwen3", REASONING_QWEN3)])
def test_reasoning_parser_whole_and_streamed(name: str, cases: list[ReasoningParserCase]) -> None:
    report = check_reasoning_parser(name, cases)
    assert report.cases == len(cases)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]


def test_required_schema_accepts_exactly_calls_of_the_tools() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = required_schema(TOOLS)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}},
                         {"name": "get_time", "parameters": {}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}],
                [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "kelvin"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls=false: one call at most
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, required_schema(TOOLS, False))
    assert named_schema(TOOLS, "get_weather") == TOOLS[0]["function"]["parameters"]
    assert named_schema(TOOLS, "get_time") == {"type": "object", "properties": {}}


def _stream(parser: object, text: str) -> tuple[str, list[tuple[str, str]]]:
    calls: list[list[str]] = []
    content = ""
    for k in range(len(text) + 1):
        delta = parser.extract_tool_calls_streaming(text[:max(k - 1, 0)], text[:k], text[max(k - 1, 0):k],  # type: ignore[attr-defined]
                                                    finished=k == len(text))
        for d in delta.tool_calls if delta else []:
            if d.name is not None:
                calls.append([d.name, d.arguments or ""])
            else:
                calls[d.index][1] += d.arguments or ""
        content += (delta.content or "") if delta else ""
    return content, [(n, a) for n, a in calls]


def test_required_and_named_outputs_parse_whole_and_streamed() -> None:
    ctx = ToolParserContext(None, TOOLS)
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    whole = RequiredToolCallsParser(ctx).extract_tool_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert _stream(RequiredToolCallsParser(ctx), text) == ("", [(c.name, c.arguments) for c in whole.tool_calls])
    args = ' {"city": "Paris", "unit": "celsius"}'
    named = NamedToolCallParser(ctx, "get_weather").extract_tool_calls(args)
    assert [(c.name, c.arguments) for c in named.tool_calls] == [("get_weather", args.strip())]
    assert _stream(NamedToolCallParser(ctx, "get_weather"), args) == ("", [("get_weather", args.strip())])
