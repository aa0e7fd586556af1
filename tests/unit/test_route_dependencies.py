"""Every dependency of the service's routes runs on the event loop: FastAPI runs a plain `def`
dependency (or a class) in its thread pool, a hand-over to a thread and back for each one, on
every request."""

from __future__ import annotations

import inspect
from typing import Any

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from exgrpo_pool.api.routes import batches, dashboard, docs, pools, runs
from exgrpo_pool.app import create_app
from exgrpo_pool.config import Settings


def _calls(dep: Dependant) -> list[Any]:
    out = []
    for sub in dep.dependencies:
        out.append(sub.call)
        out += _calls(sub)
    return out


def test_no_route_dependency_goes_through_the_thread_pool() -> None:
    app = create_app(Settings(allow_anonymous=True, database_url="sqlite+aiosqlite://"))
    routers = (pools.router, runs.router, batches.router, dashboard.router, docs.router)
    routes = [r for r in [*app.routes, *(r for m in routers for r in m.routes)] if isinstance(r, APIRoute)]
    assert len(routes) > 30
    sync = {
        f"{r.path}: {getattr(call, '__qualname__', call)}"
        for r in routes
        for call in _calls(r.dependant)
        if call is not None and not inspect.iscoroutinefunction(call)
    }
    assert sync == set()
