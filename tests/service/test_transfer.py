"""Ingest and select, export/import of a pool, the sampling index, and seeded reproducibility."""

from __future__ import annotations

import json
from typing import Any

import httpx
import redis

from .factories import (
    B,
    K,
    commit_batch,
    create_pool,
    create_run,
    group,
    import_questions,
    make_groups,
    ok,
    payload_of,
    plan_batch,
    pool_stats,
    question_detail,
    run_stats,
    setup_pool,
)
from .harness import Backend, serve


def _hist(stats: dict[str, Any]) -> dict[int, int]:
    return {b["bucket"]: b["questions"] for b in stats["buckets"]}


async def _first_ids(client: httpx.AsyncClient, n: int, pool: str = "p1") -> list[int]:
    page = ok(await client.get(f"/v1/pools/{pool}/questions", params={"limit": n}))
    return [q["id"] for q in page["data"]]


async def _train(
    client: httpx.AsyncClient, steps: int, run: str = "r1", pool: str = "p1"
) -> list[dict[str, Any]]:
    """A few plan/commit steps with outcomes that depend on the question's content only."""
    plans = []
    for step in range(1, steps + 1):
        plan = await plan_batch(client, pool, run)
        gt = {i["question_id"]: int(i["ground_truth"]) for i in plan["fresh"] + plan["replay"]}
        replayed = {i["question_id"] for i in plan["replay"]}

        def reward(
            q: int, row: int, gt: dict[int, int] = gt, rep: set[int] = replayed, s: int = step
        ) -> float:
            k = max((gt[q] + s) % (K + 1), q in rep)
            return 1.0 if row < k else 0.0

        ok(await commit_batch(client, plan, make_groups(plan, reward, lambda q, row, gt=gt: [gt[q], row, 3])))
        plans.append(plan)
    return plans


# ------------------------------------------------------------------------------ ingest/select
async def test_ingest_applies_the_collection_rules(client: httpx.AsyncClient) -> None:
    await setup_pool(client)  # on-policy: ingest collects only when pre-filling
    q0, q1, q2, q3 = await _first_ids(client, 4)
    with_entropy = group(q1, [1, 1, 1, 0])
    for row, ent in zip(with_entropy["rollouts"], [0.9, 0.2, 0.5, 0.1], strict=True):
        row["entropy"] = ent
    body = {
        "groups": [
            group(q0, [0, 0, 0, 0]),  # nothing
            with_entropy,  # bucket 3, three trajectories
            group(q2, [0, 1, 0, 0], b64=False),  # bucket 1
            group(q3, [1, 1, 1, 1]),  # retired
            group(q2, [0, 1, 0, 0]),  # the same trajectory again: a duplicate
        ],
        "step": 7,
        "policy_version": 3,
        "prefill": True,
    }
    r = ok(await client.post("/v1/pools/p1/runs/r1/ingest", json=body))
    assert r["batch_id"] is None and r["run"] == "r1" and r["step"] == 0 and r["switched"] is False
    assert (r["retired"], r["collected_groups"], r["ignored_groups"]) == (1, 3, 1)
    assert (r["stored_trajectories"], r["duplicate_trajectories"]) == (4, 1)
    assert r["solved_fraction"] == 9 / 20

    stats = await run_stats(client)
    assert _hist(stats) == {1: 1, 3: 1} and stats["retired"] == 1 and stats["seen"] == 4
    assert stats["step"] == 0 and stats["phase"] == "on_policy" and stats["trajectories"] == 4
    detail = await question_detail(client, q1)
    assert {(t["step"], t["policy_version"]) for t in detail["trajectories"]} == {(7, 3)}
    assert sorted(t["entropy"] for t in detail["trajectories"]) == [0.2, 0.5, 0.9]

    # select: only eligible questions, each with its stored trajectories
    sel = ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 10, "seed": 1}))
    assert sel["num_eligible"] == 2 and sel["run"] == "r1"
    items = {i["question_id"]: i for i in sel["replay"]}
    assert set(items) == {q1, q2}
    assert items[q1]["bucket"] == 3 and items[q2]["bucket"] == 1
    assert all(i["num_samples"] == K - 1 for i in sel["replay"])
    assert {payload_of(c) for c in items[q1]["candidates"]} == {
        payload_of(x) for x in with_entropy["rollouts"] if x["reward"] == 1.0
    }
    lowest = ok(
        await client.post(
            "/v1/pools/p1/runs/r1/select", json={"n": 10, "seed": 1, "candidates": "lowest_stored_entropy"}
        )
    )
    best = {i["question_id"]: i["candidates"] for i in lowest["replay"]}
    assert [c["entropy"] for c in best[q1]] == [0.2] and len(best[q2]) == 1
    none = ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 10, "candidates": "none"}))
    assert {i["question_id"] for i in none["replay"]} == {q1, q2}
    assert all(i["candidates"] == [] for i in none["replay"])
    # selecting does not change anything
    assert await run_stats(client) == stats


async def test_select_is_seeded_and_bounded(client: httpx.AsyncClient) -> None:
    await setup_pool(client, questions=16, phase="mixed")
    ids = await _first_ids(client, 12)
    groups = [group(q, [1.0 if row <= i % 3 else 0.0 for row in range(K)]) for i, q in enumerate(ids)]
    ok(await client.post("/v1/pools/p1/runs/r1/ingest", json={"groups": groups}))

    async def pick(seed: int, n: int = 5) -> list[int]:
        sel = ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": n, "seed": seed}))
        return [i["question_id"] for i in sel["replay"]]

    first = await pick(11)
    assert len(first) == len(set(first)) == 5 and set(first) <= set(ids)
    assert await pick(11) == first
    assert len({tuple(await pick(s)) for s in range(8)}) > 1
    assert sorted(await pick(3, n=100)) == sorted(ids)


# ----------------------------------------------------------------------------- export/import
async def _pool_view(client: httpx.AsyncClient, pool: str) -> dict[str, Any]:
    """Everything about a pool except database ids and timestamps, keyed by question content."""
    stats = await pool_stats(client, pool)
    for r in stats["runs"]:
        # batches are not exported (an imported run starts its next batch afresh)
        for key in ("ingest_per_minute", "replayed_last_step", "pool"):
            r.pop(key)
    questions = ok(await client.get(f"/v1/pools/{pool}/questions", params={"limit": 1000}))["data"]
    per_q = {}
    for q in questions:
        d = await question_detail(client, q["id"], pool, payload=True)
        per_q[q["ground_truth"]] = {
            "prompt": d["prompt"],
            "meta": (d["data_source"], d["external_id"], d["metadata"]),
            "trajectories": sorted(
                (
                    t["token_ids_b64"],
                    t["logprobs_b64"],
                    t["reward"],
                    t["entropy"],
                    t["step"],
                    t["policy_version"],
                    t["source_run"],
                )
                for t in d["trajectories"]
            ),
            "runs": sorted(json.dumps(s, sort_keys=True) for s in d["runs"]),
        }
    runs = ok(await client.get(f"/v1/pools/{pool}/runs"))["data"]
    run_view = {
        r["name"]: (
            r["seed"],
            r["phase"],
            r["switched_at_step"],
            r["step"],
            r["policy_version"],
            r["overrides"],
        )
        for r in runs
    }
    versions = {
        r["name"]: ok(await client.get(f"/v1/pools/{pool}/runs/{r['name']}/policy-versions"))["data"]
        for r in runs
    }
    for vs in versions.values():
        for v in vs:
            v.pop("created_at")
    return {
        "stats": {k: v for k, v in stats.items() if k != "pool"},
        "questions": per_q,
        "runs": run_view,
        "versions": versions,
    }


async def test_export_import_round_trip(client: httpx.AsyncClient) -> None:
    await setup_pool(client, runs=("r1", "r2"), questions=20, description="to be copied")
    ok(await client.patch("/v1/pools/p1/runs/r1", json={"phase": "mixed"}))
    await _train(client, 3, "r1")
    await _train(client, 2, "r2")
    ok(
        await client.post(
            "/v1/pools/p1/runs/r1/policy-versions", json={"version": 2, "uri": "file:///ckpt/2"}
        ),
        201,
    )
    original = await _pool_view(client, "p1")
    assert original["stats"]["num_trajectories"] > 0 and any(r["retired"] for r in original["stats"]["runs"])

    exported = await client.get("/v1/pools/p1/export")
    assert exported.status_code == 200 and exported.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(x) for x in exported.content.splitlines()]
    header = lines[0]
    assert header["type"] == "header" and header["kind"] == "exgrpo-pool-export"
    kinds = [x["type"] for x in lines]
    assert kinds.count("question") == header["num_questions"] == 20
    assert kinds.count("trajectory") == header["num_trajectories"] == original["stats"]["num_trajectories"]
    assert kinds.count("run") == header["num_runs"] == 2

    imported = ok(
        await client.post("/v1/pools/import", params={"name": "p1-copy"}, content=exported.content), 201
    )
    assert imported["pool"] == "p1-copy" and imported["questions"] == 20 and imported["runs"] == 2
    assert imported["trajectories"] == original["stats"]["num_trajectories"] and imported["duplicates"] == 0
    assert imported["states"] == kinds.count("state")
    copy = await _pool_view(client, "p1-copy")
    assert copy == original
    shown = ok(await client.get("/v1/pools/p1-copy"))
    assert (
        shown["description"] == "to be copied"
        and shown["config"] == ok(await client.get("/v1/pools/p1"))["config"]
    )

    # the copy is a working pool: its runs continue with replay from the imported experience
    plan = await plan_batch(client, "p1-copy", "r1")
    assert plan["step"] == 4 and plan["phase"] == "mixed"
    assert len(plan["replay"]) == min(original["stats"]["runs"][0]["eligible"], B // 2)
    # importing under a taken name is a conflict and changes nothing
    again = await client.post("/v1/pools/import", params={"name": "p1-copy"}, content=exported.content)
    assert again.status_code == 409 and "already exists" in again.json()["detail"]
    assert ok(await client.get("/v1/pools"))["count"] == 2


async def test_broken_import_changes_nothing(client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed")
    await _train(client, 2)
    exported = (await client.get("/v1/pools/p1/export")).content.splitlines()
    before = ok(await client.get("/v1/pools"))
    traj = next(i for i, x in enumerate(exported) if b'"trajectory"' in x)
    question = next(i for i, x in enumerate(exported) if b'"question"' in x)

    def replace(i: int, line: bytes) -> list[bytes]:
        return [*exported[:i], line, *exported[i + 1 :]]

    broken_cases = {
        "truncated json": replace(traj, exported[traj][:-10]),
        "bad base64": replace(traj, exported[traj].replace(b'"token_ids_b64":"', b'"token_ids_b64":"!!')),
        "unknown record": [*exported, b'{"type": "mystery"}'],
        "bad question": replace(question, b'{"type": "question", "id": 1, "prompt": "nope"}'),
        "no header": exported[1:],
        "empty": [],
    }
    for name, lines in broken_cases.items():
        r = await client.post("/v1/pools/import", params={"name": "p1-broken"}, content=b"\n".join(lines))
        assert r.status_code == 422, (name, r.status_code, r.text[:300])
        assert r.headers["content-type"].startswith("application/problem+json") and r.json()["detail"]
        assert (await client.get("/v1/pools/p1-broken")).status_code == 404, name
        assert ok(await client.get("/v1/pools")) == before, name
    line_no = traj + 1
    r = await client.post(
        "/v1/pools/import", params={"name": "p1-broken"}, content=b"\n".join(broken_cases["truncated json"])
    )
    assert f"line {line_no}" in r.json()["detail"]


# ------------------------------------------------------------------------------------ index
def _redis_buckets(r: redis.Redis, prefix: str, scope: int) -> dict[int, int]:
    out = {}
    for key in r.scan_iter(match=f"{prefix}:idx:{scope}:b:*"):
        n = r.zcard(key)
        if n:
            out[int(key.decode().rsplit(":", 1)[1])] = n
    return out


async def test_index_is_rebuilt_from_the_database_on_start(
    backend: Backend, redis_direct: redis.Redis | None
) -> None:
    async with serve(backend.settings()) as c:
        await setup_pool(c, runs=("r1", "r2"), phase="mixed", questions=32)
        await _train(c, 3, "r1")
        await _train(c, 2, "r2")
        stats = {r: await run_stats(c, run=r) for r in ("r1", "r2")}
        run_ids = {r["name"]: r["id"] for r in ok(await c.get("/v1/pools/p1/runs"))["data"]}
    assert all(s["eligible"] > 0 for s in stats.values())

    if redis_direct is not None:
        # the index in Redis is lost (flushed, evicted, a new Redis)
        for key in redis_direct.scan_iter(match=f"{backend.redis_prefix}:idx:*"):
            redis_direct.delete(key)

    async with serve(backend.settings()) as c:
        for run in ("r1", "r2"):
            if redis_direct is not None:
                assert _redis_buckets(redis_direct, backend.redis_prefix, run_ids[run]) == _hist(stats[run])
            sel = ok(await c.post(f"/v1/pools/p1/runs/{run}/select", json={"n": 100, "seed": 1}))
            assert sel["num_eligible"] == stats[run]["eligible"] == len(sel["replay"])
            buckets: dict[int, int] = {}
            for i in sel["replay"]:
                buckets[i["bucket"]] = buckets.get(i["bucket"], 0) + 1
            assert buckets == _hist(stats[run])
            now = await run_stats(c, run=run)
            assert {**now, "ingest_per_minute": 0} == {**stats[run], "ingest_per_minute": 0}
        plan = await plan_batch(c, run="r1")
        assert plan["num_eligible"] == stats["r1"]["eligible"] and len(plan["replay"]) == B // 2


async def test_admin_index_rebuild(
    backend: Backend, client: httpx.AsyncClient, redis_direct: redis.Redis | None
) -> None:
    await setup_pool(client, runs=("r1", "r2"), phase="mixed", questions=32)
    await _train(client, 2, "r1")
    await _train(client, 2, "r2")
    eligible = {r: (await run_stats(client, run=r))["eligible"] for r in ("r1", "r2")}
    run_ids = {r["name"]: r["id"] for r in ok(await client.get("/v1/pools/p1/runs"))["data"]}

    if redis_direct is not None:
        # damage the index behind the service's back
        for key in redis_direct.scan_iter(match=f"{backend.redis_prefix}:idx:{run_ids['r1']}:b:*"):
            redis_direct.delete(key)
        sel = ok(await client.post("/v1/pools/p1/runs/r1/select", json={"n": 100}))
        assert sel["num_eligible"] == 0

    rebuilt = ok(await client.post("/v1/admin/index/rebuild"))
    assert rebuilt == {"indexed_questions": eligible["r1"] + eligible["r2"]}
    for run in ("r1", "r2"):
        sel = ok(await client.post(f"/v1/pools/p1/runs/{run}/select", json={"n": 100}))
        assert sel["num_eligible"] == eligible[run] == len(sel["replay"])
    per_pool = ok(await client.post("/v1/pools/p1/index/rebuild"))
    assert per_pool == {str(run_ids[r]): eligible[r] for r in ("r1", "r2")}
    metrics = (await client.get("/metrics")).text
    assert "exgrpo_index_rebuilds_total" in metrics


# ------------------------------------------------------------------------------ reproducible
async def test_same_seed_same_plans(client: httpx.AsyncClient) -> None:
    """Two runs with one seed on identical pools plan the same questions (fresh and replayed) in
    the same order; another seed plans differently."""
    for pool in ("p1", "p2"):
        await create_pool(client, pool)
        await import_questions(client, pool, 24)
        await create_run(client, pool, "r1", seed=1234, phase="mixed")
    await create_run(client, "p1", "other", seed=99, phase="mixed")

    async def trace(pool: str, run: str) -> list[tuple[Any, ...]]:
        plans = await _train(client, 5, run, pool)
        return [
            (
                tuple(f["ground_truth"] for f in p["fresh"]),
                tuple((r["ground_truth"], r["bucket"], len(r["candidates"])) for r in p["replay"]),
            )
            for p in plans
        ]

    a, b = await trace("p1", "r1"), await trace("p2", "r1")
    assert a == b
    assert sum(len(replay) for _, replay in a) > 0
    assert await trace("p1", "other") != a
    # the pools ended identical too
    sa, sb = await run_stats(client, "p1", "r1"), await run_stats(client, "p2", "r1")
    assert _hist(sa) == _hist(sb) and sa["retired"] == sb["retired"]
