"""The routes that `LeanRoute` answers (a run's stats, the pool's stats, a page of questions, a
replay selection, a commit, an ingest) answer every request as FastAPI's own handler answers it:
the same status, headers that matter and body, for good requests, bad parameters, bad bodies (JSON
and binary frames), unknown names and every kind of caller; and they do take the lean path
(FastAPI's solver is not called for them), straight from the service's middleware (FastAPI's
router is not entered for them; it still answers everything else, with dependency overrides too)."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import routing as fastapi_routing
from fastapi.routing import APIRoute, APIRouter

from exgrpo_client import frames
from exgrpo_client.schemas import unpack_ids, unpack_logprobs
from exgrpo_pool.api.deps import Principal, get_principal
from exgrpo_pool.api.lean import LeanRoute, lean_routes
from exgrpo_pool.app import create_app
from exgrpo_pool.config import TokenGrant

from .factories import commit_batch, correct_first, group, make_groups, ok, plan_batch, setup_pool
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
    "/v1/pools/{pool}/batches/{batch_id}/commit",
    "/v1/pools/{pool}/runs/{run}/ingest",
}
FRAME = {"content-type": frames.MEDIA_TYPE}
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
    # no route matches (a redirect to the path without the slash), or another route does
    "/v1/pools/p1/stats/",
    "/v1/pools/p1/runs/r1",
    "/v1/pools/p1",
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


def _frame(body: dict[str, Any], *, payload_fields: bool = False, nan: bool = False) -> bytes:
    """`body` (groups of JSON rollouts with base64 payloads) as a binary frame: payloads in its
    buffers (`payload_fields`: also left in the body, which a frame refuses; `nan`: log-probs NaN)."""
    slots: list[tuple[list[int], list[float]] | None] = []
    for g in body["groups"]:
        for r in g["rollouts"]:
            if "token_ids_b64" in r:
                lps = unpack_logprobs(r["logprobs_b64"])
                slots.append((unpack_ids(r["token_ids_b64"]), [float("nan")] * len(lps) if nan else lps))
                if not payload_fields:
                    del r["token_ids_b64"], r["logprobs_b64"]
            else:
                slots.append(None)
    return frames.encode(body, slots)


def _writes(batch: str, groups: dict[str, Any]) -> list[tuple[str, bytes, dict[str, str]]]:
    """Commits and ingests that change nothing: bad bodies in both encodings, unknown names, and
    groups that do not match the batch. (path, body, headers)"""
    commit = f"/v1/pools/p1/batches/{batch}/commit"
    ingest = "/v1/pools/p1/runs/r1/ingest"
    first = groups["groups"][0]
    half = [0.5] + [0.0] * (len(first["rollouts"]) - 1)
    out: list[tuple[str, bytes, dict[str, str]]] = []
    for path in (commit, ingest):
        out += [
            (path, b"", JSON),
            (path, b"{", JSON),
            (path, b"[1, 2]", JSON),
            (path, b'"groups"', JSON),
            (path, b'{"groups": []}', JSON),
            # parts that are no object where a model is (FastAPI's errors name other types there)
            (path, b'{"groups": ["x"]}', JSON),
            (path, json.dumps({"groups": [{"question_id": 1, "rollouts": ["x", 1.0]}]}).encode(), JSON),
            (path, json.dumps({"groups": [group(first["question_id"], half)]}).encode(), JSON),
            (path, json.dumps({"groups": [{"question_id": 1}]}).encode(), JSON),
            (path, json.dumps({**groups, "extra": 1}).encode(), JSON),
            (path, json.dumps(groups).encode(), {"content-type": "text/plain"}),
            (path, json.dumps(groups).encode(), {}),
            (path, b"not msgpack", FRAME),
            (path, _frame(copy.deepcopy(groups), payload_fields=True), FRAME),
            (path, _frame(copy.deepcopy(groups), nan=True), FRAME),
            (path, _frame({"groups": [group(first["question_id"], half)]}), FRAME),
        ]
    one = {"groups": groups["groups"][:1]}
    out += [
        (commit, json.dumps(one).encode(), JSON),  # not the batch's groups
        (commit, _frame(copy.deepcopy(one)), FRAME),
        ("/v1/pools/p1/batches/nope/commit", json.dumps(groups).encode(), JSON),
        ("/v1/pools/nope/runs/r1/ingest", json.dumps(one).encode(), JSON),
        ("/v1/pools/p1/runs/nope/ingest", _frame(copy.deepcopy(one)), FRAME),
        (ingest, json.dumps({"groups": [group(99999, [1.0, 0.0, 0.0, 0.0])]}).encode(), JSON),
    ]
    return out


def _lean_path(app: Any, path: str) -> bool:
    """Whether a GET of `path` (a query string aside) is a lean route's (the router's first match)."""
    scope = {"type": "http", "method": "GET", "path": path.partition("?")[0], "root_path": ""}
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match.name != "NONE":
            return match.name == "FULL" and route.path in LEAN_PATHS
    return False


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
    routed: list[str] = []
    real_route = APIRouter.app

    async def route_counted(self: APIRouter, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            routed.append(scope["path"])
        await real_route(self, scope, receive, send)

    monkeypatch.setattr(APIRouter, "app", route_counted)
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
                    routed.clear()
                    got = _answer(await fast.get(path, headers=headers))
                    lean = _lean_path(app, path)
                    if lean:
                        assert solved == [] and routed == [], (path, "router or solver called")
                    else:
                        assert routed == [path.partition("?")[0]], (path, "router not entered")
                    want = _answer(await plain.get(path, headers=headers))
                    assert solved or not lean, (path, "the plain app did not call FastAPI's solver")
                    assert got == want, (headers, path)
                    statuses.add(got[0])
                for path, body, extra in SELECTIONS:
                    solved.clear()
                    routed.clear()
                    got = _answer(await fast.post(path, content=body, headers={**headers, **extra}))
                    assert solved == [] and routed == [], (path, "router or solver called")
                    want = _answer(await plain.post(path, content=body, headers={**headers, **extra}))
                    assert solved or want[0] in (400, 422), (
                        path,
                        "the plain app did not call FastAPI's solver",
                    )
                    assert got == want, (headers, path, body, extra)
                    statuses.add(got[0])
            # commits and ingests that change nothing: the same answers, the solver not called
            batch = await plan_batch(admin, "p1", "r1")
            groups = make_groups(batch, correct_first(lambda q: q % 4))
            writes = _writes(batch["id"], groups)
            for headers in CALLERS:
                for path, body, extra in writes:
                    solved.clear()
                    routed.clear()
                    got = _answer(await fast.post(path, content=body, headers={**headers, **extra}))
                    assert solved == [] and routed == [], (path, "router or solver called")
                    want = _answer(await plain.post(path, content=body, headers={**headers, **extra}))
                    assert got == want, (headers, path, body[:200], extra)
                    statuses.add(got[0])
            # and the writes themselves, in both encodings (the ingests' rollouts not the commit's)
            other = make_groups(batch, correct_first(lambda q: q % 4), lambda q, row: [q, row + 50, 9])
            ingest = "/v1/pools/p1/runs/r1/ingest"
            for path, body, extra in [
                (f"/v1/pools/p1/batches/{batch['id']}/commit", _frame(copy.deepcopy(groups)), FRAME),
                (ingest, json.dumps({"groups": other["groups"][:4]}).encode(), JSON),
                (ingest, _frame({"groups": copy.deepcopy(other["groups"][4:])}), FRAME),
            ]:
                solved.clear()
                r = await fast.post(path, content=body, headers={**bearer(ADMIN_TOKEN), **extra})
                assert r.status_code == 200 and solved == [] and routed == [], (path, r.text)
                assert r.json()["stored_trajectories"] > 0, (path, r.json())
            # every kind of answer was compared
            assert statuses >= {200, 400, 401, 403, 404, 422}, statuses


async def test_overridden_dependencies_take_fastapis_path(backend: Backend) -> None:
    """An app whose dependencies are overridden (as a test of the app's users overrides them)
    answers its lean routes through FastAPI's router and solver, which apply the override: a
    caller without a token reads the pool's and a run's stats as the override's principal, and
    without the override is refused again."""
    async with serve_app(backend.settings()) as (app, admin):
        await setup_pool(admin, "p1", questions=4, runs=("r1",), phase="mixed")
        paths = ["/v1/pools/p1/stats", "/v1/pools/p1/runs/r1/stats", "/v1/pools/p1/questions?limit=2"]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as anonymous:
            for path in paths:
                assert (await anonymous.get(path)).status_code == 401, path
            app.dependency_overrides[get_principal] = lambda: Principal("override", frozenset({"read"}))
            for path in paths:
                r = await anonymous.get(path)
                assert r.status_code == 200, (path, r.text)
            del app.dependency_overrides[get_principal]
            for path in paths:
                assert (await anonymous.get(path)).status_code == 401, path
