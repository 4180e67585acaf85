"""OutputCollector: one request's hand-off from the engine-core reader to the task streaming it out.

The reader puts one delta RequestOutput per engine step; the consumer (a server handler writing SSE events)
takes whatever has arrived. While the consumer is behind -- the API process busy with other streams -- the
deltas waiting for it are merged into one (texts concatenated, ids and logprobs extended, the newest finish
state), as vLLM's RequestOutputCollector does. So a loaded API process frames, encodes and writes one event
per stream per wake-up instead of one per step it fell behind, and catches up instead of falling further back;
an idle one still sends one event per step. The concatenation of what `get` returns is the same either way.
"""

from __future__ import annotations

import asyncio

from pagedllm.outputs import CompletionOutput, RequestOutput


class OutputCollector:
    def __init__(self) -> None:
        self._output: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Hand over a delta (merged into one not yet taken) or an error (it replaces anything pending: the
        request is over, and what it had not yet streamed will not be read)."""
        pending = self._output
        if pending is None or isinstance(item, BaseException):
            self._output = item
            self._ready.set()
        elif isinstance(pending, RequestOutput):
            merge_delta(pending, item)
        # else: an error is pending and stays the request's last word

    async def get(self) -> RequestOutput | BaseException:
        """The deltas put since the last call, merged into one, or the error that was put instead."""
        while (item := self._output) is None:
            await self._ready.wait()
        self._output = None
        self._ready.clear()
        return item

    def get_nowait(self) -> RequestOutput | BaseException | None:
        """What `get` would return now, or None when nothing has arrived."""
        item, self._output = self._output, None
        self._ready.clear()
        return item


def merge_delta(into: RequestOutput, later: RequestOutput) -> None:
    """Append delta `later` to delta `into` in place, per sample index (a sample absent from `into` is added)."""
    into.finished = later.finished
    into.num_cached_tokens = later.num_cached_tokens
    into.metrics = later.metrics
    into.error = later.error if later.error is not None else into.error
    if later.prompt_logprobs is not None:
        into.prompt_logprobs = later.prompt_logprobs
    by_index = {c.index: c for c in into.outputs}
    added = False
    for nxt in later.outputs:
        cur = by_index.get(nxt.index)
        if cur is None:
            into.outputs.append(nxt)
            by_index[nxt.index] = nxt
            added = True
        else:
            _extend(cur, nxt)
    if added:  # deltas list their samples by index
        into.outputs.sort(key=lambda c: c.index)


def _extend(cur: CompletionOutput, nxt: CompletionOutput) -> None:
    cur.text += nxt.text
    cur.token_ids = cur.token_ids + nxt.token_ids  # a new list: the first delta's may be shared with its caller
    if nxt.logprobs:
        cur.logprobs = list(cur.logprobs or []) + list(nxt.logprobs)
    cur.cumulative_logprob = nxt.cumulative_logprob
    cur.finish_reason, cur.stop_reason = nxt.finish_reason, nxt.stop_reason
