"""The app's routes lie in one flat list (`exgrpo_pool.app.add_routers`): a request is matched
against each route once, not against a wrapper per included router whose routes FastAPI matches
once to pick the router and again inside it. Flat, the routes must not take each other's
requests (their order then decides nothing), and the API they describe is the one the routers
describe when included."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.routing import Match, Route

import exgrpo_pool.app as service_app
from exgrpo_pool.app import create_app
from exgrpo_pool.config import Settings

SETTINGS = Settings(allow_anonymous=True, database_url="sqlite+aiosqlite://")


def _scope(method: str, path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": "",
        "headers": [],
        "query_string": b"",
    }


def _example_path(route: Route) -> str:
    """The route's path with every parameter given a value its convertor takes."""
    return re.sub(r"{[^}]+}", "7", route.path)


def test_every_route_of_the_app_is_a_route_with_a_path() -> None:
    app = create_app(SETTINGS)
    kinds = {type(r).__name__ for r in app.router.routes if not isinstance(r, Route)}
    assert kinds == set()
    paths = {r.path for r in app.router.routes if isinstance(r, Route)}
    # the routers' routes are there, next to the app's own
    hot = {"/v1/pools/{pool}/runs/{run}/stats", "/v1/pools/{pool}/batches/{batch_id}/commit"}
    assert {"/healthz", *hot} <= paths
    assert len([r for r in app.router.routes if isinstance(r, APIRoute)]) > 30


def test_no_two_routes_take_the_same_request() -> None:
    routes = [r for r in create_app(SETTINGS).router.routes if isinstance(r, Route)]
    for route in routes:
        for method in route.methods or {"GET"}:
            scope = _scope(method, _example_path(route))
            assert route.matches(scope)[0] == Match.FULL, (method, route.path)
            takers = [r.path for r in routes if r.matches(scope)[0] == Match.FULL]
            assert takers == [route.path], (method, scope["path"], takers)


def test_the_api_is_the_one_of_the_included_routers(monkeypatch: pytest.MonkeyPatch) -> None:
    flat = create_app(SETTINGS)

    def included(app: FastAPI, *routers: Any) -> None:
        for router in routers:
            app.include_router(router)
        app.state.declared_routes = []

    monkeypatch.setattr(service_app, "add_routers", included)
    nested = create_app(SETTINGS)
    assert flat.openapi() == nested.openapi()
    assert sorted(flat.openapi()["paths"]) == sorted(nested.openapi()["paths"])
    assert len(flat.openapi()["paths"]) > 20


async def test_the_apps_dependency_overrides_reach_every_route(tmp_path: Any) -> None:
    """Each app has routes of its own: its `dependency_overrides` apply to the routers' routes as
    to its own, and not to another app's."""
    from asgi_lifespan import LifespanManager

    from exgrpo_pool.api import deps
    from exgrpo_pool.errors import Forbidden

    async def deny() -> None:
        raise Forbidden("overridden")

    settings = Settings(allow_anonymous=True, database_url=f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}")
    overridden, plain = create_app(settings), create_app(settings)
    overridden.dependency_overrides[deps.require_read] = deny
    for app, status in ((overridden, 403), (plain, 404)):
        async with (
            LifespanManager(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pool.test") as client,
        ):
            for path in ("/v1/pools/p1/stats", "/v1/pools/p1/runs/r1/stats", "/v1/pools/p1/questions"):
                r = await client.get(path)
                assert r.status_code == status, (path, r.text)


def test_the_hot_routes_are_matched_first_and_documented_in_their_place() -> None:
    """A trainer's and a dashboard's requests are matched against their own routes first (each
    route passed costs a path match); the API document lists the routes as they are declared."""
    app = create_app(SETTINGS)
    order = [(sorted(r.methods or ())[0], r.path) for r in app.router.routes if isinstance(r, APIRoute)]
    hot = service_app.HOT_ROUTES
    assert set(hot) <= set(order), set(hot) - set(order)
    assert order[: len(hot)] == list(hot)
    documented = list(app.openapi()["paths"])
    declared = list(dict.fromkeys(p for _, p in service_app.declared_routes(app)))
    assert documented == [p for p in declared if p in documented]
    assert documented.index("/v1/pools") < documented.index("/v1/pools/{pool}/runs/{run}/batches")
