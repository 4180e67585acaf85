"""Command-line flags shared by every subcommand that builds an engine; they override the config file."""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from pagedllm.component_names import check_component_names
from pagedllm.config import ConfigError, EngineConfig, refuse_remote_code, speculative_from_vllm

# flag -> dotted config key
_FLAGS: dict[str, tuple[str, type, str]] = {
    "--model": ("model", str, "model folder, .gguf file or alias (default: embedded SmolLM2)"),
    "--tokenizer": ("tokenizer", str, "tokenizer folder, if not the model's"),
    "--dtype": ("dtype", str, "auto, float32, float16, bfloat16"),
    "--device": ("device", str, "auto, cpu, cuda"),
    "--seed": ("seed", int, "engine seed"),
    "--max-model-len": ("max_model_len", int, "context length cap"),
    "--num-threads": ("num_threads", int, "torch CPU threads"),
    "--attention-backend": ("attention.backend", str, "attention plugin name"),
    "--block-size": ("kv_cache.block_size", int, "tokens per KV block"),
    "--num-kv-blocks": ("kv_cache.num_blocks", int, "force the number of KV blocks"),
    "--kv-cache-memory-gb": ("kv_cache.memory_gb", float, "KV-cache budget on CPU (GiB)"),
    "--gpu-memory-utilization": ("kv_cache.gpu_memory_utilization", float, "fraction of GPU memory"),
    "--scheduler": ("scheduler.name", str, "scheduler plugin name"),
    "--max-num-seqs": ("scheduler.max_num_seqs", int, "most requests per step"),
    "--max-num-batched-tokens": ("scheduler.max_num_batched_tokens", int, "token budget per step"),
    "--load-format": ("loader.name", str, "loader plugin name (hf, gguf, dummy)"),
    "--quantization": ("quantization.method", str, "force a quantization method"),
    "--speculative-method": ("speculative.method", str, "speculative decoding proposer (ngram, draft)"),
    "--num-speculative-tokens": ("speculative.num_speculative_tokens", int, "draft tokens per step (k)"),
    "--speculative-draft-model": ("speculative.draft_model", str, "draft model folder (method draft)"),
    "--prompt-lookup-min": ("speculative.prompt_lookup_min", int, "ngram: shortest n-gram looked up"),
    "--prompt-lookup-max": ("speculative.prompt_lookup_max", int, "ngram: longest n-gram looked up"),
    "--tensor-parallel-size": ("parallel.tensor_parallel_size", int, "ranks (processes) per pipeline stage"),
    "--pipeline-parallel-size": ("parallel.pipeline_parallel_size", int, "pipeline stages (layer ranges) per replica"),
    "--data-parallel-size": ("parallel.data_parallel_size", int, "engine replicas (on Ray)"),
    "--distributed-executor-backend": ("parallel.executor", str, "executor plugin (uniproc, multiproc, ray)"),
    "--otlp-traces-endpoint": ("observability.otlp_traces_endpoint", str,
                               "OTLP collector for request traces (needs pagedllm[tracing])"),
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (override the config file)")
    group.add_argument("--config", help="engine config file (YAML or TOML)")
    for flag, (_key, typ, help_text) in _FLAGS.items():
        group.add_argument(flag, type=typ, default=None, help=help_text)
    # vLLM's spelling (--enable-prefix-caching / --no-enable-prefix-caching) and the older short one.
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                       help="automatic prefix caching (on by default)")
    group.add_argument("--no-prefix-caching", action="store_true", help="same as --no-enable-prefix-caching")
    group.add_argument("--enforce-eager", action="store_true", default=None, help="never capture CUDA graphs")
    group.add_argument("--speculative-config", metavar="JSON",
                       help='vLLM\'s speculative_config, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    group.add_argument("--trust-remote-code", action="store_true",
                       help="refused: pagedllm never runs model code from a checkpoint (architectures are plugins)")
    group.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="any config key, dotted (e.g. --set scheduler.enable_chunked_prefill=false); repeatable",
    )
    # Marks the command as one that builds an engine: main() checks its config before dispatching to it.
    parser.set_defaults(builds_engine=True)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The config the flags describe (file, environment, flags), its component names checked.

    The check is by name against plugin discovery only (`check_component_names`): a misspelled plugin fails
    here, naming its key, instead of deep inside the engine build.
    """
    config = _config_from_args(args)
    check_component_names(config, source=args.config or "config")
    return config


def _config_from_args(args: argparse.Namespace) -> EngineConfig:
    overrides: dict[str, Any] = {}
    for flag, (key, _typ, _help) in _FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            overrides[key] = value
    if args.trust_remote_code:
        refuse_remote_code(True)
    if args.no_prefix_caching or args.enable_prefix_caching is not None:
        overrides["kv_cache.enable_prefix_caching"] = bool(args.enable_prefix_caching) and not args.no_prefix_caching
    if args.enforce_eager:
        overrides["enforce_eager"] = True
    if args.speculative_config is not None:
        overrides.update({f"speculative.{k}": v for k, v in speculative_from_vllm(args.speculative_config).items()})
    for item in args.set:
        if "=" not in item:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        overrides[key.strip()] = yaml.safe_load(raw)  # YAML scalars: 8 -> int, false -> bool
    if args.config:
        return EngineConfig.from_file(args.config, overrides)
    return EngineConfig.from_dict({}, overrides)
