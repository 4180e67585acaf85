"""The FastAPI app: routes, API-key and body-size middleware, error handlers, metrics, plugin hook.

`build_app(engine, options)` only wires things; `run.serve` owns the process (engine start, uvicorn, drain).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.api.engine import AsyncLLM
from pagedllm.plugins.server.errors import (
    ERROR_RESPONSES,
    APIError,
    error_body,
    from_exception,
    install_handlers,
)
from pagedllm.plugins.server.metrics import ServerMetrics
from pagedllm.plugins.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.plugins.server.serving_chat import create_chat_completion
from pagedllm.plugins.server.serving_common import check_model
from pagedllm.plugins.server.serving_completion import create_completion

ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[dict[str, Any]]], Callable[[dict[str, Any]], Awaitable[None]]],
                   Awaitable[None]]

# Paths that need the API key when one is set; health and metrics stay open for probes and scrapers.
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")

_SSE_200: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}},
}


class _Guard:
    """Pure-ASGI middleware (it must not buffer streaming responses): API key, then body-size limit."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope["path"].startswith(_PROTECTED_PREFIXES):
            given = headers.get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            # compare_digest: the time taken does not reveal how many leading bytes matched.
            if not hmac.compare_digest(token, self.api_key):
                await _send_error(send, 401, "Incorrect or missing API key (send 'Authorization: Bearer <key>')",
                                  code="invalid_api_key", extra_headers=[(b"www-authenticate", b"Bearer")])
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await _send_error(send, 413, f"request body exceeds {self.max_body} bytes", code="request_too_large")
            return
        received = 0

        async def limited_receive() -> dict[str, Any]:
            nonlocal received
            message: dict[str, Any] = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:  # chunked bodies carry no content-length
                    raise APIError(413, f"request body exceeds {self.max_body} bytes", None, "request_too_large")
            return message

        await self.app(scope, limited_receive, send)


async def _send_error(send: Any, status: int, message: str, param: str | None = None, code: str | None = None,
                      extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(status, message, param, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})


def build_app(engine: AsyncLLM, api_key: str | None = None, max_body_bytes: int = 4 << 20) -> FastAPI:
    app = FastAPI(title="pagedllm OpenAI-compatible API", version="0.1.0")
    app.state.engine = engine
    app.state.metrics = ServerMetrics(engine)
    install_handlers(app)

    async def guarded(work: Awaitable[Any]) -> Any:
        try:
            return await work
        except Exception as exc:
            raise from_exception(exc) from exc

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if engine.healthy:
            return JSONResponse({})
        reason = engine.dead_reason or "the engine core is not running"
        return JSONResponse(error_body(503, reason, None, "engine_dead"), status_code=503)

    @app.get("/v1/models", response_model=ModelList, responses={401: {"model": ErrorResponse}})
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=engine.model_name, max_model_len=engine.max_model_len)])

    @app.post("/v1/completions", response_model=CompletionResponse, responses={**_SSE_200, **ERROR_RESPONSES})
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return await guarded(create_completion(engine, body, raw))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**_SSE_200, **ERROR_RESPONSES})
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return await guarded(create_chat_completion(engine, body, raw))

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        check_model(engine, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", "prompt")
        try:
            if body.messages is not None:
                msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
                ids = engine.apply_chat_template(msgs, add_generation_prompt=body.add_generation_prompt)
            else:
                ids = list(engine.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids)
        except Exception as exc:
            raise from_exception(exc if isinstance(exc, ValueError) else ValueError(str(exc))) from exc
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(engine, body.model)
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", "tokens")
        vocab = engine.ready.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=str(engine.tokenizer.decode(body.tokens)))

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics() -> Response:
        return Response(app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    engine.pm.hook.server_app_created(app=app, engine=engine)
    # Outermost, so a rejected key or an oversized body never reaches routing or the engine.
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)  # type: ignore[arg-type]
    return app
