"""Assembles an engine from an EngineConfig: every component chosen through the plugin selector.

Order: model reference → loader → config/tokenizer → architecture → attention backend → quantization →
model built and loaded → KV specs → KV manager per group → cache sized and allocated → scheduler → runner.
Each choice is kept as a `Selection`, so `pagedllm config show` can say what was picked and why.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.default_model import resolve_model_reference
from pagedllm.distributed.communication import tp_min
from pagedllm.distributed.shard_check import check_tensor_parallel
from pagedllm.kv_cache.capacity import KVCapacity
from pagedllm.kv_cache.kv_cache_manager import KVCacheConfig, KVCacheManager
from pagedllm.kv_cache.layout import KVCacheLayout, bind_kv_groups
from pagedllm.kv_cache.spec import AttentionSpec, FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from pagedllm.layers.dense_gemv import set_dense_gemv
from pagedllm.layers.fused_ops import set_cpu_ops, set_fused_ops
from pagedllm.layers.gated_gemm import set_gated_gemm
from pagedllm.plugin_manager import PluginManager, get_plugin_manager
from pagedllm.plugin_spec import ComponentSpec, PluginKind
from pagedllm.protocols.executor import ExecutorContext
from pagedllm.protocols.loader import LoadedModelInfo
from pagedllm.protocols.model import ModelBuildContext
from pagedllm.sched.base import SchedulerContext
from pagedllm.selection_context import AttentionSelectionContext
from pagedllm.selector import Selection, SelectionError, select
from pagedllm.worker.cuda_graphs import GPURunnerOptions
from pagedllm.worker.memory_profile import profile_activation_bytes
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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

    def describe(self) -> str:
        lines = [f"model: {self.model_ref}", f"device: {self.device}, dtype: {str(self.dtype).removeprefix('torch.')}"]
        lines += [sel.explain() for sel in self.selections.values()]
        lines.append(
            f"kv cache: {self.num_blocks} blocks x {self.block_size} tokens = "
            f"{self.num_blocks * self.block_size} token slots; max_model_len {self.max_model_len}"
        )
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


def resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU half-precision matmuls are slow and lossy; float32 is the CPU norm
    cfg_dtype = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    return cfg_dtype if cfg_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def select_loader(pm: PluginManager, config: EngineConfig, model_ref: str) -> Selection:
    return select(pm, PluginKind.LOADER, model_ref, requested=config.loader.name)


def build_engine(config: EngineConfig, pm: PluginManager | None = None) -> EngineParts:
    """The engine core's build: its executor first (remote tensor-parallel ranks start and this process joins
    their group as rank 0), then rank 0's parts; the executor is shut down if anything fails."""
    pm = pm or get_plugin_manager()
    parallel = config.parallel
    speculative = getattr(getattr(config, "speculative", None), "method", None)
    if speculative and parallel.tensor_parallel_size > 1:
        # The proposer and the verification live in rank 0's runner only; the other ranks would run a
        # different batch and their collectives would never match.
        raise ValueError(
            f"speculative.method '{speculative}' with parallel.tensor_parallel_size "
            f"{parallel.tensor_parallel_size} is not supported (speculation runs on one rank)"
        )
    sel = select(pm, PluginKind.EXECUTOR, parallel, requested=parallel.executor)
    executor = sel.load()(ExecutorContext(config))
    try:
        executor.start()
        parts = build_engine_parts(config, pm, tp_rank=0)
        executor.bind(parts.runner)
    except BaseException:
        executor.shutdown()
        raise
    parts.executor = executor
    parts.selections = {"executor": sel, **parts.selections}
    return parts


def build_engine_parts(config: EngineConfig, pm: PluginManager | None = None, *, tp_rank: int = 0) -> EngineParts:
    """One rank's engine: model shard, KV cache, runner (and the scheduler, used on rank 0 only).

    Every rank runs this same build so shapes, block counts and captured graphs agree; a process with
    tensor_parallel_size > 1 must have joined the group first (pagedllm.distributed.parallel_state).
    """
    t0 = time.perf_counter()
    pm = pm or get_plugin_manager()
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    model_ref = resolve_model_reference(config.model)
    selections: dict[str, Selection] = {}

    sel = selections["loader"] = select_loader(pm, config, model_ref)
    loader = sel.load()()
    info: LoadedModelInfo = loader.load_info(model_ref, config.tokenizer)
    hf_config = info.hf_config
    trained = getattr(hf_config, "max_position_embeddings", None)
    if config.max_model_len and trained and config.max_model_len > trained:
        # NOTE: refused before the weights load, as vLLM does, rather than failing mid-request: the rotary tables (and what the
        # model was trained on) end at max_position_embeddings, so a longer request would index past them.
        raise ValueError(
            f"max_model_len {config.max_model_len} is greater than the model's max_position_embeddings "
            f"{trained}; lower max_model_len (or use a checkpoint whose config allows the length)"
        )

    tp_size = config.parallel.tensor_parallel_size
    check_tensor_parallel(hf_config, tp_size)
    archs = list(getattr(hf_config, "architectures", None) or [])
    selections["model"] = _select_architecture(pm, archs)
    model_cls = selections["model"].load()

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, hf_config, device)
    num_attention_heads = getattr(hf_config, "num_attention_heads", None)
    if num_attention_heads:
        head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_attention_heads
    else:
        # Attention-free models (Mamba): the backend only builds the step metadata, so ask with a head size
        # every backend supports rather than a meaningless one that would rule out the CUDA-graph backends.
        head_size = 128
    block_size = config.kv_cache.block_size
    attn_ctx = AttentionSelectionContext(
        device_type=device.type,
        compute_capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
        dtype=str(dtype).removeprefix("torch."),
        kv_cache_dtype=config.kv_cache.cache_dtype,
        head_size=head_size,
        block_size=block_size,
        sliding_window=bool(getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", True)),
        logits_soft_cap=bool(getattr(hf_config, "attn_logit_softcapping", None)),
        # Decode CUDA graphs will be captured: backends without them rank themselves lower (priority_for).
        cuda_graphs=device.type == "cuda" and not config.enforce_eager,
    )
    selections["attention"] = select(pm, PluginKind.ATTENTION, attn_ctx, requested=config.attention.backend)
    backend = selections["attention"].load()

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
    selections["quantization"] = select(
        pm, PluginKind.QUANTIZATION, info.quantization_config, requested=quant_name, requested_by=quant_source
    )
    quant_cls = selections["quantization"].load()
    # Options: the checkpoint's quantization_config, overridden by the config's `plugins.<method>` section.
    quant_options = {**(info.quantization_config or {}), **config.plugins.get(quant_name, {})}
    quant_config = None if quant_name == "none" else quant_cls.from_config(quant_options)

    ctx = ModelBuildContext(hf_config, dtype, device, backend, quant_config, block_size, tp_rank, tp_size)
    phases: dict[str, float] = {}
    t_phase = t0  # the first phase includes plugin selection and reading the model config

    def phase(name: str) -> None:
        nonlocal t_phase
        now = time.perf_counter()
        phases[name] = now - t_phase
        t_phase = now

    model = _build_model(model_cls, ctx)
    loader.load_weights(model, model_ref, info)
    model.eval()
    # Fused Triton norm/rotary/activation kernels (CUDA tensors only); `fused_ops: false` is the A/B switch.
    set_fused_ops(model, "auto" if config.fused_ops else "off")
    # The Triton decode GEMV for dense 16-bit linears (CUDA only); `dense_gemv: false` is the A/B switch.
    set_dense_gemv(model, config.dense_gemv)
    # SiLU/GELU-and-mul in a prompt-sized gate_up GEMM's epilogue (CUDA sm_90+ only); off until measured.
    set_gated_gemm(model, config.gated_gemm)
    if config.fused_ops and device.type == "cpu" and dtype == torch.float32 and getattr(quant_config, "cpu_fused_ops", False):
        # NOTE: the CPU's C kernels (norm, rotary, SiLU-and-mul, decode attention) are not bit-identical to
        # torch, so only a method whose outputs already differ from the float model asks for them
        # (layers/fused_ops.py NOTE 3); the dense CPU path stays bit-for-bit transformers'.
        from pagedllm.layers.cpu_ops import cpu_ops

        set_cpu_ops(model, cpu_ops())

    phase("model and weights")
    specs: list[KVCacheSpec] = model.kv_cache_specs()
    if config.kv_cache.disable_sliding_window:
        specs = [_as_full_attention(s) for s in specs]
    # `kv_cache.cache_dtype`: the attention specs' dtype sizes the pages (fp8: half a 16-bit page, so twice
    # the blocks in the same memory) and the cache tensors; the chosen backend passed the same dtype in check().
    specs = [_with_cache_dtype(s, config.kv_cache.cache_dtype) for s in specs]
    # Groups by spec, split to equal sizes; groups of one page layout share cache tensors (kv_cache/layout.py).
    layout = KVCacheLayout.plan(specs)
    groups = layout.groups
    bind_kv_groups(model, layout)
    group_block_sizes = [g.spec.block_size for g in groups]
    factories = []
    for i, group in enumerate(groups):
        key = f"kv_manager[{i}]" if len(groups) > 1 else "kv_manager"
        selections[key] = _select_kv_manager(pm, group.spec)
        factories.append(selections[key].load())

    num_blocks = _num_blocks(config, layout, device, lambda: profile_activation_bytes(
        model, backend, specs, group_block_sizes[0], config.scheduler.max_num_batched_tokens,
        config.scheduler.max_num_seqs, device, group_block_sizes,
        config.max_model_len or trained, compile_ahead=config.compile_ahead))
    num_blocks = tp_min(num_blocks, tp_size)  # every rank must hold the same blocks (GPU memory may differ)
    model_max = config.max_model_len or trained or 2048
    # A request alone must always fit in the cache, or it could wait forever. Window-aware: a sliding-window
    # group holds a bounded number of blocks per request whatever its length (kv_cache/capacity.py).
    capacity = KVCapacity(layout, num_blocks, config.scheduler.max_num_batched_tokens)
    max_model_len = capacity.max_len(model_max)
    if config.max_model_len and config.max_model_len > max_model_len:
        raise ValueError(
            f"max_model_len {config.max_model_len} needs {capacity.blocks_per_request(config.max_model_len)} "
            f"usable KV blocks but the cache has {num_blocks - 1}; raise kv_cache.memory_gb / num_blocks or "
            "lower max_model_len"
        )
    kv_caches = layout.allocate(backend, num_blocks, device)
    kv_manager = KVCacheManager(
        KVCacheConfig(num_blocks, groups),
        factories,
        enable_caching=config.kv_cache.enable_prefix_caching,
        max_model_len=max_model_len,
    )
    selections["scheduler"] = select(pm, PluginKind.SCHEDULER, config.scheduler, requested=config.scheduler.name)
    scheduler_cls = selections["scheduler"].load()
    scheduler = scheduler_cls(
        SchedulerContext(
            config.scheduler, kv_manager, max_model_len, block_size, config.plugins.get(config.scheduler.name, {})
        )
    )
    vocab_size = hf_config.vocab_size
    options = GPURunnerOptions(
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_tokens=config.scheduler.max_num_batched_tokens,
        max_model_len=max_model_len,
        cuda_graphs=not config.enforce_eager,
        graph_batch_sizes=tuple(config.cuda_graph_sizes) if config.cuda_graph_sizes else None,
        # Speculative verification steps (k drafts + 1 per request) replay graphs of their own.
        uniform_query_lens=(config.speculative.num_speculative_tokens + 1,) if config.speculative.method else (),
    )
    # The runner's block_size is group 0's (the config's, unless a layer type sets its own).
    runner = ModelRunner(
        model, backend, kv_caches, group_block_sizes[0], device, vocab_size, options, group_block_sizes,
        tp_rank=tp_rank, tp_size=tp_size,
    )
    phase("KV cache sizing and allocation")
    if config.compile_ahead and runner.compile_ahead():  # capture's and warm-up's Triton binaries (NOTE 4 there)
        phase("Triton compiles ahead")
    if device.type == "cuda" and options.cuda_graphs:
        runner.capture_cuda_graphs()
        phase("CUDA graph capture")
    if device.type == "cuda":
        kinds = runner.warm_up()  # compile-on-first-use kernels compile now (model_runner NOTE 3)
        phase(f"warm-up ({len(kinds)} kinds of step)")
    parts = EngineParts(
        config, model_ref, info, model, runner, scheduler, kv_manager, max_model_len, num_blocks, block_size,
        device, dtype, selections, time.perf_counter() - t0, tp_size=tp_size, capacity=capacity,
        startup_phases=phases,
    )
    logger.info("engine built in %.1fs\n%s", parts.load_seconds, parts.describe())
    return parts


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


def _select_kv_manager(pm: PluginManager, spec: KVCacheSpec) -> Selection:
    # Registries keyed by type: the most specific registered spec class wins (walk the MRO).
    candidates = pm.components(PluginKind.KV_MANAGER)
    for cls in type(spec).__mro__:
        matching: list[ComponentSpec] = [c for c in candidates if c.meta.get("spec_type") is cls]
        if matching:
            return select(pm, PluginKind.KV_MANAGER, spec, candidates=matching)
    raise SelectionError(f"no kv_manager plugin handles {type(spec).__name__}")


def _with_cache_dtype(spec: KVCacheSpec, cache_dtype: str) -> KVCacheSpec:
    """An attention spec stored in the configured KV-cache dtype ('auto' keeps the model's); others as they are."""
    if cache_dtype == "auto" or not isinstance(spec, AttentionSpec):
        return spec
    kv_dtype = torch.float8_e4m3fn if cache_dtype == "fp8_e4m3" else _DTYPES[cache_dtype]
    return dataclasses.replace(spec, dtype=kv_dtype)


def _as_full_attention(spec: KVCacheSpec) -> KVCacheSpec:
    """`kv_cache.disable_sliding_window`: keep every block (the attention layer still applies its window)."""
    if isinstance(spec, SlidingWindowSpec):
        return FullAttentionSpec(spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype)
    return spec


def _num_blocks(
    config: EngineConfig, layout: KVCacheLayout, device: torch.device, profile: Callable[[], int] | None = None
) -> int:
    """KV blocks from the config: forced, a CPU budget in GiB, or what a GPU has left after a profiling run.

    GPU accounting (vLLM's): the engine may use utilization x total memory; of that, what is already in use
    (weights, CUDA context, other processes: total - free) and the peak activations of the largest step
    (`profile`, run once with a throw-away cache) are not available to the KV cache.
    """
    if config.kv_cache.num_blocks:
        return config.kv_cache.num_blocks
    bytes_per_block = layout.bytes_per_block  # one page per shared layer tensor
    if device.type == "cuda":
        activations = profile() if profile is not None else 0
        free, total = torch.cuda.mem_get_info(device)
        budget = total * config.kv_cache.gpu_memory_utilization - (total - free) - activations
        num_blocks = max(2, int(budget // bytes_per_block))
        block_size = layout.groups[0].spec.block_size
        print(
            f"pagedllm: KV cache {num_blocks} blocks = {num_blocks * block_size:,} tokens "
            f"({num_blocks * bytes_per_block / (1 << 30):.1f} GiB; in use {(total - free) / (1 << 30):.1f} GiB, "
            f"activation peak {activations / (1 << 30):.2f} GiB, of {total / (1 << 30):.1f} GiB)",
            file=sys.stderr,
            flush=True,
        )
        return num_blocks
    return max(2, int(config.kv_cache.memory_gb * (1 << 30) // bytes_per_block))


def _build_model(model_cls: Any, ctx: ModelBuildContext) -> Any:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(ctx.dtype)
    try:
        with ctx.device:
            return model_cls(ctx)
    finally:
        torch.set_default_dtype(previous)
