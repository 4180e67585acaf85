"""NgramProposer: speculative drafts by prompt lookup (no model, no state, nothing on the device).

For the context's last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`, find where the same
n tokens occurred earlier and propose the tokens that followed them. It pays off where outputs copy their
inputs: code edits, summaries quoting the source, extraction. Proposals are deterministic, so q is one-hot
and rejection sampling accepts a draft with the target's own probability of it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedllm.api.spec_decode import ProposalRequest, Proposals, ProposerContext


class NgramProposer:
    def __init__(self, ctx: ProposerContext) -> None:
        self.min_n = ctx.config.prompt_lookup_min
        self.max_n = ctx.config.prompt_lookup_max

    def propose(self, requests: list[ProposalRequest]) -> Proposals:
        ids = [ngram_lookup(r.token_ids, self.min_n, self.max_n, r.max_drafts) for r in requests]
        return Proposals(ids, [None] * len(requests))

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """Stateless: nothing to forget."""


def ngram_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest matching suffix n-gram.

    Longer n-grams are tried first (a longer match predicts better). Among a suffix's earlier occurrences
    the most recent one with k tokens after it wins (recent text predicts best); when none has k, the
    earliest (the longest continuation). An occurrence may overlap the suffix but not be it.
    """
    length = len(tokens)
    if length < 2 or k < 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows of arr[:-1] start at 0 .. length-1-n: every n-gram that ends before the last token.
        windows = sliding_window_view(arr[:-1], n)
        starts = np.flatnonzero((windows == arr[length - n :]).all(axis=1))
        if starts.size == 0:
            continue
        follow = starts + n  # where each occurrence's continuation begins
        full = follow[follow + k <= length]
        begin = int(full[-1]) if full.size else int(follow[0])
        return arr[begin : begin + k].tolist()
    return []
