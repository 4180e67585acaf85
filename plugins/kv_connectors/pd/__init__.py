"""Registers the `pd` KV connector: disaggregated prefill and decode, a request's prompt KV moved between engines.

A prefill engine (`role: kv_producer`) runs a request's prefill and keeps its full prompt blocks (every layer)
for a decode engine (`role: kv_consumer`), which fetches them over TCP and admits the request with those
tokens computed (`num_cached_tokens`). Which requests take part is said per request, in
`SamplingParams.extra_args["kv_transfer_params"]` (the server's `kv_transfer_params` field, vLLM's shape);
the router (`pagedllm disagg`) writes them. Light module: no torch import here (connector.py imports it
when the engine builds the connector). Used only when named (`kv_transfer: {kv_connector: pd}`), with its
options in `plugins.pd`. docs/disaggregated_serving.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.api import KVConnectorCheckContext, RegisterKVConnector, hookimpl

# 1.5: the optional `request_finished` member (the producer copies the prompt's blocks there).
PAGEDLLM_PLUGIN_API = ">=1.5,<2"


class PDOptions(BaseModel):
    """`plugins.pd`: the engine's role and where its KV server listens (validated: a typo is an error)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["kv_producer", "kv_consumer", "kv_both"] = Field(
        ..., description="vLLM's kv_role: kv_producer = a prefill engine that serves prompt KV; kv_consumer = a "
        "decode engine that fetches it; kv_both = both",
    )
    host: str = Field("127.0.0.1", description="kv_producer: the address its KV server binds")
    port: int = Field(0, ge=0, le=65535, description="kv_producer: the KV server's TCP port (0 = any free port, "
                      "logged; a router must then be told it)")
    transfer_timeout_s: float = Field(
        5.0, gt=0, description="kv_consumer: seconds a fetch may take (connect, header and payload) before the "
        "request falls back to local prefill",
    )
    hold_s: float = Field(60.0, gt=0, description="kv_producer: seconds a request's KV waits to be fetched")
    max_held_gb: float = Field(
        2.0, gt=0, description="kv_producer: host memory for KV waiting to be fetched; the oldest goes first "
        "(its decode request then prefills locally)",
    )


def _load() -> Any:
    from pagedllm.plugins.kv_connectors.pd.connector import PDConnector

    return PDConnector


def _check(ctx: KVConnectorCheckContext) -> list[str]:
    reasons = []
    if ctx.num_kv_groups != 1:
        reasons.append(f"one KV-cache group only (this model has {ctx.num_kv_groups}: mixed layer types)")
    if ctx.num_kv_groups == 1 and ctx.kv_spec_types != ("FullAttentionSpec",):
        # A sliding window's or a Mamba state's blocks are not the prompt's KV block by block.
        reasons.append(f"full attention only (this model's KV cache is {ctx.kv_spec_types[0]})")
    if ctx.world_size != 1:
        reasons.append(f"one rank only for now (tensor x pipeline parallel = {ctx.world_size})")
    return reasons


@hookimpl
def register_kv_connectors(register: RegisterKVConnector) -> None:
    register(
        "pd", _load, check=_check, config_model=PDOptions, explicit_only=True,
        description="disaggregated prefill/decode: a prefill engine's prompt KV fetched by a decode engine (TCP)",
    )
