"""Registers this package's components. Light on purpose: torch and pagedllm internals load in `load()`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.api import hookimpl

# The pagedllm plugin API this package was written against; another major version skips it with a warning.
PAGEDLLM_PLUGIN_API = ">=1,<2"


class BanTokensConfig(BaseModel):
    """The config's `plugins.ban_tokens` section."""

    model_config = ConfigDict(extra="forbid")
    token_ids: list[int] = Field(default_factory=list, description="token ids never sampled, for every request")


def _spf() -> Any:
    from pagedllm_example_plugins.spf_scheduler import ShortestPromptFirstScheduler

    return ShortestPromptFirstScheduler


def _stats_torch() -> Any:
    from pagedllm_example_plugins.stats_backend import StatsTorchBackend

    return StatsTorchBackend


def _ban_tokens() -> Any:
    from pagedllm_example_plugins.ban_tokens import BanTokensProcessor

    return BanTokensProcessor


@hookimpl
def register_schedulers(register: Any) -> None:
    register("spf", _spf, description="shortest prompt first")


@hookimpl
def register_attention_backends(register: Any) -> None:
    # explicit_only: a debugging aid, never picked automatically over a real backend.
    register("stats_torch", _stats_torch, priority=-1, explicit_only=True,
             description="the torch backend, recording tokens and requests per step")


@hookimpl
def register_logits_processors(register: Any) -> None:
    register("ban_tokens", _ban_tokens, config_model=BanTokensConfig,
             description="never sample the configured token ids")
