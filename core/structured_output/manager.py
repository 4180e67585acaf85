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
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedllm.engine.messages import EngineCoreOutput, SchedulerOutput
from pagedllm.plugin_manager import PluginManager
from pagedllm.protocols.structured_output import StructuredOutputContext, StructuredOutputGrammar
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.bitmask import GrammarBitmask, allocate_bitmask
from pagedllm.structured_output.constraints import constraint_key
from pagedllm.structured_output.selection import select_backend

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
        self._compiled: OrderedDict[tuple[Any, ...], Future[Any]] = OrderedDict()  # LRU by constraint key
        self._pool: ThreadPoolExecutor | None = None
        self._compile_threads = compile_threads
        self.grammars: dict[str, StructuredOutputGrammar] = {}  # request id -> its matcher (NOTE 1)

    # -- compiling ---------------------------------------------------------------------------------------------

    def _backend(self, params: StructuredOutputsParams) -> tuple[str, Any]:
        selection = select_backend(self.pm, params, self.default_backend)
        name = selection.winner.name
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

        def make(done: Future[Any]) -> None:
            exc = done.exception()
            if exc is not None:
                result.set_exception(exc)
                return
            try:
                result.set_result(backend.make_grammar(done.result()))
            except Exception as make_exc:
                result.set_exception(make_exc)

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
        bitmask = allocate_bitmask(num_rows, self.vocab_size)
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

    def advance(self, outputs: list[EngineCoreOutput], requests: Mapping[str, Request]) -> dict[str, RequestStatus]:
        """Feed each grammar request its accepted tokens. Returns the requests the engine must finish, with
        their status: a terminated grammar the step did not already finish (`stop`; the output says so), a
        rejected token (`error`). Also cuts new drafts (NOTE 2) and forgets finished requests."""
        grammars = self.grammars
        to_finish: dict[str, RequestStatus] = {}
        for out in outputs:
            grammar = grammars.get(out.request_id)
            if grammar is None:
                continue
            if out.new_token_ids and not grammar.accept_tokens(out.request_id, out.new_token_ids):
                # The mask allowed only what the grammar accepts: this is a backend bug, reported as such.
                logger.error("structured output: request %s produced tokens %s its grammar rejects",
                             out.request_id, out.new_token_ids)
                if not out.finished:
                    to_finish[out.request_id] = RequestStatus.FINISHED_ERROR
                    out.finish_reason, out.error = "error", "structured output: the grammar rejected a sampled token"
            if out.finished:
                grammars.pop(out.request_id, None)
                continue
            if grammar.is_terminated():
                out.finish_reason = "stop"
                to_finish[out.request_id] = RequestStatus.FINISHED_STOPPED
                grammars.pop(out.request_id, None)
                continue
            req = requests.get(out.request_id)
            if req is not None and req.spec_token_ids:
                req.spec_token_ids = grammar.validate_tokens(req.spec_token_ids)
        return to_finish

    def remove(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.grammars.pop(rid, None)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

