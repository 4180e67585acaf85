"""The runner's half of speculative decoding: score the drafts, verify them, and ask for the next ones.

Layout of one request with k drafts in the step's flat logits (rows come from the target's single forward):

    scheduled:   t_{n-1}  d_0  d_1 ... d_{k-1}        (t_{n-1}: its last known token; n = known tokens)
    row r + j:   p_j scores the token after t_{n-1}, d_0..d_{j-1}        j = 0..k   (k + 1 rows)

Every row gets the request's sampling controls as if d_0..d_{j-1} were already output (penalties and
min_tokens see them, logits processors get them in `output_token_ids`), because that is the only case in
which row j's token is ever emitted. Requests without drafts have one row (k = 0) and the same rule reduces
to ordinary sampling, so a mixed batch is verified in one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.engine.messages import LogprobsEntry
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.rejection_sampler import draw_randoms, rejection_sample
from pagedllm.sample.sampler import Sampler, gather_logprobs, sampling_probs
from pagedllm.spec_decode.proposer import ProposalRequest
from pagedllm.worker.request_state import CachedRequestState


@dataclass
class VerifiedTokens:
    """Per request: the tokens emitted (accepted drafts, then one more) and their logprobs if asked for."""

    token_ids: list[list[int]]
    logprobs: list[list[LogprobsEntry] | None]
    num_accepted: list[int]


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    states: Sequence[CachedRequestState],
    drafts: Sequence[list[int]],
    draft_probs: Sequence[torch.Tensor | None],
    vocab_size: int,
) -> VerifiedTokens:
    """Verify every request's drafts against `logits` ([sum(k_i + 1), V], laid out as above)."""
    logits = logits.float()  # compute_logits may return the model's dtype; acceptance compares probabilities
    device = logits.device
    counts = [len(d) for d in drafts]
    batch, k_max = len(states), max(counts, default=0)

    # One metadata row per logits row: the request's params, its outputs extended by the drafts before it.
    row_params, row_prompts, row_outputs = [], [], []
    for state, draft in zip(states, drafts, strict=True):
        for j in range(len(draft) + 1):
            row_params.append(state.sampling_params)
            row_prompts.append(state.prompt_token_ids)
            row_outputs.append(state.output_token_ids + draft[:j] if j else state.output_token_ids)
    metadata = SamplingMetadata.build(
        row_params, [None] * len(row_params), row_prompts, row_outputs, vocab_size, device
    )
    raw_logprobs = None if metadata.max_num_logprobs is None else torch.log_softmax(logits, dim=-1)
    processed = sampler.process(logits, metadata)

    # Padded [B, K + 1] view: position j of request b is flat row starts[b] + min(j, k_b).
    starts = [0]
    for c in counts[:-1]:
        starts.append(starts[-1] + c + 1)
    index = torch.tensor(
        [[start + min(j, c) for j in range(k_max + 1)] for start, c in zip(starts, counts, strict=True)],
        dtype=torch.int64, device=device,
    )
    target_argmax = processed.argmax(dim=-1)[index]
    greedy = torch.tensor([s.sampling_params.greedy for s in states], dtype=torch.bool, device=device)
    target_probs = None if metadata.all_greedy else sampling_probs(processed, metadata)[index]

    draft_ids = torch.tensor([d + [0] * (k_max - len(d)) for d in drafts], dtype=torch.int64, device=device)
    q = _stack_draft_probs(draft_probs, draft_ids, counts, k_max, vocab_size, device)
    generators = {
        b: s.generator for b, s in enumerate(states) if s.generator is not None and not s.sampling_params.greedy
    }
    uniforms, noise = draw_randoms(counts, vocab_size, generators, device)
    out = rejection_sample(
        draft_ids, torch.tensor(counts, dtype=torch.int64, device=device), target_argmax, target_probs, q,
        greedy, uniforms, noise,
    )
    # The step's one device->host sync: accepted counts ride along as the last column.
    both = torch.cat([out.token_ids, out.num_accepted.unsqueeze(1)], dim=1).tolist()
    rows, accepted = [r[:-1] for r in both], [r[-1] for r in both]
    tokens = [row[: a + 1] for row, a in zip(rows, accepted, strict=True)]

    logprobs: list[list[LogprobsEntry] | None] = [None] * batch
    if raw_logprobs is not None:
        assert metadata.max_num_logprobs is not None
        wanted = [b for b, s in enumerate(states) if s.sampling_params.logprobs is not None]
        flat_rows = [starts[b] + j for b in wanted for j in range(accepted[b] + 1)]
        flat_ids = [t for b in wanted for t in tokens[b]]
        lp = gather_logprobs(
            raw_logprobs[flat_rows], metadata.max_num_logprobs, torch.tensor(flat_ids, device=device)
        )
        entries = lp.to_entries([states[b].sampling_params.logprobs for b in wanted for _ in tokens[b]])
        pos = 0
        for b in wanted:
            n = len(tokens[b])
            logprobs[b] = [e for e in entries[pos : pos + n] if e is not None]
            pos += n
    return VerifiedTokens(tokens, logprobs, accepted)


def _stack_draft_probs(
    probs: Sequence[torch.Tensor | None], draft_ids: torch.Tensor, counts: list[int], k_max: int, vocab: int,
    device: torch.device,
) -> torch.Tensor | None:
    """[B, K, V] q for the rejection sampler; None when every proposal is deterministic (one-hot)."""
    if k_max == 0 or all(p is None for p in probs):
        return None
    q = torch.zeros(len(probs), k_max, vocab, dtype=torch.float32, device=device)
    for b, (p, c) in enumerate(zip(probs, counts, strict=True)):
        if not c:
            continue
        if p is None:  # a deterministic proposal (e.g. a greedy draft) in a batch with sampled ones: one-hot
            q[b, torch.arange(c, device=device), draft_ids[b, :c]] = 1.0
        else:
            q[b, :c] = p[:c].to(device=device, dtype=torch.float32)
    return q


def proposal_requests(
    states: Sequence[CachedRequestState], num_speculative_tokens: int, max_model_len: int
) -> list[ProposalRequest]:
    """What to ask the proposer for each request that just got tokens: at most k drafts, fewer near the end.

    The next step schedules positions n-1 .. n-1+k, so n + k <= max_model_len; and it emits at most k + 1
    tokens, so k < the tokens still allowed by max_tokens (more drafts could never be used).
    """
    out = []
    for s in states:
        n = s.num_tokens
        k = min(num_speculative_tokens, max_model_len - n)
        max_tokens = s.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - len(s.output_token_ids) - 1)
        if k >= 1:
            out.append(ProposalRequest(s.req_id, s.token_ids, k, s.sampling_params, s.generator))
    return out
