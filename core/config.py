"""EngineConfig: the whole engine assembled from one file (YAML or TOML), with overrides on top.

Every section forbids unknown keys, so a typo fails loudly with the dotted key named instead of being
ignored. Plugins are chosen by name here; `None` means "let the selector decide".

Precedence, lowest first: defaults < the file < environment variables `PAGEDLLM_<SECTION>__<KEY>` (e.g.
`PAGEDLLM_SCHEDULER__MAX_NUM_SEQS=8`, `PAGEDLLM_MODEL=...`; values parsed as YAML scalars) < command-line
flags / `--set` / `LLM(...)` keyword arguments. A plugin's own section `plugins.<name>` is validated by the
pydantic model it registers (`config_model=`), see `validate_plugin_sections`. Keys that name a component
(`COMPONENT_KEYS`) are checked against the installed plugins by `check_component_names`, which the CLI runs
before it builds anything.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class AttentionConfig(_Section):
    """Which attention backend runs the model's attention layers."""

    backend: str | None = Field(None, description="attention backend plugin name; None = auto-select")


class KVCacheConfigSection(_Section):
    """The paged KV cache: block size, how many blocks, prefix caching."""

    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    num_blocks: int | None = Field(None, ge=2, description="force the number of blocks (overrides memory)")
    memory_gb: float = Field(
        1.0, gt=0, description="KV-cache budget on CPU (GiB); unset: sized from the machine's available memory "
        "and max_num_seqs, at least 1.0 (platform/cpu_sizing.py)",
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1.0, description="fraction of GPU memory to use")
    enable_prefix_caching: bool = Field(True, description="reuse the KV blocks of shared prompt prefixes")
    cache_dtype: str = Field(
        "auto",
        description="KV-cache element type: 'auto' = the model dtype; 'fp8' (= 'fp8_e4m3') stores K and V as "
        "float8_e4m3fn with a per-tensor scale, doubling the tokens a 16-bit cache holds",
    )
    disable_sliding_window: bool = Field(
        False,
        description="keep every block of sliding-window layers (treat them as full attention for memory; "
        "the window is still applied); for comparing memory use",
    )

    @field_validator("cache_dtype")
    @classmethod
    def _cache_dtype(cls, v: str) -> str:
        # One spelling downstream: the selection context and the backends' checks see 'fp8_e4m3'.
        name = v.strip().lower()
        name = _CACHE_DTYPE_ALIASES.get(name, name)
        if name not in _CACHE_DTYPES:
            raise ValueError(f"'{v}' is not a KV-cache dtype; use auto, fp8 (fp8_e4m3), float16, bfloat16 or float32")
        return name


_CACHE_DTYPES = ("auto", "fp8_e4m3", "float16", "bfloat16", "float32")
_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "half": "float16", "bf16": "bfloat16"}


class SchedulerConfig(_Section):
    """Which scheduler plugin decides each step's batch, and its limits."""

    name: str = Field("fcfs", description="scheduler plugin name")
    max_num_seqs: int = Field(
        64, ge=1, description="most requests in one step (on the CPU, unset: 64 per physical core within 64..256, "
        "bounded by the memory: platform/cpu_sizing.py)",
    )
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="token budget of one step (on the CPU, unset: 1024 per physical core within "
        "2048..4096)",
    )
    enable_chunked_prefill: bool = Field(True, description="split long prompts across steps within the token budget")
    max_waiting: int | None = Field(None, ge=1, description="bound on queued requests (None: unbounded)")
    admission_headroom_tokens: int = Field(
        256,
        ge=0,
        description="KV slots kept free for the running requests' next tokens when a waiting request is admitted: "
        "each may grow by up to this many more tokens (or its max_tokens, if fewer) before admission takes blocks it "
        "would need; 0 = admit while blocks are free (vLLM's rule, which then preempts and recomputes as they grow)",
    )
    async_scheduling: bool | None = Field(
        None,
        description="schedule and prepare step N+1 while the GPU runs step N (vLLM's async scheduling); "
        "None = on for CUDA (any tensor_parallel_size) without speculative decoding, off otherwise",
    )


class LoaderConfig(_Section):
    """Which loader plugin reads the model (by default chosen from the model path)."""

    name: str | None = Field(None, description="loader plugin name (hf, gguf, dummy); None = by model path")
    seed: int = Field(0, description="seed for dummy weights")


class QuantizationSection(_Section):
    """Quantization method (by default the checkpoint's own)."""

    method: str | None = Field(None, description="force a quantization method; None = from the checkpoint")


class ParallelConfig(_Section):
    """How many processes serve the model: tensor-parallel ranks per replica, data-parallel replicas."""

    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks that split every layer (heads, MLP columns, vocabulary); one process each"
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, description="stages that split the decoder layers (each stage tensor_parallel_size ranks; world "
        "size tp x pp); stage s sends its hidden state and residual to stage s + 1, the last samples"
    )
    pp_layer_partition: list[int] | None = Field(
        None, description="decoder layers per pipeline stage, e.g. [3, 5] (vLLM's VLLM_PP_LAYER_PARTITION); None "
        "= even, the remainder on the stages before the last"
    )
    data_parallel_size: int = Field(1, ge=1, description="independent engine replicas behind one frontend (Ray)")
    executor: str | None = Field(
        None, description="executor plugin (uniproc, multiproc, ray); None = uniproc at tp x pp 1, else multiproc"
    )

    @field_validator("pp_layer_partition", mode="before")
    @classmethod
    def _partition_from_text(cls, v: Any) -> Any:
        # vLLM's VLLM_PP_LAYER_PARTITION spelling, "3,5" (as PAGEDLLM_PARALLEL__PP_LAYER_PARTITION=3,5 gives it).
        if isinstance(v, str):
            try:
                return [int(part) for part in v.split(",")]
            except ValueError:
                raise ValueError(f"expected layer counts such as '3,5' or [3, 5], got {v!r}") from None
        return v

    @property
    def world_size(self) -> int:
        """Ranks per replica: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


class SpeculativeConfig(_Section):
    """Speculative decoding: a proposer plugin guesses tokens, the target verifies them in one pass.

    Off while `method` is None. The output distribution is the target's exactly (rejection sampling), so
    these settings change speed only, never what is generated.
    """

    method: str | None = Field(None, description="proposer plugin name (ngram, draft); None = off")
    num_speculative_tokens: int = Field(3, ge=1, le=64, description="tokens proposed per request per step (k)")
    prompt_lookup_min: int = Field(1, ge=1, description="ngram: shortest suffix n-gram to look up")
    prompt_lookup_max: int = Field(4, ge=1, validate_default=True, description="ngram: longest suffix n-gram to look up (tried first)")
    draft_model: str | None = Field(None, description="draft: folder of a smaller model sharing the tokenizer")
    draft_load_format: str | None = Field(None, description="draft: loader plugin name; None = by path")

    @field_validator("prompt_lookup_max")
    @classmethod
    def _lookup_range(cls, v: int, info: ValidationInfo) -> int:
        # A field validator (not a model one) so the error names speculative.prompt_lookup_max.
        low = info.data.get("prompt_lookup_min")
        if low is not None and v < low:
            raise ValueError(f"must be >= prompt_lookup_min ({low})")
        return v

    @field_validator("draft_model")
    @classmethod
    def _expand_draft(cls, v: str | None) -> str | None:
        return os.path.expanduser(v) if v else v


class StructuredOutputsConfig(_Section):
    """Structured outputs (JSON schema, regex, choice, grammar): the backend plugin and its grammar compiler."""

    backend: str | None = Field(
        None, description="structured-output backend plugin (xgrammar, llguidance) for every request; None = "
        "per request, the highest-priority backend that supports its constraint (a request's own `backend` wins)",
    )
    disable_any_whitespace: bool = Field(
        False, description="JSON constraints allow no whitespace between tokens (vLLM's engine-wide "
        "disable_any_whitespace; a request may also set it): compact output, and a weak model cannot pad forever",
    )
    compile_threads: int = Field(2, ge=1, description="threads compiling grammars off the step loop")
    cache_size: int = Field(256, ge=1, description="compiled grammars kept, by constraint (least recently used out)")


class KVTransferConfig(_Section):
    """KV blocks beyond the device pool (vLLM's KVTransferConfig): the KV-connector plugin, if any."""

    kv_connector: str | list[str] | None = Field(
        None, description="KV-connector plugin (e.g. tiered: host-memory and disk tiers under the prefix cache; "
        "its options in `plugins.<name>`), or a list of them stacked: a prefix hit comes from the one holding the "
        "longest, the earlier on a tie (kv_cache/connector_stack.py); None = no connector",
    )

    @field_validator("kv_connector")
    @classmethod
    def _a_stack_of_distinct_connectors(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list):
            if not value:
                raise ValueError("an empty list names no connector: leave the key unset (null) for none")
            twice = sorted({name for name in value if value.count(name) > 1})
            if twice:
                raise ValueError(f"lists {', '.join(twice)} more than once: each connector of a stack is one "
                                 "plugin with one `plugins.<name>` section")
        return value


class ObservabilityConfig(_Section):
    """What the engine reports beyond /metrics (vLLM's ObservabilityConfig)."""

    otlp_traces_endpoint: str | None = Field(
        None, description="OTLP collector for OpenTelemetry traces of every request (tracing.py: spans queue, "
        "prefill, decode, detokenize); needs pagedllm[tracing]; the protocol is OTEL_EXPORTER_OTLP_TRACES_PROTOCOL "
        "(grpc, the default, or http/protobuf); None = no tracing",
    )


class EngineConfig(_Section):
    model: str | None = Field(None, description="model folder, .gguf file or alias; None = embedded default")
    tokenizer: str | None = Field(None, description="tokenizer folder; None = the model's own")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="auto: on the CPU bfloat16 where it has AMX-BF16 or AVX512-BF16, else float32 "
        "(GGUF kept quantized: float32; platform/cpu_compute.py); the checkpoint's half type on GPU",
    )
    cpu_kernels: Literal["auto", "quantized", "bf16", "int8"] = Field(
        "auto",
        description="GGUF weights kept quantized on the CPU: 'quantized' = gguf_cpu.c at every size (prefill and "
        "batches dequantize each matrix to float32 per call); 'bf16' = products of >= 8 rows run a bf16 GEMM on a "
        "bf16 copy of the weights made at load (smaller decode batches stay on the C kernels; refused when the copy would take more "
        "than half the available memory), faster but near-tied greedy tokens may flip; 'int8' = products of >= 2 rows run "
        "an int8 GEMM (AVX512-VNNI; activations rounded to int8 per 32, as llama.cpp does) on an int8 copy, faster "
        "again but flips more near-tied tokens; auto: bf16 where the CPU has bf16 units, else quantized "
        "(platform/cpu_compute.py NOTE 3, 4)",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")
    seed: int = Field(0, description="engine seed (dummy weights, unseeded sampling)")
    max_model_len: int | None = Field(None, ge=1, description="context length cap; None = the model's")
    num_threads: int | None = Field(
        None, ge=1, description="torch CPU threads (None: one per physical core this process may run on, unless "
        "OMP_NUM_THREADS is set)",
    )
    enforce_eager: bool = Field(False, description="never capture CUDA graphs (decode runs eagerly)")
    fused_ops: bool = Field(
        True,
        description="on CUDA, run RMSNorm(+residual), rotary and SiLU/GELU-and-mul as fused Triton kernels; on "
        "the CPU, for GGUF weights kept quantized, those and decode attention as C kernels (false: the torch "
        "ops, for A/B runs; the dense CPU path always uses torch)",
    )
    dense_gemv: bool = Field(
        True,
        description="on CUDA, dense 16-bit linears and the LM head run a Triton split-K GEMV at decode sizes "
        "(<= 4 rows, shapes where the H200 sweep found it faster than cuBLAS: core/layers/dense_gemv.py; W3 "
        "4.86 -> 4.24 ms/token there); false: always cuBLAS",
    )
    gated_gemm: bool = Field(
        False,
        description="on CUDA (sm_90+), a dense [gate | up] layer's prompt-sized products (>= 2048 rows) run one "
        "Triton GEMM with SiLU/GELU-and-mul in its epilogue instead of cuBLAS then the activation kernel "
        "(plugins/quantization/unquantized/gated_gemm.py); off: on the H200 it ran 0.94x of cuBLAS + the activation at 16,384 rows",
    )
    compile_ahead: bool = Field(
        True,
        description="on CUDA, build the Triton kernels start-up will launch (profiling step, graph capture, "
        "warm-up) on a thread pool before launching any (layers/compile_ahead.py); false: each compiles where "
        "it is first launched, one after another",
    )
    gc_threshold: int | None = Field(
        50_000,
        ge=1,
        description="Python's young-generation GC threshold while an engine runs (Python's default is 700: at "
        "hundreds of requests that collected several times per step, with full collections stalling the GPU); "
        "null keeps the process's setting; restored at shutdown",
    )
    cuda_graph_sizes: list[int] | None = Field(
        None, description="padded decode batch sizes to capture; None = 1,2,4,8..64 step 8, then step 32"
    )
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    kv_cache: KVCacheConfigSection = Field(default_factory=KVCacheConfigSection)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    loader: LoaderConfig = Field(default_factory=LoaderConfig)
    quantization: QuantizationSection = Field(default_factory=QuantizationSection)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputsConfig = Field(default_factory=StructuredOutputsConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    kv_transfer: KVTransferConfig = Field(default_factory=KVTransferConfig)
    logits_processors: list[str] = Field(
        default_factory=list,
        description="logits processor plugins to run, in order, before penalties and temperature",
    )
    # Sections owned by plugins, keyed by component name; validated by the model the plugin registers.
    plugins: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per-plugin sections, `plugins.<component name>.<key>`"
    )

    @field_validator("model")
    @classmethod
    def _expand(cls, v: str | None) -> str | None:
        return os.path.expanduser(v) if v else v

    def to_process_dict(self) -> dict[str, Any]:
        """Every value, for another process's `model_validate`, less the sections' keys left unset at their
        defaults: a dump of every key would make each one look set there, and on the CPU an unset batch or KV
        size is sized from the machine (platform/cpu_sizing.py) while a set one is taken as given."""
        return _dump_keeping_unset(self)

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        overrides: dict[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> EngineConfig:
        """Load YAML or TOML, then environment overrides, then dotted `overrides` ({"scheduler.max_num_seqs": 8})."""
        data = read_config_file(path)
        return cls.from_dict(data, overrides, source=str(path), env=env)

    @classmethod
    def from_dict(
        cls,
        data: dict[str, Any],
        overrides: dict[str, Any] | None = None,
        source: str = "config",
        env: Mapping[str, str] | None = None,
    ) -> EngineConfig:
        """Validate `data` with `PAGEDLLM_*` environment overrides (from `env`, default os.environ) and then
        `overrides` applied on top."""
        merged = _deep_copy(data)
        from_env = env_overrides(os.environ if env is None else env)
        origins: dict[str, str] = {}
        for dotted, (var, value) in from_env.items():
            _set_dotted(merged, dotted, value)
            origins[dotted] = f"environment {var}"
        for dotted, value in (overrides or {}).items():
            _set_dotted(merged, dotted, value)
            origins[dotted] = "an override"
        try:
            return cls.model_validate(merged)
        except ValidationError as exc:
            raise ConfigError(_explain(exc, source, origins)) from None


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


ENV_PREFIX = "PAGEDLLM_"
# PAGEDLLM_* variables that are settings of their own, not config keys.
_ENV_RESERVED = {"PAGEDLLM_PLUGINS", "PAGEDLLM_LOG_LEVEL", "PAGEDLLM_CPU_FLAGS"}


def env_overrides(env: Mapping[str, str]) -> dict[str, tuple[str, Any]]:
    """Dotted key -> (variable, value) for every `PAGEDLLM_<SECTION>__<KEY>` (or top-level `PAGEDLLM_<KEY>`).

    `__` separates levels (a single `_` is part of a name: `MAX_NUM_SEQS`), names are lower-cased, values are
    YAML scalars (`8` -> int, `false` -> bool, `[1, 2]` -> list). A variable without `__` counts only when it
    names a top-level key, so unrelated `PAGEDLLM_*` settings are left alone; one with `__` is always a key,
    and an unknown one fails validation naming the variable.
    """
    import yaml

    out: dict[str, tuple[str, Any]] = {}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in _ENV_RESERVED:
            continue
        parts = var[len(ENV_PREFIX):].lower().split("__")
        if len(parts) == 1 and (parts[0] not in EngineConfig.model_fields or parts[0] == "plugins"):
            continue
        if any(not p for p in parts):
            continue
        raw = env[var]
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        out[".".join(parts)] = (var, value)
    return out


def validate_plugin_sections(config: EngineConfig, models: Mapping[str, type[BaseModel]]) -> dict[str, Any]:
    """Validate each `plugins.<name>` section with the pydantic model registered for `name`.

    Returns name -> validated model instance (plain dict for sections without a model); a used plugin
    whose section is absent gets its model's defaults from `plugin_section`. Errors name
    `plugins.<name>.<key>`; a section no installed plugin claims only warns (the plugin may be uninstalled
    while the config still mentions it, and an unused section harms nothing).
    """
    validated: dict[str, Any] = {}
    lines: list[str] = []
    for name, section in config.plugins.items():
        model = models.get(name)
        if model is None:
            warnings.warn(f"config section plugins.{name}: no installed plugin declares it; ignored",
                          RuntimeWarning, stacklevel=2)
            validated[name] = dict(section)
            continue
        try:
            validated[name] = model.model_validate(section)
        except ValidationError as exc:
            lines += _explain(exc, "", {}, prefix=f"plugins.{name}.").splitlines()[1:]
    if lines:
        raise ConfigError("invalid plugin config:\n" + "\n".join(lines))
    return validated


def plugin_section(sections: Mapping[str, Any], name: str, models: Mapping[str, type[BaseModel]]) -> Any:
    """The validated section for `name`, or its model's defaults (or {}) when the config has none."""
    if name in sections:
        return sections[name]
    model = models.get(name)
    if model is None:
        return {}
    try:
        return model.model_validate({})
    except ValidationError as exc:
        raise ConfigError("invalid plugin config:\n" + "\n".join(
            _explain(exc, "", {}, prefix=f"plugins.{name}.").splitlines()[1:])) from None


def _explain(exc: ValidationError, source: str, origins: Mapping[str, str], prefix: str = "") -> str:
    lines = [f"invalid {source}:"]
    for err in exc.errors():
        key = prefix + (".".join(str(p) for p in err["loc"]) or "<root>")
        # Say when the bad value came from an override, not the file: the user would search the file in vain.
        origin = next((f" [from {o}]" for k, o in origins.items() if key == k or key.startswith(k + ".")), "")
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


def _dump_keeping_unset(model: BaseModel, top: bool = True) -> dict[str, Any]:
    """model_dump(), less each section key that is unset and still equal to its default (a top-level key,
    or a value changed in place, is always kept: nothing but the defaults' unset-ness is dropped)."""
    out: dict[str, Any] = {}
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out[name] = _dump_keeping_unset(value, top=False)
        elif top or name in model.model_fields_set or value != info.get_default(call_default_factory=True):
            out[name] = model.model_dump(include={name})[name]
    return out


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
        "disable_sliding_window": "kv_cache.disable_sliding_window",
        "max_num_seqs": "scheduler.max_num_seqs",
        "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
        "enable_chunked_prefill": "scheduler.enable_chunked_prefill",
        "admission_headroom_tokens": "scheduler.admission_headroom_tokens",
        "async_scheduling": "scheduler.async_scheduling",
        "scheduler_name": "scheduler.name",
        "attention_backend": "attention.backend",
        "load_format": "loader.name",
        "loader_name": "loader.name",
        "quantization": "quantization.method",
        "speculative_method": "speculative.method",
        "num_speculative_tokens": "speculative.num_speculative_tokens",
        "draft_model": "speculative.draft_model",
        "prompt_lookup_min": "speculative.prompt_lookup_min",
        "prompt_lookup_max": "speculative.prompt_lookup_max",
        "tensor_parallel_size": "parallel.tensor_parallel_size",
        "pipeline_parallel_size": "parallel.pipeline_parallel_size",
        "pp_layer_partition": "parallel.pp_layer_partition",
        "data_parallel_size": "parallel.data_parallel_size",
        "distributed_executor_backend": "parallel.executor",
        "structured_outputs_config": "structured_outputs",  # vLLM's StructuredOutputsConfig keyword
        "kv_transfer_config": "kv_transfer",  # vLLM's KVTransferConfig keyword
        "otlp_traces_endpoint": "observability.otlp_traces_endpoint",
    }
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key == "load_format" and value == "auto":
            continue
        if key == "trust_remote_code":
            refuse_remote_code(value)
            continue
        if key == "speculative_config":
            out.update({f"speculative.{k}": v for k, v in speculative_from_vllm(value).items()})
            continue
        out[routes.get(key, key)] = value
    return out


def refuse_remote_code(value: Any) -> None:
    """vLLM's `trust_remote_code`: False is what pagedllm always does; True is refused, saying why."""
    if value:
        raise ConfigError(
            "trust_remote_code: pagedllm never runs model code shipped in a checkpoint; architectures come from "
            "model plugins (`pagedllm plugins` lists them; docs/plugins/model.md says how to add one)"
        )


# vLLM's speculative_config keys that are spelled differently here (method values too).
_VLLM_SPECULATIVE_KEYS = {"model": "draft_model"}
_VLLM_SPECULATIVE_METHODS = {"draft_model": "draft"}


def speculative_from_vllm(spec: Any) -> dict[str, Any]:
    """vLLM's `speculative_config` dict (or its JSON text) as this config's `speculative` section keys.

    `{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}` maps one to one; `model` is
    `draft_model`, and a `model` without a `method` (or method `draft_model`) means the `draft` proposer.
    Keys this engine lacks stay as they are, so validation names them (`speculative.<key>`).
    """
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"speculative_config: not valid JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"speculative_config: expected a dict (or its JSON), got {type(spec).__name__}")
    out: dict[str, Any] = {_VLLM_SPECULATIVE_KEYS.get(str(k), str(k)): v for k, v in spec.items()}
    method = out.get("method")
    if method is None and out.get("draft_model"):
        out["method"] = "draft"
    elif isinstance(method, str):
        out["method"] = _VLLM_SPECULATIVE_METHODS.get(method, method)
    return out
