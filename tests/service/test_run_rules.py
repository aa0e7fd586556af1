"""A run's own rules: ingest follows the run's phase like a commit (pre-filling is an explicit
flag), and a GRPO run (experience=false) is plain on-policy GRPO: no experience, no retirement."""

from __future__ import annotations

from typing import Any

import httpx

from .factories import B, K, commit_batch, group, make_groups, ok, plan_batch, run_stats, setup_pool


async def _qids(client: httpx.AsyncClient, n: int) -> list[int]:
    return [q["id"] for q in ok(await client.get("/v1/pools/p1/questions", params={"limit": n}))["data"]]


def _hist(stats: dict[str, Any]) -> dict[int, int]:
    return {b["bucket"]: b["questions"] for b in stats["buckets"]}


async def test_ingest_into_an_on_policy_run_collects_only_when_prefilling(client: httpx.AsyncClient) -> None:
    await setup_pool(client)  # r1 is on_policy
    q0, q1, q2 = await _qids(client, 3)
    body = {"groups": [group(q0, [1, 1, 0, 0]), group(q1, [1, 1, 1, 1])]}
    r = ok(await client.post("/v1/pools/p1/runs/r1/ingest", json=body))
    # like a commit of the on-policy phase: retirement yes (spec 3.3), collection no (spec 2)
    assert (r["collected_groups"], r["ignored_groups"], r["retired"], r["stored_trajectories"]) == (
        0,
        1,
        1,
        0,
    )
    stats = await run_stats(client)
    assert stats["eligible"] == 0 and stats["retired"] == 1 and stats["trajectories"] == 0

    # pre-filling the pool before the delayed start is an explicit flag
    pre = ok(await client.post("/v1/pools/p1/runs/r1/ingest", json={**body, "prefill": True}))
    assert (pre["collected_groups"], pre["stored_trajectories"]) == (1, 2)
    assert _hist(await run_stats(client)) == {2: 1}

    # a mixed run collects without it
    ok(await client.patch("/v1/pools/p1/runs/r1", json={"phase": "mixed"}))
    mixed = ok(await client.post("/v1/pools/p1/runs/r1/ingest", json={"groups": [group(q2, [1, 0, 0, 0])]}))
    assert mixed["collected_groups"] == 1
    assert _hist(await run_stats(client)) == {1: 1, 2: 1}


async def test_a_grpo_run_never_retires_and_keeps_every_question(client: httpx.AsyncClient) -> None:
    n = 2 * B
    await setup_pool(client, questions=n, runs=())
    ok(await client.post("/v1/pools/p1/runs", json={"name": "grpo", "overrides": {"experience": False}}), 201)
    seen: list[int] = []
    for _ in range(4):  # two epochs, every question solved every time
        plan = await plan_batch(client, run="grpo")
        assert plan["phase"] == "on_policy" and plan["replay"] == []
        seen += [f["question_id"] for f in plan["fresh"]]
        result = ok(await commit_batch(client, plan, make_groups(plan, lambda q, row: 1.0)))
        assert (
            result["retired"] == 0 and result["stored_trajectories"] == 0 and result["phase"] == "on_policy"
        )
    # the second epoch still holds all n questions
    assert sorted(seen[:n]) == sorted(seen[n:]) and len(set(seen)) == n
    stats = await run_stats(client, run="grpo")
    assert stats["retired"] == 0 and stats["eligible"] == 0 and stats["phase"] == "on_policy"
    # ingest keeps no experience either, and pre-filling a GRPO run is refused
    q = seen[0]
    r = ok(await client.post("/v1/pools/p1/runs/grpo/ingest", json={"groups": [group(q, [1] * K)]}))
    assert r["retired"] == 0 and r["collected_groups"] == 0
    refused = await client.post(
        "/v1/pools/p1/runs/grpo/ingest", json={"groups": [group(q, [1, 0, 0, 0])], "prefill": True}
    )
    assert refused.status_code == 422 and "experience" in refused.json()["detail"]


async def test_a_grpo_run_cannot_be_mixed(client: httpx.AsyncClient) -> None:
    await setup_pool(client, runs=())
    body = {"name": "g", "phase": "mixed", "overrides": {"experience": False}}
    created = await client.post("/v1/pools/p1/runs", json=body)
    assert created.status_code == 422 and "experience" in created.json()["detail"]
    ok(await client.post("/v1/pools/p1/runs", json={"name": "g", "overrides": {"experience": False}}), 201)
    to_mixed = await client.patch("/v1/pools/p1/runs/g", json={"phase": "mixed"})
    assert to_mixed.status_code == 422 and "on_policy" in to_mixed.json()["detail"]
    ok(await client.post("/v1/pools/p1/runs", json={"name": "m", "phase": "mixed"}), 201)
    no_exp = await client.patch("/v1/pools/p1/runs/m", json={"overrides": {"experience": False}})
    assert no_exp.status_code == 422
    assert ok(await client.get("/v1/pools/p1/runs/m"))["phase"] == "mixed"
