"""ModelRunner: turns a SchedulerOutput into one forward pass and one sampling step.

Device-agnostic torch. Per step it (1) updates its per-request state from the scheduler's message, (2) lays
the batch out decodes-first and builds positions / slot_mapping / block tables (worker/input_prep.py), (3)
runs the model, computing logits only at the last scheduled position of each request, and (4) samples for
the requests whose scheduled tokens reach the end of what is known (a prefill chunk that is not the last
gets no sample). The only device->host copy is the sampled ids (and logprobs when asked for).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.engine.messages import ModelRunnerOutput, SchedulerOutput
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler
from pagedllm.worker.input_prep import prepare_inputs
from pagedllm.worker.request_state import CachedRequestState


class ModelRunner:
    def __init__(
        self,
        model: Any,
        attn_backend: Any,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        vocab_size: int,
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
        inputs = prepare_inputs(
            [s.token_ids for s in states],
            [s.num_computed_tokens for s in states],
            num_sched,
            [s.block_ids[0] for s in states],
            self.block_size,
            self.device,
            num_decodes,
        )
        attn_metadata = self.attn_backend.build_metadata(inputs.attn)
        hidden = self.model(inputs.input_ids, inputs.positions, attn_metadata, self.kv_caches)

        # Only requests whose scheduled tokens reach the end of their known tokens get a sample.
        sample_rows = [i for i, s in enumerate(states) if s.num_computed_tokens + num_sched[i] >= s.num_tokens]
        sampled: list[list[int]] = [[] for _ in states]
        logprobs: list[Any] = [None] * len(states)
        if sample_rows:
            idx = inputs.logits_indices[sample_rows] if len(sample_rows) < len(states) else inputs.logits_indices
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
