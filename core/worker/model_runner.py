"""ModelRunner: turns a SchedulerOutput into one forward pass and one sampling step.

Device-agnostic torch. Per step it (1) updates its per-request state from the scheduler's message, (2) lays
the batch out decodes-first and builds positions / slot_mapping / block tables (worker/input_prep.py), (3)
runs the model, computing logits only at the last scheduled position of each request, and (4) samples for
the requests whose scheduled tokens reach the end of what is known (a prefill chunk that is not the last
gets no sample). The only device->host copy is the sampled ids (and logprobs when asked for).

On CUDA the inputs go through persistent buffers (pinned host mirrors, non-blocking copies) and decode-only
steps can replay CUDA graphs (worker/cuda_graphs.py); on the CPU each step builds fresh tensors as before.
`profile_activation_bytes` runs the largest step once so the builder can size the KV cache from what is
left of the GPU's memory.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pagedllm.engine.messages import ModelRunnerOutput, SchedulerOutput
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler
from pagedllm.worker.cuda_graphs import DecodeGraphs, GPURunnerOptions, StepBuffers, graph_ladder
from pagedllm.worker.input_prep import StepInputs, plan_inputs, prepare_inputs
from pagedllm.worker.request_state import CachedRequestState

logger = logging.getLogger("pagedllm")


class ModelRunner:
    def __init__(
        self,
        model: Any,
        attn_backend: Any,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        vocab_size: int,
        options: GPURunnerOptions | None = None,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.vocab_size = vocab_size
        self.sampler = Sampler()
        self.states: dict[str, CachedRequestState] = {}
        # Generators outlive preemption so a seeded request continues its random stream when it resumes.
        self._generators: dict[str, torch.Generator] = {}
        self.options = options or GPURunnerOptions(cuda_graphs=False)
        self._buffers: StepBuffers | None = None
        self._graphs: DecodeGraphs | None = None
        self._warned_overflow = False
        if device.type == "cuda":
            opts = self.options
            self._buffers = StepBuffers(
                max(opts.max_num_tokens, opts.max_num_seqs),
                opts.max_num_seqs,
                -(-opts.max_model_len // block_size) + 1,
                device,
            )

    @property
    def graph_sizes(self) -> list[int]:
        """Decode batch sizes with a captured CUDA graph (empty when running eagerly)."""
        return self._graphs.sizes if self._graphs else []

    def capture_cuda_graphs(self, sizes: list[int] | None = None) -> list[int]:
        """Capture decode graphs (CUDA, and a backend that declares `supports_cuda_graphs`); returns the sizes.

        Called once after the KV cache is allocated. Capturing writes only to the null block (cuda_graphs.py
        NOTE 2), so it may also run on a live engine between steps.
        """
        if self._buffers is None or not getattr(self.attn_backend, "supports_cuda_graphs", False):
            return []
        sizes = sizes or list(self.options.graph_batch_sizes or graph_ladder(self.options.max_num_seqs))
        graphs = DecodeGraphs(self.model, self.attn_backend, self.kv_caches, self._buffers)
        with torch.inference_mode():
            graphs.capture(sizes, self.block_size)
        self._graphs = graphs
        return graphs.sizes

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
            self._generators.pop(rid, None)
        for rid in so.preempted_req_ids:
            self.states.pop(rid, None)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
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
            )
        for cached in so.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            for group, ids in enumerate(cached.new_block_ids):
                state.block_ids[group].extend(ids)
            state.num_computed_tokens = cached.num_computed_tokens

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [], [])

        # Decodes first: backends can batch the query_len == 1 rows together.
        req_ids = sorted(so.num_scheduled_tokens, key=lambda r: so.num_scheduled_tokens[r] != 1)
        states = [self.states[r] for r in req_ids]
        num_sched = [so.num_scheduled_tokens[r] for r in req_ids]
        num_decodes = sum(1 for n in num_sched if n == 1)
        token_ids = [s.token_ids for s in states]
        computed = [s.num_computed_tokens for s in states]
        block_ids = [s.block_ids[0] for s in states]
        inputs, hidden = self._forward(token_ids, computed, num_sched, block_ids, num_decodes)
        logits_indices = inputs.logits_indices[: len(states)]  # graph padding rows are never sampled

        # Only requests whose scheduled tokens reach the end of their known tokens get a sample.
        sample_rows = [i for i, s in enumerate(states) if s.num_computed_tokens + num_sched[i] >= s.num_tokens]
        sampled: list[list[int]] = [[] for _ in states]
        logprobs: list[Any] = [None] * len(states)
        if sample_rows:
            idx = logits_indices[sample_rows] if len(sample_rows) < len(states) else logits_indices
            logits = self.model.compute_logits(hidden[idx])
            rows = [states[i] for i in sample_rows]
            metadata = SamplingMetadata.build(
                [s.sampling_params for s in rows],
                [s.generator for s in rows],
                [s.prompt_token_ids for s in rows],
                [s.output_token_ids for s in rows],
                self.vocab_size,
                self.device,
            )
            out = self.sampler(logits, metadata)
            tokens = out.sampled_token_ids.tolist()  # the step's one device->host sync
            entries = (
                out.logprobs.to_entries([s.sampling_params.logprobs for s in rows])
                if out.logprobs is not None
                else [None] * len(rows)
            )
            for j, i in enumerate(sample_rows):
                states[i].output_token_ids.append(tokens[j])
                sampled[i] = [tokens[j]]
                logprobs[i] = entries[j]
        for i, s in enumerate(states):
            s.num_computed_tokens += num_sched[i]
        return ModelRunnerOutput(req_ids, sampled, logprobs)

    def _forward(
        self,
        token_ids: list[list[int]],
        computed: list[int],
        num_sched: list[int],
        block_ids: list[list[int]],
        num_decodes: int,
    ) -> tuple[StepInputs, torch.Tensor]:
        """Lay out the step's inputs and run the model: graph replay, persistent buffers, or fresh tensors."""
        if self._buffers is None:  # CPU: fresh tensors per step, exactly as before the GPU path existed
            inputs = prepare_inputs(
                token_ids, computed, num_sched, block_ids, self.block_size, self.device, num_decodes
            )
        else:
            host = plan_inputs(token_ids, computed, num_sched, block_ids, self.block_size, num_decodes)
            replay = self._graphs.run(host) if self._graphs is not None else None
            if replay is not None:
                return replay
            if self._buffers.fits(host):
                inputs = self._buffers.load(host)
            else:
                # Larger than the buffers were sized for (options smaller than the scheduler's limits):
                # still correct, just with per-step allocations. Say so once.
                if not self._warned_overflow:
                    self._warned_overflow = True
                    logger.warning("step larger than the runner's buffers %s; using fresh tensors", self.options)
                inputs = prepare_inputs(
                    token_ids, computed, num_sched, block_ids, self.block_size, self.device, num_decodes
                )
        attn_metadata = self.attn_backend.build_metadata(inputs.attn)
        return inputs, self.model(inputs.input_ids, inputs.positions, attn_metadata, self.kv_caches)


@torch.inference_mode()
def profile_activation_bytes(
    model: Any,
    backend: Any,
    specs: list[Any],
    block_size: int,
    num_tokens: int,
    num_logit_rows: int,
    device: torch.device,
) -> int:
    """Peak bytes the largest step allocates beyond what is live now (CUDA only; 0 elsewhere).

    Runs one prefill of `num_tokens` tokens (the scheduler's token budget) through the model and the logits of
    `num_logit_rows` rows, against a throw-away KV cache just large enough for it, and reads the allocator's
    peak. The builder subtracts this (and everything already allocated) from the memory budget before
    sizing the real cache.
    """
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    num_blocks = -(-num_tokens // block_size) + 1
    caches = [
        torch.empty(backend.kv_cache_shape(num_blocks, s.block_size, s.num_kv_heads, s.head_size), dtype=s.dtype,
                    device=device)
        for s in specs
    ]
    cache_bytes = sum(c.numel() * c.element_size() for c in caches)
    inputs = prepare_inputs(
        [[0] * num_tokens], [0], [num_tokens], [list(range(1, num_blocks))], block_size, device, 0
    )
    hidden = model(inputs.input_ids, inputs.positions, backend.build_metadata(inputs.attn), caches)
    rows = min(num_logit_rows, num_tokens)
    model.compute_logits(hidden[-rows:]).float().softmax(-1)  # the sampler's float32 copy of the logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline - cache_bytes
    del caches, hidden, inputs
    torch.cuda.empty_cache()
    return int(peak)
