"""Assembles an engine from an EngineConfig: every component chosen through the plugin selector.

Order: model reference → loader → config/tokenizer → architecture → attention backend → quantization →
model built and loaded → KV specs → KV manager per group → cache sized and allocated → scheduler → the
runner's plugins (logits processors, speculative proposer) → runner → start-up (compile, capture, warm-up).
`build_engine_parts` runs these as named stages, each a function taking and returning small values
(`_ModelSource`, `_Components`, `KVPlan` from kv_plan.py, ...). Each choice is kept as a `Selection`, so `pagedllm config
show` can say what was picked and why.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.config import EngineConfig, plugin_section, validate_plugin_sections
from pagedllm.default_model import resolve_model_reference
from pagedllm.distributed.pp_partition import check_pipeline_parallel
from pagedllm.distributed.shard_check import check_tensor_parallel
from pagedllm.engine.attention_choice import select_attention, select_attention_for_cache
from pagedllm.engine.cpu_sizes import resolve_cpu_sizes
from pagedllm.engine.kv_plan import DTYPES, KVPlan, plan_kv_cache
from pagedllm.engine.runner_plugins import RunnerPlugins, TargetFacts, build_runner_plugins
from pagedllm.engine.thread_load import check_thread_load
from pagedllm.kv_cache.capacity import KVCapacity
from pagedllm.kv_cache.connector_setup import block_axis_of, build_kv_connector
from pagedllm.kv_cache.kv_cache_manager import KVCacheManager
from pagedllm.layers.fused_ops import building
from pagedllm.platform.cpu_compute import (
    available_memory_bytes,
    choose_cpu_kv_cache_dtype,
    choose_gguf_batch_gemm,
    default_num_threads,
    dense_weight_bytes,
    resolve_cpu_dtype,
)
from pagedllm.platform.cpu_features import cpu_features
from pagedllm.plugin_manager import PluginManager, get_plugin_manager
from pagedllm.plugin_spec import PluginKind
from pagedllm.protocols.executor import ExecutorContext
from pagedllm.protocols.loader import LoadedModelInfo
from pagedllm.protocols.model import KernelOptions, ModelBuildContext
from pagedllm.sample.sampler import Sampler
from pagedllm.sched.base import SchedulerContext
from pagedllm.selector import Selection, SelectionError, select
from pagedllm.worker.cuda_graphs import GPURunnerOptions
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm")


@dataclass
class EngineParts:
    config: EngineConfig
    model_ref: str
    info: LoadedModelInfo
    model: Any
    runner: ModelRunner
    scheduler: Any
    kv_cache_manager: KVCacheManager
    max_model_len: int
    num_blocks: int
    block_size: int
    device: torch.device
    dtype: torch.dtype
    selections: dict[str, Selection] = field(default_factory=dict)
    load_seconds: float = 0.0
    executor: Any = None  # runs the model on every tensor-parallel rank (pagedllm.protocols.executor)
    tp_size: int = 1
    capacity: KVCapacity | None = None  # what the KV pool holds, per group (the start-up report)
    # Seconds per start-up phase, in order (model + weights, KV sizing and allocation, graph capture, warm-up):
    # where a slow start goes -- the first process on a machine compiles every Triton kernel it reaches.
    startup_phases: dict[str, float] = field(default_factory=dict)
    # The config's logits processors, in the runner's sampler (runner_plugins.py); rank 0 only.
    logits_processors: list[Any] = field(default_factory=list)
    pipeline_split: str | None = None  # which layers each pipeline stage holds, and why (pp_partition.py)
    # Why the CPU dtype, (GGUF kept quantized) batch GEMM and batch / KV sizes are what they are
    # (platform/cpu_compute.py, platform/cpu_sizing.py).
    compute_notes: tuple[str, ...] = ()

    def describe(self) -> str:
        lines = [f"model: {self.model_ref}", f"device: {self.device}, dtype: {str(self.dtype).removeprefix('torch.')}"]
        if self.compute_notes:
            lines[-1] += f" ({self.compute_notes[0]})"
            lines += list(self.compute_notes[1:])
        lines += [sel.explain() for sel in self.selections.values()]
        lines.append(
            f"kv cache: {self.num_blocks} blocks x {self.block_size} tokens = "
            f"{self.num_blocks * self.block_size} token slots; max_model_len {self.max_model_len}"
        )
        if self.pipeline_split is not None:
            lines.append(self.pipeline_split)
        if self.capacity is not None:
            lines.append(self.capacity.describe(self.max_model_len))
        if self.startup_phases:
            lines.append("start-up: " + ", ".join(f"{k} {v:.1f}s" for k, v in self.startup_phases.items()))
        return "\n".join(lines)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, hf_config: Any, device: torch.device, quantization: str = "none") -> torch.dtype:
    """The model's dtype; on the CPU `auto` follows the processor's bf16 units and the quantization method
    (platform/cpu_compute.py resolve_cpu_dtype, which also says why)."""
    if device.type == "cpu":
        return DTYPES[resolve_cpu_dtype(name, quantization, cpu_features()).value]
    if name != "auto":
        return DTYPES[name]
    cfg_dtype = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    return cfg_dtype if cfg_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def select_loader(pm: PluginManager, config: EngineConfig, model_ref: str) -> Selection:
    return select(pm, PluginKind.LOADER, model_ref, requested=config.loader.name)


def build_engine(
    config: EngineConfig, pm: PluginManager | None = None, *, plugin_sections: Mapping[str, Any] | None = None
) -> EngineParts:
    """The engine core's build: its executor first (remote tensor-parallel ranks start and this process joins
    their group as rank 0), then rank 0's parts; the executor is shut down if anything fails.

    :param plugin_sections: the config's validated `plugins.*` sections (PluginManager.load_config); validated
        here when not given.
    """
    pm = pm or get_plugin_manager()
    parallel = config.parallel
    speculative = getattr(getattr(config, "speculative", None), "method", None)
    if speculative and parallel.world_size > 1:
        # The proposer and the verification live in rank 0's runner only; the other ranks would run a
        # different batch and their collectives would never match.
        key = "tensor_parallel_size" if parallel.tensor_parallel_size > 1 else "pipeline_parallel_size"
        raise ValueError(
            f"speculative.method '{speculative}' with parallel.{key} {getattr(parallel, key)} is not supported "
            "(speculation runs on one rank)"
        )
    if parallel.pipeline_parallel_size > 1:
        _check_pipeline_split(config, pm)  # before any rank starts: a bad split fails here, in seconds
    sel = select(pm, PluginKind.EXECUTOR, parallel, requested=parallel.executor)
    executor = sel.load()(ExecutorContext(config))
    try:
        executor.start()
        parts = build_engine_parts(config, pm, tp_rank=0, plugin_sections=plugin_sections)
        executor.bind(parts.runner)
    except BaseException:
        executor.shutdown()
        raise
    parts.executor = executor
    parts.selections = {"executor": sel, **parts.selections}
    return parts


def _check_pipeline_split(config: EngineConfig, pm: PluginManager, source: _ModelSource | None = None) -> str | None:
    """Raise ValueError naming the key when the model cannot be split into the configured pipeline stages
    (too few layers, a partition that does not add up, an architecture that builds every layer on every
    rank); else the split's description (distributed/pp_partition.py). Reads the model's config only."""
    parallel = config.parallel
    source = source or _load_model_info(config, pm)
    split = check_pipeline_parallel(source.info.hf_config, parallel.pipeline_parallel_size,
                                    parallel.pp_layer_partition)
    if split is None:
        return None
    model_sel = _select_architecture(pm, list(getattr(source.info.hf_config, "architectures", None) or []))
    model_cls = model_sel.load()
    if not getattr(model_cls, "supports_pipeline_parallel", False):
        raise ValueError(
            f"parallel.pipeline_parallel_size {parallel.pipeline_parallel_size}: model {model_sel.winner.name} "
            f"({model_cls.__name__}) builds every layer on every rank (it does not declare "
            "supports_pipeline_parallel)"
        )
    return split


def build_engine_parts(
    config: EngineConfig,
    pm: PluginManager | None = None,
    *,
    tp_rank: int = 0,
    pp_rank: int = 0,
    plugin_sections: Mapping[str, Any] | None = None,
) -> EngineParts:
    """One rank's engine: model shard, KV cache, runner (and the scheduler, used on rank 0 only).

    Every rank runs this same build so shapes, block counts and captured graphs agree; a process with
    tensor_parallel_size or pipeline_parallel_size > 1 must have joined the group first
    (pagedllm.distributed.parallel_state). `pp_rank` is the pipeline stage: its model holds its layers only
    (distributed/pp_partition.py). The sampling rank's runner (tensor-parallel rank 0 of the last stage) is
    built with the runner plugins (logits processors, speculator: runner_plugins.py).
    """
    clock = _PhaseClock()  # the first phase includes plugin selection and reading the model config
    pm = pm or get_plugin_manager()
    on_cpu = config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    elif on_cpu:
        # One thread per physical core this process may use (cpu_compute.default_num_threads): only ever
        # fewer than torch's own default, which counts the machine's cores but not a container's CPU mask.
        threads = default_num_threads(cpu_features(), os.environ)
        if threads is not None and threads < torch.get_num_threads():
            torch.set_num_threads(threads)
    if tp_rank == 0 and pp_rank == 0 and on_cpu:
        overloaded = check_thread_load(torch.get_num_threads())  # thread_load.py: why a busy machine matters
        if overloaded:
            logger.warning(overloaded)
    torch.manual_seed(config.seed)
    tp_size = config.parallel.tensor_parallel_size
    if plugin_sections is None:
        plugin_sections = validate_plugin_sections(config, pm.config_models())
    source = _load_model_info(config, pm)
    split = _check_pipeline_split(config, pm, source) if config.parallel.pipeline_parallel_size > 1 else None
    comps = _select_components(config, pm, source, tp_size, plugin_sections)
    if comps.kv_cache_dtype != config.kv_cache.cache_dtype:
        # `kv_cache.cache_dtype: auto` resolved on the CPU (cpu_compute.py NOTE 5): the KV plan, the CPU sizing and
        # EngineParts.config take the resolved dtype.
        config = config.model_copy(update={
            "kv_cache": config.kv_cache.model_copy(update={"cache_dtype": comps.kv_cache_dtype})})
    model = _build_and_load_model(config, source, comps, tp_rank, tp_size, pp_rank)
    clock("model and weights")
    sizing_notes: tuple[str, ...] = ()
    if comps.device.type == "cpu":
        # Batch limits and KV size the config leaves unset, from the machine (cpu_sizes.py); the rest of the
        # build (KV plan, scheduler, runner, EngineParts.config) takes the resolved config.
        config, sizing_notes = resolve_cpu_sizes(config, model, source.trained_len)
    kv = plan_kv_cache(config, pm, model, comps.backend, comps.device, source.trained_len)
    scheduler, scheduler_sel = _build_scheduler(config, pm, kv, comps.block_size)
    clock("KV cache sizing and allocation")
    sampling_rank = tp_rank == 0 and pp_rank == config.parallel.pipeline_parallel_size - 1
    plugins = _build_runner_plugins(config, pm, source, comps, kv, sampling_rank, plugin_sections)
    if plugins.speculator is not None:
        clock("speculative proposer")  # a draft model is a whole second engine (runner_plugins.py NOTE)
    runner = _build_runner(config, model, source, comps, kv, plugins, tp_rank, tp_size, pp_rank)
    connector_sels = build_kv_connector(
        config, pm, plugin_sections, model=source.model_ref, kv_manager=kv.manager, scheduler=scheduler, runner=runner,
        kv_caches=kv.kv_caches, block_axis=block_axis_of(comps.backend), device=comps.device,
    ) if config.kv_transfer.kv_connector else {}
    _start_up(config, runner, comps.device, clock)
    selections = {
        **source.selections, **comps.selections, **kv.selections, "scheduler": scheduler_sel, **plugins.selections,
        **connector_sels,
    }
    parts = EngineParts(
        config, source.model_ref, source.info, model, runner, scheduler, kv.manager, kv.max_model_len,
        kv.num_blocks, comps.block_size, comps.device, comps.dtype, selections, clock.elapsed(), tp_size=tp_size,
        capacity=kv.capacity, startup_phases=clock.phases, logits_processors=plugins.logits_processors,
        pipeline_split=split, compute_notes=comps.compute_notes + sizing_notes,
    )
    logger.info("engine built in %.1fs\n%s", parts.load_seconds, parts.describe())
    return parts


class _PhaseClock:
    """Seconds per start-up phase, in order: each phase runs from the end of the one before (the first from
    the clock's creation)."""

    def __init__(self) -> None:
        self.t0 = self._last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self._last
        self._last = now

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


@dataclass(frozen=True)
class _ModelSource:
    """Stage 1: where the model comes from and what its config says (no weights read yet)."""

    model_ref: str
    loader: Any
    info: LoadedModelInfo
    trained_len: int | None  # the config's max_position_embeddings
    selections: dict[str, Selection]


def _load_model_info(config: EngineConfig, pm: PluginManager) -> _ModelSource:
    model_ref = resolve_model_reference(config.model)
    sel = select_loader(pm, config, model_ref)
    loader = sel.load()()
    info: LoadedModelInfo = loader.load_info(model_ref, config.tokenizer)
    trained = getattr(info.hf_config, "max_position_embeddings", None)
    if config.max_model_len and trained and config.max_model_len > trained:
        # NOTE: refused before the weights load, as vLLM does, rather than failing mid-request: the rotary tables (and what the
        # model was trained on) end at max_position_embeddings, so a longer request would index past them.
        raise ValueError(
            f"max_model_len {config.max_model_len} is greater than the model's max_position_embeddings "
            f"{trained}; lower max_model_len (or use a checkpoint whose config allows the length)"
        )
    return _ModelSource(model_ref, loader, info, trained, {"loader": sel})


@dataclass(frozen=True)
class _Components:
    """Stage 2: the chosen architecture, attention backend and quantization, and where the model runs."""

    model_cls: Any
    backend: Any  # an AttentionBackend class, bound to its `plugins.<name>` section when it takes one
    quant_config: Any | None
    dense_config: Any  # the `none` method's config: the dense layers' kernels (ModelBuildContext.dense_config)
    kernels: KernelOptions  # the fused kernels every layer takes at construction
    device: torch.device
    dtype: torch.dtype
    block_size: int  # the config's (kv_cache.block_size)
    selections: dict[str, Selection]
    compute_notes: tuple[str, ...] = ()  # EngineParts.compute_notes
    kv_cache_dtype: str = "auto"  # kv_cache.cache_dtype as resolved (on the CPU `auto` may become bfloat16)


def _select_components(
    config: EngineConfig, pm: PluginManager, source: _ModelSource, tp_size: int, sections: Mapping[str, Any]
) -> _Components:
    hf_config = source.info.hf_config
    check_tensor_parallel(hf_config, tp_size)
    archs = list(getattr(hf_config, "architectures", None) or [])
    model_sel = _select_architecture(pm, archs)
    model_cls = model_sel.load()
    device = resolve_device(config.device)
    # The quantization method first: on the CPU the dtype `auto` resolves to depends on it (cpu_compute.py).
    quant_sel, quant_config, notes = _select_quantization(config, pm, source.info, device)
    dtype = resolve_dtype(config.dtype, hf_config, device, quant_sel.winner.name)
    if device.type == "cpu":
        notes = (resolve_cpu_dtype(config.dtype, quant_sel.winner.name, cpu_features()).reason, *notes)
    dense = quant_sel.winner.name == "none"
    kv_cache_dtype = config.kv_cache.cache_dtype
    if device.type == "cpu":
        kv_choice = choose_cpu_kv_cache_dtype(kv_cache_dtype, str(dtype).removeprefix("torch."), quant_sel.winner.name,
                                              cpu_features(), config.cpu_kernels)
        attention_sel, kv_cache_dtype, kv_note = select_attention_for_cache(
            config, pm, hf_config, model_cls, device, dtype, dense, kv_choice.value, kv_choice.reason)
        notes = (*notes, kv_note)
    else:
        attention_sel = select_attention(config, pm, hf_config, model_cls, device, dtype, dense, kv_cache_dtype)
    backend = attention_sel.load()
    configure = getattr(backend, "configure", None)  # AttentionBackend's optional member: per-engine options
    if configure is not None:
        backend = configure(plugin_section(sections, attention_sel.winner.name, pm.config_models()))
    dense_sel, dense_config = _select_dense(config, pm, quant_sel)
    selections = {"model": model_sel, "attention": attention_sel, "quantization": quant_sel, **dense_sel}
    kernels = _kernel_options(config, quant_config, device, dtype)
    return _Components(model_cls, backend, quant_config, dense_config, kernels, device, dtype,
                       config.kv_cache.block_size, selections, notes, kv_cache_dtype)


def _select_dense(config: EngineConfig, pm: PluginManager, quant_sel: Selection) -> tuple[dict[str, Selection], Any]:
    """The `none` method's config for the layers every model keeps dense (all of an unquantized one's; a
    quantized checkpoint's skipped layers and dense LM head), with the engine's dense kernel switches."""
    if quant_sel.winner.name == "none":
        selection, extra = quant_sel, {}
    else:
        selection = select(pm, PluginKind.QUANTIZATION, None, requested="none", requested_by="dense layers")
        extra = {"dense": selection}
    # `dense_gemv`: the Triton decode GEMV for dense 16-bit products (CUDA only; false is the A/B switch);
    # `gated_gemm`: SiLU/GELU-and-mul in a prompt-sized gate_up GEMM's epilogue (CUDA sm_90+; off until measured).
    options = {"dense_gemv": config.dense_gemv, "gated_gemm": config.gated_gemm}
    return extra, selection.load().from_config(options)


def _kernel_options(config: EngineConfig, quant_config: Any, device: torch.device, dtype: torch.dtype) -> KernelOptions:
    """The fused kernels the model's layers take at construction (pagedllm.layers.fused_ops NOTE 1)."""
    cpu_ops = None
    provider = getattr(quant_config, "cpu_fused_ops", None)
    if config.fused_ops and device.type == "cpu" and dtype == torch.float32 and provider is not None:
        # NOTE: the CPU's C kernels (norm, rotary, SiLU-and-mul, decode attention) are not bit-identical to
        # torch, so only a method whose outputs already differ from the float model brings them
        # (layers/fused_ops.py NOTE 3); the dense CPU path stays bit-for-bit transformers'.
        cpu_ops = provider()
    # Fused Triton norm/rotary/activation kernels (CUDA tensors only); `fused_ops: false` is the A/B switch.
    return KernelOptions(fused_ops="auto" if config.fused_ops else "off", cpu_ops=cpu_ops)


def _select_quantization(
    config: EngineConfig, pm: PluginManager, info: LoadedModelInfo, device: torch.device
) -> tuple[Selection, Any | None, tuple[str, ...]]:
    """The quantization method's selection, its config (None for `none`) and why its CPU GEMM is what it is
    (a GGUF file kept quantized on the CPU; empty otherwise)."""
    checkpoint_quant = (info.quantization_config or {}).get("quant_method")
    dense_fallback = (info.quantization_config or {}).get("dense_fallback")
    if checkpoint_quant and dense_fallback and not config.quantization.method and device.type != "cpu":
        # NOTE: a checkpoint its loader can also serve dense (a GGUF file) runs kept quantized on the CPU,
        # where its C kernels decode faster than the dense model and prefill as fast (docs/benchmarks.md), but
        # dequantized elsewhere unless the config asks for its method: CUDA's Triton GGUF kernels are not yet
        # measured against the dense bf16 model (docs/perf-notes.md §8 states when this default switches).
        # `quantization: none` asks for the dense model on the CPU too.
        checkpoint_quant = None
    quant_name = config.quantization.method or checkpoint_quant or "none"
    quant_source = "config" if config.quantization.method else "the checkpoint" if checkpoint_quant else "default"
    selection = select(
        pm, PluginKind.QUANTIZATION, info.quantization_config, requested=quant_name, requested_by=quant_source
    )
    quant_cls = selection.load()
    # Options: the checkpoint's quantization_config, overridden by the config's `plugins.<method>` section.
    quant_options = {**(info.quantization_config or {}), **config.plugins.get(quant_name, {})}
    notes: tuple[str, ...] = ()
    if dense_fallback and quant_name == checkpoint_quant and device.type == "cpu":
        # A file kept quantized on the CPU: its large products' GEMM follows the CPU's bf16 units, the memory a
        # bf16 copy would take and `cpu_kernels` (platform/cpu_compute.py NOTE 1, 2).
        gemm = choose_gguf_batch_gemm(
            cpu_features(), config.cpu_kernels, dense_weight_bytes(info.hf_config, 2), available_memory_bytes()
        )
        quant_options["batch_gemm"] = gemm.value
        notes = (gemm.reason,)
    return selection, None if quant_name == "none" else quant_cls.from_config(quant_options), notes


def _build_and_load_model(
    config: EngineConfig, source: _ModelSource, comps: _Components, tp_rank: int, tp_size: int, pp_rank: int = 0
) -> Any:
    """Stage 3: the model built on its device with its kernels chosen (the build context), its weights loaded."""
    parallel = config.parallel
    partition = tuple(parallel.pp_layer_partition) if parallel.pp_layer_partition else None
    ctx = ModelBuildContext(
        source.info.hf_config, comps.dtype, comps.device, comps.backend, comps.quant_config, comps.block_size,
        tp_rank, tp_size, kernels=comps.kernels, dense_config=comps.dense_config,
        pp_rank=pp_rank, pp_size=parallel.pipeline_parallel_size, pp_layer_partition=partition,
    )
    model = _build_model(comps.model_cls, ctx)
    load_shard = getattr(source.loader, "load_shard", None)  # ModelLoader's optional member
    if load_shard is not None and parallel.pipeline_parallel_size > 1:
        raise ValueError(
            f"loader {config.loader.name or 'sharded_state'!r}: its shards are per tensor-parallel rank of the whole "
            f"model; parallel.pipeline_parallel_size {parallel.pipeline_parallel_size} needs a whole checkpoint"
        )
    if load_shard is not None:
        load_shard(model, source.model_ref, source.info, tp_rank, tp_size)
    else:
        source.loader.load_weights(model, source.model_ref, source.info)
    model.eval()
    return model


def build_model_shard(
    config: EngineConfig, pm: PluginManager | None = None, tp_rank: int = 0
) -> tuple[torch.nn.Module, LoadedModelInfo]:
    """One tensor-parallel rank's model with its weights loaded, and the model's info, in this process: no KV
    cache, runner or process group (the layers slice their rank's part while loading). For tools that
    convert checkpoints, such as saving each rank's shard (the `sharded_state` loader's saver)."""
    pm = pm or get_plugin_manager()
    torch.manual_seed(config.seed)  # dummy weights are the same as the engine's for the same config
    source = _load_model_info(config, pm)
    tp_size = config.parallel.tensor_parallel_size
    comps = _select_components(config, pm, source, tp_size, validate_plugin_sections(config, pm.config_models()))
    return _build_and_load_model(config, source, comps, tp_rank, tp_size), source.info


def _build_scheduler(config: EngineConfig, pm: PluginManager, kv: KVPlan, block_size: int) -> tuple[Any, Selection]:
    """Stage 5: the configured scheduler over the KV manager (used on rank 0 only)."""
    selection = select(pm, PluginKind.SCHEDULER, config.scheduler, requested=config.scheduler.name)
    scheduler_cls = selection.load()
    scheduler = scheduler_cls(
        SchedulerContext(
            config.scheduler, kv.manager, kv.max_model_len, block_size, config.plugins.get(config.scheduler.name, {})
        )
    )
    return scheduler, selection


def _build_runner_plugins(
    config: EngineConfig,
    pm: PluginManager,
    source: _ModelSource,
    comps: _Components,
    kv: KVPlan,
    sampling_rank: bool,
    plugin_sections: Mapping[str, Any],
) -> RunnerPlugins:
    """Stage 6: the sampling rank's logits processors and speculator (runner_plugins.py); a plain sampler
    elsewhere. The sampling rank is tensor-parallel rank 0 of the last pipeline stage (rank 0 without pp)."""
    if not sampling_rank:
        return RunnerPlugins(Sampler())
    target = TargetFacts(
        comps.device, comps.dtype, int(source.info.hf_config.vocab_size), kv.max_model_len, comps.block_size,
        kv.num_blocks, tuple(g.spec for g in kv.layout.groups),
    )
    return build_runner_plugins(config, pm, target, plugin_sections)


def _build_runner(
    config: EngineConfig,
    model: Any,
    source: _ModelSource,
    comps: _Components,
    kv: KVPlan,
    plugins: RunnerPlugins,
    tp_rank: int,
    tp_size: int,
    pp_rank: int = 0,
) -> ModelRunner:
    """Stage 7: the model runner, whole: its buffers, sampler and speculator fixed at construction."""
    pp_size = config.parallel.pipeline_parallel_size
    options = GPURunnerOptions(
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_tokens=config.scheduler.max_num_batched_tokens,
        max_model_len=kv.max_model_len,
        # NOTE: no decode graphs between pipeline stages yet: a graph would have to capture the send/recv.
        cuda_graphs=not config.enforce_eager and pp_size == 1,
        graph_batch_sizes=tuple(config.cuda_graph_sizes) if config.cuda_graph_sizes else None,
        # Speculative verification steps (k drafts + 1 per request) replay graphs of their own.
        uniform_query_lens=(config.speculative.num_speculative_tokens + 1,) if config.speculative.method else (),
    )
    block_sizes = kv.group_block_sizes
    # The runner's block_size is group 0's (the config's, unless a layer type sets its own).
    return ModelRunner(
        model, comps.backend, kv.kv_caches, block_sizes[0], comps.device, source.info.hf_config.vocab_size,
        options, block_sizes, tp_rank=tp_rank, tp_size=tp_size, sampler=plugins.sampler,
        speculator=plugins.speculator, pp_rank=pp_rank, pp_size=pp_size,
    )


def _start_up(config: EngineConfig, runner: ModelRunner, device: torch.device, clock: _PhaseClock) -> None:
    """Stage 8: Triton compiles ahead, CUDA graph capture and warm-up, each timed as its own phase."""
    if runner.pp_size > 1:
        # A pipeline stage's steps send to / receive from its neighbours: compile-ahead's thread pool and the
        # warm-up's throw-away steps would have to run in lockstep on every stage (not done yet).
        return
    if config.compile_ahead and runner.compile_ahead():  # capture's and warm-up's Triton binaries (NOTE 4 there)
        clock("Triton compiles ahead")
    if device.type == "cuda" and runner.options.cuda_graphs:
        runner.capture_cuda_graphs()
        clock("CUDA graph capture")
    if device.type == "cuda":
        kinds = runner.warm_up()  # compile-on-first-use kernels compile now (model_runner NOTE 3)
        clock(f"warm-up ({len(kinds)} kinds of step)")


def _select_architecture(pm: PluginManager, archs: list[str]) -> Selection:
    if not archs:
        raise SelectionError("the model config names no `architectures`; cannot choose a model class")
    errors = []
    for arch in archs:
        try:
            return select(pm, PluginKind.MODEL, None, requested=arch, requested_by="the checkpoint's architectures")
        except SelectionError as exc:
            errors.append(str(exc))
    raise SelectionError("; ".join(errors))


def _build_model(model_cls: Any, ctx: ModelBuildContext) -> Any:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(ctx.dtype)
    try:
        with ctx.device, building(ctx.kernels):
            return model_cls(ctx)
    finally:
        torch.set_default_dtype(previous)
