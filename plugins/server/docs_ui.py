"""/docs (Swagger UI) and /redoc served from this machine: no CDN, so they work on an air-gapped host.

FastAPI's own pages load swagger-ui and redoc from a CDN (and a favicon from fastapi.tiangolo.com). Here the
assets come from the `fastapi-offline` package (a `pagedllm[server]` dependency; MIT, with Swagger UI 5 under
Apache-2.0 and Redoc under MIT, their licences shipped in it), served under ASSETS_PATH, and the pages are
FastAPI's HTML pointing there. Swagger UI's validator badge is off: it would send the schema to
validator.swagger.io. Without the package the pages answer a 404 that says what to install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from pagedllm.plugins.server.errors import error_body

ASSETS_PATH = "/docs/assets"
DOCS_PATH, REDOC_PATH, OAUTH2_REDIRECT_PATH = "/docs", "/redoc", "/docs/oauth2-redirect"


def asset_dir() -> Path | None:
    """fastapi-offline's static folder (swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js,
    favicon.png), found without importing the package; None when it is not installed."""
    spec = importlib.util.find_spec("fastapi_offline")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "static"
    return folder if (folder / "swagger-ui-bundle.js").is_file() else None


def install_docs(app: FastAPI) -> None:
    """Add /docs, its OAuth2 redirect page, /redoc and the assets to an app built with docs_url=None and
    redoc_url=None."""
    folder = asset_dir()
    if folder is None:
        async def missing() -> Response:
            return JSONResponse(error_body(404, "the API docs need the fastapi-offline package, which serves their "
                                           "assets locally: pip install 'pagedllm[server]'", None, "not_found"),
                                status_code=404)

        for path in (DOCS_PATH, REDOC_PATH):
            app.add_api_route(path, missing, include_in_schema=False)
        return
    app.mount(ASSETS_PATH, StaticFiles(directory=folder), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get(DOCS_PATH, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=root + openapi_url, title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=root + OAUTH2_REDIRECT_PATH,
            swagger_js_url=f"{root}{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_PATH}/favicon.png",
            swagger_ui_parameters={"validatorUrl": None},
        )

    @app.get(OAUTH2_REDIRECT_PATH, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get(REDOC_PATH, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=root + openapi_url, title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS_PATH}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS_PATH}/favicon.png", with_google_fonts=False,
        )
