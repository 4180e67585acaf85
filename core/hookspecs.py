"""The pluggy hook specifications: every way a plugin talks to pagedllm.

Registration hooks receive a `register` callable (simonw/llm style) so one plugin module may offer several
components; each call is attributed to the plugin (and its distribution) that made it. A registration is
light: it names the component and gives a zero-argument `load` that imports the implementation when the
component is actually used, so discovering plugins never imports torch kernels, triton or fastapi.

`register(name, load, *, priority=0, requires=(), check=None, description="", config_model=None,
explicit_only=False, override=False, **meta)`, typed per kind by the `Register*` protocols below (exported
from `pagedllm.api`; annotate a hook's `register` with its kind's protocol and mypy checks every call):

- name: the component's name (for models, the HF `architectures` name it implements).
- load: `() -> object`, imports and returns the component (a class, usually).
- priority: higher wins when several pass their checks.
- requires: importable module names the component needs; a missing one makes it unavailable, with a reason.
- check: `(context) -> list[str]`, reasons the component cannot serve this context (empty: it can); the
  context's type per kind is in pagedllm.selection_context.
- description: one line for `pagedllm plugins` and the selection report.
- config_model: a pydantic model validating the config's `plugins.<name>` section, errors naming
  `plugins.<name>.<key>`.
- explicit_only: keeps the component out of automatic selection (as for the `dummy` loader).
- override: replaces a component of the same name registered earlier.
- meta: extra, kind-specific facts (`spec_type` for KV managers, `priority_for` for attention backends); all
  keyword arguments past `description` land in `ComponentSpec.meta`.

Which process a hook fires in: the one where the event happens. With the offline `LLM`/`LLMEngine` that is
the one process. Behind `pagedllm serve` the engine core runs in its own process (core_proc.py): the plugin
is loaded in both, `step_stats` and the logits processors run in the engine-core process, while
`engine_started`/`engine_stopped`, `request_added`, `request_finished` and `server_app_created` run in the
API process. `config_loaded` fires in each process that builds from the config (with tensor parallelism,
every rank's process too; with data parallelism, every replica's). A hook must not assume shared memory with
the other process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import pluggy

from pagedllm.kv_cache.spec import KVCacheSpec
from pagedllm.selection_context import (
    AttentionSelectionContext,
    ExecutorCheckContext,
    KVConnectorCheckContext,
    LoaderCheckContext,
    ProposerCheckContext,
    QuantizationCheckContext,
    SchedulerCheckContext,
    StructuredOutputCheckContext,
)

if TYPE_CHECKING:  # annotations only: importing the hookspecs must stay torch-free
    from pydantic import BaseModel

    from pagedllm.config import EngineConfig
    from pagedllm.request import Request
    from pagedllm.sched.stats import SchedulerStats

hookspec = pluggy.HookspecMarker("pagedllm")
hookimpl = pluggy.HookimplMarker("pagedllm")

C_co = TypeVar("C_co", covariant=True)
S = TypeVar("S", bound=KVCacheSpec)


class Register(Protocol[C_co]):
    """The `register(...)` callable a registration hook receives; `C_co` is what the kind's check() is given.

    The keyword arguments are what pagedllm's plugin manager accepts (module docstring); any other keyword
    goes to `ComponentSpec.meta` unchecked.
    """

    def __call__(
        self,
        name: str,
        load: Callable[[], Any],
        *,
        priority: int = 0,
        requires: tuple[str, ...] | list[str] = (),
        check: Callable[[C_co], list[str]] | None = None,
        description: str = "",
        config_model: type[BaseModel] | None = None,
        explicit_only: bool = False,
        override: bool = False,
        **meta: Any,
    ) -> None: ...


class RegisterAttentionBackend(Protocol):
    """`register` for attention backends: check() and `priority_for` receive an `AttentionSelectionContext`."""

    def __call__(
        self,
        name: str,
        load: Callable[[], Any],
        *,
        priority: int = 0,
        requires: tuple[str, ...] | list[str] = (),
        check: Callable[[AttentionSelectionContext], list[str]] | None = None,
        description: str = "",
        config_model: type[BaseModel] | None = None,
        explicit_only: bool = False,
        override: bool = False,
        priority_for: Callable[[AttentionSelectionContext], int] | None = None,
        **meta: Any,
    ) -> None: ...


class RegisterKVManager(Protocol):
    """`register` for KV managers: `spec_type` is the KVCacheSpec subclass served; check() gets such a spec."""

    def __call__(
        self,
        name: str,
        load: Callable[[], Any],
        *,
        spec_type: type[S],
        priority: int = 0,
        requires: tuple[str, ...] | list[str] = (),
        check: Callable[[S], list[str]] | None = None,
        description: str = "",
        config_model: type[BaseModel] | None = None,
        explicit_only: bool = False,
        override: bool = False,
        **meta: Any,
    ) -> None: ...


# The other kinds differ only in what check() receives.
RegisterScheduler = Register[SchedulerCheckContext]
RegisterLoader = Register[LoaderCheckContext]
RegisterQuantizationMethod = Register[QuantizationCheckContext]
RegisterModel = Register[None]
RegisterEntrypoint = Register[None]
RegisterLogitsProcessor = Register[None]
RegisterExecutor = Register[ExecutorCheckContext]
RegisterProposer = Register[ProposerCheckContext]
RegisterCommand = Register[None]
RegisterStructuredOutputBackend = Register[StructuredOutputCheckContext]
RegisterToolParser = Register[None]
RegisterReasoningParser = Register[None]
RegisterKVConnector = Register[KVConnectorCheckContext]


@hookspec
def register_attention_backends(register: RegisterAttentionBackend) -> None:
    """Register attention backends (pagedllm.api.attention.AttentionBackend).

    A backend whose rank depends on the machine may pass `priority_for=<callable(context) -> int>`; the
    selector then ranks it by that instead of the fixed `priority` (pagedllm.selector.effective_priority).

    :param register: call once per backend; check() and `priority_for` receive an
        `AttentionSelectionContext` (device, compute capability, dtypes, head and block size).
    """


@hookspec
def register_kv_managers(register: RegisterKVManager) -> None:
    """Register single-type KV managers, each for the `KVCacheSpec` subclass it holds.

    :param register: call once per manager with `spec_type=<KVCacheSpec subclass>`; the most specific
        registered class in a KV-cache group's spec MRO wins, and check() receives that group's spec
        (`KVManagerCheckContext`).
    """


@hookspec
def register_schedulers(register: RegisterScheduler) -> None:
    """Register schedulers, selected by the config's `scheduler.name`.

    :param register: call once per scheduler; check() receives the config's `scheduler` section
        (`SchedulerCheckContext`).
    """


@hookspec
def register_loaders(register: RegisterLoader) -> None:
    """Register model loaders; without `loader.name` the highest-priority loader whose check passes reads it.

    :param register: call once per loader; check() receives the model reference, a path or alias string
        (`LoaderCheckContext`).
    """


@hookspec
def register_quantization_methods(register: RegisterQuantizationMethod) -> None:
    """Register quantization configs, by the checkpoint's `quant_method` name.

    :param register: call once per method; check() receives the checkpoint's `quantization_config` mapping,
        or None for a checkpoint without one (`QuantizationCheckContext`).
    """


@hookspec
def register_models(register: RegisterModel) -> None:
    """Register model architectures, by the HF `architectures` name.

    :param register: call once per architecture name; check() receives None (models are checked by
        building them).
    """


@hookspec
def register_entrypoints(register: RegisterEntrypoint) -> None:
    """Register entrypoints (e.g. the `serve` app); `load()` returns `serve(config, options) -> int`.

    :param register: call once per entrypoint; check() receives None (list the server's packages in
        `requires=` instead).
    """


@hookspec
def register_logits_processors(register: RegisterLogitsProcessor) -> None:
    """Register named logits processors; the config's `logits_processors: [name, ...]` turns them on.

    `load()` returns a class built once per engine as `cls(LogitsProcessorContext)` (pagedllm.sample.
    logits_processor) whose `apply(logits, batch) -> logits` runs on each step's [B, V] float32 logits before
    penalties and temperature. Pass `config_model=` to validate its `plugins.<name>` section.

    :param register: call once per processor; check() receives None.
    """


@hookspec
def register_executors(register: RegisterExecutor) -> None:
    """Register executors: how one engine replica runs its tensor-parallel ranks (pagedllm.protocols.executor).

    The config's `parallel.executor` names one, else the highest-priority executor whose check passes is used.

    :param register: call once per executor; check() receives the config's `parallel` section
        (`ExecutorCheckContext`).
    """


@hookspec
def register_proposers(register: RegisterProposer) -> None:
    """Register speculative-decoding proposers, selected by the config's `speculative.method`.

    `load()` returns a class built once per engine as `cls(ProposerContext)` (pagedllm.spec_decode.proposer)
    that guesses the next tokens of each request; the target model verifies them and rejection sampling
    keeps its output distribution exact.

    :param register: call once per proposer; check() receives the config's `speculative` section
        (`ProposerCheckContext`).
    """


@hookspec
def register_commands(register: RegisterCommand) -> None:
    """Register `pagedllm` subcommands (pagedllm.protocols.command), by the subcommand's name.

    `load()` returns an object (a module, usually) whose `add_parser(subparsers)` adds the subcommand named as
    registered and sets `func` on its parser; `pagedllm` adds every registered command after its built-in
    ones. A name clashing with a built-in command is refused, and a command whose `load()` or `add_parser`
    fails is skipped, each with a warning naming its plugin and distribution (`pagedllm --help` still works).
    `load()` runs whenever `pagedllm` builds its parser: it and the flags must not import torch.

    :param register: call once per command; check() receives None.
    """


@hookspec
def register_tool_parsers(register: RegisterToolParser) -> None:
    """Register tool-call parsers (pagedllm.protocols.tool_parser), by the name `--tool-call-parser` gives.

    `load()` returns a class built once per chat request as `cls(ToolParserContext)`; it turns the model's
    text into OpenAI `tool_calls`, whole (`extract_tool_calls`) or delta by delta while streaming
    (`extract_tool_calls_streaming`). The server looks parsers up by name; nothing is selected automatically.

    :param register: call once per parser; check() receives None.
    """


@hookspec
def register_reasoning_parsers(register: RegisterReasoningParser) -> None:
    """Register reasoning parsers (pagedllm.protocols.reasoning_parser), by the name `--reasoning-parser` gives.

    `load()` returns a class built once per chat request as `cls(ReasoningParserContext)`; it splits the
    model's text into `reasoning_content` and `content`, whole or delta by delta while streaming.

    :param register: call once per parser; check() receives None.
    """


@hookspec
def register_kv_connectors(register: RegisterKVConnector) -> None:
    """Register KV connectors (pagedllm.protocols.kv_connector): stores of KV blocks beyond the device pool.

    `load()` returns a class built once per engine as `cls(KVConnectorContext)`. Only the connector the
    config's `kv_transfer.kv_connector` names is used (none by default: no connector, no cost).

    :param register: call once per connector; check() receives the engine's `KVConnectorCheckContext`
        (device, KV-cache groups, world size, prefix caching): return reasons it cannot serve that engine.
    """


@hookspec
def register_structured_output_backends(register: RegisterStructuredOutputBackend) -> None:
    """Register structured-output backends (pagedllm.protocols.structured_output), e.g. xgrammar, llguidance.

    `load()` returns a class built once per engine as `cls(StructuredOutputContext)` that compiles a request's
    `StructuredOutputsParams` into grammars masking its logits. Per request, `params.backend` or the config's
    `structured_outputs.backend` names one; otherwise the highest-priority backend whose check passes serves it.

    :param register: call once per backend; check() receives the request's `StructuredOutputsParams`
        (`StructuredOutputCheckContext`): return reasons for a constraint the backend cannot compile.
    """


@hookspec
def config_loaded(config: EngineConfig) -> None:
    """The engine config was read and validated (plugin sections included), before anything is built.

    Fires once per engine, in each process that builds one. Read your `config.plugins[<name>]` here; raise
    to refuse the config (the error reaches the user as is). Do not mutate `config`.

    :param config: the validated EngineConfig.
    """


@hookspec
def request_added(request: Request) -> None:
    """A request was handed to the engine core (after tokenization; once per sample when n > 1).

    Fires in the process holding the frontend (LLMEngine or the server's AsyncLLM). Must be cheap: it runs
    on the request's path.

    :param request: the core `Request` (request_id, prompt_token_ids, sampling_params, priority).
    """


@hookspec
def step_stats(stats: SchedulerStats, num_scheduled_tokens: int, num_requests: int) -> None:
    """One engine step finished (fires in the engine-core process, after the scheduler applied the outputs).

    :param stats: the scheduler's counters after the step (running, waiting, KV usage, preemptions...).
    :param num_scheduled_tokens: tokens the step computed.
    :param num_requests: requests the step scheduled.
    """


@hookspec
def engine_started(engine: Any) -> None:
    """The engine finished building (model loaded, KV cache allocated).

    :param engine: the frontend that built it: the offline `LLMEngine`, or the server's `AsyncLLM`.
    """


@hookspec
def engine_stopped(engine: Any) -> None:
    """The engine is shutting down.

    :param engine: the frontend shutting it down (the one `engine_started` received).
    """


@hookspec
def request_finished(output: Any) -> None:
    """A request reached a final state.

    :param output: its final `RequestOutput`.
    """


@hookspec
def server_app_created(app: Any, engine: Any) -> None:
    """The HTTP server's app was built (for the default `openai` entrypoint: a FastAPI app, before it starts).

    Add routes, middleware or exception handlers here.

    :param app: the server's app (a FastAPI app for `openai`).
    :param engine: the `AsyncLLM` the app serves.
    """
