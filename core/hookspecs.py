"""The pluggy hook specifications: every way a plugin talks to pagedllm.

Registration hooks receive a `register` callable (simonw/llm style) so one plugin module may offer several
components; each call is attributed to the plugin (and its distribution) that made it. A registration is
light: it names the component and gives a zero-argument `load` that imports the implementation when the
component is actually used, so discovering plugins never imports torch kernels, triton or fastapi.

`register(name, load, *, priority=0, requires=(), check=None, description="", **meta)`:

- name: the component's name (for models, the HF `architectures` name it implements).
- load: `() -> object`, imports and returns the component (a class, usually).
- priority: higher wins when several pass their checks.
- requires: importable module names the component needs; a missing one makes it unavailable, with a reason.
- check: `(context) -> list[str]`, reasons the component cannot serve this context (empty: it can).
- meta: extra, kind-specific facts (e.g. `spec_type` for KV managers; `explicit_only=True` keeps a
  component out of automatic selection, as for the `dummy` loader; `override=True` replaces a component of
  the same name registered earlier; `config_model=<pydantic model>` validates the config's
  `plugins.<name>` section, errors naming `plugins.<name>.<key>`).

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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: importing the hookspecs must stay torch-free
    from pagedllm.config import EngineConfig
    from pagedllm.request import Request
    from pagedllm.sched.stats import SchedulerStats

import pluggy

hookspec = pluggy.HookspecMarker("pagedllm")
hookimpl = pluggy.HookimplMarker("pagedllm")

Register = Callable[..., None]


@hookspec
def register_attention_backends(register: Register) -> None:
    """Register attention backends. check() receives an `AttentionSelectionContext`.

    A backend whose rank depends on the machine may pass `priority_for=<callable(context) -> int>` as meta;
    the selector then ranks it by that instead of the fixed `priority` (pagedllm.selector.effective_priority).
    """


@hookspec
def register_kv_managers(register: Register) -> None:
    """Register single-type KV managers; pass `spec_type=<KVCacheSpec subclass>` as meta."""


@hookspec
def register_schedulers(register: Register) -> None:
    """Register schedulers, selected by the config's `scheduler.name`."""


@hookspec
def register_loaders(register: Register) -> None:
    """Register model loaders. check() receives the model reference (a path or alias string)."""


@hookspec
def register_quantization_methods(register: Register) -> None:
    """Register quantization configs, by the checkpoint's `quant_method` name."""


@hookspec
def register_models(register: Register) -> None:
    """Register model architectures, by the HF `architectures` name."""


@hookspec
def register_entrypoints(register: Register) -> None:
    """Register entrypoints (e.g. the `serve` app)."""


@hookspec
def register_logits_processors(register: Register) -> None:
    """Register named logits processors; the config's `logits_processors: [name, ...]` turns them on.

    `load()` returns a class built once per engine as `cls(LogitsProcessorContext)` (pagedllm.sample.
    logits_processor) whose `apply(logits, batch) -> logits` runs on each step's [B, V] float32 logits before
    penalties and temperature. Pass `config_model=` to validate its `plugins.<name>` section.
    """


@hookspec
def register_executors(register: Register) -> None:
    """Register executors: how one engine replica runs its tensor-parallel ranks (pagedllm.protocols.executor).

    check() receives the config's `parallel` section; the config's `parallel.executor` names one, else the
    highest-priority executor whose check passes is used.
    """


@hookspec
def register_proposers(register: Register) -> None:
    """Register speculative-decoding proposers, selected by the config's `speculative.method`.

    `load()` returns a class built once per engine as `cls(ProposerContext)` (pagedllm.spec_decode.proposer)
    that guesses the next tokens of each request; the target model verifies them and rejection sampling
    keeps its output distribution exact. check() receives the config's `SpeculativeConfig` section.
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
    """The engine finished building (model loaded, KV cache allocated)."""


@hookspec
def engine_stopped(engine: Any) -> None:
    """The engine is shutting down."""


@hookspec
def request_finished(output: Any) -> None:
    """A request reached a final state; `output` is its final RequestOutput."""


@hookspec
def server_app_created(app: Any, engine: Any) -> None:
    """The HTTP server's app was built (for the default `openai` entrypoint: a FastAPI app, before it starts).

    Add routes, middleware or exception handlers here. `engine` is the `AsyncLLM` the app serves.
    """
