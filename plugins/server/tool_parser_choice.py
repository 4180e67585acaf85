"""The tool parser a model's chat template implies, for a server started without `--tool-call-parser`.

A template teaches the model the format it writes calls in, so its markers name the parser that reads them:

    marker in the template            parser        models
    [TOOL_CALLS]                      mistral       Mistral / Mixtral instruct (v3 tokenizers and later)
    <|python_tag|>                    llama3_json   Llama 3.1 / 3.2 / 3.3
    <tool_call>                       hermes        Hermes 2 Pro / 3, Qwen2.5, Qwen3, QwQ
    [func_name1(                      pythonic      Llama 3.2 / 4 pythonic templates (their format example)
    ipython (the tool-result role)    llama3_json   Llama 3.x templates without <|python_tag|>

The first row that matches wins; the table is ordered from the most specific marker down: the pythonic
templates also name the ipython role, so their format example must be looked for first. No marker: no parser,
and the reasons say what was looked for, as the selectors' explanations do. An explicit flag always wins.
"""

from __future__ import annotations

from dataclasses import dataclass

MARKERS: tuple[tuple[str, str], ...] = (
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ("<tool_call>", "hermes"),
    ("[func_name1(", "pythonic"),
    ("ipython", "llama3_json"),
)


@dataclass(frozen=True)
class ToolParserChoice:
    name: str | None  # the parser plugin, or None when the template names none that is installed
    reason: str


def choose_tool_parser(chat_template: str | dict[str, str] | None, installed: set[str]) -> ToolParserChoice:
    """The parser `chat_template`'s call markers imply, among the `installed` tool_parser plugins. A tokenizer
    with several named templates (a dict) is read as all of them together."""
    if isinstance(chat_template, dict):
        chat_template = "\n".join(str(t) for t in chat_template.values())
    if not chat_template:
        return ToolParserChoice(None, "the model has no chat template to read a tool-call format from")
    skipped = []
    for marker, name in MARKERS:
        if marker not in chat_template:
            continue
        if name in installed:
            return ToolParserChoice(name, f"the chat template writes {marker} (the {name} call format)")
        skipped.append(f"{marker} implies {name}, which is not installed")
    looked_for = ", ".join(marker for marker, _ in MARKERS)
    return ToolParserChoice(None, "; ".join(skipped) or f"the chat template has none of {looked_for}")
