"""EngineConfig: the whole engine assembled from one file (YAML or TOML), with CLI overrides on top.

Every section forbids unknown keys, so a typo fails loudly with the dotted key named instead of being
ignored. Plugins are chosen by name here; `None` means "let the selector decide".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class AttentionConfig(_Section):
    backend: str | None = Field(None, description="attention backend plugin name; None = auto-select")


class KVCacheConfigSection(_Section):
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    num_blocks: int | None = Field(None, ge=2, description="force the number of blocks (overrides memory)")
    memory_gb: float = Field(1.0, gt=0, description="KV-cache budget on CPU (GiB)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1.0, description="fraction of GPU memory to use")
    enable_prefix_caching: bool = True
    cache_dtype: str = Field("auto", description="'auto' = the model dtype")


class SchedulerConfig(_Section):
    name: str = Field("fcfs", description="scheduler plugin name")
    max_num_seqs: int = Field(64, ge=1, description="most requests in one step")
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget of one step")
    enable_chunked_prefill: bool = True
    max_waiting: int | None = Field(None, ge=1, description="bound on queued requests (None: unbounded)")


class LoaderConfig(_Section):
    name: str | None = Field(None, description="loader plugin name (hf, gguf, dummy); None = by model path")
    seed: int = Field(0, description="seed for dummy weights")


class QuantizationSection(_Section):
    method: str | None = Field(None, description="force a quantization method; None = from the checkpoint")


class EngineConfig(_Section):
    model: str | None = Field(None, description="model folder, .gguf file or alias; None = embedded default")
    tokenizer: str | None = None
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    max_model_len: int | None = Field(None, ge=1)
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads (None: torch's default)")
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    kv_cache: KVCacheConfigSection = Field(default_factory=KVCacheConfigSection)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    loader: LoaderConfig = Field(default_factory=LoaderConfig)
    quantization: QuantizationSection = Field(default_factory=QuantizationSection)
    # Free-form sections owned by plugins (validated by the plugins that read them).
    plugins: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @field_validator("model")
    @classmethod
    def _expand(cls, v: str | None) -> str | None:
        return os.path.expanduser(v) if v else v

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], overrides: dict[str, Any] | None = None) -> EngineConfig:
        """Load YAML or TOML, then apply dotted `overrides` ({"scheduler.max_num_seqs": 8})."""
        data = read_config_file(path)
        return cls.from_dict(data, overrides, source=str(path))

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], overrides: dict[str, Any] | None = None, source: str = "config"
    ) -> EngineConfig:
        merged = _deep_copy(data)
        for dotted, value in (overrides or {}).items():
            _set_dotted(merged, dotted, value)
        try:
            return cls.model_validate(merged)
        except ValidationError as exc:
            raise ConfigError(_explain(exc, source, set(overrides or ()))) from None


class ConfigError(ValueError):
    """An invalid configuration; the message names each offending key and why."""


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    text = p.read_text()
    try:
        if p.suffix in (".toml", ".tml"):
            import tomllib

            data = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except Exception as exc:
        raise ConfigError(f"config file {p} could not be parsed: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping at the top level, not {type(data).__name__}")
    return data


def _explain(exc: ValidationError, source: str, overridden: set[str]) -> str:
    lines = [f"invalid {source}:"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        # Say when the bad value came from an override, not the file: the user would search the file in vain.
        origin = " [from an override]" if any(key == o or key.startswith(o + ".") for o in overridden) else ""
        if err["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key{origin}")
        else:
            lines.append(f"  {key}: {err['msg']} (got {err.get('input')!r}){origin}")
    return "\n".join(lines)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def _deep_copy(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in data.items()}


def flat_overrides(**kwargs: Any) -> dict[str, Any]:
    """Map LLM(...) keyword arguments to dotted keys: top-level names stay, known shortcuts are routed.

    `LLM(model, max_num_seqs=8, block_size=4, enable_prefix_caching=False)` mirrors vLLM's flat kwargs.
    """
    routes = {
        "block_size": "kv_cache.block_size",
        "num_gpu_blocks_override": "kv_cache.num_blocks",
        "num_kv_blocks": "kv_cache.num_blocks",
        "enable_prefix_caching": "kv_cache.enable_prefix_caching",
        "gpu_memory_utilization": "kv_cache.gpu_memory_utilization",
        "kv_cache_memory_gb": "kv_cache.memory_gb",
        "kv_cache_dtype": "kv_cache.cache_dtype",
        "max_num_seqs": "scheduler.max_num_seqs",
        "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
        "enable_chunked_prefill": "scheduler.enable_chunked_prefill",
        "scheduler_name": "scheduler.name",
        "attention_backend": "attention.backend",
        "load_format": "loader.name",
        "loader_name": "loader.name",
        "quantization": "quantization.method",
    }
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key == "load_format" and value == "auto":
            continue
        out[routes.get(key, key)] = value
    return out
