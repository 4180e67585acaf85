"""pagedllm.api.spec_decode: What a speculative-decoding proposer plugin builds on: its context, requests and proposals.

Part of the plugin API (docs/plugins/api.md): covered by PLUGIN_API_VERSION.
"""

from __future__ import annotations

from pagedllm.sample.sampler import exponential_race
from pagedllm.spec_decode.proposer import ProposalRequest, Proposals, ProposerContext

__all__ = [
    "ProposalRequest",
    "Proposals",
    "ProposerContext",
    "exponential_race",
]
