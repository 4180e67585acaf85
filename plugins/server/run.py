"""The `openai` entrypoint's process: tokenizer here, engine core in its own process, uvicorn in front.

SIGTERM / Ctrl-C: uvicorn stops accepting connections and lets in-flight requests (streams included) finish
for up to `drain_timeout_s`; only then is the engine core shut down.
"""

from __future__ import annotations

import asyncio
import contextlib
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

    from pagedllm.api.engine import AsyncLLM, EngineDeadError
    from pagedllm.plugins.server.app import build_app

    engine = AsyncLLM(config, served_model_name=options.served_model_name)
    try:
        ready = await engine.start()
    except EngineDeadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        await engine.shutdown()
        return 1
    logger.info("engine core ready (pid %d): %s, max_model_len %d", ready.pid, engine.model_name, ready.max_model_len)
    app = build_app(engine, options.api_key, options.max_body_bytes)
    server = _draining_server_class()(
        uvicorn.Config(
            app,
            host=options.host,
            port=options.port,
            log_level=options.log_level,
            lifespan="off",
            timeout_graceful_shutdown=int(options.drain_timeout_s),
        )
    )
    try:
        await server.serve()
    finally:
        await engine.shutdown()
    return 0


def _draining_server_class() -> type:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn re-raises a captured SIGTERM once it has drained, which would kill this process before
        the engine core is shut down; here the signal only starts the graceful shutdown."""

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
