"""Several runs on one pool: shared trajectories, per-run or pooled states, concurrent writers.
(What each sharing mode shares, and that pools never share anything: test_isolation.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import httpx
import pytest

from exgrpo_client.schemas import unpack_ids

from .factories import (
    B,
    K,
    Model,
    commit_batch,
    group,
    make_groups,
    ok,
    plan_batch,
    pool_stats,
    question_detail,
    run_stats,
    setup_pool,
)
from .harness import Backend, serve


async def _ingest(client: httpx.AsyncClient, run: str, groups: list[dict[str, Any]]) -> dict[str, Any]:
    return ok(await client.post(f"/v1/pools/p1/runs/{run}/ingest", json={"groups": groups}))


async def _select(client: httpx.AsyncClient, run: str, n: int = 100) -> dict[int, dict[str, Any]]:
    sel = ok(await client.post(f"/v1/pools/p1/runs/{run}/select", json={"n": n, "seed": 3}))
    return {i["question_id"]: i for i in sel["replay"]}


def _hist(stats: dict[str, Any]) -> dict[int, int]:
    return {b["bucket"]: b["questions"] for b in stats["buckets"]}


async def test_runs_share_trajectories_but_not_states(client: httpx.AsyncClient) -> None:
    await setup_pool(client, runs=("r1", "r2"), phase="mixed", sharing="shared_trajectories")
    qids = [q["id"] for q in ok(await client.get("/v1/pools/p1/questions", params={"limit": 3}))["data"]]
    q, q_other, q_both = qids

    def run_tokens(run: int) -> Any:
        return lambda qid, row: [qid, 100 * run + row]

    await _ingest(
        client, "r1", [group(q, [1, 1, 0, 0], run_tokens(1)), group(q_other, [1, 0, 0, 0], run_tokens(1))]
    )
    await _ingest(client, "r2", [group(q, [1, 0, 0, 0], run_tokens(2))])
    # both runs send one identical trajectory: stored once
    await _ingest(client, "r1", [group(q_both, [1, 0, 0, 0])])
    dup = await _ingest(client, "r2", [group(q_both, [1, 0, 0, 0])])
    assert dup["stored_trajectories"] == 0 and dup["duplicate_trajectories"] == 1

    detail = await question_detail(client, q)
    assert sorted(t["source_run"] for t in detail["trajectories"]) == ["r1", "r1", "r2"]
    states = {s["run"]: s for s in detail["runs"]}
    assert states["r1"]["bucket"] == 2 and states["r2"]["bucket"] == 1

    # r1 solves q completely: retired for r1 only
    r = await _ingest(client, "r1", [group(q, [1, 1, 1, 1], run_tokens(1))])
    assert r["retired"] == 1
    states = {s["run"]: s for s in (await question_detail(client, q))["runs"]}
    assert states["r1"]["retired"] is True and states["r1"]["bucket"] is None
    assert states["r2"]["retired"] is False and states["r2"]["bucket"] == 1

    r1_sel, r2_sel = await _select(client, "r1"), await _select(client, "r2")
    assert set(r1_sel) == {q_other, q_both} and set(r2_sel) == {q, q_both}
    # r2 replays q with every stored trajectory of it, whoever collected it
    assert sorted(c["source_run"] for c in r2_sel[q]["candidates"]) == ["r1", "r1", "r2"]
    s1, s2 = await run_stats(client, run="r1"), await run_stats(client, run="r2")
    assert (s1["retired"], s1["eligible"], _hist(s1)) == (1, 2, {1: 2})
    assert (s2["retired"], s2["eligible"], _hist(s2)) == (0, 2, {1: 2})
    assert (s1["trajectories"], s2["trajectories"]) == (4, 1)
    assert (await pool_stats(client))["num_trajectories"] == 5


async def test_two_runs_training_on_one_pool_follow_their_own_rules(client: httpx.AsyncClient) -> None:
    """Plan/commit loops of two runs (same seed, so they see the same questions) with different
    outcomes: the states of each run follow its own groups, the trajectories are pooled."""
    await setup_pool(client, runs=("r1", "r2"), phase="mixed", questions=16, sharing="shared_trajectories")
    model = Model(drop_retired=False)  # shared trajectories outlive a run's retirement
    for step in range(1, 5):
        outcomes = (("r1", lambda q, s=step: (q + s) % (K + 1)), ("r2", lambda q, s=step: (q * 3 + s) % K))
        for run, k_of in outcomes:
            plan = await plan_batch(client, run=run)
            sc = model.scope(run)
            assert len(plan["replay"]) == min(len(sc.eligible), B // 2)
            assert {i["question_id"] for i in plan["replay"]} <= sc.eligible
            replayed = {i["question_id"] for i in plan["replay"]}
            body = make_groups(
                plan,
                lambda q, row, k_of=k_of, replayed=replayed: (
                    1.0 if row < max(k_of(q), q in replayed) else 0.0
                ),
            )
            ok(await commit_batch(client, plan, body))
            model.apply(run, body, collect=True)
    for run in ("r1", "r2"):
        stats = await run_stats(client, run=run)
        sc = model.scope(run)
        assert _hist(stats) == sc.histogram()
        assert stats["retired"] == len(sc.retired) and stats["eligible"] == len(sc.eligible)
        assert set(await _select(client, run)) == sc.eligible
    assert model.scope("r1").retired - model.scope("r2").retired  # r2 never retires here
    assert (await pool_stats(client))["num_trajectories"] == len(model.trajectories)


async def test_pooled_sharing_shares_buckets_and_retirement(client: httpx.AsyncClient) -> None:
    await setup_pool(client, runs=("r1", "r2"), phase="mixed", sharing="pooled")
    qids = [q["id"] for q in ok(await client.get("/v1/pools/p1/questions", params={"limit": 2}))["data"]]
    q, q2 = qids
    await _ingest(client, "r1", [group(q, [1, 1, 0, 0]), group(q2, [1, 0, 0, 0])])
    # r2 sees what r1 collected and moves the shared bucket
    assert set(await _select(client, "r2")) == {q, q2}
    await _ingest(client, "r2", [group(q, [1, 1, 1, 0])])
    detail = await question_detail(client, q)
    assert detail["runs"] == [{"run": "*", "num_correct": 3, "bucket": 3, "retired": False, "last_step": 0}]
    # r2 retires q: retired for r1 as well
    await _ingest(client, "r2", [group(q, [1, 1, 1, 1])])
    assert set(await _select(client, "r1")) == set(await _select(client, "r2")) == {q2}
    s1, s2 = await run_stats(client, run="r1"), await run_stats(client, run="r2")
    assert _hist(s1) == _hist(s2) == {1: 1} and s1["retired"] == s2["retired"] == 1
    # the replay plan of r1 honours it too
    plan = await plan_batch(client, run="r1")
    assert [i["question_id"] for i in plan["replay"]] == [q2]


# ------------------------------------------------------------------------------ concurrency
async def _concurrent_training(clients: list[httpx.AsyncClient], steps: int = 4) -> None:
    """Two runs plan and commit concurrently, while extra producers ingest into both runs, all
    writers sending overlapping trajectories. Nothing may be lost or double counted."""
    a, b = clients[0], clients[-1]
    # shared trajectories: concurrent writers of two runs insert into one trajectory scope
    await setup_pool(a, runs=(), questions=48, sharing="shared_trajectories")
    for run, seed in (("r1", 1), ("r2", 2)):
        ok(await a.post("/v1/pools/p1/runs", json={"name": run, "seed": seed, "phase": "mixed"}), 201)
    all_q = [q["id"] for q in ok(await a.get("/v1/pools/p1/questions", params={"limit": 1000}))["data"]]
    model = Model(drop_retired=False)  # shared trajectories outlive a run's retirement
    run_client = {"r1": a, "r2": b}
    # the same (question, row) always yields the same tokens, whichever run or producer sends it,
    # so concurrent transactions insert the same trajectories
    for step in range(1, steps + 1):
        plans = await asyncio.gather(*(plan_batch(run_client[r], run=r) for r in ("r1", "r2")))
        calls = []
        for plan in plans:
            run = plan["run"]
            sc = model.scope(run)
            assert {i["question_id"] for i in plan["replay"]} <= sc.eligible
            assert len(plan["replay"]) == min(len(sc.eligible), B // 2)
            replayed = {i["question_id"] for i in plan["replay"]}
            body = make_groups(
                plan,
                lambda q, row, s=step, rep=replayed: 1.0 if row < max((q + s) % (K + 1), q in rep) else 0.0,
            )
            calls.append((run, body, commit_batch(run_client[run], plan, body)))
        # producers ingest into each run questions that its plan does not touch, three requests on
        # disjoint questions (so no final state depends on which concurrent request ran last)
        for i, plan in enumerate(plans):
            run = plan["run"]
            used = {g["question_id"] for g in calls[i][1]["groups"]}
            free = [q for q in all_q if q not in used]
            free = free[step * 5 % len(free) :] + free[: step * 5 % len(free)]
            for j in range(3):
                groups = [
                    group(q, [1.0 if row < (q + j) % K + 1 else 0.0 for row in range(K)])
                    for q in free[2 * j : 2 * j + 2]
                ]
                body = {"groups": groups}
                cli = clients[(i + j) % len(clients)]
                calls.append((run, body, cli.post(f"/v1/pools/p1/runs/{run}/ingest", json=body)))
        responses = await asyncio.gather(*(c for _, _, c in calls))
        for (run, body, _), resp in zip(calls, responses, strict=True):
            ok(resp)
            model.apply(run, body, collect=True)

    for cli in clients:
        assert (await pool_stats(cli))["num_trajectories"] == len(model.trajectories)
        for run in ("r1", "r2"):
            stats = await run_stats(cli, run=run)
            sc = model.scope(run)
            assert stats["step"] == steps
            assert _hist(stats) == sc.histogram(), run
            assert stats["retired"] == len(sc.retired)
            # the sampling index agrees with the database
            sel = ok(await cli.post(f"/v1/pools/p1/runs/{run}/select", json={"n": 200, "seed": 1}))
            assert sel["num_eligible"] == stats["eligible"] == len(sc.eligible)
            assert {i["question_id"] for i in sel["replay"]} == sc.eligible
    # per question: stored trajectories are exactly the distinct correct ones sent
    sent: dict[int, set[tuple[int, ...]]] = {}
    for qid, ids in model.trajectories:
        sent.setdefault(qid, set()).add(ids)
    for qid in itertools.islice(sorted(sent), 6):
        detail = await question_detail(a, qid, payload=True)
        assert {tuple(unpack_ids(t["token_ids_b64"])) for t in detail["trajectories"]} == sent[qid]


async def test_concurrent_runs_lose_no_update(client: httpx.AsyncClient) -> None:
    await _concurrent_training([client])


@pytest.mark.parametrize(
    "backend",
    [pytest.param("postgres-redis", marks=[pytest.mark.postgres, pytest.mark.redis])],
    indirect=True,
)
async def test_concurrent_runs_on_two_api_replicas(backend: Backend) -> None:
    """Two app instances on one database and one Redis prefix, as two replicas behind a balancer."""
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(serve(backend.settings())) for _ in range(2)]
        await _concurrent_training(clients)


async def test_concurrent_writers_of_a_pooled_pool(backend: Backend) -> None:
    """Runs of a pooled pool write the same state rows; concurrent requests that touch the same
    questions in opposite orders must all succeed (no deadlock) and leave one consistent state."""
    runs = ("r1", "r2", "r3", "r4")
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(serve(backend.settings())) for _ in range(2)]
        if not backend.uses_redis:
            clients = clients[:1]  # the in-process index serves one process only
        a = clients[0]
        await setup_pool(a, runs=runs, phase="mixed", sharing="pooled", questions=60)
        qs = [q["id"] for q in ok(await a.get("/v1/pools/p1/questions", params={"limit": 100}))["data"]]
        sent: set[tuple[int, tuple[int, ...]]] = set()
        for rnd in range(8 if backend.uses_redis else 3):
            calls = []
            for i, run in enumerate(runs):
                order = qs if i % 2 == 0 else qs[::-1]
                groups = [
                    group(q, [1, 1 if (q + rnd + i) % 2 else 0, 0, 0], lambda q, row, r=rnd: [q, row, r])
                    for q in order
                ]
                sent |= {
                    (q, (q, row, rnd)) for q in order for row in range(2) if row == 0 or (q + rnd + i) % 2
                }
                cli = clients[i % len(clients)]
                calls.append(cli.post(f"/v1/pools/p1/runs/{run}/ingest", json={"groups": groups}))
            for r in await asyncio.gather(*calls):
                ok(r)
        assert (await pool_stats(a))["num_trajectories"] == len(sent)
        stats = [await run_stats(a, run=r) for r in runs]
        assert all(_hist(s) == _hist(stats[0]) for s in stats)
        assert sum(_hist(stats[0]).values()) == len(qs) and set(_hist(stats[0])) <= {1, 2}
        # the sampling index holds each question in the bucket the database has
        buckets = {q: (await question_detail(a, q))["runs"][0]["bucket"] for q in qs}
        for cli in clients:
            sel = ok(await cli.post("/v1/pools/p1/runs/r3/select", json={"n": 100, "seed": 1}))
            assert sel["num_eligible"] == len(qs) == len(sel["replay"])
            assert {i["question_id"]: i["bucket"] for i in sel["replay"]} == buckets
