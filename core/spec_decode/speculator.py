"""Speculator: what the model runner holds for speculative decoding (the proposer and its last proposals).

Per step the runner (1) feeds each request's scheduled drafts after its known tokens, (2) hands the logits of
the drafts' positions to `verify`, which emits the accepted drafts plus one token, and (3) asks `propose`
for the next drafts, which go back to the scheduler in ModelRunnerOutput.spec_token_ids. The draft
distributions q stay here (a [k, V] tensor per request is not a message) until the step that verifies them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from pagedllm.sample.sampler import Sampler
from pagedllm.spec_decode.verification import VerifiedTokens, proposal_requests, verify
from pagedllm.worker.request_state import CachedRequestState


class Speculator:
    def __init__(self, proposer: Any, num_speculative_tokens: int, max_model_len: int, vocab_size: int) -> None:
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._draft_probs: dict[str, torch.Tensor] = {}

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """Finished or preempted requests: their proposals (and the proposer's state) are dropped."""
        ids = list(req_ids)
        if not ids:
            return
        for rid in ids:
            self._draft_probs.pop(rid, None)
        self.proposer.remove_requests(ids)

    @staticmethod
    def logits_rows(last_rows: list[int], num_drafts: list[int]) -> list[int]:
        """Flat hidden-state rows to score: each request's last k + 1 scheduled rows (k = its drafts)."""
        return [r for last, k in zip(last_rows, num_drafts, strict=True) for r in range(last - k, last + 1)]

    def verify(
        self,
        sampler: Sampler,
        logits: torch.Tensor,
        states: Sequence[CachedRequestState],
        drafts: Sequence[list[int]],
    ) -> VerifiedTokens:
        """Verify each request's scheduled `drafts` (a prefix of what was proposed) against the logits of
        `logits_rows`, with the distributions they were drawn from."""
        probs = []
        for state, draft in zip(states, drafts, strict=True):
            q = self._draft_probs.pop(state.req_id, None) if draft else None
            probs.append(None if q is None else q[: len(draft)])
        return verify(sampler, logits, states, drafts, probs, self.vocab_size)

    def propose(self, states: Sequence[CachedRequestState]) -> dict[str, list[int]]:
        """Drafts for the next step of each request that just got tokens (none near its length limits)."""
        requests = proposal_requests(states, self.num_speculative_tokens, self.max_model_len)
        if not requests:
            return {}
        proposals = self.proposer.propose(requests)
        out: dict[str, list[int]] = {}
        for req, ids, probs in zip(requests, proposals.token_ids, proposals.probs, strict=True):
            ids = list(ids[: req.max_drafts])
            if not ids:
                continue
            if probs is None and len(ids) < req.max_drafts:
                # NOTE: a deterministic proposal (n-gram) shorter than allowed is padded by repeating its last
                # token. Any draft is a valid guess (verification keeps the output exact); a full-length one
                # makes the step uniform (k + 1 tokens per request), which replays a CUDA graph instead of
                # running eagerly (cuda_graphs.py NOTE 3). At small batches the extra rows cost ~nothing.
                ids += [ids[-1]] * (req.max_drafts - len(ids))
            out[req.req_id] = ids
            if probs is not None:
                self._draft_probs[req.req_id] = probs
            else:
                self._draft_probs.pop(req.req_id, None)
        return out
