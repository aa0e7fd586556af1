"""The polled stats answers (a run's, a pool's) are written from plain values, not validated models:
they must be, byte for byte, the JSON their models (`RunStats`, `PoolStats`) write, on both
backends, for runs with and without buckets, trajectories and replays, and for a pool without runs."""

from __future__ import annotations

import httpx

from exgrpo_client import schemas as s

from .factories import commit_batch, correct_first, make_groups, ok, plan_batch, run_stats, setup_pool

HALF = correct_first(lambda q: 2)


async def _raw(client: httpx.AsyncClient, path: str) -> bytes:
    r = await client.get(path)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    return r.content


async def test_stats_answers_are_what_their_models_write(client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed", questions=24, runs=("r1", "r2"))
    ok(await client.post("/v1/pools", json={"name": "empty"}), 201)
    for _ in range(3):
        plan = await plan_batch(client, run="r1")
        ok(await commit_batch(client, plan, make_groups(plan, HALF)))

    r1 = await _raw(client, "/v1/pools/p1/runs/r1/stats")
    r2 = await _raw(client, "/v1/pools/p1/runs/r2/stats")
    pool = await _raw(client, "/v1/pools/p1/stats")
    empty = await _raw(client, "/v1/pools/empty/stats")
    for raw in (r1, r2):
        assert s.RunStats.model_validate_json(raw).model_dump_json().encode() == raw
    for raw in (pool, empty):
        assert s.PoolStats.model_validate_json(raw).model_dump_json().encode() == raw

    trained, fresh = s.RunStats.model_validate_json(r1), s.RunStats.model_validate_json(r2)
    assert trained.buckets and trained.trajectories > 0 and trained.step == 3
    assert trained.ingest_per_minute == trained.trajectories / 5  # every one stored just now
    assert fresh.buckets == [] and fresh.trajectories == 0 and fresh.step == 0
    whole = s.PoolStats.model_validate_json(pool)
    assert [r.run for r in whole.runs] == ["r1", "r2"] and whole.runs[0] == trained
    assert whole.num_runs == 2 and whole.num_trajectories == trained.trajectories
    assert s.PoolStats.model_validate_json(empty).runs == []

    # a commit's answer (`with_stats`, the model validated from the same values) says the same
    plan = await plan_batch(client, run="r1")
    result = ok(await commit_batch(client, plan, {**make_groups(plan, HALF), "with_stats": True}))
    assert result["stats"] == await run_stats(client, run="r1")
    assert result["stats"]["replayed_last_step"] == len(plan["replay"]) > 0


async def test_stats_of_what_does_not_exist_are_refused(client: httpx.AsyncClient) -> None:
    await setup_pool(client)
    for path in ("/v1/pools/p1/runs/nope/stats", "/v1/pools/nope/runs/r1/stats", "/v1/pools/nope/stats"):
        r = await client.get(path)
        assert r.status_code == 404, (path, r.text)
