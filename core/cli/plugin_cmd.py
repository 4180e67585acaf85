"""`pagedllm plugin new KIND NAME [DIR]`: write a working, pip-installable plugin package to start from.

The package is rendered from the templates in `plugin-templates/` (package data: `common/` for every kind,
one folder per kind): a pyproject.toml with the kind's entry point, a light registration module that
imports only `pagedllm.api`, an implementation built on the in-tree default through the public API, a
README and tests that run the component through the engine on a tiny random Llama. A template names its
values as `{{key}}`; rendering fails on a key it does not know, so a typo in a template cannot ship.

Light: nothing here imports torch (the name check asks plugin discovery only).
"""

from __future__ import annotations

import argparse
import keyword
import os
import re
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from pagedllm.api import PLUGIN_API_VERSION, PluginKind


class StarterError(Exception):
    """A request the starter cannot honour (bad kind, name or folder); a usage error, exit status 2."""


@dataclass(frozen=True)
class Starter:
    """What differs between kinds; the files themselves are the templates in plugin-templates/<kind>/."""

    kind: PluginKind
    module: str  # the implementation module: src/<package>/<module>.py
    component: str  # the registered name ({{name}} or a template of it)
    summary: str
    select: str  # engine.yaml lines that select it; "" = there is no config key
    use: str  # the README's "Use" section (markdown)
    api_min: str = ""  # the oldest plugin API the kind needs, where newer than PLUGIN_API_VERSION's major


_SELECT_USE = (
    "Select it in a config file (`engine.yaml` here):\n\n```yaml\n{{select}}\n```\n\n"
    "```bash\npagedllm config show --config engine.yaml   # each selection and why\n"
    "pagedllm generate --config engine.yaml --prompt Hello\n```"
)

STARTERS: dict[str, Starter] = {
    "scheduler": Starter(
        PluginKind.SCHEDULER, "scheduler", "{{name}}", "first come first served continuous batching",
        "scheduler: {name: {{name}}}", _SELECT_USE,
    ),
    "attention": Starter(
        PluginKind.ATTENTION, "backend", "{{name}}", "paged attention through pagedllm's torch backend",
        "attention: {backend: {{name}}}", _SELECT_USE,
    ),
    "kv_manager": Starter(
        PluginKind.KV_MANAGER, "manager", "{{name}}", "a KV manager for full-attention layers", "",
        "KV managers have no config key: the engine takes, per group of layers, the manager registered for "
        "the most specific type of the model's KV-cache spec, then the highest priority. Installed, this one "
        "(`FullAttentionSpec`, priority 10 over `full_attention`'s 0) serves every full-attention layer; "
        "`pagedllm config show --resolve` names it, and `PAGEDLLM_PLUGINS=` (empty) blocks every third-party "
        "plugin, this one included.",
    ),
    "loader": Starter(
        PluginKind.LOADER, "loader", "{{name}}", "reads a Hugging Face folder (config.json + safetensors)",
        "loader: {name: {{name}}}", _SELECT_USE,
    ),
    "quantization": Starter(
        PluginKind.QUANTIZATION, "method", "{{name}}", "dense weights through pagedllm's dense linear method",
        "quantization: {method: {{name}}}", _SELECT_USE,
    ),
    "model": Starter(
        PluginKind.MODEL, "model", "{{Class}}ForCausalLM", "a Llama-style decoder built from pagedllm's layers",
        "",
        "Model classes have no config key: a checkpoint whose config.json lists "
        '`"architectures": ["{{Class}}ForCausalLM"]` runs on this one '
        "(`pagedllm generate --model path/to/that/checkpoint --prompt Hello`).",
    ),
    "logits_processor": Starter(
        PluginKind.LOGITS_PROCESSOR, "processor", "{{name}}", "bans token ids from being sampled",
        "logits_processors: [{{name}}]\nplugins:\n  {{name}}: {token_ids: [0]}", _SELECT_USE,
    ),
    "proposer": Starter(
        PluginKind.PROPOSER, "proposer", "{{name}}", "speculative drafts guessing the last token comes again",
        "speculative: {method: {{name}}, num_speculative_tokens: 2}", _SELECT_USE,
    ),
    "executor": Starter(
        PluginKind.EXECUTOR, "executor", "{{name}}", "one rank, in the engine core's process",
        "parallel: {executor: {{name}}}", _SELECT_USE,
    ),
    "command": Starter(
        PluginKind.COMMAND, "cli", "{{name}}", "a prompt's token count and greedy continuation as JSON", "",
        "Installed, it is a `pagedllm` subcommand, with every engine flag (`--model`, `--config`, "
        "`--set KEY=VALUE`, ...):\n\n```bash\npagedllm {{name}} --help\n"
        "pagedllm {{name}} --prompt Hello --max-tokens 8\n"
        "pagedllm {{name}} --model path/to/model --token-ids 10,11,12\n```",
        api_min="1.2",
    ),
    "entrypoint": Starter(
        PluginKind.ENTRYPOINT, "entrypoint", "{{name}}", "prompts from stdin as JSON lines, completions to stdout",
        "",
        "Entrypoints have no config key: `pagedllm serve --entrypoint {{name}}` runs this one, with every engine "
        "flag (`--model`, `--config`, `--set KEY=VALUE`, ...):\n\n```bash\n"
        "echo '{\"prompt\": \"Hello\", \"max_tokens\": 8}' | pagedllm serve --entrypoint {{name}}\n```",
    ),
    "tool_parser": Starter(
        PluginKind.TOOL_PARSER, "parser", "{{name}}", "Llama 3.1 custom-tool calls: <function=NAME>{...}</function>",
        "",
        "Tool parsers have no engine config key: the server uses the one it is started with, for requests "
        "with `tools`:\n\n```bash\npagedllm serve --model path/to/model --tool-call-parser {{name}} "
        "--enable-auto-tool-choice\n```",
    ),
    "reasoning_parser": Starter(
        PluginKind.REASONING_PARSER, "parser", "{{name}}", "<thought>...</thought> as reasoning_content",
        "",
        "Reasoning parsers have no engine config key: the server uses the one it is started with:\n\n```bash\n"
        "pagedllm serve --model path/to/model --reasoning-parser {{name}}\n```",
    ),
    "kv_connector": Starter(
        PluginKind.KV_CONNECTOR, "connector", "{{name}}",
        "an in-memory store for the blocks the device prefix cache evicts",
        "kv_transfer: {kv_connector: {{name}}}\nplugins:\n  {{name}}: {max_blocks: 4096}", _SELECT_USE,
        api_min="1.4",
    ),
    "structured_output": Starter(
        PluginKind.STRUCTURED_OUTPUT, "backend", "{{name}}", "output constrained to one of the request's choices",
        "structured_outputs: {backend: {{name}}}",
        "A request names it (`StructuredOutputsParams(choice=[...], backend=\"{{name}}\")` offline; "
        '`"structured_outputs": {"choice": [...], "backend": "{{name}}"}` over HTTP), or a config file makes it '
        "every request's (`engine.yaml` here; then constraints other than `choice` are refused):\n\n```yaml\n"
        "{{select}}\n```",
    ),
}
_ALIASES = {"attention_backend": "attention"}  # PluginKind's own spelling
# Kinds pagedllm has but the starter does not write (none today; a kind added to PluginKind lands here).
NOT_STARTED = tuple(k.value for k in PluginKind if k not in {s.kind for s in STARTERS.values()})

# THE ONE PLACE for pagedllm's conformance kit (pagedllm.testing): kind -> what the kit's check needs. A kind
# listed here gets a test calling the kit next to its engine-level tests; any other kind's test says where the
# call would go. Quantization is left out: its check needs a packed checkpoint of the method's own format.
@dataclass(frozen=True)
class KitCheck:
    imports: str  # names imported from pagedllm.testing
    params: str  # the test function's parameters (fixtures of the generated conftest.py)
    call: str  # the check; NAME / ARCHITECTURE are the generated test's constants


KIT_CHECKS: dict[str, KitCheck] = {
    "scheduler": KitCheck("check_scheduler", "", "check_scheduler(NAME)"),
    "attention": KitCheck("check_attention_backend", "", "check_attention_backend(NAME)"),
    "kv_manager": KitCheck("check_kv_manager", "", "check_kv_manager(NAME)"),
    "loader": KitCheck("check_loader", "tiny_llama: str", "check_loader(NAME, tiny_llama)"),
    "model": KitCheck(
        "check_model_architecture, tiny_hf_config", "", 'check_model_architecture(ARCHITECTURE, tiny_hf_config("llama"))'
    ),
    # Every case whole, then streamed split at every character: the deltas must reassemble to the whole result.
    "tool_parser": KitCheck("check_tool_parser", "", "check_tool_parser(NAME, CASES)"),
    "reasoning_parser": KitCheck("check_reasoning_parser", "", "check_reasoning_parser(NAME, CASES)"),
    # Seeded walks over the kit's small tokenizer: every mask exactly the tokens a reference keeps alive.
    "structured_output": KitCheck("check_structured_output_backend", "", "check_structured_output_backend(NAME, CASES)"),
}
# Where a kind without a kit call says the call goes, and why it is not there yet.
KIT_LATER = {
    "quantization": "# Conformance kit: once the method stores a format of its own, pagedllm.testing's\n"
    "# check_quantization_method(NAME, checkpoint, dequantized_weight) compares its products here.",
    "logits_processor": "# Conformance kit: pagedllm.testing has no logits-processor check yet; when it has, call it here.",
    "proposer": "# Conformance kit: pagedllm.testing has no proposer check yet; when it has, call it here.",
    "executor": "# Conformance kit: pagedllm.testing has no executor check yet; when it has, call it here.",
    "command": "# Conformance kit: pagedllm.testing has no command check yet; when it has, call it here.",
    "entrypoint": "# Conformance kit: pagedllm.testing has no entrypoint check yet; when it has, call it here.",
    "kv_connector": "# Conformance kit: pagedllm.testing has no KV-connector check yet; when it has, call it here.",
}

_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plugin", help="write a new plugin package to start from")
    psub = p.add_subparsers(dest="plugin_command", required=True)
    new = psub.add_parser(
        "new",
        help="write a working pip-installable plugin package for KIND",
        description=f"Write a plugin package for KIND (one of: {', '.join(STARTERS)}) named NAME into DIR.",
    )
    new.add_argument("kind", metavar="KIND", help=f"one of: {', '.join(STARTERS)}")
    new.add_argument("name", metavar="NAME", help="the component's name: lower-case letters, digits, _")
    new.add_argument(
        "dir", metavar="DIR", nargs="?", help="where to write it (default: ./pagedllm-NAME, with _ as -)"
    )
    new.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        written = new_package(args.kind, args.name, Path(args.dir) if args.dir else None)
    except StarterError as exc:
        print(f"pagedllm: error: {exc}", file=sys.stderr)
        return 2
    root = written[0].parent
    shown = os.path.relpath(root)  # as the user would type it, when it is under the current folder
    if shown.startswith(".."):
        shown = str(root)
    print(f"wrote {args.kind} plugin '{args.name}' to {shown}/:")
    for path in written:
        print(f"  {path.relative_to(root)}")
    print(f"next:\n  pip install -e {shown}\n  pagedllm plugins | grep {args.name}\n  pytest {shown}/tests")
    return 0


def new_package(kind: str, name: str, target: Path | None = None) -> list[Path]:
    """Write the package; return the files written, pyproject.toml first. Raises StarterError."""
    starter = starter_for(kind)
    kind = _ALIASES.get(kind, kind)
    check_name(name)
    values = _values(kind, name, starter)
    check_unused(starter.kind, values["component"], values["dist"])
    root = target if target is not None else Path.cwd() / values["dist"]
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise StarterError(f"'{root}' exists and is not an empty folder; refusing to overwrite it")
    files = render(kind, values)
    written = []
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def starter_for(kind: str) -> Starter:
    """The kind's starter, or StarterError listing the supported kinds."""
    starter = STARTERS.get(_ALIASES.get(kind, kind))
    if starter is not None:
        return starter
    supported = ", ".join(STARTERS)
    if kind in NOT_STARTED:
        raise StarterError(f"the starter cannot write a {kind} plugin yet; supported kinds: {supported} "
                           "(docs/plugins/ describes every kind's protocol)")
    raise StarterError(f"unknown plugin kind '{kind}'; supported kinds: {supported}")


def check_name(name: str) -> None:
    """A component name is what a config file says (`scheduler: {name: spf}`) and part of a module name."""
    if not _NAME.fullmatch(name) or keyword.iskeyword(name):
        raise StarterError(
            f"invalid plugin name '{name}': use 1-40 lower-case letters, digits and underscores, starting "
            "with a letter (it names the component in config files and the Python package pagedllm_NAME)"
        )


def check_unused(kind: PluginKind, component: str, dist: str) -> None:
    """Refuse a name another distribution already registers for the kind: the second registration would be
    reported broken ("registered twice"). The same distribution (this package, regenerated) is fine."""
    from pagedllm.plugin_manager import get_plugin_manager

    spec = get_plugin_manager().get(kind, component)
    if spec is not None and spec.distribution != dist:
        raise StarterError(
            f"{kind.value} '{component}' is already registered by {spec.distribution}; pick another name"
        )


def _values(kind: str, name: str, starter: Starter) -> dict[str, str]:
    klass = "".join(part.capitalize() for part in name.split("_") if part)
    values = {
        "name": name,
        "kind": kind,
        "Class": klass,
        "package": f"pagedllm_{name}",
        "dist": f"pagedllm-{name.replace('_', '-')}",
        "group": starter.kind.entry_point_group,
        "module": starter.module,
        "summary": starter.summary,
        # The majors of the plugin API this pagedllm implements: its own, up to the next breaking one.
        "api_range": f">={starter.api_min or PLUGIN_API_VERSION},<{PLUGIN_API_VERSION + 1}",
        "kit": _kit_block(kind),
    }
    values["component"] = fill(starter.component, values)
    values["select"] = fill(starter.select, values)
    values["use"] = fill(starter.use, values)
    return values


def render(kind: str, values: dict[str, str]) -> dict[str, str]:
    """The package's files, relative path -> text."""
    starter = STARTERS[kind]
    name, package = values["name"], values["package"]
    sources = {
        "pyproject.toml": "common/pyproject.toml",
        "README.md": "common/README.md",
        ".gitignore": "common/gitignore",
        f"src/{package}/__init__.py": f"{kind}/__init__.py",
        f"src/{package}/{starter.module}.py": f"{kind}/{starter.module}.py",
        "tests/conftest.py": "common/conftest.py",
        f"tests/test_{name}.py": f"{kind}/test.py",
    }
    if starter.select:
        sources["engine.yaml"] = "common/engine.yaml"
    return {rel: fill(_template(src), values) for rel, src in sources.items()}


def fill(text: str, values: dict[str, str]) -> str:
    """Replace every `{{key}}`; an unknown key raises (a template bug, not a user error)."""

    def value(match: re.Match[str]) -> str:
        key = match.group(1)
        if key not in values:
            raise KeyError(f"template placeholder {{{{{key}}}}} has no value")
        return values[key]

    return _PLACEHOLDER.sub(value, text)


def _template(rel: str) -> str:
    return (resources.files("pagedllm.cli") / "plugin-templates" / f"{rel}.tmpl").read_text()


def _kit_block(kind: str) -> str:
    """The generated test's conformance-kit section: a test calling the kit, or where that call goes."""
    check = KIT_CHECKS.get(kind)
    if check is None:
        return "\n\n" + KIT_LATER.get(kind, "# Conformance kit: when pagedllm.testing checks this kind, call it here.")
    return (
        f"\n\ndef test_conformance_kit({check.params}) -> None:\n"
        "    # pagedllm's conformance kit drives the component directly, case by case, against the in-tree one.\n"
        f"    from pagedllm.testing import {check.imports}\n\n"
        f"    {check.call}\n"
    ).rstrip("\n")
