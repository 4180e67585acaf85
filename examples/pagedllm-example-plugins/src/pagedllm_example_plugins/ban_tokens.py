"""A logits processor that bans token ids: from the config for every request, and per request.

    plugins: {ban_tokens: {token_ids: [13, 42]}}            every request
    SamplingParams(extra_args={"ban_token_ids": [7]})       this request only

Vectorised: one index_put per step for the whole batch, no per-row device work.
"""

from __future__ import annotations

import torch

from pagedllm.api.sched import LogitsBatch, LogitsProcessorContext


class BanTokensProcessor:
    def __init__(self, ctx: LogitsProcessorContext) -> None:
        ids = [t for t in ctx.config.token_ids if 0 <= t < ctx.vocab_size]
        self.vocab_size = ctx.vocab_size
        self.global_ids = torch.tensor(ids, dtype=torch.int64, device=ctx.device)

    def apply(self, logits: torch.Tensor, batch: LogitsBatch) -> torch.Tensor:
        if self.global_ids.numel():
            logits[:, self.global_ids] = float("-inf")
        rows: list[int] = []
        cols: list[int] = []
        for i in range(len(batch.params)):
            for t in batch.extra_args(i).get("ban_token_ids", ()):
                if 0 <= t < self.vocab_size:
                    rows.append(i)
                    cols.append(t)
        if rows:
            index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
            logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))
        return logits
