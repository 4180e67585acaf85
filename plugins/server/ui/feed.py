"""The dashboard's event stream: engine snapshots as server-sent events, watched only while someone looks.

The first connected dashboard makes the engine core start recording (`AsyncLLM.watch_engine`); the last one
to leave stops it, so an engine nobody watches records nothing (engine_watch.py in the core).

    GET /ui/events  ->  event: hello     {model, num_blocks, block_size, max_num_seqs, max_model_len, interval_s}
                        data: {...}      one per snapshot: {"snapshot": EngineSnapshot, "stats": totals}
                        : keepalive      every KEEPALIVE_S without a snapshot (proxies close silent streams)
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.api.engine import AsyncLLM, EngineDeadError

INTERVAL_S = 0.5  # snapshot period while watched: two pictures a second read as live, and cost the core little
POLL_S = 0.1  # how often a stream looks for a new snapshot (an attribute read on the event loop)
KEEPALIVE_S = 10.0


def _event(data: dict[str, Any], name: str | None = None) -> bytes:
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class DashboardFeed:
    """Counts connected dashboards and turns the engine's recording on and off with them."""

    def __init__(self, engine: AsyncLLM, draining: Any, interval_s: float = INTERVAL_S) -> None:
        self.engine = engine
        self.draining = draining  # () -> bool: a draining server ends the streams, so they do not hold it up
        self.interval_s = interval_s
        self.clients = 0

    def hello(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.engine.model_name, "interval_s": self.interval_s,
                               "max_num_seqs": self.engine.config.scheduler.max_num_seqs}
        try:
            ready = self.engine.ready
        except EngineDeadError:  # a core being restarted has not told its limits yet
            return out
        return {**out, "num_blocks": ready.num_blocks, "block_size": ready.block_size,
                "max_model_len": ready.max_model_len}

    def message(self) -> dict[str, Any]:
        """The latest snapshot with the engine's running totals (SchedulerStats) beside it."""
        snap = self.engine.snapshot
        stats = self.engine.stats
        return {
            "snapshot": dataclasses.asdict(snap) if snap is not None else None,
            "stats": {
                "num_preemptions": stats.num_preemptions, "num_steps": stats.num_steps,
                "kv_cache_usage": stats.kv_cache_usage, "prefix_cache_queries": stats.prefix_cache_queries,
                "prefix_cache_hits": stats.prefix_cache_hits, "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
                "num_running": stats.num_running, "num_waiting": stats.num_waiting,
            },
            "healthy": self.engine.healthy,
        }

    async def events(self) -> AsyncIterator[bytes]:
        self.clients += 1
        if self.clients == 1:
            self.engine.watch_engine(self.interval_s)
        try:
            yield _event(self.hello(), "hello")
            last: Any = None
            healthy = self.engine.healthy
            quiet = 0.0
            while not self.draining():
                snap = self.engine.snapshot
                # A dead core sends no snapshots: its death (and a restart) is news of its own.
                if (snap is not None and snap is not last) or self.engine.healthy != healthy:
                    last, healthy, quiet = snap, self.engine.healthy, 0.0
                    yield _event(self.message())
                elif quiet >= KEEPALIVE_S:
                    quiet = 0.0
                    yield b": keepalive\n\n"
                await asyncio.sleep(POLL_S)
                quiet += POLL_S
        finally:  # the client left (the response task is cancelled) or the server drains
            self.clients -= 1
            if self.clients == 0:
                self.engine.watch_engine(0)
