"""The engine-core process: builds the engine, then loops — take requests in, step, send outputs out.

Started by `EngineCoreClient` (multiprocessing, spawn) with an EngineConfig as a plain dict and two ipc://
addresses. It never sees text: requests arrive as token ids, outputs leave as token ids, so tokenizing and
detokenizing stay in the API process and overlap with the model's steps there.

    loop:
        wait for input (no timeout while there is work, else up to HEARTBEAT_S)
        apply every queued AddRequest / Abort (Shutdown ends the loop)
        step once if anything is unfinished
        send Outputs(step outputs, stats) — also when only an abort changed the stats, and as a heartbeat

NOTE(1): stats ride along with every Outputs message: KV usage after an abort must reach /metrics even when
no step follows (the test "disconnected clients free their blocks" reads exactly that).
NOTE(2): the process exits when its parent is gone (orphaned engines would hold memory forever).
NOTE(3): a dashboard snapshot (engine_watch.py) rides along too, at most every `Watch.interval_s`, and only
after a Watch asked for them; a core without `set_watching` (the data-parallel router) sends none.
NOTE(4): a busy core finds a dead tensor-parallel rank in the step (the executor checks before sending it,
and a collective with a dead peer fails); an idle one asks the executor every HEARTBEAT_S, so /health turns
503 within about a second of the death, not at the next request. A step that cannot fail by itself (NCCL
waits for a dead peer until the group timeout) is ended by the RankWatchdog (rank_watchdog.py), which the
executor's monitor thread tells at once.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from typing import Any

from pagedllm.engine.messages import EngineCoreOutput
from pagedllm.engine.rank_watchdog import RankWatchdog
from pagedllm.engine.serialization import (
    Abort,
    AddRequest,
    AddRequests,
    Fatal,
    Outputs,
    Ready,
    Shutdown,
    Watch,
    decode_to_core,
    encode,
    request_from_message,
)
from pagedllm.protocols.executor import WorkerDiedError

logger = logging.getLogger("pagedllm")

HEARTBEAT_S = 1.0


def run_engine_core(config_dict: dict[str, Any], input_addr: str, output_addr: str, parent_pid: int) -> None:
    """Process entry point (must stay importable by name for the spawn start method)."""
    import zmq

    # Ctrl-C in a terminal reaches the whole process group, and a service manager's SIGTERM often the whole
    # control group: the API process decides when the core stops (it drains first), so both are ignored here.
    # The core still exits on a Shutdown message, on its parent's death (NOTE 2) or on SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("PAGEDLLM_LOG_LEVEL", "WARNING"))
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)  # let the last message (Fatal, final outputs) reach the peer
    out.connect(output_addr)
    try:
        try:
            core, ready = _build(config_dict)
        except Exception as exc:
            out.send(encode(Fatal(f"engine core failed to start: {type(exc).__name__}: {exc}")))
            return
        out.send(encode(ready))
        # NOTE(4): a rank that dies while this process is stuck in a step (NCCL) is reported by the watchdog.
        watchdog = RankWatchdog(output_addr)
        register = getattr(getattr(core, "executor", None), "register_failure_callback", None)
        if register is not None:
            register(watchdog.rank_died)
        try:
            EngineCoreLoop(core, inp, out, parent_pid).run()
        except WorkerDiedError as exc:  # a rank's death is an event to report, not a bug here: no traceback
            logger.error("engine core stopping: %s", exc)
            out.send(encode(Fatal(str(exc))))
            raise SystemExit(1) from exc
        except Exception as exc:
            logger.error("engine core crashed:\n%s", traceback.format_exc())
            out.send(encode(Fatal(f"engine core crashed: {type(exc).__name__}: {exc}")))
            raise SystemExit(1) from exc
        finally:
            watchdog.disarm()  # Fatal is sent (or the loop stopped cleanly): the shutdown may take its time
            core.shutdown()  # tensor-parallel ranks stop with the core
    finally:
        inp.close(linger=0)
        out.close()
        ctx.term()


def _build(config_dict: dict[str, Any]) -> tuple[Any, Ready]:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.builder import build_engine
    from pagedllm.engine.engine_core import EngineCore
    from pagedllm.engine.input_processing import ModelLimits
    from pagedllm.plugin_manager import get_plugin_manager

    # This process loads the plugins afresh: config_loaded, step_stats and logits processors run here.
    pm = get_plugin_manager()
    config = EngineConfig.model_validate(config_dict)
    sections = pm.load_config(config)
    if config.parallel.data_parallel_size > 1:
        return _build_data_parallel(config, pm)
    parts = build_engine(config, pm, plugin_sections=sections)
    limits = ModelLimits.from_model(parts.info, parts.max_model_len)
    ready = Ready(
        pid=os.getpid(),
        model_name=parts.model_ref,
        max_model_len=limits.max_model_len,
        eos_token_ids=sorted(limits.eos_token_ids),
        vocab_size=limits.vocab_size,
        num_blocks=parts.num_blocks,
        block_size=parts.block_size,
        max_num_seqs=parts.config.scheduler.max_num_seqs,
    )
    return EngineCore(parts, pm), ready


def _build_data_parallel(config: Any, pm: Any) -> tuple[Any, Ready]:
    """This process routes requests to the replicas (Ray actors); the loop drives it like an EngineCore."""
    from pagedllm.default_model import resolve_model_reference
    from pagedllm.engine.dp_engine import build_data_parallel_core
    from pagedllm.engine.input_processing import ModelLimits

    core, info, _ = build_data_parallel_core(config, pm)
    limits = ModelLimits.from_model(info, int(core.max_model_len))
    ready = Ready(
        pid=os.getpid(),
        model_name=resolve_model_reference(config.model),
        max_model_len=limits.max_model_len,
        eos_token_ids=sorted(limits.eos_token_ids),
        vocab_size=limits.vocab_size,
        num_blocks=sum(r["num_blocks"] for r in core.info),
        block_size=config.kv_cache.block_size,
    )
    return core, ready


class EngineCoreLoop:
    """The busy loop around one EngineCore and its two sockets."""

    def __init__(self, core: Any, inp: Any, out: Any, parent_pid: int) -> None:
        self.core, self.inp, self.out, self.parent_pid = core, inp, out, parent_pid
        self._pending_errors: list[EngineCoreOutput] = []
        self.watch_interval = 0.0  # NOTE 3: 0 while nobody watches
        self._last_snapshot = 0.0

    def run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.inp, zmq.POLLIN)
        last_sent = last_checked = 0.0
        check_health = getattr(self.core, "check_health", None)  # a data-parallel core checks its replicas itself
        while True:
            busy = self.core.has_unfinished_requests()
            poller.poll(0 if busy else int(HEARTBEAT_S * 1000))
            if not busy and check_health is not None and time.monotonic() - last_checked >= HEARTBEAT_S:
                check_health()  # NOTE(4): raises WorkerDiedError, and the core reports Fatal
                last_checked = time.monotonic()
            changed, stop = self._drain_input()
            if stop:
                return
            outputs, self._pending_errors = self._pending_errors, []
            if self.core.has_unfinished_requests():
                outputs.extend(self.core.step())
            now = time.monotonic()
            if outputs or changed or now - last_sent >= HEARTBEAT_S:
                snapshot = None
                if self.watch_interval and now - self._last_snapshot >= self.watch_interval:  # NOTE 3
                    snapshot, self._last_snapshot = self.core.snapshot(), now
                self.out.send(encode(Outputs(outputs, self.core.get_stats(), time.time(), snapshot)))
                last_sent = now
            if os.getppid() != self.parent_pid:
                logger.warning("engine core: the API process is gone; exiting")
                return

    def _add(self, msg: AddRequest) -> None:
        try:
            self.core.add_request(request_from_message(msg))
        except Exception as exc:  # e.g. a duplicate id: fail that request, not the engine
            self._pending_errors.append(EngineCoreOutput(msg.request_id, [], finish_reason="error", error=str(exc)))

    def _drain_input(self) -> tuple[bool, bool]:
        """Apply every queued message. Returns (anything changed, shutdown requested)."""
        import zmq

        changed = False
        while True:
            try:
                data = self.inp.recv(zmq.NOBLOCK)
            except zmq.Again:
                return changed, False
            msg = decode_to_core(data)
            changed = True
            if isinstance(msg, AddRequest):
                self._add(msg)
            elif isinstance(msg, AddRequests):
                for one in msg.requests:
                    self._add(one)
            elif isinstance(msg, Abort):
                self.core.abort_requests(msg.request_ids)
            elif isinstance(msg, Shutdown):
                return changed, True
            elif isinstance(msg, Watch):
                set_watching = getattr(self.core, "set_watching", None)
                if set_watching is not None:
                    set_watching(msg.interval_s > 0)
                    self.watch_interval, self._last_snapshot = msg.interval_s, 0.0
