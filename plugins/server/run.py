"""The `openai` entrypoint's process: tokenizer here, engine core in its own process, uvicorn in front.

SIGTERM / Ctrl-C: a drain (lifecycle.py): new requests get 503 with Retry-After, in-flight ones (streams
included) finish for up to `drain_timeout_s`, the rest end with a 503 error; only then does uvicorn stop and
the engine core shut down. A second signal stops at once. Engine-core death: lifecycle.EngineSupervisor
(exit 1 by default, or `--engine-restarts N` respawns).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from pagedllm.api.engine import EngineConfig

logger = logging.getLogger("pagedllm.server")


def serve(config: EngineConfig, options: Any) -> int:
    """Run until stopped. `options` is a `pagedllm.cli.serve_cmd.ServeOptions`."""
    logging.basicConfig(level=options.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return asyncio.run(_serve(config, options))


async def _serve(config: EngineConfig, options: Any) -> int:
    import uvicorn

    from pagedllm.api.engine import AdmissionLimits, AsyncLLM, EngineDeadError
    from pagedllm.plugins.server.app import build_app
    from pagedllm.plugins.server.lifecycle import FLUSH_S, EngineSupervisor, ServerState
    from pagedllm.plugins.server.options import ServerSection

    # --max-waiting N >= 1 arrives as scheduler.max_waiting; 0 (unbounded) only here.
    limits = AdmissionLimits(
        max_waiting=0 if options.max_waiting == 0 else None,
        max_tokens=options.max_tokens_limit,
        request_timeout_s=options.request_timeout_s,
    )
    from pagedllm.plugins.server.chat_parsing import ChatParsing

    try:  # a misspelt parser name stops the server before the engine loads
        chat_parsing = ChatParsing.from_settings(options, config.plugins.get("openai"))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine = AsyncLLM(config, served_model_name=options.served_model_name, limits=limits)
    engine.chat_template = getattr(options, "chat_template", None)
    try:  # no --tool-call-parser: the one the model's template implies (before the engine core starts)
        chat_parsing = chat_parsing.for_model(engine.chat_template or getattr(engine.tokenizer, "chat_template", None))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        await engine.shutdown()
        return 2
    try:
        ready = await engine.start()
    except EngineDeadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        await engine.shutdown()
        return 1
    logger.info("engine core ready (pid %d): %s, max_model_len %d, waiting bound %s", ready.pid, engine.model_name,
                ready.max_model_len, engine.max_waiting if engine.max_waiting is not None else "none")
    state = ServerState()
    app = build_app(engine, options.api_key, options.max_body_bytes, state=state,
                    ui=ServerSection.resolve_ui(options, config.plugins.get("openai")))
    app.state.chat_parsing = chat_parsing
    server = _draining_server_class()(
        uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level, lifespan="off",
                       timeout_graceful_shutdown=int(FLUSH_S)),
    )
    server.pagedllm_drain = (engine, state, float(options.drain_timeout_s))

    def give_up() -> None:
        server.should_exit = True

    supervisor = EngineSupervisor(engine, state, options.engine_restarts, give_up)
    # NOTE: this process holds transformers, the tokenizer, FastAPI and pydantic's schemas: hundreds of thousands
    # of objects alive for as long as it serves. Out of the cyclic GC's generations with them (as vLLM's API
    # server does after start-up): at 256 streams a full collection walked them all ~every 2 s (0.47 s each
    # on the 2-core CPU machine, tools/online_cpu_profile.py). Reference counting still frees them.
    gc.collect()
    gc.freeze()
    try:
        await server.serve()
    finally:
        await supervisor.stop()
        if server.drain_task is not None:
            await asyncio.gather(server.drain_task, return_exceptions=True)
        await engine.shutdown()
    return state.exit_code


def _draining_server_class() -> type:
    import uvicorn

    from pagedllm.plugins.server.lifecycle import drain

    class DrainingServer(uvicorn.Server):
        """The first SIGTERM / SIGINT starts the drain, and uvicorn's own shutdown only once it is over;
        a second one stops at once. (uvicorn would re-raise a captured signal after its shutdown, killing
        this process before the engine core is shut down: here it does not.)"""

        pagedllm_drain: tuple[Any, Any, float]
        drain_task: asyncio.Task[None] | None = None
        _signalled = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self._signalled or self.should_exit:
                super().handle_exit(sig, frame)
                self.force_exit = True
                return
            self._signalled = True
            # A signal handler runs between two bytecodes of the loop's thread: schedule, do not await.
            loop = asyncio.get_event_loop()
            loop.call_soon_threadsafe(self._start_drain)

        def _start_drain(self) -> None:
            if self.drain_task is None:
                self.drain_task = asyncio.get_running_loop().create_task(self._drain_then_exit())

        async def _drain_then_exit(self) -> None:
            try:
                await drain(*self.pagedllm_drain)
            finally:
                self.should_exit = True

        def capture_signals(self) -> Any:
            server = self

            @contextlib.contextmanager
            def scope() -> Iterator[None]:
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                previous = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for sig, handler in previous.items():
                        signal.signal(sig, handler)

            return scope()

    return DrainingServer
