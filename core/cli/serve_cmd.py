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
from pagedllm.config import ConfigError

DEFAULT_ENTRYPOINT = "openai"


@dataclass
class ServeOptions:
    """What an entrypoint plugin needs besides the engine config."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 4 << 20
    max_waiting: int | None = None  # None: sized from the KV cache; 0: unbounded
    max_tokens_limit: int | None = None
    request_timeout_s: float | None = None
    engine_restarts: int = 0
    drain_timeout_s: float = 30.0
    log_level: str = "info"
    # Chat parsing (plugins found by name; None: the entrypoint's config section decides, else off).
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool | None = None
    # A chat template replacing the model's own (vLLM's --chat-template): the template text itself.
    chat_template: str | None = None
    # The web chat and engine dashboard at / (an entrypoint's own); False: --no-ui; None: its config decides.
    ui: bool | None = None


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the engine over HTTP (OpenAI-compatible API by default)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $PAGEDLLM_API_KEY if set)")
    g.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    g.add_argument("--max-waiting", type=_non_negative_int, default=None,
                   help="bound on waiting requests; beyond it requests get 429 with Retry-After (sets "
                   "scheduler.max_waiting; default: sized from the KV cache; 0: unbounded)")
    g.add_argument("--max-tokens-limit", type=_positive_int, default=None,
                   help="ceiling on one request's max_tokens: above it 400, and the default when a request gives none")
    g.add_argument("--request-timeout", type=_positive_float, default=None,
                   help="seconds a request may run; past it 408 (or a stream error event) and the engine stops its work")
    g.add_argument("--engine-restarts", type=_non_negative_int, default=0,
                   help="respawn a dead engine core up to N times, with backoff (default 0: the server exits 1)")
    g.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest accepted request body")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish (new ones get 503); the rest then "
                   "end with a 503 error")
    g.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info",
                   help="server log level (vLLM's --uvicorn-log-level is the same flag)")
    g.add_argument("--chat-template", default=None,
                   help="a chat template replacing the model's own: a file path, or the Jinja text itself")
    g.add_argument("--entrypoint", default=DEFAULT_ENTRYPOINT, help="entrypoint plugin name")
    g.add_argument("--no-ui", dest="ui", action="store_false", default=None,
                   help="do not serve the web chat and engine dashboard at / (sets plugins.openai.ui=false)")
    g.add_argument("--tool-call-parser", default=None,
                   help="tool parser plugin turning model output into tool_calls (hermes, llama3_json, mistral, "
                   "pythonic, or any installed one)")
    g.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                   help='allow tool_choice "auto" (the model decides; needs --tool-call-parser), as in vLLM')
    g.add_argument("--reasoning-parser", default=None,
                   help="reasoning parser plugin splitting out reasoning_content (deepseek_r1, qwen3, ...)")
    # vLLM's `serve MODEL`: the model as a positional argument (the same as --model).
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model folder, .gguf file, Hugging Face repo id or alias (same as --model)")
    add_engine_args(p)
    p.set_defaults(func=run)


def _read_chat_template(value: str | None) -> str | None:
    """vLLM's rule: a path that exists is read; anything else is the template text (it must look like Jinja)."""
    import os

    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError(f"--chat-template: '{value}' is neither a file nor a Jinja template")


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def run(args: argparse.Namespace) -> int:
    import os

    from pagedllm.cli.engine_args import engine_config_from_args
    from pagedllm.plugin_manager import get_plugin_manager
    from pagedllm.plugin_spec import PluginKind, PluginLoadError

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ConfigError(f"serve: the model is given twice, '{args.model_tag}' and --model '{args.model}'")
        args.model = args.model_tag
    chat_template = _read_chat_template(args.chat_template)
    if args.max_waiting:  # 0 (unbounded) is not a scheduler.max_waiting value: ServeOptions carries it
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
        max_tokens_limit=args.max_tokens_limit,
        request_timeout_s=args.request_timeout,
        engine_restarts=args.engine_restarts,
        drain_timeout_s=args.drain_timeout,
        log_level=args.log_level,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        chat_template=chat_template,
        ui=args.ui,
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
