"""Registers the `sink` KV manager: a sliding window plus the first `num_sink_tokens` tokens (StreamingLLM's
attention sinks), whose blocks stay pinned while the request runs."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterKVManager, hookimpl


def _load() -> Any:
    from pagedllm.plugins.kvmanagers.sink.manager import SinkWindowManager

    return SinkWindowManager


@hookimpl
def register_kv_managers(register: RegisterKVManager) -> None:
    from pagedllm.api import SinkSlidingWindowSpec

    # The engine picks the manager of the most specific spec class, so this one, not sliding_window, takes
    # a SinkSlidingWindowSpec group.
    register(
        "sink",
        _load,
        spec_type=SinkSlidingWindowSpec,
        description="sliding window + the first num_sink_tokens tokens' blocks kept (StreamingLLM sinks)",
    )
