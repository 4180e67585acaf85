"""The tool parser chosen from the model's chat template when `--tool-call-parser` is not given.

The templates: tests/tool_models.py's (a Qwen-style one writing `<tool_call>`), and short templates written
here in each family's call format, rendered by transformers and read back by the parser that was chosen --
so a wrong choice shows as a call the parser cannot read, not only as a different name.
The live server path (no flag, `--enable-auto-tool-choice`, calls parsed) runs in test_server_responses.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tool_models import CHAT_TEMPLATE, make_tokenizer, make_tool_model

from pagedllm.api.parsers import ToolParserContext
from pagedllm.plugins.server.chat_parsing import ChatParsing
from pagedllm.plugins.server.tool_parser_choice import MARKERS, choose_tool_parser

INSTALLED = {"hermes", "llama3_json", "mistral", "pythonic"}
CALL = {"name": "get_time", "arguments": {"zone": "UTC"}}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
# Each family's template renders an assistant turn's call the way its models write one; the parser chosen
# for the template must read that rendering back.
LLAMA3_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    "{% if m.tool_calls %}<|python_tag|>{% for tc in m.tool_calls %}"
    "{\"name\": \"{{ tc.function.name }}\", \"parameters\": {{ tc.function.arguments | tojson }}}"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}")
MISTRAL_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.tool_calls %}[TOOL_CALLS][{% for tc in m.tool_calls %}"
    "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]</s>{% else %}{{ m.content }}</s>{% endif %}{% endfor %}")
PYTHONIC_TEMPLATE = (
    "Environment: ipython\nRespond in the format [func_name1(params_name1=params_value1), func_name2(params)]\n"
    "{% for m in messages %}{% if m.tool_calls %}[{% for tc in m.tool_calls %}{{ tc.function.name }}("
    "{% for k, v in tc.function.arguments.items() %}{{ k }}='{{ v }}'{% endfor %}){% endfor %}]"
    "{% else %}{{ m.content }}{% endif %}\n{% endfor %}")
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def _assistant_call_text(template: str) -> str:
    """What the template renders for an assistant turn holding CALL (transformers renders it)."""
    tok = make_tokenizer()
    turn = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": CALL["name"], "arguments": CALL["arguments"]}}]}]
    text: Any = tok.apply_chat_template(turn, chat_template=template, tokenize=False)
    return str(text)


@pytest.mark.parametrize(("template", "expected"), [
    (CHAT_TEMPLATE, "hermes"),
    (LLAMA3_TEMPLATE, "llama3_json"),
    (MISTRAL_TEMPLATE, "mistral"),
    (PYTHONIC_TEMPLATE, "pythonic"),
])
def test_the_template_names_the_parser_that_reads_its_calls(template: str, expected: str) -> None:
    choice = choose_tool_parser(template, INSTALLED)
    assert choice.name == expected, choice
    parsing = ChatParsing.from_settings(SimpleNamespace(enable_auto_tool_choice=True), None).for_model(template)
    assert parsing.tool_parser_name == expected and parsing.enable_auto_tool_choice
    text = _assistant_call_text(template)
    if expected == "hermes":  # the tool_models template renders the call inside its assistant turn
        text = text.split("<|im_start|>assistant", 1)[1].rsplit("<|im_end|>", 1)[0]
    elif expected == "llama3_json":
        text = text.split("<|end_header_id|>\n\n", 1)[1].split("<|eot_id|>", 1)[0]
    elif expected == "mistral":
        text = text.rsplit("</s>", 1)[0]
    else:
        text = text.split("\n", 2)[2].strip()
    found = parsing.tool_parser(ToolParserContext(None, TOOLS)).extract_tool_calls(text)
    assert found.tools_called, (expected, text)
    assert [(c.name, json.loads(c.arguments)) for c in found.tool_calls] == [(CALL["name"], CALL["arguments"])]


def test_no_marker_no_parser_with_the_reason() -> None:
    choice = choose_tool_parser(PLAIN_TEMPLATE, INSTALLED)
    assert choice.name is None and all(marker in choice.reason for marker, _ in MARKERS)
    assert choose_tool_parser(None, INSTALLED).name is None
    missing = choose_tool_parser(MISTRAL_TEMPLATE, INSTALLED - {"mistral"})
    assert missing.name is None and "mistral, which is not installed" in missing.reason
    # Several named templates: all are read.
    assert choose_tool_parser({"default": PLAIN_TEMPLATE, "tool_use": CHAT_TEMPLATE}, INSTALLED).name == "hermes"


def test_an_explicit_flag_wins_and_auto_without_any_parser_is_an_error() -> None:
    flagged = ChatParsing.from_settings(SimpleNamespace(tool_call_parser="mistral"), None)
    assert flagged.for_model(CHAT_TEMPLATE).tool_parser_name == "mistral"
    plain = ChatParsing.from_settings(None, None)
    assert plain.for_model(PLAIN_TEMPLATE).tool_parser is None  # tools then need tool_choice other than auto
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser: none could be "
                                         "chosen from the model .*has none of"):
        ChatParsing.from_settings(SimpleNamespace(enable_auto_tool_choice=True), None).for_model(PLAIN_TEMPLATE)


@pytest.mark.slow
def test_serve_stops_when_auto_has_no_parser(tmp_path: Path) -> None:
    """The tiny model with a template that writes no call format: `--enable-auto-tool-choice` alone stops
    serve with the reason, before the engine core starts."""
    model = make_tool_model(tmp_path)
    result = subprocess.run([sys.executable, "-m", "pagedllm.cli.serve_cmd", model, "--enable-auto-tool-choice",
                             "--chat-template", PLAIN_TEMPLATE], capture_output=True, text=True, timeout=180,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--enable-auto-tool-choice needs --tool-call-parser: none could be chosen from the model" in result.stderr
