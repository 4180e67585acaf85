"""The server's life around the engine: admission state, the engine-core restart policy, the SIGTERM drain.

    serving ──SIGTERM──▶ draining: new requests 503 + Retry-After, in-flight ones run on
                           │ all finished, or --drain-timeout passed: the rest end with a 503 error
                           ▼ (a stream gets an error event, then [DONE]); then uvicorn stops, the core closes
                         stopped (exit 0)

    serving ──core dies──▶ every pending request 503 at once, /health 503, gauges 0
                           │ restarts left: respawn after a backoff (1 s, 2 s, 4 s ... 30 s), serve again
                           ▼ none left (default --engine-restarts 0): stop the server, exit 1

NOTE(1): exiting is the default, as in vLLM: an API server that stays up answering 503 over a dead core
never trips a container's or systemd's restart policy, which is what restores service for most operators.
NOTE(2): the drain keeps the listening socket open and answers 503 rather than refusing connections: a load
balancer may still route here for a moment after the SIGTERM, and a 503 with Retry-After is retried
elsewhere, while a refused connection is often reported to the user.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.api.engine import AsyncLLM, EngineDeadError
from pagedllm.plugins.server.errors import APIError

logger = logging.getLogger("pagedllm.server")

BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
# After the drain ended every request, how long uvicorn may take to flush their last bytes.
FLUSH_S = 5.0


@dataclass
class ServerState:
    """What the HTTP layer asks before admitting a request."""

    draining: bool = False
    # Set when the process should exit non-zero (the engine core died and no restart is left).
    exit_code: int = 0


def shutting_down_error() -> APIError:
    return APIError(503, "the server is shutting down; retry on another replica", None, "server_shutting_down")


class EngineSupervisor:
    """The restart policy (NOTE 1): on core death, respawn up to `restarts` times with backoff, else `give_up()`."""

    def __init__(self, engine: AsyncLLM, state: ServerState, restarts: int, give_up: Callable[[], None],
                 backoff_s: float = BACKOFF_START_S) -> None:
        self.engine, self.state, self.restarts_left, self.give_up = engine, state, restarts, give_up
        self.backoff_s = backoff_s
        self._task: asyncio.Task[None] | None = None
        engine.death_listeners.append(self._on_death)

    def _on_death(self, reason: str) -> None:
        if self.state.draining:
            return  # stopping anyway: the drain ends what is left
        self._task = asyncio.get_running_loop().create_task(self._recover(reason), name="pagedllm-supervisor")

    async def _recover(self, reason: str) -> None:
        delay = self.backoff_s
        while self.restarts_left > 0 and not self.state.draining:
            self.restarts_left -= 1
            logger.warning("engine core died (%s); restarting it in %.0fs (%d restart(s) left after this one)",
                           reason, delay, self.restarts_left)
            await asyncio.sleep(delay)
            try:
                ready = await self.engine.restart()
            except EngineDeadError as exc:
                reason = str(exc)
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            logger.warning("engine core restarted (pid %d); serving again", ready.pid)
            return
        if not self.state.draining:
            logger.error("engine core died (%s) and no restart is left (--engine-restarts); exiting", reason)
            self.state.exit_code = 1
            self.give_up()

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def drain(engine: AsyncLLM, state: ServerState, timeout_s: float) -> None:
    """Stop admission, wait for in-flight requests up to `timeout_s`, then end the rest with a 503."""
    state.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    logger.info("draining: %d request(s) in flight, up to %.0fs", engine.num_unfinished_requests, timeout_s)
    while engine.num_unfinished_requests and loop.time() < deadline:
        await asyncio.sleep(0.1)
    ended = engine.fail_all(shutting_down_error)
    if ended:
        logger.warning("drain timeout: ended %d request(s) still in flight with a 503", ended)
