"""The routes `DirectRoutes` asks for a path (`_RouteShapes`) find what the router finds: for every
path and method, the first route that matches at all (and how) among the candidates is the first
among all the routes, on the service's own app and on an app with routes of every kind (a `path`
parameter, an `int` one, a mount, a literal that is also a parameter's value)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI
from starlette.routing import Match, Mount
from starlette.staticfiles import StaticFiles

from exgrpo_pool.api.lean import _RouteShapes
from exgrpo_pool.app import create_app
from exgrpo_pool.config import Settings

METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def _first(routes: Any, scope: dict[str, Any]) -> tuple[Any, Match] | None:
    for route in routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            return route, match
    return None


def _paths(app: FastAPI) -> list[str]:
    """Paths made from the app's route templates (each parameter a few ways) and near misses."""
    out = {"/", "", "/v1", "/v1/", "/nope", "/v1/pools/p1/stats/", "//", "/v1//stats"}
    for route in app.router.routes:
        path = getattr(route, "path", None)
        if not isinstance(path, str):
            continue
        for value in ("p1", "7", "stats", "runs", "a.b-c_d"):
            filled = path
            while "{" in filled:
                start = filled.index("{")
                filled = filled[:start] + value + filled[filled.index("}", start) + 1 :]
            out |= {filled, filled + "/", filled + "/x", filled.rsplit("/", 1)[0], filled + "/stats"}
    return sorted(out)


def _check(app: FastAPI, paths: list[str], root_path: str = "", shapes: _RouteShapes | None = None) -> int:
    shapes = shapes or _RouteShapes()
    routes = app.router.routes
    compared = 0
    for path in paths:
        for method in METHODS:
            scope = {"type": "http", "method": method, "path": root_path + path, "root_path": root_path}
            want = _first(routes, scope)
            got = _first(shapes.candidates(routes, scope), scope)
            assert got == want, (method, path)
            compared += want is not None
    return compared


def test_the_services_routes(tmp_path: Path) -> None:
    app = create_app(Settings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'p.db'}", allow_anonymous=True))
    paths = _paths(app)
    assert _check(app, paths) > 100  # many paths matched a route, fully or partly
    shapes = _RouteShapes()
    scope = {"type": "http", "method": "GET", "path": "/v1/pools/p1/runs/r1/stats", "root_path": ""}
    candidates = shapes.candidates(app.router.routes, scope)
    assert 0 < len(candidates) <= 2 < len(app.router.routes)


def test_routes_of_every_kind(tmp_path: Path) -> None:
    app = FastAPI()
    router = APIRouter()  # included: FastAPI keeps it as one route of its own (any path)

    @router.get("/included/{name}")
    async def included(name: str) -> str:
        return name

    app.include_router(router)

    @app.get("/items/{item_id:int}")
    async def item(item_id: int) -> int:
        return item_id

    @app.get("/items/stats")
    async def stats() -> str:
        return "stats"

    @app.get("/items/{name}")
    async def named(name: str) -> str:
        return name

    @app.get("/files/{rest:path}")
    async def files(rest: str) -> str:
        return rest

    @app.post("/items/{name}/tags/{tag}")
    async def tag(name: str, tag: str) -> str:
        return tag

    (tmp_path / "static").mkdir()
    app.router.routes.append(Mount("/static", app=StaticFiles(directory=tmp_path / "static")))
    paths = [
        "/items/7",
        "/items/stats",
        "/items/other",
        "/items/7/tags/x",
        "/items/7/tags",
        "/files/a/b/c",
        "/files/",
        "/files",
        "/static/a.txt",
        "/static",
        "/items",
        "/items/",
        "/nope/stats",
        "/included/x",
        "/included/x/y",
    ]
    shapes = _RouteShapes()
    assert _check(app, paths, shapes=shapes) >= 10

    # a route added later is found: the shapes follow the router's list
    @app.get("/items/{name}/more")
    async def more(name: str) -> str:
        return name

    assert _check(app, [*paths, "/items/7/more"], shapes=shapes) >= 11
    # a request under a root path is matched against every route, as the router matches it
    assert _check(app, paths, root_path="/api") >= 10
