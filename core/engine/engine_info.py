"""What a built engine is: the public summary tools and plugins read instead of the engine's internals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.builder import EngineParts


@dataclass(frozen=True)
class EngineInfo:
    """One engine's model, limits, KV layout and chosen components (`LLM.engine_info()`)."""

    model_ref: str  # the resolved model reference (a folder or a file)
    config: EngineConfig  # the resolved engine config
    hf_config: Any  # the model's config (LoadedModelInfo.hf_config: a ModelConfig or a transformers config)
    tokenizer: Any  # None for a checkpoint without one
    device: str
    dtype: str  # e.g. "bfloat16"
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    components: dict[str, str]  # selection key ("loader", "attention", "kv_manager", ...) -> the chosen name

    @classmethod
    def of(cls, parts: EngineParts) -> EngineInfo:
        return cls(
            model_ref=parts.model_ref, config=parts.config, hf_config=parts.info.hf_config,
            tokenizer=parts.info.tokenizer, device=str(parts.device),
            dtype=str(parts.dtype).removeprefix("torch."), block_size=parts.block_size,
            num_kv_blocks=parts.num_blocks, max_model_len=parts.max_model_len,
            components={key: sel.winner.name for key, sel in parts.selections.items()},
        )
