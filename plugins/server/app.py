"""The FastAPI app: routes, API-key / drain / body-size middleware, error handlers, metrics, plugin hook.

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
from pagedllm.plugins.server.docs_ui import install_docs
from pagedllm.plugins.server.errors import (
    ERROR_RESPONSES,
    APIError,
    error_body,
    from_exception,
    install_handlers,
    retry_after_headers,
)
from pagedllm.plugins.server.lifecycle import ServerState, shutting_down_error
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
    publish_limits,
)
from pagedllm.plugins.server.responses_protocol import ResponseObject, ResponsesRequest
from pagedllm.plugins.server.serving_chat import create_chat_completion
from pagedllm.plugins.server.serving_common import check_model, until_disconnected
from pagedllm.plugins.server.serving_completion import create_completion
from pagedllm.plugins.server.serving_responses import create_response
from pagedllm.plugins.server.tools import template_messages

ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[dict[str, Any]]], Callable[[dict[str, Any]], Awaitable[None]]],
                   Awaitable[None]]

# With an API key set, every path needs it -- routes a plugin adds too, and unknown paths (a 401, not a 404
# that would map the routes) -- except these: probes and scrapers carry no key.
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})

_SSE_200: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}},
}


def package_version() -> str:
    """The installed pagedllm's version (what /version answers)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagedllm")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


class _Guard:
    """Pure-ASGI middleware (it must not buffer streaming responses): API key, drain, then body-size limit."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, state: ServerState,
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.open_paths = open_paths
        self.max_body = max_body_bytes
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        path = scope["path"]
        if self.api_key is not None and path not in self.open_paths:
            given = headers.get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            # compare_digest: the time taken does not reveal how many leading bytes matched.
            if not hmac.compare_digest(token, self.api_key):
                await _send_error(send, 401, "Incorrect or missing API key (send 'Authorization: Bearer <key>')",
                                  code="invalid_api_key", extra_headers=[(b"www-authenticate", b"Bearer")])
                return
        if self.state.draining and path not in OPEN_PATHS:  # lifecycle.py NOTE 2
            err = shutting_down_error()
            await _send_error(send, err.status, err.message, code=err.code, extra_headers=[(b"connection", b"close")])
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await _send_error(send, 413, f"request body exceeds {self.max_body} bytes", code="request_too_large")
            return
        # A chunked body carries no content-length: count it as it arrives. Past the limit, the 413 is sent
        # from here and the app sees a disconnect (raising inside receive() would reach FastAPI's body
        # parser, which turns any error into a 400).
        received = 0
        rejected = started = False

        async def limited_receive() -> dict[str, Any]:
            nonlocal received, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message: dict[str, Any] = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    rejected = True
                    if not started:
                        await _send_error(send, 413, f"request body exceeds {self.max_body} bytes",
                                          code="request_too_large", extra_headers=[(b"connection", b"close")])
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            nonlocal started
            if rejected:
                return  # the 413 above is this request's response
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not rejected:
                raise


async def _send_error(send: Any, status: int, message: str, param: str | None = None, code: str | None = None,
                      extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(status, message, param, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in retry_after_headers(status).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})


def build_app(engine: AsyncLLM, api_key: str | None = None, max_body_bytes: int = 4 << 20,
              state: ServerState | None = None, ui: bool = False) -> FastAPI:
    """The app over `engine`; `ui`: also the web chat and engine dashboard at `/` (ui/routes.py)."""
    # FastAPI's own /docs and /redoc load their assets from a CDN: docs_ui.py serves them from here instead.
    app = FastAPI(title="pagedllm OpenAI-compatible API", version="0.1.0", docs_url=None, redoc_url=None)
    install_docs(app)
    state = state or ServerState()
    app.state.engine = engine
    app.state.lifecycle = state
    app.state.metrics = ServerMetrics(engine)
    install_handlers(app)
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        # The served model's vocabulary and name written in (protocol.publish_limits), once the core is ready.
        if app.openapi_schema is None:
            schema = default_openapi()
            app.openapi_schema = publish_limits(schema, engine.ready.vocab_size, engine.model_name,
                                                kv_connector=bool(engine.config.kv_transfer.kv_connector))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    async def guarded(raw: Request, work: Callable[[], Awaitable[Any]]) -> Any:
        # Watched from the start: a client that leaves while its prompts wait for their first tokens
        # aborts them all then, not when the engine is done with them.
        try:
            return await until_disconnected(raw, work)
        except Exception as exc:
            raise from_exception(exc) from exc

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if state.draining:
            err = shutting_down_error()
            return JSONResponse(error_body(503, err.message, None, err.code), status_code=503,
                                headers=retry_after_headers(503))
        if engine.healthy:
            return JSONResponse({})
        reason = engine.dead_reason or "the engine core is not running"
        return JSONResponse(error_body(503, reason, None, "engine_dead"), status_code=503,
                            headers=retry_after_headers(503))

    # vLLM's (and SageMaker's) liveness probe: the same answer as /health.
    app.add_api_route("/ping", health, methods=["GET", "POST"], responses={503: {"model": ErrorResponse}})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": package_version()}

    @app.get("/v1/models", response_model=ModelList, responses={401: {"model": ErrorResponse}})
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=engine.model_name, root=engine.config.model or engine.model_name,
                                         max_model_len=engine.max_model_len)])

    @app.post("/v1/completions", response_model=CompletionResponse, responses={**_SSE_200, **ERROR_RESPONSES})
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return await guarded(raw, lambda: create_completion(engine, body, raw))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**_SSE_200, **ERROR_RESPONSES})
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return await guarded(raw, lambda: create_chat_completion(engine, body, raw))

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        check_model(engine, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt", "invalid_value")
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", "prompt")
        try:
            if body.messages is not None:
                # As chat completions renders them (tools.template_messages, the tools), so the counts agree.
                tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
                ids = engine.apply_chat_template(template_messages(body.messages),
                                                 add_generation_prompt=body.add_generation_prompt, tools=tools)
            else:
                ids = list(engine.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids)
        except APIError:
            raise  # already names its field (template_messages: messages)
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

    @app.post("/v1/responses", responses={200: {"model": ResponseObject, **_SSE_200[200]}, **ERROR_RESPONSES})
    async def responses_create(body: ResponsesRequest, raw: Request) -> Any:
        return await guarded(raw, lambda: create_response(engine, body, raw))

    @app.api_route("/v1/responses/{rest:path}", methods=["GET", "POST", "DELETE"], include_in_schema=False)
    async def responses_stored() -> Response:
        # serving_responses.py keeps no responses: retrieving, cancelling or deleting one is a clear 404.
        return JSONResponse(error_body(404, "this server keeps no responses (store is not supported), so there is "
                                       "none to retrieve, cancel or delete", None, "not_found"), status_code=404)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics() -> Response:
        return Response(app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    open_paths = OPEN_PATHS
    if ui:
        from pagedllm.plugins.server.ui.routes import PUBLIC_PATHS, install_ui

        app.state.dashboard = install_ui(app, engine, lambda: state.draining)
        open_paths = OPEN_PATHS | PUBLIC_PATHS  # the page, not its data: it must load to ask for the key
    engine.pm.hook.server_app_created(app=app, engine=engine)
    # Outermost, so a rejected key or an oversized body never reaches routing or the engine.
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes, state=state,  # type: ignore[arg-type]
                       open_paths=open_paths)
    return app
