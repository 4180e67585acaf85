"""Light, frozen descriptions of what a component must serve: the context each kind's check() receives.

A registration's `check(context) -> list[str]` is called with the context of its kind (the selector passes
what the engine builder hands it); these names type it. All are read-only for the check: the frozen
dataclasses and specs cannot be assigned, the config sections are seen through protocols of read-only
properties (the engine passes the config's own section, which satisfies them), and the quantization config
through a `Mapping`.

    kind                  check() receives                              type
    attention_backend     the layer shapes, dtypes and device            AttentionSelectionContext
    kv_manager            one KV-cache group's spec                      KVManagerCheckContext (= KVCacheSpec)
    scheduler             the config's `scheduler` section               SchedulerCheckContext
    loader                the model reference (a path or alias)          LoaderCheckContext (= str)
    quantization          the checkpoint's quantization_config, or None  QuantizationCheckContext
    proposer              the config's `speculative` section             ProposerCheckContext
    executor              the config's `parallel` section                ExecutorCheckContext
    structured_output     one request's constraint                       StructuredOutputCheckContext
    kv_connector          the engine's device, KV groups, world size      KVConnectorCheckContext
    model, entrypoint, logits_processor, command                         None

Light on purpose (typing only, no torch, no pydantic): registration modules import these through
`pagedllm.api` while `pagedllm plugins` must stay fast.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from pagedllm.kv_cache.spec import KVCacheSpec
from pagedllm.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class AttentionSelectionContext:
    """What an attention backend's check() (and `priority_for`) receives: the model's attention needs here."""

    device_type: str  # "cpu" or "cuda"
    compute_capability: tuple[int, int] | None  # None off CUDA
    dtype: str  # "float32", "float16", "bfloat16"
    kv_cache_dtype: str  # "auto" (= dtype) or e.g. "fp8_e4m3"
    head_size: int
    block_size: int
    sliding_window: bool = False
    logits_soft_cap: bool = False
    cuda_graphs: bool = False
    # Learned per-head attention sinks in the softmax (AttentionLayerConfig.sinks; gpt-oss).
    sinks: bool = False
    # Chunked local attention layers (AttentionLayerConfig.attention_chunk_size; Llama 4).
    chunked_local: bool = False
    # Whether the model promises its float reference's numerics (a dense model: greedy tokens equal to
    # transformers' in float32). False for a quantized model (the engine's quantization method is not
    # `none`, e.g. a GGUF file kept quantized), whose weights already differ from any float reference: a
    # backend that sums in another order than torch may then take float32 too.
    exact_reference: bool = True


# A KV manager's check() receives the spec of the KV-cache group it would hold (frozen dataclasses); only
# managers registered with a `spec_type` in the spec's MRO are asked.
KVManagerCheckContext: TypeAlias = KVCacheSpec

# A loader's check() receives the model reference: a folder, a file or an alias, as the config names it.
LoaderCheckContext: TypeAlias = str

# A quantization method's check() receives the checkpoint's `quantization_config` (as in config.json; read-only),
# or None for a checkpoint without one.
QuantizationCheckContext: TypeAlias = Mapping[str, Any] | None

# A structured-output backend's check() receives one request's constraint (vLLM's StructuredOutputsParams):
# a reason against it (a Lark grammar xgrammar cannot parse, a JSON-schema feature one backend lacks) sends the
# request to the next backend by priority. Read-only for the check.
StructuredOutputCheckContext: TypeAlias = StructuredOutputsParams


@dataclass(frozen=True)
class KVConnectorCheckContext:
    """What a KV connector's check() receives: the facts of the engine it would serve."""

    device: str  # "cpu" or "cuda"
    num_kv_groups: int  # KV-cache groups (one block table each)
    kv_spec_types: tuple[str, ...]  # each group's KVCacheSpec class name ("FullAttentionSpec", "MambaSpec", ...)
    world_size: int  # tensor x pipeline parallel ranks
    enable_prefix_caching: bool  # block hashes exist only with prefix caching


class SchedulerCheckContext(Protocol):
    """What a scheduler's check() receives: the config's `scheduler` section, read-only."""

    @property
    def name(self) -> str:
        """The scheduler plugin the config names."""
        ...

    @property
    def max_num_seqs(self) -> int:
        """Most requests in one step."""
        ...

    @property
    def max_num_batched_tokens(self) -> int:
        """Token budget of one step."""
        ...

    @property
    def enable_chunked_prefill(self) -> bool:
        """Whether long prompts may be split across steps."""
        ...

    @property
    def max_waiting(self) -> int | None:
        """Bound on queued requests (None: unbounded)."""
        ...

    @property
    def admission_headroom_tokens(self) -> int:
        """KV slots kept free for the running requests' growth when a waiting request is admitted."""
        ...

    @property
    def async_scheduling(self) -> bool | None:
        """Schedule step N+1 while step N runs (None: the engine decides)."""
        ...


class ExecutorCheckContext(Protocol):
    """What an executor's check() receives: the config's `parallel` section, read-only."""

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks that split every layer, one process each."""
        ...

    @property
    def pipeline_parallel_size(self) -> int:
        """Stages that split the decoder layers, each of tensor_parallel_size ranks."""
        ...

    @property
    def data_parallel_size(self) -> int:
        """Independent engine replicas behind one frontend."""
        ...

    @property
    def executor(self) -> str | None:
        """The executor the config names (None: chosen by priority among those whose check passes)."""
        ...


class ProposerCheckContext(Protocol):
    """What a speculative-decoding proposer's check() receives: the config's `speculative` section, read-only."""

    @property
    def method(self) -> str | None:
        """The proposer the config names."""
        ...

    @property
    def num_speculative_tokens(self) -> int:
        """Tokens proposed per request per step (k)."""
        ...

    @property
    def prompt_lookup_min(self) -> int:
        """ngram: the shortest suffix n-gram looked up."""
        ...

    @property
    def prompt_lookup_max(self) -> int:
        """ngram: the longest suffix n-gram looked up (tried first)."""
        ...

    @property
    def draft_model(self) -> str | None:
        """draft: the folder of a smaller model sharing the tokenizer."""
        ...

    @property
    def draft_load_format(self) -> str | None:
        """draft: its loader plugin (None: by path)."""
        ...


if TYPE_CHECKING:
    # The config sections the engine passes satisfy the protocols: a renamed or retyped field fails here.
    from pagedllm.config import ParallelConfig, SchedulerConfig, SpeculativeConfig

    def _conforms(s: SchedulerConfig, p: ParallelConfig, q: SpeculativeConfig) -> None:
        _s: SchedulerCheckContext = s
        _p: ExecutorCheckContext = p
        _q: ProposerCheckContext = q
