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
  component out of automatic selection, as for the `dummy` loader).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("pagedllm")
hookimpl = pluggy.HookimplMarker("pagedllm")

Register = Callable[..., None]


@hookspec
def register_attention_backends(register: Register) -> None:
    """Register attention backends. check() receives an `AttentionSelectionContext`."""


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
