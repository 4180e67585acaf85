"""StructuredOutputManager: compiles grammars off the step loop, fills each step's bitmask, advances grammars.

Owned by the EngineCore (engine_core.py NOTE 2), which runs it around every step that has a grammar request:

    add_request ─▶ submit(request) ─▶ thread pool: backend.compile(params), cached by constraint key
                                       │ (the request waits aside; the batch does not)
    step: ready() ─▶ scheduler.add_request ─▶ schedule() ─▶ bitmask(so) ─▶ runner masks the logits
          advance(outputs): accepted tokens move each grammar on; a terminated one finishes its request

NOTE(1) one grammar per core request: with n > 1 every sample is its own core request (input_processing.
fan_out) and gets its own matcher from the one cached compilation. Preemption keeps the grammar: it already
accepted exactly the outputs the request keeps, and the recompute only rebuilds their KV.

NOTE(2) drafts (vLLM's scheme): after each step a request's new drafts are cut to the prefix its grammar
accepts (`validate_tokens`), so the scheduler never spends a slot on a draft the mask would reject. The
bitmask then has one row per draft position plus the bonus one: row j is filled after accepting drafts
0..j-1, and the grammar is rolled back afterwards, so verification samples every position under its own mask.

NOTE(3) pipelined steps (async scheduling, engine_core.py NOTE 2). Step N+1 is scheduled and its forward
launched before step N's tokens reach the host, so its masks cannot be filled at schedule time. `deferred()`
lays out N+1's rows and hands the runner a DeferredBitmask; the runner samples N+1 at its next call
(worker/pipelined_step.py NOTE 5), and then `resolve(previous)` fills N+1's rows from the grammars as N's
tokens left them, as vLLM's deferred sampling does. A grammar that N's token terminated gets an allow-all
row; the extra tokens it samples after its end are dropped (NOTE 5).

NOTE(4) the grammar work beside the engine's (ahead.py). Accept + fill cost ~5 ms a step at 256 requests on
the H200 host; in series with the engine's own host work (~6 ms: applying outputs, scheduling, laying out
inputs) that is more host time than a ~10 ms forward, and the GPU waits. So once the runner has sampled step N
it hands the step's ids to `_accept_ahead`: the worker thread waits for them, accepts them and fills the rows
of each grammar's next sample, while the engine thread applies N's output, schedules N+2 and lays out its
inputs; the runner joins it at its next call, before sampling N+1, whose `_resolve` only fills the rows the
worker could not know (a request whose prompt ended, one back from a pause). Until the join the worker alone
touches the step's grammars: the engine thread reads only the verdicts the worker recorded (`_pre_accepted`,
merged at the join), never those matchers. Only grammar classes that declare `gil_free_batches` (their batch
accept and fill release the GIL) go ahead: a per-token Python loop on a thread would queue for the GIL behind
the engine thread's Python every token. The others are accepted by `advance` on the engine thread, as in a
synchronous step, and filled by `_resolve`.

NOTE(5) verdicts one step late. The engine applies step N (`advance`) while the worker is still accepting N's
tokens, so `advance` learns whether N's token was accepted, and whether it ended the grammar, with step
N+1's output. A token the grammar rejected (a backend bug: the mask allows only what it accepts) or one that
ended it finishes the request then, and N+1's tokens, sampled after it, are dropped from the output. With
xgrammar a grammar ends only on a stop token, which already finishes the request in step N unless the
request ignores EOS, so the late verdict changes nothing for most requests.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pagedllm.engine.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.plugin_manager import PluginManager
from pagedllm.protocols.structured_output import StructuredOutputContext, StructuredOutputGrammar
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.ahead import AheadResult, AheadWorker
from pagedllm.structured_output.bitmask import DeferredBitmask, GrammarBitmask, bitmask_width
from pagedllm.structured_output.constraints import constraint_key
from pagedllm.structured_output.selection import KeyCache, select_backend, selection_key

logger = logging.getLogger("pagedllm")


class StructuredOutputManager:
    def __init__(
        self,
        pm: PluginManager,
        context: StructuredOutputContext,
        *,
        default_backend: str | None = None,
        compile_threads: int = 2,
        cache_size: int = 256,
        plugin_sections: Mapping[str, Any] | None = None,
    ) -> None:
        self.pm = pm
        self.context = context
        self.vocab_size = context.vocab_size
        self.default_backend = default_backend
        self.cache_size = cache_size
        self._sections = dict(plugin_sections or {})
        self._backends: dict[str, Any] = {}  # name -> built backend, made on first use
        self._chosen = KeyCache(cache_size)  # selection_key -> the backend chosen for it
        self._compiled: OrderedDict[tuple[Any, ...], Future[Any]] = OrderedDict()  # LRU by constraint key
        self._pool: ThreadPoolExecutor | None = None
        self._compile_threads = compile_threads
        self.grammars: dict[str, StructuredOutputGrammar] = {}  # request id -> its matcher (NOTE 1)
        # request id -> (its last tokens accepted, its grammar terminated after them): NOTE 3, NOTE 4
        self._pre_accepted: dict[str, tuple[bool, bool]] = {}
        self._worker = AheadWorker()  # NOTE 4
        self._gil_free: dict[type, bool] = {}  # grammar class -> whether it declares gil_free_batches (NOTE 4)
        self._ahead: AheadResult | None = None  # the last joined worker task, for the next step's _resolve
        self._in_worker: set[str] = set()  # NOTE 5: the requests whose last token the worker is accepting now
        # One CPU buffer for every step's masks: a fresh 4 MB tensor per step (256 rows of a 128k vocabulary)
        # costs its page faults each time. Pinned where CUDA is, so that the runner's copy to the device is
        # asynchronous: from pageable memory the copy waits for the stream, i.e. for the step's forward, and
        # the host work meant to overlap it would wait too. Reusing it is safe: a step's masks are filled only
        # after the step before has sampled (its ids are on the host), so the last copy from it is done.
        self._pin = torch.cuda.is_available()
        self._buffer = torch.empty((0, bitmask_width(self.vocab_size)), dtype=torch.int32)

    # -- compiling ---------------------------------------------------------------------------------------------

    def _backend(self, params: StructuredOutputsParams) -> tuple[str, Any]:
        key = selection_key(params)
        name = self._chosen.get(key) if key is not None else None  # selection.py's NOTE: checks cost ~1 ms
        if name is not None and name in self._backends:
            return name, self._backends[name]
        selection = select_backend(self.pm, params, self.default_backend)
        name = selection.winner.name
        if key is not None:
            self._chosen.put(key, name)
        backend = self._backends.get(name)
        if backend is None:
            cls = selection.load()
            section = self._sections.get(name, {})
            ctx = StructuredOutputContext(self.context.tokenizer, self.context.vocab_size,
                                          self.context.eos_token_ids, self.context.num_speculative_tokens, section)
            backend = self._backends[name] = cls(ctx)
        return name, backend

    def submit(self, request: Request) -> Future[StructuredOutputGrammar]:
        """Start compiling the request's grammar (or reuse a cached compilation); the future gives its matcher."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        result: Future[StructuredOutputGrammar] = Future()
        try:
            name, backend = self._backend(params)
        except Exception as exc:  # selection failed: the frontend validated, but a backend may have vanished
            result.set_exception(exc)
            return result
        key = (name, *constraint_key(params))
        compiled = self._compiled.get(key)
        if compiled is None or (compiled.done() and compiled.exception() is not None):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._compile_threads, thread_name_prefix="pagedllm-grammar")
            compiled = self._compiled[key] = self._pool.submit(backend.compile, params)
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)

        # NOTE: a future keeps its done callbacks for good (concurrent.futures never clears the list), and the
        # cached compilation lives as long as the cache: a callback holding `result` would keep the matcher of
        # every request that waited for this compile alive after the request finished (with xgrammar's
        # unbounded rollback history, every token it accepted). So the callback lets go of it once it ran.
        waiting = [result]

        def make(done: Future[Any]) -> None:
            target = waiting.pop()
            exc = done.exception()
            if exc is not None:
                target.set_exception(exc)
                return
            try:
                target.set_result(backend.make_grammar(done.result()))
            except Exception as make_exc:
                target.set_exception(make_exc)

        compiled.add_done_callback(make)
        return result

    # -- per step ----------------------------------------------------------------------------------------------

    def bitmask(self, so: SchedulerOutput, requests: Mapping[str, Request]) -> GrammarBitmask | None:
        """The masks of the step's grammar requests that sample (none for a prefill chunk that is not the
        last: the runner samples nothing there). Drafts get one row each plus the bonus row (NOTE 2)."""
        grammars = self.grammars
        if not grammars:
            return None
        spec = so.scheduled_spec_decode_tokens
        plan: list[tuple[str, StructuredOutputGrammar, list[int]]] = []
        num_rows = 0
        for rid in so.num_scheduled_tokens:
            grammar = grammars.get(rid)
            if grammar is None:
                continue
            req = requests.get(rid)
            # make_output moved num_computed_tokens past this step's tokens: it samples iff that reaches the
            # end of what is known.
            if req is None or req.num_computed_tokens < len(req.prompt_token_ids) + len(req.output_token_ids):
                continue
            drafts = spec.get(rid, []) if spec else []
            plan.append((rid, grammar, drafts))
            num_rows += len(drafts) + 1
        if not plan:
            return None
        bitmask = self._rows(num_rows)
        bitmask.fill_(-1)
        rows: dict[str, int] = {}
        row = 0
        for rid, grammar, drafts in plan:
            rows[rid] = row
            accepted = 0
            for j in range(len(drafts) + 1):
                if grammar.is_terminated():
                    break  # rows past a draft that ended the grammar keep "allow all": the stop truncates them
                grammar.fill_bitmask(bitmask, row + j)
                if j < len(drafts):
                    if not grammar.accept_tokens(rid, [drafts[j]]):
                        break  # validated drafts are accepted; this is only a safety net
                    accepted += 1
            if accepted:
                grammar.rollback(accepted)
            row += len(drafts) + 1
        return GrammarBitmask(rows, bitmask)

    def _rows(self, num_rows: int, keep: int = 0) -> torch.Tensor:
        """The first `num_rows` rows of the mask buffer, grown if need be (its first `keep` rows kept)."""
        if self._buffer.shape[0] < num_rows:
            # A normal tensor even when made under the runner's inference mode: the grammar worker's thread
            # (NOTE 4) is outside it, and may not write an inference tensor in place.
            with torch.inference_mode(False):
                grown = torch.empty((max(num_rows, 2 * self._buffer.shape[0]), self._buffer.shape[1]),
                                    dtype=torch.int32, pin_memory=self._pin)
                if keep:
                    grown[:keep] = self._buffer[:keep]
            self._buffer = grown
        return self._buffer[:num_rows]

    def deferred(self, so: SchedulerOutput, requests: Mapping[str, Request]) -> DeferredBitmask | None:
        """A pipelined step's masks, filled when the runner has the step before's tokens (NOTE 3). Every
        grammar request of the step gets a row but a prompt chunk before the last (it samples nothing):
        whether a decode samples is the runner's to know, and a row too many costs one fill."""
        grammars = self.grammars
        # Request ids, not their grammars: a step whose sampling waits (worker/pipelined_step.py NOTE 5) may
        # be kept by the runner after its requests finished, and must not keep their matchers alive.
        plan: list[str] = []
        for rid in so.num_scheduled_tokens:
            grammar = grammars.get(rid)
            if grammar is None:
                continue
            req = requests.get(rid)
            if req is None or req.num_computed_tokens < len(req.prompt_token_ids):
                continue
            plan.append(rid)
        if not plan:
            return None
        return DeferredBitmask(lambda previous: self._resolve(plan, previous),
                               lambda req_ids, sample_rows, fetch: self._accept_ahead(plan, req_ids, sample_rows,
                                                                                      fetch))

    def _resolve(self, plan: list[str], previous: ModelRunnerOutput | None) -> GrammarBitmask | None:
        ahead, self._ahead = self._ahead, None
        grammars = self.grammars
        if not any(rid in grammars for rid in plan):
            return None  # every request of the step has ended (NOTE 3): nothing to mask
        prefilled: dict[str, int] = {}
        if ahead is not None and previous is not None and previous.req_ids is ahead.req_ids:
            prefilled = ahead.rows  # the worker accepted these and filled their rows (NOTE 4)
        rows: dict[str, int] = {}
        missing: list[tuple[str, StructuredOutputGrammar | None]] = []
        for rid in plan:
            row = prefilled.get(rid)
            if row is None:
                missing.append((rid, grammars.get(rid)))
            else:
                rows[rid] = row
        base = len(prefilled)
        bitmask = self._rows(base + len(missing), keep=base)
        live: list[tuple[StructuredOutputGrammar, int]] = []
        for row, (rid, grammar) in enumerate(missing, base):
            rows[rid] = row
            status = self._pre_accepted.get(rid)
            if grammar is None or grammar.is_terminated() or (status is not None and not status[0]):
                bitmask[row].fill_(-1)  # its request ended, or ends with the step before (NOTE 3)
            else:
                live.append((grammar, row))
        fill_rows(live, bitmask)
        return GrammarBitmask(rows, bitmask)

    def _accept_ahead(self, plan: list[str], req_ids: list[str],
                      sample_rows: list[int], fetch: Callable[[], list[int]]) -> Callable[[], None] | None:
        """Start accepting a just-sampled step's ids on the worker (NOTE 4); returns the runner's join."""
        planned, grammars = set(plan), self.grammars
        gil_free = self._gil_free
        picks = []
        for j, i in enumerate(sample_rows):
            rid = req_ids[i]
            grammar = grammars.get(rid) if rid in planned else None
            if grammar is None:
                continue
            cls = type(grammar)
            ok = gil_free.get(cls)
            if ok is None:
                ok = gil_free[cls] = bool(getattr(cls, "gil_free_batches", False))
            if ok:
                picks.append((j, rid, grammar))  # the others are accepted by `advance` (NOTE 4)
        if not picks:
            return None
        join = self._worker.start(lambda: self._accept_and_fill(req_ids, picks, fetch))
        self._in_worker = {rid for _, rid, _ in picks}

        def merge() -> None:
            try:
                result = join()
            finally:
                self._in_worker = set()
            grammars = self.grammars  # a request removed meanwhile keeps no entry
            self._pre_accepted.update((rid, s) for rid, s in result.status.items() if rid in grammars)
            self._ahead = result

        return merge

    def _accept_and_fill(self, req_ids: list[str], picks: list[tuple[int, str, StructuredOutputGrammar]],
                         fetch: Callable[[], list[int]]) -> AheadResult:
        """The worker's task (NOTE 4): accept each grammar's sampled id, then fill its next row."""
        tokens = fetch()
        todo = [(rid, grammar, [tokens[j]]) for j, rid, grammar in picks]
        bitmask = self._rows(len(todo))
        status: dict[str, tuple[bool, bool]] = {}
        rows: dict[str, int] = {}
        live: list[tuple[StructuredOutputGrammar, int]] = []
        for row, ((rid, grammar, _), ok) in enumerate(zip(todo, accept_rows(todo))):
            ended = grammar.is_terminated()
            status[rid] = (ok, ended)
            rows[rid] = row
            if ok and not ended:
                live.append((grammar, row))
            else:
                bitmask[row].fill_(-1)  # its request ends with this step (NOTE 3)
        fill_rows(live, bitmask)
        return AheadResult(req_ids, status, rows)

    def advance(self, outputs: list[EngineCoreOutput], requests: Mapping[str, Request]) -> dict[str, RequestStatus]:
        """Feed each grammar request its accepted tokens. Returns the requests the engine must finish, with
        their status: a terminated grammar the step did not already finish (`stop`; the output says so), a
        rejected token (`error`). Also cuts new drafts (NOTE 2) and forgets finished requests."""
        grammars = self.grammars
        to_finish: dict[str, RequestStatus] = {}
        for out in outputs:
            rid = out.request_id
            grammar = grammars.get(rid)
            if grammar is None:
                continue
            late = self._pre_accepted.pop(rid, None)  # NOTE 5: the worker's verdict on the token before
            if late is not None and (not late[0] or late[1]):
                # That token was rejected, or ended the grammar: this step's tokens follow it and are dropped.
                was_finished = out.finished
                out.new_token_ids, out.new_logprobs = [], []
                grammars.pop(rid, None)
                if not late[0]:
                    _log_rejected(rid)
                    out.finish_reason, out.stop_reason, out.error = "error", None, _REJECTED
                    status = RequestStatus.FINISHED_ERROR
                else:
                    out.finish_reason, out.stop_reason, status = "stop", None, RequestStatus.FINISHED_STOPPED
                if not was_finished:
                    to_finish[rid] = status
                continue
            if rid in self._in_worker:  # the worker is accepting this step's token right now (NOTE 5)
                if out.finished:
                    grammars.pop(rid, None)
                continue
            accepted = grammar.accept_tokens(rid, out.new_token_ids) if out.new_token_ids else None
            if accepted is False:
                _log_rejected(rid)
                if not out.finished:
                    to_finish[rid] = RequestStatus.FINISHED_ERROR
                    out.finish_reason, out.error = "error", _REJECTED
            if out.finished:
                grammars.pop(rid, None)
                continue
            if grammar.is_terminated():
                out.finish_reason = "stop"
                to_finish[rid] = RequestStatus.FINISHED_STOPPED
                grammars.pop(rid, None)
                continue
            req = requests.get(out.request_id)
            if req is not None and req.spec_token_ids:
                req.spec_token_ids = grammar.validate_tokens(req.spec_token_ids)
        return to_finish

    def remove(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.grammars.pop(rid, None)
            self._pre_accepted.pop(rid, None)

    def shutdown(self) -> None:
        self._worker.shutdown()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None



_REJECTED = "structured output: the grammar rejected a sampled token"


def _log_rejected(request_id: str) -> None:
    # The mask allowed only what the grammar accepts: this is a backend bug, reported as such.
    logger.error("structured output: request %s produced a token its grammar rejects", request_id)


def accept_rows(todo: list[tuple[str, StructuredOutputGrammar, list[int]]]) -> list[bool]:
    """accept_tokens for each (request id, grammar, tokens), in order. A grammar class may offer a batch
    form, `accept_many(grammars, tokens)` (a staticmethod)."""
    if not todo:
        return []
    cls = type(todo[0][1])
    batch = getattr(cls, "accept_many", None)
    if batch is not None and len(todo) > 1 and all(type(g) is cls for _, g, _ in todo):
        return list(batch([g for _, g, _ in todo], [t for _, _, t in todo]))
    return [grammar.accept_tokens(rid, tokens) for rid, grammar, tokens in todo]


def fill_rows(live: list[tuple[StructuredOutputGrammar, int]], bitmask: torch.Tensor) -> None:
    """Fill row `row` of `bitmask` for each (grammar, row). A grammar class may offer a batch fill,
    `fill_bitmasks(grammars, bitmask, rows)` (a staticmethod; xgrammar's runs on its own threads, as vLLM
    fills large batches in parallel); grammars of one class go through it together."""
    by_class: dict[type, list[tuple[StructuredOutputGrammar, int]]] = {}
    for grammar, row in live:
        by_class.setdefault(type(grammar), []).append((grammar, row))
    for cls, items in by_class.items():
        batch = getattr(cls, "fill_bitmasks", None)
        if batch is not None and len(items) > 1:
            batch([g for g, _ in items], bitmask, [r for _, r in items])
        else:
            for grammar, row in items:
                grammar.fill_bitmask(bitmask, row)
