"""DraftModelProposer: a smaller model guesses k tokens per request; the target verifies them in one pass.

The draft is a second engine built through the same builder as the target (loader, architecture, attention
backend, quantization, its own paged KV cache with prefix caching, its own runner), with the target's
device, dtype and context length. Per request it keeps a shadow `Request` holding the verified tokens, so
the draft's KVCacheManager allocates, prefix-caches and frees its blocks exactly as it does the target's.

One propose() call, for a request with n verified tokens:

    draft KV valid:  | t_0 ... t_{s-1} |                       s = what survived from last time
    catch-up:                          | t_s ... t_{n-1} |     one batched forward; logits at n-1 -> d_0
    draft steps:                                         | d_0 ... d_{k-2} |  k-1 batched decodes -> d_1..d_{k-1}

Drafts fed at positions n.. are kept as "fed": next time, the ones the target accepted still hold valid KV
(same tokens at the same positions), so the catch-up starts after them; the rest is overwritten. Hashes
cover verified tokens only, so a draft token never enters the draft's prefix cache either.

Greedy requests draft by argmax (q is irrelevant to greedy verification); sampled requests draft from
softmax(draft logits / temperature) with the request's own generator, and that q goes to the verifier.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.api.engine import EngineConfig
from pagedllm.api.sched import Request, SamplingParams
from pagedllm.api.spec_decode import ProposalRequest, Proposals, ProposerContext, exponential_race

logger = logging.getLogger("pagedllm")

# Sections of the target's config the draft does not inherit (they describe the target or its serving).
_NOT_INHERITED = ("speculative", "quantization", "logits_processors", "parallel", "tokenizer")


@dataclass
class _DraftState:
    shadow: Request  # prompt_token_ids = the verified tokens the draft knows; num_computed_tokens = valid KV
    fed: list[int] = field(default_factory=list)  # drafts written after them last time (positions n, n+1, ..)


class DraftModelProposer:
    def __init__(self, ctx: ProposerContext) -> None:
        from pagedllm.api.engine import build_engine

        cfg = ctx.config
        if not cfg.draft_model:
            raise ValueError("speculative.draft_model must name the draft model for method 'draft'")
        self.vocab_size = ctx.vocab_size
        self.device = ctx.device
        k = cfg.num_speculative_tokens
        # As many blocks as the target has, plus room for each running request's k draft positions: the
        # draft never holds more tokens of a request than the target does, k - 1 drafts aside.
        max_seqs = ctx.engine_config.scheduler.max_num_seqs
        num_blocks = ctx.num_kv_blocks + max_seqs * (-(-k // ctx.block_size) + 1)
        base = ctx.engine_config.model_dump()
        for key in _NOT_INHERITED:
            base.pop(key, None)
        overrides: dict[str, Any] = {
            "model": cfg.draft_model,
            "loader.name": cfg.draft_load_format,
            "dtype": str(ctx.dtype).removeprefix("torch."),
            "device": ctx.device.type,
            "max_model_len": ctx.max_model_len,
            "kv_cache.num_blocks": num_blocks,
        }
        draft_config = EngineConfig.from_dict(base, overrides, source="the draft model's config", env={})
        self.parts = build_engine(draft_config, ctx.plugin_manager)
        draft_vocab = int(self.parts.info.hf_config.vocab_size)
        if abs(draft_vocab - self.vocab_size) > 1024:
            # Padded vocabularies differ by a few hundred ids at most; more means another tokenizer.
            raise ValueError(
                f"speculative.draft_model {cfg.draft_model}: vocabulary of {draft_vocab} ids, the target has "
                f"{self.vocab_size}; the draft must share the target's tokenizer"
            )
        self.draft_vocab = draft_vocab
        self.model = self.parts.model
        self.runner = self.parts.runner
        self.kv = self.parts.kv_cache_manager
        self.max_tokens = draft_config.scheduler.max_num_batched_tokens
        self._states: dict[str, _DraftState] = {}

    # -- protocol ------------------------------------------------------------------------------------------

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            state = self._states.pop(rid, None)
            if state is not None:
                self.kv.free(state.shadow)

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> Proposals:
        token_ids: list[list[int]] = [[] for _ in requests]
        probs: list[torch.Tensor | None] = [None] * len(requests)
        live = [i for i, r in enumerate(requests) if self._prepare(r)]
        if not live:
            return Proposals(token_ids, probs)

        step_probs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        last_logits = self._catch_up(live, requests)
        self._draw(torch.stack([last_logits[i] for i in live]), live, requests, token_ids, step_probs)

        # Draft steps: feed each request's newest draft, one token each, until it has max_drafts.
        for j in range(1, max(requests[i].max_drafts for i in live)):
            batch = [i for i in live if requests[i].max_drafts > j]
            seqs = [requests[i].token_ids + token_ids[i] for i in batch]
            computed = [len(requests[i].token_ids) + j - 1 for i in batch]
            logits = self._forward(seqs, computed, [1] * len(batch), batch, requests, len(batch))
            self._draw(logits, batch, requests, token_ids, step_probs)

        for i in live:
            state = self._states[requests[i].req_id]
            state.shadow.num_computed_tokens = len(requests[i].token_ids)
            state.fed = token_ids[i][:-1]
            if not requests[i].sampling_params.greedy:
                probs[i] = torch.stack(step_probs[i])
        return Proposals(token_ids, probs)

    # -- internals -----------------------------------------------------------------------------------------

    def _catch_up(self, live: list[int], requests: list[ProposalRequest]) -> dict[int, torch.Tensor]:
        """Feed each request's verified tokens the draft has not seen; its logits at the last one.

        Forwards of at most `max_num_batched_tokens` tokens, like the target's chunked prefill: a long prompt
        that the target just finished takes several.
        """
        done = {i: self._states[requests[i].req_id].shadow.num_computed_tokens for i in live}
        last: dict[int, torch.Tensor] = {}
        pending = list(live)
        while pending:
            batch: list[tuple[int, int]] = []  # (request index, tokens fed now)
            room = self.max_tokens
            for i in pending:
                if room == 0:
                    break
                take = min(len(requests[i].token_ids) - done[i], room)
                batch.append((i, take))
                room -= take
            batch.sort(key=lambda item: item[1] != 1)  # single tokens first, as the runner requires
            rows = [i for i, _ in batch]
            logits = self._forward(
                [requests[i].token_ids for i in rows], [done[i] for i in rows], [n for _, n in batch], rows,
                requests, sum(1 for _, n in batch if n == 1),
            )
            for j, (i, n) in enumerate(batch):
                done[i] += n
                if done[i] == len(requests[i].token_ids):
                    last[i] = logits[j]
            pending = [i for i in pending if i not in last]
        return last

    def _prepare(self, r: ProposalRequest) -> bool:
        """Bring the request's shadow up to its verified tokens and hold KV slots for this proposal.

        False (nothing proposed this step) when the draft's cache has no room; the request keeps what it has.
        """
        n = len(r.token_ids)
        state = self._states.get(r.req_id)
        if state is None:
            shadow = Request(r.req_id, list(r.token_ids), SamplingParams(max_tokens=None))
            hits, num_hit = self.kv.get_computed_blocks(shadow)
            if self.kv.allocate_slots(shadow, n - num_hit + r.max_drafts - 1, num_hit, hits) is None:
                return False
            shadow.num_computed_tokens = num_hit
            self._states[r.req_id] = _DraftState(shadow)
            return True
        shadow = state.shadow
        known = shadow.num_tokens
        new = r.token_ids[known:]
        # Drafts the target accepted are the same tokens at the same positions: their KV stays valid.
        same = 0
        while same < min(len(state.fed), len(new)) and state.fed[same] == new[same]:
            same += 1
        shadow.prompt_token_ids.extend(new)
        state.fed = []
        shadow.num_computed_tokens = min(shadow.num_computed_tokens + same, n - 1)
        return self.kv.allocate_slots(shadow, n - shadow.num_computed_tokens + r.max_drafts - 1) is not None

    def _forward(
        self,
        seqs: list[list[int]],
        computed: list[int],
        num_sched: list[int],
        rows: list[int],
        requests: list[ProposalRequest],
        num_decodes: int,
    ) -> torch.Tensor:
        """Draft logits [B, target vocab] (float32) at each request's last scheduled position."""
        block_ids = [self.kv.get_block_ids(requests[i].req_id)[0] for i in rows]
        inputs, hidden = self.runner.forward_tokens(seqs, computed, num_sched, block_ids, num_decodes)
        logits = self.model.compute_logits(hidden[inputs.logits_indices[: len(rows)]]).float()
        if self.draft_vocab >= self.vocab_size:
            return logits[:, : self.vocab_size]
        pad = logits.new_full((logits.shape[0], self.vocab_size - self.draft_vocab), float("-inf"))
        return torch.cat([logits, pad], dim=1)

    def _draw(
        self,
        logits: torch.Tensor,
        rows: list[int],
        requests: list[ProposalRequest],
        token_ids: list[list[int]],
        step_probs: dict[int, list[torch.Tensor]],
    ) -> None:
        """One draft token per row: argmax for greedy requests, else a sample of softmax(logits / T) = q."""
        params = [requests[i].sampling_params for i in rows]
        temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=logits.device)
        q = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
        generators = {
            j: generator for j, i in enumerate(rows)
            if (generator := requests[i].generator) is not None and not params[j].greedy
        }
        sampled = exponential_race(q, generators)
        greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool, device=logits.device)
        chosen = torch.where(greedy, logits.argmax(dim=-1), sampled).tolist()
        for j, i in enumerate(rows):
            token_ids[i].append(int(chosen[j]))
            step_probs[i].append(q[j])
