"""pagedllm.api: the one import surface for plugins.

A plugin imports from `pagedllm.api` (this module) and its submodules, and from its own package; everything
else in pagedllm is internal and may change in any release (docs/plugins/api.md lists this surface and the
compatibility policy). CI enforces the rule for the in-tree plugins (import-linter contracts in
pyproject.toml).

This module is light -- no torch -- because registration modules import it while `pagedllm plugins` and
`import pagedllm` must stay fast: it holds what registration needs (`hookimpl`, the kinds, component specs,
KV-cache spec types, the version) and the types of a registration, typing only: the `register` callable per
kind (`RegisterScheduler`, ...: annotate a hook's argument with it and mypy checks every call) and the context
each kind's check() receives (`SchedulerCheckContext`, ...; the table in pagedllm.selection_context).
Implementation modules, imported when a component is used, take the rest from the submodules:

    pagedllm.api.attention     attention backends: per-step metadata, layer config
    pagedllm.api.kv            KV managers: block pool, blocks, single-type manager base; KV connectors
    pagedllm.api.sched         schedulers: bookkeeping base, requests, step messages
    pagedllm.api.model         model architectures: build context, layers, decoder blocks, weight loading
    pagedllm.api.quantization  quantization methods: the unquantized fallback, weight helpers
    pagedllm.api.loading       loaders: model info, HF folders, GGUF blocks
    pagedllm.api.kernels       the kernel toolkit (compile-ahead launches, NVRTC, native builds, PDL, split-K)
    pagedllm.api.engine        entrypoints and commands: engine config, async and offline frontends, outputs,
                               errors
    pagedllm.api.cli           command plugins (light): the engine's command-line flags and the config they give
    pagedllm.api.executor      executors: context, tensor-parallel worker and driver
    pagedllm.api.spec_decode   speculative proposers: context, requests, proposals
    pagedllm.api.parsers       tool-call and reasoning parsers (light): protocols, deltas, streaming bases
    pagedllm.api.structured_output  structured-output backends: context, the grammar protocol, schema helpers
"""

from __future__ import annotations

from pagedllm.hookspecs import (
    Register,
    RegisterAttentionBackend,
    RegisterCommand,
    RegisterEntrypoint,
    RegisterExecutor,
    RegisterKVConnector,
    RegisterKVManager,
    RegisterLoader,
    RegisterLogitsProcessor,
    RegisterModel,
    RegisterProposer,
    RegisterQuantizationMethod,
    RegisterReasoningParser,
    RegisterScheduler,
    RegisterStructuredOutputBackend,
    RegisterToolParser,
    hookimpl,
)
from pagedllm.kv_cache.spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SinkSlidingWindowSpec,
    SlidingWindowSpec,
)
from pagedllm.plugin_spec import ComponentSpec, PluginKind
from pagedllm.selection_context import (
    AttentionSelectionContext,
    ExecutorCheckContext,
    KVConnectorCheckContext,
    KVManagerCheckContext,
    LoaderCheckContext,
    ProposerCheckContext,
    QuantizationCheckContext,
    SchedulerCheckContext,
    StructuredOutputCheckContext,
)

# NOTE: semver over exactly the names this package and its submodules export. A minor release may add
# names, optional protocol methods with defaults, or optional keyword arguments; removing or renaming a
# name, changing a signature or a value type's fields incompatibly needs a major release, and a name to be
# removed warns (DeprecationWarning) for one minor release first. Plugins declare the majors they support:
# PAGEDLLM_PLUGIN_API = ">=1,<2" (integer clauses compare the major), or a minor they need: ">=1.1,<2".
API_VERSION = "1.9.0"
PLUGIN_API_VERSION = int(API_VERSION.split(".")[0])

__all__ = [
    "API_VERSION",
    "PLUGIN_API_VERSION",
    "AttentionSelectionContext",
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "ComponentSpec",
    "CrossAttentionSpec",
    "ExecutorCheckContext",
    "FullAttentionSpec",
    "KVCacheSpec",
    "KVConnectorCheckContext",
    "KVManagerCheckContext",
    "LoaderCheckContext",
    "MambaSpec",
    "PluginKind",
    "ProposerCheckContext",
    "QuantizationCheckContext",
    "Register",
    "RegisterAttentionBackend",
    "RegisterCommand",
    "RegisterEntrypoint",
    "RegisterExecutor",
    "RegisterKVConnector",
    "RegisterKVManager",
    "RegisterLoader",
    "RegisterLogitsProcessor",
    "RegisterModel",
    "RegisterProposer",
    "RegisterQuantizationMethod",
    "RegisterReasoningParser",
    "RegisterScheduler",
    "RegisterStructuredOutputBackend",
    "RegisterToolParser",
    "SchedulerCheckContext",
    "StructuredOutputCheckContext",
    "SinkSlidingWindowSpec",
    "SlidingWindowSpec",
    "hookimpl",
]
