"""The disaggregated-serving router: each request is prefilled on one server and decoded on another.

For POST /v1/completions and /v1/chat/completions (vLLM's disagg proxy, examples/online_serving/
disaggregated_serving): a transfer id is drawn; the request goes to the prefill server with max_tokens=1,
not streamed, and `kv_transfer_params: {do_remote_decode: true, transfer_id}`; its answer is dropped. Then the
original request goes to the decode server with `kv_transfer_params: {do_remote_prefill: true, transfer_id,
remote_host, remote_port}`, and the decode server's answer (status, headers' content type, body: streamed
byte for byte when it streams) is the client's.

NOTEs:

1. Nothing is lost when the prefill side fails. A prefill request that errors, times out or finds no server
   sends the decode request without transfer parameters (the decode engine prefills the whole prompt
   itself); a transfer that fails after a good prefill answer (the prefill process died, the KV expired, a
   checksum) is the decode engine's fallback (plugins/kv_connectors/pd NOTE 1). Greedy tokens are the same
   either way: the transferred KV is the KV the decode engine would have computed.
2. The prefill answer is awaited before the decode request is sent: the prefill engine holds the blocks
   once its response is out (request_finished runs before the output leaves the engine core), so the decode
   engine's fetch never races the prefill.
3. Everything else (GET /v1/models, /health, ...) goes to the decode server unchanged. Beam search
   (`use_beam_search`) is not split: it goes to the decode server whole.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

# Imported with the proxy only (the command's registration and cli.py stay light); at module level because
# FastAPI resolves the handlers' (postponed) annotations in this module's namespace.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

log = logging.getLogger("pagedllm.disagg")

_PASSED_HEADERS = ("authorization", "content-type", "traceparent", "x-request-id")


@dataclass
class _Upstream:
    scheme: str
    host: str
    port: int
    base_path: str

    @classmethod
    def parse(cls, url: str) -> _Upstream:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) server URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

    def connect(self, timeout: float | None) -> http.client.HTTPConnection:
        conn_cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return conn_cls(self.host, self.port, timeout=timeout)


@dataclass
class RouterStats:
    requests: int = 0
    prefilled_remotely: int = 0  # prefill answered 200: the decode request carried transfer parameters
    prefill_failures: int = 0  # NOTE 1: the decode server prefilled these itself
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, key: str) -> None:
        with self.lock:
            setattr(self, key, getattr(self, key) + 1)

    def as_dict(self) -> dict[str, int]:
        return {"requests": self.requests, "prefilled_remotely": self.prefilled_remotely,
                "prefill_failures": self.prefill_failures}


def prefill_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """The prefill server's copy of a request: one token, not streamed, told to keep the prompt's KV."""
    out = dict(body)
    for name in ("stream_options", "max_completion_tokens", "min_tokens"):
        out.pop(name, None)
    out.update(max_tokens=1, stream=False, n=1,
               kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id})
    return out


class Router:
    def __init__(self, prefill_url: str, prefill_kv: tuple[str, int], decode_url: str,
                 prefill_timeout_s: float = 30.0) -> None:
        self.prefill, self.decode = _Upstream.parse(prefill_url), _Upstream.parse(decode_url)
        self.prefill_kv = prefill_kv
        self.prefill_timeout_s = prefill_timeout_s
        self.stats = RouterStats()

    def run_prefill(self, path: str, body: dict[str, Any], headers: dict[str, str], transfer_id: str) -> bool:
        """True when the prefill server answered 200 (it then holds the prompt's KV under `transfer_id`)."""
        conn = self.prefill.connect(self.prefill_timeout_s)
        try:
            conn.request("POST", self.prefill.base_path + path, json.dumps(prefill_body(body, transfer_id)),
                         {**headers, "content-type": "application/json"})
            resp = conn.getresponse()
            answer = resp.read()
            if resp.status != 200:
                log.warning("prefill server answered %d (%s): decoding with a local prefill", resp.status,
                            answer[:300].decode(errors="replace"))
                return False
            return True
        except (OSError, http.client.HTTPException) as exc:
            log.warning("prefill server failed (%s): decoding with a local prefill", exc)
            return False
        finally:
            conn.close()

    def open_decode(self, method: str, path: str, raw: bytes | None,
                    headers: dict[str, str]) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self.decode.connect(None)  # a decode runs as long as it must; the client decides when to quit
        conn.request(method, self.decode.base_path + path, raw, headers)
        return conn, conn.getresponse()

    def decode_body(self, body: dict[str, Any], transfer_id: str | None) -> bytes:
        if transfer_id is None:
            return json.dumps(body).encode()
        host, port = self.prefill_kv
        params = {"do_remote_prefill": True, "transfer_id": transfer_id, "remote_host": host, "remote_port": port}
        return json.dumps({**body, "kv_transfer_params": params}).encode()


def passed_headers(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() in _PASSED_HEADERS}


def stream_body(conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> Iterator[bytes]:
    """The upstream body as it arrives (an SSE stream chunk by chunk), closing the connection at the end or
    when the client goes away (the decode server then sees the disconnect and aborts the request)."""
    try:
        while chunk := resp.read1(65536):
            yield chunk
    finally:
        conn.close()


def make_app(router: Router) -> FastAPI:
    app = FastAPI(title="pagedllm disagg router", docs_url=None, redoc_url=None, openapi_url=None)

    def error(status: int, message: str, param: str | None = None) -> Response:
        kind = "invalid_request_error" if status < 500 else "upstream_error"
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                            status_code=status)

    async def relay(method: str, path: str, raw: bytes | None, headers: dict[str, str]) -> Response:
        try:
            conn, resp = await run_in_threadpool(router.open_decode, method, path, raw, headers)
        except (OSError, http.client.HTTPException) as exc:
            return error(502, f"the decode server failed: {exc}")
        content_type = resp.getheader("content-type", "application/json")
        if content_type.startswith("text/event-stream"):
            return StreamingResponse(stream_body(conn, resp), status_code=resp.status, media_type=content_type)
        try:
            data = await run_in_threadpool(resp.read)
        finally:
            conn.close()
        return Response(data, status_code=resp.status, media_type=content_type)

    @app.get("/router/stats")
    async def stats() -> dict[str, int]:
        return router.stats.as_dict()

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def split(request: Request) -> Response:
        path = request.url.path
        raw = await request.body()
        headers = passed_headers(request.headers)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict) or body.get("use_beam_search"):
            return await relay("POST", path, raw, headers)  # the decode server's own 400, or NOTE 3
        if "kv_transfer_params" in body:
            return error(400, "kv_transfer_params is the router's to set: send the request without it",
                         "kv_transfer_params")
        router.stats.add("requests")
        transfer_id = uuid.uuid4().hex
        prefilled = await run_in_threadpool(router.run_prefill, path, body, headers, transfer_id)
        router.stats.add("prefilled_remotely" if prefilled else "prefill_failures")
        # NOTE 1: without a prefill, no transfer parameters: the decode server computes the prompt.
        return await relay("POST", path, router.decode_body(body, transfer_id if prefilled else None),
                           {**headers, "content-type": "application/json"})

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def other(path: str, request: Request) -> Response:
        raw = await request.body()
        query = f"?{request.url.query}" if request.url.query else ""
        return await relay(request.method, f"/{path}{query}", raw or None, passed_headers(request.headers))

    return app
