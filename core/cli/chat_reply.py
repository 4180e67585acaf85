"""One `pagedllm chat` reply: streamed from the engine's delta outputs as they arrive, stoppable with Ctrl-C.

The engine is AsyncLLM, the frontend `pagedllm serve` uses: its `generate` yields per-step deltas (new text
only), and leaving it early aborts the request in the engine core, which frees its KV blocks (async_llm.py
NOTE 1). The core process ignores SIGINT (core_proc.py), so Ctrl-C reaches only this process.

NOTE(1): Ctrl-C during a reply cancels the reply's task instead of raising KeyboardInterrupt wherever the
main thread happens to be (possibly inside the ZMQ reader or the detokenizer, leaving either half-updated).
The handler is installed only while a reply runs; at the prompt, Ctrl-C is Python's KeyboardInterrupt,
which the prompt loop answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedllm.sampling_params import SamplingParams


class ReplyFailedError(RuntimeError):
    """The engine ended the request with an error (the message says which)."""


@dataclass
class Reply:
    text: str = ""
    finish_reason: str | None = None  # "stop", "length", ... None when stopped by Ctrl-C
    stopped: bool = False  # Ctrl-C ended it early


def stream_reply(
    loop: asyncio.AbstractEventLoop, engine: Any, prompt_ids: list[int], params: SamplingParams,
    write: Callable[[str], None],
) -> Reply:
    """Run one reply to completion (or Ctrl-C), writing each piece of text as the engine produces it.

    Raises what `engine.generate` raises (RequestValidationError, EngineDeadError) and ReplyFailedError."""
    reply = Reply()
    task = loop.create_task(_consume(engine, prompt_ids, params, write, reply))
    try:
        loop.add_signal_handler(signal.SIGINT, task.cancel)  # NOTE 1
        handler = True
    except (NotImplementedError, RuntimeError):  # no signal handlers on this platform or thread
        handler = False
    try:
        loop.run_until_complete(task)
    except asyncio.CancelledError:  # Ctrl-C (NOTE 1): generate()'s own cleanup has aborted the request
        reply.stopped = True
    except KeyboardInterrupt:  # where no handler could be installed
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(task)
        reply.stopped = True
    finally:
        if handler:
            loop.remove_signal_handler(signal.SIGINT)
    return reply


async def _consume(
    engine: Any, prompt_ids: list[int], params: SamplingParams, write: Callable[[str], None], reply: Reply
) -> None:
    async for out in engine.generate({"prompt_token_ids": prompt_ids}, params, prompt_param="messages"):
        if out.error:
            raise ReplyFailedError(out.error)
        for sample in out.outputs:
            if sample.text:
                write(sample.text)
                reply.text += sample.text
            if sample.finish_reason is not None:
                reply.finish_reason = sample.finish_reason
