"""EngineWatch: what the engine dashboard shows, recorded in the engine core only while someone watches.

The server's dashboard (plugins/server/ui/) asks for it with a `Watch(interval_s)` message; the core then
builds an `EngineWatch`, feeds it every step, and attaches an `EngineSnapshot` to an `Outputs` message at most
every `interval_s`. Nobody watching: `EngineCore.watch` is None and a step pays one attribute test.

    step ──▶ on_step: one StepRecord (prefill / decode tokens, duration), request timelines advanced
    abort ─▶ on_abort: those timelines end
    every interval_s ──▶ snapshot(): queue counts, the KV pool drawn (kv_cache/pool_snapshot.py; at most once a
                         second: it walks every block), the window's steps and token totals, the live and
                         recently finished requests' timelines

Times are wall-clock seconds (time.time()) of the core's machine: the browser places them relative to the
snapshot's own `time`, so neither the API process's nor the browser's clock has to agree with it.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.messages import EngineCoreOutput, SchedulerOutput
from pagedllm.kv_cache.pool_snapshot import KVPoolSnapshot, snapshot_pool
from pagedllm.request import Request, RequestStatus

MAX_STEPS = 256  # step records per snapshot (the window's totals still count every step)
MAX_FINISHED = 24  # finished requests' timelines kept for the picture
MAX_LIVE = 40  # live requests' timelines per snapshot (the oldest first)
KV_PERIOD_S = 1.0  # the pool picture is redrawn at most this often (pool_snapshot.py: O(blocks))


@dataclass
class StepRecord:
    """One engine step: when it ended, how long it took, and its batch (tokens by kind, requests)."""

    end: float
    duration_s: float
    prefill_tokens: int
    decode_tokens: int
    num_requests: int


@dataclass
class RequestTimeline:
    """One sequence's life: queue (arrival -> scheduled), prefill (-> first token), decode (-> finished)."""

    request_id: str
    arrival: float
    prompt_tokens: int
    scheduled: float | None = None  # first scheduled (None: still queued, or running since before watching)
    first_token: float | None = None
    finished: float | None = None
    finish_reason: str | None = None
    output_tokens: int = 0
    cached_tokens: int = 0  # prefix-cache hit at first scheduling
    preemptions: int = 0
    preempted: float | None = None  # the last preemption (its blocks freed) ...
    resumed: float | None = None  # ... and when it was scheduled again, to be recomputed (None: still waiting)
    state: str = "waiting"  # waiting | preempted | prefill | decode | finished


@dataclass
class EngineSnapshot:
    time: float
    window_s: float  # since the previous snapshot (or since watching began)
    num_running: int
    num_waiting: int
    num_preempted: int  # of the waiting ones, those preempted (they wait to be recomputed)
    kv: KVPoolSnapshot | None
    num_steps: int  # steps in the window
    busy_s: float  # their summed durations
    prefill_tokens: int  # tokens computed in the window, by kind
    decode_tokens: int
    generated_tokens: int  # tokens sampled in the window
    steps: list[StepRecord] = field(default_factory=list)  # the window's last MAX_STEPS steps
    requests: list[RequestTimeline] = field(default_factory=list)  # live, then recently finished


def _wall(monotonic: float) -> float:
    return time.time() - (time.monotonic() - monotonic)


class EngineWatch:
    def __init__(self) -> None:
        self._steps: deque[StepRecord] = deque(maxlen=MAX_STEPS)
        self._live: dict[str, RequestTimeline] = {}
        self._finished: deque[RequestTimeline] = deque(maxlen=MAX_FINISHED)
        self._window_start = time.time()
        self._num_steps = self._prefill = self._decode = self._generated = 0
        self._busy = 0.0
        self._kv: KVPoolSnapshot | None = None
        self._kv_time = 0.0

    def _timeline(self, req: Request) -> RequestTimeline:
        tl = self._live.get(req.request_id)
        if tl is None:
            tl = self._live[req.request_id] = RequestTimeline(req.request_id, _wall(req.arrival_time),
                                                              req.num_prompt_tokens)
        return tl

    def on_step(self, scheduler_output: SchedulerOutput, requests: dict[str, Request], started: float,
                outputs: list[EngineCoreOutput]) -> None:
        """Record one step that began at wall time `started` and produced `outputs`."""
        now = time.time()
        prefill = decode = 0
        spec = scheduler_output.scheduled_spec_decode_tokens
        for rid in scheduler_output.preempted_req_ids:  # preempted by the schedule() that made this step
            tl = self._live.get(rid)
            if tl is not None:
                tl.preempted, tl.resumed = started, None
                tl.preemptions += 1
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            req = requests.get(rid)
            # A decode computes the one newest token (plus drafts to verify); anything else is a prompt (or a
            # preempted request's recomputation) being prefilled. A request this very step finished has left
            # the scheduler already: one token was its last decode.
            one = n - len(spec.get(rid, ())) == 1
            if one and (req is None or req.output_token_ids or req.num_output_placeholders):
                decode += n
            else:
                prefill += n
            if req is None:
                continue
            tl = self._timeline(req)
            if tl.scheduled is None:
                tl.scheduled = started
                tl.cached_tokens = max(0, req.num_cached_tokens)
            elif tl.preempted is not None and tl.resumed is None:
                tl.resumed = started
        for out in outputs:
            found = self._live.get(out.request_id)
            if found is None:
                continue
            tl = found
            if out.new_token_ids:
                tl.output_tokens += len(out.new_token_ids)
                self._generated += len(out.new_token_ids)
                if tl.first_token is None:
                    tl.first_token = now
            if out.finish_reason is not None:
                self._end(tl, out.finish_reason, now)
        if scheduler_output.is_empty:  # a pipelined engine applying its last step launches nothing new
            return
        self._steps.append(StepRecord(now, now - started, prefill, decode, len(scheduler_output.num_scheduled_tokens)))
        self._num_steps += 1
        self._busy += now - started
        self._prefill += prefill
        self._decode += decode

    def on_abort(self, request_ids: list[str]) -> None:
        now = time.time()
        for rid in request_ids:
            tl = self._live.get(rid)
            if tl is not None:
                self._end(tl, "abort", now)

    def _end(self, tl: RequestTimeline, reason: str, now: float) -> None:
        tl.finished, tl.finish_reason, tl.state = now, reason, "finished"
        del self._live[tl.request_id]
        self._finished.append(tl)

    def snapshot(self, scheduler: Any) -> EngineSnapshot:
        """The window since the last snapshot, then a new window begins."""
        now = time.time()
        running, waiting = list(scheduler.running), list(scheduler.waiting)
        live_ids = {r.request_id for r in running} | {r.request_id for r in waiting}
        for rid in [rid for rid in self._live if rid not in live_ids]:
            self._end(self._live[rid], "gone", now)  # ended by a path that produced no output here
        for req in running:
            tl = self._timeline(req)
            tl.state = "decode" if req.num_computed_tokens >= req.num_tokens - 1 and req.output_token_ids else "prefill"
            tl.preemptions = max(tl.preemptions, req.num_preemptions)  # also those from before watching
        num_preempted = 0
        for req in waiting:
            tl = self._timeline(req)
            preempted = req.status == RequestStatus.PREEMPTED
            num_preempted += preempted
            tl.state = "preempted" if preempted else "waiting"
            tl.preemptions = max(tl.preemptions, req.num_preemptions)
        kv: Any = getattr(scheduler, "kv", None)  # a scheduler plugin's KV manager may have no single pool
        pool = getattr(kv, "block_pool", None)
        if pool is not None and now - self._kv_time >= KV_PERIOD_S:
            self._kv, self._kv_time = snapshot_pool(pool, int(kv.block_size)), now
        live = sorted(self._live.values(), key=lambda t: t.arrival)[:MAX_LIVE]
        snap = EngineSnapshot(
            time=now, window_s=now - self._window_start, num_running=len(running), num_waiting=len(waiting),
            num_preempted=num_preempted,
            kv=self._kv,
            num_steps=self._num_steps, busy_s=self._busy, prefill_tokens=self._prefill, decode_tokens=self._decode,
            generated_tokens=self._generated, steps=list(self._steps),
            requests=[dataclasses.replace(t) for t in (*live, *self._finished)],
        )
        self._steps.clear()
        self._window_start = now
        self._num_steps = self._prefill = self._decode = self._generated = 0
        self._busy = 0.0
        return snap
