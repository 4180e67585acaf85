"""A bounded schemathesis run over the server's own OpenAPI schema: no 5xx, no response-schema violations.

Loopback only, a few examples per operation, and generation lengths capped (max_tokens <= 3, n <= 2) so
fuzzed requests stay cheap on a shared two-core machine; everything else is as schemathesis generates it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from test_server_support import LiveServer, live_server  # noqa: E402

API_KEY = "sk-schema"
MAX_EXAMPLES = 8

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(default_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("server_schema") / "server.log"
    args = ["--model", default_gguf, "--served-model-name", "smollm2", "--api-key", API_KEY,
            "--max-model-len", "256", "--max-body-bytes", "65536"]
    with live_server(args, str(log)) as srv:
        yield srv


def _cap(case: Any) -> Any:
    """Keep fuzzed generations short; leave everything else (including invalid values) untouched."""
    body = case.body
    if isinstance(body, dict):
        # The Responses API names its limit max_output_tokens (and has no max_tokens field to add).
        keys = ("max_output_tokens",) if case.path == "/v1/responses" else ("max_tokens", "max_completion_tokens")
        for key in keys:
            value = body.get(key)
            too_long = isinstance(value, int) and not isinstance(value, bool) and value > 3
            if value is None or too_long:
                body[key] = 3
        if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 2:
            body["n"] = 2
        body.pop("min_tokens", None)
    return case


def test_schemathesis_finds_no_server_errors(server: LiveServer) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}  # the key covers every path but /health and /metrics
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=headers, timeout=30)
    checks = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]
    operations = [result.ok() for result in schema.get_all_operations()]
    statuses: list[int] = []
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/health"}
    for op in operations:

        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy().map(_cap) if op.method.upper() == "POST" else op.as_strategy())
        def check(case: Any) -> None:
            statuses.append(case.call_and_validate(headers=headers, checks=checks, timeout=120).status_code)

        check()
    # The run really exercised the server: valid requests succeeded and invalid ones were refused.
    assert len(statuses) >= 2 * len(operations)
    assert 200 in statuses and 400 in statuses, sorted(set(statuses))
