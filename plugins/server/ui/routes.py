"""Wire the web UI into the FastAPI app: `/` (the page), `/ui/static/*` (its files), `/ui/events` (the feed).

The page and its static files carry no data and are open even with `--api-key` (PUBLIC_PATHS): the page must
load to ask for the key. Everything with data -- /v1/* and the event stream -- stays behind the key, which the
page sends as an `Authorization: Bearer` header (it reads the event stream with fetch, not EventSource, so the
key never sits in a URL, where access logs would keep it).
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.api.engine import AsyncLLM
from pagedllm.plugins.server.errors import error_body
from pagedllm.plugins.server.ui.feed import DashboardFeed

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


def _static_files() -> dict[str, tuple[bytes, str]]:
    """Every shipped file, read once: name -> (bytes, content type). Only these names are ever served."""
    root = files("pagedllm.plugins.server.ui").joinpath("static")
    out: dict[str, tuple[bytes, str]] = {}
    for entry in root.iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if entry.is_file() and suffix in _TYPES:
            out[entry.name] = (entry.read_bytes(), _TYPES[suffix])
    return out


STATIC = _static_files()
PUBLIC_PATHS = frozenset({"/", *(f"/ui/static/{name}" for name in STATIC)})

# The page's own files may load only from this server: no CDN, no inline script a reply could smuggle in.
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; frame-ancestors 'none'")
_NO_STORE = {"cache-control": "no-cache", "content-security-policy": _CSP, "x-content-type-options": "nosniff"}


def install_ui(app: FastAPI, engine: AsyncLLM, draining: Any) -> DashboardFeed:
    feed = DashboardFeed(engine, draining)

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        body, media = STATIC["index.html"]
        return Response(body, media_type=media, headers=_NO_STORE)

    @app.get("/ui/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        found = STATIC.get(name)
        if found is None:
            return JSONResponse(error_body(404, f"the web UI has no file named {name!r}", "name", "not_found"),
                                status_code=404)
        return Response(found[0], media_type=found[1], headers=_NO_STORE)

    @app.get("/ui/events", include_in_schema=False)
    async def events() -> StreamingResponse:
        return StreamingResponse(feed.events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    return feed
