"""ModelRunner: turns a SchedulerOutput into one forward pass and one sampling step.

Device-agnostic torch. Per step it (1) updates its per-request state from the scheduler's message, (2) lays
the batch out decodes-first and builds positions / slot_mapping / block tables (worker/input_prep.py), (3)
runs the model, computing logits only at the last scheduled position of each request, and (4) samples for
the requests whose scheduled tokens reach the end of what is known (a prefill chunk that is not the last
gets no sample). The only device->host copy is the sampled ids (and logprobs when asked for).

A hybrid model (several KV-cache groups) gets one block table and slot mapping per group
(`block_sizes` has one entry per group) and a `KVGroupMetadata`; a one-group model takes exactly the
single-table path it always did.

On CUDA the inputs go through persistent buffers (pinned host mirrors, non-blocking copies) and decode-only
steps can replay CUDA graphs (worker/cuda_graphs.py); on the CPU each step builds fresh tensors as before.
worker/memory_profile.py runs the largest step once so the builder can size the KV cache from what is left
of the GPU's memory.

Pipelined steps (async scheduling, NOTE 1). `execute_pipelined(so)` launches step N+1 and returns step N's
output, so the engine's host work (applying N's tokens, detokenizing, scheduling N+2, laying out its inputs)
runs while the GPU computes N+1, as vLLM's async scheduling does. Step N's samples stay on the device: each
request that sampled gets a PLACEHOLDER token in its state, and step N+1 -- scheduled before N's tokens are
known -- feeds that position from N's sampled-ids tensor (a device-side gather into the input ids, before
any graph replay). Only after launching N+1's forward does the runner wait for N's ids (a non-blocking copy
into pinned memory), write them over the placeholders, and then sample N+1, so penalties, logits
processors and seeded generators see exactly the tokens a synchronous run would.

Tensor parallelism (NOTE 2): every rank runs the same pipelined steps; rank 0 alone samples and then
broadcasts its ids over the group, in-stream (NCCL on GPUs, gloo on the CPU), into the tensor each rank's
next step gathers its placeholders from. Remote ranks skip the sampler: their inputs, states and KV cache
hold rank 0's tokens without a host round trip and without rank 0's previous output in the step message
(the synchronous path's adoption, tp_worker.py NOTE 1).

Warm-up (NOTE 3). Triton compiles a kernel the first time a launch configuration is used, and the triton
attention backend picks its configuration by the step's shape (triton_tuning.choose_config): decode-only,
decodes beside a prompt chunk, prompts. Graph capture and the profiling step reach only some of them, so
the first mixed step of a fresh process compiled inside the first requests' time -- measured on the H200 as
a first benchmark process 1.3-2 % slower on W1 than the next ones on the same machine (docs/perf-notes.md
§17). `warm_up` runs each kind of step once on the null block at start-up, as vLLM's start-up warm-up does.
The kinds include decodes beside a long fresh prompt (the fresh-prefill route: the decodes then launch
alone, without the cascade of a decode-only step, at 16 and at 256 requests, the two decode entries) and
decodes beside a later chunk: W1's mixed steps compiled those inside the timed run (perf-notes §19).

Compile-ahead (NOTE 4). Each of those first launches compiled its Triton binary in turn: ~25 binaries, most
of a cold start (perf-notes §19). `compile_ahead` first walks the same steps -- every graph size capture will
take, every warm-up kind -- inside layers/compile_ahead.compiling_ahead(), where the Triton launches only
compile, on a thread pool; capture and warm-up then find every binary built.

Encoder-decoder models (NOTE 5). A model with `is_encoder_decoder` (BART) has cross-attention KV-cache groups
(CrossAttentionSpec) whose blocks hold each request's encoder output, not its decoder tokens. They stay out of
the usual tables and step buffers: each step worker/encoder_inputs.py lays out the encoder prompts of the
requests in their first step and the cross-attention pseudo-batch per group, and the model gets them as
`encoder_inputs=` and in its groups' metadata. Such steps are never captured in CUDA graphs.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.engine.messages import ModelRunnerOutput, SchedulerOutput
from pagedllm.kv_cache.spec import MambaSpec
from pagedllm.layers.compile_ahead import compile_first, repeated_layers_skipped
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler
from pagedllm.spec_decode.speculator import Speculator
from pagedllm.spec_decode.verification import verify
from pagedllm.worker import prompt_logprobs
from pagedllm.worker.cuda_graphs import DecodeGraphs, GPURunnerOptions, StepBuffers, graph_ladder
from pagedllm.worker.encoder_inputs import (
    CrossLayout,
    cross_attention_groups,
    plan_cross_layout,
    with_cross_metadata,
)
from pagedllm.worker.input_prep import (
    BlockTableCache,
    GroupBlockIds,
    StepInputs,
    build_attn_metadata,
    plan_inputs,
    prepare_inputs,
)
from pagedllm.worker.pipeline_stage import stage_forward, stage_step_output
from pagedllm.worker.pipelined_step import PendingStep, PipelinedSteps
from pagedllm.worker.request_state import CachedRequestState

logger = logging.getLogger("pagedllm")


class ModelRunner(PipelinedSteps):
    def __init__(
        self,
        model: Any,
        attn_backend: Any,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        vocab_size: int,
        options: GPURunnerOptions | None = None,
        block_sizes: list[int] | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        *,
        sampler: Sampler | None = None,
        speculator: Speculator | None = None,
        pp_rank: int = 0,
        pp_size: int = 1,
    ) -> None:
        """:param sampler: the engine's sampler (with the config's logits processors); a plain one by default.
        :param speculator: speculative decoding's proposer and verification (pagedllm.spec_decode.speculator);
            None keeps every step exactly as without it.
        Both are built by the engine's builder (engine/runner_plugins.py) and fixed for the runner's life."""
        self.model = model
        self.tp_rank, self.tp_size = tp_rank, tp_size  # this runner's tensor-parallel rank (NOTE 2)
        self.pp_rank, self.pp_size = pp_rank, pp_size  # its pipeline stage (worker/pipeline_stage.py)
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches
        # A KV connector's worker side (protocols/kv_connector.py), set by the engine builder; None: none.
        self.kv_connector: Any = None
        self.block_size = block_size
        # One entry per KV-cache group; group 0's is block_size.
        self.block_sizes = list(block_sizes) if block_sizes else [block_size]
        if self.block_sizes[0] != block_size:
            raise ValueError(f"block_sizes[0] ({self.block_sizes[0]}) must be block_size ({block_size})")
        self.device = device
        self.vocab_size = vocab_size
        self.sampler = sampler if sampler is not None else Sampler()
        self.speculator = speculator
        self.states: dict[str, CachedRequestState] = {}
        # Generators outlive preemption so a seeded request continues its random stream when it resumes.
        self._generators: dict[str, torch.Generator] = {}
        # Requests that asked for prompt logprobs (worker/prompt_logprobs.py): empty, the step skips them all.
        self._prompt_logprob_reqs: set[str] = set()
        self.options = options or GPURunnerOptions(cuda_graphs=False)
        self._buffers: StepBuffers | None = None
        self._graphs: DecodeGraphs | None = None
        self._warned_overflow = False
        self._pending: PendingStep | None = None  # pipelined mode: the step in flight (NOTE 1)
        self._unsampled: Any = None  # pipelined mode: a launched step waiting to be sampled (pipelined_step NOTE 5)
        self._grammar_join: Callable[[], None] | None = None  # the grammar work in flight (pipelined_step NOTE 5)
        self._sampled_host: torch.Tensor | None = None
        # An encoder-decoder model's cross-attention groups, laid out on their own each step (NOTE 5); the
        # other groups ("self" groups, group 0 first) take the usual tables and step buffers.
        self._cross_groups = cross_attention_groups(model)
        self._self_groups = [g for g in range(len(self.block_sizes)) if g not in self._cross_groups]
        # Block tables kept between steps, one per self group (input_prep.BlockTableCache).
        self._table_caches = [BlockTableCache() for _ in self._self_groups]
        # The last step's sampling metadata: a steady batch reuses its params tensors (metadata.py `reuse`).
        self._last_metadata: SamplingMetadata | None = None
        if device.type == "cuda":
            opts = self.options
            self._buffers = StepBuffers(
                max(opts.max_num_tokens, opts.max_num_seqs),
                opts.max_num_seqs,
                -(-opts.max_model_len // min(self.block_sizes)) + 1,
                device,
                num_groups=len(self._self_groups),
            )

    @property
    def graph_sizes(self) -> list[int]:
        """Decode batch sizes with a captured CUDA graph (empty when running eagerly)."""
        return self._graphs.sizes if self._graphs else []

    def capture_cuda_graphs(
        self, sizes: list[int] | None = None, query_lens: tuple[int, ...] | None = None
    ) -> list[int]:
        """Capture decode graphs (CUDA, and a backend that declares `supports_cuda_graphs`); returns the sizes.

        `query_lens` (default: the options' uniform_query_lens) adds graphs for uniform steps of q tokens per
        request (speculative verification, cuda_graphs.py NOTE 3); models with state layers (Mamba) plan
        decodes and prefills differently on the host, so they get decode graphs only.
        Called once after the KV cache is allocated. Capturing writes only to the null block (cuda_graphs.py
        NOTE 2), so it may also run on a live engine between steps.
        """
        plan = self._graph_plan(sizes, query_lens)
        if plan is None:
            return []
        assert self._buffers is not None  # a graph plan exists only with the step buffers (CUDA)
        graphs = DecodeGraphs(self.model, self.attn_backend, self.kv_caches, self._buffers)
        with torch.inference_mode():
            graphs.capture(plan[0], self.block_sizes, plan[1])
        self._graphs = graphs
        return graphs.sizes

    def _graph_plan(
        self, sizes: list[int] | None = None, query_lens: tuple[int, ...] | None = None
    ) -> tuple[list[int], tuple[int, ...]] | None:
        """(batch sizes, uniform query lengths) capture_cuda_graphs takes, or None where nothing is captured."""
        if self._buffers is None or not getattr(self.attn_backend, "supports_cuda_graphs", False):
            return None
        if self._cross_groups:  # each step's cross-attention layout is built fresh (NOTE 5): no graphs
            return None
        sizes = sizes or list(self.options.graph_batch_sizes or graph_ladder(self.options.max_num_seqs))
        lens = self.options.uniform_query_lens if query_lens is None else query_lens
        if any(isinstance(getattr(m, "spec", None), MambaSpec) for m in self.model.modules()):
            lens = ()
        return sizes, lens

    def compile_ahead(self) -> int:
        """Build the Triton binaries of every step graph capture and warm_up() will run, on a thread pool,
        before either launches one (NOTE 4); returns the steps walked (0: not CUDA, a Triton without
        thread-pool compiles, or a failure, logged). Launches there only compile: the KV cache is not written."""
        if self.device.type != "cuda":
            return 0
        plan = self._graph_plan() if self.options.cuda_graphs else None
        steps: list[int] = []

        def walk() -> None:
            with torch.inference_mode(), repeated_layers_skipped(self.model):
                if plan is not None:
                    assert self._buffers is not None  # as in capture_cuda_graphs
                    graphs = DecodeGraphs(self.model, self.attn_backend, self.kv_caches, self._buffers)
                    steps.append(graphs.compile_ahead(plan[0], self.block_sizes, plan[1]))
                steps.append(len(self._run_warm_up_kinds()))

        compile_first(walk)
        return sum(steps)

    def release_cuda_graphs(self) -> None:
        """Destroy the captured graphs (before leaving a tensor-parallel group: cuda_graphs.py NOTE 5)."""
        if self._graphs is not None:
            self._graphs.release()
            self._graphs = None

    def release(self) -> None:
        """Drop the graphs, model, KV cache and step buffers (engine shutdown), so their device memory goes back
        to the allocator -- and, after the engine's empty_cache, to the driver -- even while the caller still
        holds the LLM object. The runner cannot step afterwards."""
        self.release_cuda_graphs()
        shutdown = getattr(self.kv_connector, "shutdown", None)  # optional (protocols/kv_connector.py, API 1.5)
        if shutdown is not None:
            shutdown()
        self.model = None
        self.kv_caches = []
        self._buffers = None
        self.speculator = None
        self._last_metadata = None
        self._table_caches = [BlockTableCache() for _ in self._self_groups]
        self.states.clear()

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
            self._generators.pop(rid, None)
            self._prompt_logprob_reqs.discard(rid)
        for rid in so.preempted_req_ids:
            self.states.pop(rid, None)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            if params.prompt_logprobs is not None:
                self._prompt_logprob_reqs.add(new.req_id)
            gen = self._generators.get(new.req_id)
            if gen is None and params.seed is not None and not params.greedy:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(params.seed)
                self._generators[new.req_id] = gen
            self.states[new.req_id] = CachedRequestState(
                new.req_id,
                list(new.prompt_token_ids),
                list(new.output_token_ids),
                params,
                gen,
                [list(ids) for ids in new.block_ids],
                new.num_computed_tokens,
                new.encoder_prompt_token_ids,
            )
        states = self.states
        for cached in so.scheduled_cached_reqs:
            state = states[cached.req_id]
            for group, ids in enumerate(cached.new_block_ids):
                if ids:  # most decode steps append no block
                    state.block_ids[group].extend(ids)
            state.num_computed_tokens = cached.num_computed_tokens
        if so.kv_connector_metadata is not None:
            # Evicted blocks out, tier hits in: before this step's forward writes or reads the cache.
            self.kv_connector.start_load_kv(so.kv_connector_metadata)

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if self.speculator is not None:
            self.speculator.remove_requests(so.finished_req_ids | so.preempted_req_ids)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [], [])

        req_ids, states, num_sched = self._layout(so)
        prompt_slots = (prompt_logprobs.plan(req_ids, states, num_sched, self._prompt_logprob_reqs)
                        if self._prompt_logprob_reqs else None)
        # Speculative decoding: a request's scheduled drafts follow its known tokens (core/spec_decode/).
        spec = so.scheduled_spec_decode_tokens
        token_ids = [s.token_ids + spec[r] if r in spec else s.token_ids for r, s in zip(req_ids, states)]
        inputs, hidden = self._forward_states(states, token_ids, num_sched)
        if hidden is None:  # a pipeline stage before the last: its output went on to the next stage
            return stage_step_output(req_ids, states, num_sched)
        prompt_lps = (prompt_logprobs.to_entries(prompt_logprobs.compute(self.model, hidden, prompt_slots,
                                                                         self.vocab_size))
                      if prompt_slots else {})
        logits_indices = inputs.logits_indices[: len(states)]  # graph padding rows are never sampled

        # Only requests whose scheduled tokens reach the end of their known tokens get a sample.
        sample_rows = [i for i, s in enumerate(states) if s.num_computed_tokens + num_sched[i] >= s.num_tokens]
        sampled: list[list[int]] = [[] for _ in states]
        logprobs: list[Any] = [None] * len(states)
        num_rejected = [0] * len(states)
        if sample_rows and spec:
            drafts = [spec.get(req_ids[i], []) for i in sample_rows]
            last_rows = list(itertools.accumulate(num_sched))  # host-side: no sync on logits_indices
            rows_idx = Speculator.logits_rows([last_rows[i] - 1 for i in sample_rows], [len(d) for d in drafts])
            logits = self.model.compute_logits(hidden[torch.tensor(rows_idx, device=hidden.device)])
            rows = [states[i] for i in sample_rows]
            if so.structured_output is not None:  # drafts are verified under their positions' masks
                so.structured_output.apply(logits, [req_ids[i] for i in sample_rows], [len(d) + 1 for d in drafts])
            # A runner without the proposer (a remote tensor-parallel rank) verifies with one-hot q.
            verified = (self.speculator.verify(self.sampler, logits, rows, drafts) if self.speculator is not None
                        else verify(self.sampler, logits, rows, drafts, [None] * len(rows), self.vocab_size))
            for j, i in enumerate(sample_rows):
                states[i].append_outputs(verified.token_ids[j])
                sampled[i] = verified.token_ids[j]
                logprobs[i] = verified.logprobs[j]
                num_rejected[i] = len(drafts[j]) - verified.num_accepted[j]
        elif sample_rows:
            idx = logits_indices[sample_rows] if len(sample_rows) < len(states) else logits_indices
            logits = self.model.compute_logits(hidden[idx])
            rows = [states[i] for i in sample_rows]
            if so.structured_output is not None:
                so.structured_output.apply(logits, [req_ids[i] for i in sample_rows], [1] * len(sample_rows))
            metadata = SamplingMetadata.build(
                [s.sampling_params for s in rows],
                [s.generator for s in rows],
                [s.prompt_token_ids for s in rows],
                [s.output_token_ids for s in rows],
                self.vocab_size,
                self.device,
                reuse=self._last_metadata,
            )
            self._last_metadata = metadata
            out = self.sampler(logits, metadata)
            tokens = out.sampled_token_ids.tolist()  # the step's one device->host sync
            entries = (
                out.logprobs.to_entries([s.sampling_params.logprobs for s in rows])
                if out.logprobs is not None
                else [None] * len(rows)
            )
            for j, i in enumerate(sample_rows):
                states[i].append_outputs([tokens[j]])
                sampled[i] = [tokens[j]]
                logprobs[i] = None if entries[j] is None else [entries[j]]
        for i, s in enumerate(states):
            s.num_computed_tokens += num_sched[i] - num_rejected[i]  # rejected drafts' KV is rolled back
        proposals: list[list[int]] = []
        if self.speculator is not None and sample_rows:
            drafts_next = self.speculator.propose([states[i] for i in sample_rows])
            proposals = [drafts_next.get(r, []) for r in req_ids]
        return ModelRunnerOutput(req_ids, sampled, logprobs, proposals, prompt_lps)

    def _layout(self, so: SchedulerOutput) -> tuple[list[str], list[CachedRequestState], list[int]]:
        """The step's requests, decodes first (backends batch the query_len == 1 rows together)."""
        num_scheduled = so.num_scheduled_tokens
        if so.total_num_scheduled_tokens == len(num_scheduled):  # all decodes (one token each): no sort
            req_ids = list(num_scheduled)
            return req_ids, [self.states[r] for r in req_ids], [1] * len(req_ids)
        req_ids = sorted(num_scheduled, key=lambda r: num_scheduled[r] != 1)
        return req_ids, [self.states[r] for r in req_ids], [num_scheduled[r] for r in req_ids]

    def _forward_states(
        self,
        states: list[CachedRequestState],
        token_ids: list[list[int]],
        num_sched: list[int],
        fill: Callable[[torch.Tensor], None] | None = None,
    ) -> tuple[StepInputs, torch.Tensor]:
        num_decodes = sum(1 for n in num_sched if n == 1)
        computed = [s.num_computed_tokens for s in states]
        block_ids = [s.block_ids[0] for s in states]
        more_groups: list[GroupBlockIds] = [
            ([s.block_ids[g] for s in states], self.block_sizes[g]) for g in self._self_groups[1:]
        ]
        cross = self._cross_layout(states, computed, num_sched) if self._cross_groups else None
        # The states' block lists only grow (_update_states extends them): the tables can be kept (input_prep.py).
        return self._forward(token_ids, computed, num_sched, block_ids, num_decodes, more_groups, fill,
                             self._table_caches, cross=cross)

    def _cross_layout(self, states: list[CachedRequestState], computed: list[int], num_sched: list[int]) -> CrossLayout:
        """The step's encoder inputs and each cross-attention group's metadata (NOTE 5)."""
        return plan_cross_layout([s.encoder_prompt_token_ids or [] for s in states], computed, num_sched,
                                 {g: [s.block_ids[g] for s in states] for g in self._cross_groups},
                                 self.block_sizes, self.device)

    def forward_tokens(
        self,
        token_ids: list[list[int]],
        computed: list[int],
        num_sched: list[int],
        block_ids: list[list[int]],
        num_decodes: int,
    ) -> tuple[StepInputs, torch.Tensor]:
        """One forward over a batch the caller lays out (one KV-cache group), with no request state and no
        sampling: a draft model's proposer drives its own runner this way. Returns (inputs, hidden states)."""
        return self._forward(token_ids, computed, num_sched, block_ids, num_decodes)

    def _forward(
        self,
        token_ids: list[list[int]],
        computed: list[int],
        num_sched: list[int],
        block_ids: list[list[int]],
        num_decodes: int,
        more_groups: list[GroupBlockIds] | None = None,
        fill: Callable[[torch.Tensor], None] | None = None,
        table_caches: list[BlockTableCache] | None = None,
        use_graphs: bool = True,
        cross: CrossLayout | None = None,
    ) -> tuple[StepInputs, torch.Tensor]:
        """Lay out the step's inputs and run the model: graph replay, persistent buffers, or fresh tensors.

        `block_ids` are KV-cache group 0's per request; `more_groups` the other groups' (hybrid models);
        `fill` rewrites the input ids on the device before the model reads them (NOTE 1); `use_graphs` False
        runs a decode-only step eagerly even where a graph would fit (warm_up); `cross` an encoder-decoder
        model's encoder inputs and cross-attention metadata per group (NOTE 5).
        """
        more = more_groups or ()
        inputs: StepInputs | None = None
        if self._buffers is not None:
            host = plan_inputs(token_ids, computed, num_sched, block_ids, self.block_size, num_decodes, more,
                               table_caches)
            replay = self._graphs.run(host, fill) if self._graphs is not None and use_graphs else None
            if replay is not None:
                return replay
            if self._buffers.fits(host):
                inputs = self._buffers.load(host, fill=fill)
            elif not self._warned_overflow:
                # Larger than the buffers were sized for (options smaller than the scheduler's limits):
                # still correct, just with per-step allocations. Say so once.
                self._warned_overflow = True
                logger.warning("step larger than the runner's buffers %s; using fresh tensors", self.options)
        if inputs is None:  # the CPU (fresh tensors per step, as before the GPU path existed) or an oversized step
            inputs = prepare_inputs(
                token_ids, computed, num_sched, block_ids, self.block_size, self.device, num_decodes, more,
                table_caches,
            )
            if fill is not None:
                fill(inputs.input_ids)
        attn_metadata = build_attn_metadata(self.attn_backend, inputs)
        if cross is not None:
            attn_metadata = with_cross_metadata(self.attn_backend, attn_metadata, cross[1])
            return inputs, self.model(inputs.input_ids, inputs.positions, attn_metadata, self.kv_caches,
                                      encoder_inputs=cross[0])
        if self.pp_size > 1:  # None on a stage before the last (pipeline_stage.py)
            return inputs, stage_forward(self.model, inputs.input_ids, inputs.positions, attn_metadata,
                                         self.kv_caches, self.pp_rank, self.pp_size)  # type: ignore[return-value]
        return inputs, self.model(inputs.input_ids, inputs.positions, attn_metadata, self.kv_caches)

    @torch.inference_mode()
    def warm_up(self) -> list[str]:
        """Run one eager forward (and its logits) of each kind of step the scheduler makes, so that kernels
        which compile on first use -- Triton's JIT builds one binary per launch configuration, and the
        attention rule picks its configuration by step shape -- do it at start-up, not inside the first
        requests' steps (NOTE 3). Every position maps to the null block 0 (never read for real requests, as
        in graph capture), so the KV cache's blocks 1.. are untouched. Returns the kinds run; none for models
        with state layers or several KV-cache groups (their steps need per-request state slots and tables).
        """
        kinds = self._run_warm_up_kinds()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return kinds

    def _warm_up_kinds(self) -> list[tuple[str, list[int], list[int], int]]:
        """(kind, tokens already computed per request, tokens scheduled per request, leading decodes)."""
        opts = self.options
        seqs, budget, ctx = opts.max_num_seqs, opts.max_num_tokens, min(64, opts.max_model_len - 1)
        kinds: list[tuple[str, list[int], list[int], int]] = [
            ("decode, few requests (split-KV)", [ctx] * min(2, seqs), [1] * min(2, seqs), min(2, seqs)),
            ("decode, many requests", [ctx] * min(256, seqs, budget), [1] * min(256, seqs, budget),
             min(256, seqs, budget)),
        ]
        if seqs >= 4 and budget > 3 + 16:
            chunk = min(64, budget - 3, opts.max_model_len)
            kinds.append(("decodes beside a prompt chunk", [ctx] * 3 + [0], [1] * 3 + [chunk], 3))
        # NOTE 3: a long fresh prompt after the decodes (the fresh route: the decodes launch alone), at both
        # decode entries' batch sizes; then decodes, a later chunk (few tokens per request) and such a prompt.
        for decodes in sorted({min(16, seqs - 1), min(256, seqs - 1)}):
            long = min(2048, budget - decodes - 32, opts.max_model_len - 1)
            if decodes < 1 or long < 256:
                continue
            kinds.append((f"{decodes} decodes beside a long prompt", [ctx] * decodes + [0],
                          [1] * decodes + [long], decodes))
            if decodes == min(16, seqs - 1) and decodes + 2 <= seqs and ctx + 32 < opts.max_model_len:
                kinds.append((f"{decodes} decodes, a later chunk and a long prompt", [ctx] * decodes + [ctx, 0],
                              [1] * decodes + [32, long], decodes))
        prompt = min(128, budget // min(2, seqs), opts.max_model_len)
        kinds.append(("prompts", [0] * min(2, seqs), [prompt] * min(2, seqs), 0))
        if opts.max_model_len > 2 * prompt and budget >= prompt:
            kinds.append(("a later chunk of a prompt", [prompt], [prompt], 0))
        return kinds

    def _run_warm_up_kinds(self) -> list[str]:
        """One eager forward (and its logits) of each warm-up kind on the null block; the kinds run."""
        if len(self.block_sizes) > 1 or any(isinstance(getattr(m, "spec", None), MambaSpec)
                                            for m in self.model.modules()):
            return []
        kinds = self._warm_up_kinds()
        for _, computed, sched, decodes in kinds:
            lens = [c + s for c, s in zip(computed, sched, strict=True)]
            token_ids = [[0] * n for n in lens]
            block_ids = [[0] * -(-n // self.block_size) for n in lens]
            inputs, hidden = self._forward(token_ids, computed, sched, block_ids, decodes, use_graphs=False)
            self.model.compute_logits(hidden[inputs.logits_indices[: len(lens)]])
        return [kind for kind, *_ in kinds]
