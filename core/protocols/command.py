"""Command protocol: a `pagedllm <name>` subcommand a plugin adds to the CLI (the in-tree `bench` is one).

Light (typing only): `pagedllm --help` builds every registered command's parser, so neither this module nor
what a command's `load()` imports to declare its flags may import torch; the work happens in `func`.
"""

from __future__ import annotations

from typing import Any, Protocol


class Command(Protocol):
    """What a command registration's `load()` returns (a module or an object): it declares the subcommand."""

    def add_parser(self, subparsers: Any) -> None:
        """Add the subcommand to `pagedllm`'s subparsers (`argparse._SubParsersAction`).

        Call `subparsers.add_parser(<the registered name>, help=...)` once, declare its flags, and set
        `func=<callable(argparse.Namespace) -> int | None>` with `set_defaults` on it (or on each of its own
        subcommands): `pagedllm` calls it with the parsed arguments and exits with what it returns (None: 0).
        Import the implementation inside `func`, not here. Flags from `pagedllm.api.cli.add_engine_args` make
        `pagedllm` check the engine config before `func` runs.
        """
        ...
