"""Structured outputs over HTTP: OpenAI's `response_format` and vLLM's `structured_outputs` body field.

Both become one `StructuredOutputsParams` (SamplingParams.structured_outputs); the engine's request builder then
validates it with the backend that will serve it, and a failure is a 400 whose `param` names what the client
sent: `response_format.json_schema.schema` for a bad OpenAI schema, `structured_outputs.regex` for a bad vLLM
regex. `strict` is accepted either way: the grammar always holds the output to the schema (as vLLM does).
"""

from __future__ import annotations

from typing import Any

from pagedllm.api.engine import AsyncLLM, RequestValidationError
from pagedllm.api.sched import StructuredOutputsParams
from pagedllm.plugins.server.errors import APIError
from pagedllm.plugins.server.response_format import ResponseFormat, StructuredOutputsBody


def structured_outputs_of(body: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the request parameter to name in its errors) from a completion or chat body."""
    fmt: ResponseFormat | None = getattr(body, "response_format", None)
    so: StructuredOutputsBody | None = getattr(body, "structured_outputs", None)
    if so is not None:
        if fmt is not None and fmt.type != "text":
            raise APIError(400, "give either response_format or structured_outputs, not both", "response_format")
        fields = so.model_dump(by_alias=True)
        try:
            return StructuredOutputsParams(**fields), "structured_outputs"
        except ValueError as exc:
            raise APIError(400, str(exc), "structured_outputs") from None
    if fmt is None or fmt.type == "text":
        return None, None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    assert fmt.json_schema is not None
    if fmt.json_schema.schema_ is None:
        raise APIError(400, "response_format.json_schema.schema is required", "response_format.json_schema.schema")
    return StructuredOutputsParams(json=fmt.json_schema.schema_), "response_format.json_schema.schema"


def check_structured_outputs(engine: AsyncLLM, params: StructuredOutputsParams, origin: str) -> None:
    """Validate with the engine's backends now, so the 400 names the field the client sent (`origin`)."""
    try:
        engine.requests.validate_structured_outputs(params)
    except RequestValidationError as exc:
        param = origin
        if origin == "structured_outputs" and exc.param and exc.param.startswith("structured_outputs."):
            param = exc.param  # the constraint's own field, e.g. structured_outputs.regex
        message = str(exc)
        if origin.startswith("response_format"):
            message = message.split(": ", 1)[-1] if message.startswith("structured_outputs.") else message
            message = f"{origin}: {message}"
        raise APIError(400, message, param, "invalid_value") from None
