"""The dashboard: a static page (HTML, JS, CSS shipped in `exgrpo_pool/static/`) that reads the
pool service's own API from the browser.

The page itself needs no credentials: it holds no data. Its API calls go out anonymously (which the
service allows on a loopback bind when anonymous access is on) or with the bearer token the user
types into it, so the usual scope checks apply to everything it shows.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from exgrpo_pool.errors import NotFound

STATIC = Path(__file__).resolve().parents[2] / "static"
#: The files the page is made of, by the name it asks for them under, with their media types.
ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
HEADERS = {
    # Everything is same-origin: the page's own script and style, and calls to this service.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(tags=["dashboard"], include_in_schema=False)


@lru_cache(maxsize=8)
def _read(name: str, mtime_ns: int) -> bytes:
    del mtime_ns  # part of the cache key only: an edited file is read again
    return (STATIC / name).read_bytes()


def _file(name: str, media_type: str) -> Response:
    path = STATIC / name
    try:
        body = _read(name, path.stat().st_mtime_ns)
    except FileNotFoundError as e:
        raise NotFound(f"the dashboard file {name!r} is missing from this installation ({STATIC})") from e
    return Response(body, media_type=media_type, headers=HEADERS)


@router.get("/dashboard")
async def dashboard() -> Response:
    """The dashboard page: pools, runs, training curves, buckets and stored trajectories."""
    return _file("dashboard.html", "text/html; charset=utf-8")


@router.get("/dashboard/{asset}")
async def dashboard_asset(asset: str) -> Response:
    media_type = ASSETS.get(asset)
    if media_type is None:
        raise NotFound(f"no dashboard file {asset!r}; the page is at /dashboard")
    return _file(asset, media_type)
