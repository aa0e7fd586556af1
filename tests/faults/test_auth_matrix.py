"""Every write endpoint against every kind of caller, on both backends.

The endpoints come from the app itself (every POST, PUT, PATCH and DELETE route), so a new one is
in the matrix the day it is added; the table of valid requests below must then name it, or this
test fails saying so. For each endpoint: no token and an unknown token answer 401; the read-only
token, a token scoped to another pool and, for admin endpoints, the pool's own writer answer 403;
none of them changes anything (the pool's export, the open batch's tasks, the run's metrics and
lease are read back after each). The caller it is meant for is then accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from service.factories import K, correct_first, make_groups, ok, setup_pool
from service.harness import (
    ADMIN_TOKEN,
    READ_TOKEN,
    WRITE_OTHER_TOKEN,
    WRITE_P1_TOKEN,
    Backend,
    bearer,
    serve,
)

from exgrpo_pool.api.contract import dependency_calls, operations
from exgrpo_pool.api.deps import require_admin, writable_pool_name
from exgrpo_pool.app import create_app

pytestmark = pytest.mark.faults

WRITE_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


@dataclass
class World:
    """The resources the requests name: an open batch with four leased tasks, a committed step."""

    plan: dict[str, Any]
    tasks: list[dict[str, Any]]
    export: str = ""

    def task(self, i: int) -> dict[str, Any]:
        return self.tasks[i]


Request = Callable[[World], tuple[str, Any]]
"""(url with its query, JSON body or raw bytes) of a valid request."""


def _question(i: int) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": f"auth {i}"}], "ground_truth": str(i)}


def _rollouts(w: World) -> list[dict[str, Any]]:
    group = make_groups(w.plan, correct_first(lambda q: 2))["groups"][0]
    return group["rollouts"][: w.task(1)["num_samples"]]


#: A valid request of every write endpoint, in the order the accepted ones are sent.
VALID: dict[tuple[str, str], Request] = {
    ("POST", "/v1/pools"): lambda w: ("/v1/pools", {"name": "p3", "config": {"k": K}}),
    ("PATCH", "/v1/pools/{pool}"): lambda w: ("/v1/pools/p1", {"description": "changed"}),
    ("POST", "/v1/pools/{pool}/questions"): lambda w: (
        "/v1/pools/p1/questions",
        {"questions": [_question(900)]},
    ),
    ("POST", "/v1/pools/{pool}/runs"): lambda w: ("/v1/pools/p1/runs", {"name": "r2"}),
    ("PATCH", "/v1/pools/{pool}/runs/{run}"): lambda w: ("/v1/pools/p1/runs/r2", {"phase": "mixed"}),
    ("PUT", "/v1/pools/{pool}/runs/{run}/lease"): lambda w: ("/v1/pools/p1/runs/r2/lease", {"holder": "h"}),
    ("DELETE", "/v1/pools/{pool}/runs/{run}/lease"): lambda w: ("/v1/pools/p1/runs/r2/lease?holder=h", None),
    ("POST", "/v1/pools/{pool}/runs/{run}/metrics"): lambda w: (
        "/v1/pools/p1/runs/r1/metrics",
        {"step": 7, "metrics": {"loss": 0.5}},
    ),
    ("POST", "/v1/pools/{pool}/runs/{run}/policy-versions"): lambda w: (
        "/v1/pools/p1/runs/r1/policy-versions",
        {"version": 9, "uri": "file:///w/9"},
    ),
    ("POST", "/v1/pools/{pool}/runs/{run}/select"): lambda w: ("/v1/pools/p1/runs/r1/select", {"n": 2}),
    ("POST", "/v1/pools/{pool}/runs/{run}/tasks/claim"): lambda w: (
        "/v1/pools/p1/runs/r1/tasks/claim",
        {"worker": "w2"},
    ),
    ("POST", "/v1/pools/{pool}/tasks/claim"): lambda w: (
        "/v1/pools/p1/tasks/claim",
        {"worker": "w3", "runs": ["r1"]},
    ),
    ("POST", "/v1/pools/{pool}/tasks/{task_id}/renew"): lambda w: (
        f"/v1/pools/p1/tasks/{w.task(0)['id']}/renew",
        {"lease_token": w.task(0)["lease_token"]},
    ),
    ("POST", "/v1/pools/{pool}/tasks/{task_id}/complete"): lambda w: (
        f"/v1/pools/p1/tasks/{w.task(1)['id']}/complete",
        {"lease_token": w.task(1)["lease_token"], "rollouts": _rollouts(w)},
    ),
    ("POST", "/v1/pools/{pool}/tasks/{task_id}/fail"): lambda w: (
        f"/v1/pools/p1/tasks/{w.task(2)['id']}/fail",
        {"lease_token": w.task(2)["lease_token"], "error": "boom"},
    ),
    ("POST", "/v1/pools/{pool}/batches/{batch_id}/commit"): lambda w: (
        f"/v1/pools/p1/batches/{w.plan['id']}/commit",
        make_groups(w.plan, correct_first(lambda q: 2)),
    ),
    ("POST", "/v1/pools/{pool}/runs/{run}/ingest"): lambda w: (
        "/v1/pools/p1/runs/r1/ingest",
        {"groups": make_groups(w.plan, correct_first(lambda q: 1))["groups"][:1]},
    ),
    ("POST", "/v1/pools/{pool}/runs/{run}/batches"): lambda w: ("/v1/pools/p1/runs/r1/batches", {}),
    ("POST", "/v1/pools/{pool}/index/rebuild"): lambda w: ("/v1/pools/p1/index/rebuild", None),
    ("POST", "/v1/admin/index/rebuild"): lambda w: ("/v1/admin/index/rebuild", None),
    ("POST", "/v1/pools/import"): lambda w: ("/v1/pools/import?name=p1-copy", w.export.encode()),
    ("DELETE", "/v1/pools/{pool}/runs/{run}"): lambda w: ("/v1/pools/p1/runs/r2", None),
    ("DELETE", "/v1/pools/{pool}"): lambda w: ("/v1/pools/p3", None),
}


def _write_routes() -> dict[tuple[str, str], str]:
    """Every write route of the app and the caller it is meant for: admin, writer (of the pool
    named in it) or reader (a POST that only reads)."""
    app = create_app(Backend("x", "sqlite+aiosqlite://", None, "x").settings())
    out = {}
    for op in operations(app.routes):
        if not op.path.startswith("/v1/"):
            continue
        calls = dependency_calls(op.route.dependant)
        for method in op.methods & WRITE_METHODS:
            # creating pool p3 needs write:p3 or write:*, which of our tokens only the admin has
            # (/v1/admin/ routes check the admin scope in their body)
            if require_admin in calls or op.path in ("/v1/pools",) or op.path.startswith("/v1/admin/"):
                out[(method, op.path)] = "admin"
            elif writable_pool_name in calls:  # the check of every route that writes to a pool
                out[(method, op.path)] = "writer"
            else:
                out[(method, op.path)] = "reader"
    return out


async def _world(admin: httpx.AsyncClient) -> World:
    await setup_pool(admin, phase="mixed", questions=24)
    first = ok(await admin.post("/v1/pools/p1/runs/r1/batches", json={}), 201)
    ok(
        await admin.post(
            f"/v1/pools/p1/batches/{first['id']}/commit", json=make_groups(first, correct_first(lambda q: 2))
        )
    )
    plan = ok(await admin.post("/v1/pools/p1/runs/r1/batches", json={"create_tasks": True}), 201)
    tasks = ok(await admin.post("/v1/pools/p1/runs/r1/tasks/claim", json={"worker": "w", "max_tasks": 3}))[
        "data"
    ]
    assert len(tasks) == 3
    world = World(plan=plan, tasks=tasks)
    world.export = (await admin.get("/v1/pools/p1/export")).text
    return world


async def _state(admin: httpx.AsyncClient, world: World) -> dict[str, Any]:
    pools = ok(await admin.get("/v1/pools"))
    return {
        "pools": [(p["name"], p["description"], p["config"], p["num_questions"]) for p in pools["data"]],
        "export": (await admin.get("/v1/pools/p1/export")).text,
        "batch": ok(await admin.get(f"/v1/pools/p1/batches/{world.plan['id']}/status")),
        "metrics": ok(await admin.get("/v1/pools/p1/runs/r1/metrics")),
        "runs": ok(await admin.get("/v1/pools/p1/runs")),
    }


def _send(client: httpx.AsyncClient, method: str, url: str, body: Any, headers: dict[str, str]) -> Any:
    if isinstance(body, bytes):
        return client.request(method, url, content=body, headers=headers)
    return client.request(method, url, json=body, headers=headers)


async def test_every_write_endpoint_refuses_the_wrong_callers(backend: Backend) -> None:
    routes = _write_routes()
    assert len(routes) >= 19, routes
    missing = sorted(set(routes) - set(VALID))
    assert missing == [], f"write endpoints without a valid request in VALID: {missing}"
    settings = backend.settings()
    async with (
        serve(settings, ADMIN_TOKEN) as admin,
        serve(settings, READ_TOKEN) as reader,
        serve(settings, WRITE_P1_TOKEN) as writer,
        serve(settings, WRITE_OTHER_TOKEN) as other,
    ):
        world = await _world(admin)
        refused = 0
        for (method, path), build in VALID.items():
            if (method, path) not in routes:
                continue  # an endpoint this version of the service does not have
            meant_for = routes[(method, path)]
            url, body = build(world)
            bad: list[tuple[str, httpx.AsyncClient, dict[str, str], int]] = [
                ("no token", reader, {"Authorization": ""}, 401),
                ("unknown token", reader, bearer("not-a-token-of-this-service"), 401),
                ("token of another pool", other, {}, 403),
            ]
            if meant_for != "reader":
                bad.append(("read-only token", reader, {}, 403))
            if meant_for == "admin":
                bad.append(("the pool's writer", writer, {}, 403))
            before = await _state(admin, world)
            for who, client, headers, status in bad:
                if meant_for == "reader" and who == "token of another pool":
                    continue  # any reader may select; the other pool's writer can read
                r = await _send(client, method, url, body, headers)
                assert r.status_code == status, (method, path, who, r.status_code, r.text[:300])
                assert r.headers["content-type"].startswith("application/problem+json")
                refused += 1
            assert await _state(admin, world) == before, (method, path)
            right = {"admin": admin, "writer": writer, "reader": reader}[meant_for]
            r = await _send(right, method, url, body, {})
            assert r.status_code < 300, (method, path, meant_for, r.status_code, r.text[:500])
        print(f"{backend.name}: {len(routes)} write endpoints, {refused} refused attempts, none wrote")
        assert refused >= 3 * len(routes)
