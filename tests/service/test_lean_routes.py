"""The routes that `LeanRoute` answers (a run's stats, the pool's stats, a page of questions, a
replay selection) answer every request as FastAPI's own handler answers it: the same status, headers that
matter and body, for good requests, bad parameters, unknown names and every kind of caller; and
they do take the lean path (FastAPI's solver is not called for them)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import routing as fastapi_routing
from fastapi.routing import APIRoute

from exgrpo_pool.api.lean import LeanRoute, lean_routes
from exgrpo_pool.app import create_app
from exgrpo_pool.config import TokenGrant

from .factories import commit_batch, correct_first, make_groups, ok, plan_batch, setup_pool
from .harness import (
    ADMIN_TOKEN,
    READ_TOKEN,
    TOKENS,
    WRITE_OTHER_TOKEN,
    WRITE_P1_TOKEN,
    Backend,
    bearer,
    serve_app,
)

LEAN_PATHS = {
    "/v1/pools/{pool}/stats",
    "/v1/pools/{pool}/questions",
    "/v1/pools/{pool}/runs/{run}/stats",
    "/v1/pools/{pool}/runs/{run}/select",
}
JSON = {"content-type": "application/json"}
#: selections: (path, body, headers)
SELECTIONS: list[tuple[str, bytes, dict[str, str]]] = [
    ("/v1/pools/p1/runs/r1/select", b'{"n": 4, "seed": 1}', JSON),
    ("/v1/pools/p1/runs/r1/select", b'{"n": 4, "seed": 1, "candidates": "none"}', JSON),
    ("/v1/pools/p1/runs/r1/select", b'{"n": 4, "seed": 1, "candidates": "lowest_stored_entropy"}', JSON),
    (
        "/v1/pools/p1/runs/r1/select",
        b'{"n": 3, "seed": 2}',
        {"content-type": "application/json; charset=utf-8"},
    ),
    ("/v1/pools/p1/runs/r1/select", b'{"n": 3, "seed": 2}', {"content-type": "application/vnd.x+json"}),
    ("/v1/pools/p1/runs/r1/select", b'{"n": 4, "seed": 1}', {**JSON, "accept": "application/x-msgpack"}),
    ("/v1/pools/p1/runs/r1/select", b'{"n": 4, "seed": 1}', {}),
    ("/v1/pools/p1/runs/r1/select", b'{"n": 4, "seed": 1}', {"content-type": "text/plain"}),
    ("/v1/pools/p1/runs/r1/select", b"", JSON),
    ("/v1/pools/p1/runs/r1/select", b"{", JSON),
    ("/v1/pools/p1/runs/r1/select", b'{"n": 4,}', JSON),
    ("/v1/pools/p1/runs/r1/select", b"\xff\xfe\x00", JSON),
    ("/v1/pools/p1/runs/r1/select", b"[1, 2]", JSON),
    ("/v1/pools/p1/runs/r1/select", b'{"n": 0}', JSON),
    ("/v1/pools/p1/runs/r1/select", b'{"n": "four"}', JSON),
    ("/v1/pools/p1/runs/r1/select", b'{"n": 4, "extra": 1}', JSON),
    ("/v1/pools/p1/runs/r1/select", b'{"n": 4, "candidates": "some"}', JSON),
    ("/v1/pools/p1/runs/r1/select", b'{"n": 4.0, "seed": 1}', JSON),
    ("/v1/pools/p1/runs/nope/select", b'{"n": 4}', JSON),
    ("/v1/pools/nope/runs/r1/select", b'{"n": 4}', JSON),
    ("/v1/pools/bad%20name/runs/r1/select", b'{"n": 0}', JSON),
    ("/v1/pools/p1/runs/bad%20name/select", b"{", JSON),
]

BASE = "http://pool.test"

REQUESTS = [
    "/v1/pools/p1/stats",
    "/v1/pools/p1/runs/r1/stats",
    "/v1/pools/p1/runs/r2/stats",
    "/v1/pools/p1/questions",
    "/v1/pools/p1/questions?limit=5",
    "/v1/pools/p1/questions?after=3&limit=2",
    "/v1/pools/p1/questions?limit=5&limit=7",
    "/v1/pools/p1/questions?limit=0",
    "/v1/pools/p1/questions?limit=1001",
    "/v1/pools/p1/questions?limit=abc",
    "/v1/pools/p1/questions?after=-1&limit=abc",
    "/v1/pools/p1/questions?after=99999999999999999999",
    "/v1/pools/nope/stats",
    "/v1/pools/nope/questions",
    "/v1/pools/p1/runs/nope/stats",
    "/v1/pools/bad%20name/stats",
    "/v1/pools/bad%20name/questions?limit=0",
    "/v1/pools/p1/runs/bad%20name/stats",
    "/v1/pools/bad%20name/runs/bad%20name/stats",
]

#: reads one other pool only, and may read nothing of p1; writes nothing
OTHER_READER = "test-read-other-token-0005"

CALLERS: list[dict[str, str]] = [
    bearer(OTHER_READER),
    bearer(ADMIN_TOKEN),
    bearer(READ_TOKEN),
    bearer(WRITE_P1_TOKEN),
    bearer(WRITE_OTHER_TOKEN),
    bearer("no-such-token"),
    {"Authorization": "Basic abc"},
    {},
]


def _answer(r: httpx.Response) -> tuple[int, str | None, Any]:
    if r.headers.get("content-type") == "application/x-msgpack":
        return r.status_code, r.headers["content-type"], r.content
    body: Any = r.json() if r.content else None
    if isinstance(body, dict):
        body.pop("request_id", None)  # one per request
    return r.status_code, r.headers.get("content-type"), body


async def test_lean_routes_answer_as_fastapi_does(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    grant = TokenGrant(token=OTHER_READER, name="reader-other", scopes=["read:other-pool"])
    settings = backend.settings(tokens=[*TOKENS, grant])
    with monkeypatch.context() as m:
        m.setattr(LeanRoute, "get_route_handler", APIRoute.get_route_handler)
        plain_app = create_app(settings)
    assert set(lean_routes(plain_app.router.routes)) == LEAN_PATHS  # marked, but FastAPI's handler
    solved: list[str] = []
    real_solve = fastapi_routing.solve_dependencies

    async def counted(**kw: Any) -> Any:
        solved.append(kw["request"].url.path)
        return await real_solve(**kw)

    monkeypatch.setattr(fastapi_routing, "solve_dependencies", counted)
    async with serve_app(settings) as (app, admin):
        assert set(lean_routes(app.router.routes)) == LEAN_PATHS
        await setup_pool(admin, "p1", questions=12, runs=("r1", "r2"), phase="mixed")
        plan = await plan_batch(admin, "p1", "r1")
        ok(await commit_batch(admin, plan, make_groups(plan, correct_first(lambda q: q % 8))))
        async with (
            LifespanManager(plain_app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=plain_app), base_url="http://pool.test"
            ) as plain,
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pool.test") as fast,
        ):
            statuses = set()
            for headers in CALLERS:
                for path in REQUESTS:
                    solved.clear()
                    got = _answer(await fast.get(path, headers=headers))
                    assert solved == [], (path, "the lean app called FastAPI's solver")
                    want = _answer(await plain.get(path, headers=headers))
                    assert solved, (path, "the plain app did not call FastAPI's solver")
                    assert got == want, (headers, path)
                    statuses.add(got[0])
                for path, body, extra in SELECTIONS:
                    solved.clear()
                    got = _answer(await fast.post(path, content=body, headers={**headers, **extra}))
                    assert solved == [], (path, "the lean app called FastAPI's solver")
                    want = _answer(await plain.post(path, content=body, headers={**headers, **extra}))
                    assert solved or want[0] in (400, 422), (
                        path,
                        "the plain app did not call FastAPI's solver",
                    )
                    assert got == want, (headers, path, body, extra)
                    statuses.add(got[0])
            # every kind of answer was compared
            assert statuses >= {200, 401, 403, 404, 422}, statuses
