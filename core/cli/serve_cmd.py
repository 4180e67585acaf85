"""`pagedllm serve`: run an HTTP entrypoint plugin (default: the OpenAI-compatible server) over the engine.

The entrypoint is found through the plugin manager like any other component — the core never imports
`pagedllm.plugins.*` by name — and is called as `serve(config: EngineConfig, options: ServeOptions) -> int`.
This module only declares flags, so `pagedllm --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from pagedllm.cli.engine_args import add_engine_args

DEFAULT_ENTRYPOINT = "openai"


@dataclass
class ServeOptions:
    """What an entrypoint plugin needs besides the engine config."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 4 << 20
    max_waiting: int | None = None
    drain_timeout_s: float = 30.0
    log_level: str = "info"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the engine over HTTP (OpenAI-compatible API by default)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $PAGEDLLM_API_KEY if set)")
    g.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    g.add_argument("--max-waiting", type=int, default=None,
                   help="bound on waiting requests; beyond it requests get 429 (sets scheduler.max_waiting)")
    g.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest accepted request body")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before exiting")
    g.add_argument("--log-level", default="info")
    g.add_argument("--entrypoint", default=DEFAULT_ENTRYPOINT, help="entrypoint plugin name")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    from pagedllm.cli.engine_args import engine_config_from_args
    from pagedllm.plugin_manager import get_plugin_manager
    from pagedllm.plugin_spec import PluginKind, PluginLoadError

    if args.max_waiting is not None:
        args.set = [*args.set, f"scheduler.max_waiting={args.max_waiting}"]
    config = engine_config_from_args(args)
    pm = get_plugin_manager()
    spec = pm.get(PluginKind.ENTRYPOINT, args.entrypoint)
    if spec is None:
        names = ", ".join(sorted(c.name for c in pm.components(PluginKind.ENTRYPOINT))) or "none"
        raise PluginLoadError(f"no entrypoint named '{args.entrypoint}'; available: {names}")
    serve = spec.resolve()
    options = ServeOptions(
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("PAGEDLLM_API_KEY") or None,
        served_model_name=args.served_model_name,
        max_body_bytes=args.max_body_bytes,
        max_waiting=args.max_waiting,
        drain_timeout_s=args.drain_timeout,
        log_level=args.log_level,
    )
    return int(serve(config, options) or 0)


def main(argv: list[str] | None = None) -> int:
    """`python -m pagedllm.cli.serve_cmd` (the same as `pagedllm serve`)."""
    parser = argparse.ArgumentParser(prog="pagedllm")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
