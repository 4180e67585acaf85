"""`pagedllm config show`: the resolved config and, with --resolve, the components the selector picks."""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from pagedllm.cli.engine_args import add_engine_args, engine_config_from_args


def add_parser(sub: Any) -> None:
    p = sub.add_parser("config", help="inspect configuration")
    csub = p.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="print the resolved config (and the selected plugins with --resolve)")
    show.add_argument("--resolve", action="store_true", help="build the engine and explain every selection")
    add_engine_args(show)
    show.set_defaults(func=run_show)


def run_show(args: argparse.Namespace) -> int:
    cfg = engine_config_from_args(args)
    print(yaml.safe_dump(cfg.model_dump(), sort_keys=False).rstrip())
    if args.resolve:
        from pagedllm.engine.builder import build_engine

        parts = build_engine(cfg)
        print("\n# selected components")
        print(parts.describe())
    return 0
