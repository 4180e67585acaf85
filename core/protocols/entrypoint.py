"""Entrypoint protocol: what `pagedllm serve --entrypoint NAME` runs (the `openai` server is one).

Light (typing only): the API process resolves its entrypoint before the server's packages are imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pagedllm.cli.serve_cmd import ServeOptions
    from pagedllm.config import EngineConfig


class Entrypoint(Protocol):
    """A callable owning its process: it builds an `AsyncLLM` from the engine config and serves until stopped."""

    def __call__(self, config: EngineConfig, options: ServeOptions) -> int | None:
        """Serve; the return value is the process's exit status (None: 0)."""
        ...
