"""`pagedllm top [--url URL] [--interval S] [--once] [--json]`: a running server's /metrics, refreshed in place.

Declares the flags only (what the registration's `load()` returns); the work is in scrape.py and view.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_parser(sub: Any) -> None:
    p = sub.add_parser("top", help="a live terminal view of a running server's /metrics")
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="the server (its /metrics is read; default http://127.0.0.1:8000)")
    p.add_argument("--interval", type=_positive_float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--once", action="store_true",
                   help="print one view (no screen control) and exit: for scripts and logs")
    p.add_argument("--json", action="store_true", help="with --once: the figures as one JSON object instead")
    p.add_argument("--timeout", type=_positive_float, default=5.0, help="seconds to wait for each scrape")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedllm.plugins.commands.top.scrape import ScrapeError, scrape
    from pagedllm.plugins.commands.top.view import render, summary

    if args.json and not args.once:
        print("pagedllm top: --json needs --once", file=sys.stderr)
        return 2
    try:
        if args.once:
            snapshot = scrape(args.url, args.timeout)
            if args.json:
                import json

                print(json.dumps(summary(snapshot, None), indent=2, sort_keys=True))
            else:
                print("\n".join(render(snapshot, None, args.url)))
            return 0
        previous = None
        while True:
            try:
                snapshot = scrape(args.url, args.timeout)
                screen = render(snapshot, previous, args.url)
                previous = snapshot
            except ScrapeError as exc:  # a restarting server comes back: keep trying, say why meanwhile
                screen = [f"pagedllm top  {args.url}  {time.strftime('%H:%M:%S')}", "", str(exc), "retrying..."]
                previous = None
            # Home, clear to the end: the view redraws in place without scrolling the terminal.
            sys.stdout.write("\x1b[H\x1b[J" + "\n".join(screen) + "\n")
            sys.stdout.flush()
            time.sleep(args.interval)
    except ScrapeError as exc:
        print(f"pagedllm top: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
