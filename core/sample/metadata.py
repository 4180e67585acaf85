"""SamplingMetadata: one step's sampling controls for the whole batch, as tensors the Sampler can vectorise over.

Each optional feature is stored as `None` (and a `no_*` flag set) when no row in the batch uses it, so a batch
of plain requests pays for nothing but a softmax and a draw.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pagedllm.sample.logits_processor import LogitsBatch
from pagedllm.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Per-step batch tensors for the Sampler; rows follow the order of the logits.

    Rows that do not use a feature hold its neutral value (top_k = vocab size, top_p = 1, min_p = 0,
    penalties 0 / 0 / 1), so one vectorised op serves a mixed batch.
    """

    # [B] float32; greedy rows hold 1.0 so the division by temperature never meets a zero.
    temperature: torch.Tensor
    # [B] bool: rows that take the argmax instead of a random draw.
    greedy_mask: torch.Tensor
    all_greedy: bool
    all_random: bool

    top_k: torch.Tensor | None  # [B] int64, None when no_top_k
    top_p: torch.Tensor | None  # [B] float32, None when no_top_p
    min_p: torch.Tensor | None  # [B] float32, None when no_min_p
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool

    # [B] float32 each, None when no_penalties.
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    # [B, L] int64, padded with vocab_size (an id one past the vocabulary, dropped after scattering).
    # Only rows with a penalty carry ids; the others are all padding.
    prompt_token_ids: torch.Tensor | None
    output_token_ids: torch.Tensor | None
    no_penalties: bool

    # Row index -> that request's own generator (seeded requests only); other rows share the default one.
    generators: dict[int, torch.Generator]
    # Largest `logprobs` asked for in the batch; None when no row wants logprobs.
    max_num_logprobs: int | None

    # (rows, token ids) whose logits are forced to -inf because the request has not reached min_tokens;
    # None when no row is below its min_tokens.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None

    vocab_size: int

    # [B, V] bool, True where a token is *not* allowed (rows without allowed_token_ids are all False); None
    # when no row restricts its tokens. Fixed per request, so a steady batch reuses it.
    allowed_token_ids_mask: torch.Tensor | None = None
    # (rows, token ids, biases) added to the logits (OpenAI's logit_bias); None when no row has a bias.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (rows, token ids) banned this step because a bad word's prefix was just generated (single-token bad
    # words always); None when nothing is banned.
    bad_words_mask: tuple[torch.Tensor, torch.Tensor] | None = None

    # The rows' params and token lists (references, no copies) for logits processors.
    logits_batch: LogitsBatch | None = None

    # What the per-row params tensors were built from (held, so the identities stay unique): `build(reuse=)`
    # keeps them when the next step samples the same requests in the same order.
    source_params: list[SamplingParams] = field(default_factory=list, repr=False, compare=False)
    source_generators: list[torch.Generator | None] = field(default_factory=list, repr=False, compare=False)
    source_device: torch.device | None = field(default=None, repr=False, compare=False)
    # Rows with min_tokens > 0 (the only ones the per-step min_tokens mask can hold).
    min_tokens_rows: list[int] = field(default_factory=list, repr=False, compare=False)
    # Rows with bad words (the only ones the per-step bad-words mask can hold).
    bad_words_rows: list[int] = field(default_factory=list, repr=False, compare=False)

    @property
    def no_token_edits(self) -> bool:
        """True when no row restricts, bans or biases tokens (allowed_token_ids, bad_words, logit_bias,
        min_tokens): the logits reach the penalties untouched."""
        return (self.allowed_token_ids_mask is None and self.logit_bias is None and self.bad_words_mask is None
                and self.min_tokens_mask is None)

    @property
    def batch_size(self) -> int:
        """Number of rows (requests) in this step."""
        return int(self.temperature.shape[0])

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
        reuse: SamplingMetadata | None = None,
    ) -> SamplingMetadata:
        """Gather the batch's per-request params into tensors on `device`.

        :param params: one SamplingParams per row, in logits order.
        :param generators: one per row; a request with a seed passes its own generator (kept across steps,
            on `device`), others pass None.
        :param prompt_token_ids: the prompt of each row (only read for rows with a repetition penalty).
        :param output_token_ids: tokens generated so far for each row (penalties and min_tokens).
        :param vocab_size: the width of the logits (ids >= it are ignored).
        :param reuse: the previous step's metadata: when it was built from the very same params and generator
            objects in the same order (a steady decode batch), its per-row params tensors are reused and only
            what depends on the tokens (penalty ids, the min_tokens mask) is rebuilt. Rebuilding them costs
            ~10 passes over the batch in Python per step (~1 ms at 500 rows).
        """
        n = len(params)
        assert len(generators) == n and len(prompt_token_ids) == n and len(output_token_ids) == n
        if (
            reuse is not None
            and len(reuse.source_params) == n
            and reuse.vocab_size == vocab_size
            and reuse.source_device == device
            and all(map(operator.is_, reuse.source_params, params))
            and all(map(operator.is_, reuse.source_generators, generators))
        ):
            return reuse._with_tokens(prompt_token_ids, output_token_ids, device)

        greedy = [p.greedy for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)

        def f32(values: list[float]) -> torch.Tensor:
            return to_device(values, torch.float32, device)

        temperature = f32([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)])
        greedy_mask = to_device(greedy, torch.bool, device)

        # NOTE(1): greedy rows never reach the random path's filters, so they do not switch those on.
        def uses(pred: list[bool]) -> bool:
            return any(u and not g for u, g in zip(pred, greedy, strict=True))

        ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        no_top_k = not uses([k < vocab_size for k in ks])
        no_top_p = not uses([p.top_p < 1.0 for p in params])
        no_min_p = not uses([p.min_p > 0.0 for p in params])

        no_penalties = not any(_has_penalty(p) for p in params)
        presence = frequency = repetition = None
        if not no_penalties:
            presence = f32([p.presence_penalty for p in params])
            frequency = f32([p.frequency_penalty for p in params])
            repetition = f32([p.repetition_penalty for p in params])

        wanted = [p.logprobs for p in params if p.logprobs is not None]
        # One pass finds the rows that restrict, bias or ban tokens; a batch without any builds nothing more.
        edit_rows = [i for i, p in enumerate(params) if p.allowed_token_ids or p.logit_bias or p.bad_words_token_ids]
        static = cls(
            temperature=temperature,
            greedy_mask=greedy_mask,
            all_greedy=all_greedy,
            all_random=all_random,
            top_k=None if no_top_k else to_device(ks, torch.int64, device),
            top_p=None if no_top_p else f32([p.top_p for p in params]),
            min_p=None if no_min_p else f32([p.min_p for p in params]),
            no_top_k=no_top_k,
            no_top_p=no_top_p,
            no_min_p=no_min_p,
            presence_penalties=presence,
            frequency_penalties=frequency,
            repetition_penalties=repetition,
            prompt_token_ids=None,
            output_token_ids=None,
            no_penalties=no_penalties,
            # Greedy rows draw nothing, so their generators are left untouched.
            generators={i: g for i, g in enumerate(generators) if g is not None and not greedy[i]},
            max_num_logprobs=max(wanted) if wanted else None,
            min_tokens_mask=None,
            vocab_size=vocab_size,
            source_params=list(params),
            source_generators=list(generators),
            source_device=device,
            min_tokens_rows=[i for i, p in enumerate(params) if p.min_tokens > 0],
            allowed_token_ids_mask=_allowed_mask(params, edit_rows, vocab_size, device) if edit_rows else None,
            logit_bias=_logit_bias(params, edit_rows, vocab_size, device) if edit_rows else None,
            bad_words_rows=[i for i in edit_rows if params[i].bad_words_token_ids],
        )
        return static._with_tokens(prompt_token_ids, output_token_ids, device)

    def _with_tokens(
        self, prompt_token_ids: list[list[int]], output_token_ids: list[list[int]], device: torch.device
    ) -> SamplingMetadata:
        """This metadata's params tensors with the parts that depend on the rows' tokens built for this step."""
        params, vocab_size = self.source_params, self.vocab_size
        prompt_ids = output_ids = None
        if not self.no_penalties:
            has_penalty = [_has_penalty(p) for p in params]
            # NOTE(2): the prompt matters only to the repetition penalty; rows without one send no ids.
            prompt_ids = _pad(
                [
                    ids if h and p.repetition_penalty != 1.0 else []
                    for ids, h, p in zip(prompt_token_ids, has_penalty, params, strict=True)
                ],
                vocab_size,
                device,
            )
            output_ids = _pad(
                [ids if h else [] for ids, h in zip(output_token_ids, has_penalty, strict=True)],
                vocab_size,
                device,
            )

        rows: list[int] = []
        cols: list[int] = []
        for i in self.min_tokens_rows:
            p = params[i]
            if len(output_token_ids[i]) < p.min_tokens:
                stops = sorted(t for t in p.all_stop_token_ids | p.min_tokens_stop_ids if 0 <= t < vocab_size)
                rows.extend([i] * len(stops))
                cols.extend(stops)
        min_tokens_mask = None
        if rows:
            min_tokens_mask = (
                to_device(rows, torch.int64, device),
                to_device(cols, torch.int64, device),
            )
        bad_words_mask = None
        if self.bad_words_rows:
            bad_words_mask = _bad_words_mask(self.bad_words_rows, params, output_token_ids, vocab_size, device)
        return replace(
            self,
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            min_tokens_mask=min_tokens_mask,
            bad_words_mask=bad_words_mask,
            logits_batch=LogitsBatch(list(params), output_token_ids, prompt_token_ids),
        )


def _allowed_mask(
    params: list[SamplingParams], rows_to_check: list[int], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """[B, V] True where a row with allowed_token_ids may not sample (vLLM's allowed_token_ids_mask)."""
    restricted = [i for i in rows_to_check if params[i].allowed_token_ids]
    if not restricted:
        return None
    rows: list[int] = []
    cols: list[int] = []
    for i in restricted:
        ids = [t for t in params[i].allowed_token_ids or () if 0 <= t < vocab_size]
        rows.extend([i] * len(ids))
        cols.extend(ids)
    allowed = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)
    has_list = torch.zeros(len(params), 1, dtype=torch.bool, device=device)
    has_list[to_device(restricted, torch.int64, device)] = True
    allowed[to_device(rows, torch.int64, device), to_device(cols, torch.int64, device)] = True
    return has_list & ~allowed


def _logit_bias(
    params: list[SamplingParams], rows_to_check: list[int], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    cols: list[int] = []
    biases: list[float] = []
    for i in rows_to_check:
        p = params[i]
        if p.logit_bias:
            for tid, bias in p.logit_bias.items():
                if 0 <= tid < vocab_size:
                    rows.append(i)
                    cols.append(tid)
                    biases.append(float(bias))
    if not rows:
        return None
    return (to_device(rows, torch.int64, device), to_device(cols, torch.int64, device),
            to_device(biases, torch.float32, device))


def _bad_words_mask(
    rows_with_words: list[int], params: list[SamplingParams], output_token_ids: list[list[int]], vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The tokens each row must not sample now: a bad word's last token when the tokens before it are the
    row's latest outputs (vLLM V1's apply_bad_words; only generated tokens count, not the prompt)."""
    rows: list[int] = []
    cols: list[int] = []
    for i in rows_with_words:
        past = output_token_ids[i]
        for word in params[i].bad_words_token_ids:
            prefix_len = len(word) - 1
            if prefix_len > len(past) or not 0 <= word[-1] < vocab_size:
                continue
            if prefix_len == 0 or past[-prefix_len:] == word[:-1]:
                rows.append(i)
                cols.append(word[-1])
    if not rows:
        return None
    return to_device(rows, torch.int64, device), to_device(cols, torch.int64, device)


def _has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _pad(rows: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """Right-pad ragged id lists into one [B, max_len] int64 tensor (at least one column)."""
    width = max(1, max((len(r) for r in rows), default=0))
    padded = [r + [pad_id] * (width - len(r)) for r in rows]
    return to_device(padded, torch.int64, device)


def to_device(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`, without waiting for the GPU.

    NOTE: `torch.tensor(values, device="cuda")` copies from pageable memory and then synchronizes the stream,
    i.e. waits for every kernel queued so far -- with async scheduling, the whole next forward. A pinned
    staging tensor and a non-blocking copy keep the host free (the caching host allocator keeps the staging
    memory alive until the copy has run).
    """
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t if device.type == "cpu" else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
