"""Pool lifecycle: deleting a run and a pool (admin), and the capacity limits of a pool with their
eviction rule."""

from __future__ import annotations

from typing import Any

import httpx

from exgrpo_client.schemas import unpack_ids

from .factories import group, ok, plan_batch, pool_stats, question_detail, run_stats, setup_pool
from .harness import WRITE_P1_TOKEN, Backend, serve


async def _qids(client: httpx.AsyncClient, pool: str = "p1", n: int = 100) -> list[int]:
    return [q["id"] for q in ok(await client.get(f"/v1/pools/{pool}/questions", params={"limit": n}))["data"]]


async def _ingest(client: httpx.AsyncClient, run: str, groups: list[dict[str, Any]], pool: str = "p1") -> Any:
    return ok(await client.post(f"/v1/pools/{pool}/runs/{run}/ingest", json={"groups": groups}))


async def _select(client: httpx.AsyncClient, run: str, pool: str = "p1") -> set[int]:
    sel = ok(await client.post(f"/v1/pools/{pool}/runs/{run}/select", json={"n": 100, "seed": 1}))
    return {i["question_id"] for i in sel["replay"]}


async def test_delete_a_run(backend: Backend, client: httpx.AsyncClient) -> None:
    await setup_pool(client, runs=("r1", "r2"), phase="mixed")
    q = await _qids(client)
    await _ingest(client, "r1", [group(x, [1, 0, 0, 0], lambda qid, row: [qid, 1, row]) for x in q[:4]])
    await _ingest(client, "r2", [group(x, [1, 1, 0, 0], lambda qid, row: [qid, 2, row]) for x in q[2:5]])
    await plan_batch(client, run="r1", create_tasks=True)
    ok(await client.post("/v1/pools/p1/runs/r1/metrics", json={"step": 1, "metrics": {"loss": 1.0}}))
    ok(await client.put("/v1/pools/p1/runs/r1/lease", json={"holder": "trainer"}))
    assert (await pool_stats(client))["num_trajectories"] == 4 + 6

    # a writer of the pool may not delete runs; a live lease needs force
    async with serve(backend.settings(), WRITE_P1_TOKEN) as writer:
        assert (await writer.delete("/v1/pools/p1/runs/r1")).status_code == 403
    held = await client.delete("/v1/pools/p1/runs/r1")
    assert held.status_code == 409 and "trainer" in held.json()["detail"] and "force" in held.json()["detail"]
    assert (await client.delete("/v1/pools/p1/runs/r1", params={"force": True})).status_code == 204

    assert (await client.get("/v1/pools/p1/runs/r1")).status_code == 404
    assert (await client.get("/v1/pools/p1/runs/r1/metrics")).status_code == 404
    # r1's own trajectories (sharing per_run) and states are gone; r2 is untouched
    assert (await pool_stats(client))["num_trajectories"] == 6
    assert {s["run"] for s in (await question_detail(client, q[2]))["runs"]} == {"r2"}
    assert await _select(client, "r2") == set(q[2:5])
    # a new run of the same name starts empty
    ok(await client.post("/v1/pools/p1/runs", json={"name": "r1", "phase": "mixed"}), 201)
    assert await _select(client, "r1") == set()
    assert (await run_stats(client, run="r1"))["seen"] == 0
    assert (await client.delete("/v1/pools/p1/runs/nope")).status_code == 404


async def test_deleting_a_run_of_a_pooled_pool_keeps_the_pools_experience(client: httpx.AsyncClient) -> None:
    await setup_pool(client, runs=("r1", "r2"), phase="mixed", sharing="pooled")
    q = await _qids(client)
    await _ingest(client, "r1", [group(x, [1, 0, 0, 0]) for x in q[:3]])
    assert (await client.delete("/v1/pools/p1/runs/r1")).status_code == 204
    assert (await pool_stats(client))["num_trajectories"] == 3
    assert await _select(client, "r2") == set(q[:3])
    detail = await question_detail(client, q[0])
    assert [t["source_run"] for t in detail["trajectories"]] == [None]


async def test_delete_a_pool(backend: Backend, client: httpx.AsyncClient) -> None:
    for name in ("p1", "p2"):
        await setup_pool(client, name, runs=("r1",), phase="mixed", sharing="pooled")
        await _ingest(client, "r1", [group(x, [1, 0, 0, 0]) for x in (await _qids(client, name))[:3]], name)
    ok(await client.put("/v1/pools/p1/runs/r1/lease", json={"holder": "trainer"}))
    async with serve(backend.settings(), WRITE_P1_TOKEN) as writer:
        assert (await writer.delete("/v1/pools/p1")).status_code == 403
    held = await client.delete("/v1/pools/p1")
    assert held.status_code == 409 and "trainer" in held.json()["detail"]
    assert (await client.delete("/v1/pools/p1", params={"force": True})).status_code == 204
    assert (await client.get("/v1/pools/p1")).status_code == 404
    assert [p["name"] for p in ok(await client.get("/v1/pools"))["data"]] == ["p2"]
    assert await _select(client, "r1", "p2") == set((await _qids(client, "p2"))[:3])
    # the name is free again, and the new pool starts empty (also in the sampling index)
    await setup_pool(client, "p1", runs=("r1",), phase="mixed", sharing="pooled")
    assert await _select(client, "r1") == set()
    stats = await pool_stats(client)
    assert stats["num_trajectories"] == 0 and stats["runs"][0]["eligible"] == 0
    assert (await client.delete("/v1/pools/nope")).status_code == 404


async def test_max_trajectories_per_question_keeps_the_newest(client: httpx.AsyncClient) -> None:
    await setup_pool(client, phase="mixed", max_trajectories_per_question=2)
    q = (await _qids(client))[0]
    first = await _ingest(client, "r1", [group(q, [1, 1, 1, 0], lambda qid, row: [qid, 10 + row])])
    assert first["stored_trajectories"] == 3 and first["removed_trajectories"] == 1
    second = await _ingest(client, "r1", [group(q, [1, 0, 0, 0], lambda qid, row: [qid, 20 + row])])
    assert second["removed_trajectories"] == 1
    kept = (await question_detail(client, q, payload=True))["trajectories"]
    assert sorted(unpack_ids(t["token_ids_b64"])[1] for t in kept) == [12, 20]
    ok(await client.patch("/v1/pools/p1", json={"config": {"max_trajectories_per_question": None}}))
    third = await _ingest(client, "r1", [group(q, [1, 0, 0, 0], lambda qid, row: [qid, 30 + row])])
    assert third["removed_trajectories"] == 0


async def test_max_payload_bytes_evicts_the_oldest(client: httpx.AsyncClient) -> None:
    # 32 tokens = 256 bytes of token ids and log-probs: 1024 bytes hold 4 trajectories
    await setup_pool(client, phase="mixed", max_payload_bytes=1024)
    q = await _qids(client)

    def tokens(qid: int, row: int) -> list[int]:
        return [qid, row] + [7] * 30

    await _ingest(client, "r1", [group(x, [1, 0, 0, 0], tokens) for x in q[:3]])
    r = await _ingest(client, "r1", [group(q[3], [1, 1, 0, 0], tokens)])
    # 5 trajectories do not fit: the oldest (q0's) goes, and q0 has none left, so it is not eligible
    assert r["removed_trajectories"] == 1
    stats = await pool_stats(client)
    assert stats["num_trajectories"] == 4 and stats["num_tokens"] * 8 <= 1024
    assert (await question_detail(client, q[0]))["trajectories"] == []
    assert await _select(client, "r1") == set(q[1:4])
    assert (await run_stats(client))["eligible"] == 3
    plan = await plan_batch(client)
    assert {i["question_id"] for i in plan["replay"]} <= set(q[1:4])
    # a single write larger than the pool's capacity is refused, and changes nothing
    big = await client.post(
        "/v1/pools/p1/runs/r1/ingest",
        json={"groups": [group(x, [1, 1, 1, 0], tokens) for x in q[5:7]]},
    )
    assert big.status_code == 422 and "max_payload_bytes" in big.json()["detail"]
    assert (await pool_stats(client))["num_trajectories"] == 4
