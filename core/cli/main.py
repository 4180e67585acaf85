"""The `pagedllm` command: generate, serve, chat, plugins, config show, bench."""

from __future__ import annotations

import argparse
import sys

from pagedllm.cli import bench_cmd, chat_cmd, config_cmd, generate_cmd, plugins_cmd, serve_cmd


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

    try:
        return int(args.func(args) or 0)
    except (ConfigError, PluginLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
