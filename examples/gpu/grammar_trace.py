"""--trace for bench_structured.py (pagedllm only): where a run's grammar time goes, and what it leaves behind.

Per run: milliseconds per step of the worker's task (accept + next fill) and of its parts (the wait for the
step's sampled ids, xgrammar's batch accept, its batch fill), of the runner's wait at its join (the part of it
on the step's critical path), of the engine thread's own grammar work (deferred plan, resolve, apply,
advance) and of the engine's whole step; then what the engine holds once the run's requests are done (grammars,
pre-accepted tokens, requests awaiting a grammar, matchers alive, the cached compilations' callbacks), the
process RSS and the GC collections during the run. A workload that slows down repeat after repeat shows here
as a growing number: a state size that grows is what accumulates; a time per step that grows says where.

`step_parts`: medians over the run's steady steps of the time between consecutive marks -- on the GPU between
CUDA events at the entry and exit of the sampling and of the decode CUDA graph (a gap from one region's exit to
the next one's entry that the host did not fill is idle time), on the host between the engine thread's marks
(the ids wait, the grammar join, the sampling, the graph) and between the worker's (task start, ids fetched,
accepted, filled). A masked step is sampled at the runner's next call, after the join (pipelined_step.py NOTE 5).
"""

from __future__ import annotations

import gc
import time
import weakref
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any


class GrammarTrace:
    def __init__(self, llm: Any) -> None:
        from pagedllm.engine.engine_core import EngineCore
        from pagedllm.plugins.structured_output.xgrammar.backend import XgrammarBackend
        from pagedllm.structured_output.ahead import AheadWorker
        from pagedllm.structured_output.bitmask import GrammarBitmask
        from pagedllm.structured_output.manager import StructuredOutputManager

        self.core = llm.engine.core
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.collections: Counter[int] = Counter()
        self.matchers: list[weakref.ref[Any]] = []
        self.steps: list[tuple[float, float]] = []  # each engine step's (start, end), perf_counter seconds
        self.run_start = 0.0
        for name in ("_accept_and_fill", "deferred", "_resolve", "advance"):
            self._time(StructuredOutputManager, name, name.strip("_"))
        self._time(GrammarBitmask, "apply", "apply")
        # Inside the worker's task: the wait for the step's ids, the batch accept, the batch fill.
        from pagedllm.plugins.structured_output.xgrammar.backend import XgrammarGrammar
        from pagedllm.worker import pipelined_step
        for name in ("accept_many", "fill_bitmasks"):
            self._time(XgrammarGrammar, name, name, static=True)
        ids_fetch = pipelined_step._ids_fetch
        pipelined_step._ids_fetch = lambda *a: self._timed(ids_fetch(*a), "ids wait")  # type: ignore[assignment]
        # The worker's phases as marks too (`_step_parts`): its task's start, the ids there, accepted, filled.
        for cls, name, label, static in ((XgrammarGrammar, "accept_many", "accepted", True),
                                         (XgrammarGrammar, "fill_bitmasks", "filled", True),
                                         (StructuredOutputManager, "_accept_and_fill", "task", False)):
            self._mark_after(cls, name, label, static, before=label == "task")
        fetch_timed = pipelined_step._ids_fetch

        def marked_fetch(*a: Any) -> Callable[[], Any]:
            fetch = fetch_timed(*a)

            def run() -> Any:
                out = fetch()
                self._mark("fetched", False)
                return out

            return run

        pipelined_step._ids_fetch = marked_fetch  # type: ignore[assignment]
        step = EngineCore.step

        def marked_step(core: Any, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return step(core, *args, **kwargs)
            finally:
                end = time.perf_counter()
                self.steps.append((t, end))
                self._add("engine step", end - t)

        EngineCore.step = marked_step  # type: ignore[method-assign]
        # (label, perf_counter, CUDA event or None), in order: `_step_parts`
        self.marks: list[tuple[str, float, Any]] = []
        self._mark_regions()
        start, make = AheadWorker.start, XgrammarBackend.make_grammar

        def timed_start(worker: Any, task: Callable[[], Any]) -> Callable[[], Any]:
            join = self._timed(start(worker, task), "join wait")

            def marked_join() -> Any:
                self._mark("join", False)
                out = join()
                self._mark("join end", False)
                return out

            return marked_join

        def recorded_make(backend: Any, compiled: Any) -> Any:
            grammar = make(backend, compiled)
            self.matchers.append(weakref.ref(grammar))
            return grammar

        AheadWorker.start = timed_start  # type: ignore[method-assign]
        XgrammarBackend.make_grammar = recorded_make  # type: ignore[method-assign]
        gc.callbacks.append(lambda phase, info: self.collections.update([info["generation"]]) if phase == "start" else None)

    def _mark_after(self, cls: type, name: str, label: str, static: bool, before: bool = False) -> None:
        fn = getattr(cls, name)

        def marked(*args: Any, **kwargs: Any) -> Any:
            if before:
                self._mark(label, False)
            out = fn(*args, **kwargs)
            if not before:
                self._mark(label, False)
            return out

        setattr(cls, name, staticmethod(marked) if static else marked)

    def _mark_regions(self) -> None:
        """Marks at the runner's queueing regions and the worker's phases (see `_step_parts`)."""
        import torch

        from pagedllm.worker.cuda_graphs import DecodeGraphs
        from pagedllm.worker.model_runner import ModelRunner

        cuda = torch.cuda.is_available()

        def mark(label: str, gpu: bool = True) -> None:
            event = None
            if gpu and cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
            self.marks.append((label, time.perf_counter(), event))

        def wrap(cls: type, name: str, label: str, gpu: bool = True) -> None:
            fn = cls.__dict__.get(name) or getattr(cls, name)

            def marked(obj: Any, *args: Any, **kwargs: Any) -> Any:
                mark(label, gpu)
                out = fn(obj, *args, **kwargs)
                mark(f"{label} end", gpu)
                return out

            setattr(cls, name, marked)

        wrap(ModelRunner, "_sample", "sample")  # a step's mask and sampling
        wrap(DecodeGraphs, "run", "graph")  # a decode step's forward (its CUDA graph)
        wrap(ModelRunner, "_resolve_pending", "ids", gpu=False)  # the wait for the step in flight's ids
        self._mark = mark

    def _step_parts(self) -> dict[str, Any]:
        """Medians (ms) over the run's steady steps of the time between consecutive marks: on the GPU
        between consecutive CUDA events (the stream's order), on the host between consecutive marks of one
        thread. A GPU gap between one region's end and the next region's start that the host did not fill
        is idle time; the worker's marks beside the engine thread's `join` say which waited for which."""
        import statistics

        import torch

        marks = self.marks
        if len(marks) < 40:
            return {}
        gpu: defaultdict[str, list[float]] = defaultdict(list)
        events = [(label, e) for label, _, e in marks if e is not None]
        if events:
            torch.cuda.synchronize()
            for (a, ea), (b, eb) in zip(events, events[1:]):
                gpu[f"{a} -> {b}"].append(ea.elapsed_time(eb))
        host: defaultdict[str, list[float]] = defaultdict(list)
        worker = {"fetched", "accepted", "filled", "task"}
        for group in (worker, None):
            seq = [(label, t) for label, t, _ in marks if (label in worker) == (group is not None)]
            for (a, ta), (b, tb) in zip(seq, seq[1:]):
                host[f"{a} -> {b}"].append(1e3 * (tb - ta))
        # The worker's finish against the engine thread's arrival at the join that waits for it.
        slack = []
        filled = [t for label, t, _ in marks if label == "filled"]
        joins = [t for label, t, _ in marks if label == "join"]
        for t_fill, t_join in zip(filled, joins):
            slack.append(1e3 * (t_join - t_fill))

        def medians(d: dict[str, list[float]]) -> dict[str, Any]:
            return {k: [round(statistics.median(v[10:-10] or v), 3), len(v)] for k, v in d.items() if len(v) > 20}

        return {"gpu_ms": medians(gpu), "host_ms": medians(host),
                "join_minus_filled_ms": round(statistics.median(slack[10:-10] or slack), 3) if slack else None}

    def _add(self, key: str, seconds: float) -> None:
        self.seconds[key] += seconds
        self.calls[key] += 1

    def _timed(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        """`fn`, each call's time added under `key`."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(key, time.perf_counter() - t)

        return timed

    def _time(self, cls: type, name: str, key: str, static: bool = False) -> None:
        timed = self._timed(getattr(cls, name), key)
        setattr(cls, name, staticmethod(timed) if static else timed)

    def start_run(self) -> None:
        self.steps.clear()
        self.marks.clear()
        self.run_start = time.perf_counter()
        self.seconds.clear()
        self.calls.clear()
        self.collections.clear()

    def report(self) -> dict[str, Any]:
        """The run's figures (call right after it ended: its end is taken as now)."""
        end = time.perf_counter()
        core, manager = self.core, self.core._structured
        collections = {f"gen{g}": n for g, n in sorted(self.collections.items())}  # before ours, below
        gc.collect()
        with open("/proc/self/statm") as f:
            rss_mb = int(f.read().split()[1]) * 4096 // 2**20
        out: dict[str, Any] = {
            "ms_per_call": {k: round(1e3 * s / self.calls[k], 3) for k, s in self.seconds.items()},
            "calls": dict(self.calls),
            "timeline_ms": self._timeline(end),
            "step_parts": self._step_parts(),
            "gc_collections": collections,
            "rss_mb": rss_mb,
            "matchers_made": len(self.matchers),
            "matchers_alive": sum(ref() is not None for ref in self.matchers),
        }
        if manager is not None:
            out.update(grammars=len(manager.grammars), pre_accepted=len(manager._pre_accepted),
                       awaiting=len(core._awaiting_grammar),
                       compile_callbacks=sum(len(f._done_callbacks) for f in manager._compiled.values()))
        return out

    def _timeline(self, end: float) -> dict[str, float]:
        """Where the run's wall time went around the engine steps: before the first, between them, after the
        last (the frontend's adds and output processing, waits for grammars), against the steps' own."""
        if not self.steps:
            return {}
        gaps = sum(b[0] - a[1] for a, b in zip(self.steps, self.steps[1:]))
        inside = sum(b - a for a, b in self.steps)
        return {k: round(1e3 * v, 1) for k, v in (("wall", end - self.run_start), ("in_steps", inside),
                                                   ("before_first", self.steps[0][0] - self.run_start),
                                                   ("between", gaps), ("after_last", end - self.steps[-1][1]))}
