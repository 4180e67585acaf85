"""Registers the Mamba KV manager (one constant-size state block per request, no prefix caching)."""

from __future__ import annotations

from typing import Any

from pagedllm.api import RegisterKVManager, hookimpl


def _load() -> Any:
    from pagedllm.plugins.kvmanagers.mamba.manager import MambaManager

    return MambaManager


@hookimpl
def register_kv_managers(register: RegisterKVManager) -> None:
    from pagedllm.api import MambaSpec

    register(
        "mamba",
        _load,
        spec_type=MambaSpec,
        description="Mamba state: one block per request (conv + SSM state), constant in the request's length",
    )
