"""`pagedllm disagg --prefill URL --prefill-kv HOST:PORT --decode URL [--host H] [--port P]`: the P/D router.

Declares the flags only (what the registration's `load()` returns); the routing is in proxy.py.
"""

from __future__ import annotations

import argparse
from typing import Any


def _kv_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"want HOST:PORT (the prefill engine's plugins.pd.host/port), got {text!r}")
    return host, int(port)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_parser(sub: Any) -> None:
    p = sub.add_parser("disagg", help="route OpenAI requests through a prefill server, then a decode server")
    p.add_argument("--prefill", required=True, help="the prefill server's base URL (kv_connector pd, kv_producer)")
    p.add_argument("--prefill-kv", required=True, type=_kv_address,
                   help="HOST:PORT of the prefill engine's KV server (its plugins.pd.host and plugins.pd.port)")
    p.add_argument("--decode", required=True, help="the decode server's base URL (kv_connector pd, kv_consumer)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--prefill-timeout", type=_positive_float, default=30.0,
                   help="seconds the prefill request may take before the decode server prefills itself (default 30)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    import uvicorn

    from pagedllm.plugins.commands.disagg.proxy import Router, make_app

    try:
        router = Router(args.prefill, args.prefill_kv, args.decode, args.prefill_timeout)
    except ValueError as exc:
        print(f"pagedllm disagg: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(make_app(router), host=args.host, port=args.port, log_level=args.log_level)
    return 0
