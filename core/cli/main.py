"""The `pagedllm` command: generate, serve, chat, plugins, plugin, config; then every command plugin's (bench).

Command plugins (`PluginKind.COMMAND`, pagedllm.protocols.command) add their subcommands after the built-in
ones; `pagedllm bench` is one, from pagedllm's own distribution.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

from pagedllm.cli import chat_cmd, config_cmd, generate_cmd, plugin_cmd, plugins_cmd, serve_cmd
from pagedllm.cli.engine_args import engine_config_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="paged-KV-cache LLM inference from plugins")
    sub = parser.add_subparsers(dest="command", required=True)
    generate_cmd.add_parser(sub)
    serve_cmd.add_parser(sub)
    chat_cmd.add_parser(sub)
    plugins_cmd.add_parser(sub)
    plugin_cmd.add_parser(sub)
    config_cmd.add_parser(sub)
    add_plugin_commands(sub)
    return parser


def add_plugin_commands(sub: Any) -> list[str]:
    """Add every registered command plugin's subcommand to `sub`, after the built-in ones; the names added.

    Discovery imports only the light registration modules, and each command's `load()` its flag-declaring
    module, so this stays torch-free. A command named like a built-in one is refused, and one whose `load()`
    or `add_parser` fails, that adds no subcommand of its registered name, or whose parser sets no `func`, is
    skipped (whatever it half-added is taken back): each with a warning naming the plugin and distribution,
    so a broken command plugin never breaks `pagedllm --help`.
    """
    from pagedllm.plugin_manager import get_plugin_manager
    from pagedllm.plugin_spec import PluginKind, PluginLoadError

    built_in = set(sub.choices)
    added: list[str] = []
    for spec in get_plugin_manager().components(PluginKind.COMMAND):
        dist = f"{spec.distribution or '?'} {spec.version}".strip()
        who = f"command '{spec.name}' from plugin '{spec.plugin}' (distribution {dist})"
        if spec.name in built_in:
            _warn(f"pagedllm {who} is refused: `pagedllm {spec.name}` is a built-in command")
            continue
        try:
            command = spec.resolve()
        except PluginLoadError as exc:  # names the command, plugin and distribution already
            _warn(f"pagedllm {exc}; the command is skipped")
            continue
        before, n_actions = set(sub.choices), len(sub._choices_actions)
        try:
            command.add_parser(sub)
            problem = _added_problem(sub, spec.name, before)
        except Exception as exc:  # a broken plugin is skipped, like any broken plugin
            problem = f"{type(exc).__name__}: {exc}"
        if problem:
            for name in set(sub.choices) - before:
                del sub.choices[name]
            del sub._choices_actions[n_actions:]
            _warn(f"pagedllm {who} failed and is skipped: {problem}")
            continue
        added.append(spec.name)
    return added


def _added_problem(sub: Any, name: str, before: set[str]) -> str:
    """Why what a command's add_parser did is unusable ("" when it is fine)."""
    if name not in set(sub.choices) - before:
        return f"its add_parser() added no subcommand named '{name}'"
    if not _sets_func(sub.choices[name]):
        return f"its parser for '{name}' sets no func (set_defaults(func=...))"
    return ""


def _sets_func(parser: argparse.ArgumentParser) -> bool:
    """Whether the parser sets `func`, itself or on every one of its own subcommands."""
    if parser.get_default("func") is not None:
        return True
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return bool(subs) and all(_sets_func(p) for a in subs for p in a.choices.values())


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from pagedllm.config import ConfigError
    from pagedllm.plugin_spec import PluginLoadError
    from pagedllm.selector import SelectionError

    try:
        if getattr(args, "builds_engine", False):
            # Fail on a bad config (a misspelled plugin name) before the command imports torch or loads a
            # model; the command builds its config again, with any overrides of its own (serve's --max-waiting).
            engine_config_from_args(args)
        return int(args.func(args) or 0)
    except (ConfigError, SelectionError, PluginLoadError) as exc:
        # The user's config asked for something that cannot be: a usage error, not a bug, so no traceback.
        # Anything else (an internal bug) still raises with its traceback.
        print(f"pagedllm: error: {_error_text(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _error_text(exc: BaseException) -> str:
    """`exc`'s message; a config error with one problem ("invalid X:" + "  key: why") becomes one line."""
    lines = str(exc).splitlines()
    if len(lines) == 2 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[1].strip()}"
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
