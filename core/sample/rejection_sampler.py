"""Rejection sampling for speculative decoding: keep the target's output distribution exactly.

For one request with drafts d_0..d_{k-1} proposed from distributions q_0..q_{k-1}, and the target's
distributions p_0..p_k at the same positions (p_j scores the token after d_0..d_{j-1}):

    j = 0, 1, ...:  accept d_j with probability min(1, p_j(d_j) / q_j(d_j))       (u_j * q_j(d_j) < p_j(d_j))
    first rejection at j = a:  emit d_0..d_{a-1}, then one token from norm(max(0, p_a - q_a))  (recovered)
    all k accepted (a = k):    emit d_0..d_{k-1}, then one token from p_k                       (bonus)

Each emitted token is then distributed exactly as if it had been sampled from the target alone (Leviathan et
al. 2023, Chen et al. 2023). A deterministic proposer (n-gram lookup) has one-hot q: accept with p_j(d_j),
recover from p_a with d_a removed. Greedy rows need no randomness: accept while d_j == argmax p_j, then
emit argmax p_a. Every request emits between 1 and k + 1 tokens.

NOTE(1): one exponential noise vector per request serves whichever position emits the final token. Only one
position ever uses it, and which one (a) depends on the uniforms alone, so given a the draw is an exact
sample of that position's distribution (argmax(dist / E) with E ~ Exp(1) i.i.d. samples from norm(dist)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_ID = -1  # fills the token rows past what a request emitted


@dataclass
class RejectionOutput:
    """Per request (row): the emitted tokens, left-aligned and padded with PAD_ID, and how many drafts won."""

    token_ids: torch.Tensor  # [B, K + 1] int64
    num_accepted: torch.Tensor  # [B] int64, in [0, num_drafts]


def draw_randoms(
    num_drafts: list[int], vocab: int, generators: dict[int, torch.Generator], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms [B, K] for the accept tests and exponential noise [B, V] for the final token (NOTE 1).

    K = max(num_drafts). A seeded row draws from its own generator alone, exactly its own num_drafts
    uniforms and then V noise values, so it gets the same tokens whatever else shares the batch (with no
    drafts that is the plain Sampler's draw, so steps with and without drafts continue one stream); other
    rows share the default generator.
    """
    batch, k = len(num_drafts), max(num_drafts, default=0)
    uniforms = torch.empty(batch, k, device=device)
    noise = torch.empty(batch, vocab, device=device)
    if len(generators) < batch:
        uniforms.uniform_()
        noise.exponential_()
    for row, generator in generators.items():
        uniforms[row, : num_drafts[row]].uniform_(generator=generator)
        noise[row].exponential_(generator=generator)
    # A draw of exactly 0 would give 0/0 = NaN for a zero-probability token, and argmax prefers NaN.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return uniforms, noise


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    target_argmax: torch.Tensor,
    target_probs: torch.Tensor | None,
    draft_probs: torch.Tensor | None,
    greedy: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> RejectionOutput:
    """Verify a padded batch of drafts; see the module docstring for the rule.

    :param draft_token_ids: [B, K] int64; row b's first num_drafts[b] entries are its drafts (rest: any id).
    :param num_drafts: [B] int64, each in [0, K].
    :param target_argmax: [B, K + 1] int64, argmax of the target's (processed) logits at each position.
    :param target_probs: [B, K + 1, V] float32 target distributions after temperature / top-k / top-p, or
        None when every row is greedy.
    :param draft_probs: [B, K, V] the distributions the drafts were drawn from, or None when every draft is
        deterministic (one-hot q).
    :param greedy: [B] bool, rows verified by argmax.
    :param uniforms: [B, K] in [0, 1); noise: [B, V] Exp(1) draws (see draw_randoms).
    """
    batch, k = draft_token_ids.shape
    device = draft_token_ids.device
    rows = torch.arange(batch, device=device)
    positions = torch.arange(k, device=device)
    valid = positions.unsqueeze(0) < num_drafts.unsqueeze(1)

    accept = draft_token_ids == target_argmax[:, :k]
    if target_probs is not None and k:
        ids = draft_token_ids.clamp(min=0).unsqueeze(-1)
        p_draft = target_probs[:, :k].gather(-1, ids).squeeze(-1)
        q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs.gather(-1, ids).squeeze(-1)
        # u < p/q written without the division (q > 0 for a token drawn from q); strict, so p = 0 never wins.
        accept = torch.where(greedy.unsqueeze(1), accept, uniforms * q_draft < p_draft)
    accept &= valid
    # Leading run of acceptances: everything after the first rejection is discarded.
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)

    final = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    if target_probs is not None:
        p_final = target_probs[rows, num_accepted]  # [B, V]: p_a (recovery) or p_k (bonus)
        dist = p_final
        if k:
            rejected = num_accepted < num_drafts
            at = num_accepted.clamp(max=k - 1)
            if draft_probs is None:
                q_final = torch.zeros_like(p_final)
                q_final[rows, draft_token_ids[rows, at].clamp(min=0)] = 1.0
            else:
                q_final = draft_probs[rows, at]
            residual = (p_final - q_final).clamp(min=0.0)
            # A rejection implies p(d) < q(d), so the residual has mass; the guard only covers rounding.
            usable = rejected & (residual.sum(dim=-1) > 0)
            dist = torch.where(usable.unsqueeze(1), residual, p_final)
        sampled = dist.div(noise).argmax(dim=-1)
        final = torch.where(greedy, final, sampled)

    token_ids = torch.full((batch, k + 1), PAD_ID, dtype=torch.int64, device=device)
    token_ids[:, :k] = torch.where(positions.unsqueeze(0) < num_accepted.unsqueeze(1), draft_token_ids, PAD_ID)
    token_ids[rows, num_accepted] = final
    return RejectionOutput(token_ids, num_accepted)
