"""Registers the `bench` command: `pagedllm bench throughput|latency|serve`.

Benchmarks: workloads, our engine timed, transformers, llama.cpp and vLLM baselines, reports, a load generator for
OpenAI-compatible servers. Light on purpose: `load()` gives the flag-declaring module (`cli.py`, no torch), and
the benchmarks import the engine, torch, transformers, llama_cpp or httpx only when one runs.
"""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterCommand, hookimpl


def _load() -> Any:
    from pagedllm.plugins.commands.bench import cli

    return cli


@hookimpl
def register_commands(register: RegisterCommand) -> None:
    register("bench", _load, description="measure throughput or latency (optionally against HF / llama.cpp / vLLM)")
