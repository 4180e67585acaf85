"""What the model runner remembers about each request between steps."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[list[int]]  # per KV-cache group
    num_computed_tokens: int
    # An encoder-decoder model's encoder prompt (its encoder runs in the request's first step: encoder_inputs.py).
    encoder_prompt_token_ids: list[int] | None = None
    # prompt + output, kept alongside: building it every step cost O(length) per request (~8 ms per step at
    # 512 requests of ~600 tokens). Grow outputs through `append_outputs` so the two stay in step.
    _all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._all_token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def token_ids(self) -> list[int]:
        """Prompt then outputs (the live list: read it, do not change it)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    def append_outputs(self, token_ids: list[int]) -> None:
        """Record tokens this step emitted."""
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    def append_output(self, token_id: int) -> int:
        """Record one emitted token; returns its index in `output_token_ids`."""
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        return len(self.output_token_ids) - 1

    def replace_last_outputs(self, token_ids: list[int]) -> None:
        """Overwrite the last len(token_ids) outputs (a tensor-parallel rank adopting rank 0's sample)."""
        n = len(token_ids)
        if n:
            self.output_token_ids[-n:] = token_ids
            self._all_token_ids[-n:] = token_ids

    def set_output(self, index: int, token_id: int) -> None:
        """Write output `index` (a placeholder of a pipelined step, model_runner.py NOTE 1)."""
        self.output_token_ids[index] = token_id
        self._all_token_ids[len(self.prompt_token_ids) + index] = token_id
