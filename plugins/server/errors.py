"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, and the handlers that make them.

Every failure a client can cause maps to a 4xx naming the parameter; engine trouble maps to 503 so load
balancers retry elsewhere; anything unexpected is a 500 with the same shape (never a bare traceback).
429 and 503 carry `Retry-After` (seconds), so well-behaved clients back off instead of hammering.
docs/operations.md lists every status and code.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError as FastAPIValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.api.engine import EngineDeadError, QueueFullError, RequestTimeoutError, RequestValidationError
from pagedllm.plugins.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("pagedllm.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}

# Documented on every generating route, so the OpenAPI schema lists each status the server may send.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 408, 413, 429, 500, 503)
}

# Seconds a client should wait before retrying: a full queue drains within a step or two; an engine that is
# restarting or a server that is draining needs longer (and a load balancer may send the retry elsewhere).
RETRY_AFTER_S = {429: 1, 503: 5}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    err = ErrorInfo(message=message, type=_TYPES.get(status, "invalid_request_error"), param=param, code=code)
    return ErrorResponse(error=err).model_dump()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers={**retry_after_headers(status), **(headers or {})})


def retry_after_headers(status: int) -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S[status])} if status in RETRY_AFTER_S else {}


def from_exception(exc: BaseException) -> APIError:
    """The API error for an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return APIError(400, str(exc), exc.param, "invalid_value")
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), None, "queue_full")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), None, "engine_dead")
    if isinstance(exc, RequestTimeoutError):
        return APIError(408, str(exc), None, "request_timeout")
    if isinstance(exc, ValueError):  # SamplingParams and the detokenizer name the field in their message
        return APIError(400, str(exc), _param_from_message(str(exc)), "invalid_value")
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error")


def _param_from_message(message: str) -> str | None:
    # SamplingParams errors read "SamplingParams.<field> must ..."
    if message.startswith("SamplingParams."):
        return message.split(".", 1)[1].split(" ", 1)[0]
    return None


def _reason(error: Any) -> str:
    # protocol.py NOTE 1: a field we do not implement is refused rather than dropped; say so plainly.
    if error.get("type") == "extra_forbidden":
        return "this server does not implement this field (it would otherwise be silently ignored)"
    return str(error.get("msg"))


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return error_response(exc.status, exc.message, exc.param, exc.code, headers)

    @app.exception_handler(FastAPIValidationError)
    async def _validation(_: Request, exc: FastAPIValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        # loc is ("body", "field", ...): name the top-level field, as OpenAI's `param` does.
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        # A body that is not JSON at all has no field to name (its loc is a character offset).
        param = loc[0] if loc and first.get("type") != "json_invalid" else None
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {_reason(e)}" for e in errors[:5]
        )
        code = "unsupported_field" if first.get("type") == "extra_forbidden" else "invalid_value"
        return error_response(400, message or "invalid request", param, code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), None, None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        err = from_exception(exc)
        return error_response(err.status, err.message, err.param, err.code)
