"""pagedllm's torch attention backend, counting each step's tokens and requests.

`build_metadata` runs once per model step, so it is where a backend sees the batch: the counts are kept on
the class (the backend is a class with static methods; the engine never instantiates it).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pagedllm.plugins.attention.torch_sdpa.backend import TorchSDPABackend
from pagedllm.protocols.attention import CommonAttentionMetadata


class StatsTorchBackend(TorchSDPABackend):
    name: ClassVar[str] = "stats_torch"
    tokens_per_step: ClassVar[list[int]] = []
    requests_per_step: ClassVar[list[int]] = []

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata) -> Any:
        StatsTorchBackend.tokens_per_step.append(common.num_actual_tokens)
        StatsTorchBackend.requests_per_step.append(common.num_reqs)
        return TorchSDPABackend.build_metadata(common)

    @classmethod
    def reset(cls) -> None:
        cls.tokens_per_step.clear()
        cls.requests_per_step.clear()
