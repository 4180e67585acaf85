"""EngineCoreClient: starts the engine-core process and talks to it over ZMQ, from an asyncio event loop.

Two ipc:// sockets in a private temporary folder (no TCP port, nothing reachable from outside):

    client PUSH (bound) ──▶ core PULL    requests and aborts
    client PULL (bound) ◀── core PUSH    Ready, then Outputs per step / heartbeat, Fatal on failure

Death detection: the reader task wakes at least every POLL_S; when nothing arrived it checks the process
(`is_alive`, i.e. its sentinel). A dead core, or a Fatal message, calls `on_death(reason)` exactly once, so
the frontend fails every pending request at once instead of letting them hang.

NOTE(1): after `shutdown()` the sockets are closed; an abort that arrives then (a request task cancelled
late by the HTTP server) has nothing left to free and returns quietly instead of raising ZMQError (the old
"Socket operation on non-socket" tracebacks at the end of a drain), and a new request is EngineDeadError.
NOTE(2): requests added in one event-loop turn travel as one AddRequests message, sent at the end of that
turn. The prompts (and the n samples) of one API request are added in one turn, so the core takes them into
the same step; sent one by one, a core that was idle woke on the first and stepped with it alone, and a
loaded machine made that several waves (8 prompts of 4 tokens took 6 steps). Anything else sent to the core
(an abort, Watch, Shutdown) first sends the pending adds, so an abort never overtakes its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from pagedllm.config import EngineConfig
from pagedllm.engine.core_proc import run_engine_core
from pagedllm.engine.serialization import (
    Abort,
    AddRequest,
    AddRequests,
    Fatal,
    Outputs,
    Ready,
    Shutdown,
    Watch,
    decode_from_core,
    encode,
    make_add_request,
)
from pagedllm.request import Request

logger = logging.getLogger("pagedllm")

POLL_S = 0.2


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; requests cannot be served until the server restarts."""


class EngineCoreClient:
    def __init__(
        self,
        config: EngineConfig,
        on_outputs: Callable[[Outputs], None],
        on_death: Callable[[str], None],
    ) -> None:
        self.config = config
        self.on_outputs = on_outputs
        self.on_death = on_death
        self.ready: Ready | None = None
        self.dead_reason: str | None = None
        self._dir = tempfile.mkdtemp(prefix="pagedllm-ipc-")
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._push = self._sync_ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a burst of requests
        self._push.setsockopt(zmq.LINGER, 0)
        self._pull = self._async_ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self.input_addr = f"ipc://{os.path.join(self._dir, 'input')}"
        self.output_addr = f"ipc://{os.path.join(self._dir, 'output')}"
        self._push.bind(self.input_addr)
        self._pull.bind(self.output_addr)
        self._proc: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._closed = False
        self._adds: list[AddRequest] = []  # NOTE 2: added this event-loop turn, not yet sent

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def alive(self) -> bool:
        # Ready, not just spawned: a core still loading its model (a restart) cannot take requests yet.
        return (self.dead_reason is None and not self._closed and self._reader is not None
                and self._proc is not None and self._proc.is_alive())

    async def start(self, timeout: float = 900.0) -> Ready:
        """Spawn the core and wait for its Ready message (model loading happens there)."""
        # spawn, not fork: the API process may already hold threads (uvicorn, tokenizers) and a fork
        # would copy their locks mid-flight.
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(
            target=run_engine_core,
            # The sizes the config left unset stay unset there (config.py to_process_dict).
            args=(self.config.to_process_dict(), self.input_addr, self.output_addr, os.getpid()),
            name="pagedllm-engine-core",
            daemon=True,
        )
        self._proc.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if await self._pull.poll(int(POLL_S * 1000)):
                msg = decode_from_core(await self._pull.recv())
                if isinstance(msg, Ready):
                    self.ready = msg
                    break
                if isinstance(msg, Fatal):
                    await self._reap()
                    raise EngineDeadError(msg.message)
                continue
            if not self._proc.is_alive():
                raise EngineDeadError(f"the engine-core process exited during start-up (exit code {self._proc.exitcode})")
            if loop.time() > deadline:
                await self._reap()
                raise EngineDeadError(f"the engine core did not become ready within {timeout:.0f}s")
        self._reader = asyncio.create_task(self._read_loop(), name="pagedllm-engine-core-reader")
        return self.ready

    def add_request(self, request: Request) -> None:
        if self._closed:  # NOTE 1
            raise EngineDeadError("the engine core has been shut down")
        self._check_alive()
        if self._reader is None:
            raise EngineDeadError("the engine core is starting (after a restart); retry shortly")
        self._adds.append(make_add_request(request))
        if len(self._adds) == 1:  # NOTE 2
            try:
                asyncio.get_running_loop().call_soon(self._send_adds)
            except RuntimeError:  # no event loop (a synchronous caller): nothing to gather with
                self._send_adds()

    def _send_adds(self) -> None:
        adds, self._adds = self._adds, []
        if not adds or self._closed or self.dead_reason is not None:
            return  # a death has failed these requests already (on_death); a shutdown is ending them
        msg = adds[0] if len(adds) == 1 else AddRequests(adds)
        # NOBLOCK: a PUSH socket whose peer has vanished blocks forever, and this runs on the event loop.
        # With no send limit (SNDHWM 0) it only refuses when no core is connected: the core is gone.
        try:
            self._push.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self._died("the engine core is not accepting requests (its process is gone)")

    def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None and not self._closed:  # NOTE 1
            self._send_adds()  # NOTE 2
            with contextlib.suppress(zmq.Again):  # no core: nothing left to free
                self._push.send(encode(Abort(list(request_ids))), zmq.NOBLOCK)

    def watch(self, interval_s: float) -> None:
        """Ask the core for dashboard snapshots every `interval_s` (0: stop; engine_watch.py)."""
        if self.dead_reason is None and not self._closed and self._reader is not None:
            self._send_adds()  # NOTE 2
            with contextlib.suppress(zmq.Again):  # no core: nothing to watch
                self._push.send(encode(Watch(interval_s)), zmq.NOBLOCK)

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    async def _read_loop(self) -> None:
        try:
            while True:
                if await self._pull.poll(int(POLL_S * 1000)):
                    msg = decode_from_core(await self._pull.recv())
                    if isinstance(msg, Outputs):
                        self.on_outputs(msg)
                    elif isinstance(msg, Fatal):
                        self._died(msg.message)
                        return
                elif not self._proc.is_alive():
                    self._died(f"the engine-core process died (exit code {self._proc.exitcode})")
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave requests hanging either
            logger.exception("engine-core reader failed")
            self._died(f"the engine-core connection failed: {type(exc).__name__}: {exc}")

    def _died(self, reason: str) -> None:
        if self.dead_reason is None and not self._closed:
            logger.error("engine core is dead: %s", reason)
            self.dead_reason = reason
            self.on_death(reason)

    async def _reap(self) -> None:
        if self._proc is None:
            return
        await asyncio.to_thread(self._proc.join, 5)
        if self._proc.is_alive():
            self._proc.kill()
            await asyncio.to_thread(self._proc.join, 5)

    async def shutdown(self) -> None:
        """Ask the core to stop, then make sure it did; close the sockets and remove the ipc folder."""
        if self._closed:
            return
        self._send_adds()  # NOTE 2
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if self._proc is not None and self._proc.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._push.send(encode(Shutdown()), zmq.NOBLOCK)
            await asyncio.to_thread(self._proc.join, 10)
            if self._proc.is_alive():
                self._proc.terminate()
            await self._reap()
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._sync_ctx.term()
        self._async_ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
