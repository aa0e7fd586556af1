"""Pools are isolated from each other in every sharing mode, and inside a pool each mode shares
exactly what it says:

* ``per_run``: each run has its own buckets, retirement and trajectories (de-duplicated per run);
* ``pooled``: the runs of the pool share buckets, retirement and trajectories;
* ``shared_trajectories``: buckets and retirement per run, trajectories shared by the pool's runs.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from .factories import group, make_groups, ok, plan_batch, pool_stats, question_detail, run_stats, setup_pool

MODES = ("per_run", "pooled", "shared_trajectories")


async def _ingest(
    client: httpx.AsyncClient, pool: str, run: str, groups: list[dict[str, Any]]
) -> dict[str, Any]:
    return ok(await client.post(f"/v1/pools/{pool}/runs/{run}/ingest", json={"groups": groups}))


async def _select(client: httpx.AsyncClient, pool: str, run: str) -> dict[int, dict[str, Any]]:
    sel = ok(await client.post(f"/v1/pools/{pool}/runs/{run}/select", json={"n": 100, "seed": 1}))
    return {i["question_id"]: i for i in sel["replay"]}


async def _qids(client: httpx.AsyncClient, pool: str) -> list[int]:
    return [
        q["id"] for q in ok(await client.get(f"/v1/pools/{pool}/questions", params={"limit": 100}))["data"]
    ]


def _hist(stats: dict[str, Any]) -> dict[int, int]:
    return {b["bucket"]: b["questions"] for b in stats["buckets"]}


def _tokens(run: int) -> Any:
    return lambda qid, row: [qid, 100 * run + row]


async def test_two_pools_of_each_mode_side_by_side_do_not_leak(client: httpx.AsyncClient) -> None:
    """Pools A and B of the same mode, both with a run `r` (same name, same seed, same questions):
    whatever happens in A leaves B as it was, for every mode."""
    for mode in MODES:
        a, b = f"a-{mode.replace('_', '-')}", f"b-{mode.replace('_', '-')}"
        for name in (a, b):
            await setup_pool(client, name, runs=("r",), phase="mixed", sharing=mode, questions=16)
        qa, qb = await _qids(client, a), await _qids(client, b)
        assert not set(qa) & set(qb)
        # A collects 3 questions and retires one
        await _ingest(client, a, "r", [group(q, [1, 1, 0, 0]) for q in qa[:3]])
        await _ingest(client, a, "r", [group(qa[3], [1, 1, 1, 1])])

        sa, sb = await run_stats(client, a, "r"), await run_stats(client, b, "r")
        assert (sa["eligible"], sa["retired"], _hist(sa)) == (3, 1, {2: 3}), mode
        assert (sb["eligible"], sb["retired"], sb["seen"], _hist(sb)) == (0, 0, 0, {}), mode
        assert (await pool_stats(client, b))["num_trajectories"] == 0, mode
        assert (await pool_stats(client, a))["num_trajectories"] == 6, mode
        assert set(await _select(client, a, "r")) == set(qa[:3]), mode
        assert await _select(client, b, "r") == {}, mode
        plan_b = await plan_batch(client, b, "r")
        assert plan_b["replay"] == [] and plan_b["num_eligible"] == 0, mode
        assert {f["question_id"] for f in plan_b["fresh"]} <= set(qb), mode
        # B collects its own: A's state does not move
        await _ingest(client, b, "r", [group(q, [1, 0, 0, 0]) for q in qb[:5]])
        sa2 = await run_stats(client, a, "r")
        assert (sa2["eligible"], sa2["retired"], _hist(sa2)) == (3, 1, {2: 3}), mode
        plan_a = await plan_batch(client, a, "r")
        assert {i["question_id"] for i in plan_a["replay"]} <= set(qa[:3]), mode
        for item in plan_a["replay"]:
            assert {c["question_id"] for c in item["candidates"]} == {item["question_id"]}


@pytest.mark.parametrize("mode", MODES)
async def test_what_each_mode_shares_between_the_runs_of_a_pool(client: httpx.AsyncClient, mode: str) -> None:
    await setup_pool(client, runs=("r1", "r2"), phase="mixed", sharing=mode)
    q, q2, q3 = (await _qids(client, "p1"))[:3]
    await _ingest(
        client, "p1", "r1", [group(q, [1, 1, 0, 0], _tokens(1)), group(q2, [1, 0, 0, 0], _tokens(1))]
    )

    # buckets: shared only by pooled
    r2_sees = set(await _select(client, "p1", "r2"))
    assert r2_sees == ({q, q2} if mode == "pooled" else set())

    # r2 collects q itself, with one rollout identical to r1's and one of its own
    same_and_own = [[q, 100], [q, 201], [q, 7], [q, 8]]
    r = await _ingest(client, "p1", "r2", [group(q, [1, 1, 0, 0], lambda qid, row: same_and_own[row])])
    shares_trajectories = mode != "per_run"
    # de-duplication follows the trajectory scope: the copy of r1's rollout is r2's own in per_run
    assert (r["stored_trajectories"], r["duplicate_trajectories"]) == (
        (1, 1) if shares_trajectories else (2, 0)
    )

    cands = {tuple(c["source_run"] for c in (await _select(client, "p1", "r2"))[q]["candidates"])}
    sources = sorted(next(iter(cands)))
    assert sources == (["r1", "r1", "r2"] if shares_trajectories else ["r2", "r2"])
    r1_sources = sorted(c["source_run"] for c in (await _select(client, "p1", "r1"))[q]["candidates"])
    assert r1_sources == (["r1", "r1", "r2"] if shares_trajectories else ["r1", "r1"])

    # retirement by r1: shared only by pooled; a retired question's trajectories are removed from
    # the scope that owns them (the spec never replays them), except where other runs still replay
    # them (shared_trajectories)
    retired = await _ingest(client, "p1", "r1", [group(q, [1, 1, 1, 1], _tokens(1))])
    assert retired["removed_trajectories"] == {"per_run": 2, "pooled": 3, "shared_trajectories": 0}[mode]
    s1, s2 = await run_stats(client, "p1", "r1"), await run_stats(client, "p1", "r2")
    assert s1["retired"] == 1
    assert s2["retired"] == (1 if mode == "pooled" else 0)
    r2_sel = await _select(client, "p1", "r2")
    detail_sources = sorted(t["source_run"] for t in (await question_detail(client, q))["trajectories"])
    if mode == "pooled":
        assert q not in r2_sel and detail_sources == []
    elif mode == "per_run":
        assert sorted(c["source_run"] for c in r2_sel[q]["candidates"]) == ["r2", "r2"]
        assert detail_sources == ["r2", "r2"]
    else:
        assert sorted(c["source_run"] for c in r2_sel[q]["candidates"]) == ["r1", "r1", "r2"]
        assert detail_sources == ["r1", "r1", "r2"]
    assert q not in await _select(client, "p1", "r1")

    # a plan of r2 replays only questions of its own view, with candidates of its trajectory scope
    await _ingest(client, "p1", "r2", [group(q3, [1, 0, 0, 0], _tokens(2))])
    plan = await plan_batch(client, "p1", "r2")
    for item in plan["replay"]:
        sources = {c["source_run"] for c in item["candidates"]}
        assert sources <= ({"r1", "r2"} if shares_trajectories else {"r2"})
    ok(
        await client.post(
            f"/v1/pools/p1/batches/{plan['id']}/commit", json=make_groups(plan, lambda q, row: 0.0)
        )
    )


@pytest.mark.parametrize("mode", MODES)
async def test_export_and_import_keep_each_modes_scopes(client: httpx.AsyncClient, mode: str) -> None:
    await setup_pool(client, runs=("r1", "r2"), phase="mixed", sharing=mode)
    q = (await _qids(client, "p1"))[0]
    await _ingest(client, "p1", "r1", [group(q, [1, 1, 0, 0], _tokens(1))])
    await _ingest(client, "p1", "r2", [group(q, [1, 0, 0, 0], _tokens(2))])
    export = await client.get("/v1/pools/p1/export")
    imported = ok(await client.post("/v1/pools/import", params={"name": "copy"}, content=export.content), 201)
    assert imported["trajectories"] == 3
    for pool in ("p1", "copy"):  # the copy has new question ids: one question either way
        (item,) = (await _select(client, pool, "r2")).values()
        sources = sorted(c["source_run"] for c in item["candidates"])
        assert sources == (["r2"] if mode == "per_run" else ["r1", "r1", "r2"]), (pool, sources)
    # a shared trajectory that names a run scope in a pool without per-run trajectories is refused
    if mode != "per_run":
        lines = export.content.decode().splitlines()
        bad = [line.replace('"scope":0', '"scope":1') if '"trajectory"' in line else line for line in lines]
        r = await client.post("/v1/pools/import", params={"name": "bad"}, content="\n".join(bad).encode())
        assert r.status_code == 422 and "scope" in r.json()["detail"]
