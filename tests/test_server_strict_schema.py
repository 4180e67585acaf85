"""The OpenAPI schema the server publishes is the one it enforces: requests schemathesis generates from
/openapi.json as valid are served (200), and requests it generates as invalid are refused with a 4xx.

Valid cases are narrowed only inside the valid space, to keep generation cheap on two shared cores
(max_tokens <= 3, n <= 2, min_tokens <= max_tokens, prompts truncated to fit the context), and integral
floats are sent as integers: JSON Schema cannot tell 15 from 15.0 (both are "integer"), while the server, as
OpenAI's typed schema and SDKs have it, takes only the integer spelling for an integer field (a number field
takes both). Invalid cases are sent exactly as generated. The server writes its vocabulary size and model name into the schema
(protocol.publish_limits), so a generated token id or model name is valid exactly when the server takes it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from test_server_support import LiveServer, live_server  # noqa: E402

API_KEY = "sk-strict-schema"
MAX_MODEL_LEN = 256
# Per operation and mode; more by hand: PAGEDLLM_SCHEMA_EXAMPLES=200.
EXAMPLES = int(os.environ.get("PAGEDLLM_SCHEMA_EXAMPLES", "12"))
# Other plugins' request fields (structured outputs, tool calling) validate their own contents (a JSON
# schema, a grammar, tool-call pairing) beyond what this schema says; valid cases leave them out.
OTHER_FEATURES = ("response_format", "structured_outputs", "tools", "tool_choice", "parallel_tool_calls")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(default_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("server_strict_schema") / "server.log"
    args = ["--model", default_gguf, "--served-model-name", "smollm2", "--api-key", API_KEY,
            "--max-model-len", str(MAX_MODEL_LEN), "--max-body-bytes", "1000000"]
    with live_server(args, str(log)) as srv:
        yield srv


def _integers(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integers(v) for v in value]
    if isinstance(value, dict):
        return {k: _integers(v) for k, v in value.items()}
    return value


def _narrow(case: Any) -> Any:
    case.body = body = _integers(case.body)
    if isinstance(body, dict) and case.operation.path == "/tokenize":
        # /tokenize renders messages and tools as chat does: the same rules beyond the schema.
        body.pop("tools", None)
        if isinstance(body.get("messages"), list):
            body["messages"] = _without_tool_turns(body["messages"])
    if isinstance(body, dict) and case.operation.path in ("/v1/completions", "/v1/chat/completions"):
        for key in OTHER_FEATURES:
            body.pop(key, None)
        if isinstance(body.get("messages"), list):
            body["messages"] = _without_tool_turns(body["messages"])
        for key in ("max_tokens", "max_completion_tokens"):
            if key in body or key == "max_tokens":
                body[key] = min(body.get(key) or 3, 3)
        body["n"] = min(body.get("n", 1), 2)
        if body.get("min_tokens", 0) > 3:
            body["min_tokens"] = 3
        # The last 128 prompt tokens leave room for the completion in any case.
        body["truncate_prompt_tokens"] = min(body.get("truncate_prompt_tokens") or 128, 128)
    if isinstance(body, dict) and case.operation.path == "/v1/responses":
        # Beyond the schema: the response store this server does not keep (a 400 naming the field), and the
        # tools' and text.format's own rules, as for chat above.
        for key in ("store", "previous_response_id", "tools", "tool_choice", "parallel_tool_calls", "text"):
            body.pop(key, None)
        if isinstance(body.get("input"), list):
            # function_call_output items answer an earlier call id; calls carry JSON arguments.
            body["input"] = [_short(item) for item in body["input"]
                             if isinstance(item, dict) and item.get("type", "message") in ("message", "reasoning")
                             ][:4] or "hi"
        elif isinstance(body.get("input"), str):
            body["input"] = body["input"][:200]
        body["instructions"] = body["instructions"][:200] if isinstance(body.get("instructions"), str) else None
        body["max_output_tokens"] = min(body.get("max_output_tokens") or 3, 3)
    return case


def _without_tool_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Tool turns carry tool calling's own pairing rules (a tool message answers a call id).
    return [{k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
            for m in messages if m.get("role") != "tool"] or [{"role": "user"}]


def _short(item: dict[str, Any]) -> dict[str, Any]:
    """An input item whose texts fit the context: 200 characters and 4 parts at most."""
    content = item.get("content")
    if isinstance(content, str):
        return {**item, "content": content[:200]}
    if isinstance(content, list):
        return {**item, "content": [{**p, "text": str(p.get("text", ""))[:200]} for p in content[:4]]}
    return item


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize",
                                  "/detokenize"])
def test_valid_cases_are_served_and_invalid_ones_refused(server: LiveServer, path: str) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", timeout=30, headers=headers)
    operation = schema[path]["POST"]
    refused: list[tuple[int, Any, str]] = []
    accepted: list[tuple[int, Any, str]] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(schemathesis.GenerationMode.POSITIVE).map(_narrow))
    def valid(case: Any) -> None:
        response = case.call(headers=headers, timeout=120)
        if response.status_code != 200:
            refused.append((response.status_code, case.body, response.text[:300]))

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(schemathesis.GenerationMode.NEGATIVE))
    def invalid(case: Any) -> None:
        response = case.call(headers=headers, timeout=120)
        if not 400 <= response.status_code < 500:
            accepted.append((response.status_code, case.body, response.text[:300]))

    valid()
    invalid()
    assert not refused, f"schema-valid requests refused: {refused[:3]}"
    assert not accepted, f"schema-invalid requests not refused with a 4xx: {accepted[:3]}"


def test_the_schema_carries_the_served_limits(server: LiveServer) -> None:
    import httpx

    spec = httpx.get(f"{server.url}/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
    text = str(spec)
    assert "x-token-id" not in text and "x-served-model" not in text  # every mark was replaced
    detok = spec["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]
    vocab = httpx.post(f"{server.url}/tokenize", json={"prompt": "hi"},
                       headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert vocab["count"] > 0
    assert detok["items"]["maximum"] == 49151  # SmolLM2's vocabulary: 49,152 tokens
    assert spec["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"] == ["smollm2", None]
