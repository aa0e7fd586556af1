"""Redis going away under the service (a Redis server of the test's own, killed, restarted empty,
or paused): requests that need it answer 503 problem+json and change nothing; a commit whose
database transaction went through answers its real result; the index comes back right."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from service.factories import (
    commit_batch,
    correct_first,
    make_groups,
    ok,
    plan_batch,
    run_stats,
    setup_pool,
)
from service.harness import serve

from .conftest import OwnRedis

pytestmark = [pytest.mark.faults, pytest.mark.postgres]


def _unavailable(r: httpx.Response) -> None:
    assert r.status_code == 503, f"{r.request.method} {r.request.url.path}: {r.status_code} {r.text}"
    assert r.headers["content-type"] == "application/problem+json"
    assert r.headers["retry-after"] == "1"
    assert "Redis" in r.json()["detail"]


async def _db_view(client: httpx.AsyncClient) -> dict[str, Any]:
    """What the database holds (read through routes that do not use Redis)."""
    run = ok(await client.get("/v1/pools/p1/runs/r1"))
    pool = ok(await client.get("/v1/pools/p1"))
    return {"step": run["step"], "questions": pool["num_questions"], "trajectories": pool["num_trajectories"]}


async def test_redis_killed_then_back_empty(own_redis: OwnRedis) -> None:
    settings = own_redis.backend.settings(redis_timeout_s=0.5)
    async with serve(settings) as client:
        ctx = client._transport.app.state.ctx  # type: ignore[attr-defined]  # the ASGI app behind the client
        kwargs = ctx.redis.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == 0.5

        await setup_pool(client, questions=48, phase="mixed")
        plan = await plan_batch(client)
        ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 2))))
        plan = await plan_batch(client)
        body = make_groups(plan, correct_first(lambda q: 1), lambda q, row: [q, row, 2])
        before = await _db_view(client)

        own_redis.redis.kill()
        # the commit needs Redis only after its transaction: it is committed and says so
        committed = await commit_batch(client, plan, body, **{"Idempotency-Key": "commit-2"})
        assert committed.status_code == 200, committed.text
        result = committed.json()
        assert result["step"] == 2 and result["stored_trajectories"] > 0
        after = await _db_view(client)
        assert after["step"] == 2
        assert after["trajectories"] == before["trajectories"] + result["stored_trajectories"]

        # what needs the index answers 503 and changes nothing
        _unavailable(await client.post("/v1/pools/p1/runs/r1/batches", json={}))
        _unavailable(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 2}))
        _unavailable(await client.post("/v1/pools/p1/index/rebuild"))
        assert await _db_view(client) == after

        own_redis.redis.start()  # back, empty
        replay = await commit_batch(client, plan, body, **{"Idempotency-Key": "commit-2"})
        assert replay.status_code == 200 and replay.headers["idempotent-replayed"] == "true"
        assert replay.json() == result
        stats = await run_stats(client)
        nxt = await plan_batch(client)
        assert nxt["step"] == 3 and nxt["num_eligible"] == stats["eligible"] > 0
        assert await _db_view(client) == after


async def test_redis_paused_during_a_commit_then_answering_with_old_data(own_redis: OwnRedis) -> None:
    """A Redis that stops answering and comes back with what it held before: the commit made
    during the pause is missing from it, and the service rebuilds the scope before using it."""
    async with serve(own_redis.backend.settings(redis_timeout_s=0.3)) as client:
        await setup_pool(client, questions=48, phase="mixed")
        plan = await plan_batch(client)
        ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 2))))
        plan = await plan_batch(client)
        body = make_groups(plan, correct_first(lambda q: 3), lambda q, row: [q, row, 5])
        own_redis.redis.pause()
        try:
            committed = await commit_batch(client, plan, body)
            assert committed.status_code == 200, committed.text
            _unavailable(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 2}))
        finally:
            own_redis.redis.resume()
        stats = await run_stats(client)
        assert stats["step"] == 2
        # without the rebuild the index would lack the questions the paused commit collected
        sel = ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 4, "seed": 1}))
        assert sel["num_eligible"] == stats["eligible"] > 0
        nxt = await plan_batch(client)
        assert nxt["num_eligible"] == stats["eligible"]


async def test_writes_during_an_outage_tell_the_truth(own_redis: OwnRedis) -> None:
    """Redis down for a commit (with stats), its retry, and an ingest: each was written to the
    database, so each answers its result (never a 5xx saying nothing changed); a retry with the
    same key answers the committed result, during the outage and after it."""
    async with serve(own_redis.backend.settings(redis_timeout_s=0.3)) as client:
        await setup_pool(client, questions=48, phase="mixed")
        plan = await plan_batch(client)
        ok(await commit_batch(client, plan, make_groups(plan, correct_first(lambda q: 2))))
        plan = await plan_batch(client)
        body = {
            **make_groups(plan, correct_first(lambda q: 2), lambda q, row: [q, row, 9]),
            "with_stats": True,
        }
        before = await _db_view(client)

        own_redis.redis.kill()
        try:
            first = await commit_batch(client, plan, body, **{"Idempotency-Key": "outage-commit"})
            assert first.status_code == 200, first.text
            result = first.json()
            assert result["step"] == 2 and result["stored_trajectories"] > 0
            assert result["stats"]["step"] == 2 and result["stats"]["eligible"] > 0
            again = await commit_batch(client, plan, body, **{"Idempotency-Key": "outage-commit"})
            assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
            assert again.json() == result
            # the same groups without the key: the batch is committed with them, the same answer
            assert ok(await commit_batch(client, plan, body)) == result
            ingest = await client.post(
                "/v1/pools/p1/runs/r1/ingest",
                json={
                    "groups": make_groups(plan, correct_first(lambda q: 1), lambda q, row: [q, row, 11])[
                        "groups"
                    ][:2]
                },
            )
            assert ingest.status_code == 200, ingest.text
            stored = result["stored_trajectories"] + ingest.json()["stored_trajectories"]
            assert await _db_view(client) == {
                **before,
                "step": 2,
                "trajectories": before["trajectories"] + stored,
            }
        finally:
            own_redis.redis.start()  # back, empty
        replay = await commit_batch(client, plan, body, **{"Idempotency-Key": "outage-commit"})
        assert replay.status_code == 200 and replay.json() == result
        # the index is rebuilt from the database on its next use
        stats = await run_stats(client)
        nxt = await plan_batch(client)
        assert nxt["step"] == 3 and nxt["num_eligible"] == stats["eligible"] > 0
