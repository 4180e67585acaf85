"""Sampler: turns one step's logits into one token per row (plus optional logprobs), vectorised over the batch.

Order of operations (as vLLM V1):

    raw logits ──► logprobs (log_softmax, only if some row asked)           reported to the user
        │
        ├─ allowed_token_ids: every other token -> -inf
        ├─ bad_words: a bad word's last token -> -inf when its prefix was just generated
        ├─ logit_bias: + bias (OpenAI's, in logit space)
        ├─ min_tokens: stop and EOS ids -> -inf for rows below min_tokens
        ├─ logits processors (plugins named in the config's `logits_processors`, in that order)
        ├─ penalties:  repetition (prompt+output), frequency + presence (output)
        │
        ├─ greedy rows ─► argmax
        └─ random rows ─► / temperature ─► min_p ─► top_k + top_p (one sort) ─► softmax ─► exponential race

The returned token ids stay on the logits' device: the caller decides when to sync (one `.tolist()` per step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.engine.messages import LogprobsEntry
from pagedllm.sample.greedy_argmax import greedy_argmax
from pagedllm.sample.logits_processor import LogitsProcessor, apply_logits_processors
from pagedllm.sample.metadata import SamplingMetadata

_NEG_INF = float("-inf")


@dataclass
class LogprobsTensors:
    """Logprobs of one step, column 0 = the sampled token, columns 1..N = the top-N of the raw distribution.

    N is the batch's largest request; `to_entries` trims each row to what its own request asked for.
    """

    token_ids: torch.Tensor  # [B, N+1] int64
    logprobs: torch.Tensor  # [B, N+1] float32
    ranks: torch.Tensor  # [B, N+1] int64, 1-based

    def to_entries(self, num_per_row: list[int | None]) -> list[LogprobsEntry | None]:
        """One LogprobsEntry per row with that row's N (None where the request wants no logprobs)."""
        # One device->host copy per tensor, then plain list slicing.
        ids, lps, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        assert len(num_per_row) == len(ids)
        entries: list[LogprobsEntry | None] = []
        for i, n in enumerate(num_per_row):
            if n is None:
                entries.append(None)
                continue
            entries.append(
                LogprobsEntry(token_ids=ids[i][: n + 1], logprobs=lps[i][: n + 1], ranks=ranks[i][: n + 1])
            )
        return entries


@dataclass
class SamplerOutput:
    """What one step of sampling produced."""

    sampled_token_ids: torch.Tensor  # [B] int64, on the logits' device
    logprobs: LogprobsTensors | None


class Sampler:
    """Stateless: everything per-request lives in SamplingMetadata (generators carry the seeded state).

    `logits_processors` are the engine's configured processors, fixed at construction (the builder makes the
    runner's sampler with them: engine/runner_plugins.py); none by default, which costs nothing.
    """

    def __init__(self, logits_processors: Sequence[LogitsProcessor] = ()) -> None:
        self.logits_processors: tuple[LogitsProcessor, ...] = tuple(logits_processors)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` [B, V] (any float dtype). `logits` itself is not modified."""
        assert logits.dim() == 2 and logits.shape[0] == metadata.batch_size
        if metadata.all_greedy and metadata.max_num_logprobs is None and metadata.no_penalties and (
            not self.logits_processors
        ) and metadata.logit_bias is None:
            # NOTE(2): the argmax of bf16 logits is the argmax of their float32 copy (the conversion is exact
            # and keeps order and ties), so a greedy batch skips the copy -- a [B, V] write and read: 0.18 ms
            # of a 24 ms decode step at 500 requests x 128k vocab on the H200. The -inf masks (min_tokens,
            # allowed_token_ids, bad_words) are exact too; a logit bias is not, so it takes the float path.
            # NOTE(3): a wide vocabulary's argmax runs chunked in one launch (greedy_argmax.py), same index.
            if logits.device.type == "cpu" and _only_min_tokens(metadata):
                return SamplerOutput(sampled_token_ids=_greedy_under_min_tokens(logits, metadata), logprobs=None)
            return SamplerOutput(sampled_token_ids=greedy_argmax(self.process(logits, metadata)), logprobs=None)
        logits = logits.float()
        # Logprobs describe the model's own distribution, before any penalty or filter (vLLM's default).
        raw_logprobs = None if metadata.max_num_logprobs is None else torch.log_softmax(logits, dim=-1)

        sampled = self.sample(self.process(logits, metadata), metadata)

        logprobs = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def process(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Token restrictions, logits processors and penalties: the logits greedy rows take the argmax of.

        `logits` itself is not modified. Speculative verification calls this too, so its target
        distribution is the one plain sampling draws from.
        """
        if not metadata.no_token_edits:
            logits = apply_token_edits(logits, metadata)
        if self.logits_processors:
            # A copy, so processors may edit in place while the caller's logits stay untouched.
            logits = apply_logits_processors(logits.clone(), self.logits_processors, metadata.logits_batch)
        return apply_penalties(logits, metadata)

    @staticmethod
    def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy rows: argmax. Random rows: temperature, min_p, top-k/top-p, then an exponential race."""
        greedy = None if metadata.all_random else greedy_argmax(logits)
        if greedy is not None and metadata.all_greedy:
            return greedy
        random = exponential_race(sampling_probs(logits, metadata), metadata.generators)
        return random if greedy is None else torch.where(metadata.greedy_mask, greedy, random)


def sampling_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows draw from: temperature, min_p, top-k/top-p, softmax (greedy rows: T=1)."""
    logits = logits / metadata.temperature.unsqueeze(1)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    if metadata.top_k is not None or metadata.top_p is not None:
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    return logits.softmax(dim=-1)


def apply_token_edits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """allowed_token_ids, bad_words, logit_bias, then min_tokens (vLLM V1's order); a new tensor."""
    neg_inf = torch.full((), _NEG_INF, dtype=logits.dtype, device=logits.device)
    if metadata.allowed_token_ids_mask is not None:
        logits = logits.masked_fill(metadata.allowed_token_ids_mask, _NEG_INF)
    if metadata.bad_words_mask is not None:
        logits = logits.index_put(metadata.bad_words_mask, neg_inf)
    if metadata.logit_bias is not None:
        rows, cols, biases = metadata.logit_bias
        logits = logits.index_put((rows, cols), biases.to(logits.dtype), accumulate=True)
    return apply_min_tokens(logits, metadata)


def _only_min_tokens(metadata: SamplingMetadata) -> bool:
    """min_tokens is the batch's one token edit (greedy rows, no processors or penalties: the caller's test)."""
    return (metadata.min_tokens_mask is not None and metadata.allowed_token_ids_mask is None
            and metadata.bad_words_mask is None and metadata.logit_bias is None)


def _greedy_under_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """argmax of apply_min_tokens(logits) without its [B, V] copy: the plain argmax, then the rows whose pick is a
    forbidden token again on a masked copy of those rows only. Forbidding tokens cannot move a pick that is not
    one of them (it stays the first maximum), so the indices are the masked argmax's. The CPU's path: the check
    reads the picks back, a device sync elsewhere."""
    assert metadata.min_tokens_mask is not None
    tokens = greedy_argmax(logits)
    rows, cols = metadata.min_tokens_mask
    hit = rows[tokens[rows] == cols].unique()
    if hit.numel():
        masked = logits[hit]
        keep = torch.isin(rows, hit)
        masked[torch.searchsorted(hit, rows[keep]), cols[keep]] = _NEG_INF
        tokens[hit] = masked.argmax(dim=-1)
    return tokens


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Forbid stop tokens (and EOS, even with ignore_eos) for rows that have not yet produced min_tokens."""
    if metadata.min_tokens_mask is None:
        return logits
    return logits.index_put(metadata.min_tokens_mask, torch.full((), _NEG_INF, dtype=logits.dtype, device=logits.device))


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty over prompt+output tokens, then frequency and presence penalties over output tokens.

    Repetition (CTRL paper): a seen token's logit is divided by the penalty when positive and multiplied when
    negative, so a penalty > 1 always makes it less likely. Frequency subtracts penalty * count, presence
    subtracts penalty once per seen token (OpenAI's definitions).
    """
    if metadata.no_penalties:
        return logits
    assert metadata.prompt_token_ids is not None and metadata.output_token_ids is not None
    assert metadata.repetition_penalties is not None
    assert metadata.frequency_penalties is not None and metadata.presence_penalties is not None
    batch, vocab = logits.shape
    # Padding ids equal `vocab`: they land in an extra column that is sliced off.
    out_ids = metadata.output_token_ids
    out_counts = torch.zeros(batch, vocab + 1, dtype=logits.dtype, device=logits.device)
    out_counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
    out_counts = out_counts[:, :vocab]
    out_seen = out_counts > 0
    prompt_seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=logits.device)
    prompt_seen.scatter_(1, metadata.prompt_token_ids, True)
    seen = prompt_seen[:, :vocab] | out_seen

    scale = torch.where(seen, metadata.repetition_penalties.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    logits = logits - metadata.frequency_penalties.unsqueeze(1) * out_counts
    return logits - metadata.presence_penalties.unsqueeze(1) * out_seen.to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's k most likely tokens, then the smallest top set whose mass (after top-k) is >= p.

    One ascending sort serves both. `k` in [1, V] (V = off); `p` in (0, 1] (1 = off). Tokens tied with the
    k-th logit are all kept.
    """
    sorted_logits, order = logits.sort(dim=-1)
    vocab = logits.shape[1]
    if k is not None:
        # Ascending order: the k-th largest sits at column V - k.
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if p is not None:
        # Cumulative mass from the least likely end: a token goes while everything up to and including it
        # fits inside the 1 - p that may be discarded.
        tail_mass = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = tail_mass <= (1.0 - p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample one index per row from `probs` as argmax(probs / E), E ~ Exponential(1) i.i.d.

    Equivalent to torch.multinomial but without its device sync, and each seeded row's noise comes from its
    own generator alone, so a seeded request draws the same tokens whatever shares its batch.
    """
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()  # unseeded rows share the default generator
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    # NOTE(1): a draw of exactly 0 would make 0/0 = NaN for a masked token, and argmax prefers NaN;
    # flooring the noise keeps masked tokens at 0 and costs one pass.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return probs.div(noise).argmax(dim=-1)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, sampled: torch.Tensor) -> LogprobsTensors:
    """Column 0: the sampled token's logprob and rank; columns 1..N: the top-N tokens (ranks 1..N)."""
    num_logprobs = min(num_logprobs, logprobs.shape[1])  # asking for more than the vocabulary gets all of it
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    token_logprobs = logprobs.gather(-1, sampled.unsqueeze(-1))
    # Rank = how many tokens are at least as likely (ties count against the sampled token, as vLLM).
    token_ranks = (logprobs >= token_logprobs).sum(dim=-1, keepdim=True)
    top_ranks = torch.arange(1, num_logprobs + 1, device=logprobs.device).expand(logprobs.shape[0], -1)
    return LogprobsTensors(
        token_ids=torch.cat([sampled.unsqueeze(-1), top_ids], dim=1),
        logprobs=torch.cat([token_logprobs, top_logprobs], dim=1),
        ranks=torch.cat([token_ranks, top_ranks], dim=1),
    )
