"""The server's SSE events (serving_common.sse): msgspec-framed, read back by `json` as what `json` would write."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("msgspec")

from pagedllm.plugins.server.serving_common import sse, sse_error  # noqa: E402

CHUNK = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
         "choices": [{"index": 0, "text": "caf\u00e9 \U0001f600 \"q\"\n\t\\ \u2028", "logprobs": None,
                      "finish_reason": None, "stop_reason": None}],
         "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4, "prompt_tokens_details": None}}


def _payload(event: bytes) -> str:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n\n") == 1
    return event[6:-2].decode("utf-8")


def test_a_chunk_reads_back_equal() -> None:
    payload = _payload(sse(CHUNK))
    assert json.loads(payload) == CHUNK
    assert "\u00e9" in payload and "\U0001f600" in payload  # UTF-8 as json's ensure_ascii=False writes it
    assert "\n" not in payload  # one event, one data line


def test_done_and_errors() -> None:
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    err = json.loads(_payload(sse_error(ValueError("bad value"))))
    assert "message" in err["error"]


def test_exact_floats_keep_minus_infinity() -> None:
    body = {"choices": [{"logprobs": {"token_logprobs": [-0.25, -math.inf]}}]}
    back = json.loads(_payload(sse(body, exact_floats=True)))
    assert back == body and json.dumps(back) == json.dumps(body)
    # The fast framing writes the non-finite float as null: why chunks with logprobs take exact_floats.
    assert json.loads(_payload(sse(body)))["choices"][0]["logprobs"]["token_logprobs"] == [-0.25, None]
