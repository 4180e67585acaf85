"""The `pagedllm` command: generate, serve, chat, plugins, config show, bench."""

from __future__ import annotations

import argparse
import sys

from pagedllm.cli import bench_cmd, chat_cmd, config_cmd, generate_cmd, plugins_cmd, serve_cmd
from pagedllm.cli.engine_args import engine_config_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="paged-KV-cache LLM inference from plugins")
    sub = parser.add_subparsers(dest="command", required=True)
    generate_cmd.add_parser(sub)
    serve_cmd.add_parser(sub)
    chat_cmd.add_parser(sub)
    plugins_cmd.add_parser(sub)
    config_cmd.add_parser(sub)
    bench_cmd.add_parser(sub)
    return parser


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
