"""Run leases through the SDK: acquire, use (every write of the run carries the header), take-over
fencing, release, and deletes that honour a live lease; `AsyncClient` and `Client` against a live
server."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from exgrpo_client import AsyncClient, Client, Conflict, GroupResult, rollout
from exgrpo_client import schemas as s

K = 2
QUESTIONS = [
    {"prompt": [{"role": "user", "content": f"{i} + 1 = ?"}], "ground_truth": str(i + 1)} for i in range(8)
]


def _groups(plan: s.BatchPlan) -> list[GroupResult]:
    out = []
    for item in [*plan.fresh, *plan.replay]:
        rows = [rollout(0.0, np.array([item.question_id, j]), [-0.5, -0.5]) for j in range(K)]
        out.append(GroupResult(question_id=item.question_id, rollouts=rows))
    return out


async def test_async_lease_use_takeover_and_release(live_server: Any, pool_name: str) -> None:
    p = pool_name
    async with AsyncClient(live_server.url, retries=0) as a, AsyncClient(live_server.url, retries=0) as b:
        await a.create_pool(p, {"k": K, "batch_size": 4})
        await a.import_questions(p, QUESTIONS)
        await a.create_run(p, "r")
        lease = await a.acquire_run_lease(p, "r", "trainer-a", ttl_s=30)
        assert (lease.run, lease.holder, lease.generation, lease.pool) == ("r", "trainer-a", 1, p)
        a.use_run_lease(lease)

        plan = await a.plan_batch(p, "r")
        done = await a.commit_batch(p, plan.id, _groups(plan))
        assert done.step == 1
        await a.post_run_metrics(p, "r", 1, {"loss": 0.5})
        await a.add_policy_version(p, "r", 1, "file:///w/1", step=1)
        await a.update_run(p, "r", overrides={"batch_size": 4})

        # b has no lease: its writes are refused, with the holder named in the error
        with pytest.raises(Conflict, match="trainer-a") as refused:
            await b.plan_batch(p, "r")
        assert "takeover" in refused.value.detail
        with pytest.raises(Conflict, match="generation 1"):
            await b.acquire_run_lease(p, "r", "trainer-b")

        # b takes over; a's next writes are fenced out
        taken = await b.acquire_run_lease(p, "r", "trainer-b", takeover=True)
        assert taken.generation == 2
        b.use_run_lease(taken)
        plan2 = await b.plan_batch(p, "r")
        with pytest.raises(Conflict, match="fenced out"):
            await a.commit_batch(p, plan2.id, _groups(plan2))
        with pytest.raises(Conflict):
            await a.post_run_metrics(p, "r", 2, {"loss": 0.1})
        assert (await b.commit_batch(p, plan2.id, _groups(plan2))).step == 2

        # a releasing a lease it lost is refused; b releases and stops sending the header
        with pytest.raises(Conflict, match="does not hold"):
            await a.release_run_lease(p, "r", "trainer-a")
        await b.release_run_lease(p, "r", "trainer-b")
        assert (await b.plan_batch(p, "r")).step == 3
        a.use_run_lease(None)
        assert (await a.plan_batch(p, "r")).step == 3


def test_sync_client_leases(live_server: Any, pool_name: str) -> None:
    with Client(live_server.url) as a, Client(live_server.url) as b:
        a.create_pool(pool_name, {"k": K, "batch_size": 4})
        a.import_questions(pool_name, QUESTIONS)
        a.create_run(pool_name, "r")
        lease = a.acquire_run_lease(pool_name, "r", "a", ttl_s=30)
        renewed = a.acquire_run_lease(pool_name, "r", "a", ttl_s=30)
        assert renewed.generation == lease.generation == 1 and renewed.expires_at >= lease.expires_at
        a.use_run_lease(renewed)
        plan = a.plan_batch(pool_name, "r")
        with pytest.raises(Conflict, match="'a'"):
            b.commit_batch(pool_name, plan.id, _groups(plan))
        assert a.commit_batch(pool_name, plan.id, _groups(plan)).step == 1
        a.release_run_lease(pool_name, "r", "a")
        assert b.plan_batch(pool_name, "r").step == 2


async def test_async_deletes_honour_leases(live_server: Any, pool_name: str) -> None:
    async with AsyncClient(live_server.url, retries=0) as client:
        await client.create_pool(pool_name, {"k": K, "batch_size": 4})
        await client.create_run(pool_name, "r")
        await client.create_run(pool_name, "other")
        await client.acquire_run_lease(pool_name, "r", "t")
        with pytest.raises(Conflict, match="force=true"):
            await client.delete_run(pool_name, "r")
        with pytest.raises(Conflict, match="'t'"):
            await client.delete_pool(pool_name)
        await client.delete_run(pool_name, "r", force=True)
        assert [r.name for r in (await client.list_runs(pool_name)).data] == ["other"]
        await client.delete_pool(pool_name)
        assert pool_name not in {p.name for p in (await client.list_pools()).data}
