"""The interactive API documentation, `/docs` (Swagger UI) and `/redoc`, with every asset served by
the pool service itself, so the pages work without internet access.

The JavaScript, CSS and favicon come from the `fastapi-offline` package (MIT; the Swagger UI and
ReDoc files it ships keep their Apache-2.0 and MIT licences): a dependency of the server extra,
not files copied into this repository.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response

from exgrpo_pool.errors import NotFound

ASSET_PREFIX = "/docs/assets"
#: The files the pages load, by name, with their media types.
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "redoc.standalone.js": "text/javascript; charset=utf-8",
    "favicon.png": "image/png",
}
TITLE = "ExGRPO experience pool"

router = APIRouter(tags=["docs"], include_in_schema=False)


def assets_dir() -> Path | None:
    """The folder of the documentation assets in the installed `fastapi-offline` package."""
    spec = importlib.util.find_spec("fastapi_offline")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "static"


@lru_cache(maxsize=len(ASSETS))
def _read(name: str) -> bytes:
    folder = assets_dir()
    if folder is None or not (folder / name).is_file():
        raise NotFound(f"the documentation asset {name!r} is missing: install fastapi-offline")
    return (folder / name).read_bytes()


@router.get("/docs")
async def swagger_ui() -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url="/openapi.json",
        title=f"{TITLE} - API",
        swagger_js_url=f"{ASSET_PREFIX}/swagger-ui-bundle.js",
        swagger_css_url=f"{ASSET_PREFIX}/swagger-ui.css",
        swagger_favicon_url=f"{ASSET_PREFIX}/favicon.png",
    )


@router.get("/redoc")
async def redoc() -> HTMLResponse:
    return get_redoc_html(
        openapi_url="/openapi.json",
        title=f"{TITLE} - API",
        redoc_js_url=f"{ASSET_PREFIX}/redoc.standalone.js",
        redoc_favicon_url=f"{ASSET_PREFIX}/favicon.png",
        with_google_fonts=False,
    )


@router.get(f"{ASSET_PREFIX}/{{name}}")
async def asset(name: str) -> Response:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise NotFound(f"no documentation asset {name!r}")
    return Response(_read(name), media_type=media_type, headers={"Cache-Control": "public, max-age=86400"})
