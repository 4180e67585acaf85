"""check_scheduler: a scheduler policy in a simulated engine loop, then in a real small engine.

1. Simulation (no model). The scheduler is built as the engine builds it (`SchedulerContext` over a real
   `KVCacheManager` with the registered `full_attention` manager) and driven step by step: schedule(), a fake
   model run, update_from_output(). The fake model's next token is a fixed function of the sequence so far,
   so every request's outputs are known in advance whatever the batching. Per step:
   - the step's tokens are within `max_num_batched_tokens` and its requests within `max_num_seqs`;
   - each request is scheduled >= 1 token and never past its known tokens; the total is the sum;
   - the KV pool's books hold (kv_invariants.py): running requests hold exactly the blocks ref-counted for
     them, covering their computed tokens; waiting and preempted ones hold none.
   Two workloads: continuous batching with arrivals over time, shared prefixes and an abort
   (finish_requests); and a pool too small for the requests' growth (admission headroom 0), which must
   preempt -- a preempted request gives its blocks back and still finishes. In both, every request not
   aborted must finish with exactly the expected tokens, in bounded steps (no step may stall with work
   left), and the pool must be empty afterwards.
2. Engine. A tiny random Llama generates greedily with this scheduler and with the reference (fcfs) through
   LLMEngine; the tokens must be identical, and every step the engine reports stays within its limits.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.config import SchedulerConfig
from pagedllm.engine.messages import ModelRunnerOutput, SchedulerOutput
from pagedllm.kv_cache.kv_cache_manager import KVCacheConfig, KVCacheGroup, KVCacheManager
from pagedllm.kv_cache.spec import FullAttentionSpec
from pagedllm.plugin_spec import PluginKind
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.base import SchedulerContext
from pagedllm.testing.components import find_spec, manager_or_default
from pagedllm.testing.engine_run import run_greedy
from pagedllm.testing.kv_invariants import KVBooks

if TYPE_CHECKING:
    from pagedllm.plugin_manager import PluginManager

BLOCK_SIZE = 4
VOCAB = 97


@dataclass(frozen=True)
class Workload:
    """Requests for the simulation: prompts, max_tokens, the step each arrives at; and the engine's limits."""

    name: str
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]
    arrivals: tuple[int, ...]
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    admission_headroom_tokens: int = 256
    must_preempt: bool = False
    aborts: tuple[tuple[int, int], ...] = ()  # (request index, step): finish_requests(ABORTED) before that step


def _prompt(start: int, n: int) -> tuple[int, ...]:
    return tuple(3 + (start + 5 * i) % (VOCAB - 3) for i in range(n))


_SHARED = _prompt(0, 8)
WORKLOADS = (
    # Continuous batching: prompts longer than the budget (chunked), arrivals while others decode, two
    # prompts sharing their first two blocks with the first (prefix hits), an abort mid-prefill.
    Workload(
        "continuous batching",
        prompts=(_SHARED + _prompt(40, 5), _prompt(7, 20), _SHARED + _prompt(60, 1), _prompt(11, 3),
                 _prompt(13, 9), _SHARED + _prompt(80, 9)),
        max_tokens=(6, 4, 5, 8, 3, 6),
        arrivals=(0, 0, 0, 2, 4, 6),
        num_blocks=64,
        max_num_seqs=3,
        max_num_batched_tokens=16,
        aborts=((1, 2),),
    ),
    # A pool of 6 usable blocks (24 slots) for three requests growing to 17-19 tokens (5 blocks each): the
    # running ones cannot all grow, so some must be preempted and recomputed. Each alone fits.
    Workload(
        "preemption under a tiny KV pool",
        prompts=(_prompt(1, 6), _prompt(2, 7), _prompt(3, 5)),
        max_tokens=(12, 12, 12),
        arrivals=(0, 0, 0),
        num_blocks=7,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        admission_headroom_tokens=0,
        must_preempt=True,
    ),
)

ENGINE_PROMPTS = (_prompt(5, 5), _prompt(17, 13), _prompt(29, 9), _prompt(41, 3), _SHARED + _prompt(3, 6))


@dataclass
class SchedulerReport:
    """Per workload: steps taken and preemptions seen; whether the engine comparison ran."""

    scheduler: str
    steps: dict[str, int] = field(default_factory=dict)
    preemptions: dict[str, int] = field(default_factory=dict)
    engine_compared_with: str | None = None
    engine_steps: int = 0
    engine_preemptions: int = 0


def fake_next_token(tokens: Sequence[int]) -> int:
    """The simulation's model: the next token is a fixed function of the whole sequence."""
    return 3 + (7 * sum(tokens) + 3 * len(tokens) + tokens[-1]) % (VOCAB - 3)


def expected_outputs(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """What the fake model generates for `prompt`, whatever the batching."""
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(fake_next_token(tokens))
        tokens.append(out[-1])
    return out


def check_scheduler(
    name: str,
    *,
    plugin_config: Mapping[str, Any] | None = None,
    workloads: Sequence[Workload] = WORKLOADS,
    require_preemption: bool = True,
    engine_run: bool = True,
    reference: str = "fcfs",
    model_dir: str | None = None,
    plugin_manager: PluginManager | None = None,
) -> SchedulerReport:
    """Check the scheduler registered as `name` (see the module docstring); AssertionError on a violation.

    `plugin_config` is its `plugins.<name>` section. `require_preemption=False` accepts a policy that avoids
    preemption by design (the tiny-pool workload must then still finish). `model_dir`: the checkpoint for
    the engine comparison (default: a tiny random Llama made in a temporary folder); the comparison is
    skipped when `engine_run` is false or `name` is the reference itself.
    """
    pm = manager_or_default(plugin_manager)
    cls = find_spec(PluginKind.SCHEDULER, name, pm).resolve()
    manager_cls = find_spec(PluginKind.KV_MANAGER, "full_attention", pm).resolve()
    report = SchedulerReport(name)
    for workload in workloads:
        steps, preemptions = _Simulation(cls, manager_cls, name, workload, dict(plugin_config or {})).run()
        report.steps[workload.name] = steps
        report.preemptions[workload.name] = preemptions
        if workload.must_preempt and require_preemption and not preemptions:
            raise AssertionError(
                f"scheduler {name!r}, workload {workload.name!r}: the running requests outgrow the pool but none "
                "was preempted (pass require_preemption=False if the policy avoids preemption by design)"
            )
    if engine_run and name != reference:
        _compare_engines(name, reference, model_dir, dict(plugin_config or {}), pm, report)
    return report


class _Simulation:
    def __init__(self, cls: Any, manager_cls: Any, name: str, workload: Workload, plugin_config: dict[str, Any]) -> None:
        self.workload = workload
        self.label = f"scheduler {name!r}, workload {workload.name!r}"
        spec = FullAttentionSpec(BLOCK_SIZE, 1, 8, torch.float32)
        self.max_model_len = 256
        self.kv = KVCacheManager(
            KVCacheConfig(workload.num_blocks, [KVCacheGroup(spec, [0])]), [manager_cls],
            enable_caching=True, max_model_len=self.max_model_len,
        )
        self.books = KVBooks(self.kv, self.label)
        self.config = SchedulerConfig(
            name=name,
            max_num_seqs=workload.max_num_seqs,
            max_num_batched_tokens=workload.max_num_batched_tokens,
            admission_headroom_tokens=workload.admission_headroom_tokens,
        )
        ctx = SchedulerContext(self.config, self.kv, self.max_model_len, BLOCK_SIZE, plugin_config)
        self.scheduler = cls(ctx)
        self.requests = [
            Request(f"r{i}", list(p), SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
            for i, (p, m) in enumerate(zip(workload.prompts, workload.max_tokens, strict=True))
        ]

    def run(self) -> tuple[int, int]:
        """Drive the scheduler until every request finished; returns (steps, preemptions seen)."""
        sched, w = self.scheduler, self.workload
        by_id = {r.request_id: r for r in self.requests}
        limit = 10 * sum(len(p) + m for p, m in zip(w.prompts, w.max_tokens, strict=True)) + max(w.arrivals)
        preempted: set[str] = set()
        idle_steps = 0
        step = 0
        while True:
            for req, arrival in zip(self.requests, w.arrivals, strict=True):
                if arrival == step:
                    sched.add_request(req)
            aborted = [self.requests[i].request_id for i, at in w.aborts if at == step]
            if aborted:
                sched.finish_requests(aborted, RequestStatus.FINISHED_ABORTED)
                self._check_books(f"step {step}, after aborting {aborted}")
            pending = any(a > step for a in w.arrivals)
            if not sched.has_unfinished_requests():
                if not pending:
                    break
                step += 1
                continue
            if step > limit:
                states = {r.request_id: r.status.name for r in self.requests}
                raise AssertionError(f"{self.label}: requests unfinished after {step} steps: {states}")
            out = sched.schedule()
            where = f"step {step}"
            self._check_step(out, by_id, where)
            preempted |= set(out.preempted_req_ids) | {r.request_id for r in self.requests if r.num_preemptions}
            idle_steps = idle_steps + 1 if out.total_num_scheduled_tokens == 0 else 0
            if idle_steps >= 3 and not pending:
                raise AssertionError(
                    f"{self.label}: {where}: three steps in a row scheduled nothing while "
                    f"{sched.get_num_unfinished_requests()} requests are unfinished (no progress)"
                )
            sched.update_from_output(out, self._fake_model(out, by_id))
            self._check_books(f"{where}, after update_from_output")
            step += 1
        self._check_finished()
        return step, len(preempted)

    def _check_step(self, out: SchedulerOutput, by_id: dict[str, Request], where: str) -> None:
        label, cfg = f"{self.label}: {where}", self.config
        scheduled = out.num_scheduled_tokens
        total = sum(scheduled.values())
        if out.total_num_scheduled_tokens != total:
            raise AssertionError(f"{label}: total_num_scheduled_tokens {out.total_num_scheduled_tokens} is not "
                                 f"the sum of num_scheduled_tokens ({total})")
        if total > cfg.max_num_batched_tokens:
            raise AssertionError(f"{label}: scheduled {total} tokens, over max_num_batched_tokens "
                                 f"{cfg.max_num_batched_tokens} ({scheduled})")
        if len(scheduled) > cfg.max_num_seqs:
            raise AssertionError(f"{label}: scheduled {len(scheduled)} requests, over max_num_seqs {cfg.max_num_seqs}")
        sent = {r.req_id for r in out.scheduled_new_reqs} | {r.req_id for r in out.scheduled_cached_reqs}
        if sent != set(scheduled):
            raise AssertionError(f"{label}: requests sent to the runner {sorted(sent)} are not the scheduled "
                                 f"ones {sorted(scheduled)}")
        for rid, n in scheduled.items():
            req = by_id.get(rid)
            if req is None or req.is_finished():
                raise AssertionError(f"{label}: scheduled {rid!r}, which is not an unfinished request")
            if n < 1:
                raise AssertionError(f"{label}: scheduled {n} tokens for {rid!r} (each scheduled request needs >= 1)")
            if req.status != RequestStatus.RUNNING:
                raise AssertionError(f"{label}: scheduled {rid!r} while it is {req.status.name}")
            # make_output moved num_computed_tokens forward by what it scheduled (or from 0 plus a prefix hit).
            if req.num_computed_tokens > req.num_tokens:
                raise AssertionError(f"{label}: {rid!r} was scheduled up to token {req.num_computed_tokens} but "
                                     f"only {req.num_tokens} are known")
        self._check_books(label.removeprefix(f"{self.label}: "))

    def _check_books(self, where: str) -> None:
        live = [r for r in self.requests if r.status == RequestStatus.RUNNING]
        idle = [r for r in self.requests if r.status != RequestStatus.RUNNING]
        for req in idle:
            self.books.released(req.request_id)
        self.books.check(live, idle, where)

    def _fake_model(self, out: SchedulerOutput, by_id: dict[str, Request]) -> ModelRunnerOutput:
        """One sampled token per request whose scheduled tokens reach its end; none for a prefill chunk."""
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = by_id[rid]
            sampled.append([fake_next_token(req.all_token_ids)] if req.num_computed_tokens >= req.num_tokens else [])
        return ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids))

    def _check_finished(self) -> None:
        aborted = {i for i, _ in self.workload.aborts}
        for i, (req, prompt, m) in enumerate(
            zip(self.requests, self.workload.prompts, self.workload.max_tokens, strict=True)
        ):
            if i in aborted:
                if req.status != RequestStatus.FINISHED_ABORTED:
                    raise AssertionError(f"{self.label}: request {req.request_id!r} was aborted but ended "
                                         f"{req.status.name}")
                continue
            if req.status != RequestStatus.FINISHED_LENGTH_CAPPED:
                raise AssertionError(f"{self.label}: request {req.request_id!r} ended {req.status.name}, "
                                     f"expected FINISHED_LENGTH_CAPPED after {m} tokens")
            expected = expected_outputs(prompt, m)
            if req.output_token_ids != expected:
                raise AssertionError(f"{self.label}: request {req.request_id!r} produced {req.output_token_ids}, "
                                     f"expected {expected} (tokens were lost, repeated or computed out of order)")
        self.books.check([], self.requests, "after every request finished")
        self.books.check_all_free("after every request finished")


# The engine comparison: 12 blocks of 4 (11 usable: 44 slots) for five requests growing to 11-22 tokens,
# admitted without headroom: batches, chunked prefills, a prefix hit, and preemption in the real engine too.
ENGINE_LIMITS: dict[str, Any] = {"max_num_batched_tokens": 16, "max_num_seqs": 3, "admission_headroom_tokens": 0}
ENGINE_KV_BLOCKS = 12


def _compare_engines(
    name: str, reference: str, model_dir: str | None, plugin_config: dict[str, Any], pm: PluginManager,
    report: SchedulerReport,
) -> None:
    """Greedy tokens through LLMEngine with `name` and with `reference` must be identical."""

    def config(scheduler: str) -> dict[str, Any]:
        out: dict[str, Any] = {"kv_cache": {"num_blocks": ENGINE_KV_BLOCKS},
                               "scheduler": {**ENGINE_LIMITS, "name": scheduler}}
        if scheduler == name and plugin_config:
            out["plugins"] = {name: plugin_config}
        return out

    with tempfile.TemporaryDirectory(prefix="pagedllm-testing-") as tmp:
        if model_dir is None:
            from pagedllm.testing.tiny import save_tiny_model

            model_dir = save_tiny_model("llama", tmp)
        expected = run_greedy(model_dir, ENGINE_PROMPTS, 8, config=config(reference), plugin_manager=pm).tokens
        run = run_greedy(model_dir, ENGINE_PROMPTS, 8, config=config(name), plugin_manager=pm)
    budget, max_seqs = ENGINE_LIMITS["max_num_batched_tokens"], ENGINE_LIMITS["max_num_seqs"]
    for i, (num_tokens, num_requests) in enumerate(run.steps):
        if num_tokens > budget or num_requests > max_seqs:
            raise AssertionError(f"scheduler {name!r} in the engine: step {i} ran {num_tokens} tokens of "
                                 f"{num_requests} requests, over max_num_batched_tokens {budget} / max_num_seqs "
                                 f"{max_seqs}")
    for i, (got, want) in enumerate(zip(run.tokens, expected, strict=True)):
        if got != want:
            raise AssertionError(
                f"scheduler {name!r} in the engine: prompt {i} gave greedy tokens {got}, the {reference!r} "
                f"scheduler {want}: scheduling must not change what is computed"
            )
    report.engine_compared_with = reference
    report.engine_steps = len(run.steps)
    report.engine_preemptions = run.num_preemptions
